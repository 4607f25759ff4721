"""Configuration: one TOML file (``infergate.toml``) read into pydantic models.

Every section and field is optional; defaults are the values below. Units are in the
field names (``_s`` seconds, ``_ms`` milliseconds, ``0-1`` fractions). Environment
variables override a few fields so secrets need not sit in the file:

- ``INFERGATE_REDIS_URL`` -> ``redis.url``
- ``INFERGATE_ADMIN_TOKEN`` -> ``controlplane.admin_token``

Every default, unit and range of the edge's options lives here, once: the sections
in :data:`EDGE_SECTIONS` are rendered into the edge's options document, and the spec
the edge validates that document against (``lua/infergate/core/options.lua``) is
generated from these fields (:mod:`controlplane.edge.options`). A refused value of
any section is reported in the edge's own words, e.g.
``edge.redis_timeout_ms: 100000 is above the maximum 60000`` (:func:`bound_message`).
Every number has a lower and an upper bound.

Errors: :func:`load_settings` raises :class:`ConfigError` (a ``click`` friendly
``ValueError``) naming the file and the field for unreadable TOML or invalid values, in
one line when one field is refused
(``f.toml: invalid configuration: controlplane.poll_interval_s: -1 is below the minimum
0.01``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import core_schema

from controlplane.errors import InfergateError

NodeKind = Literal["vllm", "tgi", "sglang", "json", "openai"]
"""Metrics dialect of a node. ``openai`` means "no metrics endpoint" (llama.cpp without
``--metrics``, Ollama, any OpenAI-compatible server): the node is routed on what the
edge observes itself. ``vllm`` also accepts the pre-0.10 names (auto-detected)."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
PATH_RE = re.compile(r"^/[A-Za-z0-9/_.-]{0,200}\Z")


