-- Prefix-cache-aware node choice: the same leading prompt goes to the same node, from
-- every edge, without shared state.
--
-- Inference servers keep the KV cache of prompts they have seen (vLLM's automatic prefix
-- caching, SGLang's radix cache), so a request whose system prompt and earlier turns are
-- cached on a node skips most of its prefill there. The access phase derives an affinity
-- key from the request (key(), no I/O); the balancer phase ranks the eligible nodes for
-- that key by rendezvous hashing and takes the first one whose load is within the bound
-- (choose(), no I/O).
--
-- The key, in order of precedence (edge.prefix_affinity = false: none at all):
--   1. the request header edge.affinity_header (default X-Session-ID), when present and
--      not empty: an explicit session key;
--   2. the leading prompt: the messages in order, each as role, "\n", its text, "\n"
--      (text parts of an array content joined, other parts as "[type]"), taken up to and
--      including the first message at which the text reaches edge.prefix_min_tokens
--      tokens (4 characters a token: the edge does not tokenize), and cut at
--      edge.prefix_max_tokens tokens; /v1/completions: the prompt string, cut the same
--      way. A prompt shorter than prefix_min_tokens has no key: its prefill is too short
--      to be worth a detour, and the plain cost (infergate.routing.balancer) decides.
--      Every later turn of a conversation starts with the same messages, so it gets the
--      same key as the first turn; conversations that share a long system prompt share
--      one key (and one node's cache of it);
--   3. the body's "user" field when edge.affinity_user_field is true and there is no
--      prefix key.
-- The key is the CRC-32 of that text (ngx.crc32_long): a collision only sends two
-- prefixes to the same node.
--
-- The choice (consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam
-- 2016, over weighted rendezvous hashing):
--   rank(node)  = effective_weight / -ln(u),  u = fmix32(key xor crc32(name)) / 2^32
--                 (the same order on every edge; removing a node moves only its keys;
--                 a node ramping up after an undrain or a return gets fewer keys)
--   bound(node) = ceil((1 + edge.prefix_load_factor) x (T + 1) x cap(node) / sum cap)
--                 T = this edge's requests in flight on the candidates, cap = the
--                 node's concurrency (max_concurrency, or the learned one for a node
--                 without metrics, infergate.routing.speed) x effective_weight,
--                 and at least ceil(FREE_SHARE (1/4) x the node's concurrency): a node
--                 that far from full is not loaded, whatever the others carry
-- The first node in rank order with in-flight < bound that is not saturated (fresh
-- snapshot) is taken, so a burst spills to the key's second, third, ... node instead of
-- piling onto one. When every candidate is over its bound or saturated, the first in
-- rank order is taken.
--
-- Hot keys. A key's share of this edge's recent requests, q (decayed counts with a
-- half-life of HEAT_HALF_LIFE_S, shared dict infergate_affinity), is compared with what
-- one node may carry: a key whose traffic would put its node over (1 + epsilon) times
-- the average (one system prompt shared by all traffic) is spread over the first
--   m = min(n, ceil(q x n / (1 + epsilon)))
-- nodes of its order, the least loaded of them (in-flight / cap; ties: at random)
-- taken, each of them keeping a copy of the prefix in its cache, unless no other
-- request of the key is in flight at this edge (a lone conversation is the whole
-- traffic of a quiet edge, and stays). Ordinary keys (m = 1: one group's system prompt
-- among many) stay on their first node. Without that shared
-- dict (a hand-written config) every key counts as ordinary.
-- First sight. A leading prompt this edge has not seen within HEAT_TTL_S (600 s) can be
-- cached on no node yet, so its first node has no prefill to save: unseen() tells the
-- balancer, which sends it to its first node (the same on every edge) only when that
-- node's plain cost is within FIRST_SIGHT_MARGIN of the cheapest candidate's, and to the
-- cheapest otherwise (a one-off long document must not queue behind a busy node that
-- the least loaded one would spare it). Either way the key is counted (heat()), and its
-- later requests (the next turn, the group's other users) follow the key. While under
-- REUSE_MIN of the edge's recent prefix keys were seen before (reuse(), with a prior and
-- a decay), the margin is the balancer's tie (the first node only when it ties with the
-- cheapest): with nothing reused, the key only makes the placement less even. Session
-- and user keys are explicit and always followed.
-- Counters (shared dict infergate_stats, exported by infergate.core.prometheus):
-- "af:first" (the key's first node, or one of its m nodes), "af:spill" (a later one).
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local stats = require("infergate.routing.stats")
local speed = require("infergate.routing.speed")
local bit = require("bit")

local _M = {}

local type = type
local ipairs = ipairs
local concat = table.concat
local sub = string.sub
local log = math.log
local ceil = math.ceil
local min = math.min
local random = math.random
local tobit = bit.tobit
local bxor = bit.bxor
local rshift = bit.rshift
local crc32 = ngx.crc32_long
local shared = ngx.shared

-- 32-bit multiply modulo 2^32 (LuaJIT numbers are doubles: split one factor in halves
-- so no product exceeds 2^53).
local function imul(a, b)
    local lo = b % 0x10000
    local hi = (b - lo) / 0x10000
    return tobit(tobit(a * hi) * 0x10000 + a * lo)
end

-- MurmurHash3's 32-bit finaliser: a bijection that spreads every input bit.
local function fmix32(h)
    h = bxor(h, rshift(h, 16))
    h = imul(h, 0x85ebca6b)
    h = bxor(h, rshift(h, 13))
    h = imul(h, 0xc2b2ae35)
    return bxor(h, rshift(h, 16))
end
_M.fmix32 = fmix32

-- Rendezvous rank of `node` for `key` (higher first).
function _M.rank(key, node)
    local h = fmix32(bxor(key, crc32(node.name)))
    local u = (h % 4294967296 + 0.5) / 4294967296
    return node.effective_weight / -log(u)
end

local function part_text(content)
    if type(content) == "string" then
        return content
    end
    if type(content) ~= "table" then
        return ""
    end
    local out = {}
    for i, p in ipairs(content) do
        if type(p) == "table" then
            if type(p.text) == "string" then
                out[i] = p.text
            else
                out[i] = "[" .. (type(p.type) == "string" and p.type or "?") .. "]"
            end
        else
            out[i] = ""
        end
    end
    return concat(out, "\n")
end

-- The leading prompt text of a decoded request body (see the header), or nil when it is
-- shorter than min_chars.
function _M.leading_text(body, min_chars, max_chars)
    local msgs = body.messages
    local text
    if type(msgs) == "table" then
        local parts, len = {}, 0
        for i, m in ipairs(msgs) do
            if type(m) ~= "table" then
                break
            end
            local piece = (type(m.role) == "string" and m.role or "") .. "\n"
                .. part_text(m.content) .. "\n"
            parts[i] = piece
            len = len + #piece
            if len >= min_chars then
                break
            end
        end
        if len < min_chars then
            return nil
        end
        text = concat(parts)
    elseif type(body.prompt) == "string" then
        if #body.prompt < min_chars then
            return nil
        end
        text = body.prompt
    else
        return nil
    end
    if #text > max_chars then
        text = sub(text, 1, max_chars)
    end
    return text
end

local header_var, header_for = nil, nil

local function session_header(name)
    if name ~= header_for then
        header_for = name
        header_var = name ~= "" and ("http_" .. name:lower():gsub("-", "_")) or nil
    end
    if not header_var then
        return nil
    end
    local v = ngx_var(header_var)
    if v == nil or v == "" then
        return nil
    end
    return v
end

-- Access phase: the affinity key (a 32-bit number) of the request and its source
-- ("session" | "prefix" | "user"), or nil when the request has none. body: the decoded
-- request body (a table). Reads one request header; no I/O.
function _M.key(body, o)
    o = o or config.get()
    if not o.edge.prefix_affinity then
        return nil
    end
    local s = session_header(o.edge.affinity_header)
    if s then
        return crc32("s\0" .. s), "session"
    end
    local text = _M.leading_text(body, o.edge.prefix_min_tokens * 4, o.edge.prefix_max_tokens * 4)
    if text then
        return crc32(text), "prefix"
    end
    if o.edge.affinity_user_field and type(body.user) == "string" and body.user ~= "" then
        return crc32("u\0" .. body.user), "user"
    end
    return nil
end

-- A node with fewer requests of this edge in flight than this share of its concurrency
-- is within the bound whatever the others carry: it is not loaded, and sending the
-- request elsewhere would only lose the cached prefix (at a light load the bound alone,
-- ceil(1.25 x (T + 1) / n), is 1, and every busy node would spill).
local FREE_SHARE = 0.25
_M.FREE_SHARE = FREE_SHARE

_M.HEAT_DICT = "infergate_affinity"
_M.HEAT_HALF_LIFE_S = 10
local HEAT_TTL_S = 600
local exp2 = function(x) return 2 ^ x end

-- Decayed count stored under `name` (value and time) at `now` (half-life: `half`
-- seconds, HEAT_HALF_LIFE_S when nil).
local function decayed(d, name, now, half)
    local v = d:get("v" .. name) or 0
    local t = d:get("t" .. name) or now
    return v * exp2(-(now - t) / (half or _M.HEAT_HALF_LIFE_S))
end

-- That count plus `add`, stored; returns the new value.
local function decayed_add(d, name, now, add, half)
    local v = decayed(d, name, now, half) + add
    d:set("v" .. name, v, HEAT_TTL_S)
    d:set("t" .. name, now, HEAT_TTL_S)
    return v
end

-- Balancer phase, first attempt of every request (with a key or not): counts it in
-- this edge's recent total.
function _M.count_request(now)
    local d = shared[_M.HEAT_DICT]
    if d then
        decayed_add(d, "*", now, 1)
    end
end

-- Counts one request for `key` and returns its share (0-1) of this edge's recent
-- requests (count_request counted this one in the total already), or 0 without the
-- shared dict.
function _M.heat(key, now)
    local d = shared[_M.HEAT_DICT]
    if not d then
        return 0
    end
    local total = decayed(d, "*", now)
    local v = decayed_add(d, key, now, 1)
    if total <= 0 then
        return 0
    end
    return min(v / total, 1)
end

-- Cost difference (infergate.routing.balancer's cost units: 0.1 = a tenth of a node's
-- concurrency in flight) within which a first-sight prompt still goes to its first node.
_M.FIRST_SIGHT_MARGIN = 0.1

-- Balancer phase, first attempt of a request with a prefix key: true when this edge
-- has not counted the key within HEAT_TTL_S (false without the shared dict: every key
-- is followed). Reads only.
function _M.unseen(key)
    local d = shared[_M.HEAT_DICT]
    return d ~= nil and d:get("v" .. key) == nil
end

-- Observed reuse: the share of this edge's recent prefix-keyed requests whose key it had
-- seen before (decayed counts, half-life REUSE_HALF_LIFE_S), with a prior of
-- REUSE_PRIOR_SEEN seen in REUSE_PRIOR_ALL requests (0.5: reuse is assumed until
-- traffic shows none, and the share returns to it when no keyed request comes). Below
-- REUSE_MIN the traffic shares no prefixes (one-off documents, prompts unique per
-- request), so following a key at first sight buys no cached prefill and only makes the
-- placement less even than the plain cost's: the balancer then sends a first sight to
-- the cheapest candidate (a key seen again is still followed).
_M.REUSE_HALF_LIFE_S = 60
_M.REUSE_MIN = 0.05
local REUSE_PRIOR_SEEN, REUSE_PRIOR_ALL = 1, 2

-- Observed reuse (0-1; the prior without the shared dict), see above.
function _M.reuse(now)
    local d = shared[_M.HEAT_DICT]
    if not d then
        return REUSE_PRIOR_SEEN / REUSE_PRIOR_ALL
    end
    local half = _M.REUSE_HALF_LIFE_S
    return (decayed(d, "#seen", now, half) + REUSE_PRIOR_SEEN)
        / (decayed(d, "#keyed", now, half) + REUSE_PRIOR_ALL)
end

-- Balancer phase, first attempt of every request: counts it (count_request) and, for a
-- prefix key (kind "prefix"), in the observed reuse. Returns true when the key is a
-- first sight (unseen), false otherwise.
function _M.first_sight(kind, key, now)
    _M.count_request(now)
    if kind ~= "prefix" then
        return false
    end
    local first = _M.unseen(key)
    local d = shared[_M.HEAT_DICT]
    if d then
        local half = _M.REUSE_HALF_LIFE_S
        decayed_add(d, "#keyed", now, 1, half)
        decayed_add(d, "#seen", now, first and 0 or 1, half)
        if first then
            -- seen from now on, wherever the request goes (heat() counts its share
            -- when the key decides the node)
            d:add("v" .. key, 0, HEAT_TTL_S)
        end
    end
    return first
end

-- The key's first node among cands[1..n] in rendezvous order (no load considered).
function _M.top(cands, n, key)
    local best, br = nil, -1
    for i = 1, n do
        local r = _M.rank(key, cands[i])
        if r > br then
            best, br = cands[i], r
        end
    end
    return best
end

-- Requests of `key` in flight at this edge: track() when the request is sent to a
-- node (balancer phase; returns true when counted), untrack() when it ends (log phase).
function _M.track(key)
    local d = shared[_M.HEAT_DICT]
    if not d then
        return false
    end
    local _, err = d:incr("k" .. key, 1, 0, HEAT_TTL_S)
    return err == nil
end

function _M.untrack(key)
    local d = shared[_M.HEAT_DICT]
    if d then
        local v = d:incr("k" .. key, -1, 0)
        if v and v <= 0 then
            d:delete("k" .. key)
        end
    end
end

function _M.live(key)
    local d = shared[_M.HEAT_DICT]
    local v = d and d:get("k" .. key) or 0
    return v > 0 and v or 0
end

-- How many of the key's first nodes share a key with share `q` (see the header).
function _M.width(q, n, eps)
    local m = ceil(q * n / (1 + eps))
    if m < 1 then
        return 1
    end
    return m < n and m or n
end

local function bump(name)
    local d = shared[config.DICT_STATS]
    if d then
        d:incr(name, 1, 0)
    end
end

-- Balancer phase: the node for affinity `key` among cands[1..n] (n >= 2, all eligible),
-- fresh = the snapshot is fresh (its saturated flags count), retry = a later attempt of
-- the request (not counted again in the key's share). Pure: shared-dict reads and
-- counters.
function _M.choose(cands, n, key, o, fresh, now, retry)
    local ranks, inflight, caps = {}, {}, {}
    local total, capsum = 0, 0
    for i = 1, n do
        local node = cands[i]
        ranks[i] = _M.rank(key, node)
        local f = stats.inflight(node.name)
        inflight[i] = f
        total = total + f
        local c = speed.concurrency(node, fresh and node.score ~= nil) * node.effective_weight
        caps[i] = c
        capsum = capsum + c
    end
    local eps = o.edge.prefix_load_factor
    -- candidates in rank order (n is small: a selection sort, no closure)
    local order = {}
    for pos = 1, n do
        local bi, br = nil, -1
        for i = 1, n do
            local r = ranks[i]
            if r and r > br then
                bi, br = i, r
            end
        end
        ranks[bi] = nil
        order[pos] = bi
    end
    local m = 1
    if not retry then
        m = _M.width(_M.heat(key, now or ngx_now()), n, eps)
        if m > 1 and _M.live(key) == 0 then
            m = 1 -- nothing of this key in flight: a lone conversation stays where it is
        end
    end
    if m > 1 then
        -- a hot key: the least loaded of its first m nodes, ties drawn at random (every
        -- one of them holds the prefix; a fixed order would leave the last one idle)
        local best, bl, ties = nil, nil, 0
        for pos = 1, m do
            local i = order[pos]
            if not (fresh and cands[i].saturated) then
                local l = inflight[i] / caps[i]
                if not bl or l < bl then
                    best, bl, ties = pos, l, 1
                elseif l == bl then
                    ties = ties + 1
                    if random() * ties < 1 then
                        best = pos
                    end
                end
            end
        end
        if best and best > 1 then
            -- move it to the front; the others keep their order
            local i = order[best]
            for pos = best, 2, -1 do
                order[pos] = order[pos - 1]
            end
            order[1] = i
        end
    end
    local factor = (1 + eps) * (total + 1) / capsum
    for pos = 1, n do
        local i = order[pos]
        local node = cands[i]
        local bound = ceil(factor * caps[i])
        local floor = ceil(FREE_SHARE * caps[i] / node.effective_weight)
        if bound < floor then
            bound = floor
        end
        if inflight[i] < bound and not (fresh and node.saturated) then
            bump(pos <= m and "af:first" or "af:spill")
            return node
        end
    end
    bump("af:spill")
    return cands[order[1]]
end

-- Counters since nginx started: {first = n, spill = n}.
function _M.counts()
    local d = shared[config.DICT_STATS]
    if not d then
        return { first = 0, spill = 0 }
    end
    return { first = d:get("af:first") or 0, spill = d:get("af:spill") or 0 }
end

return _M
