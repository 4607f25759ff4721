-- The stream relay: streamed /v1/chat/completions and /v1/completions requests driven by
-- the edge itself over cosockets (access phase, the last step), so that a stream
-- survives its node. nginx's proxy module cannot move a request once it has read the
-- node's response header (proxy_next_upstream acts only before that), and a body filter
-- cannot do socket I/O; the relay can:
--
-- 1. Hold the first byte. What the node sends before its first content token (headers,
--    the role-only chunk, comments) is held, at most edge.stream_hold_s; a node that
--    fails, stalls or sends an in-band error (infergate.stream.sse) before content has
--    the request sent to another node as if nothing had happened. Past the hold the
--    headers go out, and a failure before content still retries: the next node's role
--    chunk is dropped and its chunks take the first one's id.
-- 2. Continue after it. A stream that breaks after content (connection reset or closed,
--    an in-band error, [DONE] without a finish_reason, silent past the stall rule:
--    2 x infergate.routing.stall.threshold) is continued on another node serving the
--    model that can continue (infergate.stream.splice.engine) with the partial answer as
--    an assistant message to continue (/v1/completions: prompt + partial text) and
--    max_tokens reduced by the content chunks sent (one token each on vLLM, SGLang and
--    llama.cpp, but for text held back: a possible stop string start), at most
--    edge.stream_continue_max times; its chunks are spliced into the same client stream
--    (same id, one finish_reason, one [DONE], usage completion tokens summed).
--    Off (edge.stream_continue, or a model not in edge.stream_continue_models), or no
--    node able to: the client gets an SSE error event and [DONE], never a silent
--    cut.
-- 3. Cancellation. A client that leaves ends the request at once (ngx.on_abort,
--    lua_check_client_abort in the location): nginx closes the node's connection, and the
--    node stops the work (continued requests too).
-- 4. Shutdown. With edge.shutdown_stream_s, a stream that has sent its headers ends with
--    an SSE error event (code "shutting_down") and [DONE] that long after nginx began to
--    shut down (infergate.core.closing), before whatever stops nginx outright cuts it.
--
-- The attempts are the balancer's (infergate.routing.relaypick): in-flight counts, held
-- slots, breaker verdicts, TTFB outliers, stall progress (stall.byte per piece read),
-- learned concurrency; the log phase closes an attempt the relay left open (client
-- abort). What the client gets goes through the body filters as a proxied answer
-- does: usage counting (infergate.admission.usage), cache capture. With
-- edge.answer_relay the relay drives the same requests that are not streams
-- (infergate.stream.answer: a node that freezes while it holds one has it retried
-- before its deadline). https nodes and every other request keep the proxy path.
local abort = require("infergate.core.abort")
local config = require("infergate.core.config")
local errors = require("infergate.core.errors")
local ngxapi = require("infergate.core.ngxapi")
local deadline = require("infergate.admission.deadline")
local astats = require("infergate.admission.stats")
local metrics = require("infergate.core.prometheus")
local relaypick = require("infergate.routing.relaypick")
local snapshot = require("infergate.routing.snapshot")
local models = require("infergate.routing.models")
local slots = require("infergate.admission.slots")
local splice = require("infergate.stream.splice")
local leg = require("infergate.stream.leg")
local answer = require("infergate.stream.answer")

local _M = {}

local ngx_now = ngxapi.now
local log = ngx.log
local WARN = ngx.WARN

_M.PATHS = { ["/v1/chat/completions"] = true, ["/v1/completions"] = true }

-- Whether another active node than the one a request is sent to serves `model`: a
-- request that is not a stream is relayed only then (with one node nginx's proxy path
-- does all the relay could, for less CPU). A node found unhealthy counts: it may be
-- back before the request's deadline, and a relayed request on a node that froze
-- meanwhile is then retried on it, where the proxy path waits for the deadline.
-- Reads the routing snapshot only.
local function two_nodes(model)
    local n = 0
    for _, node in ipairs(snapshot.current().nodes) do
        if node.addr and node.state == "active" and models.serves(node, model) then
            n = n + 1
            if n > 1 then
                return true
            end
        end
    end
    return false
end

-- Whether the relay drives request `req`: a stream (edge.stream_relay), or a request
-- that is not one (edge.answer_relay) when two nodes serve its model.
function _M.wanted(req, o)
    if req.route ~= "inference" then
        return false
    end
    if req.stream then
        if not o.edge.stream_relay then
            return false
        end
    elseif not o.edge.answer_relay or not two_nodes(req.model) then
        return false
    end
    if not _M.PATHS[ngx.var.uri] then
        return false
    end
    return ngx.var.infergate_upstream_scheme ~= "https"
