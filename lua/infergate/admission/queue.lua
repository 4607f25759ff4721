-- The edge's queue: requests waiting for a slot (infergate.admission.slots), first come
-- first served per pool (the request's model; "" without one), shared by all workers in
-- the shared dict infergate_stats. No timer: every waiting request polls it.
--
-- A request that must wait takes a ticket (1, 2, ...: "qn:<pool>" counts them); the
-- head "qh:<pool>" is the oldest ticket still waiting, and ahead(t) = t - head the
-- requests before ticket t. A ticket leaves (admitted, shed, shutting down) by marking
-- itself done; whoever sees the head done moves the head on, once per ticket (an atomic
-- add of "q:<pool>:x<t>" decides). A waiting request refreshes its "alive" key every
-- poll (TTL alive_ttl_s): a ticket whose worker died is no longer alive and is passed
-- over ALIVE_GRACE_S after it was first seen so, so the queue never sticks (a run of
-- such tickets after one grace: a flood that filled the dict may have evicted the marks
-- of thousands). "qc:<pool>" counts the tickets still waiting (a ticket that left behind
-- a waiting head is not waiting any more, though the head has not passed it yet). A
-- ticket's marks are deleted when the head passes it, except the 2 s once-only mark, so
-- the keys held stay about the queue's length, however many requests went through.
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")

local _M = {}

local shared = ngx.shared
local ngx_now = ngxapi.now

_M.ALIVE_GRACE_S = 1
local DONE_TTL_S = 120        -- a ticket's "done" mark, until the head passes it
local PASSED_TTL_S = 2        -- the once-only mark of a ticket the head passed
local ADVANCE_MAX = 64        -- tickets passed over per call at most

local keys = {}

local function dict()
    return shared[config.DICT_STATS]
end

local function keys_of(pool)
    local k = keys[pool]
    if not k then
        local pre = "q:" .. pool .. ":"
        k = { n = "qn:" .. pool, h = "qh:" .. pool, c = "qc:" .. pool, pre = pre }
        keys[pool] = k
    end
    return k
end

-- TTL (s) of a waiting request's alive key: a few polls.
function _M.alive_ttl_s(poll_s)
    return 2 + 3 * poll_s
end

-- Whether no request waits in `pool`.
function _M.empty(pool)
    local d, k = dict(), keys_of(pool)
    return (d:get(k.h) or 1) > (d:get(k.n) or 0)
end

-- Marks ticket t seen neither alive nor done at `at` (kept when it has a mark already).
local function mark(d, k, t, at)
    if t <= (d:get(k.n) or 0) and not d:get(k.pre .. "a" .. t) and not d:get(k.pre .. "d" .. t) then
        d:add(k.pre .. "m" .. t, at, DONE_TTL_S)
    end
end

-- Whether ticket h is gone without leaving (its worker died, or its marks were evicted
-- from a full dict): not alive, first seen so ALIVE_GRACE_S ago. The first look at a
-- ticket seen so also marks the next ADVANCE_MAX tickets that are neither alive nor
-- done, and each ticket passed so marks the one ADVANCE_MAX + 1 further with its own
-- time: a run of such tickets is passed after one grace, not one grace each.
local function lost(d, k, h, now)
    if d:get(k.pre .. "a" .. h) then
        return false
    end
    local seen = d:get(k.pre .. "m" .. h)
    if not seen then
        d:set(k.pre .. "m" .. h, now, DONE_TTL_S)
        for t = h + 1, h + ADVANCE_MAX do
            mark(d, k, t, now)
        end
        return false
    end
    if now - seen >= _M.ALIVE_GRACE_S then
        mark(d, k, h + ADVANCE_MAX + 1, seen)
        return true
    end
    return false
end

-- Ticket t stops counting as waiting (once, however often it is called; the count never
-- goes below 0). A ticket the head passed was uncounted before (it had left, or was
-- lost), and its once-only mark is gone: nothing to do.
local function uncount(d, k, t)
    if t < (d:get(k.h) or 1) then
        return
    end
    if d:add(k.pre .. "l" .. t, true, DONE_TTL_S) then
        local c = d:incr(k.c, -1, 1)
        if c and c < 0 then
            d:incr(k.c, -c)
        end
    end
end

-- Moves the head past the tickets that left; returns the head.
local function advance(d, k, now)
    for _ = 1, ADVANCE_MAX do
        local h = d:get(k.h) or 1
        if h > (d:get(k.n) or 0) then
            return h
        end
        if not d:get(k.pre .. "d" .. h) then
            if not lost(d, k, h, now) then
                return h
            end
            uncount(d, k, h)
        end
        if d:add(k.pre .. "x" .. h, true, PASSED_TTL_S) then
            d:incr(k.h, 1, 1)
            d:delete(k.pre .. "d" .. h)
            d:delete(k.pre .. "m" .. h)
            d:delete(k.pre .. "l" .. h)   -- passed: only the short "x" mark is left
        end
    end
    return d:get(k.h) or 1
end

-- A ticket at the end of `pool`'s queue.
function _M.join(pool, poll_s)
    local d, k = dict(), keys_of(pool)
    d:add(k.h, 1)
    local t = d:incr(k.n, 1, 0)
    d:set(k.pre .. "a" .. t, true, _M.alive_ttl_s(poll_s))
    d:incr(k.c, 1, 0)
    return t
end

-- Ticket t still waits (every poll).
function _M.alive(pool, t, poll_s)
    dict():set(keys_of(pool).pre .. "a" .. t, true, _M.alive_ttl_s(poll_s))
end

-- The requests before ticket t in `pool` (0: it is the head), at most: the tickets
-- between the head and t, of which those that left behind a waiting head (shed, gone)
-- still count, and the tickets still waiting other than t (exact for the newest
-- ticket): the smaller. Counting the tickets that left would make a run of 429s look
-- like a long queue, and shed the requests after them in turn.
function _M.ahead(pool, t, now)
    local d, k = dict(), keys_of(pool)
    local h = advance(d, k, now or ngx_now())
    local a = t - h
    local others = (d:get(k.c) or 0) - 1
    if others < a then
        a = others
    end
    return a > 0 and a or 0
end

-- Ticket t leaves the queue (admitted or not).
function _M.leave(pool, t, now)
    local d, k = dict(), keys_of(pool)
    d:set(k.pre .. "d" .. t, true, DONE_TTL_S)
    d:delete(k.pre .. "a" .. t)
    uncount(d, k, t)
    advance(d, k, now or ngx_now())
end

-- Requests waiting in `pool`: the tickets that have not left, at most those the head
-- has not passed.
function _M.length(pool)
    local d, k = dict(), keys_of(pool)
    local n = (d:get(k.n) or 0) - (d:get(k.h) or 1) + 1
    local c = d:get(k.c) or 0
    if c < n then
        n = c
    end
    return n > 0 and n or 0
end

return _M
