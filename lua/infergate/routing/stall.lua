-- Stall detection: proof of life for a node in the middle of its streams. A node whose
-- process is frozen (SIGSTOP, a hung engine) still accepts connections, so a slow health
-- check looks like a busy node. Busy needs progress: bytes arriving on its requests. A
-- node this edge has streams on that already sent bytes ("mid-stream"), and from which
-- no byte at all came for longer than the threshold, is stalled: it gets no new request
-- from this edge (infergate.routing.outlier.is_outlier asks here) until a byte comes
-- again, and the edge reports it to the control plane (infergate.routing.stats
-- node_report: "stalled"), which then calls it stalled instead of busy.
--
-- threshold = max(edge.stall_min_s, edge.stall_gap_factor x p90), where p90 is the 90th
-- percentile of the largest gap between two chunks of the node's last SAMPLES answers
-- seen by one worker (published when it changes), the answers not seen yet counted as
-- gaps of 0 (a prior: the third largest gap of a new node's first answers, not its
-- largest, so that one long pause does not raise it fivefold); stall_gap_factor = 0
-- turns detection off. Requests still waiting for their first byte are the TTFB outlier rule's
-- (infergate.routing.outlier).
--
-- A node found stalled and silent since then ("ss:<node>" newer than "lb:<node>") is
-- half-open: one request of this edge at a time (none while any is in flight, nor before
-- the node answers a liveness check, infergate.routing.liveness), and a
-- probe that ended without a byte after waiting past the threshold keeps it out for
-- min(PROBE_BACKOFF_MAX_S, threshold x 2^probes) more. A probe with another node to retry
-- on waits for its first byte only twice the larger of this threshold and its TTFB
-- outlier threshold (infergate.routing.outlier.probe_threshold), then goes to another
-- node. A node that resumes (SIGCONT) sends bytes on the streams it holds, or answers
-- the probe, and is back at once.
--
-- Requests sent before the stall was found: a stream try with another node left to
-- retry on reads with a timeout of max(edge.stall_first_byte_s, 2 x its TTFB outlier
-- threshold, 2 x the stall threshold) (stream_read_half): one still waiting for its
-- first byte then is retried on another node; one that already streamed bytes to the
-- client cannot move and ends there, cut, as it would at its deadline.
--
-- Shared dict infergate_stats (all workers):
--   "lb:<node>"  epoch s of the last byte from the node (any attempt of any worker;
--                written at most every PROGRESS_RES_S per worker and node)
--   "gq:<node>"  p90 (s) of the largest inter-chunk gap of the node's last answers
--   "sl:<node>"  epoch s the node was found stalled (TTL FLAG_TTL_FACTOR x threshold)
--   "ss:<node>"  the same without a TTL; removed at the node's next byte
--   "sn:<node>"  probes in a row that ended without a byte, "su:<node>" epoch s before
--                which it gets no probe
-- Worker-local: the number of this worker's attempts per node that are mid-stream (dies
-- with the worker; a node also needs this edge's requests in flight to be found
-- stalled, so a count left behind cannot sideline an idle node).
--
-- byte(req, now)          body filter, for every non-empty chunk from the node
-- finished(att, now)      when an attempt ends (through outlier.finished)
-- is_stalled(node, now, o, inflight)  balancer phase (no I/O)
-- body_filter()           the body filter step (infergate.phases)
local config = require("infergate.core.config")
local key = require("infergate.core.memo").keyer()
local ngxapi = require("infergate.core.ngxapi")
local ring = require("infergate.routing.ring")
local liveness = require("infergate.routing.liveness")
local ngx_now = ngxapi.now

local _M = {}

local shared = ngx.shared
local log = ngx.log
local WARN = ngx.WARN

_M.SAMPLES = 20
_M.FLAG_TTL_FACTOR = 3
_M.PROBE_BACKOFF_MAX_S = 60
_M.PROGRESS_RES_S = 0.1

local streaming = {}   -- node -> this worker's attempts on it that are mid-stream
local written = {}     -- node -> epoch s this worker last wrote "lb:<node>"
local rings = {}       -- node -> {n, i, last, [1..SAMPLES]}: largest gaps of answers

