-- The slot of a llama.cpp server's answer that outlives its request (infergate.stream.leg):
-- such a server goes on with an answer that is not a stream after its connection closes
-- (it looks at the connection only after a second with no result of any request on the
-- server: one with other work, or asked for /slots, finishes the answer), so a request
-- whose deadline passed there (its client has the 504, the connection to the node is
-- closed) still holds one of the node's slots. Counted free at once, the
-- next request sent there waits behind it (seen: 16 tokens answered after 24 s on the
-- node of two such answers while another node was idle). The attempt's in-flight count
-- is held instead: one poller per worker (a timer started with the first hold, ending
-- when none is left; never one per request) asks each node with held counts for its
-- /slots every POLL_S and gives back as many as the node runs fewer requests than the
-- edge counts on it (those answers are done); all of a node's when /slots does not
-- answer (a server started with --no-slots or an API key the edge does not send there:
-- as before, at once); each after edge.read_timeout_ms. The test counts this edge's
-- requests only: with several edges sending to the node, the others' requests running
-- there keep the counts held too (at most read_timeout_ms); a request this edge just
-- sent there that the server has not started yet makes one count go back early (the
-- node may then get one request more than it runs, as without the hold).
--
--   hold(r, node, att)   the attempt's in-flight count to the poller (att.released)
local cjson = require("cjson.safe")
local stats = require("infergate.routing.stats")
local http = require("infergate.stream.http")
local ngxapi = require("infergate.core.ngxapi")

local _M = {}

local concat = table.concat
local ipairs = ipairs
local pcall = pcall
local pairs = pairs
local next = next
local type = type
local ngx_now = ngxapi.now
local log = ngx.log
local WARN = ngx.WARN

-- How often (s) the node's /slots is asked while the count is held.
_M.POLL_S = 0.5
-- Timeouts (ms) of one /slots call.
_M.CALL_MS = 1000
-- Most counts a worker holds at once; past it a count is given back at once, as before.
_M.MAX_HELD = 256

-- node name -> {addr, port, host, auth, ends = {when (s) each count held goes back at
-- the latest, oldest first}}
local held = {}
local polling = false

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

-- Gives back the first k counts held on `name`.
local function give_back(name, h, k)
    for _ = 1, k do
        table.remove(h.ends, 1)
        stats.release({ node = name })
    end
    if #h.ends == 0 then
        held[name] = nil
    end
end

-- One pass over the nodes with held counts (a list of names first: the /slots calls
-- yield, and a hold taken meanwhile may add a node).
local function pass(exiting)
    local names = {}
    for name in pairs(held) do
        names[#names + 1] = name
    end
    for _, name in ipairs(names) do
        local h = held[name]
        if h then
            local now, gone = ngx_now(), 0
            for _, u in ipairs(h.ends) do
                if u <= now then
                    gone = gone + 1
                end
            end
            if exiting then
                gone = #h.ends
            end
            if gone < #h.ends then
                local fine, busy = pcall(busy_slots, h.addr, h.port, h.host, h.auth)
                if not fine or not busy then
                    gone = #h.ends
                else
                    local done = stats.inflight(name) - busy
                    if done > gone then
                        gone = math.min(done, #h.ends)
                    end
                end
            end
            give_back(name, h, gone)
        end
    end
end

local function run(premature)
    while true do
        local fine, err = pcall(pass, premature)
        if not fine then
            log(WARN, "infergate: held llama.cpp slots: ", err)
            premature = true -- everything goes back
            pcall(pass, true)
            held = {}
        end
        if premature or next(held) == nil then
            break
        end
        ngx.sleep(_M.POLL_S)
        premature = ngx.worker.exiting()
    end
    polling = false
end

-- Counts this worker holds.
local function holding()
    local n = 0
    for _, h in pairs(held) do
        n = n + #h.ends
    end
    return n
end

function _M.hold(r, node, att)
    if att.released or holding() >= _M.MAX_HELD then
        return
    end
    if not polling then
        local ok, err = ngx.timer.at(0, run)
        if not ok then
            log(WARN, "infergate: slot of ", att.node, " past a deadline not held: ", err)
            return
        end
        polling = true
    end
    local h = held[att.node]
    if not h then
        h = { addr = node.addr, port = node.port, host = node.host or node.addr,
              auth = ngx.var.infergate_node_auth, ends = {} }
        held[att.node] = h
    end
    local ends = h.ends
    ends[#ends + 1] = ngx_now() + r.o.edge.read_timeout_ms / 1000
    att.released = true -- its in-flight count is the poller's now
end

return _M
