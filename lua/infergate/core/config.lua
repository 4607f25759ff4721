-- Edge options, rendered into the nginx config by `infergate render-nginx` and loaded
-- once in init_by_lua (master process, before the workers fork):
--
--   require("infergate.core.config").init([[{"edge": {...}, ..., "nodes": [...]}]],
--                                         [[{"type": "object", "fields": {...}}]])
--
-- The first text is the options document (the edge's sections of infergate.toml, named
-- and nested as there, plus the static node list), the second the spec it is checked
-- against; both are written by controlplane/edge/options.py, the spec generated from
-- the pydantic fields of controlplane/config/ (every default, unit and range lives
-- there). infergate.core.options does the checking.
--
-- init() returns true or nil, err (the rendered init_by_lua turns an error into a
-- failed nginx start, naming the field: "edge.redis_timeout_ms: 100000 is above the
-- maximum 60000"). A later init(options) without a spec reuses the last spec.
--
-- get() returns the validated document itself, every option under its section and its
-- name in infergate.toml and the pydantic fields (no renaming: edge.max_tries is
-- get().edge.max_tries, [admission] shed is get().admission.shed), with the defaults
-- filled in and a few values completed where the file leaves them open:
--   edge.edge_id "" = "edge";
--   deadlines.routes[path] = {request_ms, stream_idle_ms}, a missing field = the global one;
--   cache.min_similarity unset = false (the embedder model's default), the per-route and
--   per-model maps {} when unset;
--   redis.tls_cert_pem / redis.tls_key_pem: the texts of redis.tls_cert_file / tls_key_file;
--   nodes = {{name, host, port, weight, max_concurrency, kind, models, scheme, tls_name,
--            auth}, ...}, the static node list.
-- Sections the document leaves out are empty tables. document() is the document as
-- validated, before these completions.
local cjson = require("cjson.safe")
local options = require("infergate.core.options")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local tostring = tostring

-- Shared dict names; they must match the lua_shared_dict lines of infergate-http.conf.
_M.DICT_SNAPSHOT = "infergate_snapshot"
_M.DICT_STATS = "infergate_stats"

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
local doc = nil
local last_spec = nil

local function check_node(i, n)
    local where = "nodes[" .. i .. "]"
    if type(n) ~= "table" then
        return nil, where .. " must be an object"
    end
    if type(n.name) ~= "string" or n.name == "" then
        return nil, where .. ".name must be a non-empty string"
    end
    if n.host ~= nil and n.host ~= cjson.null and type(n.host) ~= "string" then
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
    if n.models ~= nil and n.models ~= cjson.null then
        if type(n.models) ~= "table" then
            return nil, where .. ".models must be an array of model ids"
        end
        for _, m in ipairs(n.models) do
            if type(m) ~= "string" or m == "" then
                return nil, where .. ".models must be an array of non-empty strings"
            end
        end
    end
    return true
end

-- JSON text or a table -> table, or nil, err (`what` names it in the message).
function _M.decode(src, what)
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
    return t
end

-- The options of a validated document (see the header): its sections copied (the
-- document itself stays as validated, document()), edge_id, the route deadlines and the
-- cache's open values completed.
local SECTIONS = { "edge", "redis", "scoring", "auth", "limits", "admission", "deadlines",
                   "cache" }

local function complete(validated)
    local d = {}
    for _, name in ipairs(SECTIONS) do
        local copy = {}
        for k, v in pairs(type(validated[name]) == "table" and validated[name] or {}) do
            copy[k] = v
        end
        d[name] = copy
    end
    if d.edge.edge_id == nil or d.edge.edge_id == "" then
        d.edge.edge_id = "edge"
    end
    local dl = d.deadlines
    local routes = {}
    for path, r in pairs(dl.routes or {}) do
        routes[path] = {
            request_ms = r.request_ms == nil and dl.request_ms or r.request_ms,
            stream_idle_ms = r.stream_idle_ms == nil and dl.stream_idle_ms or r.stream_idle_ms,
        }
    end
    dl.routes = routes
    local cache = d.cache
    if cache.min_similarity == nil then
        cache.min_similarity = false
    end
    cache.min_similarity_routes = cache.min_similarity_routes or {}
    cache.min_similarity_models = cache.min_similarity_models or {}
    return d
end

-- Reads the Redis TLS client certificate and key named in the [redis] section `r` into
-- it (PEM texts). Returns true or nil, err.
local function read_tls_files(r)
    local cert, key = r.tls_cert_file or "", r.tls_key_file or ""
    if (cert == "") ~= (key == "") then
        return nil, "redis.tls_cert_file and redis.tls_key_file go together"
    end
    if cert ~= "" then
        local cerr
        r.tls_cert_pem, cerr = read_file(cert, "redis.tls_cert_file")
        if not r.tls_cert_pem then
            return nil, cerr
        end
        r.tls_key_pem, cerr = read_file(key, "redis.tls_key_file")
        if not r.tls_key_pem then
            return nil, cerr
        end
    end
    return true
end

-- The static node list of the options document: a list of {name, host, port, weight,
-- max_concurrency, kind, models, scheme, tls_name, auth}, or nil, err.
local function static_nodes(nodes)
    nodes = nodes or {}
    if type(nodes) ~= "table" then
        return nil, "infergate option 'nodes' must be an array"
    end
    local seen = {}
    local out = {}
    for i, n in ipairs(nodes) do
        local ok, nerr = check_node(i, n)
        if not ok then
            return nil, "infergate static node list: " .. nerr
        end
        if seen[n.name] then
            return nil, "infergate static node list: duplicate node name '" .. n.name .. "'"
        end
        seen[n.name] = true
        out[i] = {
            name = n.name,
            -- nil when the address could not be resolved at render time
            host = n.host ~= cjson.null and n.host or nil,
            port = n.port,
            weight = n.weight or 1.0,
            max_concurrency = n.max_concurrency or 64,
            kind = n.kind,
            -- served model ids; nil or empty = unknown (any model)
            models = type(n.models) == "table" and n.models or nil,
            -- how the edge reaches it: "http" | "https", the certificate's host name,
            -- the Authorization value (API key; secret)
            scheme = n.scheme,
            tls_name = type(n.tls_name) == "string" and n.tls_name or nil,
            auth = type(n.auth) == "string" and n.auth or nil,
        }
    end
    return out
end

-- Parses and validates the rendered options and spec (JSON texts or tables).
function _M.init(src, spec_src)
    local t, err = _M.decode(src, "infergate options")
    if not t then
        return nil, err
    end
    local spec = last_spec
    if spec_src ~= nil then
        spec, err = _M.decode(spec_src, "infergate option spec")
        if not spec then
            return nil, err
        end
    end
    if not spec then
        return nil, "infergate options: no spec (init(options, spec), rendered by infergate render-nginx)"
    end
    local body = {}
    for k, v in pairs(t) do
        if k ~= "nodes" then
            body[k] = v
        end
    end
    local d, verr = options.validate(body, spec)
    if not d then
        return nil, verr
    end
    local o = complete(d)
    local ok, terr = read_tls_files(o.redis)
    if not ok then
        return nil, terr
    end
    local nodes, nerr = static_nodes(t.nodes)
    if not nodes then
        return nil, nerr
    end
    o.nodes = nodes
    last_spec = spec
    doc = d
    opts = o
    return true
end

-- The validated options (the document, see above). Raises when init() never succeeded.
function _M.get()
    if not opts then
        error("infergate.core.config: init(options, spec) has not been called", 2)
    end
    return opts
end

-- Before init(): every section an empty table (code driving a module outside a rendered
-- edge, e.g. in tests: the module's defaults apply).
local EMPTY = setmetatable({}, { __index = function()
    return {}
end })

-- The options like get(), or EMPTY before init().
function _M.get_or_empty()
    return opts or EMPTY
end

-- Folder the running configuration was rendered into (absolute path, set by the rendered
-- init_by_lua; nil outside a rendered edge). The status endpoint and /metrics report it,
-- so `infergate render-nginx --check` can tell this nginx from another infergate edge
-- holding an address.
local rendered_dir = nil

function _M.set_rendered_dir(dir)
    rendered_dir = dir
end

function _M.rendered_dir()
    return rendered_dir
end

-- The validated options document (get() before its completions), or nil before init().
function _M.document()
    return doc
end

return _M
