-- Group commit of semantic lookups within a worker (no timer, no extra coroutine).
--
--   local batch = require("infergate.cache.batch")
--   local result, err = batch.submit(item, budget_s, send[, req])
--
-- A lookup goes out at once, alone, while fewer than MAX_FLIGHTS calls of this worker
-- are in flight, so a lone request never waits. Otherwise it waits in the worker's
-- queue; when a call ends, the queued lookups (the oldest MAX_BATCH of them) go out
-- together in the next call, sent by the newest of them (the one with the most budget
-- left), and the others are woken with their results. Under a burst the embedder thus
-- gets a few calls of many texts (one model call, one HTTP exchange and one Redis
-- pipeline each) instead of one call per request.
--
-- send(items) -> results, err: one call for the list of items; results[i] is the
-- answer for items[i], or results is nil and err says why the whole call failed. send
-- runs protected: an error it raises fails that call's lookups only.
--
-- submit returns the lookup's result; or nil and the call's err ("no answer for this
-- lookup" when send gave none for it); or nil, "timeout" when budget_s (s) passed while
-- it waited for its call to start or to end (a lookup whose call ends later is answered
-- by no one: its result is dropped). A waiting lookup whose budget left is shorter than
-- a call takes (this worker's moving average) gives up when the next call is made up,
-- unsent ("timeout" too): it would be answered too late, and the embedder's time goes to
-- lookups that can still use it. The sender of a call had at least one call's time left
-- when it was chosen, and waits for the call itself even past its own budget (bounded by
-- the lookup location's timeouts: the others of the call wait for it).
--
-- A client that leaves ends its request at once (lua_check_client_abort), the lookup's
-- coroutine with it. With `req` (the request's state), its lookup then leaves the queue
-- (infergate.core.abort): a sender's call stops counting against MAX_FLIGHTS and the
-- others of its call are answered "sender left" at once; a waiting one is never handed
-- a call. Without that, two calls whose senders were gone kept every later lookup of the
-- worker waiting past its budget (BYPASS) until STALE_FLIGHT_S.
local semaphore = require("ngx.semaphore")
local abort = require("infergate.core.abort")

local _M = {}

local pcall = pcall
local now = ngx.now
local update_time = ngx.update_time

-- Calls of one worker in flight at once (the embedder runs one per process and more
-- queue there), and most lookups in one call (the embedder's /v1/lookups takes 64).
_M.MAX_FLIGHTS = 2
_M.MAX_BATCH = 32
-- A call in flight for longer than its own bound no longer counts against MAX_FLIGHTS:
-- its sender never came back. A client that leaves ends its request at once
-- (lua_check_client_abort), its sender's coroutine with it, mid-call or before it could
-- send the call it was handed; two such calls would otherwise keep every later lookup
-- of the worker waiting past its budget. The bound: STALE_FACTOR x the call's budget (the
-- lookup location's connect, send and read timeouts are each at most the budget, see
-- infergate.cache.embedder) plus STALE_SLACK_S, at most STALE_FLIGHT_S.
_M.STALE_FACTOR = 3
_M.STALE_SLACK_S = 1
_M.STALE_FLIGHT_S = 30
-- Weight of the latest call in the moving average of call durations.
_M.CALL_EWMA = 0.3

local queue = {}      -- waiting entries, oldest first
local flights = {}    -- call token -> start time
local nflights = 0
-- how long a call takes (s, moving average of this worker's calls; nil before the first)
local call_s = nil

-- A call starts (its budget `budget_s`, s): counted against MAX_FLIGHTS until fly()
-- ends it or its bound passes (see STALE_FACTOR); returns its token.
local function start_flight(budget_s)
    local token = {}
    local bound = _M.STALE_FACTOR * budget_s + _M.STALE_SLACK_S
    flights[token] = now() + (bound < _M.STALE_FLIGHT_S and bound or _M.STALE_FLIGHT_S)
    nflights = nflights + 1
    return token
end

local function live_flights()
    if nflights < _M.MAX_FLIGHTS then
        return nflights
    end
    local t = now()
    for token, ends in pairs(flights) do
        if t > ends then
            flights[token] = nil
            nflights = nflights - 1
        end
    end
    return nflights
end

-- Hands the next call to the newest of the oldest MAX_BATCH waiting entries, while
-- calls may start.
local function release()
    while #queue > 0 and live_flights() < _M.MAX_FLIGHTS do
        local batch, rest = {}, {}
        local t = now()
        for _, e in ipairs(queue) do
            if e.state == "queued" and (e.deadline <= t or call_s and e.deadline - t < call_s) then
                -- its answer would come after its budget: it gives up now, unsent (one
                -- past its budget and still queued is gone: its client left, which ended
                -- its request; it must not be handed a call it would never send)
                e.state = "expired"
                e.sema:post(1)
            elseif e.state == "queued" then
                if #batch < _M.MAX_BATCH then
                    batch[#batch + 1] = e
                else
                    rest[#rest + 1] = e
                end
            end
        end
        queue = rest
        if #batch == 0 then
            return
        end
        local lead = batch[#batch]
        local token = start_flight(lead.budget)
        for _, e in ipairs(batch) do
            e.state = "sent"
        end
        lead.state, lead.batch, lead.token = "lead", batch, token
        lead.sema:post(1)
    end
end

-- Sends `batch` (entries) as one call; returns the result of `me`.
local function fly(batch, token, send, me)
    local items = {}
    for i, e in ipairs(batch) do
        items[i] = e.item
    end
    update_time()
    local started = now()
    local ok, results, err = pcall(send, items)
    update_time()
    local took = now() - started
    call_s = call_s and call_s + _M.CALL_EWMA * (took - call_s) or took
    if not ok then
        results, err = nil, "lookup call failed: " .. tostring(results)
    elseif results == nil and err == nil then
        err = "no answer"
    end
    if flights[token] then
        flights[token] = nil
        nflights = nflights - 1
    end
    local mine, mine_err
    for i, e in ipairs(batch) do
        local r = results and results[i]
        local rerr = err
        if r == nil and rerr == nil then
            rerr = "no answer for this lookup"
        end
        if e == me then
            mine, mine_err = r, rerr
        elseif e.state == "sent" then
            e.state, e.result, e.err = "done", r, rerr
            e.sema:post(1)
        end
    end
    release()
    return mine, mine_err
end

-- The client of entry `e` left (its request ends now): see the header.
local function left(e)
    local state = e.state
    e.state = "gone"
    if state == "lead" and e.token then
        if flights[e.token] then
            flights[e.token] = nil
            nflights = nflights - 1
        end
        for _, o in ipairs(e.batch or {}) do
            if o ~= e and o.state == "sent" then
                o.state, o.err = "done", "sender left"
                o.sema:post(1)
            end
        end
    end
    release()
end

local function wait_turn(e, send)
    while true do
        if e.state == "lead" then
            -- chosen to send: it sends even when its own time runs out (see the header)
            return fly(e.batch, e.token, send, e)
        elseif e.state == "done" then
            return e.result, e.err
        elseif e.state == "expired" then
            return nil, "timeout"
        end
        local left_s = e.deadline - now()
        local posted = left_s > 0 and e.sema:wait(left_s)
        update_time()
        if not posted and (e.state == "queued" or e.state == "sent") and now() >= e.deadline then
            -- still queued (release skips it) or sent (its result will be dropped)
            e.state = "gone"
            return nil, "timeout"
        end
    end
end

--- One lookup: `item` (what send gets for it), `budget_s` (s) the longest it may wait
-- before its call starts or while a call it is in runs (see the header); `req`: the
-- request's state, for its client leaving (optional).
function _M.submit(item, budget_s, send, req)
    local e
    if #queue == 0 and live_flights() < _M.MAX_FLIGHTS then
        e = { item = item, state = "lead" }
        e.batch, e.token = { e }, start_flight(budget_s)
    else
        update_time()
        e = { item = item, state = "queued", sema = semaphore.new(0),
              deadline = now() + budget_s, budget = budget_s }
        queue[#queue + 1] = e
    end
    local id = req and abort.watch(req, function() left(e) end)
    local result, err
    if e.state == "lead" then
        result, err = fly(e.batch, e.token, send, e)
    else
        -- the queue may hold only lookups that gave up while a call could start
        release()
        result, err = wait_turn(e, send)
    end
    if id then
        abort.unwatch(req, id)
    end
    return result, err
end

return _M
