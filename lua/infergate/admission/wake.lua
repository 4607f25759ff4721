-- Waking the requests at the head of the edge queue (infergate.admission.shed,
-- wait_for_slot) the moment a slot frees in this worker, instead of at their next poll.
--
-- A request that waits for a slot looks again every admission.poll_ms (20 ms): a slot
-- that frees stays idle until then, where an engine's own queue (llama-server, vLLM)
-- starts its next request in the same step. Over capacity every slot turnover pays that
-- gap. The requests near the head of the queue (at most NEAR more of them than free
-- slots before them) sleep here instead, on one semaphore per worker (ngx.semaphore),
-- and released() (infergate.routing.stats.release: an attempt's in-flight count down)
-- wakes all of them; each then looks as after a poll. The others, and every request of
-- another worker (a semaphore wakes only its own worker's requests), poll as before.
-- Only the near ones: waking hundreds of waiting requests at every release would cost
-- more than the gap. released() posts exactly as many resources as there are sleepers
-- (count() is minus their number), so none is left over to cut a later sleep short.
-- No I/O; released() never yields and may run in any phase (the log and balancer
-- phases included: ngx.semaphore's post only queues the wake-up).
local semaphore = require("ngx.semaphore")

local _M = {}

_M.NEAR = 4

local sema   -- this worker's, made at its first use

-- Sleeps up to `s` seconds (> 0), less when a slot frees in this worker meanwhile.
-- Falls back on ngx.sleep when no semaphore can be made.
function _M.sleep(s)
    if not sema then
        local made, err = semaphore.new(0)
        if not made then
            ngx.log(ngx.ERR, "infergate: semaphore of the slot queue: ", err)
            return ngx.sleep(s)
        end
        sema = made
    end
    local ok, err = sema:wait(s)
    if not ok and err ~= "timeout" then
        ngx.log(ngx.ERR, "infergate: wait on the slot queue's semaphore: ", err)
        ngx.sleep(s)
    end
end

-- A slot freed in this worker: every request sleeping in sleep() wakes.
function _M.released()
    local sem = sema
    if sem then
        local c = sem:count()
        if c < 0 then
            sem:post(-c)
        end
    end
end

return _M
