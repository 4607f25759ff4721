-- Liveness check of a silent node: a node found stalled mid-stream
-- (infergate.routing.stall) or a TTFB outlier (infergate.routing.outlier), and silent
-- since, would next get a client request as its half-open probe. A frozen process
-- (SIGSTOP, a machine paused) accepts connections and answers nothing, so each such probe
-- costs its client the wait before its retry. Before that probe, the edge asks the node
-- itself: one `GET /health` over a new connection, from worker 0's liveness timer, at
-- most one at a time per node. Any byte is an answer (a 404 or a 503 from a busy engine,
-- even bytes that are not HTTP, show the process is running): from then on the half-open
-- probes go as before, and a node that answers them is back. With no answer the node keeps getting
-- no request, for at most HOLD_MAX_S after it was found silent; then the probes go
-- anyway (a node that never answers the check is not kept out for good). A node that
-- resumes sends bytes on the streams it holds and is back at once, check or not.
-- https nodes, nodes reached by name and edge.liveness_check = false: no check, the
-- half-open probes alone (as before).
-- A check that got no answer is also the evidence the stream relay needs before it
-- gives up on a request still waiting for a silent node's first byte (dead(), asked by
-- infergate.routing.outlier.gone_silent): found silent alone is not enough, a long
-- prefill is silent too, but its server answers the check.
--
-- Shared dict infergate_stats (all workers):
--   "lw:<node>"  epoch s of the finding a check is wanted for (set by holds() and dead(),
--                TTL HOLD_MAX_S)
--   "la:<node>"  epoch s of the node's last answer to a check
--   "lc:<node>"  a check in flight or its pause running (TTL: the check's timeout)
--   "ln:<node>"  the finding (epoch s) a check got no answer for
--
-- holds(node, since, now, o)  balancer phase (no I/O): true while the node waits for an
--                             answer to a check
-- dead(node, since, o)        true when a check for the finding `since` got no answer
--                             and none answered since (asks for a check; no I/O)
-- tick(nodes, o, threshold)   worker 0's timer: starts a check (a timer each) per node that waits
-- init_worker()               the timer (worker 0 only)
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now

local _M = {}

local shared = ngx.shared
local log = ngx.log
local WARN = ngx.WARN

_M.HOLD_MAX_S = 30
_M.TICK_S = 0.25
_M.TIMEOUT_MIN_S = 3
_M.TIMEOUT_MAX_S = 10
_M.PATH = "/health"

local function dict()
    return shared[config.DICT_STATS]
end

local function checkable(node, o)
    return o.edge.liveness_check ~= false and node.scheme == "http" and node.addr ~= nil
end

-- True when a check answered after the finding `since`; otherwise asks worker 0 for one.
local function answered(d, name, since)
    local la = d:get("la:" .. name)
    if la and la >= since then
        return true
    end
    if d:get("lw:" .. name) ~= since then
        d:set("lw:" .. name, since, _M.HOLD_MAX_S)
    end
    return false
end

-- True when node `node`, found silent at epoch s `since`, gets no probe yet: no answer
-- to a check since then, within HOLD_MAX_S of the finding.
function _M.holds(node, since, now, o)
    o = o or config.get()
    if not since or not checkable(node, o) or now - since > _M.HOLD_MAX_S then
        return false
    end
    return not answered(dict(), node.name, since)
end

function _M.dead(node, since, o)
    o = o or config.get()
    if not checkable(node, o) then
        return false
    end
    local d = dict()
    return not answered(d, node.name, since) and d:get("ln:" .. node.name) == since
end

-- Timeout (s) of a check: twice the node's stall threshold, within TIMEOUT_MIN_S (an
-- API server busy under load may answer late) and TIMEOUT_MAX_S.
function _M.timeout(thr)
    local t = 2 * thr
    if t < _M.TIMEOUT_MIN_S then
        return _M.TIMEOUT_MIN_S
    end
    return t > _M.TIMEOUT_MAX_S and _M.TIMEOUT_MAX_S or t
end

-- One check of `node` (timeout `t` s); true when it answered anything at all.
function _M.check(node, t)
    local sock = ngx.socket.tcp()
    local ms = math.max(1, math.ceil(t * 1000)) -- 0 would mean lua_socket_*_timeout
    sock:settimeouts(ms, ms, ms)
    local ok, err = sock:connect(node.addr, node.port)
    if not ok then
        return nil, err
    end
    local host = node.host or node.addr
    ok, err = sock:send("GET " .. _M.PATH .. " HTTP/1.1\r\nHost: " .. host .. ":" .. node.port
        .. "\r\nUser-Agent: infergate-liveness\r\nConnection: close\r\n\r\n")
    if not ok then
        sock:close()
        return nil, err
    end
    local line, partial
    line, err, partial = sock:receive("*l")
    sock:close()
    if line or (partial and partial ~= "") then
        return true -- any byte: the process runs (a status line or not)
    end
    return nil, err
end

local function run_check(node, since, t)
    local ok, err = _M.check(node, t)
    local d = dict()
    if ok then
        d:set("la:" .. node.name, ngx_now(), _M.HOLD_MAX_S)
        log(WARN, "infergate: node ", node.name, " answers its liveness check: probes resume")
    elseif d:get("lw:" .. node.name) == since then
        if d:get("ln:" .. node.name) ~= since then
            log(WARN, "infergate: node ", node.name, " silent and no answer to its liveness",
                " check within ", t, " s: ", err or "?")
        end
        d:set("ln:" .. node.name, since, _M.HOLD_MAX_S)
    end
end

local function check_timer(premature, node, since, t)
    if not premature then
        run_check(node, since, t)
    end
end

-- Start a check of every node that waits for one, each in a timer of its own (a frozen
-- node's check, up to 10 s, does not hold up the check of a node found silent
-- meanwhile; "lc:" keeps one check per node). Returns the number started.
function _M.tick(nodes, o, threshold)
    local d = dict()
    local started = 0
    for _, node in ipairs(nodes) do
        local since = d:get("lw:" .. node.name)
        if since and checkable(node, o) then
            local la = d:get("la:" .. node.name)
            local t = _M.timeout(threshold(node.name, o))
            if (not la or la < since) and d:add("lc:" .. node.name, true, t) then
                local ok, err = ngx.timer.at(0, check_timer, node, since, t)
                if ok then
                    started = started + 1
                else
                    d:delete("lc:" .. node.name)
                    log(WARN, "infergate: liveness check of ", node.name, " not started: ", err)
                end
            end
        end
    end
    return started
end

-- init_worker_by_lua: the liveness timer, on worker 0 only. `nodes()` -> the node table,
-- `threshold(name, o)` -> the node's stall threshold (s). A tick never yields (the
-- checks run in timers of their own), so ticks cannot overlap.
function _M.init_worker(nodes, threshold)
    local id = ngx.worker.id()
    if id ~= nil and id ~= 0 then
        return
    end
    local function tick(premature)
        if premature then
            return
        end
        local ok, err = pcall(_M.tick, nodes(), config.get(), threshold)
        if not ok then
            log(WARN, "infergate: liveness checks failed: ", err)
        end
    end
    local ok, err = ngx.timer.every(_M.TICK_S, tick)
    if not ok then
        log(WARN, "infergate: cannot start the liveness timer: ", err)
    end
end

return _M
