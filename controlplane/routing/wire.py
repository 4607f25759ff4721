"""The JSON documents the control plane shares through Redis, as dataclasses parsed once.

| document | Redis key | written by | read by |
|---|---|---|---|
| :class:`RoutingSnapshot` (nodes: :class:`SnapshotNode`) | ``infergate:v1:routing`` (string) | leader control plane (``routing/service.py``) | the Lua edge (``lua/infergate/routing/snapshot.lua``), the admin (node views, ``GET /api/v1/snapshot``) |
| :class:`NodeMetricsDoc` | ``infergate:v1:node:{name}:metrics`` (string, TTL) | leader control plane (``routing/poller.py``) | the admin (node views) |
| :class:`EdgeReport` (nodes: :class:`EdgeNodeStats`) | ``infergate:v1:edges`` (hash field per edge) | each Lua edge, every sync | the leader (drain), the admin (node views) |

Field meanings and units: docs/internals.md "Redis data". Every ``to_dict`` gives the
fields in the documented order, so the JSON written is the same bytes as before these
classes existed (the Lua edge parses it with cjson; ``tests/edge/`` read it back).

Parsing is tolerant: unknown fields are ignored (an :class:`EdgeReport` keeps them in
``extra``), a missing field or one of the wrong JSON type takes its default (``None``
for "unknown"), so a newer or older writer never breaks a reader. ``from_json`` raises
:class:`WireError` only when the text is not a JSON object at all; ``parse`` returns
``None`` instead (a missing key reads as ``None`` too).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Self

from controlplane.errors import InfergateError

#: An edge report older than this many ``edge.stale_after_s`` is not believed (its
#: in-flight counts neither hold a drain open nor show on the admin page).
EDGE_FRESH_FACTOR = 3.0

#: Circuit-breaker states an edge reports, worst first.
BREAKER_STATES: tuple[str, ...] = ("open", "half_open", "closed")

class WireError(InfergateError, ValueError):
    """A stored document is not a JSON object."""


def edge_fresh_s(stale_after_s: float) -> float:
    """Age (s) up to which an edge report counts: ``EDGE_FRESH_FACTOR x stale_after_s``."""
    return EDGE_FRESH_FACTOR * stale_after_s


def _object(raw: str | bytes | dict | None, what: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "" or raw == b"":
        raise WireError(f"{what}: no document")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise WireError(f"{what}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def _num(v: Any) -> float | int | None:
    """A finite JSON number as it was (int stays int), else ``None``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if math.isfinite(v) else None


def _int(v: Any, default: int | None = 0) -> int | None:
    n = _num(v)
    return default if n is None else int(n)


def _bool(v: Any, default: bool | None) -> bool | None:
    return v if isinstance(v, bool) else default


def _str(v: Any, default: str | None) -> str | None:
    return v if isinstance(v, str) else default


class _Doc:
    """``from_json`` / ``parse`` / ``to_dict`` / ``to_json`` shared by the documents."""

    @classmethod
    def from_dict(cls, d: dict) -> Self:  # pragma: no cover - each class has its own
        raise NotImplementedError

    @classmethod
    def from_json(cls, raw: str | bytes | dict | None) -> Self:
        """Parse a stored document; raises :class:`WireError` when it is not a JSON
        object (missing, empty, invalid JSON, an array, ...)."""
        return cls.from_dict(_object(raw, cls.__name__))

    @classmethod
    def parse(cls, raw: str | bytes | dict | None) -> Self | None:
        """Like :meth:`from_json`, but ``None`` for a missing or unreadable document."""
        try:
            return cls.from_json(raw)
        except WireError:
            return None

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        """Compact JSON (no spaces), the form written to Redis."""
        return json.dumps(self.to_dict(), separators=(",", ":"))


# ---- infergate:v1:node:{name}:metrics ---------------------------------------------------


