"""Every Redis key name infergate uses, in one place.

The Lua edge has the same names in ``lua/infergate/redis/keynames.lua``; ``tests/parity/test_keys.py``
checks that both agree. All keys carry ``infergate:`` and the schema version, so a future
layout can live beside this one.

Hash tags (Redis Cluster). Keys that one Lua script or one ``MULTI``/``WATCH`` touches
together must live in one hash slot. Such a group is named after one of its keys whose
name predates the cluster support, ``K``: ``K`` itself keeps its name (a key without
``{}`` hashes its whole name) and the others end in the hash tag ``:{K}`` (hashed on ``K``
alone, e.g. ``infergate:v1:apikeys:ids:{infergate:v1:apikeys}``), so they land in ``K``'s
slot, the existing key needs no rename, and every name still starts with ``infergate:``
(ACL key patterns such as ``~infergate:*`` keep covering them):

- :data:`ROUTING` + :data:`LEADER` + :data:`LEADER_FENCE` (the snapshot is written only
  by the lease holder, in one script);
- :data:`NODES` + :data:`NODES_SEEDED` + :data:`NODE_STATES` + :data:`NODES_GEN` (the
  registry);
- :data:`APIKEYS` + :data:`APIKEY_IDS` + :data:`APIKEYS_MARKER` + :data:`APIKEYS_GEN`
  (written together under ``WATCH``/``MULTI``);
- the token buckets of one API key (``{rl:key:<id>}``) and the two global buckets
  (``{rl:global}``): see :func:`ratelimit_key`.

Every other key is used alone (pipelines of them are split per node by the cluster
clients), so it keeps its name and spreads over the slots by its own hash; cache entries
and vectors are spread entry by entry. The renamed state keys are carried over from their
old names once, at start, by :func:`controlplane.redisdb.migrate.migrate_key_names`.
"""

from __future__ import annotations

PREFIX = "infergate"
SCHEMA = "v1"
BASE = f"{PREFIX}:{SCHEMA}"

