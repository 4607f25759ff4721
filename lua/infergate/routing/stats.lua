-- Per-node counters this edge keeps about its own traffic, in the shared dict
-- infergate_stats (shared by all workers of this nginx):
--
--   "if:<node>"  in-flight attempts (incremented when the balancer picks the node,
--                decremented exactly once when the attempt ends)
--   "iw:<pid>:<node>"  the same, of the worker with that pid only: a worker that dies
--                (killed, crashed; nginx starts another in its place) never reaches the
--                log phase of its attempts, and reconcile() gives its count back
--   "rq:<node>"  attempts started (counter since nginx start)
--   "ae:<node>"  epoch s the last attempt on the node ended (infergate.routing.others)
--   "fl:<node>"  attempts failed (counter since nginx start; includes 429 answers)
--   "lt:<node>"  latency EWMA in ms of successful attempts (upstream response time)
--   "fr:<node>"  failure-rate EWMA, 0-1 (1 per failed attempt, 0 per success), decaying
--                towards 0 with a half-life of breaker_cooldown_s (at least 1 s) while
--                the node gets no traffic, so a node is never sidelined for good;
--   "ft:<node>"  epoch seconds of the last "fr" update
--
-- Attempts are tables {node = name, started = epoch s, probe = bool, closed = bool,
-- released = bool, held = HTTP status | nil} kept in the request context (see
-- infergate.core.reqctx). No I/O: safe in every phase.
--
-- What counts against a node (failure rate, "fl", breaker) is decided by the callers
-- (infergate.routing.balancer for tries that are retried, infergate.log for the last
-- one): connect errors and resets, timeouts before the first byte, garbage, a 502-504,
-- and a 500 that another node answered past for the same request. A 500 that is retried
-- is first only held (hold(): in-flight down, no verdict); the log phase settles it as a
-- failure when a later node answered the request, as neutral when the later node failed
-- it the same way (the request's fault, not the node's). A 500 no other node saw (one
-- node, no try left) is neutral: no evidence either way.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local prefixer = require("infergate.core.memo").prefixer
local key = require("infergate.core.memo").keyer()
local ngx_now = ngxapi.now
local breaker = require("infergate.routing.breaker")
local stall = require("infergate.routing.stall")
local wake = require("infergate.admission.wake")
local workers = require("infergate.core.workers")
local astats = require("infergate.admission.stats")

local _M = {}

local shared = ngx.shared
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local tonumber = tonumber
local ipairs = ipairs

-- Key names per node, built once per worker ("if:<node>", "iw:<pid>:<node>").
local if_key = prefixer("if:")
local ae_key = prefixer("ae:")
local iw_key_of -- made at its first use in a worker (its pid)

local function iw_key(name)
    if not iw_key_of then
        iw_key_of = prefixer("iw:" .. ngx.worker.pid() .. ":")
    end
    return iw_key_of(name)
end

-- EWMA smoothing: new = old + ALPHA * (sample - old)
_M.LATENCY_ALPHA = 0.3
_M.FAILURE_ALPHA = 0.3

local function dict()
    return shared[config.DICT_STATS]
end

local function ewma(d, k, sample, alpha)
    local old = d:get(k)
    local new
    if old == nil then
        new = sample
    else
        new = old + alpha * (sample - old)
    end
    d:set(k, new)
    return new
end

function _M.inflight(name)
    return dict():get(if_key(name)) or 0
end

function _M.latency_ewma_ms(name)
    return dict():get(key("lt:", name))
end

local function half_life()
    local h = config.get().edge.breaker_cooldown_s
    if h < 1 then
        h = 1
    end
    return h
end

local function decayed_failure_rate(d, name, now)
    local fr = d:get(key("fr:", name))
    if not fr or fr == 0 then
        return 0
    end
    local t = d:get(key("ft:", name)) or now
    local dt = now - t
    if dt <= 0 then
        return fr
    end
    return fr * 2 ^ (-dt / half_life())
end

-- Failure-rate EWMA (0-1) of the node's attempts, decayed to `now`.
function _M.failure_rate(name, now)
    return decayed_failure_rate(dict(), name, now or ngx_now())
end

local function update_failure_rate(d, name, sample, now)
    local old = decayed_failure_rate(d, name, now)
    d:set(key("fr:", name), old + _M.FAILURE_ALPHA * (sample - old))
    d:set(key("ft:", name), now)
end

function _M.requests(name)
    return dict():get(key("rq:", name)) or 0
end

function _M.failures(name)
    return dict():get(key("fl:", name)) or 0
end

-- Takes one of node `name`'s `limit` slots: its in-flight count up by one unless that
-- would pass `limit` (atomic across workers: the increment decides). True when taken;
-- the attempt opened on it then passes claimed = true to open_attempt.
function _M.claim(name, limit)
    local d = dict()
    local v, err = d:incr(if_key(name), 1, 0)
    if not v then
        log(ERR, "infergate: in-flight counter of ", name, ": ", err)
        return false
    end
    if v > limit then
        d:incr(if_key(name), -1, 0)
        return false
    end
    d:incr(iw_key(name), 1, 0)
    return true
end

-- A new attempt on node `name`; returns the attempt record. claimed: its in-flight
-- count was already taken by claim().
function _M.open_attempt(name, now, probe, claimed)
    local d = dict()
    if not claimed then
        local _, err = d:incr(if_key(name), 1, 0)
        if err then
            log(ERR, "infergate: in-flight counter of ", name, ": ", err)
        end
        d:incr(iw_key(name), 1, 0)
    end
    d:incr(key("rq:", name), 1, 0)
    return { node = name, started = now, probe = probe or false, closed = false }