end

local function continue_on(o, model)
    if not o.edge.stream_continue then
        return false
    end
    local list = o.edge.stream_continue_models
    if not list or #list == 0 then
        return true
    end
    for _, m in ipairs(list) do
        if m == model then
            return true
        end
    end
    return false
end

-- The body of the next leg and the accept filter of its node, or nil, reason.
local function next_body(r)
    if r.out.produced == 0 then
        return r.body, nil
    end
    if r.no_continue then
        return nil, "the answer carries tool calls or several choices"
    end
    if not continue_on(r.o, r.req.model) then
        return nil, "continuation is off for this model"
    end
    return true, function(node)
        return splice.engine(node) ~= nil or r.path == "/v1/completions"
    end
end

local write = leg.write

-- Ends the client stream that could not be completed: an SSE error event and [DONE].
local function fail_stream(r, message, code)
    log(WARN, "infergate: stream ", r.req.id or "", " ends with an error event: ", message)
    r.req.relay_error = code
    metrics.stream_relay("error_event")
    write(r, splice.error_event(message, code) .. "data: [DONE]\n\n")
end

-- Nothing was sent yet: the last node's own answer, or the JSON error the proxy path's
-- error pages give (infergate.errorpage): 504 deadline_exceeded or upstream_timeout,
-- 502 upstream_invalid_answer (bytes that are not HTTP) or upstream_error, 503 when no
-- node was left to try; 502/504 name the last node in X-Infergate-Node.
local function answer_unsent(r)
    local a = r.last_answer
    if a then
        -- the node's own answer (infergate.admission.settlement: a refusal costs nothing)
        answer.send(r, a, a.node)
        return ngx.exit(ngx.HTTP_OK)
    end
    local f = r.last_failure
    if f then
        ngx.header["X-Infergate-Node"] = f.node
    end
    if r.deadline_passed then
        astats.incr("deadline_exceeded")
        return errors.send(504, "The request did not finish within "
            .. deadline.describe(r.req) .. ".", "timeout", "deadline_exceeded",
            { [errors.NO_RETRY_HEADER] = errors.NO_RETRY })
    end
    if not f or r.no_node then -- as the balancer's retry with no node left
        return errors.send(503, "No inference node is left to try (all are unhealthy, draining, "
            .. "have an open circuit breaker or already failed this request).",
            "service_unavailable", "no_healthy_upstream",
            { ["Retry-After"] = tostring(r.o.admission.retry_after_s) })
    end
    if f.invalid then
        return errors.send(502, "Node " .. f.node .. " sent an answer that is not HTTP.",
                           "bad_gateway", "upstream_invalid_answer")
    end
    local tried = " Tried " .. r.legs .. " time(s); node answers: " .. table.concat(r.whys, ", ")
        .. "."
    if f.timeout then
        return errors.send(504, "The inference node did not answer in time." .. tried,
                           "gateway_timeout", "upstream_timeout")
    end
    return errors.send(502, "No inference node gave a valid answer." .. tried, "bad_gateway",
                       "upstream_error")
end

-- The node of the next leg (infergate.routing.relaypick.next). When the nodes left have
-- every known slot taken (a retry or a continuation: the first leg's slot was held by
-- admission), it waits for one to free, polling every admission.poll_ms: for at most
-- the stream idle time (a request that is not a stream: until its deadline), and
-- before anything was sent until the request's deadline;
-- meanwhile new requests leave it the next free slot
-- (infergate.admission.slots.mark_started_waiting).
local function wait_for_node(r, now, accept)
    local o, req = r.o, r.req
    local node, att, eligible, why = relaypick.next(req, o, now, accept)
    local d = deadline.for_request(req)
    local until_s = (req.stream or not d.at) and now + d.idle_s or d.at
    local mark = why == "full" and relaypick.accepts_all(req, accept)
    while not node and why == "full" and not r.client_gone do
        if mark then -- new requests leave the next free slot to this one
            slots.mark_started_waiting(req.model, now, o.admission.poll_ms / 1000, req.tried)
        end
        ngx.sleep(o.admission.poll_ms / 1000)
        now = ngx_now()
        if now >= until_s then
            r.deadline_passed = not r.sent and until_s == d.at -- 504, not its last node's error
            break
        elseif not r.sent and not deadline.timeouts(req, o, now) then
            r.deadline_passed = true
            break
        end
        relaypick.untry_back(req) -- a node back since it failed this request may take it
        node, att, eligible, why = relaypick.next(req, o, now, accept)
    end
    return node, att, eligible, why
end

