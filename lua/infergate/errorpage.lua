-- Content of the error_page locations of the rendered server include
-- (/_infergate/error/<status>): an OpenAI-style JSON error (infergate.core.errors) for
-- every error nginx itself produces (unknown path, body too large, all nodes failed, ...).
--
--   content_by_lua: require("infergate.phases").error_page(502)
local ngxapi = require("infergate.core.ngxapi")
local ngx_var = ngxapi.var
local config = require("infergate.core.config")
local errors = require("infergate.core.errors")
local reqctx = require("infergate.core.reqctx")
local deadline = require("infergate.admission.deadline")

local _M = {}

local tostring = tostring
local ipairs = ipairs

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
        ngx.header["X-Request-Id"] = reqctx.current_id()
    end
end

-- Whether nginx's limit_req or limit_conn refused the request ($limit_req_status and
-- $limit_conn_status, nginx 1.17.6; kept on the main request across the error_page
-- redirect).
local function site_limited()
    for _, v in ipairs({ "limit_req_status", "limit_conn_status" }) do
        local ok, val = pcall(ngx_var, v)
        if ok and val == "REJECTED" then
            return true
        end
    end
    return false
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
        ngx.header[errors.NODE_HEADER] = last_node()
        ngx.header[errors.NO_RETRY_HEADER] = errors.NO_RETRY
        ngx.say(errors.body(dmessage, dtype, dcode))
        return
    end
    local entry = errors.CATALOG[status] or errors.CATALOG[500]
    local message = entry[3]
    local etype, code = entry[1], entry[2]
    local reason = status == 500 and ngx_var("infergate_reason")
    if reason == "no_healthy_upstream" then
        status = 503
        etype, code, message = "service_unavailable", "no_healthy_upstream",
            "No inference node is left to try (all are unhealthy, draining, have an open "
            .. "circuit breaker or already failed this request)."
    elseif reason == "nodes_saturated" then
        -- a retry (or a first try whose held node left) found every slot of the nodes
        -- left taken (infergate.routing.balancer)
        status = 429
        etype, code, message = "server_overloaded", "nodes_saturated",
            "Every inference node left to try has all its slots taken; retry after "
            .. config.get().admission.retry_after_s .. " s."
    elseif (status == 503 or status == 429) and site_limited() then
        -- the site's own limit_req / limit_conn (limit_req_status 503 by default), not
        -- the nodes: said so, not "no node available"
        etype, code = "rate_limit_error", "rate_limit_exceeded"
        message = "This server's own limit on requests or connections (nginx limit_req / "
            .. "limit_conn) refused the request; retry later."
    elseif status == 413 then
        message = "The request body is larger than the " .. config.get().edge.client_max_body_size
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
    elseif status == 503 or status == 429 then
        ngx.header["Retry-After"] = tostring(config.get().admission.retry_after_s)
    elseif status == 502 or status == 504 then
        ngx.header[errors.NODE_HEADER] = last_node()
    end
    ngx.say(errors.body(message, etype, code))
end

return _M
