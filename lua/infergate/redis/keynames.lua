-- Every Redis key name the edge uses. Mirrors controlplane/redisdb/keynames.py (tests compare both),
-- hash tags included: keys one script or transaction touches together share a slot (a group
-- is named after its oldest key K; the others end in ":{K}"), see that file.
local _M = {}

local BASE = "infergate:v1"
_M.BASE = BASE

_M.routing = BASE .. ":routing"
_M.routing_version = BASE .. ":routing:version"
local ROUTING_TAG = "{" .. _M.routing .. "}"
_M.leader = BASE .. ":leader:" .. ROUTING_TAG
_M.leader_fence = BASE .. ":leader_fence:" .. ROUTING_TAG
_M.nodes = BASE .. ":nodes"
local NODES_TAG = "{" .. _M.nodes .. "}"
_M.nodes_seeded = BASE .. ":nodes_seeded:" .. NODES_TAG
_M.node_states = BASE .. ":node_states:" .. NODES_TAG
_M.edges = BASE .. ":edges"
_M.events = BASE .. ":events"
_M.apikeys = BASE .. ":apikeys"
local APIKEYS_TAG = "{" .. _M.apikeys .. "}"
_M.apikey_ids = BASE .. ":apikeys:ids:" .. APIKEYS_TAG
-- Set with every write of the API keys; missing = the key store was lost (auth.lua).
_M.apikeys_marker = BASE .. ":apikeys:marker:" .. APIKEYS_TAG
_M.cache_stats = BASE .. ":cache:stats"
_M.cache_entry_prefix = BASE .. ":cache:entry:"
_M.cache_index_prefix = BASE .. ":cache:idx:"
_M.cache_index_queue = BASE .. ":cache:index_queue"
-- Shards of the semantic-index queue (controlplane.redisdb.keynames.cache_index_queue_shard).
_M.CACHE_INDEX_QUEUE_SHARDS = 8
_M.cache_vec_prefix_base = BASE .. ":cache:vec:"
_M.cache_vec_channel = BASE .. ":cache:vec_added"
-- Per-namespace cache figures (hashes with TTL), the threshold raises of the online
-- verification (read by the embedder) and the queue of semantic hits to verify.
_M.cache_ns_stats_prefix = BASE .. ":cache:ns:"
-- Written by the embedder only: a namespace's sample question (TTL of its entry).
_M.cache_ns_sample_prefix = BASE .. ":cache:ns_sample:"
_M.cache_threshold_raise = BASE .. ":cache:threshold_raise"
_M.cache_verify_queue = BASE .. ":cache:verify_queue"
-- Written by the control plane only: marks of entries dropped as wrong.
_M.cache_dropped_prefix = BASE .. ":cache:dropped:"
_M.ratelimit_prefix = BASE .. ":ratelimit:"
-- The fair share's virtual token counters: tenant -> float (infergate.admission.vtc).
_M.fairshare_counters = BASE .. ":fairshare:vtc"
-- Written by the control plane only (the overview's time series); named here so both agree.
_M.overview_series = BASE .. ":overview:series"
-- Written by the control plane only: present while Redis kept its state (no TTL).
_M.state_marker = BASE .. ":state_marker"

function _M.node_metrics(name)
    return BASE .. ":node:" .. name .. ":metrics"
end

function _M.node_history(name)
    return BASE .. ":node:" .. name .. ":history"
end

function _M.cache_entry(exact_key_hex)
    return _M.cache_entry_prefix .. exact_key_hex
end

function _M.cache_ns_stats(namespace_hex)
    return _M.cache_ns_stats_prefix .. namespace_hex
end

function _M.cache_ns_sample(namespace_hex)
    return _M.cache_ns_sample_prefix .. namespace_hex
end

function _M.cache_dropped(exact_key_hex)
    return _M.cache_dropped_prefix .. exact_key_hex
end

function _M.cache_vec_prefix(model_slug, dim)
    return _M.cache_vec_prefix_base .. model_slug .. ":" .. dim .. ":"
end

function _M.cache_vec(model_slug, dim, exact_key_hex)
    return _M.cache_vec_prefix(model_slug, dim) .. exact_key_hex
end

function _M.cache_vec_index(model_slug, dim)
    return BASE .. ":cache:vecidx:" .. model_slug .. ":" .. dim
end

-- Token buckets: both of one API key share the tag {rl:key:<id>}, the global ones {rl:global}.
function _M.ratelimit_key(key_id, kind)
    return _M.ratelimit_prefix .. "{rl:key:" .. key_id .. "}:" .. kind
end

function _M.ratelimit_global(kind)
    return _M.ratelimit_prefix .. "{rl:global}:" .. kind
end

function _M.cache_index(dimension, value)
    return _M.cache_index_prefix .. dimension .. ":" .. value
end

-- List of semantic-index jobs of shard 0 .. CACHE_INDEX_QUEUE_SHARDS - 1, hash-tagged on
-- the queue's own name (one slot with it).
local QUEUE_TAG = "{" .. _M.cache_index_queue .. "}"
function _M.cache_index_queue_shard(shard)
    return _M.cache_index_queue .. ":" .. shard .. ":" .. QUEUE_TAG
end

-- Every list the embedder consumes: the shards, then cache_index_queue.
function _M.cache_index_queues()
    local out = {}
    for i = 0, _M.CACHE_INDEX_QUEUE_SHARDS - 1 do
        out[#out + 1] = _M.cache_index_queue_shard(i)
    end
    out[#out + 1] = _M.cache_index_queue
    return out
end

return _M
