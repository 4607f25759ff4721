-- Whether this worker's nginx is shutting down, as opposed to reloading. Both make
-- ngx.worker.exiting() true in the old workers; a reload (`nginx -s reload`, SIGHUP, as
-- `infergate up` does when the embedder moves) starts new workers that serve on, and the
-- old ones finish what they hold, requests waiting for a slot included, as plain nginx
-- finishes its requests. Only a shutdown (SIGQUIT, `nginx -s quit`, a stop of `up`)
-- should answer a waiting request 503 shutting_down at once.
--
-- Every worker writes its start time into the shared dict infergate_stats
-- ("workers_started_at", the newest); an exiting worker that sees a start newer than its
-- own is being replaced: not closing. New workers start before the master signals the
-- old ones, but may not have run init_worker yet: an exiting worker waits up to
-- RELOAD_GRACE_S for one before it calls it a shutdown.
--
--   init_worker()  records this worker's start
--   now()          true while the worker is exiting and nginx is not reloading
--   stream_left(o, now)  seconds a started stream may still run (edge.shutdown_stream_s),
--                  or nil: no shutdown, or no such bound
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now

local _M = {}

_M.RELOAD_GRACE_S = 1

local KEY = "workers_started_at"
local started_at = nil     -- this worker's start (epoch s)
local exiting_since = nil  -- when this worker first saw itself exiting

local function dict()
    return ngx.shared[config.DICT_STATS]
end

function _M.init_worker()
    started_at = ngx_now()
    local d = dict()
    if d and (d:get(KEY) or 0) < started_at then
        d:set(KEY, started_at)
    end
end

local function reloaded()
    local d = dict()
    local newest = d and d:get(KEY)
    return newest and started_at and newest > started_at
end

function _M.now()
    if not ngx.worker.exiting() then
        return false
    end
    if reloaded() then
        return false   -- reloaded: new workers serve, this one finishes what it holds
    end
    local now = ngx_now()
    exiting_since = exiting_since or now
    return now - exiting_since >= _M.RELOAD_GRACE_S
end

function _M.stream_left(o, now)
    local bound = o.edge.shutdown_stream_s
    if not bound or bound <= 0 or not ngx.worker.exiting() or reloaded() then
        return nil -- a reload: the old worker finishes what it holds, streams included
    end
    if not _M.now() then
        return _M.RELOAD_GRACE_S -- not told apart from a reload yet: look again then
    end
    return exiting_since + _M.RELOAD_GRACE_S + bound - now
end

return _M