#: String, JSON routing snapshot (see ``controlplane.routing.snapshot``). Written by the leader.
ROUTING = f"{BASE}:routing"
#: String, integer counter INCRed for every snapshot written (snapshot ``version``).
ROUTING_VERSION = f"{BASE}:routing:version"
#: Hash tag of the routing group: the snapshot, the leader lease and its fencing counter.
ROUTING_TAG = "{" + ROUTING + "}"
#: String with TTL, the id of the control plane that holds leadership (same slot as
#: :data:`ROUTING`). Before the cluster support: ``infergate:v1:leader`` (a lease, not
#: carried over: the first control plane that starts takes it anew).
LEADER = f"{BASE}:leader:{ROUTING_TAG}"
#: String without TTL (state), integer INCRed each time a control plane takes the lease:
#: the fencing token of the lease (same slot as :data:`LEADER`). Never goes back.
LEADER_FENCE = f"{BASE}:leader_fence:{ROUTING_TAG}"
#: Hash, node name -> JSON node config (url, kind, weight, max_concurrency, ...).
NODES = f"{BASE}:nodes"
#: Hash tag of the registry group (:data:`NODES` and the keys below).
NODES_TAG = "{" + NODES + "}"
#: Set of the names of configured (TOML) nodes the registry was ever seeded with: a
#: configured node is seeded once, so one removed at run time stays removed.
#: Before the cluster support: ``infergate:v1:nodes_seeded``.
NODES_SEEDED = f"{BASE}:nodes_seeded:{NODES_TAG}"
#: Hash, node name -> JSON ``{"state": "active"|"draining"|"drained", "since": epoch_s}``.
#: Before the cluster support: ``infergate:v1:node_states``.
NODE_STATES = f"{BASE}:node_states:{NODES_TAG}"
#: String without TTL (state), integer INCRed by every write of :data:`NODES` or
#: :data:`NODE_STATES` (``controlplane.routing.registry``): the registry's generation.
#: It never goes back in a healthy Redis; lower than a control plane last read, Redis
#: came back from an older snapshot (``controlplane.routing.statecopy``).
NODES_GEN = f"{BASE}:nodes_gen:{NODES_TAG}"
#: List without TTL (state): a token per write of :data:`NODES_GEN`, newest first, capped
#: (``controlplane.redisdb.genlog``): an older Redis that has had as many writes since.
NODES_GEN_LOG = f"{BASE}:nodes_gen_log:{NODES_TAG}"
#: Hash, edge id -> JSON per-edge stats ``{"ts": epoch_s, "nodes": {name: {...}}}``.
EDGES = f"{BASE}:edges"
#: Stream of operator-visible events (drains, health changes, config changes), capped.
EVENTS = f"{BASE}:events"
#: Hash, SHA-256 hex of an API key -> JSON ``{"id", "tenant", "rpm", "tpm", "created", "revoked"}``.
APIKEYS = f"{BASE}:apikeys"
#: Hash tag of the API key group (:data:`APIKEYS` and the keys below).
APIKEYS_TAG = "{" + APIKEYS + "}"
#: Hash, short key id -> SHA-256 hex of the key (listing and revoking by id).
#: Before the cluster support: ``infergate:v1:apikeys:ids``.
APIKEY_IDS = f"{BASE}:apikeys:ids:{APIKEYS_TAG}"
#: String without TTL (state): JSON ``{"written": epoch_s, "n": random hex}``, set with every write of the
#: API keys (create, revoke, limits, import). Missing = the key store was lost (Redis
#: came back empty) or never written: an edge then keeps honouring the valid keys it knew
#: (``lua/infergate/admission/auth.lua``) until a write (``infergate keys import``) sets it.
#: Before the cluster support: ``infergate:v1:apikeys:marker``.
APIKEYS_MARKER = f"{BASE}:apikeys:marker:{APIKEYS_TAG}"
#: String without TTL (state), integer INCRed by every write of an API key record
#: (``controlplane.admin.apikeys``): the key store's generation, as :data:`NODES_GEN`.
APIKEYS_GEN = f"{BASE}:apikeys:gen:{APIKEYS_TAG}"
#: List without TTL (state): the write log of :data:`APIKEYS_GEN`, as :data:`NODES_GEN_LOG`.
APIKEYS_GEN_LOG = f"{BASE}:apikeys:gen_log:{APIKEYS_TAG}"
#: Hash with a TTL (refreshed by every write): control plane id -> JSON ``{"gen": the
#: generation (:data:`APIKEYS_GEN`) of the keys its copy of the state holds, "at": epoch
#: s of that report, "every": its poll interval, s}``
#: (``controlplane.routing.statecopy``). A revocation waits for every fresh report to
#: reach its generation, so that no copy written back after a loss brings the key back.
APIKEYS_COPIES = f"{BASE}:apikeys:copies"
#: Hash of response-cache counters: lookups, hits_exact, hits_semantic, misses, bypass, stores.
CACHE_STATS = f"{BASE}:cache:stats"
#: Prefix of response-cache entries (strings, JSON, with TTL): ``CACHE_ENTRY_PREFIX + exact_key_hex``.
CACHE_ENTRY_PREFIX = f"{BASE}:cache:entry:"
#: Prefix of response-cache index sets: ``CACHE_INDEX_PREFIX + "tenant:" + t`` (also model, namespace).
CACHE_INDEX_PREFIX = f"{BASE}:cache:idx:"
#: List of semantic-index jobs: the edge RPUSHes JSON ``{"key", "namespace", "text", "model",
#: "tenant", "ttl_s"}``, the embedder consumes with BLPOP (docs/internals.md "Semantic cache").
CACHE_INDEX_QUEUE = f"{BASE}:cache:index_queue"
#: Number of shards of the semantic-index queue (:func:`cache_index_queue_shard`).
CACHE_INDEX_QUEUE_SHARDS = 8
#: Prefix of the embedder's vector hashes: ``CACHE_VEC_PREFIX + "<model_slug>:<dim>:" + exact_key_hex``.
CACHE_VEC_PREFIX = f"{BASE}:cache:vec:"
#: Pub/sub channel: the embedder publishes the hash key of every vector it stores, a purge
#: ``-`` + the hash key of every vector it deletes (``controlplane.embedder.vecchannel``).
CACHE_VEC_CHANNEL = f"{BASE}:cache:vec_added"
#: Prefix of the per-namespace cache figures (hashes with TTL, ``CACHE_NS_STATS_PREFIX +
#: namespace_hex``): ``hits_exact``, ``hits_semantic`` (the edge), ``flagged`` (operators),
#: ``verify_queued`` (the edge), ``verified``, ``wrong``, ``verify_errors``, ``win_verified``,
#: ``win_wrong`` (the control plane's online verification, ``controlplane.cache.verify``).
CACHE_NS_STATS_PREFIX = f"{BASE}:cache:ns:"
#: Prefix of the sample question of a semantic namespace (strings, ``CACHE_NS_SAMPLE_PREFIX
#: + namespace_hex``, at most 200 characters), written by the embedder with the TTL of the
#: entry it comes from: a question is never kept past its answer.
CACHE_NS_SAMPLE_PREFIX = f"{BASE}:cache:ns_sample:"
#: Hash with TTL, semantic namespace hex -> how much its semantic threshold is raised above
#: the configured one (float text, 0-1), written by the online verification and added by
#: the embedder to the threshold that decides a hit.
CACHE_THRESHOLD_RAISE = f"{BASE}:cache:threshold_raise"
#: Prefix of the marks of dropped entries (strings with TTL, value the namespace hex):
#: ``CACHE_DROPPED_PREFIX + exact_key_hex``, so flagging an entry again is a no-op.
CACHE_DROPPED_PREFIX = f"{BASE}:cache:dropped:"
#: List with TTL, capped: semantic hits to verify, JSON ``{"key", "namespace", "path",
#: "model", "tenant", "body", "ts"}`` RPUSHed by the edge, taken by the control plane.
CACHE_VERIFY_QUEUE = f"{BASE}:cache:verify_queue"
#: Prefix of the edge's token buckets (hashes ``tokens``, ``ts``; expire once full), named
#: by :func:`ratelimit_key` / :func:`ratelimit_global`.
RATELIMIT_PREFIX = f"{BASE}:ratelimit:"
#: Hash (TTL one day, renewed by every write), tenant -> its virtual token counter of the
#: fair share (float text: tokens served / weight, with the lifts), HINCRBYFLOAT by the
#: edges' flush queues (``lua/infergate/admission/vtc.lua``).
FAIRSHARE_COUNTERS = f"{BASE}:fairshare:vtc"
#: List with TTL (cache kind), newest first, capped: one JSON point per interval of the
#: pool's traffic (requests, cache, latency histogram, shed, rate limits, per-node
#: requests/failures), written by the leader control plane (``controlplane.routing.series``).
OVERVIEW_SERIES = f"{BASE}:overview:series"

