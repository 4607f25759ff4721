-- The request's part in the fair share (admission.fair_share; the queue is
-- infergate.admission.fairqueue, the counters infergate.admission.vtc):
--
--   class, weight   from the API key (infergate.admission.auth: req.key_share =
--                   {weight, priority}), else admission.tenants[<tenant>], else
--                   admission.default_weight / admission.default_priority;
--   admitted(req)   charges the tenant's counter with the estimated prompt tokens
--                   and the expected output tokens / weight when the request is
--                   admitted (so a tenant with many or long requests in flight is
--                   behind at once, not only once they finish: VTC charges output as
--                   it is generated), and asks for the answer's usage
--                   (req.track_usage, infergate.admission.usage). Expected output:
--                   the model's learned high quantile of completion tokens
--                   (infergate.routing.lengths, while its weight is above 0), or the
--                   request's max_tokens when smaller or nothing is learned; 0 when
--                   neither is known;
--   log(req)        settles when the answer's usage is known: usage.total_tokens
--                   minus what was charged, / weight (negative when the answer was
--                   shorter than expected). An answer whose usage is never known (cut
--                   by the deadline, abandoned) is charged what its slot could have
--                   written while held: the time since admission over the learned time
--                   per output token of its last node (infergate.routing.learned pt),
--                   at most its max_tokens, when that is above the charge; else it
--                   keeps the charge. Without it a tenant whose requests never finish
--                   (max_tokens far past the deadline) was charged a typical answer per
--                   request while holding slots for the whole deadline, and so took the
--                   turns of tenants whose short answers it was measured against.
--
-- The class also sets how long a request may wait for a slot: WAIT_FACTOR x the wait of
-- a standard request (critical waits longer, sheddable is shed first).
local cjson = require("cjson.safe")
local config = require("infergate.core.config")
local reqctx = require("infergate.core.reqctx")
local vtc = require("infergate.admission.vtc")
local fairqueue = require("infergate.admission.fairqueue")
local snapshot = require("infergate.routing.snapshot")
local lengths = require("infergate.routing.lengths")
local learned = require("infergate.routing.learned")
local ngxapi = require("infergate.core.ngxapi")

local _M = {}

local max = math.max
local floor = math.floor
local ceil = math.ceil
local tostring = tostring
local type = type
local find = string.find
local sub = string.sub

local CLASSES = fairqueue.CLASSES
_M.WAIT_FACTOR = { [3] = 2, [2] = 1, [1] = 0.25 }

-- Whether the fair share applies to this edge's options `o` (the admission section).
function _M.on(o)
    return o.fair_share == true and o.shed == true
end

-- The class (1..3) and weight (> 0) of the request, options `o` (admission section).
local function number(v)
    return type(v) == "number" and v > 0 and v or nil
end

function _M.share(req, o)
    local ks = req.key_share
    local t = o.tenants and o.tenants[req.tenant or ""]
    local class = (ks and CLASSES[ks.priority]) or (t and CLASSES[t.priority])
        or CLASSES[o.default_priority] or 2
    local weight = (ks and number(ks.weight)) or (t and number(t.weight))
        or number(o.default_weight) or 1
    return class, weight
end

