-- The access log's record of the tries of a request the edge relays itself
-- (infergate.stream.leg): nginx's $upstream_addr, $upstream_status and
-- $upstream_response_time stay empty then, so each leg notes its node's address when it
-- starts, and the status it got and its time when it ends, in $infergate_relay_addr,
-- $infergate_relay_status and $infergate_relay_time ("a, b" lists, as nginx writes its
-- own). The rendered http part maps them into $infergate_upstream_addr,
-- $infergate_upstream_status and $infergate_upstream_response_time, nginx's own
-- variables when the request was proxied.
local _M = {}

local concat = table.concat
local format = string.format

local function assign(name, value)
    ngx.var[name] = value
end

local function set(name, list)
    pcall(assign, name, concat(list, ", "))
end

local function add(r, field, value)
    local list = r[field] or {}
    r[field] = list
    list[#list + 1] = value
    return list
end

-- A leg starts on `node`.
function _M.start(r, node)
    set("infergate_relay_addr", add(r, "addrs", node.addr .. ":" .. node.port))
end

-- The leg ended: `head` is the node's answer head (nil when none came: 504 after a
-- timeout, else 502, as nginx logs a try without an answer), `secs` its duration.
function _M.done(r, head, timeout, secs)
    local status = head and head.status or (timeout and 504 or 502)
    set("infergate_relay_status", add(r, "try_statuses", tostring(status)))
    set("infergate_relay_time", add(r, "try_times", format("%.3f", secs)))
end

return _M
