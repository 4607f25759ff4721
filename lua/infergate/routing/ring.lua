-- The last few values of a quantity per key, kept by one worker, and their 90th
-- percentile: the TTFB of a node's answers (infergate.routing.outlier), the largest gap
-- between the chunks of its streams (infergate.routing.stall).
--
--   local ring = require("infergate.routing.ring")
--   local p = ring.push(rings, key, value, samples)   -- the new p90, or nil if unchanged
local _M = {}

local ceil = math.ceil
local huge = math.huge
local sort = table.sort

-- The ceil(0.9 n)-th smallest of r[1..n]: the largest value with at least 90 % of the
-- values at or below it. Found among the m largest (m is at most 3 for 20 values), with
-- no sort and no table per call; more values than that: a sorted copy. `size` (>= n,
-- values >= 0): the p90 of `size` values, those missing counted as 0 (a prior: a few
-- large values of a ring just begun do not make its p90 at once).
function _M.p90_of(r, n, size)
    size = size or n
    local m = size - ceil(0.9 * size) + 1
    if m > n then
        return 0
    end
    local a, b, c = -huge, -huge, -huge   -- the largest three, a >= b >= c
    for k = 1, n do
        local v = r[k]
        if v > a then
            a, b, c = v, a, b
        elseif v > b then
            b, c = v, b
        elseif v > c then
            c = v
        end
    end
    if m <= 1 then
        return a
    elseif m == 2 then
        return b
    elseif m == 3 then
        return c
    end
    local vals = {}
    for k = 1, n do
        vals[k] = r[k]
    end
    sort(vals)
    return vals[n - m + 1]
end

-- Adds `value` to the ring rings[key] of at most `samples` values (made on first use).
-- Returns the ring's p90 when it changed, else nil. prior: the p90 counts the values
-- not seen yet as 0 (p90_of's `size`).
function _M.push(rings, key, value, samples, prior)
    local r = rings[key]
    if not r then
        r = { n = 0, i = 1, last = nil }
        rings[key] = r
    end
    r[r.i] = value
    r.i = r.i % samples + 1
    if r.n < samples then
        r.n = r.n + 1
    end
    local p = _M.p90_of(r, r.n, prior and samples or nil)
    if p ~= r.last then
        r.last = p
        return p
    end
    return nil
end

return _M
