-- How a request reaches its node: scheme (http | https) and the node's API key
-- ("Authorization: Bearer KEY"), taken from the routing snapshot (scheme, tls_name,
-- auth of each node).
--
-- nginx builds the upstream request once, before the first node is picked, and every
-- retry (proxy_next_upstream) resends it; balancer_by_lua cannot change its headers.
-- So the access step picks the request's group (nodes sharing scheme and API key),
-- sets the variables the location's proxy_* lines use, and the request's tries, the
-- retries included, go only to nodes of that group:
--
--   $infergate_upstream_scheme  proxy_pass $infergate_upstream_scheme://infergate_nodes/...
--   $infergate_node_auth        proxy_set_header Authorization (empty: none is sent); a
--                               group without an API key passes the client's own header
--                               on, as a plain proxy does (with auth.mode = "required"
--                               the auth step has removed it already)
--   $infergate_ssl_name         proxy_ssl_name: set by the balancer for every try (the
--                               certificate is checked against it; SNI)
--   $infergate_node_ca          "none" when the configuration has no CA bundle to verify
--                               https nodes with: requests to them are refused (502)
--
-- A pool whose nodes all share scheme and API key (the common case) is one group: the
-- request keeps every node and every retry. With several groups, a group is drawn in
-- proportion to the effective weight of its eligible nodes for the request's model.
-- Nodes of the other groups are marked as tried for the request (req.tried), so the
-- eligibility count and the balancer's picks and retries leave them out; a node added
-- to the snapshot between the access and the balancer phase is checked by admit().
local models = require("infergate.routing.models")
local breaker = require("infergate.routing.breaker")
local snapshot = require("infergate.routing.snapshot")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now

local _M = {}

local ipairs = ipairs
local random = math.random
local sub = string.sub
local find = string.find
local concat = table.concat
local escape_uri = ngx.escape_uri
local log = ngx.log
local ERR = ngx.ERR

-- The group key of a node: scheme and Authorization value (infergate.routing.snapshot
-- computes it once per node).
function _M.key(node)
    return node.group or ((node.scheme or "http") .. " " .. (node.auth or ""))
end

-- The groups of table `t`, cached on it: {n, list = {{key, scheme, auth, tls_name}}}.
local function groups_of(t)
    local g = t.upstream_groups
    if g then
        return g
    end
    g = { n = 0, list = {}, by_key = {} }
    for _, node in ipairs(t.nodes) do
        local k = _M.key(node)
        if not g.by_key[k] then
            local e = { key = k, scheme = node.scheme or "http", auth = node.auth,
                        tls_name = node.tls_name }
            g.n = g.n + 1
            g.list[g.n] = e
            g.by_key[k] = e
        end
    end
    t.upstream_groups = g
    return g
end

-- A group drawn by the effective weight of its eligible nodes for `model` (those not
-- left out of the request's choice already: `tried`); nil when no node is eligible
-- (the eligible step answers 503).
local function draw(t, groups, model, now, tried)
    local weight, total = {}, 0
    for _, node in ipairs(t.nodes) do
        if node.addr and node.healthy and node.state == "active" and models.serves(node, model)
                and not tried[node.name] and breaker.allow(node.name, now) then
            local k = _M.key(node)
            weight[k] = (weight[k] or 0) + node.effective_weight
            total = total + node.effective_weight
        end
    end
    if total <= 0 then
        return nil
    end
    local r = random() * total
    local last
    for _, g in ipairs(groups.list) do
        local w = weight[g.key]
        if w then
            last = g
            r = r - w
            if r < 0 then
                return g
            end
        end
    end
    return last
end

-- The location's variables for group `g` (their defaults: "http", no Authorization).
local function set_vars(g)
    local auth = g.auth or ngx.var.http_authorization
    if auth then
        ngx.var.infergate_node_auth = auth
    end
    if g.scheme == "https" then
        ngx.var.infergate_upstream_scheme = "https"
        if g.tls_name then
            ngx.var.infergate_ssl_name = g.tls_name
        end
    end
end

-- Routes of prefix locations (/v1/models/, /v1/), where nginx would send the fixed
-- proxy_pass URI: the template sets $infergate_upstream_path to the prefix.
local PREFIX_ROUTES = { models = true, passthrough = true }

-- The normalised path below the location's prefix, each segment escaped again, into
-- $infergate_upstream_path (a variable proxy_pass URI is sent as it is).
local function prefixed_path()
    local prefix = ngx.var.infergate_upstream_path
    local uri = ngx.var.uri
    if not prefix or #uri <= #prefix or sub(uri, 1, #prefix) ~= prefix then
        return
    end
    local rest, parts, i = sub(uri, #prefix + 1), {}, 1
    while true do
        local j = find(rest, "/", i, true)
        parts[#parts + 1] = escape_uri(sub(rest, i, j and j - 1 or #rest))
        if not j then
            break
        end
        i = j + 1
    end
    ngx.var.infergate_upstream_path = prefix .. concat(parts, "/")
end

-- Access step: the request's group and the location's variables. nil (continue), or
-- an error table when the location lacks the variables and a node needs them.
function _M.step(req)
    if PREFIX_ROUTES[req.route] then
        pcall(prefixed_path)
    end
    local t = snapshot.current()
    local groups = groups_of(t)
    local g
    if groups.n <= 1 then
        g = groups.list[1]
    else
        g = draw(t, groups, req.model, ngx_now(), req.tried)
    end
    if not g then
        return nil
    end
    req.group = g.key
    req.ssl_name = g.tls_name
    local ok, err = pcall(set_vars, g)
    if ok and g.scheme == "https" and ngx.var.infergate_node_ca == "none" then
        ok, err = false, "no CA bundle to verify https nodes with (set controlplane.node_ca_file)"
    end
    if not ok and (g.scheme ~= "http" or g.auth) then
        log(ERR, "infergate: cannot send requests to the ", g.scheme, " nodes: ", err)
        return { status = 502, message = "The edge cannot reach the inference nodes.",
                 type = "server_error", code = "edge_misconfigured" }
    end
    if groups.n > 1 then
        local tried = req.tried
        for _, node in ipairs(t.nodes) do
            if _M.key(node) ~= g.key then
                tried[node.name] = true
            end
        end
    end
    return nil
end

local function set_ssl_name(name)
    ngx.var.infergate_ssl_name = name
end

-- Balancer hook: whether `node` may take this try of `req` (same group); sets the
-- certificate name of an https node. (No closure in here: a function that creates one
-- closes upvalues at every return, a bytecode LuaJIT does not compile, and the
-- balancer's traces through it were aborted and blacklisted.)
function _M.admit(req, node)
    if req.group and _M.key(node) ~= req.group then
        return false
    end
    local name = node.tls_name
    if name and name ~= req.ssl_name then
        local ok = pcall(set_ssl_name, name)
        if ok then
            req.ssl_name = name
        end
    end
    return true
end

return _M
