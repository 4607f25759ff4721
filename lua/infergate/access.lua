-- Access steps of the edge itself: method, body and eligible (the order of every step
-- is in infergate.phases). Each step is function(req) -> nil to continue, or an error
-- table {status, message, type, code, headers} to answer with a JSON error and stop.
--
--   step_method    the route's methods; a request that already went through an edge: 508
--   step_body      the JSON body (below); on the routes "api", "tokenizer" and
--                  "passthrough" a JSON
--                  body has the same bounds, a multipart/form-data body gives its "model"
--                  field, any other body passes unread (infergate.core.bodykind)
--   step_eligible  no eligible node among those serving the request's model: 503, unless
--                  one of them may be back soon (frozen, or coming back: infergate.
--                  admission.thaw holds the request for it within its deadline, as
--                  nginx's proxy would wait)
--
-- The body step reads the whole body once into the request's state (req.raw_body,
-- req.body_bytes: infergate.core.reqctx.body_text; nginx already enforces client_max_body_size:
-- too big -> 413 JSON from the error page). Bodies nginx buffered in memory are
-- checked directly; a body nginx spilled to a temp file is read back from the file
-- (blocking disk I/O; the rendered template sets client_body_buffer_size =
-- client_max_body_size, so nginx keeps every accepted body in memory and this is only
-- a fallback for hand-written configs). The body must be a JSON object, nested at most
-- edge.max_json_depth deep (lua-cjson stops decoding at that depth, so a hostile body
-- costs nothing: 400 json_too_deep), with at most edge.max_messages messages (400
-- too_many_messages; a large body's "role" keys are counted with a plain string search
-- before decoding, so a 100,000-message body is refused without building its tables),
-- and with at most edge.max_json_members members (object fields + array elements over
-- the whole body, 400 too_many_json_members; counted before decoding, see
-- over_member_count: decoding and the cache key's canonical encoding of a body with
-- hundreds of thousands of fields would hold the worker for seconds). Decoded, its
-- "model" must be a string of at most MODEL_MAX bytes (400 invalid_model), no output
-- limit may be negative or above 2^31 - 1 (400 integer_below_min_value,
-- integer_above_max_value: limit_out_of_range) and each of its
-- messages must be an object with a string role (400 missing_required_parameter:
-- roleless_message; on the routes "inference" and "api").
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local ngx_start_time = ngxapi.req_start_time
-- Request bodies are parsed by an instance of their own that refuses what JSON does not
-- allow and lua-cjson accepts by default (NaN, Infinity, hexadecimal numbers).
local body_json = cjson.new()
body_json.decode_invalid_numbers(false)
local reqctx = require("infergate.core.reqctx")
local snapshot = require("infergate.routing.snapshot")
local balancer = require("infergate.routing.balancer")
local affinity = require("infergate.routing.affinity")
local thaw = require("infergate.admission.thaw")
local config = require("infergate.core.config")
local deadline = require("infergate.admission.deadline")
local inputguard = require("infergate.admission.inputguard")
local bodykind = require("infergate.core.bodykind")
local cors = require("infergate.core.cors")

local _M = {}

local type = type
local tostring = tostring
local format = string.format

-- Routes of the rendered locations (nginx/infergate-server.conf.j2) and their methods:
--   inference    /v1/chat/completions, /v1/completions, /v1/embeddings (cached ones too)
--   models       GET /v1/models, /v1/models/<id> (answered by the edge)
--   api          /v1/responses, /v1/rerank, /rerank, /v1/score, /v1/audio/transcriptions,
--                /v1/audio/translations, /v1/audio/speech: proxied, never cached, wait
--                for a slot like inference (infergate.admission.shed)
--   tokenizer    /tokenize, /detokenize: as api, without the wait for a slot
--   passthrough  any other path under /v1/: proxied to a node serving the request's model
local METHODS = {
    inference = { POST = true, allow = "POST" },
    models = { GET = true, HEAD = true, allow = "GET, HEAD" },
    api = { POST = true, allow = "POST" },
    tokenizer = { POST = true, allow = "POST" },
    passthrough = { GET = true, HEAD = true, POST = true, PUT = true, PATCH = true, DELETE = true,
                    allow = "GET, HEAD, POST, PUT, PATCH, DELETE" },
}
_M.METHODS = METHODS

-- Routes whose body may be JSON, multipart/form-data or anything else (proxied_body).
local BODY_ROUTES = { api = true, tokenizer = true, passthrough = true }

