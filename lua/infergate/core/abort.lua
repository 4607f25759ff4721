-- What runs when the client leaves (lua_check_client_abort): ngx_lua takes one
-- ngx.on_abort handler per request, so the steps that must notice a client that leaves
-- (a request waiting at the edge for a slot, infergate.admission.shed; a stream the edge
-- relays, infergate.stream.relay) add a function here; the handler runs them, latest
-- first, then ends the request with 499 (the light thread it runs in kills the rest).
-- State: req.abort_fns (false for a function taken back).
local _M = {}

local pcall = pcall
local log = ngx.log
local WARN = ngx.WARN

-- What a function returns to keep the request running after its client left (it ends
-- it itself later: a relayed answer read to its end, infergate.stream.relay).
_M.STAY = "stay"

-- Adds fn() to what runs when the client of `req` leaves; returns its id for unwatch(),
-- or nil, err when ngx.on_abort is refused (lua_check_client_abort off: the client's
-- leaving is then seen only at the next write).
function _M.watch(req, fn)
    local list = req.abort_fns
    if not list then
        list = {}
        local ok, err = ngx.on_abort(function()
            local stay = false
            for i = #list, 1, -1 do
                local f = list[i]
                if f then
                    local fine, e = pcall(f)
                    if not fine then
                        log(WARN, "infergate: on client abort: ", e)
                    elseif e == _M.STAY then
                        stay = true
                    end
                end
            end
            if not stay then
                return ngx.exit(499)
            end
        end)
        if not ok then
            return nil, err
        end
        req.abort_fns = list
    end
    list[#list + 1] = fn
    return #list
end

-- Takes back the function of `id` (nil: nothing to take back).
function _M.unwatch(req, id)
    if id and req.abort_fns then
        req.abort_fns[id] = false
    end
end

return _M