class ConfigError(InfergateError, ValueError):
    """The configuration file or a value in it is invalid.

    ``fields``: one message per refused field (``controlplane.poll_interval_s: -1 is below
    the minimum 0.01``), empty for a file that cannot be read."""

    def __init__(self, message: str, fields: typing.Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields = list(fields)


# --------------------------------------------------------------------------- messages
# The wording of a refused edge option, shared with lua/infergate/core/options.lua: a
# value refused here (pydantic) and by the edge's validator reads the same.

#: Spec bound name -> words of the refusal ("<path>: <value> <words> <bound>").
BOUND_WORDS = {
    "minimum": "is below the minimum",
    "exclusiveMinimum": "is not above the exclusive minimum",
    "maximum": "is above the maximum",
    "exclusiveMaximum": "is not below the exclusive maximum",
}
#: Spec type -> the words of "<path>: must be ...".
TYPE_WORDS = {"number": "a number", "integer": "an integer", "boolean": "a boolean",
              "string": "a string", "object": "an object", "array": "an array"}


def number_text(v: float) -> str:
    """A number as the edge prints it (C ``%.15g``: ``100000``, ``0.005``, ``1e+15``)."""
    return format(v, ".15g")


def value_text(v: Any) -> str:
    """A value in a message: strings in double quotes, numbers as :func:`number_text`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return number_text(v)
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def bound_message(path: str, value: float, bound_kind: str, bound: float) -> str:
    """``edge.redis_timeout_ms: 100000 is above the maximum 60000``; ``bound_kind`` is a
    key of :data:`BOUND_WORDS`."""
    return f"{path}: {number_text(value)} {BOUND_WORDS[bound_kind]} {number_text(bound)}"


def enum_message(path: str, value: Any, choices: typing.Sequence[Any]) -> str:
    """``auth.mode: "maybe" is not one of "off", "required"``."""
    return f"{path}: {value_text(value)} is not one of {', '.join(value_text(c) for c in choices)}"


def key_message(path: str, key: str, choices: typing.Sequence[str], name: str = "key") -> str:
    """``deadlines.routes: unknown path 'x' (one of /v1/chat/completions, ...)``."""
    return f"{path}: unknown {name} '{key}' (one of {', '.join(choices)})"


def key_path(path: str, key: str) -> str:
    """Path of a map entry: ``cache.min_similarity_models["m"]``."""
    return f'{path}["{key}"]'


# --------------------------------------------------------------------------- HostPort

class HostPortError(InfergateError, ValueError):
    """A ``host:port`` value that is not one."""


_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9_][A-Za-z0-9_.-]{0,252})\Z")


class HostPort(str):
    """``HOST:PORT`` or ``[IPv6]:PORT`` (``127.0.0.1:8080``, ``edge.internal:80``,
    ``[::1]:8080``, ``0.0.0.0:8080``, ``*:8080``): a ``str`` that also carries its parts.

    ``host`` is the name or address without brackets, ``port`` an ``int`` from 1 to
    65535. :meth:`parse` raises :class:`HostPortError` (a ``ValueError``) with one message
    for every malformed value; as a pydantic field type it validates and keeps the text."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: Any, what: str = "address") -> HostPort:
        """``value`` checked and split; ``what`` names it in the error."""
        if isinstance(value, HostPort):
            return value
        text = value if isinstance(value, str) else ""
        host = port = None
        if text.startswith("["):
            inner, sep, rest = text[1:].partition("]")
            if sep and rest.startswith(":"):
                try:
                    ipaddress.IPv6Address(inner)
                    host, port = inner, rest[1:]
                except ValueError:
                    pass
        else:
            h, sep, p = text.rpartition(":")
            if sep and _HOST_RE.match(h):
                host, port = h, p
        if host is None or not (port or "").isdigit() or not 0 < int(port) < 65536:
            raise HostPortError(f"{what} must be HOST:PORT or [IPv6]:PORT with a port from 1 "
                                f"to 65535, got {value!r}")
        out = str.__new__(cls, text)
        out.host, out.port = host, int(port)
        return out

    @property
    def url_host(self) -> str:
        """The host as it goes in a URL or an nginx ``server`` line (IPv6 in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def client_host(self) -> str:
        """Where a client on this machine connects: the wildcard addresses (``0.0.0.0``,
        ``*``, ``::``) become the loopback address."""
        if self.host in ("0.0.0.0", "*"):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    @property
    def client_url(self) -> str:
        """``http://client_host:port`` (brackets for IPv6)."""
        h = self.client_host
        return f"http://{f'[{h}]' if ':' in h else h}:{self.port}"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls.parse, core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(str))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisSettings(_Section):
    """The one Redis every part shares (forms of ``url``: :mod:`controlplane.redisdb.url`)."""

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[[user]:password@]host[:port][/db]``; ``rediss://`` for TLS;
    ``redis+sentinel://[[user]:password@]h1[:26379][,h2[:26379]...]/<service>[/db]`` for
    Redis Sentinel (the master of ``<service>``, followed across failovers)."""
    socket_timeout_s: float = Field(default=0.5, gt=0, le=600)
    """Socket timeout of the control plane's and the embedder's Redis calls, seconds."""
    tls_verify: bool = True
    """``rediss://``: check the server certificate against ``tls_ca_file`` and the host
    name in the URL (the edge compares it with the certificate's DNS names only: use a
    name, not an IP address). ``false`` encrypts without checking (test setups only)."""
    tls_ca_file: str = ""
    """PEM file of the CA(s) that sign the server certificate; empty = the system bundle
    (``/etc/ssl/certs/ca-certificates.crt`` at the edge). The edge renders it as
    ``lua_ssl_trusted_certificate``."""
    tls_cert_file: str = ""
    """PEM client certificate, for servers that ask for one (Redis' ``tls-auth-clients
    yes``, its default); empty = none. Needs ``tls_key_file``."""
    tls_key_file: str = ""
    """PEM private key of ``tls_cert_file`` (read by nginx's master process at start)."""
    sentinel_password: str = ""
    """Password of the sentinels (their ``requirepass``), if any; the password of the Redis
    servers themselves goes in the URL."""
    sentinel_refresh_s: float = Field(default=5.0, ge=0.01, le=3600)
    """How often the edge asks the sentinels for the master again (seconds); it also asks
    at once after a connection error or a ``READONLY`` answer."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from controlplane.redisdb.url import parse_redis_url

        parse_redis_url(v)  # RedisURLError is a ValueError: reported as redis.url
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> RedisSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("redis.tls_cert_file and redis.tls_key_file go together")
        return self


class EdgeSettings(_Section):
    listen: HostPort = HostPort.parse("127.0.0.1:8080")
    """``host:port`` (``[v6]:port``) the rendered standalone nginx listens on."""
    edge_id: str = Field(default="", pattern=r"^([\w.:\-]{1,128})?$")
    """Name this edge publishes its stats under (letters, digits, ``_``, ``.``, ``:``,
    ``-``, at most 128); empty = ``hostname:port``."""
    sync_interval_s: float = Field(default=0.5, ge=0.01, le=3600)
    """How often a worker pulls the routing snapshot from Redis, seconds."""
    stale_after_s: float = Field(default=10.0, ge=0.01, le=86400)
    """Snapshot older than this (seconds): scores ignored, edge balances on local signals."""
    redis_timeout_ms: int = Field(default=200, ge=1, le=60000)
    """Connect, send and read timeout of every Redis call of the edge, milliseconds."""
    redis_pool_size: int = Field(default=64, ge=1, le=10000)
    """Idle Redis connections (a count) each nginx worker keeps for reuse, per Redis
    target (server, database, credentials); more may be open at once, the ones beyond
    this are closed after use. The default covers the concurrent Redis calls of a busy
    worker (nginx's own default for Lua keepalive pools is 30)."""
    redis_idle_timeout_ms: int = Field(default=60000, ge=1, le=3600000)
    """How long an idle pooled Redis connection is kept before it is closed,
    milliseconds."""
    max_tries: int = Field(default=3, ge=1, le=100)
    """Total attempts per request (first try + retries on other nodes)."""
    connect_timeout_ms: int = Field(default=2000, ge=1, le=3600000)
    """Longest wait for a node to accept the connection, milliseconds."""
    read_timeout_ms: int = Field(default=60000, ge=1, le=86400000)
    """Longest silence from a node while reading its answer (between stream chunks too),
    milliseconds."""
    send_timeout_ms: int = Field(default=60000, ge=1, le=86400000)
    """Longest wait while sending the request to a node, milliseconds."""
    retry_window_s: float = Field(default=60.0, ge=0, le=86400)
    """``proxy_next_upstream_timeout``: no new try after this long, seconds (0 = no limit)."""
    client_max_body_size: str = Field(default="8m", pattern=r"^[1-9][0-9]*[kKmMgG]?$")
    """Largest request body (nginx size: ``8m``, ``512k``, ``1048576`` bytes)."""
    breaker_failures: int = Field(default=5, ge=1, le=10000)
    """Consecutive failures that open a node's circuit breaker."""
    breaker_cooldown_s: float = Field(default=10.0, ge=0, le=86400)
    """How long a breaker stays open before one half-open probe, seconds."""
    inflight_cost: float = Field(default=1.0, ge=0, le=1000)
    """Weight of the edge's own in-flight count (per unit of max_concurrency) in the cost."""
    node_cost: Literal["load", "expected_delay"] = "expected_delay"
    """How the edge prices a node: ``expected_delay`` (the default) = the predicted
    completion time (s) of the request there, from each node's service time and
    concurrency as this edge learns them (lua/infergate/routing/speed.lua), so a node
    three times slower gets a request only when the faster ones have that much work
    queued; a node that has answered nothing for 5 s and has none of this edge's
    requests in flight sees its service time halve every 5 s more, so one measured slow
    is tried again (one probe at a time). Engines with metrics only: nodes of
    kind openai, and any candidate without a service time yet, are priced by ``load``.
    ``load`` = in-flight over capacity plus the control plane's score, for every node."""
    outlier_ttfb_factor: float = Field(default=5.0, ge=0, le=1000)
    """A node whose oldest request of this edge has waited for its first byte longer than
    this many times the node's usual time to first byte (a p90 estimate, streams and
    non-streams apart; a stream's first byte is its first chunk, not its headers), at
    least ``outlier_ttfb_min_s``, and that sent no first byte for as long, gets no new
    request until it answers again; 0 = off."""
    outlier_ttfb_min_s: float = Field(default=5.0, ge=0.1, le=3600)
    """Floor of the outlier threshold above, seconds, for answers that are not streamed
    (their first byte comes with the whole answer, so its time follows the answer's
    length); also the threshold while the node has no time-to-first-byte history of
    that kind."""
    outlier_stream_ttfb_min_s: float = Field(default=2.0, ge=0.1, le=3600)
    """Floor of the outlier threshold for streams, seconds, once the node has a history
    of streams' first chunks (prefill and one token: it does not grow with the answer's
    length, so the floor can be lower than ``outlier_ttfb_min_s``). A node flagged by it
    only stops getting new requests until its next first byte."""
    prefix_affinity: bool = True
    """Prefix-cache-aware routing: a request whose leading prompt is at least
    ``prefix_min_tokens`` long (or that carries ``affinity_header``) goes to the first node
    of a rendezvous order derived from that prompt, the same on every edge, within the
    load bound ``prefix_load_factor`` (lua/infergate/routing/affinity.lua); false = the
    plain cost for every request."""
    prefix_min_tokens: int = Field(default=256, ge=1, le=1000000)
    """Shortest leading prompt that gets affinity, tokens (estimated as 4 characters a
    token): the messages are taken in order until their text reaches this length."""
    prefix_max_tokens: int = Field(default=2048, ge=1, le=1000000)
    """Most of the leading prompt that is hashed into the affinity key, tokens (4
    characters a token): prompts that agree on this many tokens share a node."""
    prefix_load_factor: float = Field(default=0.25, ge=0, le=100)
    """epsilon of consistent hashing with bounded loads: a node gets a request for its
    prefix only while this edge's requests in flight on it are under (1 + epsilon) times
    its share of the total (capacity-weighted); past it the request goes to the prefix's
    next node."""
    affinity_header: str = Field(default="X-Session-ID", pattern=r"^([!#$%&'*+.^_`|~0-9A-Za-z-]{1,64})?$")
    """Request header whose value, when present, is the affinity key (an explicit session:
    every request carrying the same value prefers the same node); empty = none."""
    affinity_user_field: bool = False
    """Use the body's ``user`` field as the affinity key of requests without a long
    leading prompt or an ``affinity_header``."""
    keepalive: int = Field(default=64, ge=1, le=100000)
    """Idle keepalive connections per worker to the nodes."""
    workers: int = Field(default=2, ge=1, le=1024)
    """``worker_processes`` of the standalone config."""
    metrics_listen: str = "127.0.0.1:9145"
    """``host:port`` of the edge's Prometheus ``/metrics`` (a separate ``server {}`` in the
    http include); empty = no metrics server. Anyone who reaches it can read it: keep it
    on an internal address."""

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, v: str) -> str:
        v = v.strip()
        return HostPort.parse(v, "edge.metrics_listen") if v else ""
    client_body_timeout_ms: int = Field(default=60000, ge=1, le=3600000)
    """Longest wait between two reads of a request body, milliseconds (nginx
    ``client_body_timeout``): a client that stalls longer gets 408 JSON and the connection
    is closed (a chunked body's connection is closed without an answer)."""
    max_json_depth: int = Field(default=64, ge=2, le=1000)
    """Deepest nesting of objects and arrays in a request body; deeper bodies get
    ``400 invalid_request_error`` (code ``json_too_deep``) at the edge and never reach a
    node (a body nested ~1000 deep crashes many Python servers)."""
    max_messages: int = Field(default=10000, ge=1, le=1000000)
    """Most entries in a request's ``messages`` array; more get ``400
    invalid_request_error`` (code ``too_many_messages``), checked before the body is
    decoded so a huge conversation never ties up an nginx worker."""
    max_json_members: int = Field(default=100000, ge=1, le=10000000)
    """Most JSON members in a request body: object fields plus array elements, counted
    over every level (10,000 messages of a few fields each fit the default). More get
    ``400 invalid_request_error`` (code ``too_many_json_members``), counted before the
    body is decoded: decoding a body of hundreds of thousands of fields holds an nginx
    worker for seconds."""
    client_body_deadline_ms: int = Field(default=120000, ge=1, le=3600000)
    """Longest time to receive a whole request body, milliseconds, however steadily it
    trickles in (a client sending 1 byte every 20 s never trips ``client_body_timeout_ms``):
    past it the request gets 408 JSON (code ``request_timeout``) and the connection is
    closed."""
    flush_interval_ms: int = Field(default=20, ge=1, le=10000)
    """Period of the one recurring timer per nginx worker that writes cache stores,
    cache counters and rate-limit corrections to Redis in one pipeline, milliseconds."""
    flush_queue_max: int = Field(default=10000, ge=1, le=1000000)
    """Most writes (cache stores, rate-limit corrections) waiting for that timer in one
    worker; a write beyond it is dropped and counted
    (``infergate_edge_flush_dropped_total``), never logged per request."""


class ScoringSettings(_Section):
    """Health score = (w_queue*q + w_kv*kv + w_latency*lat) / weight, lower is better.

    q = min(queue_depth / queue_norm, 1) ... see docs in README "Scoring"."""

    w_queue: float = Field(default=0.5, ge=0, le=1000)
    w_kv: float = Field(default=0.3, ge=0, le=1000)
    w_latency: float = Field(default=0.2, ge=0, le=1000)
    queue_norm: float = Field(default=16.0, ge=0.01, le=1000000)
    """Queue depth that counts as fully loaded (term = 1)."""
    latency_norm_s: float = Field(default=30.0, ge=0.001, le=86400)
    """Recent e2e latency (s) that counts as fully loaded (term = 1); the edge's balancer
    normalises its latency term with it too."""
    saturation_queue: float = Field(default=32.0, ge=1, le=1000000)
    """Queue depth at or above which a node is saturated."""
    saturation_kv: float = Field(default=0.98, gt=0, le=1)
    """KV-cache usage (0-1) at or above which a node is saturated."""


class AuthSettings(_Section):
    """API keys checked by the edge on every API request (``Authorization: Bearer KEY``).

    Keys live in Redis as SHA-256 hashes (``controlplane.admin.apikeys``); ``infergate keys``
    and the admin API create and revoke them. Missing or wrong key: 401 JSON
    (``code: "invalid_api_key"``). The key is never logged and never sent to the nodes."""

    mode: Literal["off", "required"] = "off"
    """``required``: a valid key is needed; ``off``: no check, every request belongs to the
    tenant ``default`` (trusted networks; the default, so a drop-in locks nobody out).
    ``infergate up`` runs with ``required`` unless the file sets the mode."""
    cache_ttl_s: float = Field(default=5.0, ge=0.001, le=3600)
    """Seconds an edge trusts its cached answer for a valid key; a revoked key stops
    working at most this long after the revocation."""
    negative_ttl_s: float = Field(default=5.0, ge=0.001, le=3600)
    """Seconds an edge trusts its cached answer for an unknown or revoked key."""
    stale_ttl_s: float = Field(default=300.0, ge=0, le=86400)
    """While Redis is unreachable, cached answers up to this many seconds old are still
    used; a key with no cached answer then gets 503 (never let through)."""


class LimitSettings(_Section):
    """Token-bucket rate limits, shared by every edge through Redis.

    Per key: the key's ``rpm`` (requests per minute) and ``tpm`` (tokens per minute) from
    ``infergate keys``. Each bucket holds at most its per-minute limit and refills evenly.
    Tokens are estimated up front as ceil(prompt characters / ``chars_per_token``) and
    corrected with the response's ``usage.total_tokens`` afterwards. Redis down: each edge
    enforces the limits on its own (so N edges allow up to N times the limit)."""

    enabled: bool = True
    """Check the per-key and global buckets (429 ``rate_limit_exceeded`` when empty)."""
    global_rpm: int = Field(default=0, ge=0, le=10**9)
    """Requests per minute across all clients and edges; 0 = no global limit."""
    global_tpm: int = Field(default=0, ge=0, le=10**12)
    """Tokens per minute across all clients and edges; 0 = no global limit."""
    chars_per_token: float = Field(default=4.0, ge=0.01, le=1000)
    """Prompt characters counted as one token by the up-front estimate."""
    lease_fraction: float = Field(default=0.01, ge=0, le=0.5)
    """Largest lease as a fraction (0-1) of a bucket's capacity, at most 1,000 requests
    or tokens: a worker that keeps charging a bucket takes tokens from Redis ahead of
    its requests (1, 2, 4, ... per round trip) and spends them without a round trip
    until they run out or are a second old (the rest goes back). Leases never let more
    through than the limit; while other workers hold leased tokens a bucket can refuse
    up to ``lease_fraction`` x capacity x (workers x edges) early. 0 = one Redis round
    trip per request, exact to the token. Below 1 / ``lease_fraction`` per minute
    (100 at 0.01) a bucket is never leased."""
    redis_retry_s: float = Field(default=1.0, ge=0.01, le=3600)
    """After a failed Redis call (connect refused or timed out, a read timeout), seconds
    every worker of the edge skips that Redis before trying again: API keys come from
    the edge's cache, limits from local buckets, the response cache is bypassed and
    routing stays on the last snapshot meanwhile (the one back-off of the edge's Redis
    connections, ``lua/infergate/redis/pool.lua``)."""


class AdmissionSettings(_Section):
    """Load shedding at the edge: when every eligible node is saturated (snapshot
    ``saturated`` from the ``[scoring]`` caps, or this edge's in-flight count at the node's
    ``max_concurrency``), a new request waits briefly for capacity, then gets 429 with
    ``Retry-After`` (``type: "server_overloaded"``) instead of queueing into a timeout.
    Cache hits are answered before this check."""

    shed: bool = True
    """Shed load as above; off: requests always go to a node and queue there."""
    max_wait_ms: int = Field(default=500, ge=0, le=60000)
    """Longest wait for capacity before the 429, milliseconds (never past the deadline)."""
    poll_ms: int = Field(default=20, ge=1, le=1000)
    """How often a waiting request checks for capacity again, milliseconds."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """``Retry-After`` of the 429, whole seconds."""
    deadline_fraction: float = Field(default=1.0, gt=0, le=1)
    """With ``edge.node_cost = "expected_delay"`` and a deadline: a request is admitted
    while the best node's predicted completion (its expected delay, s) is at most this
    fraction of the time left before the deadline, and waits, then gets the 429, past
    it (below 1: a margin for answers longer than the mean, at the price of more 429s).
    The in-flight caps above do not apply then."""


#: The API paths the edge serves (locations of nginx/infergate-server.conf.j2).
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")


class RouteDeadlineSettings(_Section):
    """Per-path overrides of ``[deadlines]``; fields left out keep the global value."""

    request_ms: int | None = Field(default=None, ge=0, le=86400000)
    stream_idle_ms: int | None = Field(default=None, ge=1, le=86400000)


class DeadlineSettings(_Section):
    """Request deadlines at the edge. Past the deadline the client gets 504 JSON
    (``type: "timeout"``, ``code: "deadline_exceeded"``), no new try starts, and the
    connection to the node is closed so it can stop generating."""

    request_ms: int = Field(default=30000, ge=0, le=86400000)
    """End-to-end deadline of a non-streaming request, milliseconds from its arrival at
    the edge (auth, rate limiting and the admission wait count); 0 = none. For a stream,
    no try starts after it."""
    stream_idle_ms: int = Field(default=30000, ge=1, le=86400000)
    """Longest silence from the node on a streaming request (before the first chunk and
    between chunks), milliseconds; then the stream ends."""
    routes: dict[str, RouteDeadlineSettings] = Field(
        default={}, json_schema_extra={"keys": {"enum": list(API_PATHS), "name": "path"}})
    """Per path, e.g. ``[deadlines.routes."/v1/embeddings"]`` ``request_ms = 5000``."""

    @field_validator("routes")
    @classmethod
    def _paths(cls, v: dict[str, RouteDeadlineSettings]) -> dict[str, RouteDeadlineSettings]:
        for path in v:
            if path not in API_PATHS:
                raise ValueError(key_message("deadlines.routes", path, API_PATHS, "path"))
        return v


class ControlPlaneSettings(_Section):
    listen: HostPort = HostPort.parse("127.0.0.1:8081")
    """host:port of the admin page and ``/api/v1``."""
    poll_interval_s: float = Field(default=1.0, ge=0.01, le=3600)
    poll_timeout_s: float = Field(default=0.8, ge=0.01, le=600)
    unhealthy_after: int = Field(default=3, ge=1, le=1000)
    """K consecutive failed polls -> unhealthy."""
    healthy_after: int = Field(default=2, ge=1, le=1000)
    """M consecutive good polls -> healthy again."""
    leader_ttl_s: float = Field(default=5.0, ge=0.1, le=3600)
    metrics_ttl_s: float = Field(default=30.0, ge=0.1, le=86400)
    history_points: int = Field(default=300, ge=1, le=100000)
    admin_token: str = ""
    drain_timeout_s: float = Field(default=600.0, ge=0, le=604800)
    slow_start_s: float = Field(default=30.0, ge=0, le=86400)
    """Seconds over which a node's share ramps from 10 % to its full weight after it was
    undrained, added at run time, or came back from unhealthy."""
    models_refresh_s: float = Field(default=60.0, ge=5.0, le=86400.0)
    """How often (s) the served models of a node are read again from its ``GET
    /v1/models`` (also at once when a node is added); never on the health-check path."""
    models_timeout_s: float = Field(default=2.0, gt=0.0, le=30.0)
    """Timeout (s) of one ``GET /v1/models`` of a node (connect and whole body)."""
    events_max: int = Field(default=10000, ge=1, le=10000000)
    cookie_secure: bool = False
    """Mark the admin session cookie ``Secure`` always (it is anyway on a page served
    over TLS, or through a ``trusted_proxies`` proxy that sends
    ``X-Forwarded-Proto: https``)."""
    trusted_proxies: list[str] = Field(default_factory=list)
    """Addresses or CIDRs (e.g. ``"10.0.0.0/8"``) of reverse proxies in front of the admin
    page whose ``X-Forwarded-Proto`` and ``X-Forwarded-For`` are believed (TLS detection,
    the client address the login throttle counts)."""
    node_url_allow: list[str] = Field(default_factory=list)
    """Node URL hosts allowed although they are refused by default: link-local and
    cloud-metadata addresses (169.254.0.0/16, fe80::/10, fd00:ec2::254,
    ``metadata.google.internal``) and this stack's own Redis and admin ports. Entries are
    host names, addresses or CIDRs (``"169.254.10.0/24"``), optionally ``host:port``."""

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, v: list[str]) -> list[str]:
        import ipaddress

        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {item!r} is not an address or CIDR") from None
        return v


#: A cosine similarity, 0-1.
Similarity = Annotated[float, Field(ge=0.0, le=1.0)]
#: The paths a per-route similarity may name.
CACHE_PATHS = ("/v1/chat/completions", "/v1/completions")


class SemanticDomain(_Section):
    """Thresholds of one domain of the semantic cache, applied by the embedder (written by
    ``infergate cache calibrate``). A domain matches a lookup when every matcher it sets
    matches: ``route`` (request path), ``model`` (requested model), ``namespace_prefix``
    (leading hex digits of the semantic namespace). The embedder applies the most specific
    matching domain (a namespace prefix counts most, then the model, then the route; a
    longer prefix wins a tie) and it overrides the edge's ``min_similarity`` values."""

    route: str = ""
    model: str = ""
    namespace_prefix: str = Field(default="", pattern=r"^[0-9a-f]{0,64}$")
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Cosine (0-1) a candidate needs; unset = the edge's value or the embedder default."""
    min_verifier_score: float | None = Field(default=None, ge=0.0, le=1.0)
    """Verifier probability (0-1) a hit needs; unset = the verifier's own default."""
    verifier: bool | None = None
    """Use the verifier in this domain (false: cosine and the precision guard only);
    unset = ``cache.verifier``."""
    pairs: int = Field(default=0, ge=0, le=10**9)
    """Informational, from calibration: labelled pairs the thresholds were chosen on."""
    hit_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    """Informational: share of matching pairs served at these thresholds (0-1)."""
    wrong_hit_upper: float | None = Field(default=None, ge=0.0, le=1.0)
    """Informational: 95 % upper bound of the wrong-hit rate at these thresholds (0-1)."""

    @model_validator(mode="after")
    def _some_threshold(self) -> "SemanticDomain":
        if self.min_similarity is None and self.min_verifier_score is None:
            raise ValueError("a semantic domain needs min_similarity or min_verifier_score")
        return self


class CacheSettings(_Section):
    """Response cache at the edge: exact (Redis) and semantic (embedder).

    Off unless ``enabled``: serving a stored answer to another request changes what a
    sampled (temperature > 0) request returns, so an operator opts in. ``infergate up``
    turns it on (and starts the embedder) unless the file sets ``enabled`` itself."""

    enabled: bool = False
    ttl_s: int = Field(default=3600, ge=1, le=366 * 24 * 3600)
    """Lifetime of a stored answer, seconds (absolute: hits never extend it)."""
    max_entry_bytes: int = Field(default=262144, ge=1024, le=64 * 1024 * 1024)
    """Largest answer captured for the cache (bytes as sent by the node, JSON or SSE);
    a larger answer is passed on and not stored."""
    max_request_bytes: int = Field(default=1048576, ge=1024, le=64 * 1024 * 1024)
    """Largest request body that takes part in the cache, bytes; a larger one bypasses it
    (``X-Cache-Status: BYPASS``, neither read nor stored), so working out its key (a
    canonical encoding of the whole body) stays cheap."""
    max_temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Requests with a higher ``temperature`` bypass the cache. A request without
    ``temperature`` counts as the API default 1.0, so it is cached with this default."""
    stream_usage: bool = True
    """A stream whose answer is stored and that did not ask for
    ``stream_options.include_usage`` is sent to the node with ``"stream_options":
    {"include_usage": true}`` (the usage-only last chunk is taken out of what the client
    receives), so every stored entry carries usage and answers streaming and
    non-streaming requests alike; false = the body goes to the node as sent (for nodes
    that refuse ``stream_options``), and such an entry answers only streams without usage."""
    semantic: bool = True
    """Look up paraphrases through the embedder when the exact key misses."""
    embedder_url: str = "http://127.0.0.1:8090"
    """Root of the embedder service (``infergate embedder``), ``http://host:port``."""
    semantic_budget_ms: int = Field(default=150, ge=1, le=10000)
    """Time budget of one semantic lookup (connect, send and read timeouts of the
    subrequest); over it the request goes on to a node with ``X-Cache-Status: BYPASS``."""
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Cosine similarity (0-1) a semantic hit needs; unset = the embedder's default: the
    verifier's floor (0.5) when the verifier is on, else the model's threshold (0.98 for
    all-MiniLM-L6-v2 and use-multilingual-v3, chosen on the cache-eval dev sets, see
    README). 0 is a value."""
    min_similarity_routes: dict[str, Similarity] = Field(
        default={}, json_schema_extra={"keys": {"enum": list(CACHE_PATHS), "name": "path"}})
    """Per path (``/v1/chat/completions``, ``/v1/completions``), overrides ``min_similarity``."""
    min_similarity_models: dict[str, Similarity] = {}
    """Per requested ``model``, overrides the route and global values."""
    coalesce: bool = True
    """Identical requests that miss at the same time: one goes to a node, the others wait
    for its answer (per edge, shared by the nginx workers)."""
    coalesce_wait_s: float = Field(default=10.0, ge=0.0, le=600.0)
    """Longest wait for the first request's answer; then a waiter goes to a node itself."""
    coalesce_poll_ms: int = Field(default=50, ge=5, le=5000)
    """How often a waiting request looks for the answer in Redis, milliseconds."""
    embedder_token: str = Field(default="", pattern=r"^([A-Za-z0-9._~+/=-]{16,256})?$")
    """Shared secret (16-256 characters of ``A-Za-z0-9._~+/=-``; "" = none) the edge and
    the control plane send the embedder as ``Authorization: Bearer``; with one set the
    embedder refuses lookups, index writes and embeddings without it (401), so another
    process on the host can neither read stored prompts nor point a question at another
    answer. ``infergate up`` sets a random one. Also ``INFERGATE_EMBEDDER_TOKEN``."""
    local_ttl_ms: int = Field(default=0, ge=0, le=60000)
    """How long each nginx worker keeps an entry it read from Redis and answers repeats of
    it from memory, milliseconds (0 = off: every hit reads Redis). Hits of hot entries
    then cost no Redis round trip, but a purged or flagged entry may still answer from a
    worker's copy for that long (never past the entry's own TTL); at most 1000 entries
    and 16 MB per worker."""
    verifier: bool = True
    """The embedder checks every candidate with its learned verifier (a logistic regression
    over both vectors and the precision guard's signals) and retrieves from the verifier's
    cosine floor instead of the model's ``min_similarity`` default."""
    verifier_file: str = ""
    """Verifier JSON file (``infergate cache calibrate --train-verifier``); empty = the one
    shipped for the embedder's model, if any."""
    semantic_domains: list[SemanticDomain] | None = None
    """Per-domain thresholds applied by the embedder (``[[cache.semantic_domains]]``);
    unset = none (None rather than ``[]``: the edge's options document drops nulls, and it
    cannot tell an empty array from an empty table)."""
    embedder_model: str = "use-multilingual-v3"
    """Model ``infergate up`` starts the embedder with: use-multilingual-v3 (numpy, no
    torch, 16 languages) or, with the ``semantic`` extra, all-MiniLM-L6-v2 or any
    sentence-transformers name or path."""
    verify_fraction: float = Field(default=0.02, ge=0.0, le=1.0)
    """Share (0-1) of semantic hits the edge also queues for online verification (the
    hit is served all the same); 0 = off. The control plane's leader sends each queued
    request (non-streaming) to a healthy node and compares the fresh answer with the
    cached one (``controlplane.cache.verify``)."""
    verify_answer_similarity: float = Field(default=0.9, ge=0.0, le=1.0)
    """Cosine (0-1) of the two answers' embeddings (from the embedder) at or above which a
    verified hit counts as right; equal texts (up to case and spaces) always do."""
    verify_max_wrong: float = Field(default=0.01, gt=0.0, le=1.0)
    """Target wrong-hit rate of a namespace (0-1, as ``infergate cache calibrate
    --max-wrong``): when the 95 % (Wilson) upper bound of its measured wrong rate is above
    it, the namespace's semantic threshold goes up by ``verify_threshold_step``; under
    half of it, back down by a step (never below the configured threshold)."""
    verify_threshold_step: float = Field(default=0.01, gt=0.0, le=1.0)
    """Step of one threshold change of a namespace (added to the verifier score threshold,
    or the cosine threshold without the verifier)."""
    verify_max_raise: float = Field(default=0.05, ge=0.0, le=1.0)
    """Largest raise of a namespace's threshold above the configured one (0-1)."""
    verify_queue_max: int = Field(default=1000, ge=1, le=1000000)
    """Longest the verification queue grows (items; the edge trims the oldest)."""
    verify_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0)
    """Time a verification request to a node may take, seconds."""

    @field_validator("embedder_url")
    @classmethod
    def _embedder_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError("cache.embedder_url must be http://host:port")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError("cache.embedder_url is the embedder root, without a path")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"cache.embedder_url port: {exc}") from exc
        return v.rstrip("/")

    @field_validator("min_similarity_routes")
    @classmethod
    def _routes(cls, v: dict[str, float]) -> dict[str, float]:
        for path in v:
            if path not in CACHE_PATHS:
                raise ValueError(key_message("cache.min_similarity_routes", path, CACHE_PATHS,
                                             "path"))
        return v


