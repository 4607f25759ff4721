-- Routing snapshot: pulled from Redis by one worker, shared through a shared dict,
-- turned into a worker-local node table by every worker.
--
-- Every sync_interval_s a timer runs in each worker. In worker 0 it GETs
-- infergate:v1:routing (docs/internals.md) and, in the same round trip, HSETs this
-- edge's stats into infergate:v1:edges. A snapshot that differs from the last one is
-- stored in the dict infergate_snapshot ("json", "gen" = change counter,
-- "fetched_at"); every worker rebuilds its local table when "gen" changes (in the
-- timer, and on the request path through refresh(), which costs one dict read).
--
-- Redis unreachable or the key missing: the last snapshot stays (fail-static); the
-- outage is logged once when it starts and once when it ends. Redis is reached through
-- infergate.redis.pool (pooled connection; after a failure the syncs of the back-off
-- interval skip Redis and report the back-off as redis_error). Each new snapshot is
-- also saved to disk (infergate.core.statefile, "routing.json", by worker 0's sync
-- timer). Before any snapshot from Redis: the one saved last (source "disk": drains and
-- nodes added at run time kept across an nginx restart during a Redis outage), else the
-- static node list from the rendered config, all nodes active and healthy.
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local backat = require("infergate.routing.backat")
local config = require("infergate.core.config")
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local pool = require("infergate.redis.pool")
local sentinel = require("infergate.redis.sentinel")
local stats = require("infergate.routing.stats")
local statefile = require("infergate.core.statefile")

local _M = {}

-- TTL (s) of infergate:v1:edges, renewed by every sync: edge stats are cache kind
-- (evictable), state keys never carry a TTL.
local EDGES_TTL_S = 3600

local shared = ngx.shared
local log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local type = type
local tostring = tostring
local ipairs = ipairs

local local_gen = -1      -- gen of the table below
local current = nil       -- worker-local node table (see build())
local syncing = false     -- a sync is running in this worker
local outage = false      -- worker 0: since when Redis is unreachable (logged once)
local bad_snapshot_logged = nil
local bad_url_logged = false

-- Seconds between two reconciliations of in-flight counts (infergate.routing.stats).
local RECONCILE_EVERY_S = 2

local function dict()
    return shared[config.DICT_SNAPSHOT]
end

-- A host the balancer can use as-is (no DNS in the balancer phase).
local function peer_addr(host)
    if type(host) ~= "string" or host == "" then
        return nil
    end
    if host:find(":", 1, true) then
        if host:sub(1, 1) == "[" then
            return host
        end
        return "[" .. host .. "]"  -- IPv6 literal
    end
    if host:match("^%d+%.%d+%.%d+%.%d+$") then
        return host
    end
    return nil
end
_M.peer_addr = peer_addr

local function num(v, default)
    if type(v) == "number" and v == v then
        return v
    end
    return default
end

