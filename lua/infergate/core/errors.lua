-- OpenAI-style JSON errors: {"error": {"message", "type", "param": null, "code"}}
-- with Content-Type: application/json.
--
-- send() answers from the access/content phase with a specific message; page() is
-- the content of the error_page named locations, for every error nginx itself
-- produces (unknown path, body too large, all nodes failed, ...).
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_var = ngxapi.var
local config = require("infergate.core.config")
local deadline = require("infergate.admission.deadline")
local options = require("infergate.admission.options")
local reqctx = require("infergate.core.reqctx")

local _M = {}

local tostring = tostring

-- status -> {type, code, default message}
_M.CATALOG = {
    [400] = { "invalid_request_error", "bad_request", "The request could not be understood." },
    [403] = { "permission_error", "forbidden", "Access to this path is not allowed from your address." },
    [404] = { "invalid_request_error", "not_found",
              "Unknown path. The OpenAI-compatible API is served under /v1: /v1/chat/completions, "
              .. "/v1/completions, /v1/embeddings, /v1/models." },
    [405] = { "invalid_request_error", "method_not_allowed", "This method is not allowed on this path." },
    [408] = { "invalid_request_error", "request_timeout", "The request was not received in time." },
    [413] = { "invalid_request_error", "request_too_large", "The request body is too large." },
    [414] = { "invalid_request_error", "uri_too_long", "The request URI is too long." },
    [415] = { "invalid_request_error", "unsupported_media_type", "The request body's encoding is not supported." },
    -- nginx's internal code for a request header (or cookies) over its buffers; sent as 400
    [494] = { "invalid_request_error", "header_too_large", "A request header (or the cookies) is too large." },
    [501] = { "invalid_request_error", "not_implemented", "This transfer encoding is not supported." },
    [505] = { "invalid_request_error", "http_version_not_supported", "This HTTP version is not supported." },
    [429] = { "rate_limit_error", "rate_limit_exceeded", "Too many requests; retry later." },
    [500] = { "server_error", "internal_error", "The gateway failed to handle the request." },
    [502] = { "bad_gateway", "upstream_error", "No inference node gave a valid answer." },
    [503] = { "service_unavailable", "no_healthy_upstream",
              "No inference node is available (all are unhealthy, draining or have an open circuit breaker)." },
    [504] = { "gateway_timeout", "upstream_timeout", "The inference node did not answer in time." },
}

function _M.body(message, etype, code)
    return cjson.encode({
        error = { message = message, type = etype, param = cjson.null, code = code },
    })
end

-- Answer now with a JSON error and end the request. headers: optional table.
function _M.send(status, message, etype, code, headers)
    local entry = _M.CATALOG[status] or _M.CATALOG[500]
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    if headers then
        for k, v in pairs(headers) do
            ngx.header[k] = v
        end
    end
    ngx.say(_M.body(message or entry[3], etype or entry[1], code or entry[2]))
    return ngx.exit(ngx.HTTP_OK)
end

local function tries_summary()
    local us = ngx_var("upstream_status")
    if not us or us == "" then
        return nil
    end
    local n = 0
    local list = {}
    for s in us:gmatch("[^,:%s]+") do
        n = n + 1
        list[n] = s
    end
    return n, table.concat(list, ", ")
end

-- The header naming a node (as infergate.filters sets it on proxied answers).
_M.NODE_HEADER = "X-Infergate-Node"

-- Name of the node of the request's last try, or nil when no node was tried.
local function last_node()
    local req = reqctx.get()
    local attempts = req and req.attempts
    local last = attempts and attempts[#attempts]
    return last and last.node or nil
end

-- Answers on the /v1 API paths carry X-Request-Id (the request's id,
-- infergate.core.reqctx; nginx's $request_id before the access phase gave it one).
local function request_id()
    local uri = ngx_var("request_uri")
    if uri and uri:sub(1, 4) ~= "/v1/" then
        -- the path as nginx routed it: "//v1/x" and "/./v1/x" are /v1/ paths too
        uri = uri:gsub("/%./", "/"):gsub("//+", "/")
    end
    if uri and uri:sub(1, 4) == "/v1/" and not ngx.header["X-Request-Id"] then
        ngx.header["X-Request-Id"] = require("infergate.core.reqctx").current_id()
    end
end

-- Content of the error_page locations: the status nginx was about to send.
-- 502 and 504 answers name the node of the last try (the one that failed or timed out)
-- in X-Infergate-Node; 503 answers carry Retry-After (admission.retry_after_s).
-- X-Request-Id also on the answers nginx gives before the request context exists (a
-- 413 body, an unknown path under /v1/).
function _M.page(status)
    request_id()
    -- a try refused or timed out at the request's deadline: 504 deadline_exceeded
    local dstatus, dtype, dcode, dmessage = deadline.error_page(status)
    if dstatus then
        ngx.status = dstatus
        ngx.header["Content-Type"] = "application/json"
        ngx.header[_M.NODE_HEADER] = last_node()
        ngx.say(_M.body(dmessage, dtype, dcode))
        return
    end
    local entry = _M.CATALOG[status] or _M.CATALOG[500]
    local message = entry[3]
    local etype, code = entry[1], entry[2]
    if status == 500 and ngx_var("infergate_reason") == "no_healthy_upstream" then
        status = 503
        entry = _M.CATALOG[503]
        etype, code, message = entry[1], entry[2],
            "No inference node is left to try (all are unhealthy, draining, have an open "
            .. "circuit breaker or already failed this request)."
    elseif status == 413 then
        message = "The request body is larger than the " .. config.get().client_max_body_size
            .. " this gateway accepts."
    elseif status == 502 or status == 504 then
        local n, list = tries_summary()
        if n then
            message = message .. " Tried " .. n .. " time(s); node answers: " .. list .. "."
        end
    end
    if status == 494 then
        status = 400
    end
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    if status == 405 then
        ngx.header["Allow"] = "POST"
    elseif status == 503 then
        ngx.header["Retry-After"] = tostring(options.get().shed.retry_after_s)
    elseif status == 502 or status == 504 then
        ngx.header[_M.NODE_HEADER] = last_node()
    end
    ngx.say(_M.body(message, etype, code))
end

return _M