local function run(r)
    local o, req = r.o, r.req
    local max_legs = o.edge.max_tries + o.edge.stream_continue_max
    while not r.finished and not r.client_gone and not r.shutdown and r.legs < max_legs do
        local body, accept = next_body(r)
        if not body then
            return fail_stream(r, "The node serving this stream failed and the answer cannot "
                .. "be continued: " .. accept .. ".", "stream_interrupted")
        end
        local now = ngx_now()
        if not r.sent and not deadline.timeouts(req, o, now) then
            r.deadline_passed = true -- no new try past the deadline (a started stream goes on)
            break
        end
        local node, att, eligible, why = wait_for_node(r, now, accept)
        if not node then
            r.no_node = r.retry_wanted and why == nil and r.out.produced == 0
            break
        end
        r.retry_wanted = eligible > 1
        if body == true then
            local err
            body, err = splice.continuation(r.body, r.path, splice.partial(r.out), r.out.produced,
                                            splice.engine(node))
            if not body then
                relaypick.close(att, "neutral", ngx_now())
                if err == "done" then -- max_tokens reached with the tokens sent
                    r.out.finish = "length"
                    write(r, splice.finish_event(r.out, r.path, "length") .. "data: [DONE]\n\n")
                    r.finished = true
                    break
                end
                return fail_stream(r, "The answer cannot be continued: " .. err .. ".",
                                   "stream_interrupted")
            end
            r.out.usage_done = r.out.produced
            r.continued = (r.continued or 0) + 1
            metrics.stream_relay("continued")
            if splice.engine(node) == "prefill" and r.path ~= "/v1/completions" then
                r.echo = splice.partial(r.out) -- llama.cpp repeats the prefill (splice.strip_echo)
            end
        end
        if r.legs > 0 and r.out.produced == 0 and req.stream then
            metrics.stream_relay("retried")
        end
        r.legs = r.legs + 1
        leg.run(r, node, att, body, eligible)
    end
    if r.held500 then -- a 500 no later node answered past: not counted against its node
        relaypick.close(r.held500, "neutral", ngx_now())
        r.held500 = nil
    end
    if r.finished and req.stream then
        metrics.stream_relay("completed")
    end
    if r.finished or r.client_gone then
        return
    end
    if not r.sent then
        return answer_unsent(r)
    end
    if r.deadline_passed then
        return fail_stream(r, "The request did not finish within its deadline.", "deadline_exceeded")
    end
    if r.shutdown then -- edge.shutdown_stream_s after nginx began to shut down
        return fail_stream(r, "The gateway is shutting down; the answer was cut short.",
                           "shutting_down")
    end
    local f, idle = r.last_failure, deadline.for_request(req).idle_s
    if f and f.timeout and f.last_byte and ngx_now() - f.last_byte >= idle - 0.01 then
        -- silent past the stream's idle time (its gaps' bound), its node still answering
        return fail_stream(r, "The node serving this stream sent nothing for " .. idle
            .. " s (the gateway's stream idle limit, deadlines.stream_idle_ms) and no other "
            .. "node serving the model can continue it.", "stream_interrupted")
    end
    return fail_stream(r, "The node serving this stream failed and no other node serving "
        .. "the model can continue it.", "stream_interrupted")
end

-- Drives request `req` (wanted) and ends it.
local function drive(req, o)
    local r = {
        req = req, o = o, out = splice.new_out(), legs = 0, sent = false, whys = {},
        body = ngx.req.get_body_data() or req.raw_body or "",
        path = ngx.var.uri, args = ngx.var.args,
    }
    req.relay = r
    local ok, err = abort.watch(req, function()
        r.client_gone = "aborted"
        if r.read_on then -- infergate.stream.leg: its node finishes the answer anyway
            return abort.STAY
        end
    end)
    if not ok then
        log(WARN, "infergate: stream relay: ngx.on_abort: ", err,
            " (lua_check_client_abort off: a client that leaves is seen at the next write)")
    end
    run(r)
    if r.client_gone then
        -- a client that left (499, as nginx's proxy logs a cancel), or stopped reading
        -- for send_timeout (444): the connection is closed now, not held for another
        -- send_timeout while nginx tries to send what is pending, with the node's slot
        -- counted until the log phase
        return ngx.exit(r.client_gone == "aborted" and 499 or 444)
    end
    return ngx.exit(ngx.HTTP_OK)
end

-- Access step (the last): drives the request when wanted(), then ends it. (The closure
-- for the client's leaving is made in drive(): a function that creates one closes
-- upvalues at every return, which LuaJIT does not compile, and every request's trace
-- through this step was aborted.)
function _M.step(req)
    local o = config.get()
    if not _M.wanted(req, o) then
        return nil
    end
    return drive(req, o)
end

return _M
