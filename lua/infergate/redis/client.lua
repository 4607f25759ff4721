-- A small Redis client (RESP2) over ngx.socket.tcp cosockets.
--
-- Usable wherever cosockets are: timers, access/content phases (never balancer,
-- header_filter, body_filter or log).
--
--   local redis = require("infergate.redis.client")
--   local conf, err = redis.parse_url("redis://:secret@127.0.0.1:6379/2")
--   -- also rediss://... (TLS) and redis+sentinel://h1:26379,h2:26379/<service>[/db]
--   local c, err = redis.connect(conf, 200)          -- timeout in ms for every socket op
--   local v, err = c:command("GET", "key")          -- ngx.null for a missing key
--   local res, err = c:pipeline({{"GET", "a"}, {"HSET", "h", "f", "v"}})
--   c:keepalive()                                    -- or c:close() after an error
--
-- Errors are returned as nil, err (err a string); a Redis error reply to a single
-- command is nil, "ERR ..."; inside a pipeline it is a table {err = "ERR ..."} at its
-- position. After a transport error the connection is closed and must not be reused.
--
-- TLS (rediss://): sslhandshake on every new connection, verifying the certificate (CA
-- from lua_ssl_trusted_certificate) and the host name as written in the URL when
-- redis_tls_verify is on, presenting the client certificate redis_tls_cert_file when set.
-- Sentinel (redis+sentinel://): the master address comes from infergate.redis.sentinel; a new
-- connection checks ROLE is master, and a connect error or a READONLY answer makes the
-- next connect ask the sentinels again.
local _M = {}

local tcp = ngx.socket.tcp
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

-- TLS and Sentinel options of the edge (infergate.core.config), unless given.
local function url_options(o)
    if o then
        return o
    end
    local c = require("infergate.core.config").get()
    return {
        tls_verify = c.redis_tls_verify,
        tls_cert_pem = c.redis_tls_cert_pem,
        tls_key_pem = c.redis_tls_key_pem,
        sentinel_password = c.redis_sentinel_password,
    }
end

-- redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or
-- redis+sentinel://[[user]:password@]h1[:port1][,h2[:port2]...]/<service>[/db].
-- Returns a table {host, port, db, password, username, pool} (plus ssl, server_name,
-- ssl_verify, ssl_cert_pem, ssl_key_pem for TLS; sentinel = {service, hosts, password,
-- id} and no host for Sentinel) or nil, err. opts: {tls_verify, tls_cert_pem,
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
    local o = url_options(opts)
    local dbpath = path:gsub("[?#].*$", "")
    if scheme == "redis+sentinel" then
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
            -- completed with the master's address at connect time
            pool = "infergate-redis:" .. ngx.md5(db .. "\0" .. (username or "") .. "\0"
                                                 .. (password or "")),
        }
    end
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
        -- connections differ by server, credentials, selected db and TLS
        pool = "infergate-redis:" .. ngx.md5(host .. "\0" .. port .. "\0" .. db .. "\0"
                                             .. (username or "") .. "\0" .. (password or "")
                                             .. (scheme == "rediss" and "\0tls" or "")),
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
                v = { err = verr }
            end
            arr[k] = v
        end
        return arr
    end
    return nil, "protocol error: unexpected reply type '" .. sub(line, 1, 1) .. "'"
end

-- Client certificate and key of a TLS configuration, parsed once per worker.
local parsed_certs = {}

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
        require("infergate.redis.sentinel").invalidate(conf)
    end
end

-- Connects (or reuses a pooled connection), authenticating and selecting the db on
-- new connections (TLS handshake first for rediss://; for Sentinel the master comes
-- from infergate.redis.sentinel and must answer ROLE "master"). timeout_ms applies to
-- connect, the handshake, each send and each read.
function _M.connect(conf, timeout_ms)
    if type(conf) ~= "table" or not (conf.host or conf.sentinel) then
        return nil, "redis connect: bad configuration"
    end
    local t = tonumber(timeout_ms) or 200
    local host, port, pool = conf.host, conf.port, conf.pool
    if conf.sentinel then
        host, port = require("infergate.redis.sentinel").master(conf, t)
        if not host then
            return nil, "redis sentinel: " .. tostring(port)
        end
        pool = conf.pool .. ":" .. host .. ":" .. port
    end
    local sock, err = tcp()
    if not sock then
        return nil, "redis socket: " .. tostring(err)
    end
    sock:settimeouts(t, t, t)
    local ok
    ok, err = sock:connect(host, port, { pool = pool })
    if not ok then
        invalidate_master(conf)
        return nil, "redis connect " .. host .. ":" .. port .. ": " .. tostring(err)
    end
    local self = setmetatable({ sock = sock, conf = conf }, client)
    local reused = sock:getreusedtimes()
    if not reused or reused == 0 then
        if conf.ssl then
            ok, err = tls_handshake(sock, conf)
            if not ok then
                self:close()
                return nil, "redis tls " .. host .. ":" .. port .. ": " .. tostring(err)
            end
        end
        local setup = {}
        if conf.password then
            if conf.username then
                setup[#setup + 1] = { "AUTH", conf.username, conf.password }
            else
                setup[#setup + 1] = { "AUTH", conf.password }
            end
        end
        if conf.db and conf.db ~= 0 then
            setup[#setup + 1] = { "SELECT", conf.db }
        end
        if conf.sentinel then
            setup[#setup + 1] = { "ROLE" }
        end
        if #setup > 0 then
            local res, perr = self:pipeline(setup)
            if not res then
                invalidate_master(conf)
                return nil, perr
            end
            for k = 1, #res do
                if type(res[k]) == "table" and res[k].err then
                    self:close()
                    return nil, "redis " .. setup[k][1] .. ": " .. res[k].err
                end
            end
            if conf.sentinel then
                local role = res[#res]
                if type(role) ~= "table" or role[1] ~= "master" then
                    self:close()
                    invalidate_master(conf)
                    return nil, "redis " .. host .. ":" .. port .. " named by the sentinels is "
                        .. "not a master (role " .. tostring(type(role) == "table" and role[1]) .. ")"
                end
            end
        end
    end
    return self
end

-- A READONLY error reply: the master this connection reached was demoted.
local function check_readonly(self, err)
    if self.conf.sentinel and type(err) == "string" and sub(err, 1, 8) == "READONLY" then
        self.stale = true
        invalidate_master(self.conf)
    end
end

-- One command. Returns the reply or nil, err ("ERR ..." for Redis error replies,
-- in which case the connection stays usable).
function client:command(...)
    if not self.sock then
        return nil, "redis: connection closed"
    end
    local args = { ... }
    if #args == 0 then
        return nil, "redis command: no arguments"
    end
    local ok, err = self.sock:send(encode(args))
    if not ok then
        self:close()
        return nil, "redis send: " .. tostring(err)
    end
    local v, rerr = read_reply(self.sock, 0)
    if v == nil then
        self:close()
        return nil, "redis read: " .. tostring(rerr)
    end
    if v == false then
        check_readonly(self, rerr)
        return nil, rerr
    end
    return v
end

-- Several commands in one round trip. cmds = {{"GET", "k"}, {"HSET", ...}}. Returns an
-- array of replies (a Redis error reply becomes {err = "..."}) or nil, err.
function client:pipeline(cmds)
    if not self.sock then
        return nil, "redis: connection closed"
    end
    if type(cmds) ~= "table" or #cmds == 0 then
        return nil, "redis pipeline: no commands"
    end
    local parts = {}
    for k = 1, #cmds do
        parts[k] = encode(cmds[k])
    end
    local ok, err = self.sock:send(concat(parts))
    if not ok then
        self:close()
        return nil, "redis send: " .. tostring(err)
    end
    local out = {}
    for k = 1, #cmds do
        local v, rerr = read_reply(self.sock, 0)
        if v == nil then
            self:close()
            return nil, "redis read: " .. tostring(rerr)
        end
        if v == false then
            check_readonly(self, rerr)
            v = { err = rerr }
        end
        out[k] = v
    end
    return out
end

-- Returns the connection to the keepalive pool (idle_ms, pool_size default 30 s, 8).
function client:keepalive(idle_ms, pool_size)
    if not self.sock then
        return nil, "closed"
    end
    if self.stale then
        self:close()
        return nil, "closed: the server is no longer the master"
    end
    local ok, err = self.sock:setkeepalive(idle_ms or 30000, pool_size or 8)
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
