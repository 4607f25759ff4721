-- The node the admission step picked for a request's first try, and the slot it holds
-- there (infergate.admission.slots): req.picked = {name, probe = bool, claimed = bool,
-- used = bool}. The balancer takes it (take) instead of picking again; the log phase
-- gives back what was never used (give_back). No I/O.
local config = require("infergate.core.config")
local stats = require("infergate.routing.stats")
local breaker = require("infergate.routing.breaker")

local _M = {}

-- Whether known slots are a hard limit: with load shedding on (the requests beyond wait
-- in the admission step); off, every request goes to a node as before.
function _M.enforced()
    return config.get().admission.shed == true
end

-- Gives back what req.picked holds (its slot, its half-open probe) when the balancer
-- never used it; once.
function _M.give_back(req)
    local picked = req.picked
    if not picked or picked.used then
        return
    end
    picked.used = true
    if picked.claimed then
        stats.release({ node = picked.name })
    end
    if picked.probe then
        breaker.neutral(picked.name, true)
    end
end

-- The picked node for the first try while it is still usable(node, tried, model):
-- node, probe, eligible count (count(t, tried, now, model), the probe included),
-- claimed. Otherwise what it held is given back and nil returned.
function _M.take(req, t, now, usable, count)
    local picked = req.picked
    local node = t.by_name[picked.name]
    if node and usable(node, req.tried, req.model) then
        picked.used = true
        local eligible = count(t, req.tried, now, req.model)
        if picked.probe then
            eligible = eligible + 1
        end
        return node, picked.probe, eligible, picked.claimed
    end
    _M.give_back(req)
    return nil
end

return _M
