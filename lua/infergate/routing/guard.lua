-- Guard rails shared by the learned estimates of the scheduler (pure arithmetic, no
-- I/O, no state): a learned value returns to its prior while nothing observes it, stays
-- within bounds known from configuration, and gives way at once when reality keeps
-- coming in far below it.
--
--   decay(value, prior, idle_s, stale_s, half_life_s)
--       value while idle_s <= stale_s, then halfway back to prior every half_life_s
--   weight(idle_s, stale_s, half_life_s)
--       the weight a learned value keeps against its prior after idle_s (1 .. 0)
--   clamp(v, lo, hi)
--   yield(q, x, run, run_max, factor, need)
--       a run of answers x far below the estimate q (x x factor < q): after `need` of
--       them in a row, q becomes the largest of the run (the largest of 8 answers is
--       about their 0.89 quantile, so a high-quantile estimate lands where the answers
--       now are); any other answer ends the run. Returns q, run, run_max.
local _M = {}

function _M.weight(idle_s, stale_s, half_life_s)
    if not idle_s or idle_s <= stale_s then
        return 1
    end
    return 0.5 ^ ((idle_s - stale_s) / half_life_s)
end

function _M.decay(value, prior, idle_s, stale_s, half_life_s)
    return prior + (value - prior) * _M.weight(idle_s, stale_s, half_life_s)
end

function _M.clamp(v, lo, hi)
    if lo and v < lo then
        v = lo
    end
    if hi and v > hi then
        v = hi
    end
    return v
end

function _M.yield(q, x, run, run_max, factor, need)
    if x * factor >= q then
        return q, 0, 0
    end
    run = run + 1
    if x > run_max then
        run_max = x
    end
    if run >= need then
        return run_max, 0, 0
    end
    return q, run, run_max
end

return _M
