"""Polling the nodes: ``GET /health`` and ``GET /metrics`` of every node at once, and the
per-node state kept between polls (health hysteresis, last reading, held score
inputs).

One poll of a node is two concurrent requests on a shared thread pool (``requests``
with one keep-alive session per worker thread), each bounded by ``poll_timeout_s`` for
connect and for the whole body (read in chunks against a deadline, at most
``MAX_BODY`` bytes, a metrics page at most ``controlplane.max_metrics_bytes``), so one
stuck node never delays the others or the cycle. The metrics page is parsed in the same
worker, within the same deadline (:func:`~controlplane.routing.nodemetrics.parse_metrics`
gives up past it): a huge or slow page marks only its own node (not a good poll).

Outcome of one poll (see also :mod:`controlplane.routing.health`):

| what happened | good poll? | metrics |
|---|---|---|
| health 2xx, metrics 2xx and parsed | yes | yes |
| health 2xx, metrics 2xx, well-formed but no known metric name | yes | no (``last_error`` says why) |
| health 2xx, metrics non-2xx, timeout or refused | yes | no |
| health 2xx, metrics 2xx but not parseable | **no** | no |
| health non-2xx, timeout or connect error | **no** | (read if answered) |

A health answer that does not come within ``poll_timeout_s`` after the connection was
made (a read timeout: ``PollResult.busy``) while the node has work - requests in flight
at the edges (their reports in ``infergate:v1:edges``) or running requests in metrics it
answered within the last ``HOLD_POLLS`` polls (a frozen server's last page is no evidence
of work) - means the node is **busy**, not down: a server generating a long answer may be
slow to answer anything else (a single-threaded Python server, one request at a time).
Such a poll counts as good (:meth:`NodeTracker.update`, ``busy`` in the error text). A
node that connects but never answers while it has nothing to do is a failed poll, and a
node that hangs on real requests is caught by the edges (a timeout before the first byte
counts against its circuit breaker there). A connect timeout, a refused or reset
connection and a non-2xx answer are failed polls.

Nodes of kind ``openai`` (no metrics endpoint: llama.cpp without ``--metrics``,
Ollama, llama-cpp-python, any OpenAI-compatible server) get only the health request, and
the probe never calls an endpoint that waits on the model: ``GET /v1/models`` of
llama-cpp-python waits for the model lock and, with its default
``interrupt_requests=True``, ends the stream holding it. When the health path does not
exist there (404, 405 or 501: Ollama, llama-cpp-python) the answer itself proves the
server is up and serving HTTP: a good poll (liveness only, ``no health endpoint`` in the
error text). Set ``health_path`` to an endpoint the server answers without the model
(llama.cpp: ``/health``; Ollama: ``/``; ``/api/version``) for a real check. Any other
non-2xx (llama.cpp answers 503 while loading) is a failed poll. Their health is also
passive: a poll of an ``openai`` node whose circuit breaker is open at every edge that
reports it (connect errors, resets, timeouts before the first byte, 5xx that other
nodes did not repeat; :func:`breakers_open`) counts as failed, so every edge learns of
it through the snapshot. ``half_open`` does not count, so the edges' probe requests can
bring the node back.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace

import requests

from controlplane.config import NodeSettings, Settings
from controlplane.routing.health import HealthTracker
from controlplane.routing.nodeaccess import AccessTable
from controlplane.routing.stall import CounterWatch, counters_error, stalled_error
from controlplane.routing.nodemetrics import MetricsParseError, Reading, UnknownDialectError, parse_metrics, window
from controlplane.routing.scoring import LastKnown, ScoreInputs, compute_score
from controlplane.routing.wire import NodeMetricsDoc

#: Largest /health body read (bytes); larger bodies count as unparseable.
MAX_BODY = 8 * 1024 * 1024
#: Largest /metrics page read by default (bytes; ``controlplane.max_metrics_bytes``).
MAX_METRICS_BODY = 1024 * 1024
#: Missing score inputs are held for this many poll intervals (see scoring.LastKnown).
HOLD_POLLS = 5
#: Answers that mean the node refused the credentials (or their absence).
REFUSED = (401, 403)
#: In ``last_error`` of a poll answered with one of :data:`REFUSED` (the admin page shows
#: such an unhealthy node as "credentials refused", not "down").
REFUSED_TEXT = "credentials refused"
#: Health answers of an OpenAI-compatible server that mean "no such path here".
NO_SUCH_PATH = (404, 405, 501)


@dataclass
class HttpResult:
    """One GET. ``status`` is ``None`` when no HTTP answer came (``error`` says why);
    ``busy`` is True when the connection was made but no answer came in time."""

    status: int | None = None
    body: str | None = None
    content_type: str | None = None
    error: str | None = None
    elapsed_ms: float = 0.0
    busy: bool = False
    parsed: Reading | MetricsParseError | UnknownDialectError | None = None
    """A metrics page parsed in the poll worker (:meth:`Poller.metrics`): the reading or
    why there is none; ``None`` when not parsed there."""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass
class PollResult:
    """Outcome of one poll of one node."""

    good: bool
    """Counts as a good poll for the health hysteresis."""
    reachable: bool
    """Some HTTP answer came back."""
    reading: Reading | None = None
    error: str | None = None
    poll_ms: float = 0.0
    busy: bool = False
    """The health request connected but got no answer in time (see the module
    docstring: good when the node has work)."""
    credentials_refused: bool = False
    """The health or metrics request was answered 401 or 403 (a failed poll)."""


@dataclass
class NodeStatus:
    """A node after a poll; :meth:`metrics` is the ``node:{name}:metrics`` document."""

    name: str
    ts: float
    healthy: bool
    reachable: bool
    dialect: str | None
    queue_depth: float | None
    running: float | None
    kv_cache_usage: float | None
    e2e_avg_s: float | None
    ttft_avg_s: float | None
    prompt_tokens_total: float | None
    generation_tokens_total: float | None
    score: float | None
    saturated: bool
    consecutive_failures: int
    consecutive_successes: int
    last_error: str | None
    poll_ms: float
    has_metrics: bool
    stalled: bool = False
    busy: bool = False

    def metrics(self) -> NodeMetricsDoc:
        """The per-node metrics document of docs/internals.md (``poll_ms`` to 0.1 ms)."""
        d = asdict(self)
        d["poll_ms"] = round(self.poll_ms, 1)
        return NodeMetricsDoc(**d)

    def metrics_doc(self) -> dict:
        """:meth:`metrics` as the dict written (``json.dumps``) to Redis."""
        return self.metrics().to_dict()

    def history_point(self) -> dict:
        """One ``node:{name}:history`` entry."""
        return {k: getattr(self, k) for k in (
            "ts", "queue_depth", "running", "kv_cache_usage", "e2e_avg_s", "ttft_avg_s",
            "score", "healthy")}


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, requests.exceptions.SSLError):
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            return "TLS: certificate verify failed"
        if "doesn't match" in text or "hostname" in text.lower():
            return "TLS: certificate does not match the host name"
        return "TLS error: " + text[:160]
    if isinstance(exc, requests.ReadTimeout):
        return f"busy: connected, no answer within {timeout:g} s"
    if isinstance(exc, requests.Timeout):
        return f"timeout after {timeout:g} s"
    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        if "refused" in text.lower():
            return "connection refused"
        return "connection error: " + text[:160]
    return f"{type(exc).__name__}: {str(exc)[:160]}"


class Poller:
    """Concurrent HTTP polling of nodes on a thread pool. :meth:`get` is thread-safe;
    :meth:`poll_all` is meant for one cycle at a time."""

    def __init__(self, timeout_s: float, max_workers: int = 32,
                 max_metrics_bytes: int = MAX_METRICS_BODY, access: AccessTable | None = None):
        self.timeout_s = max(timeout_s, 0.05)
        self.max_metrics_bytes = max_metrics_bytes
        #: API key and CA bundle per node origin (none: plain GETs, system CAs)
        self.access = access
        self._workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="poll")
        self._local = threading.local()
        #: the futures of each node's last poll; a node whose poll is still running (a
        #: server trickling bytes) is not polled again, so it holds at most two threads
        self._running: dict[str, list[Future]] = {}

    def _ensure_workers(self, n: int) -> None:
        """Enough threads for ``n`` requests at once, so none waits in the queue past
        the cycle's deadline (the pool grows with the node count, never shrinks)."""
        if n > self._workers:
            old = self._pool
            self._workers = n
            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="poll")
            old.shutdown(wait=False)

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = requests.Session()
            s.trust_env = False  # never send node polls through an HTTP proxy
            self._local.session = s
        return s

    def get(self, url: str, max_body: int = MAX_BODY) -> HttpResult:
        """GET ``url`` within ``timeout_s`` (connect, and whole body of at most
        ``max_body`` bytes). Never raises."""
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        out = HttpResult()
        headers, verify = None, True
        if self.access is not None:
            a = self.access.for_url(url)
            headers = {"Authorization": a.auth} if a.auth else None
            verify = a.verify
        try:
            with self._session().get(url, timeout=(self.timeout_s, self.timeout_s),
                                     stream=True, allow_redirects=False, headers=headers,
                                     verify=verify) as resp:
                out.status = resp.status_code
                out.content_type = resp.headers.get("Content-Type")
                chunks, size = [], 0
                for chunk in resp.iter_content(65536):
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > max_body:
                        out.error = f"body larger than {max_body} bytes"
                        break
                    if time.monotonic() > deadline:
                        out.error = f"timeout after {self.timeout_s:g} s reading the body"
                        out.busy = True
                        break
                if out.error is None:
                    # Prometheus text and JSON are UTF-8 by their specs.
                    out.body = b"".join(chunks).decode("utf-8", "replace")
        except requests.RequestException as exc:
            out.error = _describe(exc, self.timeout_s)
            out.busy = isinstance(exc, requests.ReadTimeout)
        except Exception as exc:  # noqa: BLE001 - a poll must never raise
            out.error = f"{type(exc).__name__}: {str(exc)[:160]}"
        out.elapsed_ms = (time.monotonic() - t0) * 1000
        return out

    def metrics(self, node: NodeSettings) -> HttpResult:
        """The node's metrics page, fetched and parsed (``parsed``) within one
        ``timeout_s`` from the start, in the calling worker. Never raises."""
        deadline = time.monotonic() + self.timeout_s
        res = self.get(node.url + node.metrics_path, self.max_metrics_bytes)
        if res.ok and res.body is not None:
            t0 = time.monotonic()
            try:
                res.parsed = parse_metrics(res.body, res.content_type, deadline=deadline)
            except (MetricsParseError, UnknownDialectError) as exc:
                res.parsed = exc
            except Exception as exc:  # noqa: BLE001 - a poll must never raise
                res.parsed = MetricsParseError(f"{type(exc).__name__}: {str(exc)[:160]}")
            res.elapsed_ms += (time.monotonic() - t0) * 1000
        return res

    def _health(self, node: NodeSettings) -> HttpResult:
        """The node's health answer; never an endpoint that waits on the model."""
        res = self.get(node.url + node.health_path)
        if node.kind == "openai" and res.status in NO_SUCH_PATH:
            # no health endpoint: the HTTP answer itself is the liveness check
            return HttpResult(status=200, body="", elapsed_ms=res.elapsed_ms,
                              error=f"no health endpoint ({node.health_path} answers "
                                    f"{res.status}): liveness only")
        return res

    def poll_all(self, nodes: list[NodeSettings]) -> dict[str, PollResult]:
        """Poll every node concurrently; returns ``{name: PollResult}`` for each node.

        Waits at most about twice ``timeout_s``; a request still running then counts as
        busy (it connected: see the module docstring)."""
        futures: dict[str, tuple[Future, Future | None]] = {}
        self._ensure_workers(2 * len(nodes))
        busy = HttpResult(error="the previous poll of this node is still running")
        skipped: set[str] = set()
        for n in nodes:
            if any(not f.done() for f in self._running.get(n.name, ())):
                skipped.add(n.name)
                continue
            fh = self._pool.submit(self._health, n)
            fm = None if n.kind == "openai" else self._pool.submit(self.metrics, n)
            futures[n.name] = (fh, fm)
            self._running[n.name] = [f for f in (fh, fm) if f is not None]
        for gone in set(self._running) - {n.name for n in nodes}:
            del self._running[gone]
        every = [f for pair in futures.values() for f in pair if f is not None]
        wait(every, timeout=2 * self.timeout_s + 0.5)
        late = HttpResult(error=f"busy: no answer within {self.timeout_s:g} s", busy=True)
        out: dict[str, PollResult] = {}
        for n in nodes:
            if n.name in skipped:
                out[n.name] = classify(busy, None if n.kind == "openai" else busy)
                continue
            fh, fm = futures[n.name]
            health = fh.result() if fh.done() else late
            metrics = None if fm is None else (fm.result() if fm.done() else late)
            out[n.name] = classify(health, metrics)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def classify(health: HttpResult, metrics: HttpResult | None) -> PollResult:
    """Turn the two answers into a :class:`PollResult` (table in the module docstring).

    ``metrics`` is ``None`` for nodes without a metrics endpoint."""
    errors: list[str] = []
    good = health.ok
    refused = health.status in REFUSED or (metrics is not None and metrics.status in REFUSED)
    if health.status in REFUSED:
        errors.append(f"health: {REFUSED_TEXT} (HTTP {health.status})")
    elif not health.ok:
        errors.append("health: " + (health.error or f"HTTP {health.status}"))
    elif health.error:
        errors.append("health: " + health.error)
    reading: Reading | None = None
    if metrics is not None:
        if metrics.ok and metrics.body is not None:
            try:
                parsed = metrics.parsed
                if parsed is None:
                    parsed = parse_metrics(metrics.body, metrics.content_type)
                if isinstance(parsed, Exception):
                    raise parsed
                reading = parsed
            except UnknownDialectError as exc:
                errors.append(f"metrics: {exc}")
            except MetricsParseError as exc:
                good = False
                errors.append(f"metrics: unparseable: {str(exc)[:200]}")
        elif metrics.ok:
            good = False
            errors.append("metrics: " + (metrics.error or "empty"))
        elif metrics.status in REFUSED:
            good = False
            errors.append(f"metrics: {REFUSED_TEXT} (HTTP {metrics.status})")
        else:
            errors.append("metrics: " + (metrics.error or f"HTTP {metrics.status}"))
    reachable = health.status is not None or (metrics is not None and metrics.status is not None)
    poll_ms = max(health.elapsed_ms, metrics.elapsed_ms if metrics else 0.0)
    return PollResult(good=good, reachable=reachable, reading=reading,
                      error="; ".join(errors) or None, poll_ms=poll_ms,
                      busy=not health.ok and health.busy, credentials_refused=refused)


