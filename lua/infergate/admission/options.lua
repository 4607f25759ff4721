-- Options of admission control (API keys, rate limits, shedding, deadlines): the
-- "admission" object of the rendered edge options (controlplane/edge/admission.py writes
-- it from the [auth], [limits], [admission] and [deadlines] TOML sections).
--
--   {"auth":      {"mode": "off"|"required", "cache_ttl_s", "negative_ttl_s", "stale_ttl_s"},
--    "limits":    {"enabled", "global_rpm", "global_tpm", "chars_per_token", "redis_retry_s"},
--    "shed":      {"enabled", "max_wait_ms", "poll_ms", "retry_after_s"},
--    "deadlines": {"request_ms", "stream_idle_ms",
--                  "routes": {"/v1/embeddings": {"request_ms"?, "stream_idle_ms"?}}}}
--
-- check(t) fills in defaults and validates: returns the normalized table or nil, err
-- (infergate.core.config turns the error into a failed nginx start). Units: _s seconds,
-- _ms milliseconds; global_rpm/global_tpm 0 = no global limit; request_ms 0 = no
-- deadline.
local _M = {}

local type = type
local pairs = pairs
local tostring = tostring

-- Shared dict names; they must match the lua_shared_dict lines of infergate-http.conf.
_M.DICT_AUTH = "infergate_auth"
_M.DICT_LIMITS = "infergate_limits"

-- The tenant of every request when auth is off.
_M.DEFAULT_TENANT = "default"

-- section -> field -> {default, min, max} (numbers), or {default} (booleans, strings)
local SPEC = {
    auth = {
        mode = { "off", enum = { off = true, required = true } },
        cache_ttl_s = { 5.0, 0.001, 3600 },
        negative_ttl_s = { 5.0, 0.001, 3600 },
        stale_ttl_s = { 300.0, 0, 86400 },
    },
    limits = {
        enabled = { true },
        global_rpm = { 0, 0, 1e9 },
        global_tpm = { 0, 0, 1e12 },
        chars_per_token = { 4.0, 0.01, 1000 },
        redis_retry_s = { 1.0, 0.01, 3600 },
    },
    shed = {
        enabled = { true },
        max_wait_ms = { 500, 0, 60000 },
        poll_ms = { 20, 1, 1000 },
        retry_after_s = { 1, 1, 3600 },
    },
    deadlines = {
        request_ms = { 30000, 0, 86400000 },
        stream_idle_ms = { 30000, 1, 86400000 },
    },
}

local function check_fields(section, spec, src)
    local out = {}
    for k, s in pairs(spec) do
        out[k] = s[1]
    end
    if src == nil then
        return out
    end
    if type(src) ~= "table" then
        return nil, "admission option '" .. section .. "' must be an object"
    end
    for k, v in pairs(src) do
        local s = spec[k]
        if not s then
            if not (section == "deadlines" and k == "routes") then
                return nil, "unknown admission option '" .. section .. "." .. tostring(k) .. "'"
            end
        else
            local where = "admission option '" .. section .. "." .. k .. "'"
            if type(v) ~= type(s[1]) then
                return nil, where .. " must be a " .. type(s[1])
            end
            if s.enum and not s.enum[v] then
                return nil, where .. " has an unknown value '" .. tostring(v) .. "'"
            end
            if type(v) == "number" and (v ~= v or v < s[2] or v > s[3]) then
                return nil, where .. " out of range: " .. tostring(v)
            end
            out[k] = v
        end
    end
    return out
end

local function check_routes(src, base)
    local routes = {}
    if src == nil then
        return routes
    end
    if type(src) ~= "table" then
        return nil, "admission option 'deadlines.routes' must be an object"
    end
    for path, r in pairs(src) do
        if type(path) ~= "string" or path:sub(1, 1) ~= "/" then
            return nil, "admission option 'deadlines.routes': keys are paths starting with '/'"
        end
        local spec = {
            request_ms = { base.request_ms, 0, 86400000 },
            stream_idle_ms = { base.stream_idle_ms, 1, 86400000 },
        }
        local out, err = check_fields("deadlines.routes[" .. path .. "]", spec, r)
        if not out then
            return nil, err
        end
        routes[path] = out
    end
    return routes
end

-- Defaults filled in, every value checked. Returns the table or nil, err.
function _M.check(t)
    if t == nil then
        t = {}
    end
    if type(t) ~= "table" then
        return nil, "infergate option 'admission' must be an object"
    end
    local o = {}
    for k in pairs(t) do
        if not SPEC[k] then
            return nil, "unknown admission option '" .. tostring(k) .. "'"
        end
    end
    for section, spec in pairs(SPEC) do
        local out, err = check_fields(section, spec, t[section])
        if not out then
            return nil, err
        end
        o[section] = out
    end
    local routes, err = check_routes(t.deadlines and t.deadlines.routes, o.deadlines)
    if not routes then
        return nil, err
    end
    o.deadlines.routes = routes
    return o
end

-- The admission options of the running edge (infergate.core.config must be loaded).
function _M.get()
    return require("infergate.core.config").get().admission
end

return _M