-- Served models of a node: {list = {id, ...}, set = {id = true}, any = true|nil}, or nil
-- when unknown (missing, null or an empty array: the node may be sent any model). any:
-- the node also takes a model no node lists ("models_any": a single-model llama.cpp
-- server); build() then adds listed = the union of every node's set, shared, or false
-- while a node whose list is unknown is healthy and active (it may serve any name: the
-- fallback is off). An unknown node that is down or drained (one that never answered,
-- an address with nothing behind it) does not turn it off: every name it might serve
-- would otherwise get the 503 of no eligible node while the nodes that take any name
-- are up, where nginx would have sent it to them.
local function model_set(models, any)
    if type(models) ~= "table" then
        return nil
    end
    local list, set = {}, {}
    for _, m in ipairs(models) do
        if type(m) == "string" and m ~= "" and not set[m] then
            set[m] = true
            list[#list + 1] = m
        end
    end
    if #list == 0 then
        return nil
    end
    return { list = list, set = set, any = any == true or nil }
end
_M.model_set = model_set

-- Node entry of the local table from a snapshot node (or a static one).
local function make_node(n)
    local name = n.name
    if type(name) ~= "string" or name == "" then
        return nil, "node without a name"
    end
    local port = num(n.port)
    if not port or port < 1 or port > 65535 then
        return nil, "node " .. name .. ": bad port"
    end
    local addr = peer_addr(n.host)
    local weight = num(n.weight, 1.0)
    if weight <= 0 then
        weight = 1.0
    end
    local ew = num(n.effective_weight, weight)
    if ew <= 0 then
        ew = weight
    end
    local maxc = num(n.max_concurrency, 64)
    if maxc < 1 then
        maxc = 1
    end
    local scheme = n.scheme == "https" and "https" or "http"
    local auth = type(n.auth) == "string" and n.auth ~= "" and n.auth or nil
    local slots = num(n.slots)
    if slots and slots < 1 then
        slots = nil
    end
    local ctx = num(n.ctx_tokens)
    if ctx and ctx < 1 then
        ctx = nil
    end
    local state = n.state
    if state ~= "active" and state ~= "draining" and state ~= "drained" then
        state = "active"
    end
    return {
        name = name,
        host = n.host,
        addr = addr,          -- nil: not an IP literal, never picked
        port = port,
        state = state,
        healthy = n.healthy ~= false,
        connects = n.connects == true,  -- unhealthy, its last poll connected (infergate.access)
        weight = weight,
        effective_weight = ew,
        max_concurrency = maxc,
        slots = slots and math.floor(slots),  -- nil: not known (hard limit, see admission.slots)
        score = num(n.score),         -- nil = no metrics
        saturated = n.saturated == true,
        running = num(n.running),          -- the node's metrics (nil: unknown), for
        queue_depth = num(n.queue_depth),  -- infergate.routing.room
        polled_at = num(n.polled_at),      -- their poll (epoch s; infergate.routing.others)
        restarted_after = num(n.restarted_after),  -- infergate.routing.restarts
        back_at = num(n.back_at),  -- came back (healthy again, restarted): routing.breaker
        kind = n.kind,
        slots_source = n.slots_source,  -- "server": a llama.cpp server (infergate.stream.splice)
        ctx_tokens = ctx,  -- context of one slot, tokens (nil: not known; routing.ctxfit)
        models = model_set(n.models, n.models_any),  -- nil = unknown (any model)
        -- how the edge reaches it (infergate.routing.upstream): the API key is secret,
        -- never reported by /infergate/status
        scheme = scheme,
        tls_name = scheme == "https" and type(n.tls_name) == "string" and n.tls_name or nil,
        auth = auth,
        group = scheme .. " " .. (auth or ""),
    }
end

local function build(nodes, meta)
    local t = {
        source = meta.source,
        version = meta.version,
        generated_at = meta.generated_at,
        fetched_at = meta.fetched_at,
        leader = meta.leader,
        nodes = {},
        by_name = {},
    }
    local problems
    for _, n in ipairs(nodes) do
        local node, err = make_node(n)
        if node and not t.by_name[node.name] then
            t.nodes[#t.nodes + 1] = node
            t.by_name[node.name] = node
        else
            problems = (problems and problems .. "; " or "") .. (err or ("duplicate node " .. tostring(n.name)))
        end
    end
    local listed = {}
    for _, node in ipairs(t.nodes) do
        if node.models then
            for id in pairs(node.models.set) do
                listed[id] = true
            end
        elseif node.healthy and node.state == "active" then
            -- it may serve any name, and it can be sent one now: no fallback
            listed = false
            break
        end
    end
    for _, node in ipairs(t.nodes) do
        if node.models then
            node.models.listed = listed
        end
    end
    return t, problems
end

local function static_table()
    local o = config.get()
    local t = build(o.nodes, { source = "static", version = 0 })
    return t
end

_M.STATE_FILE = "routing.json"
local saved = nil         -- this worker's table from the saved snapshot (false: none)

-- The table before any snapshot from Redis: the saved one, else the static list.
local function first_table()
    if saved == nil then
        saved = false
        local raw = statefile.read(_M.STATE_FILE)
        local snap = raw and cjson.decode(raw)
        if type(snap) == "table" and type(snap.nodes) == "table" then
            saved = build(snap.nodes, { source = "disk", version = num(snap.version, 0),
                                        generated_at = num(snap.generated_at),
                                        leader = snap.leader })
            if ngx.worker.id() == 0 then
                -- on every start with a saved snapshot; a fault only while it lasts
                log(WARN, "infergate: started routing on the snapshot saved last (version ",
                    saved.version, ", ", #saved.nodes, " nodes), until the first one read ",
                    "from Redis (at once when it answers)")
            end
        end
    end
    return saved or static_table()
end

-- Rebuild the worker-local table when the shared snapshot changed. Cheap: one dict
-- read when nothing changed. Returns the current table.
function _M.refresh()
    local d = dict()
    local gen = d and d:get("gen") or 0
    if gen == local_gen and current then
        return current
    end
    if gen == 0 then
        current = first_table()
        local_gen = 0
        return current
    end
    local raw = d:get("json")
    local snap = raw and cjson.decode(raw)
    if type(snap) ~= "table" or type(snap.nodes) ~= "table" then
        -- cannot happen for stored snapshots (validated before storing); keep the old
        local_gen = gen
        current = current or static_table()
        return current
    end
    local t, problems = build(snap.nodes, {
        source = "redis",
        version = num(snap.version, 0),
        generated_at = num(snap.generated_at),
        fetched_at = d:get("fetched_at"),
        leader = snap.leader,
    })
    if problems and bad_snapshot_logged ~= gen then
        bad_snapshot_logged = gen
        log(WARN, "infergate: routing snapshot version ", t.version, " has invalid nodes (skipped): ", problems)
    end
    current = t
    local_gen = gen
    backat.update(t.nodes)
    return current
end

-- The worker-local table without any check (balancer phase).
function _M.current()
    if not current then
        return _M.refresh()
    end
    return current
end

-- True when the table comes from a snapshot younger than stale_after_s.
function _M.is_fresh(t, now)
    if t.source ~= "redis" or not t.generated_at then
        return false
    end
    return (now - t.generated_at) <= config.get().edge.stale_after_s
end

-- Seconds since generated_at, or nil for the static list.
function _M.age(t, now)
    if not t.generated_at then
        return nil
    end
    return now - t.generated_at
end

-- Stores a snapshot JSON text fetched from Redis. Returns true, or nil, err when it
-- is not a usable snapshot (then the previous one stays).
function _M.store(raw, now)
    local snap, err = cjson.decode(raw)
    if type(snap) ~= "table" then
        return nil, "routing snapshot is not valid JSON: " .. tostring(err)
    end
    if type(snap.nodes) ~= "table" then
        return nil, "routing snapshot has no nodes array"
    end
    local d = dict()
    d:set("fetched_at", now)
    if d:get("json") == raw then
        return true
    end
    local ok, serr = d:set("json", raw)
    if not ok then
        return nil, "cannot store routing snapshot in the shared dict: " .. tostring(serr)
    end
    d:incr("gen", 1, 0)
    statefile.write(_M.STATE_FILE, raw)  -- a failure is logged once (statefile)
    return true
end

local function edge_report(now)
    local t = _M.current()
    local nodes = {}
    for _, n in ipairs(t.nodes) do
        nodes[n.name] = stats.node_report(n.name, now)
    end
    local o = config.get()
    return cjson.encode({ edge_id = o.edge.edge_id, ts = now, nodes = nodes,
                          admission = require("infergate.admission.stats").all(),
                          duration = require("infergate.core.prometheus").duration_report() })
end

local function redis_failed(err)
    local d = dict()
    d:set("redis_ok", false)
    d:set("redis_error", tostring(err))
    if not outage then
        outage = ngx_now()
        log(WARN, "infergate: Redis unreachable, routing on the last snapshot until it returns: ", err)
    end
end

-- One sync round of worker 0: GET the snapshot, publish this edge's stats.
function _M.fetch()
    local o = config.get()
    local redis_conf, conf_err = pool.conf()
    if not redis_conf then
        if not bad_url_logged then
            bad_url_logged = true
            log(ERR, "infergate: bad redis url, the edge runs on its static node list: ", conf_err)
        end
        return nil, conf_err
    end
    local now = ngx_now()
    if redis_conf.sentinel then
        -- Sentinel: ask for the master every redis_sentinel_refresh_s (infergate.redis.sentinel)
        sentinel.tick(redis_conf, o.edge.redis_timeout_ms)
    end
    -- through the pool: pooled connection, skipped while Redis is backed off
    local res, err = pool.run(function(c)
        return c:pipeline({
            { "GET", keynames.routing },
            { "HSET", keynames.edges, o.edge.edge_id, edge_report(now) },
            -- cache kind (evictable): renewed by every sync of every edge
            { "EXPIRE", keynames.edges, EDGES_TTL_S },
        })
    end)
    if not res then
        redis_failed(err)
        return nil, err
    end
    local d = dict()
    if outage then
        log(WARN, "infergate: Redis reachable again after ", string.format("%.1f", now - outage), " s")
        outage = false
    end
    d:set("redis_ok", true)
    d:delete("redis_error")
    local raw = res[1]
    local rerr = redis.error_of(raw)
    if rerr then
        return nil, rerr
    end
    if type(raw) == "string" then
        local ok, serr = _M.store(raw, now)
        if not ok then
            if d:get("bad_json") ~= raw then
                d:set("bad_json", raw)
                log(ERR, "infergate: ignoring routing snapshot: ", serr)
            end
            return nil, serr
        end
    end
    return true
end

local function tick(premature)
    if premature or syncing then
        return
    end
    syncing = true
    local id = ngx.worker.id()
    if id == nil or id == 0 then
        local ok, err = pcall(_M.fetch)
        if not ok then
            log(ERR, "infergate: snapshot sync failed: ", err)
        end
    end
    local ok, err = pcall(_M.refresh)
    if not ok then
        log(ERR, "infergate: rebuilding the node table failed: ", err)
    end
    -- in-flight counts of a worker that died (infergate.routing.stats), by one worker at
    -- a time, every RECONCILE_EVERY_S
    if dict():add("reconcile", true, RECONCILE_EVERY_S) then
        ok, err = pcall(stats.reconcile)
        if not ok then
            log(ERR, "infergate: in-flight reconciliation failed: ", err)
        end
    end
    syncing = false
end

-- init_worker_by_lua: local table from the static list, then the sync timer.
function _M.init_worker()
    math.randomseed(ngx_now() * 1000 + ngx.worker.pid())
    _M.refresh()
    local o = config.get()
    local ok, err = ngx.timer.at(0, tick)
    if not ok then
        log(ERR, "infergate: cannot start the first sync: ", err)
    end
    ok, err = ngx.timer.every(o.edge.sync_interval_s, tick)
    if not ok then
        log(ERR, "infergate: cannot start the sync timer: ", err)
    end
end

-- For the status endpoint.
function _M.info(now)
    local t = _M.refresh()
    local d = dict()
    local age = _M.age(t, now)
    return {
        source = t.source,
        version = t.version,
        generated_at = t.generated_at or ngx.null,
        fetched_at = d:get("fetched_at") or ngx.null,
        age_s = age or ngx.null,
        stale = t.source == "redis" and not _M.is_fresh(t, now),
        leader = t.leader or ngx.null,
        redis_ok = d:get("redis_ok") == true,
        redis_error = d:get("redis_error") or ngx.null,
        nodes = #t.nodes,
    }
end

return _M