def models_refusal(result: PollResult, models_error: str | None) -> PollResult:
    """``result``, as a failed poll with credentials refused when the node's last ``GET
    /v1/models`` was answered 401 or 403 (``models_error`` ``"HTTP 401"``, see
    :class:`controlplane.routing.models.ModelsPoller`): vLLM's ``--api-key`` guards
    only ``/v1``, so its ``/health`` and ``/metrics`` answer whatever the key."""
    if models_error not in {f"HTTP {c}" for c in REFUSED}:
        return result
    text = f"models: {REFUSED_TEXT} ({models_error})"
    return replace(result, good=False, credentials_refused=True, busy=False,
                   error="; ".join(x for x in (result.error, text) if x))


def breakers_open(edges_raw: dict[str, str], now: float, max_age_s: float) -> set[str]:
    """Nodes whose circuit breaker is ``open`` at every edge whose report (a field of
    ``infergate:v1:edges``: ``{"ts", "nodes": {name: {"breaker", ...}}}``) is at most
    ``max_age_s`` old and names the node. Malformed reports are ignored."""
    seen: dict[str, bool] = {}
    for raw in edges_raw.values():
        try:
            doc = json.loads(raw)
            ts = float(doc["ts"])
            nodes = doc.get("nodes") or {}
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if now - ts > max_age_s or not isinstance(nodes, dict):
            continue
        for name, st in nodes.items():
            is_open = isinstance(st, dict) and st.get("breaker") == "open"
            seen[name] = seen.get(name, True) and is_open
    return {name for name, all_open in seen.items() if all_open}