#: String without TTL (state): JSON ``{"created": epoch_s, "by": control plane id}``, set
#: (``SET NX``) by the first control plane that finds it missing. Missing after it was
#: seen means Redis came back empty (``controlplane.routing.service``).
STATE_MARKER = f"{BASE}:state_marker"
#: ``SET NX`` (with a TTL) by the control plane that writes its copy of the state back
#: after a loss, one per value of :data:`STATE_MARKER` (its text is appended): the others
#: that notice the same loss write nothing (controlplane/routing/statecopy.py).
STATE_RESTORE_CLAIM_PREFIX = f"{BASE}:state_restore:"

#: String with TTL: JSON ``{"instance_id", "pid", "host", "since"}`` of the running
#: ``infergate up`` that owns this Redis' node registry, refreshed by it every few
#: seconds; another ``up`` refuses to write the registry while it lives (``--take-over``).
STACK_OWNER = f"{BASE}:stack_owner"
#: Hash (cache kind: TTL renewed by every write), control plane id -> JSON ``{"ts":
#: epoch_s, "addresses": [{"what", "host", "port"}]}``: the addresses the running stack
#: serves on, so that no writer of the registry takes one for a node
#: (``controlplane.routing.ownaddrs``).
STACK_ADDRESSES = f"{BASE}:stack_addresses"
#: Prefix of the admin page's login sessions (strings with TTL, value ``"1"``):
#: ``ADMIN_SESSION_PREFIX + session id``; logging out deletes the key.
ADMIN_SESSION_PREFIX = f"{BASE}:admin:session:"

