-- The API keys of the key store, per worker, refreshed off the request path, for two
-- uses:
--   * a flood of made-up keys from an address does not lock out the valid keys of that
--     address (a NAT, a proxy, a shared egress): an address past its budget of failed
--     lookups (infergate.admission.auththrottle) still has a key looked up in Redis when
--     its digest is known here (infergate.admission.auth.lookup). A made-up key cannot
--     be among them (a SHA-256 of 256 random bits), so the flood still costs Redis
--     nothing;
--   * while Redis is unreachable, a key with no cached answer is checked against the
--     record held here (infergate.admission.auth: fail-static, as nginx keeps serving
--     its configuration): a valid key that has been idle does not get 503 for the
--     outage, a revoked or unknown one is still refused. What is held is as of the last
--     refresh (a revocation reaches it within EVERY_S).
-- A valid key created since the last refresh is known at the next one.
--
-- Every EVERY_S a recurring timer per worker (init_worker) queues HLEN of the key
-- store (keynames.apikeys) and GET of its marker (keynames.apikeys_marker, which every
-- write of the keys renews: a creation, a revocation, an edit) on the flush queue
-- (infergate.core.flush, which runs it off the request path); when the count or the
-- marker changed, or REFRESH_S passed, HGETALL follows and its records replace the set
-- (a revocation reaches it within EVERY_S). A store of more than MAX_KEYS keys is not held (the
-- set is dropped: past the budget every uncached key is refused, and during an outage
-- only cached answers serve, as without this module). An error or no answer keeps the
-- set the worker has. Only with auth.mode = "required". Worker 0 also saves the records
-- it read (infergate.core.statefile, "apikeys.json": digests and records, never a key;
-- a save that failed is tried again every EVERY_S, the stale file removed meanwhile),
-- and every worker starts from that file, so an nginx started while Redis is
-- unreachable still knows the keys of the store.
--
-- The store's marker missing means Redis lost the key store (it came back empty) or it
-- was never written: what Redis holds then is merged into the set held (its records win,
-- none held is dropped), never put in its place, so an empty store after a loss never
-- replaces the last records seen, in memory or in the file, and an nginx restarted
-- before or after the loss still knows the valid keys (infergate.admission.auth keeps
-- honouring them until the keys are written again: a restore, a key write). Revoked
-- records stay revoked; keys deleted while the marker was there were dropped then.
-- While the marker is missing and the set holds a valid key the store lacks, every
-- refresh (EVERY_S) flags auth_store_missing (infergate.admission.stats), whether or not
-- a request used such a key: the control plane and `infergate keys` read that flag from
-- the edge stats to tell a lost store that waits for its restore (a key written
-- meanwhile must not end it) from one that was never written.
--
--   has(digest)      whether the digest is a key of the store (as of the last refresh)
--   record(digest)   its record (the JSON text the store holds), or nil
--   newer_record(digest, at)  its record in a set read after at (false: not in it), or nil
--   tick(premature)  the timer's step
--   init_worker()    starts the timer
local config = require("infergate.core.config")
local ngxapi = require("infergate.core.ngxapi")
local flush = require("infergate.core.flush")
local keynames = require("infergate.redis.keynames")
local redis = require("infergate.redis.client")
local statefile = require("infergate.core.statefile")
local astats = require("infergate.admission.stats")
local cjson = require("cjson.safe")

local _M = {}

_M.EVERY_S = 5
_M.REFRESH_S = 60
_M.MAX_KEYS = 20000
-- An ask whose answer never came (a flush that could not run) is given up after this.
local PENDING_MAX_S = 30

local type = type
local log = ngx.log
local ERR = ngx.ERR

local known = nil       -- digest -> record (JSON text), or nil (nothing held)
local count = -1        -- HLEN the set was built for
local built_at = 0
local saved_text = nil  -- what worker 0 saved last
local unsaved = nil     -- worker 0: the set it could not save, tried again every tick
local marker = nil      -- the key store's marker the set was built for
local asked_marker = nil
local kept_valid = 0    -- valid keys of the set the store lacked at the last read (marker missing)

_M.STATE_FILE = "apikeys.json"
local asked_at = 0
local keys_asked_at = 0 -- when the HGETALL under way was asked: the date of its set
local pending = false

function _M.has(digest)
    return known ~= nil and known[digest] ~= nil
end

function _M.record(digest)
    return known and known[digest]
end

-- The record of digest in a set read after time at (epoch s): the record, false when
-- the store of that read did not hold the key, nil when the set held is not that new
-- (or none is held). An answer cached at `at` is then older than what the store said.
function _M.newer_record(digest, at)
    if known == nil or built_at <= at then
        return nil
    end
    return known[digest] or false
end