-- Paths under /v1/ that administer a node (vLLM's runtime LoRA loading): never passed
-- through from clients; 404 from the edge.
_M.NODE_ADMIN_PATHS = {
    ["/v1/load_lora_adapter"] = true,
    ["/v1/unload_lora_adapter"] = true,
}

-- Most bytes of the hop ids a request came with that are passed on.
_M.HOP_MAX = 256

-- Whether the X-Infergate-Hop value `came` lists the hop id `own`; otherwise what this
-- edge sends on is set: the ids before (letters, digits and commas, the last HOP_MAX
-- bytes), then its own.
local function hop_seen(came, own)
    if type(own) ~= "string" or own == "" then
        return false
    end
    for id in came:gmatch("[^,%s]+") do
        if id == own then
            return true
        end
    end
    local before = came:gsub("[^%w,]", "")
    if #before > _M.HOP_MAX then
        before = before:sub(-_M.HOP_MAX):gsub("^[^,]*,", "")
    end
    if before ~= "" then
        ngx.var.infergate_hop = before .. "," .. own
    end
    return false
end

local function step_method(req)
    local m = METHODS[req.route]
    if not m then
        return { status = 404 }
    end
    if req.route == "passthrough" and _M.NODE_ADMIN_PATHS[ngx_var("uri")] then
        return {
            status = 404,
            message = "The path " .. ngx_var("uri") .. " administers an inference node; this "
                .. "gateway does not pass it on.",
            type = "invalid_request_error",
            code = "not_found",
        }
    end
    -- Every proxied request carries X-Infergate-Hop, the hop ids of the edges it went
    -- through: one that comes back with this edge's id means a node is registered with
    -- the address of an edge of the loop. The ids are random (controlplane/edge/render.py
    -- hop_id): a header a client sets itself is passed on, never taken for a loop.
    local came = ngx_var("http_x_infergate_hop")
    if came and hop_seen(came, ngx_var("infergate_hop_id")) then
        return {
            status = 508,
            message = "Routing loop: this request already went through an infergate edge; "
                .. "a node's URL points at an edge instead of an inference server.",
            type = "invalid_request_error",
            code = "loop_detected",
        }
    end
    local method = ngx.req.get_method()
    if method == "OPTIONS" then
        return cors.preflight(m.allow) -- a browser's preflight: 204, before the API key
    end
    if not m[method] then
        return {
            status = 405,
            message = "Method " .. method .. " is not allowed on " .. ngx_var("uri")
                .. "; use " .. m.allow .. ".",
            headers = { Allow = m.allow },
        }
    end
end

local function bad_request(message)
    return { status = 400, message = message, type = "invalid_request_error", code = "invalid_json" }
end

local function too_many_messages(max)
    return {
        status = 400,
        message = "The request has more than " .. max .. " messages, the most this gateway accepts.",
        type = "invalid_request_error",
        code = "too_many_messages",
        param = "messages",
    }
end

-- Shortest encoding of one message ({"role":"x"} and a comma): below max * this many
-- bytes a body cannot carry more than max messages, and is not scanned.
local MIN_MESSAGE_BYTES = 12

-- More than `max` "role" keys in the raw body (stops counting at max + 1).
local function over_message_count(body, max)
    if #body <= max * MIN_MESSAGE_BYTES then
        return false
    end
    local find = string.find
    local n, pos = 0, 1
    while true do
        local _, e = find(body, '"role"', pos, true)
        if not e then
            return false
        end
        pos = e + 1
        if find(body, "^%s*:", pos) then
            n = n + 1
            if n > max then
                return true
            end
        end
    end
end
_M.over_message_count = over_message_count

local re_gsub = ngx.re.gsub
-- A JSON string (escapes included), and one structural character that starts a member:
-- "," (one more member) or "{" / "[" (a container and its first member).
local RE_STRING = [["(?:[^"\\]++|\\.)*+"]]
local RE_MEMBER = [=[[,\[{]]=]

-- True when the raw body has more than `max` members (object fields + array elements,
-- over every level). Counts "," and "{" / "[" outside strings: an upper bound that
-- exceeds the true count by one per empty container. Every counted character is a byte
-- of its own, so a body of at most `max` bytes is not scanned. Two PCRE passes (strings
-- removed, then the structural characters counted), no Lua loop per byte; an 8 MB body
-- costs at most ~0.4 s, far less than decoding it (see docs/admission.md, errors). Returns
-- true, false, or nil, err (the regex failed: then the decoder's own limits apply).
local function over_member_count(body, max)
    if #body <= max then
        return false
    end
    local structure, _, err = re_gsub(body, RE_STRING, "", "jo")
    if not structure then
        return nil, err
    end
    local _, n, cerr = re_gsub(structure, RE_MEMBER, "", "jo")
    if not n then
        return nil, cerr
    end
    return n > max
end
_M.over_member_count = over_member_count

-- The body's text, once; nil, error table when it cannot be read or took the whole
-- request deadline to arrive (a body that took the deadline leaves nothing for a node:
-- the client's own upload, not a busy pool; a 429 would say the pool is saturated).
local function read_body(req)
    local body, err = reqctx.body_text(req) -- read once (infergate.core.reqctx)
    if err then
        return nil, { status = 500, message = err }
    end
    local left = deadline.remaining(req)
    if left and left <= 0 then
        return nil, {
            status = 408,
            message = format("The request took %.1f s to arrive, past its deadline of %g s; "
                .. "send the body faster or ask the operator for a longer deadline.",
                ngx_now() - ngx_start_time(), deadline.for_request(req).request_ms / 1000),
            type = "invalid_request_error",
            code = "request_timeout",
        }
    end
    return body
end

-- The JSON text `body` decoded within the bounds of the options `o` (messages, members,
-- depth): the value, or nil, error table.
local function decode_json(body, o)
    if over_message_count(body, o.edge.max_messages) then
        return nil, too_many_messages(o.edge.max_messages)
    end
    if over_member_count(body, o.edge.max_json_members) then
        return nil, {
            status = 400,
            message = "The request body has more than " .. o.edge.max_json_members
                .. " JSON members (object fields and array elements), the most this "
                .. "gateway accepts.",
            type = "invalid_request_error",
            code = "too_many_json_members",
        }
    end
    body_json.decode_max_depth(o.edge.max_json_depth)
    local obj, derr = body_json.decode(body)
    if obj == nil then
        derr = tostring(derr)
        if derr:find("too many nested", 1, true) then
            return nil, {
                status = 400,
                message = "The request body is nested deeper than " .. o.edge.max_json_depth
                    .. " levels, the most this gateway accepts.",
                type = "invalid_request_error",
                code = "json_too_deep",
            }
        end
        return nil, bad_request("The request body is not valid JSON: " .. derr)
    end
    if type(obj) == "table" and type(obj.messages) == "table" and #obj.messages > o.edge.max_messages then
        return nil, too_many_messages(o.edge.max_messages)
    end
    return obj
end

-- The decoded JSON object into the request's state: stream, model, affinity key.
local function take_object(req, obj, o)
    req.stream = obj.stream == true
    req.include_usage = type(obj.stream_options) == "table"
        and obj.stream_options.include_usage == true
    if type(obj.model) == "string" then
        req.model = obj.model
    end
    req.body = obj -- the text as received is req.raw_body (infergate.cache.key.keys_for)
    req.affinity, req.affinity_kind = affinity.key(obj, o)
end

local function not_an_object(body)
    if body:sub(1, 3) == "\239\187\191" then
        return bad_request("The request body starts with a UTF-8 byte order mark; JSON "
            .. "text must not (RFC 8259 section 8.1): send the JSON object without it.")
    end
    return bad_request("The request body must be a JSON object.")
end

-- Longest model name (bytes) the edge takes: it goes into Redis key names (the cache's
-- per-model index) and metrics labels; served names are a few dozen bytes.
_M.MODEL_MAX = 512

local function model_too_long(model)
    if #model <= _M.MODEL_MAX then
        return nil
    end
    return { status = 400, message = "The field 'model' is longer than " .. _M.MODEL_MAX
                 .. " bytes; GET /v1/models lists the models this gateway serves.",
             type = "invalid_request_error", code = "invalid_model", param = "model" }
end

-- The output limits of a body (chat and completions, the Responses API). A negative one
-- is refused: llama.cpp reads -1 as no limit (its n_predict; Ollama's num_predict too),
-- which would hold a slot until the context is full, long after the client's 504, and
-- reserve no output against the tenant's tokens per minute; vLLM and the OpenAI API
-- refuse any limit below 1 (vLLM's SamplingParams: "max_tokens must be at least 1").
-- 0 passes on as sent (the node answers it as it does directly). One above 2^31 - 1 is
-- refused too: llama-server reads it into a 32-bit int (4294967295 became -1, no limit),
-- and it would reserve the whole of a tenant's tokens per minute.
local OUTPUT_LIMITS = { "max_tokens", "max_completion_tokens", "max_output_tokens" }
_M.OUTPUT_LIMIT_MAX = 2147483647

local function limit_out_of_range(obj)
    for _, f in ipairs(OUTPUT_LIMITS) do
        local v = obj[f]
        local low = type(v) == "number" and v < 0
        if low or type(v) == "number" and v > _M.OUTPUT_LIMIT_MAX then
            return { status = 400, message = "Invalid '" .. f .. "': " .. format("%.17g", v)
                         .. (low and " is below the minimum value (0; -1 is not 'no limit' here)"
                             or " is above the maximum value (" .. _M.OUTPUT_LIMIT_MAX .. ")")
                         .. ": leave the field out for the server's default.",
                     type = "invalid_request_error",
                     code = low and "integer_below_min_value" or "integer_above_max_value",
                     param = f }
        end
    end
    return nil
end

-- A chat message that is not an object with a string "role" (the OpenAI API requires
-- one; llama-server answers such a body with a 500, which is the client's error and
-- not the node's): the 400 the OpenAI API gives. Bodies without a messages array pass.
local function roleless_message(obj)
    local msgs = obj.messages
    if type(msgs) ~= "table" then
        return nil
    end
    for i, m in ipairs(msgs) do
        if type(m) ~= "table" or type(m.role) ~= "string" then
            local param = "messages[" .. (i - 1) .. "].role"
            return { status = 400, message = "Missing required parameter: '" .. param
                         .. "' (each message is an object with a role: system, user, "
                         .. "assistant or tool).",
                     type = "invalid_request_error", code = "missing_required_parameter",
                     param = param }
        end
    end
    return nil
end

-- Decodes a JSON body within the edge's bounds and takes its facts into the request
-- state. Returns nil, or an error table (an output limit out of range:
-- limit_out_of_range; a message without a role: roleless_message).
local function decode_into(req, body)
    local o = config.get()
    local obj, err = decode_json(body, o)
    if not obj then
        return err
    end
    if type(obj) == "table" then
        local model = obj.model
        if model ~= nil and model ~= cjson.null and type(model) ~= "string" then
            return { status = 400, message = "The field 'model' must be a string (the id of "
                         .. "a model, as GET /v1/models lists them).",
                     type = "invalid_request_error", code = "invalid_model", param = "model" }
        end
        -- the messages are checked on the routes that take a slot (chat and
        -- completions; the Responses API), not on bodies passed through to other paths
        -- (whose "messages" may be another API's); a negative output limit on any
        -- (an Anthropic-style /v1/messages passed through has max_tokens too)
        local route = req.route
        local bad = type(model) == "string" and model_too_long(model) or limit_out_of_range(obj)
            or (route == "inference" or route == "api") and roleless_message(obj)
        if bad then
            return bad
        end
        take_object(req, obj, o)
    end
end

-- Route "inference": the body must be a JSON object.
local function inference_body(req)
    local body, rerr = read_body(req)
    if rerr then
        return rerr
    end
    if not body or body == "" then
        return bad_request("The request body is empty; expected a JSON object.")
    end
    if not body:find("^%s*{") then
        return not_an_object(body)
    end
    return decode_into(req, body)
end

-- Routes "api", "tokenizer" and "passthrough": a JSON body (bodykind.kind) has the
-- bounds of the inference routes and gives the model; a multipart/form-data body its
-- "model" field; any other body (binary audio, none) passes as it is, with no model.
local function proxied_body(req)
    local body, rerr = read_body(req)
    if rerr then
        return rerr
    end
    if not body or body == "" then
        return nil
    end
    local ct = ngx_var("http_content_type")
    local kind = bodykind.kind(ct, body)
    if kind == "multipart" then
        local model = bodykind.form_field(body, ct, "model")
        if model and model ~= "" then
            if not inputguard.valid_utf8(model) then
                return {
                    status = 400,
                    message = "The form field \"model\" is not valid UTF-8.",
                    type = "invalid_request_error",
                    code = "invalid_utf8",
                    param = "model",
                }
            end
            local long = model_too_long(model)
            if long then
                return long
            end
            req.model = model
        end
        return nil
    end
    if kind ~= "json" then
        return nil
    end
    if not inputguard.valid_utf8(body) then
        return inputguard.bad_utf8()
    end
    if body:sub(1, 3) == "\239\187\191" then
        return not_an_object(body)
    end
    return decode_into(req, body)
end

local function step_body(req)
    local route = req.route
    if route == "inference" then
        return inference_body(req)
    end
    if BODY_ROUTES[route] then
        return proxied_body(req)
    end
end

local function step_eligible(req)
    local t = snapshot.current()
    if balancer.count_eligible(t, req.tried, ngx_now(), req.model) == 0
            and not thaw.held(req, t) then
        return {
            status = 503,
            message = "No inference node is available (all are unhealthy, draining or have an "
                .. "open circuit breaker).",
            type = "service_unavailable",
            code = "no_healthy_upstream",
            -- a breaker half-opens, a node recovers or is undrained: worth a retry soon
            headers = { ["Retry-After"] = tostring(config.get().admission.retry_after_s) },
        }
    end
end

_M.step_method = step_method
_M.step_body = step_body
_M.step_eligible = step_eligible

return _M
