"""What the health and metrics polls do not say about a node: the slots of a llama.cpp
server, and one line for a node whose kind cannot be told.

**llama.cpp slots.** ``GET /props`` of llama.cpp's ``llama-server`` answers from its HTTP
thread, without the model or the task queue (``get_res_props`` in
``tools/server/server-context.cpp``), with ``total_slots`` (its ``--parallel``: requests
it decodes at once; more wait in its queue as ``requests_deferred``),
``endpoint_metrics`` (started with ``--metrics``) and ``build_info``. The slots are a hard
limit: the routing snapshot gives such a node ``max_concurrency`` = the smaller of the
configured value and ``total_slots`` (:meth:`PropsPoller.effective`), so requests beyond
its slots wait at the edge. ``/props`` is read when a node is first seen, then every
``controlplane.models_refresh_s``, and at once when the node turns healthy again or its
metrics' counters began again between two polls (a restart may change ``--parallel``),
like ``/v1/models`` (:mod:`controlplane.routing.models`),
on a small pool of its own; the poll cycle never waits for it. An answer that is not a
JSON object with an integer ``total_slots`` >= 1 means "not llama.cpp" (vLLM, TGI and
SGLang answer 404); a failed read is tried again after ``RETRY_S``.

**Kind hints** (:meth:`PropsPoller.hint`), appended to the node's ``last_error`` (shown by
``infergate nodes list`` and the admin node page) while its metrics are unknown:

- a llama.cpp server started without ``--metrics``: start it with ``--metrics``;
- a node that answers HTTP but neither its health and metrics paths nor ``/props`` say
  what it is: what was tried, and to set its ``kind`` (``openai`` for any other
  OpenAI-compatible server), ``health_path`` or ``metrics_path``.

Every hint starts with :data:`HINT_PREFIX`.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from controlplane.config import NodeSettings
from controlplane.routing.background import BackgroundReader
from controlplane.routing.nodeaccess import AccessTable
from controlplane.routing.poller import NodeStatus

__all__ = ["HINT_PREFIX", "PROPS_PATH", "Props", "PropsPoller", "RETRY_S", "hint_of",
           "parse_props"]

PROPS_PATH = "/props"
#: Seconds before a ``/props`` read that got no answer is tried again.
RETRY_S = 10.0
#: Start of every kind hint in a node's ``last_error``.
HINT_PREFIX = "kind: "
#: Poll errors that say the metrics path is not there or not in a known dialect (a
#: timeout or a refused connection says nothing about the kind).
_NO_KIND = re.compile(r"metrics: (HTTP (404|405|501)\b|no .*metric names)")


@dataclass(frozen=True)
class Props:
    """What a llama.cpp ``/props`` answer says. ``total_slots``: ``--parallel``;
    ``metrics``: ``/metrics`` is on (``None``: not said); ``ctx_tokens``: the context
    of one slot, tokens (``default_generation_settings.n_ctx``: ``--ctx-size`` /
    ``--parallel``; llama.cpp b4000 and later; ``None``: not said)."""

    total_slots: int
    metrics: bool | None = None
    build_info: str | None = None
    ctx_tokens: int | None = None


def parse_props(body: str) -> Props:
    """Read a llama.cpp ``GET /props`` answer. Raises ``ValueError`` when ``body`` is not
    a JSON object with an integer ``total_slots`` >= 1 (not a llama.cpp server)."""
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    slots = doc.get("total_slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError("no integer total_slots")
    metrics = doc.get("endpoint_metrics")
    build = doc.get("build_info")
    gen = doc.get("default_generation_settings")
    ctx = gen.get("n_ctx") if isinstance(gen, dict) else None
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        ctx = None
    return Props(total_slots=slots, metrics=metrics if isinstance(metrics, bool) else None,
                 build_info=build if isinstance(build, str) else None, ctx_tokens=ctx)


def hint_of(last_error: str | None) -> str | None:
    """The kind hint in a node's ``last_error`` (from :data:`HINT_PREFIX` to the end),
    ``None`` when it holds none."""
    if not last_error:
        return None
    i = last_error.find(HINT_PREFIX)
    return last_error[i:] if i >= 0 else None


@dataclass
class _Entry:
    target: str
    due: float = 0.0
    """monotonic time of the next read."""
    props: Props | None = None
    answered: str | None = None
    """What the last finished read got when it was not llama.cpp (``HTTP 404``, ...);
    ``None`` before the first finished read or when it was."""
    running: Future | None = field(default=None, repr=False)


class PropsPoller(BackgroundReader):
    """``/props`` of every node, read in the background (see the module docstring);
    thread-safe, :meth:`observe` never blocks on a node."""

    def __init__(self, refresh_s: float, timeout_s: float, max_workers: int = 2,
                 clock=time.monotonic, access: AccessTable | None = None):
        super().__init__("props", refresh_s, timeout_s, max_workers, clock, access)

    def _read(self, url: str) -> tuple[Props | None, str, bool]:
        """``(props, what was answered, whether to retry soon)``."""
        res = self._http.get(url)
        if res.status is None:
            return None, res.error or "no answer", True
        if res.status >= 500:
            # llama-server answers 503 {"error": {"message": "Loading model"}} while it
            # loads its model after a restart: the server cannot say yet, and its slots
            # are kept until it can (as for no answer at all)
            return None, f"HTTP {res.status}", True
        if not res.ok or res.body is None:
            return None, f"HTTP {res.status}", False
        try:
            return parse_props(res.body), "llama.cpp", False
        except ValueError as exc:
            return None, f"HTTP {res.status}, not llama.cpp ({str(exc)[:80]})", False

    def _settle(self, e: _Entry, now: float) -> None:
        try:
            props, answered, soon = e.running.result()  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a read never breaks the cycle
            props, answered, soon = None, f"{type(exc).__name__}: {exc}", True
        e.running = None
        if props is None and soon and e.props is not None:
            # no answer at all (a frozen or restarting server): its slots are what they
            # were; forgetting them would let the whole backlog at the edge onto the
            # server the moment it answers again
            e.due = now + min(RETRY_S, self.refresh_s)
            return
        e.props = props
        e.answered = None if props is not None else answered
        e.due = now + (min(RETRY_S, self.refresh_s) if soon else self.refresh_s)

    def _entry(self, name: str, url: str) -> _Entry:
        """The node's entry, made anew when its ``/props`` URL changed (under the lock)."""
        e = self._entries.get(name)
        if e is None or e.target != url:
            e = self._entries[name] = _Entry(target=url)
        return e

    def observe(self, node: NodeSettings) -> Props | None:
        """The node's last known :class:`Props` (``None``: not llama.cpp, or not known
        yet). Starts a background read when one is due (its result shows from a later
        call)."""
        url = node.url + PROPS_PATH
        now = self._clock()
        with self._lock:
            e = self._entry(node.name, url)
            if e.running is not None and e.running.done():
                self._settle(e, now)
            if e.running is None and now >= e.due:
                e.running = self._pool.submit(self._read, url)
            return e.props

    def reread(self, node: NodeSettings, wait_s: float) -> None:
        """Read the node's ``/props`` now and wait up to ``wait_s`` for the answer (a
        read under way is waited for instead): a server seen restarted, whose new slots
        (llama-server restarted with a smaller ``--parallel``) then reach the snapshot
        written in this cycle, not two cycles later while the edges fill the old count.
        A read that takes longer settles at a later look."""
        url = node.url + PROPS_PATH
        with self._lock:
            e = self._entry(node.name, url)
            if e.running is None:
                e.running = self._pool.submit(self._read, url)
            fut = e.running
        try:
            fut.result(timeout=wait_s)
        except Exception:  # noqa: BLE001 - not yet, or failed: _settle reads it later
            pass
        with self._lock:
            if e.running is fut and fut.done():
                self._settle(e, self._clock())

    def seed(self, node: NodeSettings, total_slots: int, ctx_tokens: int | None = None) -> None:
        """Known slots of a node whose ``/props`` this poller has not read yet (a control
        plane that just started or took the lead: the routing snapshot it takes over
        says them): kept until a read says otherwise, so that the first snapshot it
        writes does not drop the limit while its first read is under way (the edges
        would send the whole backlog to a one-slot server). No effect once a read
        finished."""
        url = node.url + PROPS_PATH
        with self._lock:
            e = self._entry(node.name, url)
            if e.props is None and e.answered is None:
                e.props = Props(total_slots=total_slots, ctx_tokens=ctx_tokens)

    def effective(self, nodes: list[NodeSettings]) -> list[NodeSettings]:
        """``nodes`` with ``max_concurrency`` lowered to the slots of the llama.cpp
        servers among them (the others unchanged)."""
        out = []
        with self._lock:
            for n in nodes:
                e = self._entries.get(n.name)
                slots = e.props.total_slots if e is not None and e.props is not None else None
                if slots is not None and slots < n.max_concurrency:
                    n = n.model_copy(update={"max_concurrency": slots})
                out.append(n)
        return out

    def slots(self, nodes: list[NodeSettings]) -> dict[str, int]:
        """``total_slots`` per llama.cpp server among ``nodes`` (name -> slots; the
        others absent)."""
        out: dict[str, int] = {}
        with self._lock:
            for n in nodes:
                e = self._entries.get(n.name)
                if e is not None and e.props is not None:
                    out[n.name] = e.props.total_slots
        return out

    def contexts(self, nodes: list[NodeSettings]) -> dict[str, int]:
        """The context of one slot (tokens) per llama.cpp server among ``nodes`` that
        reports it (name -> tokens; the others absent)."""
        out: dict[str, int] = {}
        with self._lock:
            for n in nodes:
                e = self._entries.get(n.name)
                if e is not None and e.props is not None and e.props.ctx_tokens is not None:
                    out[n.name] = e.props.ctx_tokens
        return out

    def hint(self, node: NodeSettings, status: NodeStatus) -> str | None:
        """One line (starting with :data:`HINT_PREFIX`) when the node's kind needs a
        setting (cases in the module docstring), else ``None``."""
        if status.has_metrics or node.kind == "openai" or not status.reachable:
            return None
        with self._lock:
            e = self._entries.get(node.name)
            props, answered = (e.props, e.answered) if e is not None else (None, None)
        if props is not None:
            if props.metrics is False:
                return (HINT_PREFIX + "llama.cpp server without --metrics (running and queued "
                        "requests unknown): start llama-server with --metrics")
            return None
        if answered is None or not _NO_KIND.search(status.last_error or ""):
            return None  # /props not read yet, or the metrics failed for another reason
        return (HINT_PREFIX + f"unknown: GET {node.health_path} and GET {node.metrics_path} "
                f"as above, GET {PROPS_PATH} {answered}; not vLLM, TGI, SGLang or llama.cpp: "
                f"set the node's kind (openai for any other OpenAI-compatible server), "
                f"health_path or metrics_path")

    def annotate(self, node: NodeSettings, status: NodeStatus) -> None:
        """Append :meth:`hint` to ``status.last_error`` (in place)."""
        h = self.hint(node, status)
        if h:
            status.last_error = "; ".join(x for x in (status.last_error, h) if x)

