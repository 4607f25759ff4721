-- Request bodies that arrive too slowly or are not UTF-8: a defined JSON answer.
--
-- step() is the access step "body_read", before "body" (infergate.phases), for every
-- route with a body (all but "models"; the UTF-8 check on "inference", and on the other
-- routes for JSON bodies only, in infergate.access):
--
-- * Slow bodies: a body with a Content-Length (HTTP/1.x) is read here through the
--   request socket, each read waiting at most client_body_timeout_ms, and handed to nginx
--   with ngx.req.init_body/append_body/finish_body (in memory up to
--   client_body_buffer_size, like nginx's own read). A client that stalls longer gets 408
--   JSON (code "request_timeout") with "Connection: close" (RFC 9110 section 15.5.9: a
--   408 should close): the request goes to the 408 error page location, which has
--   keepalive_timeout 0, since the rest of the body may still come. The whole body must
--   also arrive within client_body_deadline_ms of the request's arrival, however steadily
--   it trickles (1 byte every 20 s never trips the gap timeout): past it, the same 408.
--   nginx's own
--   client_body_timeout cannot answer (seen with nginx 1.22: the request is terminated,
--   the connection closed, the 408 only in the access log). A chunked body (HTTP/1.1,
--   "Transfer-Encoding: chunked") is decoded by nginx (lua-nginx-module's request socket
--   refuses chunked bodies, and the raw one would leave nginx unable to send the
--   proxied answer): a stall between two reads ends as nginx ends it, but the total
--   deadline holds too, kept by a light thread of the request that sleeps until the
--   deadline (no timer) and sends the request to the same 408 when the body is not
--   complete by then. HTTP/2 bodies are read by nginx (the "body" step).
-- * A body with a Content-Encoding (gzip, ...): 415 JSON (code
--   "unsupported_content_encoding"), before it is read.
-- * Invalid UTF-8 anywhere in the body: 400 JSON (code "invalid_utf8"); JSON text must be
--   UTF-8 (RFC 8259 section 8.1), and the cache keys and nodes expect text.
--
-- Bodies over client_max_body_size never get here (nginx answers 413 from the headers,
-- or while reading a chunked body; the error locations of the rendered server template
-- set client_max_body_size 0, so a chunked body nginx refused mid-way gets the same 413
-- JSON and not nginx's HTML page).
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_start_time = ngxapi.req_start_time
local ngx_var = ngxapi.var
local reqctx = require("infergate.core.reqctx")

local _M = {}

local tonumber = tonumber
local tostring = tostring
local min = math.min
local floor = math.floor

_M.CHUNK = 65536
-- Bodies up to this many bytes are read into a buffer of exactly their size.
_M.SMALL_BODY = 65536
_M.TIMEOUT_LOCATION = "/_infergate/error/408"

local function bad_utf8()
    return {
        status = 400,
        message = "The request body is not valid UTF-8; JSON text must be UTF-8 encoded.",
        type = "invalid_request_error",
        code = "invalid_utf8",
    }
end

_M.bad_utf8 = bad_utf8

-- True when `s` is valid UTF-8 (PCRE's UTF-8 check of the whole subject).
function _M.valid_utf8(s)
    -- PCRE checks the whole subject in C, ASCII included, faster than a Lua scan
    local from, _, err = ngx.re.find(s, [[^]], "uo")
    if from then
        return true
    end
    return false, err
end

-- Reads a Content-Length body through the request socket, within the gaps of
-- client_body_timeout_ms and the total client_body_deadline_ms counted from the
-- request's arrival. Returns true, or nil and "timeout" | "closed" | another error.
local function read_with_timeout(len)
    local sock = ngx.req.socket()
    if not sock then
        -- body already read, discarded, or a protocol without a request socket
        ngx.req.read_body()
        return true
    end
    local o = config.get()
    local gap = o.edge.client_body_timeout_ms
    local deadline = ngx_start_time() + (o.edge.client_body_deadline_ms or 3600000) / 1000
    -- a small body gets a buffer of its own size: nginx would allocate
    -- client_body_buffer_size (in the rendered config as large as client_max_body_size)
    -- for every request; larger ones follow client_body_buffer_size (memory or temp file)
    if len <= _M.SMALL_BODY then
        ngx.req.init_body(len)
    else
        ngx.req.init_body()
    end
    local got = 0
    while got < len do
        ngx.update_time()
        local left_ms = floor((deadline - ngx_now()) * 1000)
        if left_ms <= 0 then
            return nil, "timeout"
        end
        sock:settimeout(min(gap, left_ms))
        -- whatever has arrived, so a body trickling in is checked against the deadline
        -- at every read
        local data, rerr = sock:receiveany(min(_M.CHUNK, len - got))
        if not data then
            return nil, rerr
        end
        ngx.req.append_body(data)
        got = got + #data
    end
    ngx.req.finish_body()
    return true
end

-- Reads a chunked body (nginx decodes it: ngx.req.read_body) within the total deadline
-- client_body_deadline_ms: a light thread of the request sleeps until the deadline and,
-- when the body is not complete by then, sends the request to the 408 location. The gap
-- timeout between reads is nginx's client_body_timeout (the rendered
-- client_body_timeout_ms). Returns once the body is read.
local function read_chunked_with_deadline(req)
    local o = config.get()
    local deadline = ngx_start_time() + (o.edge.client_body_deadline_ms or 3600000) / 1000
    local watchdog = ngx.thread.spawn(function()
        ngx.update_time()
        local left = deadline - ngx_now()
        if left > 0 then
            ngx.sleep(left)
        end
        req.rejected = 408
        return ngx.exec(_M.TIMEOUT_LOCATION)
    end)
    ngx.req.read_body()
    ngx.thread.kill(watchdog)
end

local function is_chunked(te)
    return te:lower():match("^%s*chunked%s*$") ~= nil
end

function _M.step(req)
    if req.route == "models" then
        return nil
    end
    -- a compressed body (Content-Encoding: gzip, ...) is not JSON text; the OpenAI API and
    -- vLLM take bodies uncompressed. Refused before it is read (nginx discards it).
    local enc = ngx_var("http_content_encoding")
    if enc and enc:lower() ~= "identity" then
        return {
            status = 415,
            message = "Content-Encoding " .. enc:sub(1, 40) .. " is not supported; send the "
                .. "request body uncompressed.",
            type = "invalid_request_error",
            code = "unsupported_content_encoding",
        }
    end
    local len = tonumber(ngx_var("http_content_length"))
    local te = ngx_var("http_transfer_encoding")
    local h1 = ngx.req.http_version() < 2
    if h1 and te and is_chunked(te) then
        read_chunked_with_deadline(req)
    elseif len and len > 0 and h1 and not te then
        local ok, err = read_with_timeout(len)
        if not ok then
            if err == "timeout" then
                req.rejected = 408
                return ngx.exec(_M.TIMEOUT_LOCATION)
            end
            -- "client aborted": a client that closed its side (lua_check_client_abort
            -- sees a half-close so), as nginx's proxy ends it: 499, not a bad request
            if err == "closed" or err == "client aborted" then
                return ngx.exit(499)
            end
            return { status = 400, message = "The request body could not be read: " .. tostring(err) }
        end
    else
        ngx.req.read_body()
    end
    local body = reqctx.body_text(req) -- read once, kept in req (infergate.core.reqctx)
    -- the other routes check JSON bodies only (infergate.access: a body may be binary)
    if body and req.route == "inference" and not _M.valid_utf8(body) then
        return bad_utf8()
    end
end

return _M
