-- A small Redis client (RESP2) over ngx.socket.tcp cosockets: URL parsing, the wire
-- protocol, commands and pipelines on one connection. Connections are opened, pooled and
-- backed off by infergate.redis.pool; every module that talks to Redis goes through it.
--
-- Usable wherever cosockets are: timers, access/content phases (never balancer,
-- header_filter, body_filter or log).
--
--   local redis = require("infergate.redis.client")
--   local conf, err = redis.parse_url("redis://:secret@127.0.0.1:6379/2")
--   -- also rediss://... (TLS) and redis+sentinel://h1:26379,h2:26379/<service>[/db]
--   local c = redis.new(sock, conf)                  -- sock: a connected cosocket (the pool does this)
--   local v, err = c:command("GET", "key")          -- ngx.null for a missing key
--   local res, err = c:pipeline({{"GET", "a"}, {"HSET", "h", "f", "v"}})
--
-- Results follow the lua-resty-redis convention:
--   * a reply: the value (string, number, array table, ngx.null for nil replies);
--   * a Redis error reply: false, "ERR ..." (the connection stays usable); inside a
--     pipeline (or inside an array reply) an error reply is the table {false, "ERR ..."}
--     at its position (redis.error_of(v) returns its message);
--   * a transport error (send, timeout, closed, protocol): nil, err; the connection is
--     closed (c:closed() is true) and must not be reused.
local mastercache = require("infergate.redis.mastercache")

local _M = {}

local null = ngx.null
local concat = table.concat
local tostring = tostring
local tonumber = tonumber
local type = type
local sub = string.sub
local byte = string.byte

local client = {}
client.__index = client

local DEFAULT_PORT = 6379
local DEFAULT_SENTINEL_PORT = 26379
local MAX_DEPTH = 8

-- The URL without its credentials, for error messages (they end up in error.log).
local function redact(url)
    return (url:gsub("//[^/@]*@", "//***@"))
end
_M.redact = redact

local function host_port(hostport, default_port, url)
    local host, port
    if byte(hostport, 1) == 91 then -- "[" IPv6 literal
        host, port = hostport:match("^%[([^%]]+)%]:?(%d*)$")
    else
        host, port = hostport:match("^([^:]+):?(%d*)$")
    end
    if not host or host == "" then
        return nil, "redis url has no host: " .. redact(url)
    end
    port = (port and port ~= "") and tonumber(port) or default_port
    if not port or port < 1 or port > 65535 then
        return nil, "redis url port out of range: " .. redact(url)
    end
    return host, port
end

-- TLS and Sentinel options of the edge (infergate.core.config), unless given; none (TLS
-- verification on, no client certificate) where the edge options are not loaded.
local function url_options(o)
    if o then
        return o
    end
    local ok, c = pcall(require("infergate.core.config").get)
    if not ok or type(c) ~= "table" then
        return {}
    end
    return {
        tls_verify = c.redis.tls_verify,
        tls_cert_pem = c.redis.tls_cert_pem,
        tls_key_pem = c.redis.tls_key_pem,
        sentinel_password = c.redis.sentinel_password,
    }
end

-- The host and the credentials of a URL's authority part: hostport, username, password
-- (percent-decoded; nil when absent or empty).
local function split_authority(authority)
    local userinfo, hostport = authority:match("^(.*)@([^@]*)$")
    if not userinfo then
        hostport = authority
    end
    local username, password
    if userinfo and userinfo ~= "" then
        local u, p = userinfo:match("^([^:]*):(.*)$")
        if u then
            username, password = u, p
        else
            password = userinfo
        end
        if username == "" then username = nil end
        if password == "" then password = nil end
        -- percent-decoding of the credentials
        if password then password = ngx.unescape_uri(password) end
        if username then username = ngx.unescape_uri(username) end
    end
    return hostport, username, password
end

