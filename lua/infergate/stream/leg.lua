-- One leg of a relayed stream (infergate.stream.relay): the request `body` sent to one
-- node over a cosocket, its answer read and passed to the client: held until the first
-- content token (at most edge.stream_hold_s), spliced (infergate.stream.splice), and the
-- attempt closed with its verdict (infergate.routing.relaypick.close). The relay state
-- `r` records what happened: r.sent (headers out), r.finished (one finish_reason and
-- [DONE] sent), r.last_answer (a node's error answer, for a client that got nothing),
-- r.no_continue, r.client_gone.
--
-- Read timeouts: a stream's, as on the proxy path (edge.read_timeout_ms, at most the
-- deadline's stream idle time; the request deadline does not cut a stream, but while
-- nothing went to the client the node's head is not awaited past it: 504
-- deadline_exceeded, as for a request that is not a stream), shortened before content
-- as a probe's when another node is left (2 x outlier.probe_threshold, as the balancer);
-- after content, 2 x the node's stall threshold (a node silent that long is stalled: the
-- stream is continued elsewhere, unless the node answers a liveness check made since its
-- last byte: a long prefill, and the read goes on, still_alive), never past the idle time
-- after the last byte (each gap is cut there); while holding, at most until the hold ends
-- (then the held bytes go out); while the head is awaited with another node left, the
-- leg also gives up as soon as the node, found silent after the leg started, fails its
-- liveness check (outlier.gone_silent, asked every WATCH_S) or restarted since
-- (routing.restarts), as does the leg that got its head but no content yet (a head may
-- come before the prefill, as llama-server's does); once nginx shuts down, at most until
-- edge.shutdown_stream_s is up (core.closing.stream_left; the relay then ends the stream
-- with an error event). Connect and send timeouts: the deadline's for a leg before
-- content; a continuation starts after it as the stream goes on past it.
local ngxapi = require("infergate.core.ngxapi")
local deadline = require("infergate.admission.deadline")
local relaypick = require("infergate.routing.relaypick")
local stall = require("infergate.routing.stall")
local outlier = require("infergate.routing.outlier")
local restarts = require("infergate.routing.restarts")
local stats = require("infergate.routing.stats")
local liveness = require("infergate.routing.liveness")
local speed = require("infergate.routing.speed")
local sse = require("infergate.stream.sse")
local http = require("infergate.stream.http")
local splice = require("infergate.stream.splice")
local closing = require("infergate.core.closing")
local legheaders = require("infergate.stream.legheaders")
local answer = require("infergate.stream.answer")
local slothold = require("infergate.stream.slothold")
local trylog = require("infergate.stream.trylog")
local usage = require("infergate.admission.usage")
local capture = require("infergate.cache.capture")

local _M = {}

local ngx_now = ngxapi.now
local min = math.min
local ceil = math.ceil
local concat = table.concat
local log = ngx.log
local INFO = ngx.INFO
local WARN = ngx.WARN

-- Longest SSE event (bytes) read from a node.
_M.EVENT_MAX = 4 * 1024 * 1024

local write = answer.write
_M.write = write

-- Headers and the held pieces go out (the first content token, or the hold ended).
local function release(r, node)
    if not r.sent then
        r.sent = true
        legheaders.pass_headers(r.node_headers)
        ngx.status = 200
        ngx.header["Content-Type"] = r.content_type or "text/event-stream"
        ngx.header["Cache-Control"] = "no-cache"
        ngx.header["X-Infergate-Node"] = node.name
        if r.continued then
            ngx.header["X-Infergate-Continued"] = r.continued
        end
        ngx.send_headers()
    end
    local held = r.held
    r.held = nil
    if held and #held > 0 then
        write(r, concat(held))
    end
end

_M.WATCH_S = 0.5

-- A cosocket timeout of `s` seconds in whole milliseconds, at least 1 (0 would mean
-- lua_socket_read_timeout, 60 s by default).
local function ms(s)
    local v = ceil(s * 1000)
    return v >= 1 and v or 1
end
_M.ms = ms

-- Read timeout (s) of the next read: see the header (no_hold: the hold does not shorten
-- it, as for the answer's headers).
local function read_timeout(r, lg, now, no_hold)
    local o = r.o
    local read = o.edge.read_timeout_ms / 1000
    if r.req.stream then -- not a stream: bounded by the deadline (head_read)
        local idle = min(read, deadline.for_request(r.req).idle_s)
        local since = r.out.produced > 0 and (lg.last_byte or (lg.att and lg.att.started))
        read = since and min(idle, since + idle - now) or idle
    end
    if r.out.produced > 0 and o.edge.stall_gap_factor > 0 then -- (a check pending: WATCH_S)
        read = min(read, lg.pending_from and _M.WATCH_S or 2 * stall.threshold(lg.node.name, o))
    elseif lg.probe_read then
        read = min(read, lg.probe_read)
    end
    if not r.sent and lg.hold_until and not no_hold then
        read = min(read, lg.hold_until - now)
    end
    local left = r.sent and closing.stream_left(o, now) -- nginx shuts down
    read = left and left < read and left or read
    return read > 0.001 and read or 0.001
end

-- One event of the node: false to end the leg (lg.verdict set).
local function on_event(r, lg, text)
    local ev = sse.classify(text)
    local kind = ev.kind
    if kind == "error" then
        lg.verdict, lg.why = "fail", "in-band error"
        return false
    end
    if kind == "done" then
        if r.out.finish then
            release(r, lg.node)
            write(r, text)
            r.finished = true
            lg.verdict = "ok"
        else
            lg.verdict, lg.why = "fail", "[DONE] without a finish_reason"
        end
        return false
    end
    if ev.tools or ev.many then
        r.no_continue = true
    end
    if lg.echo then
        lg.echo = splice.strip_echo(ev, lg.echo)
    end
    local piece = splice.rewrite(r.out, ev, text, lg.first and 1 or 2)
    if piece then
        if r.sent then
            write(r, piece)
        else
            r.held[#r.held + 1] = piece
        end
    end
    if kind == "content" and not r.sent then
        release(r, lg.node)
    end
    return not r.client_gone
end

-- A stream silent past its stall bound after content goes on while its node answers a
-- liveness check made since its last byte (infergate.routing.liveness.mid_stream: a long
-- prefill of another request on the node, not a freeze) and was not restarted since it
-- was sent, for up to its own read bound; a check still under way gets PENDING_S. The
-- answer must be recent (RECHECK_S): one that answered and froze since is not waited on.
_M.PENDING_S = 2
_M.RECHECK_S = 3

local function still_alive(r, lg, now)
    local since = lg.last_byte or (lg.att and lg.att.started) or now
    local bound = min(r.o.edge.read_timeout_ms / 1000, deadline.for_request(r.req).idle_s)
    if now - since >= bound or (lg.att and restarts.sent_before(lg.node, lg.att)) then
        return false -- (a restarted node answers from a process without the stream)
    end
    local verdict = liveness.mid_stream(lg.node, since, r.o, math.max(since, now - _M.RECHECK_S))
    if verdict == "pending" then
        lg.pending_from = lg.pending_from or now
        return now - lg.pending_from < _M.PENDING_S
    end
    lg.pending_from = nil
    return verdict == "alive"
end

-- Before content with another node left (lg.probe_read), the end (epoch s) of the
-- silence the leg waits out (its read bound from the head or its last byte, renewed
-- while the node answers its liveness checks, up to still_alive's bound); its reads
-- then go in WATCH_S slices, as the head's, and give up as soon as the node is found
-- gone silent (llama-server sends a stream's head before its prefill: a node frozen
-- then is no longer waited on for the whole bound). nil otherwise.
local function watch_end(r, lg)
    if not lg.probe_read or r.out.produced > 0 then
        return nil
    end
    local since = lg.last_byte or lg.head_at
    local e = since + read_timeout(r, lg, since, true)
    return lg.alive_to and lg.alive_to > e and lg.alive_to or e
end

local function read_stream(r, lg, head, sock)
    local st = sse.new()
    lg.head_at = ngx_now()
    while true do
        local now = ngx_now()
        local left = r.sent and closing.stream_left(r.o, now)
        if left and left <= 0.001 then -- ends with an error event (infergate.stream.relay)
            lg.verdict, lg.why, r.shutdown = "neutral", "nginx shuts down", true
            return
        end
        local t = read_timeout(r, lg, now)
        local quiet_end = watch_end(r, lg)
        if quiet_end and t > _M.WATCH_S and quiet_end - now > _M.WATCH_S then
            t = _M.WATCH_S
        end
        sock:settimeout(ms(t))
        local data, err = http.read_body(head, sock)
        now = ngx_now()
        if not data and err == "timeout" and not r.sent and lg.hold_until
                and now >= lg.hold_until - 0.001 then
            release(r, lg.node) -- the hold ended: what was held goes out, the read goes on
            lg.hold_until = nil
        elseif not data and err == "timeout" and quiet_end and now < quiet_end - 0.002 then
            if outlier.gone_silent(lg.node, lg.att, now, r.o)
                    and relaypick.other_left(r.req, now) then
                lg.verdict, lg.why, lg.timeout = "fail", "silent, no answer to a liveness check", true
                return
            end
        elseif not data and err == "timeout" and quiet_end and still_alive(r, lg, now) then
            -- its bound before content is up, but the node answers its liveness checks: a
            -- long prefill, waited on (as nginx would) for another bound, still watched
            lg.alive_to = now + read_timeout(r, lg, now, true)
        elseif (not data or data == "") and r.out.finish then
            release(r, lg.node) -- finished, closed without [DONE]: the relay's own
            write(r, "data: [DONE]\n\n")
            r.finished, lg.verdict = true, "ok"
            return
        elseif not data and err == "timeout" and (left or (r.out.produced > 0
                and still_alive(r, lg, now))) then -- shutting down, or alive: goes on
            lg.silent_reads = (lg.silent_reads or 0) + 1 -- alive: the stream goes on
        elseif not data or data == "" then
            lg.verdict, lg.why = "fail", err or "closed before the end"
            lg.timeout = err == "timeout"
            return
        else
            lg.last_byte = now
            stall.byte(r.req, now)
            outlier.first_byte(r.req, now)
            for _, text in ipairs(sse.feed(st, data)) do
                if not on_event(r, lg, text) then
                    return
                end
            end
            if #st.buf > _M.EVENT_MAX then
                lg.verdict, lg.why = "fail", "an SSE event longer than " .. _M.EVENT_MAX .. " bytes"
                return
            end
        end
    end
end

local leg_headers = legheaders.request

-- How long (s) the leg waits for the node's head: its read timeout and, while nothing
-- has gone to the client, no longer than the request's deadline (which a stream's
-- reads are otherwise not bounded by: its head cannot come later and still be on time).
local function head_read(r, lg, now)
    local read = read_timeout(r, lg, now, true)
    local left = not r.sent and deadline.remaining(r.req, now)
    if left and left < read then
        lg.deadline_read = true
        return left > 0.001 and left or 0.001
    end
    return read
end

-- The head read's result; a timeout of a read the deadline bounded, at the deadline,
-- is the deadline's (r.deadline_passed: 504 deadline_exceeded, not the node's fault).
local function at_deadline(r, lg, head, err)
    if not head and err == "timeout" and lg.deadline_read then
        local left = deadline.remaining(r.req, ngx_now())
        if left and left <= deadline.RETRY_MIN_S then
            r.deadline_passed = true
        end
    end
    return head, err
end

-- Connects lg.sock to the node (a pooled connection for a request that is not a
-- stream, infergate.stream.answer.connect) and sends the request: true or nil, err.
local function send_request(r, lg, body)
    local o, req, node = r.o, r.req, lg.node
    local connect, send = o.edge.connect_timeout_ms / 1000, o.edge.send_timeout_ms / 1000
    if not r.sent then
        connect, send = deadline.timeouts(req, o, ngx_now())
        if not connect then
            r.deadline_passed = true
            return nil, "deadline"
        end
    end
    local sock = lg.sock
    sock:settimeouts(ms(connect), ms(send), ms(send))
    local ok, err
    if req.stream then
        ok, err = sock:connect(node.addr, node.port)
    else
        ok, err = answer.connect(r, sock, node)
    end
    if not ok then
        return nil, err
    end
    local path = r.path
    if r.args and r.args ~= "" then
        path = path .. "?" .. r.args
    end
    return http.request(sock, {
        path = path, host = node.host or node.addr,
        headers = leg_headers(r),
        body = body,
    })
end

-- Waits for the node's head on lg.sock: {status, headers, ...} or nil, err.
local function await_head(r, lg)
    local o, node, sock = r.o, lg.node, lg.sock
    local read = head_read(r, lg, ngx_now())
    if not lg.probe_read and not lg.watch then
        sock:settimeout(ms(read))
        return at_deadline(r, lg, http.read_head(sock))
    end
    -- another node is left: while the head does not come, every WATCH_S the node is
    -- checked (see the header); found gone, the leg gives up at once and the request is
    -- retried elsewhere. At the probe's read timeout it gives up only when a node is
    -- still left for the retry (relaypick.other_left); else it reads on for the whole
    -- read timeout of a leg that has no other node. A request that is not a stream
    -- (lg.watch) has no probe's read timeout unless its node is a probe: its head comes
    -- with its whole answer.
    local started = ngx_now()
    local give_up = started + read
    sock:settimeout(ms(min(_M.WATCH_S, read)))
    local head, err = http.read_head(sock, function(got)
        local now = ngx_now()
        if not got and (outlier.gone_silent(node, lg.att, now, o)
                or restarts.sent_before(node, lg.att)) and relaypick.other_left(r.req, now) then
            return false
        end
        if give_up - now < 0.002 then
            if not lg.probe_read or relaypick.other_left(r.req, now) then
                return false -- read on once at most (probe_read is cleared for it)
            end
            lg.probe_read = nil
            give_up = started + head_read(r, lg, started)
            if give_up - now < 0.002 then
                return false
            end
        end
        sock:settimeout(ms(min(_M.WATCH_S, give_up - now)))
        return true
    end)
    if head then -- the rest of the head and the body: the leg's own read timeout
        local now = ngx_now()
        sock:settimeout(ms(r.req.stream and read_timeout(r, lg, now, true)
            or head_read(r, lg, now)))
    end
    return at_deadline(r, lg, head, err)
end

-- Sends the request and waits for the head. A pooled connection the node closed while
-- it was idle (the send fails, or the head read finds it closed or reset at once) is
-- replaced by a new one and the request sent again, as nginx does for its cached
-- upstream connections (not counted as a try). A send the node cut (reset, broken pipe)
-- still has its answer read: a node may answer before reading a long body (a 413), as
-- nginx's proxy reads it while it sends.
local function start(r, lg, body)
    local t0 = ngx_now()
    local ok, err = send_request(r, lg, body)
    local reused = (lg.sock:getreusedtimes() or 0) > 0
    local head
    if ok or err == "connection reset by peer" or err == "broken pipe" then
        head, err = await_head(r, lg)
        reused = reused and (err == "closed" or err == "connection reset by peer")
            and ngx_now() - t0 < 1
    end
    if head or not reused then
        return head, err
    end
    lg.sock:close()
    lg.sock = ngx.socket.tcp()
    ok, err = send_request(r, lg, body)
    if not ok then
        return nil, err
    end
    return await_head(r, lg)
end

-- The verdict on the attempt, as the balancer's (infergate.routing.tries): a 500 is held
-- until another node answers (then it was the node's fault) or answers 500 as well (then
-- neither counts: the request's own fault; that 500 is passed on, no further try).
local function settle(r, lg, att)
    local now = ngx_now()
    if lg.verdict == "fail" and lg.why == "status 500" then
        local prev = r.held500
        if not prev then
            r.held500 = att
            return relaypick.hold(att, now)
        end
        r.held500 = nil
        relaypick.close(prev, "neutral", now)
        relaypick.close(att, "neutral", now)
        lg.final = true
        return
    end
    if r.held500 and lg.verdict == "ok" then
        relaypick.close(r.held500, "fail", now) -- another node answered: the 500 was its node's
        r.held500 = nil
    end
    local latency_ms = (lg.verdict == "ok") and (now - att.started) * 1000 or nil
    local tokens
    if latency_ms and (r.finished or lg.final) and not r.continued then
        r.latency_s = latency_ms / 1000 -- one node's whole answer (admission.shed learns it)
        local out = r.out -- the usage is parsed at the client's eof
        tokens = usage.completion_tokens(r.req) or out and out.produced > 0 and out.produced or nil
    end
    relaypick.close(att, lg.verdict or "fail", now, latency_ms, tokens)
end

-- Runs one leg on `node` (attempt `att`, `eligible` nodes incl. this one).
function _M.run(r, node, att, body, eligible)
    local o, now = r.o, ngx_now()
    local lg = { node = node, att = att, first = not r.sent, echo = r.echo }
    r.echo = nil
    if lg.first then
        r.out = splice.new_out()
        r.held = {}
        lg.hold_until = o.edge.stream_hold_s > 0 and r.req.stream
            and now + o.edge.stream_hold_s or nil
    end
    lg.watch = not r.req.stream -- relayed only while another node may take it (relay.wanted)
    if eligible and eligible > 1 then
        -- the balancer's bound (infergate.routing.balancer, deadline.probe_read): never
        -- less than twice the predicted completion on the node (queued on a node that
        -- slowed down is not stalled)
        local thr = outlier.probe_threshold(node.name, r.req.stream, o)
        local e = thr and speed.expected_s(node)
        if e and e > thr then
            thr = e
        end
        lg.probe_read = thr and 2 * thr
    end
    trylog.start(r, node)
    -- a llama.cpp server (it answered /props) goes on with an answer that is not a
    -- stream after its connection closes: when the client leaves, the leg reads it to
    -- its end, so that the node's slot counts as taken for as long as it is (past the
    -- deadline: infergate.stream.slothold)
    r.read_on = not r.req.stream and node.slots_source == "server"
    lg.sock = ngx.socket.tcp()
    local head, err = start(r, lg, body)
    local sock = lg.sock
    if not head then
        lg.verdict, lg.why = r.deadline_passed and "neutral" or "fail", err
        lg.timeout = err == "timeout"
        if r.read_on and r.deadline_passed and lg.timeout then
            slothold.hold(r, node, att) -- it works on past the deadline
        end
    elseif head.status ~= 200
            or not (head.headers["content-type"] or ""):find("event-stream", 1, true) then
        answer.read(r, lg, head, sock) -- an error, or an answer that is not a stream
        if r.client_gone then -- read on for the slot: still charged, and stored
            usage.note_answer(r.req, r.last_answer)
            capture.note_answer(r.req, r.last_answer)
        end
    else
        stats.probe_answered(att)
        r.content_type = head.headers["content-type"]
        if lg.first then
            r.node_headers = head.list
        end
        if lg.first and not lg.hold_until then
            release(r, node) -- no holding: the headers go out as the proxy sends them
        end
        read_stream(r, lg, head, sock)
    end
    answer.keep(r, lg, head, sock)
    r.read_on = nil
    trylog.done(r, head, lg.timeout, ngx_now() - now)
    if r.client_gone then
        return -- the log phase closes the attempt (aborted)
    end
    if lg.verdict ~= "ok" and lg.verdict ~= "unserved" then
        r.last_failure = { node = node.name, timeout = lg.timeout, last_byte = lg.last_byte,
                           invalid = http.INVALID[lg.why or ""] }
        r.whys[#r.whys + 1] = node.name .. " " .. (lg.why or "?")
    end
    settle(r, lg, att)
    if lg.final and r.sent then
        r.no_continue = true -- a continuation refused (4xx): no other node would take it
    elseif lg.final then
        r.finished = true
        answer.send(r, r.last_answer, node.name)
    end
    if lg.verdict ~= "ok" then -- a failure as nginx's proxy logs its own (a warning here)
        log(lg.verdict == "fail" and WARN or INFO, "infergate: relayed request ", r.req.id or "",
            " on node ", node.name, " ended: ", lg.timeout and "upstream timed out" or lg.why or "?",
            r.out.produced > 0 and " after content" or " before content")
    end
end

return _M
