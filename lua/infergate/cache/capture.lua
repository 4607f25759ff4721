-- Capturing a node's answer for the response cache, and storing it off the request path.
--
--   header_filter_by_lua: require("infergate.cache.capture").header_filter()
--   body_filter_by_lua:   require("infergate.cache.capture").body_filter()
--   log_by_lua:           require("infergate.cache.capture").log()   -- before infergate.log
--
-- Works on the request's cache state `req.cache` set by infergate.cache.lookup (nil: nothing to
-- do). The header filter sets X-Cache-Status (MISS or BYPASS) on answers from a node and
-- starts capturing a 2xx answer that is not content-encoded; the body filter keeps its
-- bytes up to cache.max_entry_bytes (over: capture dropped). The log phase decides:
-- stored only when the answer is 200, complete (body filter saw the last buffer; every
-- choice finished with "stop", or "tool_calls" for chat; for a stream the "[DONE]" event
-- came), the client did not abort (status 499) and the size limit held. A JSON answer or
-- an SSE stream (reassembled: role, content, reasoning content, tool calls, finish
-- reasons, usage) becomes the stored form of infergate.cache.replay. Errors are never stored.
--
-- The Redis work runs in ngx.timer.at(0): one pipeline with, for a store, SET entry EX
-- ttl, SADD to the tenant, model and namespace index sets, HINCRBY stores, RPUSH of the
-- semantic index job, then the request's counters (HINCRBY on the stats hash). The
-- coalescing lock of the request (infergate.cache.lookup) is released after the store, so
-- waiting requests find the entry when the lock is gone.
local cjson = require("cjson.safe")
local config = require("infergate.core.config")
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local reqctx = require("infergate.core.reqctx")
local replay = require("infergate.cache.replay")

local _M = {}

-- Longest the semantic index queue grows (jobs) while no embedder reads it.
_M.INDEX_QUEUE_MAX = 10000

local type = type
local ipairs = ipairs
local pairs = pairs
local tostring = tostring
local tonumber = tonumber
local concat = table.concat
local null = cjson.null
local log = ngx.log
local WARN = ngx.WARN
local DEBUG = ngx.DEBUG

local FINISH_OK = {
    chat = { stop = true, tool_calls = true },
    text = { stop = true },
}

-- ------------------------------------------------------------------ filters

function _M.header_filter()
    local req = reqctx.get()
    local c = req and req.cache
    if not c or c.status == "HIT" then
        return
    end
    ngx.header["X-Cache-Status"] = c.status
    if not c.store then
        return
    end
    local status = ngx.status
    local enc = ngx.header["Content-Encoding"]
    if status ~= 200 or (enc and enc ~= "identity") or not ngx.var.upstream_status then
        c.store = false
        c.skip = "status " .. tostring(status)
        return
    end
    local ctype = ngx.header["Content-Type"]
    if type(ctype) == "table" then
        ctype = ctype[1]
    end
    c.sse = type(ctype) == "string" and ctype:lower():find("text/event-stream", 1, true) ~= nil
    c.buf = {}
    c.size = 0
end

