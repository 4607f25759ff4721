-- A small Redis client (RESP2) over ngx.socket.tcp cosockets.
--
-- Usable wherever cosockets are: timers, access/content phases (never balancer,
-- header_filter, body_filter or log).
--
--   local redis = require("infergate.redis")
--   local conf, err = redis.parse_url("redis://:secret@127.0.0.1:6379/2")
--   local c, err = redis.connect(conf, 200)          -- timeout in ms for every socket op
--   local v, err = c:command("GET", "key")          -- ngx.null for a missing key
--   local res, err = c:pipeline({{"GET", "a"}, {"HSET", "h", "f", "v"}})
--   c:keepalive()                                    -- or c:close() after an error
--
-- Errors are returned as nil, err (err a string); a Redis error reply to a single
-- command is nil, "ERR ..."; inside a pipeline it is a table {err = "ERR ..."} at its
-- position. After a transport error the connection is closed and must not be reused.
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
local MAX_DEPTH = 8

-- redis://[[user]:password@]host[:port][/db]. Returns a table
-- {host, port, db, password, username, pool} or nil, err.
function _M.parse_url(url)
    if type(url) ~= "string" or url == "" then
        return nil, "redis url must be a non-empty string"
    end
    local scheme, rest = url:match("^(%a[%w+.-]*)://(.*)$")
    if not scheme then
        return nil, "redis url must look like redis://[:password@]host:port/db"
    end
    scheme = scheme:lower()
    if scheme == "rediss" then
        return nil, "rediss:// (TLS) is not supported by the edge; use redis:// on a trusted network"
    end
    if scheme ~= "redis" then
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
    local host, port
    if byte(hostport, 1) == 91 then -- "[" IPv6 literal
        host, port = hostport:match("^%[([^%]]+)%]:?(%d*)$")
    else
        host, port = hostport:match("^([^:]+):?(%d*)$")
    end
    if not host or host == "" then
        return nil, "redis url has no host: " .. url
    end
    if host == "localhost" then
        host = "127.0.0.1"
    end
    port = (port and port ~= "") and tonumber(port) or DEFAULT_PORT
    if not port or port < 1 or port > 65535 then
        return nil, "redis url port out of range: " .. url
    end
    local db = 0
    local dbpath = path:gsub("[?#].*$", "")
    if dbpath ~= "" and dbpath ~= "/" then
        local d = dbpath:match("^/(%d+)$")
        if not d then
            return nil, "redis url path must be /<db number>: " .. url
        end
        db = tonumber(d)
    end
    return {
        host = host,
        port = port,
        db = db,
        username = username,
        password = password,
        -- connections differ by server, credentials and selected db
        pool = "infergate-redis:" .. ngx.md5(host .. "\0" .. port .. "\0" .. db .. "\0"
                                             .. (username or "") .. "\0" .. (password or "")),
    }
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

-- Connects (or reuses a pooled connection), authenticating and selecting the db on
-- new connections. timeout_ms applies to connect, each send and each read.
function _M.connect(conf, timeout_ms)
    if type(conf) ~= "table" or not conf.host then
        return nil, "redis connect: bad configuration"
    end
    local sock, err = tcp()
    if not sock then
        return nil, "redis socket: " .. tostring(err)
    end
    local t = tonumber(timeout_ms) or 200
    sock:settimeouts(t, t, t)
    local ok
    ok, err = sock:connect(conf.host, conf.port, { pool = conf.pool })
    if not ok then
        return nil, "redis connect " .. conf.host .. ":" .. conf.port .. ": " .. tostring(err)
    end
    local self = setmetatable({ sock = sock, conf = conf }, client)
    local reused = sock:getreusedtimes()
    if not reused or reused == 0 then
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
        if #setup > 0 then
            local res, perr = self:pipeline(setup)
            if not res then
                return nil, perr
            end
            for k = 1, #res do
                if type(res[k]) == "table" and res[k].err then
                    self:close()
                    return nil, "redis " .. setup[k][1] .. ": " .. res[k].err
                end
            end
        end
    end
    return self
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
