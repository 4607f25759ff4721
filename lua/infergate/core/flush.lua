-- Writes to Redis off the request path: one bounded queue per nginx worker, flushed by
-- ONE recurring timer per worker (ngx.timer.every edge.flush_interval_ms, started in
-- init_worker), pipelined to Redis through the connection pool handed to init_worker
-- (infergate.redis.pool; infergate.phases.init_worker hands it over).
--
--   init_worker_by_lua:  flush.init_worker(pool)   -- pool = infergate.redis.pool
--   local flush = require("infergate.core.flush")
--   flush.push("cache_store", { {"SET", k, v, "EX", 60}, ... }, cb)  -- any phase, no I/O
--   flush.count(hash, field, n, ttl_s)                                -- HINCRBY, summed
--
-- push(kind, cmds, cb) queues one write: cmds is a list of Redis commands (each a list
-- of arguments; may be empty), cb (optional) is called in the timer after the pipeline as
-- cb(replies, err): replies = the replies of cmds in order (an error reply is
-- {false, "ERR ..."}, see infergate.redis.client.error_of), err = a transport error or
-- the pool's back-off (replies nil). cb may do I/O (it runs in the timer) and may push
-- again. Returns true, or false when the queue already holds edge.flush_queue_max writes:
-- the write is dropped (cb is called at once with nil, "queue full" so a lock can be
-- released) and counted in infergate_edge_flush_dropped_total{kind} (infergate.core.prometheus),
-- never logged per write.
--
-- count(hash, field, n, ttl_s) adds n to a counter: the sums of a flush period go out as
-- one HINCRBY per field, after the queued writes of that flush (a request's entry is
-- written before its counters), then EXPIRE hash ttl_s. Counters are never dropped: when
-- Redis cannot be reached the sums are kept for the next flush.
--
-- A flush sends at most MAX_BATCH commands per pipeline and repeats until the queue is
-- empty. A failure is logged at most once every LOG_EVERY_S seconds per worker.
--
-- A worker that exits (nginx reload, `nginx -s quit`) runs its recurring timer one last
-- time at once, then goes on finishing the requests it serves: their writes (a cache
-- store and the release of its coalescing lock, counters) would never leave. After that
-- last run (the timer's `premature` call) a push or count starts one zero-delay timer
-- (nginx still runs those in an exiting worker) unless one is already pending, which
-- flushes until the queue is empty (at most EXIT_FLUSH_MAX_S when Redis cannot take it).
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local config = require("infergate.core.config")

local _M = {}

local type = type
local pairs = pairs
local pcall = pcall
local tostring = tostring
local tonumber = tonumber
local log = ngx.log
local WARN = ngx.WARN
local ERR = ngx.ERR

-- Used where the edge options do not say (edge.flush_interval_ms, edge.flush_queue_max).
_M.DEFAULT_INTERVAL_MS = 20
_M.DEFAULT_QUEUE_MAX = 10000
-- Most commands in one pipeline.
_M.MAX_BATCH = 2000
-- Socket timeout of a flush, milliseconds (at least edge.redis_timeout_ms). Off the request
-- path a slow answer costs nothing, while a timeout after the pipeline was sent leaves
-- open whether Redis applied it (counters sent again would count twice): a saturated
-- worker reads its replies late, so the flush waits longer than a request would.
_M.TIMEOUT_MS = 2000
_M.LOG_EVERY_S = 10
_M.EXIT_FLUSH_MAX_S = 5

-- The Redis connection pool (infergate.redis.pool: run(fn, _, timeout_ms)), handed in.
local pool = nil

local queue, qlen = {}, 0
local counts, count_ttl, ncounts = {}, {}, 0
local flushing = false
local started = false
local last_log = 0
local totals = { pushed = 0, dropped = 0, flushed = 0, failed = 0, flushes = 0 }

local function options()
    return config.get_or_empty()
end

local function queue_max()
    return tonumber(options().edge.flush_queue_max) or _M.DEFAULT_QUEUE_MAX
end

-- Logs at most once every LOG_EVERY_S seconds per worker (a Redis outage, a refused
-- write): a busy edge never floods the error log.
function _M.warn(...)
    local now = ngx_now()
    if now - last_log >= _M.LOG_EVERY_S then
        last_log = now
        log(WARN, "infergate: ", ...)
    end
end

local function metric_dropped(kind)
    local ok, m = pcall(require, "infergate.core.prometheus")
    if ok and m.flush_dropped then
        m.flush_dropped(kind)
    end
end

-- Set by the recurring timer's last (premature) run: from then on writes need
-- after_exit (defined below the timer) to leave.
local last_tick_done = false
local after_exit

-- Queues a write (see the header). Returns true, or false when dropped (queue full).
function _M.push(kind, cmds, cb)
    if qlen >= queue_max() then
        totals.dropped = totals.dropped + 1
        metric_dropped(kind or "other")
        if cb then
            pcall(cb, nil, "queue full")
        end
        return false
    end
    qlen = qlen + 1
    queue[qlen] = { kind = kind, cmds = cmds or {}, cb = cb }
    totals.pushed = totals.pushed + 1
    if last_tick_done then
        after_exit()
    end
    return true
end

-- Adds n (default 1) to field of hash at the next flush; the hash gets EXPIRE ttl_s.
function _M.count(hash, field, n, ttl_s)
    local h = counts[hash]
    if not h then
        h = {}
        counts[hash] = h
    end
    local cur = h[field]
    if not cur then
        ncounts = ncounts + 1
    end
    h[field] = (cur or 0) + (n or 1)
    if ttl_s then
        count_ttl[hash] = ttl_s
    end
    if last_tick_done then
        after_exit()
    end
end

-- Writes waiting in this worker's queue, and the counter fields not yet sent.
function _M.pending()
    return qlen, ncounts
end

-- {pushed, dropped, flushed, failed, flushes} of this worker since it started.
function _M.stats()
    return { pushed = totals.pushed, dropped = totals.dropped, flushed = totals.flushed,
             failed = totals.failed, flushes = totals.flushes, queued = qlen }
end

local function call_back(job, replies, err)
    if job.cb then
        local ok, cerr = pcall(job.cb, replies, err)
        if not ok then
            log(ERR, "infergate: flush callback (", tostring(job.kind), ") failed: ", cerr)
        end
    end
end

-- Sends jobs[first..last] (+ the counter commands when given) in one pipeline.
local function send(jobs, first, last, counter_cmds)
    local cmds, n = {}, 0
    for i = first, last do
        local jc = jobs[i].cmds
        for k = 1, #jc do
            n = n + 1
            cmds[n] = jc[k]
        end
    end
    local nc = counter_cmds and #counter_cmds or 0
    for k = 1, nc do
        cmds[n + k] = counter_cmds[k]
    end
    local res, err
    if n + nc > 0 and not pool then
        err = "no Redis pool (infergate.core.flush.use)"
    elseif n + nc > 0 then
        local t = math.max(_M.TIMEOUT_MS, tonumber(options().edge.redis_timeout_ms) or 0)
        res, err = pool.run(function(c)
            return c:pipeline(cmds)
        end, nil, t)
        if type(res) ~= "table" then
            err = err or "redis error"
            res = nil
        end
    else
        res = {}
    end
    totals.flushes = totals.flushes + 1
    if err then
        totals.failed = totals.failed + (last - first + 1)
        _M.warn("writes to Redis failed (", last - first + 1, " queued, kept counters): ", err)
    else
        totals.flushed = totals.flushed + (last - first + 1)
    end
    local pos = 0
    for i = first, last do
        local job = jobs[i]
        local jn = #job.cmds
        if err then
            call_back(job, nil, err)
        else
            local replies = {}
            for k = 1, jn do
                replies[k] = res[pos + k]
            end
            call_back(job, replies, nil)
        end
        pos = pos + jn
    end
    return err == nil
end

local function take_counters()
    if ncounts == 0 then
        return nil, nil
    end
    local taken, ttls = counts, count_ttl
    counts, count_ttl, ncounts = {}, {}, 0
    local cmds = {}
    for hash, fields in pairs(taken) do
        for field, v in pairs(fields) do
            cmds[#cmds + 1] = { "HINCRBY", hash, field, v }
        end
        if ttls[hash] then
            cmds[#cmds + 1] = { "EXPIRE", hash, ttls[hash] }
        end
    end
    return cmds, taken, ttls
end

local function restore_counters(taken, ttls)
    for hash, fields in pairs(taken) do
        for field, v in pairs(fields) do
            _M.count(hash, field, v, ttls[hash])
        end
    end
end

-- Flushes everything queued now (normally the timer does): returns the number of
-- writes handed to Redis or failed.
function _M.run_once()
    local done = 0
    -- writes queued by callbacks while flushing go out in the next round
    for _ = 1, 100 do
        if qlen == 0 and ncounts == 0 then
            break
        end
        local jobs, n = queue, qlen
        queue, qlen = {}, 0
        local first, size = 1, 0
        for i = 1, n do
            size = size + #jobs[i].cmds
            if size >= _M.MAX_BATCH and i < n then
                send(jobs, first, i, nil)
                first, size = i + 1, 0
            end
        end
        -- the counters go with the last batch: after the writes they count
        local ccmds, taken, ttls = take_counters()
        local ok
        if first <= n then
            ok = send(jobs, first, n, ccmds)
        else
            ok = send(jobs, 1, 0, ccmds)
        end
        if not ok and taken then
            restore_counters(taken, ttls)
            done = done + n
            break
        end
        done = done + n
    end
    return done
end

-- Functions the timer calls before each flush (they may push writes of their own).
local tick_hooks = {}

-- Registers fn(now) to run in this worker's flush timer before each flush (at module
-- load, e.g. infergate.admission.ratelimit returning expired leases). No per-request
-- timer: the one recurring timer runs them.
function _M.on_tick(fn)
    tick_hooks[#tick_hooks + 1] = fn
end

local function tick(premature)
    if premature then
        last_tick_done = true
    end
    if flushing then
        if premature then
            after_exit() -- the flush under way may not take what was queued meanwhile
        end
        return
    end
    flushing = true
    local now = ngx_now()
    for _, fn in ipairs(tick_hooks) do
        local hok, herr = pcall(fn, now)
        if not hok then
            log(ERR, "infergate: flush hook failed: ", herr)
        end
    end
    local ok, err = pcall(_M.run_once)
    flushing = false
    if not ok then
        log(ERR, "infergate: flush failed: ", err)
    end
end

-- The worker is exiting (see the header): flush what the requests it still serves queue.
local exit_pending = false

local function exit_flush()
    local until_s = ngx_now() + _M.EXIT_FLUSH_MAX_S
    while (qlen > 0 or ncounts > 0) and ngx_now() < until_s do
        if not flushing then
            tick(true)
        end
        if qlen > 0 or ncounts > 0 then
            ngx.sleep(0.01)  -- a flush still running, or Redis away: again shortly
        end
    end
    exit_pending = false
end

after_exit = function()
    if exit_pending then
        return
    end
    local ok, err = ngx.timer.at(0, exit_flush)
    if ok then
        exit_pending = true
    else
        _M.warn("cannot flush while the worker exits: ", err)
    end
end

-- The Redis connection pool writes go through (infergate.redis.pool, or a stand-in).
function _M.use(p)
    pool = p
end

-- init_worker_by_lua: starts this worker's flush timer (once), writing through the
-- connection pool `p` (infergate.redis.pool) when given.
function _M.init_worker(p)
    if p then
        pool = p
    end
    if started then
        return true
    end
    local ms = tonumber(options().edge.flush_interval_ms) or _M.DEFAULT_INTERVAL_MS
    local ok, err = ngx.timer.every(ms / 1000, tick)
    if not ok then
        log(ERR, "infergate: cannot start the flush timer: ", err)
        return nil, err
    end
    started = true
    return true
end

return _M