def _num(v: float | None, digits: int = 6) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, digits)


class NodeTracker:
    """What the control plane remembers about one node between polls."""

    def __init__(self, node: NodeSettings, settings: Settings):
        cp = settings.controlplane
        self.node = node
        self.settings = settings
        self.health = HealthTracker(cp.unhealthy_after, cp.healthy_after)
        self.last_reading: Reading | None = None
        #: when ``last_reading`` was read (s, the poll's ``now``)
        self.last_reading_at = 0.0
        self.held = LastKnown(hold_s=HOLD_POLLS * cp.poll_interval_s)
        self.counters = CounterWatch()
        #: the last poll's metrics showed a restart since the reading before (its
        #: counters began again: ``Window.restarted``), though it never looked down
        self.restarted = False
        #: epoch s of the last reading of the process before the latest such restart:
        #: what the edges sent the node before it went to that process (``None``: none)
        self.restarted_after: float | None = None
        #: epoch s of the poll that saw the node come back: healthy again, or a new
        #: process (``restarted``); ``None``: not seen. An edge whose breaker opened on
        #: the node before then gives the new process its probe at once
        self.back_at: float | None = None
        #: the last poll got no connection at all (refused; not a busy node)
        self.was_refused = False

    def _just_back(self, now: float) -> bool:
        """Within a breaker cooldown of :attr:`back_at`: the edges' open breakers judged
        the process before, and they give the new one its probe at once (the snapshot's
        ``back_at``), so they do not fail an ``openai`` node's polls meanwhile."""
        return self.back_at is not None \
            and now - self.back_at < self.settings.edge.breaker_cooldown_s

    def same_target(self, node: NodeSettings) -> bool:
        """False when the node's address or kind changed (start afresh)."""
        return (node.url, node.kind, node.metrics_path) == (
            self.node.url, self.node.kind, self.node.metrics_path)

    def update(self, result: PollResult, now: float, inflight: float = 0.0,
               edges_open: bool = False,
               stalled_s: float | None = None) -> tuple[NodeStatus, bool]:
        """Apply one poll; returns the node's status and whether ``healthy`` changed.

        ``inflight``: requests the edges have in flight on the node (fresh edge
        reports). A busy poll (connected, no answer in time) of a node with work - edge
        requests in flight, or running requests in its last metrics - is good.
        ``edges_open``: the node's breaker is open at every fresh edge
        (:func:`breakers_open`); for an ``openai`` node that fails the poll, except
        within a breaker cooldown of the node coming back (:meth:`_just_back`).
        ``stalled_s``: not ``None`` when a fresh edge reports the node stalled (no byte
        in the middle of its streams, :mod:`controlplane.routing.stall`; the silence in
        s): the poll fails, busy or not. So does a poll whose metrics show requests
        running and no counter advancing for ``controlplane.stall_counters_s``."""
        good = result.good
        error = result.error
        r = result.reading
        w = window(self.last_reading, r) if r is not None else None
        self.restarted = w is not None and w.restarted
        if self.restarted:
            self.restarted_after = round(self.last_reading_at, 3)
        stall_cause = None if stalled_s is None else stalled_error(stalled_s)
        quiet = self.counters.observe(w, r.running if r is not None else None, now)
        limit = self.settings.controlplane.stall_counters_s
        if stall_cause is None and quiet is not None and limit > 0 and quiet >= limit:
            stall_cause = counters_error(r.running if r and r.running else 0.0, quiet)
        if not good and result.busy and stall_cause is None:
            # the node's own "running" counts only while recent: a frozen server's last
            # page (its requests running when it stopped) is no evidence of work now
            fresh = self.last_reading is not None \
                and now - self.last_reading_at <= self.held.hold_s
            running = self.last_reading.running if fresh and self.last_reading else None
            good = inflight > 0 or bool(running and running > 0)
        if stall_cause is not None:
            good = False
            error = "; ".join(x for x in (stall_cause, error) if x)
        if result.reachable and self.was_refused:
            # it answers again after refusing: a new process (kill -9 and a restart)
            self.back_at = round(now, 3)
        self.was_refused = not result.reachable and not result.busy
        if good and edges_open and self.node.kind == "openai" and not self._just_back(now):
            good = False
            error = "; ".join(x for x in (error, "edges: circuit breaker open at every edge") if x)
        changed = self.health.observe(good)
        if (changed and self.health.healthy) or self.restarted:
            self.back_at = round(now, 3)
        if r is not None:
            self.last_reading, self.last_reading_at = r, now
        inputs = ScoreInputs(
            queue_depth=r.queue_depth if r else None,
            kv_cache_usage=r.kv_cache_usage if r else None,
            e2e_avg_s=w.e2e_avg_s if w else None,
        )
        if self.node.kind == "openai":
            sc = compute_score(ScoreInputs(), self.settings.scoring, self.node.weight)
        else:
            sc = compute_score(self.held.fill(inputs, now), self.settings.scoring,
                               self.node.weight)
        status = NodeStatus(
            name=self.node.name, ts=round(now, 3), healthy=self.health.healthy,
            reachable=result.reachable, dialect=r.dialect if r else None,
            queue_depth=_num(r.queue_depth) if r else None,
            running=_num(r.running) if r else None,
            kv_cache_usage=_num(r.kv_cache_usage) if r else None,
            e2e_avg_s=_num(w.e2e_avg_s) if w else None,
            ttft_avg_s=_num(w.ttft_avg_s) if w else None,
            prompt_tokens_total=_num(w.prompt_tokens_total, 1) if w else None,
            generation_tokens_total=_num(w.generation_tokens_total, 1) if w else None,
            score=sc.score, saturated=sc.saturated,
            consecutive_failures=self.health.consecutive_failures,
            consecutive_successes=self.health.consecutive_successes,
            last_error=error, poll_ms=result.poll_ms, has_metrics=r is not None,
            stalled=stall_cause is not None, busy=result.busy,
        )
        return status, changed
