-- header_filter_by_lua / body_filter_by_lua of the proxied locations.
--
-- run(): names the node that served a proxied response (X-Infergate-Node).
--
-- A node that answers bytes that are not HTTP (wrong port, a TLS server, a crashed
-- process writing junk) is taken by nginx for an HTTP/0.9 answer: it cannot be retried
-- on another node, nginx sends no status line or headers and passes the junk on
-- (nginx src/http/modules/ngx_http_proxy_module.c, ngx_http_proxy_process_status_line,
-- "upstream sent no valid HTTP/1.0 header"). The edge detects it here (the request's
-- HTTP version turned 0.9), counts it as a failure of the node (breaker) and, for
-- HTTP/1.x clients, replaces the junk with a complete HTTP/1.1 502 JSON answer written
-- by body(); other clients get the connection closed.
local errors = require("infergate.core.errors")
local reqctx = require("infergate.core.reqctx")

local _M = {}

local log = ngx.log
local ERR = ngx.ERR

_M.NODE_HEADER = "X-Infergate-Node"

function _M.run()
    local req = reqctx.get()
    if not req then
        return
    end
    -- headers set by the access steps (x-ratelimit-*, see infergate.admission.ratelimit)
    local extra = req.headers_out
    if extra then
        for k, v in pairs(extra) do
            ngx.header[k] = v
        end
    end
    local attempts = req.attempts
    local last = attempts[#attempts]
    if not last or not ngx.var.upstream_status then
        return
    end
    local client_version = req.http_version or 1.1
    if ngx.req.http_version() == 0.9 and client_version >= 1.0 then
        req.invalid_answer = last.node
        log(ERR, "infergate: node ", last.node, " answered with bytes that are not HTTP; ",
            "the client gets a 502")
        if client_version >= 2 then
            return ngx.exit(ngx.ERROR)
        end
        return
    end
    ngx.header[_M.NODE_HEADER] = last.node
end

function _M.body()
    local req = ngx.ctx.infergate
    if not req or not req.invalid_answer then
        return
    end
    if req.invalid_replaced then
        ngx.arg[1] = nil
        return
    end
    req.invalid_replaced = true
    local body = errors.body("Node " .. req.invalid_answer .. " sent an answer that is not HTTP.",
        "bad_gateway", "upstream_invalid_answer") .. "\n"
    local version = req.http_version == 1.0 and "1.0" or "1.1"
    ngx.arg[1] = "HTTP/" .. version .. " 502 Bad Gateway\r\n"
        .. "Content-Type: application/json\r\n"
        .. "Content-Length: " .. #body .. "\r\n"
        .. "Connection: close\r\n\r\n" .. body
    ngx.arg[2] = true
end

return _M
