-- Redis Cluster at the edge (redis+cluster:// URLs): a client with the interface of
-- infergate.redis.client (command, pipeline) that sends each command to the master of
-- its key's slot, over the per-node keepalive pools of infergate.redis.pool.
--
--   local c, err = pool.connect()      -- for a redis+cluster:// redis.url: a cluster client
--   c:command("GET", key)              -- routed by CRC16 of the key (infergate.redis.crc16)
--   c:pipeline({...})                  -- split per node, replies put back in order
--   pool.release(c)                    -- gives every node connection back
--
-- Slot map: CLUSTER SLOTS (Redis >= 3.0; the replicas are not used), asked of the known
-- masters, then the URL's seeds, cached as text in the shared dict infergate_snapshot
-- ("cluster:<id>", shared by the workers) and decoded once per worker per change. It is
-- read again (by one worker at a time, at most every REFRESH_MIN_S) after a MOVED reply
-- or a failed node, and at least every MAP_FRESH_S; the old map serves meanwhile.
--
-- Redirections: MOVED -> the command is sent again, once, to the node named (the map is
-- marked stale); ASK -> ASKING + the command, once, on the node named; TRYAGAIN and
-- CLUSTERDOWN -> sent again after 20 ms, then 50 ms, then the error reply is returned.
-- A node that does not answer fails its commands (nil, err) and is backed off by the
-- pool like a single Redis, so the callers' fail-open / fail-static rules hold per shard.
-- Cosockets only (access/content phases, timers; never the balancer phase).
local crc16 = require("infergate.redis.crc16")
local client = require("infergate.redis.client")
local mastercache = require("infergate.redis.mastercache")

local _M = {}

local type = type
local tonumber = tonumber
local tostring = tostring
local upper = string.upper
local concat = table.concat
local slot_of = crc16.slot
local error_of = client.error_of

_M.REFRESH_MIN_S = 0.1
_M.MAP_FRESH_S = 30
_M.RETRY_SLEEPS = { 0.02, 0.05 }
_M.KEY_PREFIX = "cluster:"

-- Commands the edge sends that name no key (sent to any master).
local KEYLESS = { PING = true, TIME = true, SCRIPT = true, INFO = true, ECHO = true,
                  CLUSTER = true, ASKING = true }

local pool = nil -- infergate.redis.pool, handed in when it loads

function _M.set_pool(p)
    pool = p
end

-- The key a command {name, arg...} is routed by, or nil (any master).
function _M.command_key(cmd)
    local name = cmd[1]
    if type(name) ~= "string" then
        return nil
    end
    name = upper(name)
    if name == "EVAL" or name == "EVALSHA" then
        local n = tonumber(cmd[3])
        return (n and n > 0) and cmd[4] or nil
    end
    if KEYLESS[name] then
        return nil
    end
    return cmd[2]
end

-- "MOVED 3999 10.0.0.1:6381" / "ASK ..." -> kind, slot, host, port; else nil.
function _M.redirect(err)
    if type(err) ~= "string" then
        return nil
    end
    local kind, slot, host, port = err:match("^(%u+) (%d+) (%S+):(%d+)$")
    if kind ~= "MOVED" and kind ~= "ASK" then
        return nil
    end
    return kind, tonumber(slot), host, tonumber(port)
end

-- True for the replies a moment later may cure (slot migrating, cluster reconfiguring).
function _M.retryable(err)
    return type(err) == "string" and (err:find("^TRYAGAIN") ~= nil or err:find("^CLUSTERDOWN") ~= nil)
end

-- ------------------------------------------------------------------ slot map

-- The text form of a CLUSTER SLOTS reply ("start end host port" lines), or nil, err.
function _M.encode_slots(reply)
    if type(reply) ~= "table" or #reply == 0 then
        return nil, "empty slot map (CLUSTER SLOTS)"
    end
    local lines = {}
    for i, r in ipairs(reply) do
        local m = type(r) == "table" and r[3]
        local lo, hi = tonumber(r[1]), tonumber(r[2])
        if not lo or not hi or type(m) ~= "table" or type(m[1]) ~= "string" or not tonumber(m[2]) then
            return nil, "bad slot map entry " .. i
        end
        lines[i] = lo .. " " .. hi .. " " .. m[1] .. " " .. m[2]
    end
    return concat(lines, "\n")
end

-- The decoded map of its text: {slots = {[slot] = node index}, nodes = {{host, port, id}}}.
function _M.decode_map(text)
    local map = { slots = {}, nodes = {}, text = text }
    local index = {}
    for lo, hi, host, port in text:gmatch("(%d+) (%d+) (%S+) (%d+)") do
        local id = host .. ":" .. port
        local k = index[id]
        if not k then
            k = #map.nodes + 1
            map.nodes[k] = { host = host, port = tonumber(port), id = id }
            index[id] = k
        end
        for s = tonumber(lo), tonumber(hi) do
            map.slots[s] = k
        end
    end
    return map
end

local decoded = {} -- cluster id -> decoded map (per worker)
local last_refresh = {} -- cluster id -> time of this worker's last read of the map

local function dict_key(conf)
    return _M.KEY_PREFIX .. conf.cluster.id
end

-- The connection settings of one node of `conf`, built once per worker (so the pool
-- names its keepalive pool once).
local node_confs = setmetatable({}, { __mode = "k" })

function _M.node_conf(conf, host, port)
    local per = node_confs[conf]
    if not per then
        per = {}
        node_confs[conf] = per
    end
    local id = host .. ":" .. port
    local nc = per[id]
    if not nc then
        nc = { host = host, port = port, db = 0, username = conf.username,
               password = conf.password, ssl = conf.ssl, server_name = conf.ssl and host or nil,
               ssl_verify = conf.ssl_verify, ssl_cert_pem = conf.ssl_cert_pem,
               ssl_key_pem = conf.ssl_key_pem }
        per[id] = nc
    end
    return nc
end

-- Reads the map from the known masters, then the seeds. Returns the map or nil, err.
local function read_map(conf, t, known)
    local tried, last_err = {}, "no node to ask"
    local candidates = {}
    for _, n in ipairs(known and known.nodes or {}) do
        candidates[#candidates + 1] = n
    end
    for _, s in ipairs(conf.cluster.seeds) do
        candidates[#candidates + 1] = s
    end
    for _, n in ipairs(candidates) do
        local id = n.host .. ":" .. n.port
        if not tried[id] then
            tried[id] = true
            local reply, err = pool.run(function(c)
                return c:command("CLUSTER", "SLOTS")
            end, _M.node_conf(conf, n.host, n.port), t)
            local text
            if reply then
                text, err = _M.encode_slots(reply)
            end
            if text then
                return text
            end
            last_err = id .. ": " .. tostring(err)
        end
    end
    return nil, "redis cluster: no node gave the slot map (" .. last_err .. ")"
end

-- The current slot map of `conf` (read when missing or stale). Returns map or nil, err.
function _M.map(conf, t)
    local d = mastercache.dict()
    local key = dict_key(conf)
    local text = d and d:get(key)
    local mine = decoded[conf.cluster.id]
    if not d then
        text = mine and mine.text
    end
    local fresh = d and d:get(key .. ":fresh")
    local now = ngx.now()
    -- no map at all: read it now (the pool backs off seeds that fail); a stale one: one
    -- worker at a time, at most every REFRESH_MIN_S, the others using the old map
    if not text or (not fresh and now - (last_refresh[conf.cluster.id] or 0) >= _M.REFRESH_MIN_S
                    and (not d or d:add(key .. ":reading", true, 1))) then
        last_refresh[conf.cluster.id] = now
        local new, err = read_map(conf, t, mine)
        if d and text then
            d:delete(key .. ":reading")
        end
        if new then
            text = new
            if d then
                d:set(key, new)
                d:set(key .. ":fresh", true, _M.MAP_FRESH_S)
            end
        elseif not text then
            return nil, err
        end
    end
    if not mine or mine.text ~= text then
        mine = _M.decode_map(text)
        decoded[conf.cluster.id] = mine
    end
    return mine
end

-- Marks the map of `conf` stale (a MOVED reply, a failed node): read again soon.
function _M.invalidate(conf)
    local d = mastercache.dict()
    if d then
        d:delete(dict_key(conf) .. ":fresh")
    end
    last_refresh[conf.cluster.id] = nil
end

-- ------------------------------------------------------------------ the client

local cc = {}
cc.__index = cc

-- A cluster client for `conf` with socket timeout t (ms), or nil, err (no slot map).
function _M.connect(conf, t)
    if not pool then
        return nil, "no connection pool (infergate.redis.pool not loaded)"
    end
    local map, err = _M.map(conf, t)
    if not map then
        return nil, err
    end
    return setmetatable({ conf = conf, t = t, map = map, conns = {}, is_cluster = true }, cc)
end

-- The pooled connection to node host:port for this client, or nil, err.
function cc:conn(host, port)
    local id = host .. ":" .. port
    local c = self.conns[id]
    if c and not c:closed() then
        return c
    end
    local err
    c, err = pool.connect(_M.node_conf(self.conf, host, port), self.t)
    if not c then
        _M.invalidate(self.conf) -- a failed master: its replica may have taken over
        return nil, err
    end
    self.conns[id] = c
    return c
end

-- The master node of a command (by its key; the first master for keyless ones).
function cc:node_of(cmd)
    local key = _M.command_key(cmd)
    local map = self.map
    local k = key and map.slots[slot_of(key)] or 1
    return map.nodes[k] or map.nodes[1]
end

-- Sends `cmds` to node host:port as one pipeline. Returns the replies or nil, err (the
-- connection then closed: the pool backs the node off, the map is read again soon).
local function send(self, host, port, cmds)
    local c, err = self:conn(host, port)
    if not c then
        return nil, err
    end
    local res
    res, err = c:pipeline(cmds)
    if not res then
        self.conns[host .. ":" .. port] = nil
        pool.release(c)
        _M.invalidate(self.conf)
        return nil, "redis cluster node " .. host .. ":" .. port .. ": " .. tostring(err)
    end
    return res
end

-- Records that `slot` is served by host:port (a MOVED reply) in this worker's map.
local function remember(map, slot, host, port)
    local id = host .. ":" .. port
    for k, n in ipairs(map.nodes) do
        if n.id == id then
            map.slots[slot] = k
            return
        end
    end
    map.nodes[#map.nodes + 1] = { host = host, port = port, id = id }
    map.slots[slot] = #map.nodes
end

-- The reply of `cmd` after following its redirections (reply in pipeline form: an error
-- reply is {false, err}). Returns the final reply, or nil, err on a transport error.
local function follow(self, cmd, reply)
    for attempt = 1, 3 do
        local e = error_of(reply)
        if not e then
            return reply
        end
        local kind, slot, host, port = _M.redirect(e)
        local res, err
        if kind == "MOVED" then
            _M.invalidate(self.conf)
            remember(self.map, slot, host, port)
            res, err = send(self, host, port, { cmd })
            reply = res and res[1]
        elseif kind == "ASK" then
            res, err = send(self, host, port, { { "ASKING" }, cmd })
            reply = res and res[2]
        elseif _M.retryable(e) and _M.RETRY_SLEEPS[attempt] then
            ngx.sleep(_M.RETRY_SLEEPS[attempt])
            local n = self:node_of(cmd)
            res, err = send(self, n.host, n.port, { cmd })
            reply = res and res[1]
        else
            return reply
        end
        if not res then
            return nil, err
        end
    end
    return reply
end

-- Like infergate.redis.client's command: value | false, err | nil, err.
function cc:command(...)
    local cmd = { ... }
    local node = self:node_of(cmd)
    local res, err = send(self, node.host, node.port, { cmd })
    if not res then
        return nil, err
    end
    local r = res[1]
    if error_of(r) then
        r, err = follow(self, cmd, r)
        if r == nil then
            return nil, err
        end
        local e = error_of(r)
        if e then
            return false, e
        end
    end
    return r
end

-- Like infergate.redis.client's pipeline, split per node. A node that fails gives the
-- error reply {false, "redis cluster node ...: <err>"} for its commands (the others are
-- answered); nil, err only when every node failed.
function cc:pipeline(cmds)
    local groups, order = {}, {}
    for i = 1, #cmds do
        local node = self:node_of(cmds[i])
        local g = groups[node.id]
        if not g then
            g = { node = node, idx = {}, cmds = {} }
            groups[node.id] = g
            order[#order + 1] = g
        end
        g.idx[#g.idx + 1] = i
        g.cmds[#g.cmds + 1] = cmds[i]
    end
    local out, ok, last = {}, false, nil
    for _, g in ipairs(order) do
        local res, err = send(self, g.node.host, g.node.port, g.cmds)
        ok = ok or res ~= nil
        last = err or last
        for j, i in ipairs(g.idx) do
            out[i] = res and res[j] or { false, err }
        end
    end
    if not ok then
        return nil, last
    end
    for i = 1, #cmds do
        local e = error_of(out[i])
        if e and (_M.redirect(e) or _M.retryable(e)) then
            local r, err = follow(self, cmds[i], out[i])
            out[i] = r or { false, err }
        end
    end
    return out
end

-- The pool's view (infergate.redis.pool release): never closed or stale as a whole;
-- setkeepalive gives every node connection back, close closes them.
function cc.closed()
    return false
end

function cc.stale()
    return false
end

function cc.reused()
    return 0
end

function cc:setkeepalive()
    for id, c in pairs(self.conns) do
        pool.release(c)
        self.conns[id] = nil
    end
    return true
end

function cc:close()
    for id, c in pairs(self.conns) do
        c:close()
        self.conns[id] = nil
    end
    return true
end

return _M
