-- How fast the slots of a pool free up while requests wait for them, as this edge sees
-- it: the evidence that lets the queue's prediction (infergate.admission.slots.predict)
-- yield at once when the nodes speed up again.
--
-- The prediction prices the work ahead from each node's latency EWMA and answer-time
-- tail, which learn a speed-up only from answers that started after it: for about one
-- answer time after a slowed pool recovers, the answers that end are those that ran
-- slow, and requests that the recovered pool would serve in time were shed (a 429
-- burst right after the recovery of the pool_slowdown benchmark). Slots that free up
-- faster than predicted are seen at once.
--
-- Per pool (the request's model; "" without one), from every request that held one of
-- the pool's slots (req.picked: it went through the slot queue and reserved a node) and
-- ends with a 2xx answer (the log phase) while another waits in the queue (the pool's
-- slots were all taken): the gap since the previous such end, the mean of the first
-- MIN_GAPS gaps and then an EWMA of it (ALPHA), and how many gaps it holds. A request
-- shed from the queue held no slot: counted, a burst of 429s would read as slots
-- freeing up by the dozen. An error answer may free its slot early, but says nothing
-- of the pool's speed: left out, the rate errs slow, which never yields. The mean
-- first: slots that started together end together (gaps 0, s, 0, s, ...), and an EWMA
-- seeded with the first gap would read those slots as freeing up faster than they do
-- for many gaps. A gap longer than IDLE_S (no queue meanwhile, or nothing ending)
-- restarts the count.
-- rate(pool, now) = 1 / EWMA gap (slots freed per second) once MIN_GAPS gaps are in
-- and while the last end is recent (within max(STALE_MIN_S, STALE_GAPS x the gap));
-- else nil. Guard rails: the caller uses it only to yield (a faster rate than its own,
-- by at most infergate.admission.slots.FREE_YIELD_MAX), never to shed more.
--
-- Shared dict infergate_stats, "qfr:<pool>": packed doubles {time of the last end (s),
-- EWMA gap (s) or -1, gaps counted}. Two workers ending at once may count one end:
-- an average loses nothing by it. No I/O.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local queue = require("infergate.admission.queue")
local fairqueue = require("infergate.admission.fairqueue")
local ffi = require("ffi")

local _M = {}

_M.ALPHA = 0.1
_M.MIN_GAPS = 8
_M.IDLE_S = 2
_M.STALE_MIN_S = 1
_M.STALE_GAPS = 4

local shared = ngx.shared
local cdouble_p = ffi.typeof("const double *")
local buf = ffi.new("double[3]")
local BYTES = 3 * 8

local function dict()
    return shared[config.DICT_STATS]
end

local function load(pool)
    local raw = dict():get("qfr:" .. pool)
    if type(raw) ~= "string" or #raw ~= BYTES then
        return nil
    end
    return ffi.cast(cdouble_p, raw)
end

-- A request of `pool` admitted through the slot queue ended at `now`; `waiting`: another
-- request waits in the pool's queue.
function _M.ended(pool, now, waiting)
    local rec = load(pool)
    local last, gap, n = -1, -1, 0
    if rec then
        last, gap, n = rec[0], rec[1], rec[2]
    end
    if not waiting then
        if rec then
            dict():delete("qfr:" .. pool)   -- no queue: the next gap starts afresh
        end
        return
    end
    if last >= 0 then
        local g = now - last
        if g < 0 then
            g = 0
        end
        if g > _M.IDLE_S then
            gap, n = -1, 0
        elseif gap < 0 then
            gap, n = g, 1
        else
            n = n + 1
            gap = gap + math.max(_M.ALPHA, 1 / n) * (g - gap)
        end
    end
    buf[0], buf[1], buf[2] = now, gap, n
    dict():set("qfr:" .. pool, ffi.string(buf, BYTES), _M.IDLE_S * 4)
end

-- Slots of `pool` freed per second while requests waited (see the top of this file),
-- or nil.
function _M.rate(pool, now)
    local rec = load(pool)
    if not rec or rec[2] < _M.MIN_GAPS or rec[1] <= 0 then
        return nil
    end
    local gap = rec[1]
    local fresh = math.max(_M.STALE_MIN_S, _M.STALE_GAPS * gap)
    if now - rec[0] > fresh then
        return nil
    end
    return 1 / gap
end

-- Log phase: the end of a request that held a slot of a pool with known slots
-- (req.slot_pool and req.picked), counted when its answer was a 2xx (`status`: the
-- status sent to the client).
function _M.log(req, status)
    if req.slot_pool and req.picked and status and status >= 200 and status < 300 then
        local pool = req.model or ""
        _M.ended(pool, ngxapi.now(), not queue.empty(pool) or fairqueue.any_waiting(pool))
    end
end

return _M