local function answer(replies, err)
    local v = replies and replies[1]
    if err or v == nil or redis.error_of(v) then
        return nil
    end
    return v
end

local function valid_record(rec)
    local r = cjson.decode(rec)
    return type(r) == "table" and (r.revoked == nil or r.revoked == cjson.null)
end

-- The store was lost and this worker keeps valid keys it lacks: say so for longer than
-- one refresh interval (infergate.admission.auth flags it too, on a request).
local function flag_kept()
    if marker == "" and kept_valid > 0 then
        local ttl = config.get().auth.cache_ttl_s or 0
        astats.flag("auth_store_missing", math.max(2 * ttl, 2 * _M.EVERY_S, 10))
    end
end

local function on_keys(replies, err)
    pending = false
    local list = answer(replies, err)
    if type(list) ~= "table" then
        return
    end
    local n = #list / 2          -- HGETALL: digest, record, digest, record, ...
    if n > _M.MAX_KEYS then
        known, count = nil, n
        return
    end
    local set, size, held = {}, 0, 0
    if asked_marker == "" and known then
        -- the store's marker is missing (lost): merge, never replace (see the top)
        for digest, rec in pairs(known) do
            set[digest] = rec
            size = size + 1
        end
    end
    local merged = size > 0
    local stored = {}
    for i = 1, 2 * n, 2 do
        local digest, rec = list[i], list[i + 1]
        if type(digest) == "string" and type(rec) == "string" then
            if set[digest] == nil then
                size = size + 1
            end
            set[digest] = rec
            stored[digest] = true
        end
    end
    if merged then
        -- valid keys held that the store lacks: kept over the loss
        for digest, rec in pairs(set) do
            if not stored[digest] and valid_record(rec) then
                held = held + 1
            end
        end
    end
    if size > _M.MAX_KEYS then
        known, count = nil, n
        return
    end
    -- dated when asked: an answer cached while the read was under way (a key created
    -- just after it ran) is not taken for older than the set (newer_record)
    known, count, built_at, marker = set, n, keys_asked_at, asked_marker
    kept_valid = held
    flag_kept()
    if ngx.worker.id() == 0 then
        local text = cjson.encode(set)
        if text and text ~= saved_text then
            -- saved only once written: a write that failed (a full disk, a folder made
            -- read-only) is tried again at every tick, and the old file, whose records
            -- may name a key revoked since, is removed meanwhile (an nginx started while
            -- Redis is down then refuses keys, 503, rather than take one)
            if statefile.write(_M.STATE_FILE, text) then
                saved_text, unsaved = text, nil
            else
                unsaved = text
                os.remove(statefile.path(_M.STATE_FILE))
            end
        end
    end
end

local function on_len(replies, err)
    local n = answer(replies, err)
    if type(n) ~= "number" then
        pending = false
        return
    end
    if n > _M.MAX_KEYS then
        known, count, pending = nil, n, false
        return
    end
    local m = replies[2]
    asked_marker = type(m) == "string" and m or ""
    if known and n == count and asked_marker == marker
            and ngxapi.now() - built_at < _M.REFRESH_S then
        pending = false
        flag_kept()
        return
    end
    keys_asked_at = ngxapi.now()
    if not flush.push("auth_known", { { "HGETALL", keynames.apikeys } }, on_keys) then
        pending = false
    end
end

function _M.tick(premature)
    if premature or config.get().auth.mode ~= "required" then
        return
    end
    if unsaved and statefile.write(_M.STATE_FILE, unsaved) then
        saved_text, unsaved = unsaved, nil
    end
    local now = ngxapi.now()
    if pending and now - asked_at < PENDING_MAX_S then
        return
    end
    asked_at, pending = now, true
    if not flush.push("auth_known", { { "HLEN", keynames.apikeys },
                                       { "GET", keynames.apikeys_marker } }, on_len) then
        pending = false
    end
end

-- The records saved last (statefile), held until the first refresh replaces them.
local function load_saved()
    local text = statefile.read(_M.STATE_FILE)
    local set = text and cjson.decode(text)
    if type(set) ~= "table" then
        return
    end
    local n = 0
    for digest, rec in pairs(set) do
        if type(digest) ~= "string" or type(rec) ~= "string" then
            return
        end
        n = n + 1
    end
    if n <= _M.MAX_KEYS then
        known, count, built_at, saved_text = set, -1, 0, text
    end
end

function _M.init_worker()
    if config.get().auth.mode == "required" then
        load_saved()
    end
    local ok, err = ngx.timer.at(0, _M.tick)
    if ok then
        ok, err = ngx.timer.every(_M.EVERY_S, _M.tick)
    end
    if not ok then
        log(ERR, "infergate: cannot start the known-keys refresh: ", err)
    end
end

return _M