end

-- In-flight count of the attempt's node down, exactly once per attempt.
function _M.release(att)
    if att.released then
        return false
    end
    att.released = true
    local d = dict()
    local name = att.node
    local k = if_key(name)
    local v = d:incr(k, -1, 0)
    if v and v < 0 then
        d:set(k, 0)
        log(ERR, "infergate: in-flight counter of ", name, " went below zero")
    end
    d:incr(iw_key(name), -1, 0)
    d:set(ae_key(name), ngx_now())   -- infergate.routing.others
    wake.released()   -- a request waiting for a slot at the edge looks at once
    return true
end

local alive = workers.alive
_M._alive = alive

-- Gives back the in-flight attempts of workers that are gone: for every
-- "iw:<pid>:<node>" of a pid that no longer exists, its count comes off "if:<node>" and
-- the key is removed ("ae:<node>" set: the node may still run them); so are the
-- admission gauges it held ("ag:<pid>:<gauge>", infergate.admission.stats). A worker
-- that exits normally (reload, shutdown) has released its attempts by then (its keys
-- are at 0). Run by the snapshot sync timer every few seconds, in one worker at a time.
-- Returns the number of attempts given back.
function _M.reconcile()
    local d = dict()
    local back = 0
    for _, k in ipairs(d:get_keys(0)) do
        local pid, name = k:match("^iw:(%d+):(.+)$")
        pid = tonumber(pid)
        local gpid, gauge = k:match("^ag:(%d+):(.+)$")
        gpid = tonumber(gpid)
        if gpid and not alive(gpid) then
            local v = d:get(k)
            d:delete(k)
            astats.give_back(gauge, v, gpid)
        end
        if pid and not alive(pid) then
            local v = d:get(k)
            d:delete(k)
            if v and v > 0 then
                local left = d:incr(if_key(name), -v, 0)
                if left and left < 0 then
                    d:set(if_key(name), 0)
                end
                back = back + v
                d:set(ae_key(name), ngx_now())
                log(WARN, "infergate: ", v, " in-flight attempt(s) on ", name,
                    " of worker ", pid, ", which is gone, given back")
            end
        end
    end
    return back
end

-- The attempt ended with HTTP `status` and is being retried elsewhere: in-flight down
-- now, the verdict later (close_attempt from the log phase, see the header).
function _M.hold(att, status)
    _M.release(att)
    att.held = status
end

-- Ends an attempt once. outcome: "ok" (any answer the node meant, 2xx-4xx),
-- "busy" (429), "fail" (connect error, timeout before the first byte, 5xx, invalid
-- answer), "unserved" (404/405/501: the node does not serve this route; alive, not
-- failing), "neutral" (the request's own fault: the same 500 on two nodes, a deadline
-- that bound the read), "aborted" (the client went away first). latency_ms: upstream
-- response time of a successful 2xx attempt, or nil.
function _M.close_attempt(att, outcome, now, latency_ms)
    if att.closed then
        return false
    end
    att.closed = true
    _M.release(att)
    local d = dict()
    local name = att.node
    if outcome == "ok" then
        if att.probe then
            d:set(key("fr:", name), 0) -- the breaker closes: a clean start
        else
            update_failure_rate(d, name, 0, now)
        end
        if latency_ms then
            ewma(d, key("lt:", name), latency_ms, _M.LATENCY_ALPHA)
        end
        breaker.success(name, att.probe, att.started)
    elseif outcome == "fail" then
        d:incr(key("fl:", name), 1, 0)
        update_failure_rate(d, name, 1, now)
        breaker.failure(name, att.probe, att.started, now)
    elseif outcome == "busy" then
        d:incr(key("fl:", name), 1, 0)
        -- a node that says "busy" is alive: no breaker failure, but it answered the
        -- probe, so a half-open breaker closes
        breaker.neutral(name, false)
        if att.probe then
            breaker.success(name, true, att.started)
        end
    elseif outcome == "unserved" then
        -- alive and answering; the route is just not served there
        breaker.neutral(name, false)
        if att.probe then
            breaker.success(name, true, att.started)
        end
    else
        breaker.neutral(name, att.probe)
    end
    return true
end

-- The half-open probe `att` got a 2xx response head: the node answers again, so its
-- breaker closes now, not when the answer ends (a probe that is a long stream would
-- otherwise keep every other request off the recovered node for its whole length).
-- The attempt goes on as an ordinary one; its own verdict still counts at the end.
function _M.probe_answered(att)
    if att.probe and not att.closed then
        att.probe = false
        dict():set("fr:" .. att.node, 0) -- the breaker closes: a clean start
        breaker.success(att.node, true, att.started)
    end
end

-- This edge's view of one node, as published in infergate:v1:edges. stalled: the node
-- was found stalled and sent nothing since (infergate.routing.stall.flagged); silent_s: seconds
-- since its last byte (null: none yet).
function _M.node_report(name, now)
    local lat = _M.latency_ewma_ms(name)
    local silent = stall.silent_s(name, now)
    return {
        inflight = _M.inflight(name),
        requests = _M.requests(name),
        failures = _M.failures(name),
        breaker = breaker.state(name, now),
        latency_ewma_ms = lat and (math.floor(lat * 10 + 0.5) / 10) or ngx.null,
        stalled = stall.flagged(name, _M.inflight(name)),
        silent_s = silent and (math.floor(silent * 10 + 0.5) / 10) or ngx.null,
    }
end

return _M