-- The configuration of a redis+sentinel:// URL (see parse_url), or nil, err.
local function sentinel_url(url, hostport, dbpath, username, password, o)
    local hosts = {}
    for hp in (hostport .. ","):gmatch("([^,]*),") do
        local h, p = host_port(hp, DEFAULT_SENTINEL_PORT, url)
        if not h then
            return nil, p
        end
        hosts[#hosts + 1] = { host = h, port = p }
    end
    local service, dbs = dbpath:match("^/([^/]+)/?(%d*)/?$")
    if not service and dbpath:match("^/[^/]+/") then
        return nil, "redis url path must be /<service>[/<db number>]: " .. redact(url)
    end
    if not service then
        return nil, "redis+sentinel:// url needs the service (master) name: "
            .. "redis+sentinel://host1:26379,host2:26379/mymaster[/db]"
    end
    service = ngx.unescape_uri(service)
    if not service:match("^[%w_.%-]+$") or #service > 128 then
        return nil, "redis+sentinel:// service name '" .. service
            .. "': letters, digits, '_', '.', '-'"
    end
    local db = dbs ~= "" and tonumber(dbs) or 0
    local ids = {}
    for i, h in ipairs(hosts) do
        ids[i] = h.host .. ":" .. h.port
    end
    return {
        db = db,
        username = username,
        password = password,
        sentinel = {
            service = service,
            hosts = hosts,
            password = (o.sentinel_password ~= "" and o.sentinel_password) or nil,
            id = service .. "@" .. concat(ids, ","),
        },
    }
end

-- The configuration of a redis:// or rediss:// URL (see parse_url), or nil, err.
local function server_url(url, scheme, hostport, dbpath, username, password, o)
    if hostport:find(",", 1, true) then
        return nil, "several hosts need redis+sentinel://: " .. redact(url)
    end
    local host, port = host_port(hostport, DEFAULT_PORT, url)
    if not host then
        return nil, port
    end
    local server_name = host
    if host == "localhost" then
        host = "127.0.0.1"
    end
    local db = 0
    if dbpath ~= "" and dbpath ~= "/" then
        local d = dbpath:match("^/(%d+)$")
        if not d then
            return nil, "redis url path must be /<db number>: " .. redact(url)
        end
        db = tonumber(d)
    end
    local conf = {
        host = host,
        port = port,
        db = db,
        username = username,
        password = password,
    }
    if scheme == "rediss" then
        conf.ssl = true
        conf.server_name = server_name
        conf.ssl_verify = o.tls_verify ~= false
        if o.tls_cert_pem and o.tls_cert_pem ~= "" then
            conf.ssl_cert_pem = o.tls_cert_pem
            conf.ssl_key_pem = o.tls_key_pem
        end
    end
    return conf
end

-- redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or
-- redis+sentinel://[[user]:password@]h1[:port1][,h2[:port2]...]/<service>[/db].
-- Returns a table {host, port, db, password, username} (plus ssl, server_name,
-- ssl_verify, ssl_cert_pem, ssl_key_pem for TLS; sentinel = {service, hosts, password,
-- id} and no host for Sentinel) or nil, err. The connection pool of a configuration is
-- named by infergate.redis.pool. opts: {tls_verify, tls_cert_pem,
-- tls_key_pem, sentinel_password}, default from infergate.core.config.
function _M.parse_url(url, opts)
    if type(url) ~= "string" or url == "" then
        return nil, "redis url must be a non-empty string"
    end
    local scheme, rest = url:match("^(%a[%w+.-]*)://(.*)$")
    if not scheme then
        return nil, "redis url must look like redis://[:password@]host:port/db"
    end
    scheme = scheme:lower()
    if scheme == "rediss+sentinel" then
        return nil, "rediss+sentinel:// is not supported: Sentinel works over plain TCP only "
            .. "(no TLS); use redis+sentinel://, or rediss:// to one server"
    end
    if scheme ~= "redis" and scheme ~= "rediss" and scheme ~= "redis+sentinel" then
        return nil, "unsupported redis url scheme '" .. scheme .. "'"
    end
    local authority, path = rest:match("^([^/?#]*)(.*)$")
    local hostport, username, password = split_authority(authority)
    local o = url_options(opts)
    local dbpath = path:gsub("[?#].*$", "")
    if scheme == "redis+sentinel" then
        return sentinel_url(url, hostport, dbpath, username, password, o)
    end
    return server_url(url, scheme, hostport, dbpath, username, password, o)
end

local function encode(args)
    local n = #args
    local out = { "*", n, "\r\n" }
    local i = 4
    for k = 1, n do
        local a = args[k]
        if type(a) ~= "string" then
            a = tostring(a)
        end
        out[i] = "$"
        out[i + 1] = #a
        out[i + 2] = "\r\n"
        out[i + 3] = a
        out[i + 4] = "\r\n"
        i = i + 5
    end
    return concat(out)
end
_M._encode = encode

-- Reads one reply. Returns value (string, number, table, ngx.null), or
-- false, "ERR ..." for an error reply, or nil, err for a transport/protocol error.
local function read_reply(sock, depth)
    local line, err = sock:receive("*l")
    if not line then
        return nil, err
    end
    local prefix = byte(line, 1)
    local rest = sub(line, 2)
    if prefix == 43 then -- "+"
        return rest
    elseif prefix == 45 then -- "-"
        return false, rest
    elseif prefix == 58 then -- ":"
        local n = tonumber(rest)
        if not n then
            return nil, "protocol error: bad integer reply"
        end
        return n
    elseif prefix == 36 then -- "$"
        local len = tonumber(rest)
        if not len then
            return nil, "protocol error: bad bulk length"
        end
        if len < 0 then
            return null
        end
        local data, rerr = sock:receive(len + 2)
        if not data then
            return nil, rerr
        end
        return sub(data, 1, len)
    elseif prefix == 42 then -- "*"
        local count = tonumber(rest)
        if not count then
            return nil, "protocol error: bad array length"
        end
        if count < 0 then
            return null
        end
        if depth >= MAX_DEPTH then
            return nil, "protocol error: nesting too deep"
        end
        local arr = {}
        for k = 1, count do
            local v, verr = read_reply(sock, depth + 1)
            if v == nil then
                return nil, verr
            end
            if v == false then
                v = { false, verr }
            end
            arr[k] = v
        end
        return arr
    end
    return nil, "protocol error: unexpected reply type '" .. sub(line, 1, 1) .. "'"
end

-- A client for `sock`, a connected cosocket (infergate.redis.pool connects, sets it up
-- and pools it). conf: the parsed URL (parse_url).
function _M.new(sock, conf)
    return setmetatable({ sock = sock, conf = conf }, client)
end

-- The message of an error reply found inside a pipeline or an array reply
-- ({false, "ERR ..."}), or nil for any other value.
function _M.error_of(v)
    if type(v) == "table" and v[1] == false then
        return v[2]
    end
    return nil
end

-- A READONLY error reply on a Sentinel connection: the master it reached was demoted.
-- The connection is then not pooled again, and the next connect asks the sentinels.
local function check_readonly(self, err)
    if self.conf and self.conf.sentinel and type(err) == "string"
            and sub(err, 1, 8) == "READONLY" then
        self.stale_flag = true
        mastercache.invalidate(self.conf)
    end
end

-- Sends `payload` and reads `n` replies. Returns an array of replies (error replies as
-- {false, err}) or nil, err after closing the connection.
local function round_trip(self, payload, n)
    if not self.sock then
        return nil, "redis: connection closed"
    end
    local ok, err = self.sock:send(payload)
    if not ok then
        self:close()
        self.error = "redis send: " .. tostring(err)
        return nil, self.error
    end
    local out = {}
    for k = 1, n do
        local v, rerr = read_reply(self.sock, 0)
        if v == nil then
            self:close()
            self.error = "redis read: " .. tostring(rerr)
            return nil, self.error
        end
        if v == false then
            check_readonly(self, rerr)
            v = { false, rerr }
        end
        out[k] = v
    end
    return out
end

-- One command. Returns the reply; false, "ERR ..." for a Redis error reply (the
-- connection stays usable); nil, err for a transport error (the connection is closed).
function client:command(...)
    local args = { ... }
    if #args == 0 then
        return false, "redis command: no arguments"
    end
    local res, err = round_trip(self, encode(args), 1)
    if not res then
        return nil, err
    end
    local v = res[1]
    if type(v) == "table" and v[1] == false then
        return false, v[2]
    end
    return v
end

-- Several commands in one round trip. cmds = {{"GET", "k"}, {"HSET", ...}}. Returns an
-- array with one entry per command: its reply, or {false, "ERR ..."} for a Redis error
-- reply (see error_of); nil, err for a transport error (the connection is closed).
function client:pipeline(cmds)
    if type(cmds) ~= "table" or #cmds == 0 then
        return false, "redis pipeline: no commands"
    end
    local parts = {}
    for k = 1, #cmds do
        if type(cmds[k]) ~= "table" or #cmds[k] == 0 then
            return false, "redis pipeline: command " .. k .. " has no arguments"
        end
        parts[k] = encode(cmds[k])
    end
    return round_trip(self, concat(parts), #cmds)
end

-- True once the connection is closed (after a transport error, close() or
-- setkeepalive()), with the transport error that closed it (nil after close() or
-- setkeepalive()).
function client:closed()
    if self.sock then
        return false
    end
    return true, self.error
end

-- How many times the underlying connection was taken from the keepalive pool (0 = new).
function client:reused()
    if not self.sock then
        return nil, "redis: connection closed"
    end
    return self.sock:getreusedtimes()
end

-- True when the connection must not go back to the pool (the master was demoted).
function client:stale()
    return self.stale_flag == true
end

-- Puts the connection into the cosocket keepalive pool it was connected with (the pool
-- module passes idle_ms and pool_size). Returns true or nil, err; the client is
-- unusable afterwards.
function client:setkeepalive(idle_ms, pool_size)
    if not self.sock then
        return nil, "redis: connection closed"
    end
    if self.stale_flag then
        self:close()
        return nil, "redis: closed, the server is no longer the master"
    end
    local ok, err = self.sock:setkeepalive(idle_ms, pool_size)
    self.sock = nil
    return ok, err
end

function client:close()
    if self.sock then
        self.sock:close()
        self.sock = nil
    end
end

return _M
