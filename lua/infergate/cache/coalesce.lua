-- Request coalescing (see infergate.cache.lookup): on an exact miss the first request
-- takes a lock in the shared dict; identical requests arriving meanwhile wait for its
-- answer to be stored, and serve it as an exact hit.
--
-- How long: the lock lives as long as its leader may run (its own deadline, at least
-- coalesce_wait_s, at most LOCK_MAX_S), so a generation longer than coalesce_wait_s is
-- still one node request. A waiter that is not streamed waits for it up to its own
-- deadline (the leader started first: its answer is the soonest this request can have),
-- at least coalesce_wait_s; a streamed waiter, whose client sees nothing while it waits
-- (its first token comes that much later), waits coalesce_stream_wait_s at most, and not
-- at all at 0. Either goes on to a node at once when the leader ends without an answer
-- to store (the NOSTORE mark). The lock names the leader's worker ("<pid>:<request
-- id>"): when that worker is gone (killed, crashed) the leader never ends, and a waiter
-- takes the lock over and goes to a node itself, the others waiting for it instead.
local ngx_now = require("infergate.core.ngxapi").now
local workers = require("infergate.core.workers")
local shared = require("infergate.cache.shared")
local entries = require("infergate.cache.entry")
local deadline = require("infergate.admission.deadline")

local _M = {}

local tostring = tostring
local with_redis = shared.with_redis

local opts = nil

_M.LOCK_MAX_S = 600

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

-- Seconds request `req` may wait for, or hold, an identical request's answer (see the
-- top of this file).
local function bound_s(req, leader)
    if req.stream and not leader then
        return opts.coalesce_stream_wait_s or opts.coalesce_wait_s
    end
    local wait = opts.coalesce_wait_s
    local left = deadline.remaining(req)
    if left and left > wait then
        wait = left < _M.LOCK_MAX_S and left or _M.LOCK_MAX_S
    end
    return wait
end
_M.bound_s = bound_s

-- The lock's value for leader `req`: "<worker pid>:<request id>".
local function owner_of(req)
    return workers.pid() .. ":" .. (req.id or tostring(ngx_now()))
end

-- Takes the lock of a leader whose worker is gone (value `v`, still there): true when
-- this request is the leader now (c.lock, c.owner set).
local function take_over(req, c, lock, dict, v)
    if dict:get(lock) == v then
        dict:delete(lock)
    end
    local owner = owner_of(req)
    if dict:add(lock, owner, bound_s(req, true)) then
        c.lock, c.owner = lock, owner
        return true
    end
    return false
end

local function wait_for_leader(req, c, lock)
    local dict = ngx.shared[shared.DICT]
    local until_s = ngx_now() + bound_s(req, false)
    local pause = opts.coalesce_poll_ms / 1000
    -- The leader releases the lock once its answer is stored, or marks it NOSTORE the
    -- moment it ends without one: poll the shared dict, and read Redis only then.
    while true do
        ngx.sleep(pause)
        local v = dict:get(lock)
        if v == shared.NOSTORE then
            return nil
        end
        if v and workers.holder_gone(v) and take_over(req, c, lock, dict, v) then
            return nil
        end
        if not v then
            local entry = with_redis(entries.get_entry, c.key, c)
            return entry
        end
        ngx.update_time()
        if ngx_now() >= until_s then
            return nil
        end
    end
end

-- On an exact miss: the first of identical requests takes the lock (c.lock, c.owner,
-- released by infergate.cache.capture); the others wait for its answer. Returns the
-- entry to serve as an exact hit, or nil (the request goes on).
function _M.run(req, c, k)
    if not (opts.coalesce and opts.coalesce_wait_s > 0) then
        return nil
    end
    local dict = ngx.shared[shared.DICT]
    local lock = "lock:" .. k.exact
    local owner = owner_of(req)
    local ok = dict and dict:add(lock, owner, bound_s(req, true))
    if ok then
        c.lock, c.owner = lock, owner
    elseif dict and dict:get(lock) ~= shared.NOSTORE and bound_s(req, false) > 0 then
        return wait_for_leader(req, c, lock)
    end
    return nil
end

return _M