@dataclass
class NodeMetricsDoc(_Doc):
    """The latest poll of one node, ``infergate:v1:node:{name}:metrics`` (TTL
    ``controlplane.metrics_ttl_s``). ``None`` = unknown (no metrics, nothing finished
    since the previous poll, or a field missing from the stored document)."""

    name: str
    ts: float | None = None
    """Epoch seconds of the poll."""
    healthy: bool | None = None
    """Health after the hysteresis."""
    reachable: bool | None = None
    """Some HTTP answer came back from the node."""
    dialect: str | None = None
    """vllm | vllm-legacy | tgi | sglang | json; ``None`` without metrics (kind openai)."""
    queue_depth: float | None = None
    """Requests waiting in the node's queue."""
    running: float | None = None
    """Requests running on the node."""
    kv_cache_usage: float | None = None
    """0-1."""
    e2e_avg_s: float | None = None
    """Mean end-to-end latency (s) of the requests finished since the previous poll."""
    ttft_avg_s: float | None = None
    """Mean time to first token (s), same window."""
    prompt_tokens_total: float | None = None
    """Prompt tokens processed since the previous poll."""
    generation_tokens_total: float | None = None
    """Tokens generated since the previous poll."""
    score: float | None = None
    """Health score (lower is better, already divided by the weight)."""
    saturated: bool | None = None
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    poll_ms: float | None = None
    """Duration of the poll, ms."""
    has_metrics: bool = False
    """The metrics endpoint answered and was parsed."""
    stalled: bool = False
    """An edge has streams on the node in the middle of their answer and no byte came
    from it for longer than its stall threshold (``edge.stall_gap_factor``): a frozen
    or hung process, not a busy one. The poll counts as failed."""
    busy: bool = False
    """The poll's health request connected and got no answer in time (a busy, hung or
    frozen process; a refused connection is not this)."""

    @classmethod
    def from_dict(cls, d: dict) -> NodeMetricsDoc:
        nums = {k: _num(d.get(k)) for k in (
            "ts", "queue_depth", "running", "kv_cache_usage", "e2e_avg_s", "ttft_avg_s",
            "prompt_tokens_total", "generation_tokens_total", "score", "poll_ms")}
        return cls(name=_str(d.get("name"), "") or "", healthy=_bool(d.get("healthy"), None),
                   reachable=_bool(d.get("reachable"), None),
                   dialect=_str(d.get("dialect"), None),
                   saturated=_bool(d.get("saturated"), None),
                   consecutive_failures=_int(d.get("consecutive_failures")) or 0,
                   consecutive_successes=_int(d.get("consecutive_successes")) or 0,
                   last_error=str(d["last_error"]) if d.get("last_error") else None,
                   has_metrics=_bool(d.get("has_metrics"), False) or False,
                   stalled=_bool(d.get("stalled"), False) or False,
                   busy=_bool(d.get("busy"), False) or False, **nums)


# ---- infergate:v1:routing -----------------------------------------------------------------