-- Estimated prompt tokens of the request (the rate limits' estimate when it has one).
local function prompt_tokens(req)
    local n = req.est_tokens
    if not n then
        n = max(1, ceil(reqctx.prompt_chars(req) / config.get().limits.chars_per_token))
        req.est_tokens = n   -- a stream without usage: prompt + content chunks
    end
    return n
end

-- Expected output tokens of the request (see the top of this file).
local function expected_output(req)
    local n
    local q, w = lengths.quantile(req.model, ngxapi.now())
    if q and w > 0 then
        n = q
    end
    local m = learned.max_tokens(req)
    if m and (not n or m < n) then
        n = m
    end
    return n and ceil(n) or 0
end
_M.expected_output = expected_output

-- The engine "priority" of class 3 (critical) and 1 (sheddable) by node kind: vLLM
-- handles lower values first (vllm/entrypoints/openai protocol.py, field priority,
-- "lower means earlier handling", v0.6+; needs --scheduling-policy priority), SGLang
-- higher values first (server_args.py schedule_low_priority_values_first = False by
-- default; needs --enable-priority-scheduling). Standard is 0, the engines' default,
-- and not sent.
_M.ENGINE_PRIORITY = { vllm = { [3] = -1, [2] = 0, [1] = 1 },
                       sglang = { [3] = 1, [2] = 0, [1] = -1 } }

-- admission.forward_priority: the class as the engine's "priority" member when the
-- request's node is known at admission (a pool with known slots, req.picked) and is of
-- a kind that takes it. A body without "priority" gets it right after its opening brace
-- (every other byte as sent; nothing for standard, the engines' default 0); a body with
-- its own is sent re-encoded with the class's value: a client never picks its place in
-- the engine's queue. A retry on another node sends the same body.
local function forward_priority(req, class)
    local picked = req.picked
    local body = req.body
    if not picked or type(body) ~= "table" then
        return
    end
    local node = snapshot.current().by_name[picked.name]
    local by_kind = node and _M.ENGINE_PRIORITY[node.kind]
    local p = by_kind and by_kind[class]
    if not p then
        return
    end
    if body.priority ~= nil then
        body.priority = p
        local text = cjson.encode(body)
        if text then
            ngx.req.set_body_data(text)
        end
        return
    end
    if p == 0 then
        return
    end
    local text = ngx.req.get_body_data() or req.raw_body
    local open = type(text) == "string" and find(text, "{", 1, true)
    if open then
        ngx.req.set_body_data(sub(text, 1, open) .. '"priority":' .. p .. "," .. sub(text, open + 1))
    end
end

-- The request is admitted (a slot taken or shedding passed): charge its tenant.
function _M.admitted(req, o)
    local tenant = req.tenant or ""
    local class, weight = _M.share(req, o)
    if o.forward_priority then
        forward_priority(req, class)
    end
    local n = prompt_tokens(req) + expected_output(req)
    vtc.charge(tenant, n, weight)
    req.fair = { tenant = tenant, weight = weight, charged = n, at = ngxapi.now() }
    req.track_usage = true
end

-- Output tokens the slot of a request without usage could have written since its
-- admission (fair share `f`), at its last node's learned time per token; nil unknown.
local function output_while_held(req, f, now)
    local attempts = req.attempts
    local att = attempts and attempts[#attempts]
    local info = att and att.node and learned.info(att.node)
    local pt = info and info.pt
    if not pt or pt <= 0 or not f.at then
        return nil
    end
    local n = floor(max(0, now - f.at) / pt)
    local m = learned.max_tokens(req)
    if m and m < n then
        n = m
    end
    return n
end

-- Log phase: the request's tokens settled once its usage is known; without usage, the
-- output its slot could have written while held, when above the charge.
function _M.log(req)
    local f = req.fair
    if not f then
        return
    end
    local u = req.usage
    local total = u and u.total_tokens
    if total then
        vtc.charge(f.tenant, total - f.charged, f.weight)
        return
    end
    local n = output_while_held(req, f, ngxapi.now())
    if n then
        local held = prompt_tokens(req) + n
        if held > f.charged then
            vtc.charge(f.tenant, held - f.charged, f.weight)
            f.charged = held
        end
    end
end

-- The fast 429 of a request whose flow already holds its bound (infergate.admission.
-- fairqueue: admission.tenant_queue_max while another flow waits, ALONE_FACTOR times it
-- alone).
function _M.queue_full(o)
    return {
        status = 429,
        message = "Too many of this tenant's requests are waiting for capacity (at most "
            .. tostring(o.tenant_queue_max) .. " while other tenants wait, "
            .. tostring(o.tenant_queue_max * fairqueue.ALONE_FACTOR) .. " alone); retry later.",
        type = "server_overloaded",
        code = "tenant_queue_full",
        headers = { ["Retry-After"] = tostring(o.retry_after_s) },
    }
end

return _M
