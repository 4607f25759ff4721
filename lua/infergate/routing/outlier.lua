-- Outlier detection on time to first byte (TTFB): a node that stops answering (accepts
-- requests, never sends a first byte, while /health and /metrics look fine) gets no new
-- request from this edge until it answers again, without waiting for the health poll or
-- for enough timeouts to open its circuit breaker.
--
-- A node is an outlier when either
--   * this worker's oldest attempt on it still waiting for its first byte has waited
--     longer than the threshold, and no first byte came from the node for as long. An
--     attempt that queued `ahead` places behind this edge's full batch on the node (in
--     flight at its start beyond the learned concurrency, infergate.routing.speed) waits
--     for its turn: while at most `ahead` of this edge's attempts on the node ended since
--     it started (the last of them gave it its place in the batch, and it may still be
--     reading its prompt) and some byte came from the node within the threshold
--     (infergate.routing.stall "lb:"), the node is busy, not an outlier (a busy node's
--     queue moves only when an answer of its batch ends; one that ends answers and
--     still starts nothing new is found as before); or
--   * another worker found that and flagged it ("ol:<node>"), and no first byte came from
--     the node since.
-- threshold = max(floor, edge.outlier_ttfb_factor x p90), where p90 is the 90th
-- percentile of the node's last SAMPLES TTFBs of the same kind seen by one worker (each
-- keeps its own ring and publishes the p90 when it changes; streams and non-streams
-- apart: a non-streamed answer's first byte comes with the whole answer; only attempts
-- that did not queue behind this edge's own requests on the node,
-- infergate.routing.speed.queued, so a node kept busy does not raise its own bar), or
-- outlier_ttfb_min_s while it has none (the prior). floor = edge.outlier_stream_ttfb_min_s
-- for streams (a first chunk is prefill and one token, whatever the answer's length),
-- edge.outlier_ttfb_min_s for non-streams. Guard rails (infergate.routing.guard): at most
-- CEILING_FACTOR x outlier_ttfb_min_s (a p90 learned during a slow spell cannot make a
-- hang take minutes to find), and STALE_S after the node's last first byte the
-- threshold returns to the prior with a half-life of HALF_LIFE_S (what a node showed
-- long ago says little now). outlier_ttfb_factor = 0 turns detection off.
-- The flag expires after FLAG_TTL_FACTOR x threshold; the worker whose attempt is still
-- waiting sets it again on its next pick. A node found an outlier that has not sent a
-- first byte since ("os:<node>" newer than "fb:<node>") gets one request of this edge at
-- a time (an outlier while it has any in flight), like a half-open breaker; each such
-- probe that waited past the threshold and ended without a first byte keeps the node
-- out for min(PROBE_BACKOFF_MAX_S, threshold x 2^probes) more (and no probe goes before
-- the node answers a liveness check, infergate.routing.liveness), so a node that hangs for
-- good costs a few requests, not one per request deadline. A probe with another node to
-- retry on waits only part of its time (probe_threshold, and admission.deadline.probe_read):
-- a probe of a node still hung is then retried on another node, and costs its client that
-- wait, not a timeout. Before the threshold: a node quiet for edge.liveness_suspect_s gets
-- an early liveness check, and is an outlier once that check got no answer (early(), below).
-- The balancer never excludes every candidate: when all eligible nodes are outliers, it
-- picks among them as usual.
--
-- Shared dict infergate_stats (all workers):
--   "tq:<s|n>:<node>"        p90 TTFB (s) of the node's last SAMPLES streams / non-streams
--                            (the ring of the worker that last saw it change)
--   "tt:<s|n>:<node>"        epoch s of the last such TTFB (written at most every second
--                            per worker, and with every change of the p90)
--   "fb:<node>"              epoch s of the node's last first byte seen by this edge
--   "ol:<node>"              epoch s the node was found an outlier (with a TTL)
--   "oe:<node>"              the "ol:" value when an early check set it (same TTL)
--   "os:<node>"              the same, without a TTL (the last time it was found one;
--                            removed with the others at its next first byte)
--   "op:<node>"              probes in a row that ended unanswered, "ou:<node>" epoch s
--                            before which it gets no probe
-- Worker-local: this worker's attempts per node in start order (a queue whose head is the
-- oldest attempt not yet answered, closed or released).
--
-- track(att, stream, req)  balancer phase, after stats.open_attempt (req, not a stream:
--                      not an outlier before learned.answer_bound_s, its own answer time)
-- first_byte(req[, now]) the node answered: the headers of a complete answer, the first
--                      body chunk of a stream (infergate.filters); now: epoch s (clock)
-- finished(att, now)   when an attempt ends (log phase, or the balancer before a retry)
-- is_outlier(node, now) balancer phase (no I/O: shared dict and local tables only); also
--                      true for a node stalled mid-stream (infergate.routing.stall)
local config = require("infergate.core.config")
local key = require("infergate.core.memo").keyer()
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local stats = require("infergate.routing.stats")
local speed = require("infergate.routing.speed")
local stall = require("infergate.routing.stall")
local liveness = require("infergate.routing.liveness")
local ring = require("infergate.routing.ring")
local guard = require("infergate.routing.guard")
local learned = require("infergate.routing.learned")