@dataclass
class SnapshotNode(_Doc):
    """One ``nodes[]`` entry of the routing snapshot: what the edge routes on."""

    name: str
    url: str = ""
    host: str | None = None
    """IP literal resolved by the control plane; ``None`` = unresolvable (never chosen)."""
    port: int | None = None
    kind: str = "vllm"
    """vllm | tgi | sglang | json | openai."""
    state: str = "active"
    """active | draining | drained."""
    healthy: bool = True
    """Health after hysteresis (``True`` before the first poll)."""
    weight: float = 1.0
    """Configured weight (> 0)."""
    effective_weight: float | None = None
    """``weight`` x the slow-start ramp (0.1 -> 1 over ``controlplane.slow_start_s``)."""
    max_concurrency: int | None = None
    slots: int | None = None
    """Known hard limit of requests at once (the edge never sends more, the rest wait at
    the edge); ``None`` = not known (``max_concurrency`` is then a soft cap)."""
    slots_source: str | None = None
    """Where ``slots`` came from: ``server`` (llama.cpp ``/props`` ``total_slots``) or
    ``config`` (``max_concurrency`` set to another value than its default); ``None``."""
    ctx_tokens: int | None = None
    """The context one request may fill on the node, tokens (llama.cpp ``/props``
    ``default_generation_settings.n_ctx``); ``None`` = not known."""
    score: float | None = None
    """Health score, lower is better, divided by weight; ``None`` = no metrics."""
    saturated: bool = False
    queue_depth: float | None = None
    running: float | None = None
    polled_at: float | None = None
    """Epoch s of the poll ``queue_depth`` and ``running`` come from (the edge counts
    them as others' requests only while they are fresh); ``None`` before a poll."""
    restarted_after: float | None = None
    """Epoch s of the last reading of the node's process before its latest restart seen
    between two polls (its metrics' counters began again): a request the edge sent
    before it went to that process, and no answer will come from it; ``None``: none."""
    back_at: float | None = None
    """Epoch s of the poll that saw the node come back: healthy again, or a new process
    (its counters began again). An edge breaker opened on the node before then takes
    its half-open probe at once (lua/infergate/routing/breaker.lua); ``None``: not seen."""
    kv_cache_usage: float | None = None
    """0-1."""
    has_metrics: bool = False
    models: list[str] | None = None
    """Model ids the node serves (configured, or read from its ``GET /v1/models``);
    ``None`` = unknown: the edge may send it any model."""
    models_any: bool = False
    """With ``models``: the node also takes a model no node lists (a single-model
    llama.cpp server answers any name with its one model; see
    :mod:`controlplane.routing.models`)."""
    scheme: str = "http"
    """http | https (the edge verifies the certificate against ``tls_name``)."""
    tls_name: str | None = None
    """Host name of an ``https`` node: SNI and certificate check."""
    connects: bool = False
    """Unhealthy, but likely to be back soon: its latest poll connected and got no answer
    or an edge found it stalled (a frozen or hung process), or that poll was good (coming
    back, not yet counted back by the health hysteresis); a refused connection or a
    server that answers and fails is not this. While no node of a model is eligible, the edge holds
    that model's requests for such a node within their deadline, as nginx's proxy would
    wait on it (lua/infergate/access.lua)."""
    auth: str | None = field(default=None, repr=False)
    """``Authorization`` value the edge sends to the node (its API key), ``None``: none.
    Secret: every serving path redacts it
    (:func:`controlplane.routing.nodeaccess.redact_snapshot`)."""

    @classmethod
    def from_dict(cls, d: dict) -> SnapshotNode:
        w = _num(d.get("weight"))
        raw_models = d.get("models")
        models = ([m for m in raw_models if isinstance(m, str)]
                  if isinstance(raw_models, list) else None)
        return cls(name=_str(d.get("name"), "") or "", url=_str(d.get("url"), "") or "",
                   host=_str(d.get("host"), None), port=_int(d.get("port"), None),
                   kind=_str(d.get("kind"), "vllm") or "vllm",
                   state=_str(d.get("state"), "active") or "active",
                   healthy=bool(_bool(d.get("healthy"), True)),
                   weight=1.0 if w is None else w,
                   effective_weight=_num(d.get("effective_weight")),
                   max_concurrency=_int(d.get("max_concurrency"), None),
                   slots=_int(d.get("slots"), None),
                   slots_source=_str(d.get("slots_source"), None),
                   ctx_tokens=_int(d.get("ctx_tokens"), None),
                   score=_num(d.get("score")), saturated=bool(_bool(d.get("saturated"), False)),
                   queue_depth=_num(d.get("queue_depth")), running=_num(d.get("running")),
                   polled_at=_num(d.get("polled_at")),
                   restarted_after=_num(d.get("restarted_after")),
                   back_at=_num(d.get("back_at")),
                   kv_cache_usage=_num(d.get("kv_cache_usage")),
                   has_metrics=bool(_bool(d.get("has_metrics"), False)), models=models,
                   models_any=bool(_bool(d.get("models_any"), False)) and models is not None,
                   scheme="https" if d.get("scheme") == "https" else "http",
                   tls_name=_str(d.get("tls_name"), None),
                   connects=bool(_bool(d.get("connects"), False)), auth=_str(d.get("auth"), None))


@dataclass
class RoutingSnapshot(_Doc):
    """The routing snapshot, ``infergate:v1:routing``: one GET per edge sync."""

    version: int = 0
    """INCR of ``infergate:v1:routing:version``; the edge applies a newer one only."""
    generated_at: float | None = None
    """Epoch seconds when written; older than ``edge.stale_after_s`` = stale at the edge."""
    leader: str = ""
    """Id of the control plane that wrote it."""
    nodes: list[SnapshotNode] = field(default_factory=list)
    """Sorted by name."""

    @classmethod
    def from_dict(cls, d: dict) -> RoutingSnapshot:
        raw_nodes = d.get("nodes") if isinstance(d.get("nodes"), list) else []
        nodes = [SnapshotNode.from_dict(n) for n in raw_nodes
                 if isinstance(n, dict) and isinstance(n.get("name"), str) and n["name"]]
        return cls(version=_int(d.get("version")) or 0, generated_at=_num(d.get("generated_at")),
                   leader=_str(d.get("leader"), "") or "", nodes=nodes)

    def to_dict(self) -> dict:
        """The snapshot as written; a node's ``scheme``, ``tls_name`` and ``auth`` only
        when it is an https node or has an API key (a plain node's entry is as before)."""
        d = asdict(self)
        for n in d["nodes"]:
            for k, default in (("scheme", "http"), ("tls_name", None), ("auth", None)):
                if n.get(k) == default:
                    del n[k]
        return d

    def node(self, name: str) -> SnapshotNode | None:
        """The entry of node ``name``, ``None`` if the snapshot has none."""
        return next((n for n in self.nodes if n.name == name), None)


# ---- infergate:v1:edges -------------------------------------------------------------------