class NodeSettings(_Section):
    name: str
    url: str
    """Server root, e.g. ``http://10.0.0.5:8000``; the OpenAI API is under ``/v1``."""
    kind: NodeKind = "vllm"
    weight: float = Field(default=1.0, ge=0.001, le=1000)
    max_concurrency: int = Field(default=64, ge=1, le=100000)
    metrics_path: str = "/metrics"
    health_path: str = "/health"
    models: list[str] = Field(default_factory=list)
    """Model ids the node serves (the ``model`` of a request, as in ``GET /v1/models``).
    Empty: read from the node's ``GET /v1/models`` (see ``poll_models``); still unknown,
    the node may be sent any model."""
    poll_models: bool | None = None
    """Read the served models from ``GET /v1/models`` every
    ``controlplane.models_refresh_s``: ``None`` = yes unless ``kind`` is ``openai``
    (llama-cpp-python's ``/v1/models`` waits for the model lock and can cut a running
    stream) or ``models`` is set."""

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str]) -> list[str]:
        out: list[str] = []
        for m in v:
            if not isinstance(m, str) or not m or len(m) > 256 or not m.isprintable():
                raise ValueError("models: each entry is a non-empty model id of at most 256 "
                                 "printable characters")
            if m not in out:
                out.append(m)
        return out

    def polls_models(self) -> bool:
        """Whether the control plane reads this node's ``GET /v1/models`` (see
        ``poll_models``)."""
        if self.poll_models is not None:
            return self.poll_models
        return self.kind != "openai" and not self.models

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("node name: letters, digits, '-', '_', '.', at most 63")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if any(c.isspace() or not c.isprintable() for c in v):
            raise ValueError("node url must not hold spaces, line breaks or control characters")
        parts = urlsplit(v)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError("node url must be http://host[:port] (TLS to nodes is not supported)")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError("node url is the server root, without a path (the edge adds /v1/...)")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"node url port: {exc}") from exc
        if port == 0:
            raise ValueError("node url port must be 1-65535")
        if parts.username is not None or parts.password is not None:
            raise ValueError("node url must not carry credentials (user:password@)")
        return v.rstrip("/")

    @field_validator("metrics_path", "health_path")
    @classmethod
    def _path(cls, v: str) -> str:
        # appended to the node URL: a path on the same server, nothing that could name
        # another host ("@", "//") or leave the path ("..", "?", "#")
        if not PATH_RE.match(v) or "//" in v or ".." in v:
            raise ValueError("must be an absolute path such as /metrics (letters, digits, '/', '-', '_', '.')")
        return v