#: The state keys: configuration, never given a TTL, never evicted (``volatile-lru``),
#: kept across restarts by Redis' append-only file. The leader lock is state too but has
#: its own TTL. The routing snapshot and its version counter are here as well: small,
#: rewritten by the leader, and the version must never go back because of an eviction.
#: Every other key is cache kind and always carries a TTL.
STATE_KEYS = frozenset({
    ROUTING, ROUTING_VERSION, NODES, NODES_SEEDED, NODE_STATES, NODES_GEN, NODES_GEN_LOG,
    EVENTS, APIKEYS, APIKEY_IDS, APIKEYS_MARKER, APIKEYS_GEN, APIKEYS_GEN_LOG, STATE_MARKER,
    LEADER_FENCE,
})

#: State keys renamed for Redis Cluster hash tags: old name -> new name. Carried over
#: once at start (:mod:`controlplane.redisdb.migrate`); the old names are never written.
RENAMED = {
    f"{BASE}:nodes_seeded": NODES_SEEDED,
    f"{BASE}:node_states": NODE_STATES,
    f"{BASE}:apikeys:ids": APIKEY_IDS,
    f"{BASE}:apikeys:marker": APIKEYS_MARKER,
}

#: The key groups that one script or transaction touches together: each shares one slot.
SLOT_GROUPS = {
    "routing": (ROUTING, LEADER, LEADER_FENCE),
    "registry": (NODES, NODES_SEEDED, NODE_STATES, NODES_GEN, NODES_GEN_LOG),
    "apikeys": (APIKEYS, APIKEY_IDS, APIKEYS_MARKER, APIKEYS_GEN, APIKEYS_GEN_LOG),
}


def node_metrics(name: str) -> str:
    """String with TTL: JSON of the node's latest polled metrics and health."""
    return f"{BASE}:node:{name}:metrics"


def node_history(name: str) -> str:
    """List, newest first, capped: JSON points ``{"ts", "queue_depth", "running",
    "kv_cache_usage", "e2e_avg_s", "ttft_avg_s", "score", "healthy"}``."""
    return f"{BASE}:node:{name}:history"


def cache_entry(exact_key_hex: str) -> str:
    """String with TTL: JSON cache entry ``{"tenant", "model", "namespace", "created", "ttl", "body"}``."""
    return f"{CACHE_ENTRY_PREFIX}{exact_key_hex}"


def cache_ns_stats(namespace_hex: str) -> str:
    """Hash with TTL: the cache figures of one semantic namespace (see
    :data:`CACHE_NS_STATS_PREFIX`)."""
    return f"{CACHE_NS_STATS_PREFIX}{namespace_hex}"


def cache_ns_sample(namespace_hex: str) -> str:
    """String with TTL (that of the entry it was taken from): a question stored in the
    namespace, its first 200 characters (see :data:`CACHE_NS_SAMPLE_PREFIX`)."""
    return f"{CACHE_NS_SAMPLE_PREFIX}{namespace_hex}"


def cache_dropped(exact_key_hex: str) -> str:
    """String with TTL (the dropped entry's remaining lifetime): its namespace hex."""
    return f"{CACHE_DROPPED_PREFIX}{exact_key_hex}"


def cache_vec_prefix(model_slug: str, dim: int) -> str:
    """Prefix of the vector hashes of one embedding model and dimension (never mixed)."""
    return f"{CACHE_VEC_PREFIX}{model_slug}:{dim}:"


