-- The headers of a relayed stream's legs (infergate.stream.leg): the request's, sent to
-- the node, and the node's answer's, passed to the client. No I/O.
local _M = {}

local pairs = pairs
local ipairs = ipairs
local type = type
local lower = string.lower
local concat = table.concat

-- Headers of a node's answer not passed on: the connection's (RFC 9110 7.6.1), the relay's
-- (a stream's Cache-Control is the relay's own, set after these; an answer that is not
-- a stream keeps the node's, as the proxy path passes it).
local OWN = { connection = true, ["keep-alive"] = true, ["transfer-encoding"] = true,
              ["content-length"] = true, te = true, trailer = true, upgrade = true,
              ["proxy-connection"] = true, date = true, server = true,
              ["content-type"] = true }

-- The node's own headers (X-Sim-Node, its request id...), as nginx's proxy passes them:
-- a header the node sent several times (Set-Cookie, Vary, Link) goes out as many times.
local function pass_headers(list)
    local seen
    for _, h in ipairs(list or {}) do
        local k = lower(h[1])
        if not OWN[k] then
            seen = seen or {}
            local prev = seen[k]
            if prev == nil then
                seen[k] = h[2]
                ngx.header[h[1]] = h[2]
            else
                prev = type(prev) == "table" and prev or { prev }
                prev[#prev + 1] = h[2]
                seen[k] = prev
                ngx.header[h[1]] = prev
            end
        end
    end
end
_M.pass_headers = pass_headers

-- Client request headers the relay does not pass on (lower case): hop-by-hop ones
-- (RFC 9110 7.6.1), those it writes itself, and Accept-Encoding (the node must answer
-- an SSE stream the relay can read).
local NOT_PASSED = {
    host = true, connection = true, ["keep-alive"] = true, ["proxy-connection"] = true,
    ["proxy-authorization"] = true, ["proxy-authenticate"] = true, te = true, trailer = true,
    ["transfer-encoding"] = true, upgrade = true, expect = true, ["content-length"] = true,
    ["content-type"] = true, accept = true, ["accept-encoding"] = true,
    authorization = true, ["x-request-id"] = true,
    ["x-infergate-hop"] = true, ["x-forwarded-for"] = true,
}

-- The request headers of a leg: the client's, as nginx's proxy passes them, but for
-- NOT_PASSED; then the relay's own (node API key, request id, loop guard, the client's
-- address in X-Forwarded-For). Built once
-- per request.
function _M.request(r)
    if r.leg_headers then
        return r.leg_headers
    end
    local h = {}
    for k, v in pairs(ngx.req.get_headers(100, true)) do
        local lk = lower(k)
        if not NOT_PASSED[lk] then -- a header sent twice, one line (cookies: "; ", RFC 6265)
            h[k] = type(v) == "table" and concat(v, lk == "cookie" and "; " or ", ") or v
        end
    end
    h["Content-Type"] = "application/json"
    if r.req.stream then
        h.Accept = "text/event-stream"
        h.Connection = "close"
    else -- an answer read whole, its connection kept (infergate.stream.answer); a body
        -- the node compresses passes unchanged, as on the proxy path (the cache lookup
        -- took the header out of a request whose answer it stores)
        h.Accept = "application/json"
        h["Accept-Encoding"] = ngx.var.http_accept_encoding
    end
    h["X-Request-Id"] = r.req.id
    h["X-Infergate-Hop"] = ngx.var.infergate_hop
    -- the client's address, appended to what it sent: nginx's $proxy_add_x_forwarded_for,
    -- as the proxy path sends it (that variable reads empty outside proxy_pass)
    local xff, addr = ngx.var.http_x_forwarded_for, ngx.var.remote_addr
    h["X-Forwarded-For"] = xff and xff ~= "" and (xff .. ", " .. addr) or addr
    h.Authorization = ngx.var.infergate_node_auth
    r.leg_headers = h
    return h
end

return _M
