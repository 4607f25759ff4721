-- Connections to Redis at the edge: the one way every module talks to Redis (snapshot
-- sync, cache lookup and store, API keys, rate limits, the sentinels).
--
--   local pool = require("infergate.redis.pool")
--   local v, err = pool.run(function(c) return c:command("GET", k) end)  -- the edge's Redis
--   local c, err = pool.connect()        -- or pool.connect(url | conf, timeout_ms)
--   ...                                  -- c:command(...), c:pipeline({...})
--   pool.release(c)                      -- always, also after an error
--
-- Targets: nil = the edge's redis_url (infergate.core.config); a URL string (parsed once
-- per worker and remembered: pool.conf(url)); or a table as from
-- infergate.redis.client.parse_url (the sentinel module passes its sentinels that way).
--
-- Connecting: plain TCP, TLS for rediss:// (sslhandshake on new connections, certificate
-- and host name checked when redis_tls_verify is on, client certificate when set), or
-- Sentinel for redis+sentinel:// (the master from infergate.redis.sentinel; a new
-- connection must answer ROLE "master"), or Redis Cluster for redis+cluster:// (connect
-- returns a cluster client, infergate.redis.cluster, whose node connections come from
-- this pool, each node pooled and backed off as a server of its own). New connections send AUTH and SELECT; every
-- socket operation waits at most redis_timeout_ms (or the timeout_ms given).
--
-- Pooling: connections go back to the nginx cosocket keepalive pool of the worker,
-- keeping up to redis_pool_size idle connections per pool for redis_idle_timeout_ms.
-- (Calls beyond redis_pool_size at once open a connection of their own, closed after
-- use; making them wait for a pooled one instead was measured slower at 1000 concurrent
-- requests per worker: the queue behind a saturated event loop outgrew the timeout.)
-- The pool name is "infergate-redis:" .. md5(host, port, db, user, password, TLS) (for
-- Sentinel: the sentinel list, service, db and credentials, then the master's
-- host:port), so different servers, databases or credentials never share a socket.
--
-- Back-off: after a failure (connect refused or timed out, TLS, AUTH or SELECT refused,
-- no master named by the sentinels, a send or read error or timeout on a connection)
-- every worker of the edge skips that target for limits.redis_retry_s (default 1 s):
-- connect() then returns at once nil, "redis backing off for N s after a failure: <the
-- failure>". The mark lives in the shared dict infergate_snapshot ("redis:backoff:<id>"),
-- so one failure spares all workers the timeout; a worker-local table stands in when
-- that dict does not exist. Not a failure: a timeout while another call to the same
-- target succeeded in this worker within the last limits.redis_retry_s (the worker is
-- saturated, Redis is not down). Redis error replies (false, err) are answers, not failures.
--
-- Results follow infergate.redis.client: value | false, "ERR ..." (Redis error reply) |
-- nil, err (transport error, bad URL or back-off).
local client = require("infergate.redis.client")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local config = require("infergate.core.config")
local sentinel = require("infergate.redis.sentinel")
local mastercache = require("infergate.redis.mastercache")
local cluster = require("infergate.redis.cluster")

local _M = {}

local type = type
local tostring = tostring
local tonumber = tonumber
local concat = table.concat
local format = string.format
local tcp = ngx.socket.tcp

-- Used where the edge options do not say (edge.redis_timeout_ms, edge.redis_pool_size,
-- edge.redis_idle_timeout_ms, limits.redis_retry_s of controlplane/config.py).
_M.DEFAULT_TIMEOUT_MS = 200
_M.DEFAULT_POOL_SIZE = 64
_M.DEFAULT_IDLE_TIMEOUT_MS = 60000
_M.DEFAULT_BACKOFF_S = 1.0
_M.BACKOFF_KEY_PREFIX = "redis:backoff:"

local memo = {}                                    -- url -> {conf, err}
local ids = setmetatable({}, { __mode = "k" })     -- conf -> identity (md5 hex)
local owners = setmetatable({}, { __mode = "k" })  -- client -> identity of its target
local local_backoff = {}                           -- identity -> "until err" (no dict)
local parsed_certs = {}                            -- pem -> {cert, key}, per worker

