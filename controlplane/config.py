"""Configuration: one TOML file (``infergate.toml``) read into pydantic models.

Every section and field is optional; defaults are the values below. Units are in the
field names (``_s`` seconds, ``_ms`` milliseconds, ``0-1`` fractions). Environment
variables override a few fields so secrets need not sit in the file:

- ``INFERGATE_REDIS_URL`` -> ``redis.url``
- ``INFERGATE_ADMIN_TOKEN`` -> ``controlplane.admin_token``

Errors: :func:`load_settings` raises :class:`ConfigError` (a ``click`` friendly
``ValueError``) naming the file and the field for unreadable TOML or invalid values.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

NodeKind = Literal["vllm", "tgi", "sglang", "json", "openai"]
"""Metrics dialect of a node. ``openai`` means "no metrics endpoint" (llama.cpp without
``--metrics``, Ollama, any OpenAI-compatible server): the node is routed on what the
edge observes itself. ``vllm`` also accepts the pre-0.10 names (auto-detected)."""

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
PATH_RE = re.compile(r"^/[A-Za-z0-9/_.-]{0,200}$")


class ConfigError(ValueError):
    """The configuration file or a value in it is invalid."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RedisSettings(_Section):
    """The one Redis every part shares (forms of ``url``: :mod:`controlplane.redisdb.url`)."""

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[[user]:password@]host[:port][/db]``; ``rediss://`` for TLS;
    ``redis+sentinel://[[user]:password@]h1[:26379][,h2[:26379]...]/<service>[/db]`` for
    Redis Sentinel (the master of ``<service>``, followed across failovers)."""
    socket_timeout_s: float = 0.5
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
    sentinel_refresh_s: float = Field(default=5.0, gt=0, le=3600)
    """How often the edge asks the sentinels for the master again (seconds); it also asks
    at once after a connection error or a ``READONLY`` answer."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        from controlplane.redisdb.url import parse_redis_url

        parse_redis_url(v)  # RedisURLError is a ValueError: reported as redis.url
        return v

    @model_validator(mode="after")
    def _tls_pair(self) -> "RedisSettings":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("redis.tls_cert_file and redis.tls_key_file go together")
        return self


class EdgeSettings(_Section):
    listen: str = "127.0.0.1:8080"
    """host:port the rendered standalone nginx listens on."""
    edge_id: str = ""
    """Name this edge publishes its stats under; empty = ``hostname:port``."""
    sync_interval_s: float = 0.5
    """How often a worker pulls the routing snapshot from Redis."""
    stale_after_s: float = 10.0
    """Snapshot older than this: scores ignored, edge balances on local signals."""
    redis_timeout_ms: int = 200
    max_tries: int = 3
    """Total attempts per request (first try + retries on other nodes)."""
    connect_timeout_ms: int = 2000
    read_timeout_ms: int = 60000
    """Longest silence from a node while reading its answer (between stream chunks too)."""
    send_timeout_ms: int = 60000
    retry_window_s: float = 60.0
    """``proxy_next_upstream_timeout``: no new try after this long."""
    client_max_body_size: str = "8m"
    breaker_failures: int = 5
    """Consecutive failures that open a node's circuit breaker."""
    breaker_cooldown_s: float = 10.0
    """How long a breaker stays open before one half-open probe."""
    inflight_cost: float = 1.0
    """Weight of the edge's own in-flight count (per unit of max_concurrency) in the cost."""
    keepalive: int = 64
    """Idle keepalive connections per worker to the nodes."""
    workers: int = 2
    """``worker_processes`` of the standalone config."""
    metrics_listen: str = "127.0.0.1:9145"
    """``host:port`` of the edge's Prometheus ``/metrics`` (a separate ``server {}`` in the
    http include); empty = no metrics server. Anyone who reaches it can read it: keep it
    on an internal address."""
    client_body_timeout_ms: int = Field(default=60000, ge=1, le=3600000)
    """Longest wait between two reads of a request body, milliseconds (nginx
    ``client_body_timeout``): a client that stalls longer gets 408 JSON and the connection
    is closed (a chunked body's connection is closed without an answer)."""