class Settings(_Section):
    redis: RedisSettings = RedisSettings()
    edge: EdgeSettings = EdgeSettings()
    auth: AuthSettings = AuthSettings()
    limits: LimitSettings = LimitSettings()
    admission: AdmissionSettings = AdmissionSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    controlplane: ControlPlaneSettings = ControlPlaneSettings()
    scoring: ScoringSettings = ScoringSettings()
    cache: CacheSettings = CacheSettings()
    nodes: list[NodeSettings] = []

    @field_validator("nodes")
    @classmethod
    def _unique(cls, v: list[NodeSettings]) -> list[NodeSettings]:
        names = [n.name for n in v]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate node names: {sorted(dup)}")
        return v


#: The sections of :class:`Settings` that the edge receives (its options document and
#: spec, :mod:`controlplane.edge.options`); their refusals read as the edge words them.
EDGE_SECTIONS = ("edge", "redis", "scoring", "auth", "limits", "admission", "deadlines", "cache")

_BOUND_ERRORS = {"greater_than_equal": ("minimum", "ge"), "greater_than": ("exclusiveMinimum", "gt"),
                 "less_than_equal": ("maximum", "le"), "less_than": ("exclusiveMaximum", "lt")}
_TYPE_ERRORS = {"int_type": "integer", "int_parsing": "integer", "int_from_float": "integer",
                "float_type": "number", "float_parsing": "number", "finite_number": "number",
                "bool_type": "boolean", "bool_parsing": "boolean", "string_type": "string",
                "dict_type": "object", "model_type": "object", "model_attributes_type": "object",
                "list_type": "array"}