local function dict()
    return shared[config.DICT_STATS]
end

_M._p90_of = ring.p90_of

local function add_gap(d, name, gap)
    local p = ring.push(rings, name, gap, _M.SAMPLES, true)
    if p then
        d:set(key("gq:", name), p)
    end
end

-- Body filter step: every non-empty chunk of the node's answer is progress (the stream
-- relay, infergate.stream.leg, calls byte() for what it reads itself).
function _M.body_filter()
    local req = ngx.ctx.infergate
    local chunk = ngx.arg[1]
    if req and chunk and chunk ~= "" and not req.relay then
        _M.byte(req)
    end
end

-- Threshold (s) of node `name`.
function _M.threshold(name, o)
    o = o or config.get()
    local thr = o.edge.stall_min_s
    local p = dict():get(key("gq:", name))
    if p and o.edge.stall_gap_factor * p > thr then
        thr = o.edge.stall_gap_factor * p
    end
    return thr
end

-- The node sent bytes: the time of its last byte for every worker (cleared of a stall
-- found earlier), and the attempt's largest gap between two chunks.
local function progress(d, name, now)
    written[name] = now
    d:set(key("lb:", name), now)
    if d:get(key("ss:", name)) then
        d:delete(key("sl:", name))
        d:delete(key("ss:", name))
        d:delete(key("sn:", name))
        d:delete(key("su:", name))
        log(WARN, "infergate: node ", name, " sends bytes again: no longer stalled")
    end
end

-- A gap longer than the floor counts as at most twice the node's threshold: a stall the
-- node resumed from raises its threshold by that much at most, and normal answers bring
-- it back.
local function capped(name, gap)
    local o = config.get()
    if gap <= o.edge.stall_min_s then
        return gap
    end
    local most = 2 * _M.threshold(name, o)
    return gap < most and gap or most
end

