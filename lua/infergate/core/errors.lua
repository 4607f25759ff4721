-- OpenAI-style JSON errors: {"error": {"message", "type", "param", "code"}} with
-- Content-Type: application/json; "param" names the request field at fault, null when
-- none is (as OpenAI's own answers).
--
-- send() answers from the access/content phase with a specific message; the content
-- of the error_page locations, for every error nginx itself produces (unknown path, body
-- too large, all nodes failed, ...), is infergate.errorpage.
local cjson = require("cjson.safe")
local jsonenc = require("infergate.core.jsonenc")

local _M = {}

-- The header naming a node (as infergate.filters sets it on proxied answers).
_M.NODE_HEADER = "X-Infergate-Node"

-- Header of a 504 deadline_exceeded: the OpenAI SDKs retry a 5xx twice by default
-- unless the answer says `x-should-retry: false` (openai-python 1.x,
-- _base_client.BaseClient._should_retry). A request that missed the gateway's deadline
-- would take another full deadline of a slot on each retry (the gateway already retried
-- on another node where a retry could help), so it tells the client not to.
_M.NO_RETRY_HEADER, _M.NO_RETRY = "x-should-retry", "false"

-- status -> {type, code, default message}
_M.CATALOG = {
    [400] = { "invalid_request_error", "bad_request", "The request could not be understood." },
    [403] = { "permission_error", "forbidden", "Access to this path is not allowed from your address." },
    [404] = { "invalid_request_error", "not_found",
              "Unknown path. The OpenAI-compatible API is served under /v1 (/v1/chat/completions, "
              .. "/v1/completions, /v1/embeddings, /v1/models, /v1/responses, ...), and "
              .. "/rerank, /tokenize, /detokenize." },
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
    -- a 503 nginx answers itself (the site's `return 503`, a limit): the edge's own
    -- "no node" answers carry no_healthy_upstream (infergate.errorpage, access)
    [503] = { "service_unavailable", "service_unavailable",
              "The server is unavailable for this request (answered by nginx itself, not an inference node)." },
    [504] = { "gateway_timeout", "upstream_timeout", "The inference node did not answer in time." },
}

-- The body's JSON text: infergate.core.jsonenc writes "/" as is (cjson escapes it, and
-- a person reading curl's output would see "\/v1\/chat\/completions").
function _M.body(message, etype, code, param)
    local v = { error = { message = message, type = etype, param = param or cjson.null, code = code } }
    return jsonenc.encode(v) or cjson.encode(v)
end

-- Answer now with a JSON error and end the request. headers: optional table; param:
-- the request field at fault (optional).
function _M.send(status, message, etype, code, headers, param)
    local entry = _M.CATALOG[status] or _M.CATALOG[500]
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    if headers then
        for k, v in pairs(headers) do
            ngx.header[k] = v
        end
    end
    ngx.say(_M.body(message or entry[3], etype or entry[1], code or entry[2], param))
    return ngx.exit(ngx.HTTP_OK)
end

return _M