class ScoringSettings(_Section):
    """Health score = (w_queue*q + w_kv*kv + w_latency*lat) / weight, lower is better.

    q = min(queue_depth / queue_norm, 1) ... see docs in README "Scoring"."""

    w_queue: float = 0.5
    w_kv: float = 0.3
    w_latency: float = 0.2
    queue_norm: float = 16.0
    """Queue depth that counts as fully loaded (term = 1)."""
    latency_norm_s: float = 30.0
    """Recent e2e latency (s) that counts as fully loaded (term = 1)."""
    saturation_queue: float = 32.0
    """Queue depth at or above which a node is saturated."""
    saturation_kv: float = 0.98
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
    cache_ttl_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds an edge trusts its cached answer for a valid key; a revoked key stops
    working at most this long after the revocation."""
    negative_ttl_s: float = Field(default=5.0, gt=0, le=3600)
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
    chars_per_token: float = Field(default=4.0, gt=0, le=1000)
    """Prompt characters counted as one token by the up-front estimate."""
    redis_retry_s: float = Field(default=1.0, gt=0, le=3600)
    """After a failed Redis call, seconds the edge uses local buckets and cached keys
    before trying Redis again."""


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
    routes: dict[str, RouteDeadlineSettings] = {}
    """Per path, e.g. ``[deadlines.routes."/v1/embeddings"]`` ``request_ms = 5000``."""

    @field_validator("routes")
    @classmethod
    def _paths(cls, v: dict[str, RouteDeadlineSettings]) -> dict[str, RouteDeadlineSettings]:
        for path in v:
            if path not in API_PATHS:
                raise ValueError(f"deadlines.routes: unknown path {path!r} "
                                 f"(one of {', '.join(API_PATHS)})")
        return v


class ControlPlaneSettings(_Section):
    listen: str = "127.0.0.1:8081"
    """host:port of the admin page and ``/api/v1``."""
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 0.8
    unhealthy_after: int = 3
    """K consecutive failed polls -> unhealthy."""
    healthy_after: int = 2
    """M consecutive good polls -> healthy again."""
    leader_ttl_s: float = 5.0
    metrics_ttl_s: float = 30.0
    history_points: int = 300
    admin_token: str = ""
    drain_timeout_s: float = 600.0
    slow_start_s: float = 30.0
    events_max: int = 10000


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
    max_temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """Requests with a higher ``temperature`` bypass the cache. A request without
    ``temperature`` counts as the API default 1.0, so it is cached with this default."""
    semantic: bool = True
    """Look up paraphrases through the embedder when the exact key misses."""
    embedder_url: str = "http://127.0.0.1:8090"
    """Root of the embedder service (``infergate embedder``), ``http://host:port``."""
    semantic_budget_ms: int = Field(default=150, ge=1, le=10000)
    """Time budget of one semantic lookup (connect, send and read timeouts of the
    subrequest); over it the request goes on to a node with ``X-Cache-Status: BYPASS``."""
    min_similarity: float | None = Field(default=None, ge=0.0, le=1.0)
    """Cosine similarity (0-1) a semantic hit needs; unset = the embedder model's own
    default (0.98 for all-MiniLM-L6-v2 and for use-multilingual-v3, chosen on the
    cache-eval dev sets, see README). 0 is a value."""
    min_similarity_routes: dict[str, float] = {}
    """Per path (``/v1/chat/completions``, ``/v1/completions``), overrides ``min_similarity``."""
    min_similarity_models: dict[str, float] = {}
    """Per requested ``model``, overrides the route and global values."""
    coalesce: bool = True
    """Identical requests that miss at the same time: one goes to a node, the others wait
    for its answer (per edge, shared by the nginx workers)."""
    coalesce_wait_s: float = Field(default=10.0, ge=0.0, le=600.0)
    """Longest wait for the first request's answer; then a waiter goes to a node itself."""
    coalesce_poll_ms: int = Field(default=50, ge=5, le=5000)
    """How often a waiting request looks for the answer in Redis, milliseconds."""
    embedder_model: str = "all-MiniLM-L6-v2"
    """Model ``infergate up`` starts the embedder with (all-MiniLM-L6-v2 or
    use-multilingual-v3, better for Chinese)."""

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
        for path, sim in v.items():
            if path not in ("/v1/chat/completions", "/v1/completions"):
                raise ValueError(f"min_similarity_routes: unknown path {path!r} "
                                 "(/v1/chat/completions or /v1/completions)")
            if not 0.0 <= sim <= 1.0:
                raise ValueError(f"min_similarity_routes[{path!r}]: a number from 0 to 1")
        return v

    @field_validator("min_similarity_models")
    @classmethod
    def _models(cls, v: dict[str, float]) -> dict[str, float]:
        for model, sim in v.items():
            if not 0.0 <= sim <= 1.0:
                raise ValueError(f"min_similarity_models[{model!r}]: a number from 0 to 1")
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

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("node name: letters, digits, '-', '_', '.', at most 63")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
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


def _apply_env(data: dict) -> dict:
    url = os.environ.get("INFERGATE_REDIS_URL")
    if url:
        data.setdefault("redis", {})["url"] = url
    token = os.environ.get("INFERGATE_ADMIN_TOKEN")
    if token:
        data.setdefault("controlplane", {})["admin_token"] = token
    return data


def settings_from_dict(data: dict, source: str = "<dict>") -> Settings:
    """Validate a plain dict (the TOML document) into :class:`Settings`.

    Raises :class:`ConfigError` with every invalid field listed."""
    try:
        return Settings.model_validate(_apply_env(dict(data)))
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines)) from None


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
    return settings_from_dict(data, str(p))
