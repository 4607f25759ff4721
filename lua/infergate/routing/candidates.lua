-- The candidates of a pick (infergate.routing.balancer): which nodes may take a request
-- (eligibility, the half-open probe, outliers left out while others remain, the
-- slow-start ramp). Pure: no I/O, only the node table and shared-dict reads.
local breaker = require("infergate.routing.breaker")
local outlier = require("infergate.routing.outlier")
local models = require("infergate.routing.models")

local _M = {}

local random = math.random
local ipairs = ipairs

local function usable(node, tried, model)
    return node.addr and node.healthy and node.state == "active" and not tried[node.name]
        and models.serves(node, model)
end
_M.usable = usable

-- Number of eligible nodes (including one ready for its half-open probe) for `model`
-- (nil: any). When every usable node's breaker is open, those that may take an early
-- probe (breaker.allow, alone) count.
function _M.count_eligible(t, tried, now, model)
    tried = tried or {}
    local n, open = 0, false
    for _, node in ipairs(t.nodes) do
        if usable(node, tried, model) then
            if breaker.allow(node.name, now) then
                n = n + 1
            else
                open = true
            end
        end
    end
    if n == 0 and open then
        for _, node in ipairs(t.nodes) do
            if usable(node, tried, model) and breaker.allow(node.name, now, true) then
                n = n + 1
            end
        end
    end
    return n
end

-- The node whose early probe (breaker.allow, alone) this request takes, when every
-- usable node's breaker is open; nil when none may probe yet.
local function alone_probe(t, tried, now, model, o)
    for _, node in ipairs(t.nodes) do
        if usable(node, tried, model) and breaker.allow(node.name, now, true) == "probe"
                and not outlier.probe_held(node, now, o) and breaker.take_probe(node.name) then
            return node
        end
    end
end

-- Slow start (effective_weight below weight, after an undrain or a return): the node
-- takes part in a pick with probability effective_weight / weight, so its share of
-- traffic ramps whatever the cost says (an idle node returning from a drain is the
-- cheapest and would otherwise take a full share at once). True: leave it out this time.
local function ramp_skips(node)
    local w, ew = node.weight, node.effective_weight
    return w and ew and ew < w and random() * w >= ew
end
_M.ramp_skips = ramp_skips

local function append(list, cands, n, total)
    for _, node in ipairs(list) do
        n = n + 1
        cands[n] = node
        total = total + node.weight
    end
    return n, total
end

-- The candidates of a pick: cands[1..n] (sum of weight: total), a node whose
-- half-open probe this request takes (then nothing else), and how many nodes are
-- eligible in all (those the slow-start ramp left out this time included).
function _M.gather(t, tried, now, retry, model, o)
    local cands, n, total = {}, 0, 0
    local probes, outliers, ramping, open = nil, nil, nil, false
    for _, node in ipairs(t.nodes) do
        if usable(node, tried, model) then
            local allow = breaker.allow(node.name, now)
            open = open or not allow
            if allow == "yes" and outlier.is_outlier(node, now, o) then
                outliers = outliers or {}
                outliers[#outliers + 1] = node
            elseif allow == "yes" and ramp_skips(node) then
                ramping = ramping or {}
                ramping[#ramping + 1] = node
            elseif allow == "yes" then
                n = n + 1
                cands[n] = node
                total = total + node.weight
            elseif allow == "probe" and not retry and not outlier.probe_held(node, now, o) then
                -- (a node found silent answers its liveness check before the breaker's
                -- probe goes, as before a half-open probe of the outlier rule)
                probes = probes or {}
                probes[#probes + 1] = node
            end
        end
    end
    local skipped = ramping and #ramping or 0
    if probes then
        for _, node in ipairs(probes) do
            if breaker.take_probe(node.name) then
                return cands, n, total, node, n + skipped + 1
            end
        end
    end
    if n == 0 and ramping then
        -- only nodes in slow start: the ramp never leaves a request without a node
        n, total = append(ramping, cands, n, total)
        skipped = 0
    end
    if n == 0 and outliers then
        -- every eligible node is an outlier: never nothing, pick among them
        n, total = append(outliers, cands, n, total)
    end
    if n == 0 and open and not retry then
        -- every usable node's breaker is open (or probing): an early probe, not a 503
        local node = alone_probe(t, tried, now, model, o)
        if node then
            return cands, 0, 0, node, 1
        end
    end
    return cands, n, total, nil, n + skipped
end

return _M
