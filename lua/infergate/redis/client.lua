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
local url = require("infergate.redis.url")

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

local MAX_DEPTH = 8

-- URL parsing lives in infergate.redis.url; re-exported here for the callers.
_M.redact = url.redact
_M.parse_url = url.parse_url

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
