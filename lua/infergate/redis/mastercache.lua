-- The Redis master address a Sentinel named (infergate.redis.sentinel), cached in the
-- shared dict infergate_snapshot: one entry per service and sentinel list, shared by
-- the workers. Forgetting it (invalidate) needs no connection, so the Redis client
-- (a READONLY answer) and the pool (a failed connect) call it without depending on the
-- module that asks the sentinels.
local config = require("infergate.core.config")

local _M = {}

local type = type

-- The shared dict the address lives in (nil where it does not exist).
function _M.dict()
    return ngx.shared[config.DICT_SNAPSHOT]
end

-- The dict key of the cached address of `conf` (a parsed redis+sentinel:// URL).
function _M.key(conf)
    return "sentinel:" .. conf.sentinel.id
end

-- Forget the cached master (the next connect asks the sentinels).
function _M.invalidate(conf)
    local d = _M.dict()
    if d and type(conf) == "table" and conf.sentinel then
        d:delete(_M.key(conf))
    end
end

return _M
