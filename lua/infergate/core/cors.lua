-- Cross-origin requests from browsers (CORS, the Fetch standard's CORS protocol). The
-- engines behind the edge answer them openly by default: vLLM's OpenAI server allows
-- every origin (--allowed-origins, default ["*"]), and llama-server (build 11434
-- measured) answers a preflight 200 with Access-Control-Allow-Origin set to the
-- request's Origin. Behind plain nginx a browser app talks to them unchanged. The edge
-- keeps that:
--
--   preflight(allow)  an OPTIONS request on an API route is answered here, 204, before
--                     the API key step (a browser sends a preflight without credentials):
--                     Allow, and with an Origin header the CORS answer (the origin
--                     echoed, the route's methods, the request headers asked for, cached
--                     600 s). Nothing goes to a node.
--   header_filter()   an answer the edge made itself (its JSON errors, cache hits, the
--                     model list) gets Access-Control-Allow-Origin: <Origin> and the
--                     headers a client reads exposed. A node's answer is left as the node
--                     sent it (its own CORS policy stands, as behind nginx).
--
-- The API is reached with a bearer key, never a cookie: no Access-Control-Allow-
-- Credentials, so a page can read only what its own key (or an open edge) gives it.
local _M = {}

--- How long a browser may keep a preflight's answer (s).
_M.MAX_AGE_S = 600

-- Headers of the edge's answers a script in the page may read.
local EXPOSE = "X-Request-Id, Retry-After, X-Cache-Status, X-Cache-Match, X-Infergate-Node, "
    .. "x-ratelimit-limit-requests, x-ratelimit-remaining-requests, "
    .. "x-ratelimit-reset-requests, x-ratelimit-limit-tokens, "
    .. "x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens"

local function vary_origin(h)
    local v = h["Vary"]
    if not v then
        h["Vary"] = "Origin"
    elseif type(v) == "string" and not v:lower():find("origin", 1, true) then
        h["Vary"] = v .. ", Origin"
    end
end

-- Answer an OPTIONS request on a route whose methods are `allow` ("POST", "GET, HEAD"):
-- 204 (ends the request).
function _M.preflight(allow)
    local h = ngx.header
    local methods = allow .. ", OPTIONS"
    h["Allow"] = methods
    local origin = ngx.var.http_origin
    if origin then
        h["Access-Control-Allow-Origin"] = origin
        h["Access-Control-Allow-Methods"] = methods
        h["Access-Control-Allow-Headers"] = ngx.var.http_access_control_request_headers
            or "Authorization, Content-Type"
        h["Access-Control-Max-Age"] = tostring(_M.MAX_AGE_S)
        vary_origin(h)
    end
    return ngx.exit(204)
end

-- Header filter step: CORS headers on an answer of the edge's own, when the request
-- came with an Origin (a node's answer carries X-Infergate-Node: left alone).
function _M.header_filter()
    local origin = ngx.var.http_origin
    if not origin then
        return
    end
    local h = ngx.header
    if h["X-Infergate-Node"] or h["Access-Control-Allow-Origin"] then
        return
    end
    h["Access-Control-Allow-Origin"] = origin
    h["Access-Control-Expose-Headers"] = EXPOSE
    vary_origin(h)
end

return _M
