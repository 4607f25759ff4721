-- header_filter_by_lua / body_filter_by_lua of the proxied locations.
--
-- run(): names the node that served a proxied response (X-Infergate-Node) and records
-- its time to first byte (infergate.routing.outlier): the headers of a complete answer
-- (not streamed, or an error), the first body chunk of a stream. vLLM, SGLang and TGI
-- send a stream's headers as soon as they accept the request, before it is scheduled
-- (vllm/entrypoints/openai/api_server.py returns the StreamingResponse before the
-- engine's first output), so only the first chunk says the node is generating; a node
-- whose engine hangs behind a live HTTP server sends the headers and then nothing.
-- Every answer of the location
-- carries X-Request-Id (the $request_id the node got as well, unless the node sent its
-- own), which OpenAI clients report as the request id.
--
-- A node that answers bytes that are not HTTP (wrong port, a TLS server, a crashed
-- process writing junk) is taken by nginx for an HTTP/0.9 answer: it cannot be retried
-- on another node, nginx sends no status line or headers and passes the junk on
-- (nginx src/http/modules/ngx_http_proxy_module.c, ngx_http_proxy_process_status_line,
-- "upstream sent no valid HTTP/1.0 header"). The edge detects it here (the request's
-- HTTP version turned 0.9), counts it as a failure of the node (breaker) and, for
-- HTTP/1.x clients, replaces the junk with a complete HTTP/1.1 502 JSON answer written
-- by body(); other clients get the connection closed.
--
-- An error answer of a node (status >= 400) that is not JSON (a plain-text "500
-- Internal Server Error", an HTML page of a proxy in front of the node) is replaced by
-- an OpenAI-style JSON error with the same status: {"error": {"message": "Node <name>
-- answered <status>: <first WRAP_MAX bytes of its text>", "type", "param", "code":
-- "upstream_error"}}. Compressed bodies (Content-Encoding) pass unchanged.
local errors = require("infergate.core.errors")
local ngxapi = require("infergate.core.ngxapi")
local ngx_var = ngxapi.var
local reqctx = require("infergate.core.reqctx")
local outlier = require("infergate.routing.outlier")
local stats = require("infergate.routing.stats")

local _M = {}

local log = ngx.log
local type = type
local ERR = ngx.ERR

_M.NODE_HEADER = "X-Infergate-Node"
-- Bytes of a node's plain-text error kept in the JSON message.
_M.WRAP_MAX = 512

local function wants_wrap(status)
    if status < 400 then
        return false
    end
    local ct = ngx.header["Content-Type"]
    if type(ct) == "table" then
        ct = ct[1]
    end
    if ct and ct:lower():find("json", 1, true) then
        return false
    end
    return not ngx.header["Content-Encoding"]
end

function _M.run()
    local req = reqctx.get()
    if not req then
        return
    end
    if req.id and not ngx.header["X-Request-Id"] then
        ngx.header["X-Request-Id"] = req.id
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
    if not last or not ngx_var("upstream_status") then
        return
    end
    local client_version = req.http_version or 1.1
    if ngx.req.http_version() == 0.9 and client_version >= 1.0 then
        req.invalid_answer = last.node
        -- nginx sends no status line for it (body() writes the 502); the status set here is
        -- what the access log ($status) and the edge's metrics record, not nginx's 9
        ngx.status = 502
        log(ERR, "infergate: node ", last.node, " answered with bytes that are not HTTP; ",
            "the client gets a 502")
        if client_version >= 2 then
            return ngx.exit(ngx.ERROR)
        end
        return
    end
    ngx.header[_M.NODE_HEADER] = last.node
    local status = ngx.status
    if last.probe and status >= 200 and status < 300 then
        stats.probe_answered(last)
    end
    if req.stream and status < 300 then
        req.first_chunk_wait = true -- its first byte is the stream's first chunk: body()
    else
        outlier.first_byte(req) -- the node answers: its TTFB, and no longer an outlier
    end
    if wants_wrap(status) then
        req.wrap_error = { status = status, node = last.node, parts = {}, size = 0 }
        ngx.header["Content-Type"] = "application/json"
        ngx.header["Content-Length"] = nil
    end
end

-- The OpenAI-style JSON error (a string) replacing node `node`'s error answer `text`
-- (status `status`) that is not JSON: its first WRAP_MAX bytes, ASCII only, whitespace
-- collapsed (the text may be any bytes).
function _M.error_json(status, node, text)
    text = text:sub(1, _M.WRAP_MAX):gsub("[^\32-\126]", " "):gsub("%s+", " ")
    text = text:match("^%s*(.-)%s*$")
    local message = "Node " .. node .. " answered " .. status
    if text ~= "" then
        message = message .. ": " .. text
    end
    local etype = status >= 500 and "server_error" or "invalid_request_error"
    return errors.body(message, etype, "upstream_error")
end

-- Body filter part of the plain-text error wrapping (see the header).
local function wrap_body(w)
    local chunk = ngx.arg[1]
    if chunk and chunk ~= "" and w.size < _M.WRAP_MAX then
        local part = chunk:sub(1, _M.WRAP_MAX - w.size)
        w.parts[#w.parts + 1] = part
        w.size = w.size + #part
    end
    if not ngx.arg[2] then
        ngx.arg[1] = nil
        return
    end
    ngx.arg[1] = _M.error_json(w.status, w.node, table.concat(w.parts)) .. "\n"
end

function _M.body()
    local req = ngx.ctx.infergate
    if not req then
        return
    end
    if req.first_chunk_wait then
        local chunk = ngx.arg[1]
        if chunk and chunk ~= "" then
            req.first_chunk_wait = nil
            outlier.first_byte(req)
        end
    end
    if req.wrap_error then
        return wrap_body(req.wrap_error)
    end
    if not req.invalid_answer then
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

-- Last body filter step of a stream the edge relays (infergate.stream.relay prints it
-- from the access phase): the chunk is handed on as a copy, so the relay's own buffers
-- are never left waiting on a slow client. lua-nginx-module before 0.10.29 (Debian 12
-- ships 0.10.23) left its context on "body filter" when the write event that drained
-- them ran this filter with no data, and the relay's next ngx.print then failed with
-- "API disabled in the context of body_filter_by_lua*", cutting the stream (fixed
-- upstream in ngx_http_lua_bodyfilterby.c by "ensure context is restorable on fd
-- writable events"). The copy keeps the pending bytes in the filter's own buffers,
-- whose drain runs with the context restored.
function _M.relay_copy()
    local req = ngx.ctx.infergate
    if req and req.relay then
        local chunk = ngx.arg[1]
        if chunk and chunk ~= "" then
            ngx.arg[1] = chunk
        end
    end
end

return _M
