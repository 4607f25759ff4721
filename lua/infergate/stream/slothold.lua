-- The slot of a llama.cpp server's answer that outlives its request (infergate.stream.leg):
-- such a server goes on with an answer that is not a stream after its connection closes,
-- so a request whose deadline passed there (its client has the 504, the connection to
-- the node is closed) still holds one of the node's slots. Counted free at once, the
-- next request sent there waits behind it (seen: 16 tokens answered after 24 s on the
-- node of two such answers while another node was idle). The attempt's in-flight count
-- passes to a timer that asks the node's /slots every POLL_S and gives the count back
-- once the node runs fewer requests than the edge counts on it (the answer is done),
-- when /slots does not answer (a server started with --no-slots or an API key the
-- edge does not send there: as before, at once) or after edge.read_timeout_ms. The
-- test counts this edge's requests only: with several edges sending to the node, the
-- others' requests running there keep the count held too (at most read_timeout_ms).
--
--   hold(r, node, att)   the attempt's in-flight count to the timer (att.released)
local cjson = require("cjson.safe")
local stats = require("infergate.routing.stats")
local http = require("infergate.stream.http")
local ngxapi = require("infergate.core.ngxapi")

local _M = {}

local concat = table.concat
local ipairs = ipairs
local pcall = pcall
local type = type
local ngx_now = ngxapi.now
local log = ngx.log
local WARN = ngx.WARN

-- How often (s) the node's /slots is asked while the count is held.
_M.POLL_S = 0.5
-- Timeouts (ms) of one /slots call.
_M.CALL_MS = 1000
-- Most counts a worker holds at once (each a running timer: lua_max_running_timers is
-- 256); past it a count is given back at once, as before.
_M.MAX_HELD = 64

local holding = 0 -- counts this worker holds

-- Busy slots of the llama.cpp server at addr:port (GET /slots), or nil.
local function busy_slots(addr, port, host, auth)
    local sock = ngx.socket.tcp()
    sock:settimeouts(_M.CALL_MS, _M.CALL_MS, _M.CALL_MS)
    local ok = sock:connect(addr, port)
    if not ok then
        return nil
    end
    ok = http.request(sock, { method = "GET", path = "/slots", host = host,
                              headers = { Authorization = auth } })
    local head = ok and http.read_head(sock)
    if not head or head.status ~= 200 then
        sock:close()
        return nil
    end
    local parts = {}
    while true do
        local data = http.read_body(head, sock)
        if not data then
            sock:close()
            return nil
        elseif data == "" then
            break
        end
        parts[#parts + 1] = data
    end
    sock:close()
    local list = cjson.decode(concat(parts))
    if type(list) ~= "table" then
        return nil
    end
    local n = 0
    for _, s in ipairs(list) do
        if type(s) == "table" and s.is_processing == true then
            n = n + 1
        end
    end
    return n
end

local function run(premature, held, addr, port, host, auth, until_s)
    while not premature and ngx_now() < until_s do
        local fine, busy = pcall(busy_slots, addr, port, host, auth) -- (the count goes back)
        if not fine or not busy or busy < stats.inflight(held.node) then
            break
        end
        ngx.sleep(_M.POLL_S)
        premature = ngx.worker.exiting()
    end
    holding = holding - 1
    stats.release(held)
end

function _M.hold(r, node, att)
    if att.released or holding >= _M.MAX_HELD then
        return
    end
    local held = { node = att.node }
    local ok, err = ngx.timer.at(0, run, held, node.addr, node.port, node.host or node.addr,
                                 ngx.var.infergate_node_auth,
                                 ngx_now() + r.o.edge.read_timeout_ms / 1000)
    if not ok then
        log(WARN, "infergate: slot of ", att.node, " past a deadline not held: ", err)
        return
    end
    holding = holding + 1
    att.released = true -- its in-flight count is the timer's now
end

return _M