def unwrap_annotation(ann: Any) -> Any:
    """``ann`` without ``Annotated[...]`` and without ``| None``."""
    while True:
        origin = typing.get_origin(ann)
        if origin is Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) != 1:
                return ann
            ann = args[0]
        else:
            return ann


def _locate(loc: tuple) -> tuple[str, Any]:
    """(path as the edge spells it, annotation) of a pydantic error location."""
    ann: Any = Settings
    path = ""
    for part in loc:
        ann = unwrap_annotation(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            path = f"{path}.{part}" if path else str(part)
            field = ann.model_fields.get(str(part))
            ann = field.annotation if field else None
        elif typing.get_origin(ann) is dict:
            path, ann = key_path(path, str(part)), typing.get_args(ann)[1]
        elif typing.get_origin(ann) is list:
            path, ann = f"{path}[{part}]", typing.get_args(ann)[0]
    return path, unwrap_annotation(ann)


def edge_message(error: dict) -> str | None:
    """The edge's wording of one pydantic error of a field of a section (the words of
    lua/infergate/core/options.lua, e.g. ``controlplane.poll_interval_s: -1 is below the
    minimum 0.01``), or ``None`` for other errors (those of ``nodes``)."""
    loc = error.get("loc") or ()
    if not loc or loc[0] not in Settings.model_fields or loc[0] == "nodes":
        return None
    path, ann = _locate(loc)
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind in _BOUND_ERRORS:
        bound_kind, key = _BOUND_ERRORS[kind]
        return bound_message(path, value, bound_kind, ctx[key])
    if kind == "literal_error" and typing.get_origin(ann) is Literal:
        return enum_message(path, value, typing.get_args(ann))
    if kind == "extra_forbidden":
        return f"{path}: unknown option"
    if kind in _TYPE_ERRORS:
        return f"{path}: must be {TYPE_WORDS[_TYPE_ERRORS[kind]]}"
    if kind == "value_error" and "error" in ctx:
        msg = str(ctx["error"])
        return msg if msg.startswith(path) else f"{path}: {msg}"
    return None


def _refusal(exc: ValidationError, source: str) -> ConfigError:
    """The :class:`ConfigError` of a refused document: one line naming the field for one
    refused field (``f.toml: invalid configuration: controlplane.poll_interval_s: -1 is
    below the minimum 0.01``), one line per field below a heading for several."""
    lines = [edge_message(e) or f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
             for e in exc.errors()]
    if len(lines) == 1:
        return ConfigError(f"{source}: invalid configuration: {lines[0]}", lines)
    return ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines), lines)