local _M = {}

local shared = ngx.shared
local log = ngx.log
local WARN = ngx.WARN

_M.SAMPLES = 20
_M.FLAG_TTL_FACTOR = 3
_M.PROBE_BACKOFF_MAX_S = 60
_M.CEILING_FACTOR = 12
_M.STALE_S = 60
_M.HALF_LIFE_S = 60

-- node -> {head = attempt, tail = attempt}: this worker's attempts still waiting for a first
-- byte, oldest first, linked through att.wprev / att.wnext (unlinked at the first byte or
-- the attempt's end: no loop on the request path, which LuaJIT would not compile).
local waiting = {}

local function dict()
    return shared[config.DICT_STATS]
end

local rings = {}        -- "<s|n>:<node>" -> {n = samples held, i = next slot, [1..SAMPLES]}
_M._p90_of = ring.p90_of

-- Adds a TTFB sample (s) to this worker's ring and stores the ring's p90 for every
-- worker when it changed.
local sampled = {}      -- "<s|n>:<node>" -> when this worker last wrote "tt:" for it

local function add_sample(d, name, kind, ttfb)
    local base = kind .. ":" .. name
    local p = ring.push(rings, base, ttfb, _M.SAMPLES)
    if p then
        d:set("tq:" .. base, p)
    end
    local now = ngx_now()
    if p or now - (sampled[base] or 0) >= 1 then
        sampled[base] = now
        d:set("tt:" .. base, now)
    end
end

-- p90 TTFB (s) of node `name` for streams (stream = true) or non-streams, or nil.
function _M.p90(name, stream)
    return dict():get("tq:" .. (stream and "s" or "n") .. ":" .. name)
end

-- Threshold (s) for an attempt of this kind on node `name` (now: epoch s, default the
-- clock), with the guard rails of the header: the prior outlier_ttfb_min_s, the floor,
-- the ceiling CEILING_FACTOR x the prior, the decay back to the prior.
function _M.threshold(name, stream, o, now)
    o = o or config.get()
    local prior = o.edge.outlier_ttfb_min_s
    local kind = stream and "s:" or "n:"
    local d = dict()
    local p = d:get("tq:" .. kind .. name)
    if not p then
        return prior
    end
    local floor = stream and o.edge.outlier_stream_ttfb_min_s or prior
    local thr = o.edge.outlier_ttfb_factor * p
    local at = d:get("tt:" .. kind .. name)
    if at then
        thr = guard.decay(thr, prior, (now or ngx_now()) - at, _M.STALE_S, _M.HALF_LIFE_S)
    end
    return guard.clamp(thr, floor, _M.CEILING_FACTOR * prior)
end

-- Attempts on node `name` this edge has ended so far (opened, no longer in flight).
local function ended(name)
    return stats.requests(name) - stats.inflight(name)
end

function _M.track(att, stream, req)
    att.stream = stream == true
    att.req = not att.stream and req or nil
    if config.get().edge.outlier_ttfb_factor <= 0 then
        return -- detection off: nothing would ever take the attempt off the queue
    end
    local name = att.node
    local q = waiting[name]
    if not q then
        q = {}
        waiting[name] = q
    end
    local tail = q.tail
    att.wprev = tail
    if tail then
        tail.wnext = att
    else
        q.head = att
    end
    q.tail = att
    att.waiting = true
    att.ended0 = ended(name)
end

-- Takes the attempt off its node's waiting list (once).
local function unlink(att)
    if not att.waiting then
        return
    end
    att.waiting = false
    local q = waiting[att.node]
    if not q then
        return
    end
    local p, n = att.wprev, att.wnext
    if p then
        p.wnext = n
    else
        q.head = n
    end
    if n then
        n.wprev = p
    else
        q.tail = p
    end
    att.wprev, att.wnext = nil, nil
end
_M._unlink = unlink

function _M.first_byte(req, now)
    local attempts = req and req.attempts
    local att = attempts and attempts[#attempts]
    if not att or att.first_byte then
        return
    end
    att.first_byte = true
    unlink(att)
    now = now or ngx_now()
    req.first_byte_at = req.first_byte_at or now  -- the client's TTFB (core.prometheus)
    local d = dict()
    local name = att.node
    -- "ol", "op" and "ou" are only ever set once "os" is: a node never found an outlier
    -- costs one read here
    local seen = d:get(key("os:", name))
    d:set(key("fb:", name), now)
    if seen then
        d:delete(key("ol:", name))
        d:delete(key("op:", name))
        d:delete(key("ou:", name))
        d:delete(key("os:", name))
    end
    local ttfb = now - att.started
    if ttfb >= 0 and not speed.queued(att) then
        add_sample(d, name, att.stream and "s" or "n", ttfb)
    end
end

local function done(att)
    return att.closed or att.released or att.first_byte
end

-- This worker's oldest attempt on `name` still waiting for its first byte, or nil. An
-- attempt that ended without finished() (cannot happen on the request path) is dropped
-- from the head here, up to two per call.
local function oldest_waiting(name)
    local q = waiting[name]
    local att = q and q.head
    if att and done(att) then
        unlink(att)
        att = q.head
        if att and done(att) then
            unlink(att)
            att = q.head
        end
    end
    if att and not done(att) then
        return att
    end
    return nil
end
_M._oldest_waiting = oldest_waiting

-- The early liveness check (infergate.routing.liveness): `node`, with attempt `att`
-- waiting past `suspect` s and no first byte since epoch s `fb`, gets one when no byte at
-- all came from it for as long either; true (and the node found an outlier, as by the
-- threshold) when such a check made since its last byte got no answer.
local function early(d, node, att, fb, now, o, suspect)
    local name = node.name
    local last = d:get(key("lb:", name)) or 0
    if fb > last then
        last = fb
    end
    local since = att.started > last and att.started or last
    if now - since <= suspect then
        return false
    end
    local failed = liveness.failed_early(name)
    if failed and failed >= last then
        local thr = _M.threshold(name, att.stream, o)
        log(WARN, "infergate: node ", name, " is an outlier: a request has waited ",
            string.format("%.1f", now - att.started), " s for its first byte, no byte for ",
            string.format("%.1f", now - since), " s and no answer to a liveness check;",
            " no new requests until it answers")
        d:set(key("ol:", name), now, _M.FLAG_TTL_FACTOR * thr)
        d:set(key("oe:", name), now, _M.FLAG_TTL_FACTOR * thr)
        d:set(key("os:", name), now)
        return true
    end
    liveness.suspect(node, since, o)
    return false
end

-- A flag an early check set (no answer: a frozen process) no longer holds once a later
-- check answered: the process runs again, and the node gets its probes one at a time as a
-- node found silent (below), not none until the flag expires. On nginx's proxy path the
-- request left on the node ends with its answer, whose first byte clears the flag.
local function refuted(d, node, flagged, o)
    return d:get(key("oe:", node.name)) == flagged and liveness.answered_since(node, flagged, o)
end

function _M.is_outlier(node, now, o)
    o = o or config.get()
    if stall.is_stalled(node, now, o, stats.inflight) then
        return true
    end
    if o.edge.outlier_ttfb_factor <= 0 then
        return false
    end
    local name = node.name
    local d = dict()
    local fb = d:get(key("fb:", name)) or 0
    local flagged = d:get(key("ol:", name))
    if flagged and flagged >= fb and not refuted(d, node, flagged, o) then
        return true
    end
    local seen = d:get(key("os:", name))
    if seen and seen >= fb then
        -- silent since it was found an outlier: one request at a time, and none while
        -- the last probes' backoff runs
        if stats.inflight(name) >= 1 then
            return true
        end
        local until_s = d:get(key("ou:", name))
        if until_s and now < until_s then
            return true
        end
        if liveness.holds(node, seen, now, o) then
            return true
        end
    end
    local att = oldest_waiting(name)
    if not att then
        return false
    end
    local waited = now - att.started
    local suspect = liveness.suspect_after(node, o)
    if suspect and waited > suspect and now - fb > suspect and early(d, node, att, fb, now, o,
            suspect) then
        return true
    end
    -- no threshold is below the lower floor: most picks end here, without the p90 read
    local floor = o.edge.outlier_ttfb_min_s
    local sfloor = o.edge.outlier_stream_ttfb_min_s
    if sfloor < floor then
        floor = sfloor
    end
    if waited <= floor or now - fb <= floor then
        return false
    end
    local thr = _M.threshold(name, att.stream, o)
    if waited > thr and att.req and att.own == nil then  -- not a stream: at least its own
        att.own = learned.answer_bound_s(name, att.req, now) or false
    end
    if waited <= thr or now - fb <= thr or waited <= (att.own or 0) then
        return false
    end
    local lc = att.k and speed.learned(name)
    local ahead = lc and att.k - speed.round_concurrency(lc) or 0
    if ahead > 0 and ended(name) - att.ended0 <= ahead
            and now - (d:get(key("lb:", name)) or 0) <= thr then
        return false   -- its turn is now or still to come, and the batch sends bytes: busy
    end
    if not flagged then
        log(WARN, "infergate: node ", name, " is an outlier: a request has waited ",
            string.format("%.1f", waited), " s for its first byte (threshold ",
            string.format("%.1f", thr), " s); no new requests until it answers")
    end
    d:set(key("ol:", name), now, _M.FLAG_TTL_FACTOR * thr)
    d:set(key("os:", name), now)
    return true
end

-- The node's threshold (s) when a try just sent to `name` is a probe of a silent
-- outlier (found one, no first byte since) or of a stalled node, else nil: the balancer then shortens that
-- try's read timeout (infergate.admission.deadline.probe_read), so that a probe of a node
-- still hung is retried on another node (no byte has reached the client:
-- proxy_next_upstream timeout) instead of waiting for its deadline. Shared-dict reads.
local function probe_of(name, stream, o)
    local st = stall.probe_threshold(name, o)
    if st then
        -- a probe of a stalled node: its first byte within the larger of both thresholds
        local thr = _M.threshold(name, stream, o)
        return thr > st and thr or st
    end
    if o.edge.outlier_ttfb_factor <= 0 then
        return nil
    end
    local d = dict()
    local seen = d:get(key("os:", name))
    if not seen or seen < (d:get(key("fb:", name)) or 0) then
        return nil
    end
    return _M.threshold(name, stream, o)
end

-- The threshold (s) that bounds a try's read (infergate.admission.deadline.probe_read
-- waits twice it) when the try has another node to retry on: a probe's (above), and for
-- a stream on any node the stall rule's first-byte bound
-- (infergate.routing.stall.stream_read_half), the smaller of both; nil: no bound.
function _M.probe_threshold(name, stream, o)
    o = o or config.get()
    local thr = probe_of(name, stream, o)
    if stream then
        local half = stall.stream_read_half(name, o, _M.threshold(name, true, o))
        if half and (not thr or half < thr) then
            return half
        end
    end
    return thr
end

-- Epoch s of the node's latest finding as silent: a TTFB outlier with no first byte
-- since ("os" not older than "fb"), or stalled with no byte since
-- (infergate.routing.stall.silent_since); nil when neither.
local function silent_finding(d, name)
    local since = d:get(key("os:", name))
    if since and since < (d:get(key("fb:", name)) or 0) then
        since = nil
    end
    local ss = stall.silent_since(d, name)
    if ss and (not since or ss > since) then
        since = ss
    end
    return since
end

-- True when a node found silent has not answered a liveness check since
-- (infergate.routing.liveness.holds): the circuit breaker's half-open probe waits too
-- (infergate.routing.candidates).
function _M.probe_held(node, now, o)
    o = o or config.get()
    return liveness.holds(node, silent_finding(dict(), node.name), now, o)
end

-- True when attempt `att` on `node`, still without a byte, should give up now: the node
-- was found a TTFB outlier or stalled (detected here too, as at a pick: a node whose every
-- slot is taken is in no pick) after the attempt started, sent no byte since, and did not
-- answer a liveness check made for that finding (infergate.routing.liveness.dead: a long
-- prefill is silent too, but its server answers), or was found so by an early check that
-- got no answer (liveness.failed_early: a running process answers /health within a
-- second, busy or not; for an answer not streamed, whose node may have most of it done,
-- a second check must fail too: a host short of CPU can miss one). A half-open probe
-- (sent after the finding) gives up when an early check begun after it was sent and
-- after the node's last byte got no answer (two, for an answer not streamed): the node
-- answered the check that let the probe go, then froze again. Called by the stream relay
-- while it waits for the answer's head (infergate.stream.leg), every WATCH_S.
function _M.gone_silent(node, att, now, o)
    o = o or config.get()
    _M.is_outlier(node, now, o)
    local d = dict()
    local name = node.name
    local since = silent_finding(d, name)
    if since == nil then
        return false
    end
    local last = liveness.last_byte(name)
    if since < att.started then
        return liveness.failed_since(name, math.max(att.started, last))
            and (att.stream or liveness.failed_early(name, true) ~= nil)
    end
    if liveness.dead(node, since, o) then
        return true
    end
    local failed = liveness.failed_early(name, not att.stream)
    return failed ~= nil and failed >= last
end

-- An attempt ended: a probe of a silent outlier (sent after it was found one) that waited
-- past the threshold without a first byte backs the node off (see the header).
function _M.finished(att, now)
    unlink(att)
    stall.finished(att, now)
    if att.first_byte or att.outlier_done then
        return
    end
    att.outlier_done = true
    local o = config.get()
    if o.edge.outlier_ttfb_factor <= 0 then
        return
    end
    local d = dict()
    local name = att.node
    local seen = d:get(key("os:", name))
    if not seen or seen < (d:get(key("fb:", name)) or 0) or att.started < seen then
        return
    end
    local thr = _M.threshold(name, att.stream, o)
    if now - att.started < thr then
        return -- ended early (the client left): no evidence either way
    end
    local n = d:incr(key("op:", name), 1, 0) or 1
    local wait = thr * 2 ^ n
    if wait > _M.PROBE_BACKOFF_MAX_S then
        wait = _M.PROBE_BACKOFF_MAX_S
    end
    d:set(key("ou:", name), now + wait)
end

-- Outlier state of node `name` for the status endpoint: true, false.
function _M.flagged(name)
    local d = dict()
    local flagged = d:get(key("ol:", name))
    return flagged ~= nil and flagged >= (d:get(key("fb:", name)) or 0)
        and not (d:get(key("oe:", name)) == flagged and liveness.last_answer(name) >= flagged)
end

return _M
