-- Request coalescing (see infergate.cache.lookup): on an exact miss the first request
-- takes a lock in the shared dict; identical requests arriving meanwhile wait for its
-- answer to be stored, and serve it as an exact hit.
local ngx_now = require("infergate.core.ngxapi").now
local shared = require("infergate.cache.shared")
local entries = require("infergate.cache.entry")

local _M = {}

local tostring = tostring
local with_redis = shared.with_redis

local opts = nil

-- The [cache] options (infergate.cache.lookup.init).
function _M.configure(o)
    opts = o
end

local function wait_for_leader(c, lock)
    local dict = ngx.shared[shared.DICT]
    local deadline = ngx_now() + opts.coalesce_wait_s
    local pause = opts.coalesce_poll_ms / 1000
    -- The leader releases the lock once its answer is stored, or marks it NOSTORE the
    -- moment it ends without one: poll the shared dict, and read Redis only then.
    while true do
        ngx.sleep(pause)
        local v = dict:get(lock)
        if v == shared.NOSTORE then
            return nil
        end
        if not v then
            local entry = with_redis(entries.get_entry, c.key, c)
            return entry
        end
        ngx.update_time()
        if ngx_now() >= deadline then
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
    local owner = req.id or tostring(ngx_now())
    local ok = dict and dict:add(lock, owner, opts.coalesce_wait_s)
    if ok then
        c.lock, c.owner = lock, owner
    elseif dict and dict:get(lock) ~= shared.NOSTORE then
        return wait_for_leader(c, lock)
    end
    return nil
end

return _M