def _apply_env(data: dict) -> dict:
    url = os.environ.get("INFERGATE_REDIS_URL")
    if url:
        data.setdefault("redis", {})["url"] = url
    token = os.environ.get("INFERGATE_ADMIN_TOKEN")
    if token:
        data.setdefault("controlplane", {})["admin_token"] = token
    etoken = os.environ.get("INFERGATE_EMBEDDER_TOKEN")
    if etoken:
        data.setdefault("cache", {})["embedder_token"] = etoken
    return data


def settings_from_dict(data: dict, source: str = "<dict>") -> Settings:
    """Validate a plain dict (the TOML document) into :class:`Settings`.

    Raises :class:`ConfigError` with every invalid field listed, the fields of the edge's
    sections in the edge's words (:func:`edge_message`)."""
    try:
        return Settings.model_validate(_apply_env(dict(data)))
    except ValidationError as exc:
        raise _refusal(exc, source) from None


def check_settings(settings: Settings, source: str = "<settings>") -> Settings:
    """``settings`` validated again, as a new :class:`Settings` (pydantic checks fields on
    loading only: a value assigned afterwards, e.g. ``settings.edge.listen = ...``, is
    checked here). No environment overrides. Raises :class:`ConfigError` like
    :func:`settings_from_dict`."""
    try:
        return Settings.model_validate(settings.model_dump())
    except ValidationError as exc:
        raise _refusal(exc, source) from None


def load_settings(path: str | Path | None) -> Settings:
    """Read the TOML file at ``path`` (``None``: defaults plus environment)."""
    if path is None:
        return settings_from_dict({}, "<defaults>")
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such configuration file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (TOML must be): {exc.reason} at byte "
                          f"{exc.start}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return settings_from_dict(data, str(p))
