-- Edge options, rendered into the nginx config by `infergate render-nginx` and loaded
-- once in init_by_lua (master process, before the workers fork).
--
--   require("infergate.core.config").init([[{"edge_id": ..., "nodes": [...]}]])
--
-- init() returns true or nil, err (the rendered init_by_lua turns an error into a
-- failed nginx start, naming the bad option). get() returns the validated table.
local cjson = require("cjson.safe")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring

-- Shared dict names; they must match the lua_shared_dict lines of infergate-http.conf.
_M.DICT_SNAPSHOT = "infergate_snapshot"
_M.DICT_STATS = "infergate_stats"

local DEFAULTS = {
    edge_id = "edge",
    redis_url = "redis://127.0.0.1:6379/0",
    redis_timeout_ms = 200,
    sync_interval_s = 0.5,
    stale_after_s = 10.0,
    max_tries = 3,
    connect_timeout_ms = 2000,
    send_timeout_ms = 60000,
    read_timeout_ms = 60000,
    retry_window_s = 60.0,
    client_max_body_size = "8m",
    breaker_failures = 5,
    breaker_cooldown_s = 10.0,
    inflight_cost = 1.0,
    latency_norm_s = 30.0,
    -- rediss:// and redis+sentinel:// (infergate.redis.client, infergate.redis.sentinel)
    redis_tls_verify = true,
    redis_tls_cert_file = "",   -- read at init (master process) into redis_tls_cert_pem
    redis_tls_key_file = "",
    redis_sentinel_password = "",
    redis_sentinel_refresh_s = 5.0,
    -- request bodies (infergate.admission.inputguard)
    client_body_timeout_ms = 60000,
    -- API keys, rate limits, shedding, deadlines: validated by infergate.admission.options
    admission = {},
}

-- name -> {min, max} for numeric options (inclusive); nil max = unbounded.
local NUMBERS = {
    redis_timeout_ms = { 1, 60000 },
    sync_interval_s = { 0.01, 3600 },
    stale_after_s = { 0.01 },
    max_tries = { 1, 100 },
    connect_timeout_ms = { 1 },
    send_timeout_ms = { 1 },
    read_timeout_ms = { 1 },
    retry_window_s = { 0 },
    breaker_failures = { 1 },
    breaker_cooldown_s = { 0 },
    inflight_cost = { 0 },
    latency_norm_s = { 0.001 },
    redis_sentinel_refresh_s = { 0.01, 3600 },
    client_body_timeout_ms = { 1, 3600000 },
}

local function read_file(path, what)
    local f, err = io.open(path, "rb")
    if not f then
        return nil, "cannot read " .. what .. " " .. path .. ": " .. tostring(err)
    end
    local text = f:read("*a")
    f:close()
    if not text or text == "" then
        return nil, what .. " " .. path .. " is empty"
    end
    return text
end

local opts = nil

local function check_node(i, n)
    local where = "nodes[" .. i .. "]"
    if type(n) ~= "table" then
        return nil, where .. " must be an object"
    end
    if type(n.name) ~= "string" or n.name == "" then
        return nil, where .. ".name must be a non-empty string"
    end
    if n.host ~= nil and type(n.host) ~= "string" then
        return nil, where .. ".host must be a string"
    end
    if type(n.port) ~= "number" or n.port < 1 or n.port > 65535 then
        return nil, where .. ".port must be 1-65535"
    end
    if n.weight ~= nil and (type(n.weight) ~= "number" or n.weight <= 0) then
        return nil, where .. ".weight must be > 0"
    end
    if n.max_concurrency ~= nil and (type(n.max_concurrency) ~= "number" or n.max_concurrency < 1) then
        return nil, where .. ".max_concurrency must be >= 1"
    end
    return true
end

-- Options given as JSON text or a table, decoded, and a copy of `defaults` to fill:
-- returns t, o or nil, err. `what` names the options in messages ("cache options").
function _M.decode_options(src, defaults, what)
    local t = src
    if type(src) == "string" then
        local err
        t, err = cjson.decode(src)
        if t == nil then
            return nil, what .. " are not valid JSON: " .. tostring(err)
        end
    end
    if type(t) ~= "table" then
        return nil, what .. " must be a JSON object"
    end
    local o = {}
    for k, v in pairs(defaults) do
        o[k] = v
    end
    return t, o
end

-- Parses and validates the rendered options (JSON text or a table).
function _M.init(src)
    local t, o = _M.decode_options(src, DEFAULTS, "infergate options")
    if not t then
        return nil, o
    end
    for k, v in pairs(t) do
        if k ~= "nodes" then
            if DEFAULTS[k] == nil then
                return nil, "unknown infergate option '" .. tostring(k) .. "'"
            end
            if type(v) ~= type(DEFAULTS[k]) then
                return nil, "infergate option '" .. k .. "' must be a " .. type(DEFAULTS[k])
            end
            local range = NUMBERS[k]
            if range and (v < range[1] or (range[2] and v > range[2])) then
                return nil, "infergate option '" .. k .. "' out of range: " .. tostring(v)
            end
            o[k] = v
        end
    end
    if (o.redis_tls_cert_file == "") ~= (o.redis_tls_key_file == "") then
        return nil, "infergate options 'redis_tls_cert_file' and 'redis_tls_key_file' go together"
    end
    if o.redis_tls_cert_file ~= "" then
        local cerr
        o.redis_tls_cert_pem, cerr = read_file(o.redis_tls_cert_file, "redis.tls_cert_file")
        if not o.redis_tls_cert_pem then
            return nil, cerr
        end
        o.redis_tls_key_pem, cerr = read_file(o.redis_tls_key_file, "redis.tls_key_file")
        if not o.redis_tls_key_pem then
            return nil, cerr
        end
    end
    local adm, aerr = require("infergate.admission.options").check(o.admission)
    if not adm then
        return nil, aerr
    end
    o.admission = adm
    local nodes = t.nodes or {}
    if type(nodes) ~= "table" then
        return nil, "infergate option 'nodes' must be an array"
    end
    local seen = {}
    o.nodes = {}
    for i, n in ipairs(nodes) do
        local ok, err = check_node(i, n)
        if not ok then
            return nil, "infergate static node list: " .. err
        end
        if seen[n.name] then
            return nil, "infergate static node list: duplicate node name '" .. n.name .. "'"
        end
        seen[n.name] = true
        o.nodes[i] = {
            name = n.name,
            host = n.host,  -- nil when the address could not be resolved at render time
            port = n.port,
            weight = n.weight or 1.0,
            max_concurrency = n.max_concurrency or 64,
            kind = n.kind,
        }
    end
    opts = o
    return true
end

-- The validated options (defaults when init() was never called, e.g. in a test).
function _M.get()
    if not opts then
        _M.init({})
    end
    return opts
end

return _M