@dataclass
class EdgeNodeStats(_Doc):
    """One edge's view of one node (``nodes.<name>`` of an edge report); counters are
    since that nginx started."""

    inflight: int = 0
    """Requests this edge has on the node now."""
    requests: int = 0
    """Requests proxied to the node (cumulative)."""
    failures: int = 0
    """Of those, the ones that counted as a node failure (cumulative)."""
    breaker: str | None = None
    """closed | open | half_open; ``None`` when missing or unknown."""
    latency_ewma_ms: float | None = None
    """Latency EWMA of the node's answers, ms; ``None`` before the first."""
    stalled: bool = False
    """The edge found the node stalled (streams in the middle of their answer, no byte
    past the threshold: lua/infergate/routing/stall.lua) and it sent nothing since."""
    silent_s: float | None = None
    """Seconds since the node's last byte at this edge; ``None`` = none yet."""

    @classmethod
    def from_dict(cls, d: dict) -> EdgeNodeStats:
        b = d.get("breaker")
        return cls(inflight=_int(d.get("inflight")) or 0, requests=_int(d.get("requests")) or 0,
                   failures=_int(d.get("failures")) or 0,
                   breaker=b if b in BREAKER_STATES else None,
                   latency_ewma_ms=_num(d.get("latency_ewma_ms")),
                   stalled=_bool(d.get("stalled"), False) or False,
                   silent_s=_num(d.get("silent_s")))


@dataclass
class EdgeReport(_Doc):
    """What one nginx edge publishes every sync, field ``<edge_id>`` of
    ``infergate:v1:edges``. Written by Lua (``lua/infergate/routing/snapshot.lua``)."""

    edge_id: str = ""
    """The edge's id: its hash field (``edge.edge_id``, one per nginx instance)."""
    ts: float | None = None
    """Epoch seconds of the edge's last sync; ``None`` = unreadable (never fresh)."""
    nodes: dict[str, EdgeNodeStats] = field(default_factory=dict)
    admission: dict[str, float] = field(default_factory=dict)
    """Admission counters since nginx start (``auth_rejected``, ``rate_limited``, ``shed``,
    ...) and the ``waiting`` gauge; numbers only."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other top-level fields, as they were (readers may use them; kept by ``to_dict``)."""

    @classmethod
    def from_dict(cls, d: dict, edge_id: str = "") -> EdgeReport:
        nodes = d.get("nodes") if isinstance(d.get("nodes"), dict) else {}
        adm = d.get("admission") if isinstance(d.get("admission"), dict) else {}
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(edge_id=_str(d.get("edge_id"), None) or edge_id, ts=_num(d.get("ts")),
                   nodes={str(k): EdgeNodeStats.from_dict(v) for k, v in nodes.items()
                          if isinstance(v, dict)},
                   admission={str(k): n for k, v in adm.items() if (n := _num(v)) is not None},
                   extra={k: v for k, v in d.items() if k not in known})

    @classmethod
    def from_field(cls, edge_id: str, raw: str | bytes | None) -> EdgeReport | None:
        """The report in hash field ``edge_id`` (which names it, whatever its ``edge_id``
        member says); ``None`` when it is not a JSON object."""
        try:
            rep = cls.from_dict(_object(raw, "EdgeReport"), edge_id=edge_id)
        except WireError:
            return None
        rep.edge_id = edge_id
        return rep

    def to_dict(self) -> dict:
        d = {"edge_id": self.edge_id, "ts": self.ts,
             "nodes": {k: v.to_dict() for k, v in self.nodes.items()},
             "admission": dict(self.admission)}
        return {**d, **{k: v for k, v in self.extra.items() if k not in d}}

    def age_s(self, now: float) -> float | None:
        """Seconds since ``ts`` (``None`` without one)."""
        return None if self.ts is None else now - self.ts

    def is_fresh(self, now: float, max_age_s: float) -> bool:
        """``ts`` at most ``max_age_s`` old (see :func:`edge_fresh_s`)."""
        return self.ts is not None and now - self.ts <= max_age_s


def edge_reports(edges_raw: dict[str, str]) -> dict[str, EdgeReport | None]:
    """Every field of ``infergate:v1:edges`` parsed; ``None`` for one that is not a JSON
    object."""
    return {str(k): EdgeReport.from_field(str(k), raw) for k, raw in edges_raw.items()}


def fresh_edge_reports(edges_raw: dict[str, str], now: float,
                       max_age_s: float) -> list[EdgeReport]:
    """The readable reports whose ``ts`` is at most ``max_age_s`` seconds old (callers
    pass :func:`edge_fresh_s` of ``edge.stale_after_s``), in field order."""
    return [rep for rep in edge_reports(edges_raw).values()
            if rep is not None and rep.is_fresh(now, max_age_s)]
