-- Requests seen running alongside each other: what a node runs at once, from evidence
-- that answer lengths cannot blur.
--
-- An attempt that started while k - 1 of this edge's attempts on its node had their
-- first byte (a stream's first token: they run there; "rf:<node>") and got its own
-- before any attempt of this edge on that node ended was run together with those k - 1:
-- a node starts requests in the order they came (vLLM's and SGLang's waiting queue,
-- llama.cpp's task queue are first come, first served), so had it run fewer than k at
-- once, this one would have waited for one of them to end. (Attempts merely in flight do
-- not count: sent at the same moment, a later one can reach the node first and take the
-- slot an earlier one then waits for.) The node then runs at least k at once, whatever
-- the answers' lengths; the levels of answer times that
-- infergate.routing.speed fits are blurred by them (a fifth of long answers among short
-- ones reads a batch-4 node anywhere from 1 to 8). The edge counts an attempt ended
-- when it releases it (infergate.routing.stats.release), a little after the node sent
-- its last byte, and a node can start the next request and send its first chunk within
-- a few milliseconds of that (llama-server with a cached prompt: a three-slot server
-- read as four): an end the edge counts within SETTLE_S after the first byte also
-- counts as before it. Each node's ends are numbered ("ae#:<node>", the time of the
-- last RING of them by number, "ec:<node>" the count); an attempt whose first end after
-- its first byte is no longer kept is not counted either way. A level counts once seen
-- twice (the lower of two sightings above the floor).
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
-- above the floor, "rf:<node>" the attempts running, "ec:<node>" and "ae#:<node>" the
-- ends. No I/O: safe in every phase.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local memo = require("infergate.core.memo")
local ngx_now = ngxapi.now

local _M = {}

_M.TTL_S = 600
_M.CAP_RUN = 8
_M.SETTLE_S = 0.05
_M.RING = 32

local shared = ngx.shared
local floor = math.floor
local key = memo.keyer()
local ring_prefix = {}
for i = 0, _M.RING - 1 do
    ring_prefix[i] = "ae" .. i .. ":"
end

local function dict()
    return shared[config.DICT_STATS]
end

-- Balancer phase, after stats.open_attempt: the attempts running on the node (their
-- first byte in) and the ends so far.
function _M.track(att)
    local d = dict()
    local r = d:get(key("rf:", att.node)) or 0
    if r >= att.k then -- a worker that died left its running attempts counted
        r = att.k - 1
    end
    if r >= 1 then
        att.r0 = r
        att.e0 = d:get(key("ec:", att.node)) or 0
    end
end

-- Attempt `att` released (infergate.routing.stats.release): its end numbered (att.own).
function _M.ended(att)
    local d = dict()
    local name = att.node
    if att.running then
        d:incr(key("rf:", name), -1, 0)
    end
    local n = d:incr(key("ec:", name), 1, 0)
    if n then
        d:set(key(ring_prefix[n % _M.RING], name), ngx_now())
        att.own = n
    end
end

-- First byte of attempt `att` (time `now`): it runs; the ends counted so far, for learn().
function _M.first_byte(att, now)
    if att.released then
        return
    end
    local d = dict()
    d:incr(key("rf:", att.node), 1, 0)
    att.running = true
    if att.e0 then
        att.e1 = d:get(key("ec:", att.node)) or 0
        att.fb = now
    end
end

-- Whether attempt `att` waited for an end on its node before its first byte (true),
-- ran alongside the others (false), or cannot tell (nil).
local function waited(d, att)
    if att.e1 > att.e0 then
        return true
    end
    local n = d:get(key("ec:", att.node)) or 0
    local nxt = att.e1 + 1
    if nxt == att.own then   -- its own end
        nxt = nxt + 1
    end
    if n < nxt then
        return false
    elseif n - nxt >= _M.RING then
        return nil
    end
    local t = d:get(key(ring_prefix[nxt % _M.RING], att.node))
    return t ~= nil and t <= att.fb + _M.SETTLE_S
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
    if not att.fb then
        return
    end
    local d = dict()
    local w = waited(d, att)
    if w == nil then
        return
    end
    local name, k = att.node, att.r0 + 1
    local fk = key("ak:", name)
    local v = d:get(fk) or 0
    local f = floor(v / 2)
    local capped = v - 2 * f == 1
    if k <= (f > 0 and f or 1) then
        if k == f and not w then
            d:expire(fk, _M.TTL_S)
        end
    elseif not w then
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
    local v = dict():get(key("ak:", name))
    if not v then
        return nil, false
    end
    local f = floor(v / 2)
    return f > 0 and f or nil, v - 2 * f == 1
end

return _M
