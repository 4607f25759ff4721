-- Per-request state shared by the access, balancer, header_filter and log phases.
--
-- ngx.ctx is emptied by internal redirects, and nginx answers an upstream failure
-- through error_page (an internal redirect to a named location), so the state is also
-- kept in a worker-local table keyed by the request's id until the log phase ends it.
--
-- The id (32 lowercase hex digits, like nginx's $request_id): a random 64-bit prefix
-- drawn once per worker from /dev/urandom, then a 64-bit counter scrambled by an odd
-- multiplier and a random mask (unique, not secret: it only saves the OpenSSL
-- RAND_bytes call $request_id makes per request). It is written to
-- $infergate_request_id (set "" in the rendered locations), which
-- $infergate_rid (the rendered http part: this id, else $request_id) sends to the node
-- as X-Request-Id and writes in the access log. A hand-written config without that
-- variable uses nginx's $request_id instead.
--
-- State: {id, route = "inference"|"models"|"api"|"tokenizer"|
--         "passthrough" (infergate.access), stream = bool, model = string|nil,
--         http_version = client's (1.0, 1.1, 2.0), attempts = {attempt records, see
--         infergate.routing.stats}, tried = {name = true}, invalid_answer = node name|nil}
-- The body, read and decoded once (the access steps body_read and body, see
-- infergate.phases); every later step reads it here:
--   raw_body      the text as received (body_text(req) reads it, once), body_bytes its size
--   body          the decoded JSON object; include_usage = stream_options.include_usage
--   prompt_chars  characters of the prompt (prompt_chars(req) counts them, once)
-- Admission control adds: tenant ("default" with auth off), key_id, key_limits
-- (infergate.admission.auth); est_raw, est_tokens, ratelimit, track_usage, usage, headers_out
-- (infergate.admission.ratelimit, infergate.admission.usage); deadline (infergate.admission.deadline);
-- admission_wait_ms, the wait for a node with room (infergate.admission.shed). Routing
-- adds first_byte_at (epoch s): when a node's answer first sent a byte
-- (infergate.routing.outlier).
-- The stream relay adds relay_answer_status: the status of a node's answer it passed on
-- itself (nginx's $upstream_status is empty then).
local _M = {}

local pending = {}
local pending_count = 0

local bit = require("bit")
local ngxapi = require("infergate.core.ngxapi")
local ngx_var = ngxapi.var
local request_body = require("infergate.core.body")
local tohex = bit.tohex
local bxor = bit.bxor
local tobit = bit.tobit
local floor = math.floor

local prefix, mask_lo, mask_hi        -- per worker, drawn on first use
local counter = 0
local own_var = true                  -- $infergate_request_id is defined here

local function random_u32s(n)
    local out = {}
    local f = io.open("/dev/urandom", "rb")
    local bytes = f and f:read(4 * n)
    if f then
        f:close()
    end
    for i = 1, n do
        if bytes and #bytes == 4 * n then
            local a, b, c, d = bytes:byte(4 * i - 3, 4 * i)
            out[i] = tobit(((a * 256 + b) * 256 + c) * 256 + d)
        else
            out[i] = tobit(floor(math.random() * 4294967296)) -- no /dev/urandom: still unique
        end
    end
    return out
end

-- A new request id (see the header).
function _M.next_id()
    if not prefix then
        local r = random_u32s(4)
        prefix = tohex(r[1], 8) .. tohex(bxor(r[2], ngx.worker.pid()), 8)
        mask_lo, mask_hi = r[3], r[4]
    end
    counter = counter + 1
    local lo = counter % 4294967296
    local hi = floor(counter / 4294967296)
    -- lo * 40503 < 2^48: exact in a double, then wrapped to 32 bits (odd: a bijection)
    return prefix .. tohex(bxor(tobit(lo * 40503), mask_lo), 8) .. tohex(bxor(hi, mask_hi), 8)
end

local function set_own(id)
    ngx.var.infergate_request_id = id
end

-- The id of the current request: the one the access phase gave it, else $request_id.
function _M.current_id()
    local id = ngx_var("infergate_rid")
    if id and id ~= "" then
        return id
    end
    return ngx_var("request_id")
end

function _M.new(route)
    local id
    if own_var then
        id = _M.next_id()
        local ok, err = pcall(set_own, id)
        if not ok then
            if tostring(err):find("not found", 1, true) then
                own_var = false -- a hand-written config without the variable
            end
            id = ngx_var("request_id")
        end
    else
        id = ngx_var("request_id")
    end
    local req = { id = id, route = route, stream = false, attempts = {}, tried = {},
                  http_version = ngx.req.http_version() }
    ngx.ctx.infergate = req
    if id then
        if not pending[id] then
            pending_count = pending_count + 1
        end
        pending[id] = req
    end
    return req
end

-- The state of the current request, or nil when the request never had one.
function _M.get()
    local ctx = ngx.ctx
    local req = ctx.infergate
    if req then
        return req
    end
    local id = ngx_var("infergate_request_id")
    if not id or id == "" then
        id = ngx_var("request_id")
    end
    req = id and pending[id]
    if req then
        ctx.infergate = req
    end
    return req
end

-- Log phase: forget the request.
function _M.finish(req)
    local id = req.id
    if id and pending[id] then
        pending[id] = nil
        pending_count = pending_count - 1
    end
end

-- The request body's text, read once (ngx.req.read_body, then from memory or the temp
-- file: infergate.core.body.text) into req.raw_body and req.body_bytes. Returns the text
-- (nil when there is none), or nil, err when it cannot be read.
function _M.body_text(req)
    if req.body_read then
        return req.raw_body, req.body_err
    end
    ngx.req.read_body()
    local text, err = request_body.text()
    req.body_read = true
    req.raw_body, req.body_err = text, err
    req.body_bytes = text and #text or 0
    return text, err
end

-- Characters of the prompt of the decoded body (infergate.core.body.prompt_chars),
-- counted on first use and kept in req.prompt_chars; 0 without a decoded body.
function _M.prompt_chars(req)
    local n = req.prompt_chars
    if not n then
        n = request_body.prompt_chars(req.body)
        if req.body ~= nil then
            req.prompt_chars = n
        end
    end
    return n
end

-- Requests of this worker between access and log (for the status endpoint).
function _M.pending()
    return pending_count
end

return _M
