-- Requests seen running alongside each other: what a node runs at once, from evidence
-- that answer lengths cannot blur.
--
-- An attempt that started with k of this edge's requests in flight on its node (itself
-- included; infergate.routing.speed.track) and got its first byte before any attempt of
-- this edge on that node ended was run together with the k - 1 before it: a node starts
-- requests in the order they came (vLLM's and SGLang's waiting queue, llama.cpp's task
-- queue are first come, first served), so had it run fewer than k at once, this one
-- would have waited for an earlier one to end. The node then runs at least k at once,
-- whatever the answers' lengths; the levels of answer times that
-- infergate.routing.speed fits are blurred by them (a fifth of long answers among short
-- ones reads a batch-4 node anywhere from 1 to 8). Attempts ended are counted as
-- started ("rq:") minus in flight ("if:", infergate.routing.stats): an attempt that
-- starts in another worker between the two reads can hide one end, so a level counts once
-- seen twice (the lower of two sightings above the floor).
--
-- Waits: a stream's first byte is its first token, sent once the request runs
-- (llama-server: tests/engine/test_llamacpp_at_once.py; vLLM's chat stream sends its
-- first chunk, the role, on the engine's first output), so one that started with k
-- above the floor and got it only after an earlier attempt ended most likely waited for
-- that slot (or another ended during its prefill: short answers behind a long prompt);
-- CAP_RUN such waits in a row above the floor (no start alongside in between) cap what
-- the node runs at once at the floor (1 without one): a node of max_concurrency 64 that
-- runs one request at a time, or a batch-4 node whose answer times read 6. A
-- non-stream's first byte is its whole answer, during which others end anyway: a start
-- alongside counts, a wait does not. Both count only for attempts answered 2xx
-- (speed.observe): an error answered at once says nothing of the node's slots.
--
-- at_once(name) -> floor (the highest level so confirmed, or nil), capped (boolean): kept
-- TTL_S after the floor was last seen or the cap set (a node restarted with a smaller
-- batch stops showing its floor). Where the node's metrics have shown no queue, the room
-- rule (infergate.routing.room) takes what a node runs at once as at least the floor,
-- and at most the floor when capped, within the node's prior (known slots, else
-- max_concurrency).
--
-- Shared dict infergate_stats: "ak:<node>" 2 x the floor (0 without one) + 1 when capped
-- (one read per use), "ap:<node>" a level seen once, "aw:<node>" the waits in a row
-- above the floor. No I/O: safe in every phase.
local config = require("infergate.core.config")
local key = require("infergate.core.memo").keyer()
local stats = require("infergate.routing.stats")

local _M = {}

_M.TTL_S = 600
_M.CAP_RUN = 8

local shared = ngx.shared
local floor = math.floor

-- Balancer phase, with att.k just set: the attempts ended so far on the node.
function _M.track(att)
    att.e0 = stats.requests(att.node) - att.k
end

-- First byte of attempt `att`: whether an attempt on its node ended since it started
-- (att.waited), for learn().
function _M.first_byte(att)
    if att.e0 and att.k and att.k >= 2 then
        att.waited = stats.requests(att.node) - stats.inflight(att.node) > att.e0
    end
end

-- A start alongside at level k above the floor f (0: none) of node `name`, capped or not.
local function sighting(d, name, k, f, capped)
    d:delete(key("aw:", name))
    local fk = key("ak:", name)
    if capped then
        d:set(fk, 2 * f, _M.TTL_S)
    end
    local pk = key("ap:", name)
    local p = d:get(pk)
    if not p then
        d:set(pk, k, _M.TTL_S)
        return
    end
    local lo, hi = p, k
    if hi < lo then
        lo, hi = hi, lo
    end
    if lo > f then
        d:set(fk, 2 * lo, _M.TTL_S)
    end
    if hi > lo then
        d:set(pk, hi, _M.TTL_S)
    else
        d:delete(pk)
    end
end

-- Log phase, attempt `att` answered 2xx (infergate.routing.speed.observe).
function _M.learn(att)
    local waited = att.waited
    if waited == nil then
        return
    end
    local d = shared[config.DICT_STATS]
    local name, k = att.node, att.k
    local fk = key("ak:", name)
    local v = d:get(fk) or 0
    local f = floor(v / 2)
    local capped = v - 2 * f == 1
    if k <= (f > 0 and f or 1) then
        if k == f and not waited then
            d:expire(fk, _M.TTL_S)
        end
    elseif not waited then
        sighting(d, name, k, f, capped)
    elseif att.stream and not capped then
        local n = d:incr(key("aw:", name), 1, 0, _M.TTL_S)
        if n and n >= _M.CAP_RUN then
            d:set(fk, 2 * f + 1, _M.TTL_S)
        end
    end
end

-- What node `name` was seen running at once: floor (nil: none), capped (see the top).
function _M.at_once(name)
    local v = shared[config.DICT_STATS]:get(key("ak:", name))
    if not v then
        return nil, false
    end
    local f = floor(v / 2)
    return f > 0 and f or nil, v - 2 * f == 1
end

return _M