def cache_vec(model_slug: str, dim: int, exact_key_hex: str) -> str:
    """Hash with TTL: ``namespace``, ``key``, ``text``, ``vec`` (float32 bytes) of one entry."""
    return f"{cache_vec_prefix(model_slug, dim)}{exact_key_hex}"


def cache_vec_index(model_slug: str, dim: int) -> str:
    """Name of the Redis search index (FT.CREATE) over ``cache_vec_prefix(model_slug, dim)``."""
    return f"{BASE}:cache:vecidx:{model_slug}:{dim}"


def ratelimit_key(key_id: str, kind: str) -> str:
    """Hash with TTL: the ``kind`` (``rpm`` | ``tpm``) token bucket of one API key. Both
    buckets of a key share the tag ``{rl:key:<id>}``: one script charges them together,
    and different keys spread over the slots."""
    return f"{RATELIMIT_PREFIX}{{rl:key:{key_id}}}:{kind}"


def ratelimit_global(kind: str) -> str:
    """Hash with TTL: the global ``kind`` (``rpm`` | ``tpm``) token bucket (tag ``{rl:global}``)."""
    return f"{RATELIMIT_PREFIX}{{rl:global}}:{kind}"


def cache_index_queue_shard(shard: int) -> str:
    """List of semantic-index jobs of one shard (0 .. :data:`CACHE_INDEX_QUEUE_SHARDS` - 1):
    the edge pushes a job to the shard of its tenant (with API keys) or of its entry, so
    one tenant's flood fills its own shard, and the embedder takes from every shard in
    turn. Hash-tagged on :data:`CACHE_INDEX_QUEUE` (one slot with it: one ``BLPOP`` waits
    on all of them); :data:`CACHE_INDEX_QUEUE` itself is still consumed (jobs of older
    edges)."""
    return f"{CACHE_INDEX_QUEUE}:{shard}:{{{CACHE_INDEX_QUEUE}}}"


def cache_index_queues() -> list[str]:
    """Every list the embedder consumes: the shards, then :data:`CACHE_INDEX_QUEUE`."""
    return [cache_index_queue_shard(i) for i in range(CACHE_INDEX_QUEUE_SHARDS)] + [
        CACHE_INDEX_QUEUE]


def cache_index(dimension: str, value: str) -> str:
    """Set of exact key hexes whose entry has ``dimension`` (tenant | model | namespace) = value."""
    return f"{CACHE_INDEX_PREFIX}{dimension}:{value}"


#: Every fixed key name, by the name used in ``lua/infergate/redis/keynames.lua``.
FIXED = {
    "routing": ROUTING,
    "routing_version": ROUTING_VERSION,
    "leader": LEADER,
    "leader_fence": LEADER_FENCE,
    "nodes": NODES,
    "nodes_seeded": NODES_SEEDED,
    "node_states": NODE_STATES,
    "edges": EDGES,
    "events": EVENTS,
    "apikeys": APIKEYS,
    "apikey_ids": APIKEY_IDS,
    "apikeys_marker": APIKEYS_MARKER,
    "cache_stats": CACHE_STATS,
    "cache_entry_prefix": CACHE_ENTRY_PREFIX,
    "cache_index_prefix": CACHE_INDEX_PREFIX,
    "cache_index_queue": CACHE_INDEX_QUEUE,
    "cache_vec_prefix_base": CACHE_VEC_PREFIX,
    "cache_vec_channel": CACHE_VEC_CHANNEL,
    "cache_ns_stats_prefix": CACHE_NS_STATS_PREFIX,
    "cache_ns_sample_prefix": CACHE_NS_SAMPLE_PREFIX,
    "cache_threshold_raise": CACHE_THRESHOLD_RAISE,
    "cache_verify_queue": CACHE_VERIFY_QUEUE,
    "cache_dropped_prefix": CACHE_DROPPED_PREFIX,
    "ratelimit_prefix": RATELIMIT_PREFIX,
    "fairshare_counters": FAIRSHARE_COUNTERS,
    "overview_series": OVERVIEW_SERIES,
    "state_marker": STATE_MARKER,
}
