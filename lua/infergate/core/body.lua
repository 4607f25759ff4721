-- The request body as one string, whether nginx kept it in memory or spilled it to a
-- temp file (the rendered config keeps every accepted body in memory; the file is only
-- read for hand-written configs with a smaller client_body_buffer_size).
--
--   local body = require("infergate.core.body")
--   local text, err = body.text()   -- after ngx.req.read_body()
--
-- Returns the body, nil when there is none, or nil, err when the temp file cannot be
-- read (blocking disk I/O, a fallback only).
local _M = {}

local io_open = io.open
local tostring = tostring

function _M.text()
    local data = ngx.req.get_body_data()
    if data then
        return data
    end
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "cannot read the buffered request body: " .. tostring(err)
    end
    data = f:read("*a")
    f:close()
    return data
end

return _M
