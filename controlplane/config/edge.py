"""The ``[redis]`` and ``[edge]`` sections."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from controlplane.config.base import _Section
from controlplane.config.hostport import HostPort


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
    (``$SSL_CERT_FILE`` when set, else ``/etc/ssl/certs/ca-certificates.crt``, at the
    edge). The edge renders it as
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
    state_dir: str = Field(default="", max_length=4096)
    """Folder for the edge's last known good state (the last routing snapshot, the key
    store's records), read when nginx starts while Redis is unreachable; nginx's worker
    user must be able to write to it. Empty = ``infergate-state`` under nginx's prefix
    (created by ``infergate render``)."""
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
    client_body_buffer_size: str = Field(default="1m", pattern=r"^[1-9][0-9]*[kKmMgG]?$")
    """nginx ``client_body_buffer_size``: a body up to this size is read into memory, a
    larger one goes to a temporary file under nginx's ``client_body_temp_path`` (read back
    once for validation; plain nginx keeps it there too, and logs a ``[warn]`` "a client
    request body is buffered to a temporary file" for each). It bounds what a slow upload
    holds in memory per connection while it arrives: with the whole 8 MB
    ``client_max_body_size`` in memory, each connection trickling an 8 MB body held about
    7.6 MB of an nginx worker until the body timeout."""
    breaker_failures: int = Field(default=5, ge=1, le=10000)
    """Consecutive failures that open a node's circuit breaker."""
    breaker_cooldown_s: float = Field(default=10.0, ge=0, le=86400)
    """How long a breaker stays open before one half-open probe, seconds (when every node
    of a request's model has its breaker open, a probe goes after 1 s: the edge's
    ``breaker.ALONE_PROBE_S``)."""
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
    stall_gap_factor: float = Field(default=5.0, ge=0, le=1000)
    """Proof of life: a node that has streams of this edge in the middle of their answer
    and sent no byte at all for longer than this many times its usual largest gap between
    two chunks of an answer (a p90 estimate), at least ``stall_min_s``, is **stalled**
    (a frozen or hung process still accepts connections): no new request from this edge
    until a byte comes again (then one probe request at a time), and the control plane
    reports it ``stalled`` instead of busy; 0 = off."""
    stall_min_s: float = Field(default=1.5, ge=0.2, le=3600)
    """Floor of the stall threshold above, seconds."""
    liveness_check: bool = True
    """Before a node found stalled or a TTFB outlier gets a client request as its
    half-open probe, the edge asks it ``GET /health`` itself (plain http nodes given by
    IP): a frozen process, which accepts connections and answers nothing, then gets no
    client request at all until it answers (anything at all, within twice its stall
    threshold, 3-10 s), for at most 30 s after it was found silent (the circuit breaker's
    probe waits for it too); streams still waiting for their first byte there are retried
    elsewhere once it fails the check. false = the half-open probes alone."""
    liveness_suspect_s: float = Field(default=1.0, ge=0, le=3600)
    """Seconds a node may be quiet (a request of this edge waiting for its first byte, no
    byte at all from the node) before the edge asks it ``GET /health`` without waiting for
    the TTFB outlier threshold: no answer within 1 s (a running engine answers it at once,
    busy or not) finds the node silent then, so a frozen node stops getting requests about
    2 s after it froze; an answer changes nothing. Needs ``liveness_check`` and outlier
    detection on; 0 = no early check."""
    stall_first_byte_s: float = Field(default=10.0, ge=0, le=3600)
    """A stream sent to a node while another node is left to retry on reads with a
    timeout of at least this many seconds (more when the node's usual time to first
    chunk or its stall threshold asks for it: twice those): a node frozen while the
    request waited for its first byte then has it retried on another node, within the
    request's deadline, instead of holding it to the deadline. A stream that already
    sent bytes to the client cannot move: silent that long, it ends as it would at its
    deadline. 0 = off (the read timeout is the deadline's)."""
    stream_relay: bool = True
    """Streamed ``/v1/chat/completions`` and ``/v1/completions`` requests to http nodes
    are driven by the edge itself (lua/infergate/stream/relay.lua, docs/streams.md) so
    that they survive their node: retried on another node before the first content
    token, continued after it; false = nginx's proxy path (a stream cut when its node
    fails)."""
    answer_relay: bool = True
    """``/v1/chat/completions`` and ``/v1/completions`` requests that are not streams, to
    http nodes, for a model that two usable nodes serve (with one there is nowhere to
    retry), are driven by the edge too (lua/infergate/stream/answer.lua): a node that
    freezes while it holds one (found silent, no answer to its liveness check) has it
    retried on another node before the request's deadline, which nginx's proxy path
    cannot do once the request was sent; its connections to the nodes are pooled as
    the proxy path's (``keepalive``). false = nginx's proxy path."""
    stream_hold_s: float = Field(default=2.0, ge=0, le=60)
    """Longest time (seconds) the relay holds the headers and role-only chunk of a stream
    while waiting for its first content token; the first token goes out the moment it
    arrives, so holding costs a healthy stream nothing. Held, a failure before content
    is invisible to the client; past it the headers go out (a failure before content
    is still retried). 0 = no holding."""
    stream_continue: bool = True
    """A relayed stream that breaks after content was sent is continued on another node
    (the partial answer as an assistant message to continue, max_tokens reduced) and
    spliced into the same client stream; false = it ends with an SSE error event."""
    stream_continue_models: list[str] | None = Field(default=None, max_length=1000)
    """Models whose streams are continued (``stream_continue``); unset or empty = every
    model."""
    stream_continue_max: int = Field(default=2, ge=0, le=10)
    """Most continuations of one stream (each on another node)."""
    shutdown_stream_s: float = Field(default=0.0, ge=0, le=86400)
    """Once nginx shuts down (SIGQUIT, ``nginx -s quit``), how long (seconds) a relayed
    stream that has sent its headers may go on: past it, it ends with an SSE error event
    (code ``shutting_down``) and ``data: [DONE]``, so that whatever stops nginx outright
    later (a service manager's timeout, ``infergate up``'s 10 s) does not cut it without
    a word. 0 = streams run to their end, as nginx lets them. ``infergate up`` sets 7."""
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

    lua_package_path_extra: str = Field(default="", max_length=4096,
                                        pattern=r"""^[^"'\\\s]*$""")
    """Lua module paths of the site's own, put before infergate's in the
    ``lua_package_path`` the http include sets (nginx allows one per ``http {}``), e.g.
    ``"/srv/shop/lua/?.lua;"``: kept at every render, unlike a hand edit of the file."""
    init_lua_file: str = Field(default="", max_length=4096)
    """Absolute path of a Lua file of the site's own that the http include's
    ``init_by_lua_block`` runs first (``dofile``; nginx allows one block per ``http {}``):
    an existing OpenResty site's init code, kept at every render. Empty = none."""
    init_worker_lua_file: str = Field(default="", max_length=4096)
    """As ``init_lua_file``, for ``init_worker_by_lua_block``."""

    @field_validator("init_lua_file", "init_worker_lua_file")
    @classmethod
    def _lua_file(cls, v: str) -> str:
        if v and (not v.startswith("/") or any(c in v for c in "\0\n\r")):
            raise ValueError("must be an absolute path to a Lua file (or empty)")
        return v

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, v: str) -> str:
        v = v.strip()
        return HostPort.parse(v, "edge.metrics_listen") if v else ""