function _M.byte(req, now)
    local attempts = req and req.attempts
    local att = attempts and attempts[#attempts]
    if not att or att.closed then
        return
    end
    now = now or ngx_now()
    local name = att.node
    local last = att.last_byte
    if last then
        local gap = now - last
        -- a gap in which the node failed a liveness check, or answered one late, was a
        -- freeze (SIGSTOP, a hung engine) it resumed from, not one of its pauses:
        -- counted, each freeze survived would raise the threshold, and the next one would
        -- be found later
        if gap > (att.max_gap or 0) and not liveness.frozen_since(name, last) then
            att.max_gap = capped(name, gap)
        end
    elseif req.stream then
        att.streaming = true
        att.stream_gaps = true
        streaming[name] = (streaming[name] or 0) + 1
    end
    att.last_byte = now
    if now - (written[name] or 0) >= _M.PROGRESS_RES_S then
        progress(dict(), name, now)
    end
end

-- Epoch s the node was found stalled when it sent no byte since, else nil.
local function silent_since(d, name)
    local ss = d:get(key("ss:", name))
    if ss and ss >= (d:get(key("lb:", name)) or 0) then
        return ss
    end
    return nil
end
_M.silent_since = silent_since

function _M.finished(att, now)
    if att.stall_done then
        return
    end
    att.stall_done = true
    local name = att.node
    local d = dict()
    if att.streaming then
        att.streaming = false
        local n = (streaming[name] or 1) - 1
        streaming[name] = n > 0 and n or nil
    end
    if att.max_gap and att.stream_gaps then
        add_gap(d, name, att.max_gap)
    end
    if att.last_byte then
        return
    end
    local o = config.get()
    local ss = silent_since(d, name)
    if o.edge.stall_gap_factor <= 0 or not ss or att.started < ss then
        return
    end
    local thr = _M.threshold(name, o)
    if now - att.started < thr then
        return -- ended early (the client left): no evidence either way
    end
    local n = d:incr(key("sn:", name), 1, 0) or 1
    local wait = thr * 2 ^ n
    if wait > _M.PROBE_BACKOFF_MAX_S then
        wait = _M.PROBE_BACKOFF_MAX_S
    end
    d:set(key("su:", name), now + wait)
end

-- True when node `node` gets no new request: found stalled (here or by another worker)
-- and silent since, within the flag's life; or half-open with a request in flight
-- (`inflight(name)`: this edge's count, infergate.routing.stats.inflight) or
-- its probe backoff running; or this worker holds a stream on it that is mid-stream and
-- no byte came from the node for longer than the threshold (then flagged).
function _M.is_stalled(node, now, o, inflight)
    o = o or config.get()
    local name = node.name
    local d = dict()
    local ss = d:get(key("ss:", name))
    if (not ss and not streaming[name]) or o.edge.stall_gap_factor <= 0 then
        return false -- most picks end here, after one read
    end
    local lb = d:get(key("lb:", name)) or 0
    local found = ss and ss >= lb
    if found then
        if d:get(key("sl:", name)) or inflight(name) >= 1 then
            return true
        end
        local until_s = d:get(key("su:", name))
        if until_s and now < until_s then
            return true
        end
        if liveness.holds(node, ss, now, o) then
            return true
        end
    end
    -- the worker-local count is checked against the shared in-flight count: a count
    -- left behind by an attempt that never reached finished() cannot make an idle node
    -- stalled
    if not streaming[name] or inflight(name) < 1 then
        return false
    end
    local silent = now - lb
    if silent <= o.edge.stall_min_s then
        return false
    end
    local thr = _M.threshold(name, o)
    if silent <= thr then
        return false
    end
    if not found then
        log(WARN, "infergate: node ", name, " is stalled: streams in flight and no byte for ",
            string.format("%.1f", silent), " s (threshold ", string.format("%.1f", thr),
            " s); no new requests until it sends again")
        d:set(key("ss:", name), now)
    end
    d:set(key("sl:", name), now, _M.FLAG_TTL_FACTOR * thr)
    return true
end

-- The node's threshold (s) when a try just sent to `name` is a probe of a stalled node
-- (found stalled, no byte since), else nil.
function _M.probe_threshold(name, o)
    o = o or config.get()
    if o.edge.stall_gap_factor <= 0 or not silent_since(dict(), name) then
        return nil
    end
    return _M.threshold(name, o)
end

-- Half the read timeout (s) of a stream try on node `name` with another node left to
-- retry on (infergate.admission.deadline.probe_read doubles it), or nil (off):
-- max(edge.stall_first_byte_s, 2 x ttfb_thr, 2 x the stall threshold) / 2, ttfb_thr being
-- the node's TTFB outlier threshold for streams. A node silent that long before the first
-- byte (frozen while the request waited) has the request retried on another node; in
-- the middle of a stream such a silence is far past the stall threshold, and the stream
-- ends there as it would at its deadline.
function _M.stream_read_half(name, o, ttfb_thr)
    if o.edge.stall_first_byte_s <= 0 or o.edge.stall_gap_factor <= 0 then
        return nil
    end
    local r = o.edge.stall_first_byte_s
    if 2 * ttfb_thr > r then
        r = 2 * ttfb_thr
    end
    local st = 2 * _M.threshold(name, o)
    if st > r then
        r = st
    end
    return r / 2
end

-- Stall state of node `name` for the edge's reports: true when it was found stalled, sent
-- no byte since, and the finding still holds: its flag lives or this edge still has
-- requests on it (`inflight`). A node found stalled that holds none of this edge's
-- requests any more is left to the control plane's own polls (so that a node that
-- resumed is not kept out by a stale report while it gets no request to prove it).
function _M.flagged(name, inflight)
    local d = dict()
    local ss = silent_since(d, name)
    if not ss then
        -- or: requests in flight, and no byte since two liveness checks got no answer
        -- (a frozen node none of whose requests was streaming: infergate.routing.liveness;
        -- two, EARLY_RECHECK_S apart, as the report takes the node from every edge: one
        -- check missed by a host short of CPU is no frozen node)
        local lx = (inflight or 0) > 0 and liveness.failed_early(name, true)
        return lx and lx >= liveness.last_byte(name)
            or false
    end
    return (d:get(key("sl:", name)) ~= nil) or (inflight or 0) > 0
end

-- Seconds since the node's last byte seen by this edge, or nil (never).
function _M.silent_s(name, now)
    local lb = dict():get(key("lb:", name))
    return lb and (now or ngx_now()) - lb or nil
end

return _M
