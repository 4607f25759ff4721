"""The edge's admission sections: ``[auth]``, ``[limits]``, ``[admission]``,
``[deadlines]``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from controlplane.config.base import _Section, key_message


#: Output tokens reserved per request.
MaxTokens = Annotated[int, Field(ge=0, le=10_000_000)]


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
    used; a key with no cached answer then gets 503 (never let through). While Redis
    answers without its key store (it came back empty: no ``apikeys:marker``), the valid
    keys an edge knew keep working until the keys are restored; revoked keys stay refused."""
    fail_burst: int = Field(default=50, ge=0, le=1_000_000)
    """Unknown or revoked keys a client address may try at once before its lookups are
    refused without asking Redis (429 ``auth_throttled``, ``Retry-After``); 0 = no limit.
    Keys the edge has cached are answered from memory and never count."""
    fail_rate_per_s: float = Field(default=5.0, gt=0, le=1_000_000)
    """Failed key lookups an address regains per second (the refill of ``fail_burst``)."""


class LimitSettings(_Section):
    """Token-bucket rate limits, shared by every edge through Redis.

    Per key: the key's ``rpm`` (requests per minute) and ``tpm`` (tokens per minute) from
    ``infergate keys``. Each bucket holds at most its per-minute limit and refills evenly.
    Tokens are estimated up front as ceil(prompt characters / ``chars_per_token``), times
    what the key's prompts on that model were billed per estimated token once three
    answers taught it (1 to 8), and corrected with the response's ``usage.total_tokens``
    afterwards. Redis down: each edge
    enforces the limits on its own (so N edges allow up to N times the limit)."""

    enabled: bool = True
    """Check the per-key and global buckets (429 ``rate_limit_exceeded`` when empty)."""
    global_rpm: int = Field(default=0, ge=0, le=10**9)
    """Requests per minute across all clients and edges; 0 = no global limit."""
    global_tpm: int = Field(default=0, ge=0, le=10**12)
    """Tokens per minute across all clients and edges; 0 = no global limit."""
    chars_per_token: float = Field(default=4.0, ge=0.01, le=1000)
    """Prompt characters counted as one token by the up-front estimate (the prior: the
    edge raises the estimate of a key whose answers bill more, never lowers it)."""
    default_max_tokens: int = Field(default=256, ge=0, le=10_000_000)
    """Output tokens a chat or completions request without ``max_tokens`` /
    ``max_completion_tokens`` reserves from the token buckets at admission (with
    ``max_tokens``: that many, times ``n``); settled on the answer's usage, the unused
    part goes back. 0 = reserve the prompt only."""
    model_max_tokens: dict[str, MaxTokens] = {}
    """Per model, instead of ``default_max_tokens``, e.g. ``[limits.model_max_tokens]``
    ``"llama-3-8b" = 1024``."""
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


Priority = Literal["critical", "standard", "sheddable"]


class TenantShare(_Section):
    """A tenant's default share (``[admission.tenants.<tenant>]``); a key's own weight
    and priority (``infergate keys edit ID --weight 2 --priority critical``) win."""

    weight: float | None = Field(default=None, ge=0.01, le=1000)
    """Weight of the tenant's keys in the fair share (tokens served count / weight)."""
    priority: Priority | None = None
    """Class of the tenant's keys: ``critical`` (served first, shed last), ``standard``,
    ``sheddable``."""


class AdmissionSettings(_Section):
    """Load shedding at the edge: when every eligible node is saturated (snapshot
    ``saturated`` from the ``[scoring]`` caps, or this edge's in-flight count at the node's
    ``max_concurrency``), a new request waits briefly for capacity, then gets 429 with
    ``Retry-After`` (``type: "server_overloaded"``) instead of queueing into a timeout.
    A node's known slots (llama.cpp's ``total_slots``, or a ``max_concurrency`` set to
    another value than its default) are a hard limit: requests beyond them wait at the
    edge in arrival order until a slot frees, and get the 429 as soon as their deadline
    cannot be met. Cache hits are answered before this check."""

    shed: bool = True
    """Shed load as above; off: requests always go to a node and queue there (known
    slots are not enforced then)."""
    max_wait_ms: int = Field(default=500, ge=0, le=60000)
    """Longest wait for capacity before the 429, milliseconds (never past the deadline).
    For a node with known slots and a deadline, the request waits for as long as its
    deadline can still be met (at least this long)."""
    poll_ms: int = Field(default=20, ge=1, le=1000)
    """How often a waiting request checks for capacity again, milliseconds."""
    retry_after_s: int = Field(default=1, ge=1, le=3600)
    """``Retry-After`` of the 429, whole seconds."""
    deadline_fraction: float = Field(default=1.0, gt=0, le=1)
    """With ``edge.node_cost = "expected_delay"`` and a deadline: a request is admitted
    while the best node's predicted completion (its expected delay, s) is at most this
    fraction of the time left before the deadline, and waits, then gets the 429, past
    it (below 1: a margin for answers longer than the mean, at the price of more 429s).
    A request is never shed while a node is below its ``max_concurrency``."""
    fair_share: bool = True
    """In a pool with known slots, requests that wait for a slot wait per tenant and
    class and the free slots go to the highest class first, then to the tenant with the
    fewest tokens served / weight (virtual token counters shared by the edges through
    Redis, docs/admission.md "Fair share"); off: one queue, first come first served."""
    tenant_queue_max: int = Field(default=64, ge=1, le=100000)
    """Most requests of one tenant and class waiting for a slot on an edge; past it the
    fast 429 ``tenant_queue_full`` (fair share only)."""
    default_weight: float = Field(default=1.0, ge=0.01, le=1000)
    """Fair-share weight of a key without its own and no ``[admission.tenants]`` entry."""
    default_priority: Priority = "standard"
    """Priority class of a key without its own and no ``[admission.tenants]`` entry."""
    tenants: dict[str, TenantShare] = {}
    """Default weight and priority per tenant, e.g. ``[admission.tenants.acme]``
    ``weight = 2``."""
    forward_priority: bool = False
    """Send the request's class to engines that schedule by priority (vLLM with
    ``--scheduling-policy priority``, SGLang with ``--enable-priority-scheduling``) as
    their ``priority`` field, with each engine's sign; never to other kinds."""


#: The API paths the edge serves (locations of nginx/infergate-server.conf.j2).
API_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models")

#: More API paths the edge proxies to a node serving the request's model, never cached
#: (each its own location of nginx/infergate-server.conf.j2; any other /v1/ path has the
#: prefix location /v1/).
PROXIED_API_PATHS = ("/v1/responses", "/v1/rerank", "/rerank", "/v1/score",
                     "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech",
                     "/tokenize", "/detokenize")
#: Of these, the ones that use no slot of the engine (no admission wait at the edge).
TOKENIZER_PATHS = ("/tokenize", "/detokenize")

#: Paths that may have a deadline of their own (``[deadlines.routes."<path>"]``).
DEADLINE_PATHS = (*API_PATHS, *PROXIED_API_PATHS)


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
        default={}, json_schema_extra={"keys": {"enum": list(DEADLINE_PATHS), "name": "path"}})
    """Per path, e.g. ``[deadlines.routes."/v1/embeddings"]`` ``request_ms = 5000``."""

    @field_validator("routes")
    @classmethod
    def _paths(cls, v: dict[str, RouteDeadlineSettings]) -> dict[str, RouteDeadlineSettings]:
        for path in v:
            if path not in DEADLINE_PATHS:
                raise ValueError(key_message("deadlines.routes", path, DEADLINE_PATHS, "path"))
        return v