-- The edge options (infergate.core.config), or an empty table where they are not
-- loaded (code driving the Redis layer outside a rendered edge: the DEFAULT_* apply).
local function edge_options()
    return config.get_or_empty()
end

-- The pool's settings, worked out again only when the edge options table changes.
local settings, settings_of = nil, nil

local function opts()
    local o = edge_options()
    if settings and settings_of == o then
        return settings
    end
    local limits = type(o.limits) == "table" and o.limits or nil
    settings = {
        timeout_ms = tonumber(o.edge.redis_timeout_ms) or _M.DEFAULT_TIMEOUT_MS,
        pool_size = tonumber(o.edge.redis_pool_size) or _M.DEFAULT_POOL_SIZE,
        idle_ms = tonumber(o.edge.redis_idle_timeout_ms) or _M.DEFAULT_IDLE_TIMEOUT_MS,
        backoff_s = limits and tonumber(limits.redis_retry_s) or _M.DEFAULT_BACKOFF_S,
    }
    settings_of = o
    return settings
end

-- The parsed configuration of `url` (default: the edge's redis_url), parsed once per
-- worker. Returns conf or nil, err.
function _M.conf(url)
    url = url or edge_options().redis.url
    if url == nil then
        return nil, "no redis url: the edge options are not loaded"
    end
    local m = memo[url]
    if not m then
        local c, err = client.parse_url(url)
        m = { c, err }
        memo[url] = m
    end
    return m[1], m[2]
end

-- The identity of a target: what makes two configurations reach different data.
local function identity(conf)
    local id = ids[conf]
    if id then
        return id
    end
    local parts
    if conf.sentinel then
        parts = { "sentinel", conf.sentinel.id, conf.db or 0, conf.username or "",
                  conf.password or "" }
    elseif conf.cluster then
        parts = { "cluster", conf.cluster.id, conf.username or "", conf.password or "",
                  conf.ssl and "tls" or "" }
    else
        parts = { conf.host, conf.port, conf.db or 0, conf.username or "", conf.password or "",
                  conf.ssl and ("tls " .. tostring(conf.server_name)) or "" }
    end
    for k = 1, #parts do
        parts[k] = tostring(parts[k])
    end
    id = ngx.md5(concat(parts, "\0"))
    ids[conf] = id
    return id
end

-- The cosocket pool name of `conf`; host, port: the master's address for Sentinel.
function _M.pool_name(conf, host, port)
    local name = "infergate-redis:" .. identity(conf)
    if conf.sentinel then
        name = name .. ":" .. tostring(host) .. ":" .. tostring(port)
    end
    return name
end

local function resolve(target)
    if type(target) == "table" then
        if not (target.host or target.sentinel or target.cluster) then
            return nil, "redis: bad configuration"
        end
        return target
    end
    local conf, err = _M.conf(target)
    if not conf then
        return nil, "bad redis url: " .. tostring(err)
    end
    return conf
end

-- ------------------------------------------------------------------ back-off

local function dict()
    return ngx.shared[config.DICT_SNAPSHOT]
end

local backoff_keys = {}   -- identity -> its back-off key, built once

local function backoff_get(id)
    local key = backoff_keys[id]
    if not key then
        key = _M.BACKOFF_KEY_PREFIX .. id
        backoff_keys[id] = key
    end
    local d = dict()
    local v
    if d then
        v = d:get(key)
    else
        v = local_backoff[id]
    end
    if not v then
        return nil
    end
    local untils, err = v:match("^(%S+) (.*)$")
    local left = (tonumber(untils) or 0) - ngx_now()
    if left <= 0 then
        if not d then
            local_backoff[id] = nil
        end
        return nil
    end
    return left, err
end

-- When a call to a target last succeeded in this worker (epoch s), by identity.
local last_ok = {}

local function backoff_set(id, err)
    if not id then
        return
    end
    -- A timeout while other calls to the same target succeeded within the back-off time
    -- is this worker being slow (a saturated event loop), not Redis being down: the call
    -- fails, the others go on. (Refused connects and a Redis that stopped answering
    -- everyone still start it: the first at once, the second after one back-off time.)
    local e = tostring(err)
    local ok_at = last_ok[id]
    local o = opts()
    if ok_at and e:find("timeout", 1, true)
            and ngx_now() - ok_at < math.max(o.backoff_s, o.timeout_ms / 1000) then
        return
    end
    local s = opts().backoff_s
    local v = format("%.3f %s", ngx_now() + s, tostring(err))
    local d = dict()
    if d then
        d:set(_M.BACKOFF_KEY_PREFIX .. id, v, s)
    else
        local_backoff[id] = v
    end
end

-- Seconds left of the back-off of `target` (nil = the edge's Redis) and the failure that
-- started it, or nil when calls go through.
function _M.backoff_left(target)
    local conf = resolve(target)
    if not conf then
        return nil
    end
    return backoff_get(identity(conf))
end

-- False while `target` is backed off after a failure.
function _M.usable(target)
    return _M.backoff_left(target) == nil
end

-- Length of the back-off after a failure, seconds (limits.redis_retry_s).
function _M.backoff_s()
    return opts().backoff_s
end

-- ------------------------------------------------------------------ connecting

local function client_cert(conf)
    local key = conf.ssl_cert_pem .. "\0" .. (conf.ssl_key_pem or "")
    local p = parsed_certs[key]
    if p then
        return p[1], p[2]
    end
    local ssl = require("ngx.ssl")
    local cert, err = ssl.parse_pem_cert(conf.ssl_cert_pem)
    if not cert then
        return nil, "bad client certificate: " .. tostring(err)
    end
    local pkey
    pkey, err = ssl.parse_pem_priv_key(conf.ssl_key_pem or "")
    if not pkey then
        return nil, "bad client key: " .. tostring(err)
    end
    parsed_certs[key] = { cert, pkey }
    return cert, pkey
end

local function tls_handshake(sock, conf)
    if conf.ssl_cert_pem then
        local cert, pkey = client_cert(conf)
        if not cert then
            return nil, pkey
        end
        local ok, err = sock:setclientcert(cert, pkey)
        if not ok then
            return nil, "client certificate: " .. tostring(err)
        end
    end
    local session, err = sock:sslhandshake(nil, conf.server_name, conf.ssl_verify)
    if not session then
        return nil, err
    end
    return true
end

local function invalidate_master(conf)
    if conf.sentinel then
        mastercache.invalidate(conf)
    end
end

-- AUTH, SELECT and (Sentinel) ROLE on a new connection. Returns true or nil, err.
local function setup(c, conf, where)
    local cmds = {}
    if conf.password then
        if conf.username then
            cmds[#cmds + 1] = { "AUTH", conf.username, conf.password }
        else
            cmds[#cmds + 1] = { "AUTH", conf.password }
        end
    end
    if conf.db and conf.db ~= 0 then
        cmds[#cmds + 1] = { "SELECT", conf.db }
    end
    if conf.sentinel then
        cmds[#cmds + 1] = { "ROLE" }
    end
    if #cmds == 0 then
        return true
    end
    local res, err = c:pipeline(cmds)
    if not res then
        return nil, err
    end
    for k = 1, #res do
        local rerr = client.error_of(res[k])
        if rerr then
            return nil, "redis " .. cmds[k][1] .. ": " .. rerr
        end
    end
    if conf.sentinel then
        local role = res[#res]
        if type(role) ~= "table" or role[1] ~= "master" then
            return nil, "redis " .. where .. " named by the sentinels is not a master (role "
                .. tostring(type(role) == "table" and role[1]) .. ")"
        end
    end
    return true
end

-- The connect options (pool name and size) of `conf`, kept per configuration when it
-- has one address (Sentinel: the master's address is part of the pool name).
local connect_opts = setmetatable({}, { __mode = "k" })

local function connect_options(conf, host, port, pool_size)
    if conf.sentinel then
        return { pool = _M.pool_name(conf, host, port), pool_size = pool_size }
    end
    local c = connect_opts[conf]
    if not c or c.pool_size ~= pool_size then
        c = { pool = _M.pool_name(conf, host, port), pool_size = pool_size }
        connect_opts[conf] = c
    end
    return c
end

local function open(conf, t, o)
    local host, port = conf.host, conf.port
    if conf.sentinel then
        host, port = sentinel.master(conf, t)
        if not host then
            return nil, "redis sentinel: " .. tostring(port)
        end
    end
    local where = host .. ":" .. port
    local sock, err = tcp()
    if not sock then
        return nil, "redis socket: " .. tostring(err)
    end
    sock:settimeouts(t, t, t)
    local ok
    ok, err = sock:connect(host, port, connect_options(conf, host, port, o.pool_size))
    if not ok then
        invalidate_master(conf)
        return nil, "redis connect " .. where .. ": " .. tostring(err)
    end
    local c = client.new(sock, conf)
    local reused = sock:getreusedtimes()
    if reused and reused > 0 then
        return c
    end
    if conf.ssl then
        ok, err = tls_handshake(sock, conf)
        if not ok then
            c:close()
            return nil, "redis tls " .. where .. ": " .. tostring(err)
        end
    end
    ok, err = setup(c, conf, where)
    if not ok then
        c:close()
        invalidate_master(conf)
        return nil, err
    end
    return c
end

-- A connection to `target` (nil = the edge's Redis, a URL, or a parsed configuration),
-- from the pool or new. timeout_ms (default redis_timeout_ms) bounds connect, the TLS
-- handshake and every send and read. Returns a client (give it back with release) or
-- nil, err; a failure starts the back-off of the target, and a target in back-off is
-- not tried.
function _M.connect(target, timeout_ms)
    local conf, err = resolve(target)
    if not conf then
        return nil, err
    end
    local id = identity(conf)
    local left, last = backoff_get(id)
    if left then
        return nil, format("redis backing off for %.2f s after a failure: %s", left, tostring(last))
    end
    local o = opts()
    local c
    if conf.cluster then
        -- a cluster client: per-node connections from this pool (infergate.redis.cluster)
        c, err = cluster.connect(conf, tonumber(timeout_ms) or o.timeout_ms)
    else
        c, err = open(conf, tonumber(timeout_ms) or o.timeout_ms, o)
    end
    if not c then
        backoff_set(id, err)
        return nil, err
    end
    owners[c] = id
    return c
end

-- Gives a connection back: into the keepalive pool when it is healthy; a connection a
-- transport error closed starts the back-off of its target; one that reached a demoted
-- master is closed. Returns nothing.
function _M.release(c)
    if not c then
        return
    end
    local closed, err = c:closed()
    if closed then
        if err then
            backoff_set(owners[c], err)
        end
        return
    end
    if c:stale() then
        c:close()
        return
    end
    local o = opts()
    local id = owners[c]
    if id then
        last_ok[id] = ngx_now()
    end
    c:setkeepalive(o.idle_ms, o.pool_size)
end

-- Runs fn(c) on a connection to `target` (see connect) and releases it. Returns fn's
-- results (by convention value | false, err | nil, err), nil, err when no connection
-- could be had, or false, "redis call failed: ..." when fn raised a Lua error.
local function run_on(c, err, fn, a, b, d)
    if not c then
        return nil, err
    end
    local ok, res, ferr = pcall(fn, c, a, b, d)
    if not ok then
        c:close()
        return false, "redis call failed: " .. tostring(res)
    end
    _M.release(c)
    return res, ferr
end

function _M.run(fn, target, timeout_ms)
    local c, err = _M.connect(target, timeout_ms)
    return run_on(c, err, fn)
end

-- run(fn) on the edge's Redis with fn(c, a, b, d): the request path passes its
-- arguments instead of creating a closure per call.
function _M.run_with(fn, a, b, d)
    local c, err = _M.connect(nil)
    return run_on(c, err, fn, a, b, d)
end

-- the sentinels are asked through this pool (infergate.redis.sentinel), and the nodes
-- of a cluster are reached through it (infergate.redis.cluster)
sentinel.set_pool(_M)
cluster.set_pool(_M)

return _M
