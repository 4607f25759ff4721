-- Settlement of the rate limits (infergate.admission.ratelimit) in the log phase: the
-- difference between the real token usage and the estimate charged up front, and a
-- lease's unspent tokens, go back to the buckets through the worker's flush queue
-- (infergate.core.flush), never on the request path.
local ngx_var = require("infergate.core.ngxapi").var
local flush = require("infergate.core.flush")
local redis = require("infergate.redis.client")
local bucketscript = require("infergate.admission.bucketscript")
local localbuckets = require("infergate.admission.localbuckets")

local _M = {}

local ipairs = ipairs
local unpack = unpack
local tonumber = tonumber
local log = ngx.log
local ERR = ngx.ERR

-- The correction of `list` by `costs` in the worker's flush queue: the script in Redis
-- (EVALSHA; EVAL queued again after NOSCRIPT), or the local buckets when the charge was
-- local or Redis cannot be reached (run in the flush timer, where waiting is allowed).
local function queue_correction(list, costs, source, full_script)
    -- a Redis Cluster: one correction per hash-tag group of buckets (one slot each)
    local groups = source == "redis" and not full_script and bucketscript.cluster_groups(list)
    if groups then
        local ok, err
        for _, idx in ipairs(groups) do
            ok, err = queue_correction(bucketscript.pick(list, idx), bucketscript.pick(costs, idx),
                                       source, false)
        end
        return ok, err
    end
    local cmds = {}
    if source == "redis" then
        local args = bucketscript.script_args("adjust", list, costs)
        if full_script then
            cmds[1] = { "EVAL", bucketscript.SCRIPT, unpack(args) }
        else
            cmds[1] = { "EVALSHA", bucketscript.SCRIPT_SHA, unpack(args) }
        end
    end
    return flush.push("ratelimit_correction", cmds, function(replies, err)
        if err == "queue full" then
            return
        end
        if replies and replies[1] ~= nil then
            local rerr = redis.error_of(replies[1])
            if not rerr then
                return
            end
            if rerr:find("^NOSCRIPT") and not full_script then
                queue_correction(list, costs, source, true)
                return
            end
            log(ngx.INFO, "infergate: token correction not applied in Redis: ", rerr)
        elseif err then
            log(ngx.INFO, "infergate: token correction not applied in Redis: ", err)
        end
        local ok, lerr = pcall(localbuckets.apply, "adjust", list, costs)
        if not ok then
            log(ERR, "infergate: token correction failed: ", lerr)
        end
    end)
end

_M.queue_correction = queue_correction

-- Whether the client left a request that is not a stream after it reached a node,
-- before its answer (and usage) came: 499 on nginx's proxy path, 444 from the relay
-- (infergate.stream.relay). A llama.cpp server writes such an answer to its end after
-- its connection closes (infergate.stream.slothold), so giving back the output reserved
-- would let a key send and abandon answers past its token limit.
local function left_at_node(req)
    if req.stream then
        return false
    end
    local st = ngx.status
    if st ~= 499 and st ~= 444 then
        return false
    end
    local r = req.relay
    if r then
        return (r.legs or 0) > 0
    end
    return (ngx_var("upstream_addr") or "") ~= ""
end

-- Log phase: charge the difference between the real token usage and the estimate (the
-- prompt estimate + the output tokens reserved, infergate.admission.tokencount).
-- No I/O here: the correction goes into the worker's flush queue (infergate.core.flush),
-- written to Redis by its timer; a full queue drops it (counted in
-- infergate_edge_flush_dropped_total{kind="ratelimit_correction"}).
-- A request a node refused (its answer, the one the client got, is 4xx: a context too
-- long, a parameter it rejects, 429 busy) read and generated nothing: the estimate is
-- given back whole, as OpenAI charges nothing for a refused request.
-- The stream relay (infergate.stream.relay) passes the node's answer itself: nginx has no
-- $upstream_status then, the relay notes it in req.relay_answer_status.
local function node_refused(req)
    local st = ngx.status
    if not st or st < 400 or st >= 500 then
        return false
    end
    local last = req.relay_answer_status
    if not last then
        local us = ngx_var("upstream_status")
        last = us and tonumber(us:match("(%d+)%s*$"))
    end
    return last ~= nil and last == st
end

function _M.log(req)
    local rl = req.ratelimit
    local usage = req.usage
    if not rl then
        return
    end
    local total = usage and usage.total_tokens
    if not total then
        if req.track_usage and node_refused(req) then
            total = 0
        elseif left_at_node(req) then
            return -- the node may be writing the answer still: the reservation stands
        elseif (req.reserved_tokens or 0) > 0 then
            -- no usage (a stream the client left, a failed try): the output reserved
            -- and not seen goes back
            total = (req.est_tokens or 0) + (req.usage_chunks or 0)
        else
            return
        end
    end
    local list, costs, any = {}, {}, false
    for _, b in ipairs(rl.list) do
        if b.kind == "tokens" then
            local delta = total - b.cost
            if delta ~= 0 then
                list[#list + 1] = b
                costs[#costs + 1] = delta
                any = true
            end
        end
    end
    if not any then
        return
    end
    queue_correction(list, costs, rl.source)
end


return _M