function _M.body_filter()
    local req = ngx.ctx.infergate
    local c = req and req.cache
    if not c or not c.buf then
        return
    end
    local data = ngx.arg[1]
    if data and data ~= "" then
        c.size = c.size + #data
        if c.size > c.max_bytes then
            c.buf = nil
            c.store = false
            c.skip = "larger than " .. c.max_bytes .. " bytes"
            return
        end
        c.buf[#c.buf + 1] = data
    end
    if ngx.arg[2] then
        c.eof = true
    end
end

-- ------------------------------------------------------------------ reassembly

-- Events of an SSE text: list of data payloads (multi-line data joined by "\n").
local function sse_events(text)
    local events = {}
    local data = nil
    for line in (text .. "\n"):gmatch("([^\n]*)\n") do
        if line:sub(-1) == "\r" then
            line = line:sub(1, -2)
        end
        if line == "" then
            if data then
                events[#events + 1] = concat(data, "\n")
                data = nil
            end
        elseif line:sub(1, 5) == "data:" then
            local v = line:sub(6)
            if v:sub(1, 1) == " " then
                v = v:sub(2)
            end
            data = data or {}
            data[#data + 1] = v
        end
    end
    if data then
        events[#events + 1] = concat(data, "\n")
    end
    return events
end
_M.sse_events = sse_events

-- One completion (decoded-JSON shape) from the SSE text of a stream; nil, err.
function _M.reassemble(text, kind)
    local acc, order = {}, {}
    local top = {}
    local done = false
    for _, ev in ipairs(sse_events(text)) do
        if ev == "[DONE]" then
            done = true
        else
            local chunk = cjson.decode(ev)
            if type(chunk) ~= "table" then
                return nil, "stream event is not JSON"
            end
            if chunk.error ~= nil and chunk.error ~= null then
                return nil, "stream carried an error"
            end
            top.id = top.id or chunk.id
            top.created = top.created or chunk.created
            top.model = top.model or chunk.model
            if type(chunk.system_fingerprint) == "string" then
                top.system_fingerprint = chunk.system_fingerprint
            end
            if type(chunk.usage) == "table" then
                top.usage = chunk.usage
            end
            if type(chunk.choices) == "table" then
                for _, ch in ipairs(chunk.choices) do
                    if type(ch) == "table" then
                        local idx = tonumber(ch.index) or 0
                        local a = acc[idx]
                        if not a then
                            a = { index = idx, content = {}, reasoning = {}, text = {}, tools = {},
                                  tool_order = {} }
                            acc[idx] = a
                            order[#order + 1] = idx
                        end
                        if type(ch.finish_reason) == "string" then
                            a.finish_reason = ch.finish_reason
                        end
                        if kind == "text" then
                            if type(ch.text) == "string" then
                                a.text[#a.text + 1] = ch.text
                            end
                        elseif type(ch.delta) == "table" then
                            local d = ch.delta
                            if type(d.role) == "string" then
                                a.role = d.role
                            end
                            if type(d.content) == "string" then
                                a.content[#a.content + 1] = d.content
                                a.has_content = true
                            end
                            local r = d.reasoning_content
                            if type(r) ~= "string" then
                                r = d.reasoning
                            end
                            if type(r) == "string" then
                                a.reasoning[#a.reasoning + 1] = r
                            end
                            if type(d.refusal) == "string" then
                                a.refusal = (a.refusal or "") .. d.refusal
                            end
                            if type(d.tool_calls) == "table" then
                                for _, tc in ipairs(d.tool_calls) do
                                    if type(tc) == "table" then
                                        local ti = tonumber(tc.index) or #a.tool_order
                                        local t = a.tools[ti]
                                        if not t then
                                            t = { name = {}, args = {} }
                                            a.tools[ti] = t
                                            a.tool_order[#a.tool_order + 1] = ti
                                        end
                                        if type(tc.id) == "string" then
                                            t.id = tc.id
                                        end
                                        if type(tc.type) == "string" then
                                            t.type = tc.type
                                        end
                                        local fn = tc["function"]
                                        if type(fn) == "table" then
                                            if type(fn.name) == "string" then
                                                t.name[#t.name + 1] = fn.name
                                            end
                                            if type(fn.arguments) == "string" then
                                                t.args[#t.args + 1] = fn.arguments
                                            end
                                        end
                                    end
                                end
                            end
                        end
                    end
                end
            end
        end
    end
    if not done then
        return nil, "stream ended without [DONE]"
    end
    table.sort(order)
    local choices = {}
    for i, idx in ipairs(order) do
        local a = acc[idx]
        local choice = { index = idx, finish_reason = a.finish_reason }
        if kind == "text" then
            choice.text = concat(a.text)
        else
            local tools = {}
            table.sort(a.tool_order)
            for j, ti in ipairs(a.tool_order) do
                local t = a.tools[ti]
                tools[j] = { id = t.id, type = t.type or "function",
                             ["function"] = { name = concat(t.name), arguments = concat(t.args) } }
            end
            choice.message = {
                role = a.role or "assistant",
                content = (a.has_content or #tools == 0) and concat(a.content) or nil,
                reasoning_content = #a.reasoning > 0 and concat(a.reasoning) or nil,
                tool_calls = #tools > 0 and tools or nil,
                refusal = a.refusal,
            }
        end
        choices[i] = choice
    end
    top.choices = choices
    return top
end

-- The stored form of a captured answer, or nil, reason.
function _M.completion(c, text)
    local o, err
    if c.sse then
        o, err = _M.reassemble(text, c.kind)
    else
        o = cjson.decode(text)
        if type(o) ~= "table" then
            err = "answer is not JSON"
        end
    end
    if not o then
        return nil, err
    end
    local comp, nerr = replay.normalize(o, c.kind)
    if not comp then
        return nil, nerr
    end
    local ok = FINISH_OK[c.kind]
    for _, ch in ipairs(comp.choices) do
        if not ok[ch.finish_reason] then
            return nil, "finish_reason " .. tostring(ch.finish_reason)
        end
    end
    return comp
end

-- ------------------------------------------------------------------ store (timer)

local redis_conf

local function release_lock(job)
    if not job.lock then
        return
    end
    local dict = ngx.shared[job.dict]
    if dict and dict:get(job.lock) == job.owner then
        dict:delete(job.lock)
    end
end

local function run_job(premature, job)
    if premature then
        release_lock(job)
        return
    end
    -- the store first, the counters last: once a request's counters are visible, its
    -- entry (if any) is too
    local cmds = {}
    local s = job.store
    if s then
        cmds[#cmds + 1] = { "SET", keynames.cache_entry(s.key), s.entry, "EX", s.ttl }
        cmds[#cmds + 1] = { "SADD", keynames.cache_index("tenant", s.tenant), s.key }
        if s.model ~= "" then
            cmds[#cmds + 1] = { "SADD", keynames.cache_index("model", s.model), s.key }
        end
        if s.namespace ~= "" then
            cmds[#cmds + 1] = { "SADD", keynames.cache_index("namespace", s.namespace), s.key }
        end
        cmds[#cmds + 1] = { "HINCRBY", keynames.cache_stats, "stores", 1 }
        if s.index_job then
            cmds[#cmds + 1] = { "RPUSH", keynames.cache_index_queue, s.index_job }
            -- bounded while no embedder consumes it: the newest jobs are kept
            cmds[#cmds + 1] = { "LTRIM", keynames.cache_index_queue, -_M.INDEX_QUEUE_MAX, -1 }
        end
    end
    for _, name in ipairs(job.counters) do
        cmds[#cmds + 1] = { "HINCRBY", keynames.cache_stats, name, 1 }
    end
    if #cmds > 0 then
        local err
        if not redis_conf then
            redis_conf, err = redis.parse_url(config.get().redis_url)
        end
        local rc
        if redis_conf then
            rc, err = redis.connect(redis_conf, config.get().redis_timeout_ms)
        end
        if rc then
            local res
            res, err = rc:pipeline(cmds)
            if res then
                rc:keepalive()
                if s and type(res[1]) == "table" then
                    err = "SET: " .. tostring(res[1].err)
                end
            end
        end
        if err then
            log(WARN, "infergate: cache ", s and "store" or "counters", " failed: ", err)
        end
    end
    release_lock(job)
end
_M._run_job = run_job

local COUNTERS = {
    HIT = { exact = { "lookups", "hits_exact" }, semantic = { "lookups", "hits_semantic" } },
    MISS = { "lookups", "misses" },
    BYPASS = { "bypass" },
}

local function store_of(req, c)
    if not c.store or not c.buf then
        return nil, c.skip
    end
    if not c.eof then
        return nil, "answer incomplete"
    end
    local status = tonumber(ngx.var.status)
    if status ~= 200 then
        return nil, "status " .. tostring(status)
    end
    local comp, err = _M.completion(c, concat(c.buf))
    c.buf = nil
    if not comp then
        return nil, err
    end
    local body, eerr = replay.encode(comp)
    if not body then
        return nil, eerr
    end
    local now = ngx.now()
    local entry = replay.encode({
        tenant = c.tenant, model = c.model or "", namespace = c.namespace or "",
        created = now, ttl = c.ttl, body = body, path = c.path, kind = c.kind,
        stream = c.sse and true or false, content_type = "application/json", v = 1,
    })
    local index_job
    if c.namespace and c.text then
        index_job = replay.encode({
            key = c.key, namespace = c.namespace, text = c.text, model = c.model or "",
            tenant = c.tenant, ttl_s = c.ttl,
        })
    end
    return {
        key = c.key, entry = entry, ttl = c.ttl, tenant = c.tenant, model = c.model or "",
        namespace = c.namespace or "", index_job = index_job,
    }
end

function _M.log()
    local req = reqctx.get()
    local c = req and req.cache
    if not c or c.logged then
        return
    end
    c.logged = true
    local job = { counters = {}, dict = c.dict, lock = c.lock, owner = c.owner }
    local counters = COUNTERS[c.status]
    if c.status == "HIT" then
        counters = counters[c.match] or counters.exact
    end
    job.counters = counters or {}
    if c.status ~= "HIT" then
        local s, why = store_of(req, c)
        if s then
            job.store = s
        elseif why then
            log(DEBUG, "infergate: cache: answer not stored: ", why)
        end
    end
    if #job.counters == 0 and not job.store then
        release_lock(job)
        return
    end
    local ok, err = ngx.timer.at(0, run_job, job)
    if not ok then
        log(WARN, "infergate: cache: cannot start the store timer: ", err)
        release_lock(job)
    end
end

return _M
