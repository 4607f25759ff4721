-- Request bodies that arrive too slowly or are not UTF-8: a defined JSON answer.
--
--   init_by_lua:  require("infergate.admission.inputguard").init()
--
-- init() adds the access step "body_read" before "body" (infergate.access), for the
-- inference paths:
--
-- * Slow bodies: a body with a Content-Length (HTTP/1.x) is read here through the
--   request socket, each read waiting at most client_body_timeout_ms, and handed to nginx
--   with ngx.req.init_body/append_body/finish_body (in memory up to
--   client_body_buffer_size, like nginx's own read). A client that stalls longer gets 408
--   JSON (code "request_timeout") with "Connection: close" (RFC 9110 section 15.5.9: a
--   408 should close): the request goes to the 408 error page location, which has
--   keepalive_timeout 0, since the rest of the body may still come. nginx's own
--   client_body_timeout cannot answer (seen with nginx 1.22: the request is terminated,
--   the connection closed, the 408 only in the access log). Chunked bodies and HTTP/2
--   are read by nginx (the "body" step), so a stall there ends that way.
-- * Invalid UTF-8 anywhere in the body: 400 JSON (code "invalid_utf8"); JSON text must be
--   UTF-8 (RFC 8259 section 8.1), and the cache keys and nodes expect text.
--
-- Bodies over client_max_body_size never get here (nginx answers 413 from the headers,
-- or while reading a chunked body).
local config = require("infergate.core.config")

local _M = {}

local tonumber = tonumber
local tostring = tostring
local min = math.min
local io_open = io.open

_M.CHUNK = 65536
_M.TIMEOUT_LOCATION = "/_infergate/error/408"

local function bad_utf8()
    return {
        status = 400,
        message = "The request body is not valid UTF-8; JSON text must be UTF-8 encoded.",
        type = "invalid_request_error",
        code = "invalid_utf8",
    }
end

-- True when `s` is valid UTF-8 (PCRE's UTF-8 check of the whole subject).
function _M.valid_utf8(s)
    if not s:find("[\128-\255]") then
        return true -- ASCII
    end
    local from, _, err = ngx.re.find(s, [[^]], "uo")
    if from then
        return true
    end
    return false, err
end

-- Reads a Content-Length body through the request socket. Returns true, or nil and
-- "timeout" | "closed" | another error.
local function read_with_timeout(len)
    local sock = ngx.req.socket()
    if not sock then
        -- body already read, discarded, or a protocol without a request socket
        ngx.req.read_body()
        return true
    end
    sock:settimeout(config.get().client_body_timeout_ms)
    ngx.req.init_body()
    local got = 0
    while got < len do
        local data, rerr = sock:receive(min(_M.CHUNK, len - got))
        if not data then
            return nil, rerr
        end
        ngx.req.append_body(data)
        got = got + #data
    end
    ngx.req.finish_body()
    return true
end

local function body_text()
    local body = ngx.req.get_body_data()
    if body then
        return body
    end
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f = io_open(path, "rb")
    if not f then
        return nil
    end
    body = f:read("*a")
    f:close()
    return body
end

function _M.step(req)
    if req.route ~= "inference" then
        return nil
    end
    local len = tonumber(ngx.var.http_content_length)
    if len and len > 0 and ngx.req.http_version() < 2 and not ngx.var.http_transfer_encoding then
        local ok, err = read_with_timeout(len)
        if not ok then
            if err == "timeout" then
                req.rejected = 408
                return ngx.exec(_M.TIMEOUT_LOCATION)
            end
            if err == "closed" then
                return ngx.exit(499)
            end
            return { status = 400, message = "The request body could not be read: " .. tostring(err) }
        end
    else
        ngx.req.read_body()
    end
    local body = body_text()
    if body and not _M.valid_utf8(body) then
        return bad_utf8()
    end
end

function _M.init()
    local access = require("infergate.access")
    for _, s in ipairs(access.steps) do
        if s.name == "body_read" then
            return true
        end
    end
    access.insert_step("body_read", _M.step, "body")
    return true
end

return _M
