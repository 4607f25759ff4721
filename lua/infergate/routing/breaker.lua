-- Per-node circuit breaker, shared by all workers through the stats shared dict.
--
--   closed    --(breaker_failures consecutive failures)-->  open
--   open      --(breaker_cooldown_s elapsed)-->            half_open (one probe allowed)
--             (after ALONE_PROBE_S already when no other node is left: allow(.., true);
--             at once when the control plane saw the node come back since it opened)
--   half_open --(probe succeeds)--> closed ; --(probe fails)--> open (cooldown again)
-- A probe succeeds at its 2xx response head (infergate.routing.stats.probe_answered), or
-- at its end with any answer the node meant (stats.close_attempt).
--
-- Keys (dict infergate_stats): "bf:<node>" consecutive failures, "bo:<node>" epoch
-- seconds the breaker opened (absent = closed), "bp:<node>" the probe in flight: the pid
-- of the worker that sent it (added with a TTL so a lost probe cannot block the node
-- forever; freed at once when that worker is gone).
-- No I/O: safe in the balancer and log phases.
local backat = require("infergate.routing.backat")
local config = require("infergate.core.config")
local key = require("infergate.core.memo").keyer()
local workers = require("infergate.core.workers")

local _M = {}

local shared = ngx.shared
local log = ngx.log
local WARN = ngx.WARN

local function dict()
    return shared[config.DICT_STATS]
end

local function probe_ttl(o)
    -- longest a probe request can take before nginx gives up on it
    local s = (o.edge.connect_timeout_ms + o.edge.send_timeout_ms + o.edge.read_timeout_ms) / 1000
    if s < 1 then
        s = 1
    end
    return s
end

-- Whether the control plane saw node `name` come back after its breaker opened at
-- `opened` (epoch s): healthy again, or a new process behind its address (the
-- snapshot's back_at). The breaker judged a process that is gone: after a kill -9 and a
-- restart, the new one would otherwise get nothing for the rest of the cooldown while
-- other nodes are left. A probe still decides: one that fails opens it again, and a
-- later back_at is needed to skip that cooldown.
local function back_since(name, opened)
    local back = backat.get(name)
    return back ~= nil and back > opened
end

-- "closed" | "open" | "half_open" (open, cooldown over: probing or ready to probe)
function _M.state(name, now)
    local d = dict()
    local opened = d:get(key("bo:", name))
    if not opened then
        return "closed"
    end
    if now - opened >= config.get().edge.breaker_cooldown_s or back_since(name, opened) then
        return "half_open"
    end
    return "open"
end

-- Whether a probe of node `name` is in flight: its slot is held by a worker that is
-- still running (one that is gone, killed or crashed, never ends its probe: the slot is
-- freed at once rather than after its TTL, which is minutes).
local function probing(d, name)
    local k = key("bp:", name)
    local holder = d:get(k)
    if holder and workers.holder_gone(holder) then
        d:delete(k)
        return false
    end
    return holder ~= nil
end

-- A node whose breaker has been open for ALONE_PROBE_S (or the whole cooldown, when
-- shorter) may take a half-open probe early when no node of the request's model is left
-- (infergate.routing.candidates): as nginx never marks the only server of an upstream
-- down, a node back after a restart is not refused for the rest of the cooldown, and the
-- 503's Retry-After of 1 s holds.
local ALONE_PROBE_S = 1
_M.ALONE_PROBE_S = ALONE_PROBE_S

-- "yes" (closed), "probe" (half-open and no probe in flight), or false. alone: the node
-- is the last hope of a request, half-open after ALONE_PROBE_S already.
function _M.allow(name, now, alone)
    local d = dict()
    local opened = d:get(key("bo:", name))
    if not opened then
        return "yes"
    end
    local cooldown = config.get().edge.breaker_cooldown_s
    if alone and ALONE_PROBE_S < cooldown then
        cooldown = ALONE_PROBE_S
    end
    if (now - opened < cooldown and not back_since(name, opened)) or probing(d, name) then
        return false
    end
    return "probe"
end

-- Takes the single half-open probe slot of a node (holding this worker's pid); true when
-- this caller got it.
function _M.take_probe(name)
    local ok = dict():add(key("bp:", name), workers.pid(), probe_ttl(config.get()))
    return ok and true or false
end

local function release_probe(name)
    dict():delete(key("bp:", name))
end

-- An attempt on the node succeeded. probe: it was the half-open probe.
-- started: epoch seconds the attempt started.
function _M.success(name, probe, started)
    local d = dict()
    local opened = d:get(key("bo:", name))
    if probe then
        d:delete(key("bo:", name))
        d:set(key("bf:", name), 0)
        release_probe(name)
        log(WARN, "infergate: circuit breaker of node ", name, " closed (probe succeeded)")
        return
    end
    if opened and started < opened then
        return -- an attempt from before the breaker opened; only the probe closes it
    end
    d:set(key("bf:", name), 0)
end

-- An attempt on the node failed (connect error, timeout, 5xx, invalid answer).
-- _started (when the attempt began) is not needed for the verdict.
function _M.failure(name, probe, _started, now)
    local d = dict()
    local o = config.get()
    if probe then
        d:set(key("bo:", name), now)
        release_probe(name)
        require("infergate.core.prometheus").breaker_opened(name)
        log(WARN, "infergate: circuit breaker of node ", name, " reopened (probe failed)")
        return
    end
    if d:get(key("bo:", name)) then
        return -- already open
    end
    local n = d:incr(key("bf:", name), 1, 0)
    if n and n >= o.edge.breaker_failures then
        -- add: only one worker opens it (and logs)
        local ok = d:add(key("bo:", name), now)
        if ok then
            require("infergate.core.prometheus").breaker_opened(name)
            log(WARN, "infergate: circuit breaker of node ", name, " opened after ", n,
                " consecutive failures; next probe in ", o.edge.breaker_cooldown_s,
                " s (in ", ALONE_PROBE_S, " s when no other node is left)")
        end
    end
end

-- The attempt ended without a verdict on the node (client went away).
function _M.neutral(name, probe)
    if probe then
        release_probe(name)
    end
end

function _M.consecutive_failures(name)
    return dict():get(key("bf:", name)) or 0
end

return _M
