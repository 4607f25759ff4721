-- header_filter_by_lua: names the node that served a proxied response.
local reqctx = require("infergate.reqctx")

local _M = {}

_M.NODE_HEADER = "X-Infergate-Node"

function _M.run()
    local req = reqctx.get()
    if not req then
        return
    end
    local attempts = req.attempts
    local last = attempts[#attempts]
    if last and ngx.var.upstream_status then
        ngx.header[_M.NODE_HEADER] = last.node
    end
end

return _M
