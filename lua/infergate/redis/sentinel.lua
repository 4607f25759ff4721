-- Redis Sentinel at the edge: the address of the current master of a service.
--
--   local sentinel = require("infergate.redis.sentinel")
--   local host, port = sentinel.master(conf, 200)   -- conf from redis.parse_url("redis+sentinel://...")
--   sentinel.invalidate(conf)                       -- after a connection error or READONLY
--   sentinel.tick(conf, 200)                        -- sync timer: re-ask every refresh_s
--
-- The address is cached in the shared dict infergate_snapshot (one entry per service and
-- sentinel list, shared by the workers), so the request path normally asks no sentinel:
-- the sync timer asks every `redis_sentinel_refresh_s`, and a connection error or a
-- READONLY answer (the cached master was demoted) drops the entry so the next connect
-- asks again. Sentinels are asked in order with `SENTINEL get-master-addr-by-name
-- <service>` (AUTH first when redis.sentinel_password is set); the first one that names
-- an address wins. A change of master is logged once.
--
-- Connections to the sentinels go through infergate.redis.pool like every other Redis
-- connection: the pool hands itself in when it loads (set_pool), as it also asks this
-- module for the master of a redis+sentinel:// target. The cached address itself lives
-- in infergate.redis.mastercache. Cosockets only (timers, access and content phases).
-- Errors: nil, err.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local mastercache = require("infergate.redis.mastercache")

local _M = {}

local log = ngx.log
local WARN = ngx.WARN
local type = type
local tostring = tostring
local tonumber = tonumber
local concat = table.concat

local dict = mastercache.dict
local cache_key = mastercache.key

-- infergate.redis.pool, handed in by the pool when it loads.
local pool = nil

function _M.set_pool(p)
    pool = p
end

-- The connection settings of one sentinel of `conf`, built once per worker (so the pool
-- names it once).
local sentinel_confs = {}

local function sentinel_conf(s, conf)
    local key = conf.sentinel.id .. "\0" .. s.host .. ":" .. s.port .. "\0"
        .. (conf.sentinel.password or "")
    local sc = sentinel_confs[key]
    if not sc then
        sc = { host = s.host, port = s.port, db = 0, password = conf.sentinel.password }
        sentinel_confs[key] = sc
    end
    return sc
end

-- Asks one sentinel (through infergate.redis.pool: pooled, and skipped for the back-off
-- after it failed). Returns host, port or nil, err.
local function ask(s, conf, timeout_ms)
    if not pool then
        return nil, "no connection pool (infergate.redis.pool not loaded)"
    end
    local res, err = pool.run(function(c)
        return c:command("SENTINEL", "get-master-addr-by-name", conf.sentinel.service)
    end, sentinel_conf(s, conf), timeout_ms)
    if not res then
        return nil, err
    end
    if type(res) ~= "table" or type(res[1]) ~= "string" then
        return nil, "does not know the service " .. conf.sentinel.service
    end
    local port = tonumber(res[2])
    if not port or port < 1 or port > 65535 then
        return nil, "answered a bad port"
    end
    return res[1], port
end

-- Asks the sentinels now and caches the answer. Returns host, port or nil, err.
function _M.refresh(conf, timeout_ms)
    if type(conf) ~= "table" or type(conf.sentinel) ~= "table" then
        return nil, "not a sentinel configuration"
    end
    local errs = {}
    for _, s in ipairs(conf.sentinel.hosts) do
        local host, port = ask(s, conf, timeout_ms)
        if host then
            local d = dict()
            local key = cache_key(conf)
            local addr = host .. " " .. port
            local old = d and d:get(key)
            if d then
                d:set(key, addr)
                d:set(key .. ":ts", ngx_now())
            end
            local last = d and d:get(key .. ":logged")
            if last ~= addr then
                if d then
                    d:set(key .. ":logged", addr)
                end
                if last or old then
                    log(WARN, "infergate: Redis master of ", conf.sentinel.service, " is now ",
                        host, ":", port, " (was ", tostring(last or old):gsub(" ", ":"), ")")
                end
            end
            return host, port
        end
        errs[#errs + 1] = s.host .. ":" .. s.port .. ": " .. tostring(port)
    end
    return nil, "no sentinel named a master for " .. conf.sentinel.service .. " ("
        .. concat(errs, "; ") .. ")"
end

-- The cached master address, asking the sentinels when nothing is cached.
function _M.master(conf, timeout_ms)
    local d = dict()
    local v = d and d:get(cache_key(conf))
    if v then
        local host, port = v:match("^(%S+) (%d+)$")
        if host then
            return host, tonumber(port)
        end
    end
    return _M.refresh(conf, timeout_ms)
end

-- Forget the cached master (the next connect asks the sentinels).
_M.invalidate = mastercache.invalidate

-- Sync timer: ask again when the cached answer is older than redis_sentinel_refresh_s.
function _M.tick(conf, timeout_ms)
    if type(conf) ~= "table" or not conf.sentinel then
        return true
    end
    local d = dict()
    local ts = d and d:get(cache_key(conf) .. ":ts")
    if ts and d:get(cache_key(conf)) and ngx_now() - ts < config.get().redis.sentinel_refresh_s then
        return true
    end
    return _M.refresh(conf, timeout_ms)
end

return _M
