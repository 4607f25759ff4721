-- API keys at the edge (access phase): "Authorization: Bearer KEY" (or, without an
-- Authorization header, "x-api-key: KEY", as Anthropic's SDK sends it) -> tenant and limits.
--
-- Mode (auth.mode): "off" -> every request belongs to the tenant "default" and nothing
-- is checked (trusted networks); "required" -> a valid key is needed on every API path.
--
-- The SHA-256 hex of the key is looked up with one HGET in infergate:v1:apikeys
-- (docs/internals.md "API keys"): valid when the record exists and "revoked" is null.
-- Answers are cached under "k:<sha256 hex>", valid keys in the infergate_auth shared
-- dict, unknown or revoked keys apart in infergate_auth_neg (so a flood of made-up keys
-- evicts only made-up keys, never a valid one):
--
--   {"ok": true, "at": epoch_s, "id", "tenant", "rpm"?, "tpm"?, "weight"?, "priority"?}
--   {"ok": false, "at": epoch_s}                                    unknown or revoked
--
-- A cached answer is trusted for auth.cache_ttl_s (valid) or auth.negative_ttl_s
-- (invalid) seconds, so a revoked key stops working at most cache_ttl_s after the
-- revocation. The dicts keep answers up to auth.stale_ttl_s: while Redis is unreachable
-- those stale answers are used (valid keys keep working, known-bad keys keep failing),
-- except a valid answer that the key store's records the worker read after it was cached
-- (infergate.admission.knownkeys) contradict: a key revoked before the outage is refused;
-- a key with no cached answer is then checked against the key store's records the
-- worker holds (infergate.admission.knownkeys, refreshed every minute or when the
-- number of keys changes; counted in auth_static), and only a key found in neither
-- gets 503 auth_unavailable. An unknown key is never let through.
--
-- Lookups that find no valid key are limited per client address
-- (infergate.admission.auththrottle, auth.fail_burst / auth.fail_rate_per_s), and for all
-- addresses together (50 times that): past either budget a key without a cached answer
-- gets 429 auth_throttled without a Redis call,
-- unless its digest is one of the key store's (infergate.admission.knownkeys, refreshed
-- every few seconds): a valid key is not locked out by a flood from its address.
-- 429, not 401: the key was not checked (it may be valid, e.g. a client behind the same
-- NAT as the attacker), and OpenAI clients retry a 429 after Retry-After. Requests that
-- look up one key with no answer cached, or one whose answer expired, at once share the
-- first one's lookup (first_lookup below), so a client starting hundreds of requests with
-- a valid key spends no budget and a busy key costs Redis one lookup per expiry.
--
-- Key store lost: when a key this edge knew as valid (a cached answer, or with none
-- cached the record infergate.admission.knownkeys holds, also from the file an nginx
-- started with) is missing from Redis, the marker
-- keynames.apikeys_marker (set by every write of the keys) tells why. Present: the
-- key was deleted, 401. Missing: Redis came back empty (a lost append-only file); the
-- edge keeps honouring the key (its answer renewed, counted in auth_kept) until the keys
-- are written again (the control plane's restore, infergate keys import), logs it at
-- ERR (at most once a minute) and shows auth_store_missing = 1 in its admission counters
-- (/infergate/status, the edge stats the control plane reads). Keys it knew as revoked,
-- and keys it never saw, stay refused.
--
-- On success: req.tenant (the response cache keys on it), req.key_id (8 hex, safe to
-- log), req.key_limits = {rpm = n|nil, tpm = n|nil}, req.key_share = {weight, priority}
-- when the key sets either (the fair share, infergate.admission.fairshare); the
-- Authorization and x-api-key headers are removed from the request so the nodes never
-- see the key. The key itself is never
-- logged or stored (a worker keeps the digests of the keys in use in its own memory).
--
-- Errors: 401 {"type": "invalid_request_error", "code": "invalid_api_key"} with
-- WWW-Authenticate: Bearer; 429 {"type": "rate_limit_error", "code": "auth_throttled"}
-- with Retry-After; 503 {"type": "service_unavailable", "code": "auth_unavailable"}.
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local options = require("infergate.admission.options")
local keynames = require("infergate.redis.keynames")
local knownkeys = require("infergate.admission.knownkeys")
local cachekey = require("infergate.cache.key")  -- sha256_hex (libcrypto via FFI)
local ar = require("infergate.admission.redis")
local astats = require("infergate.admission.stats")
local memo = require("infergate.core.memo")
local throttle = require("infergate.admission.auththrottle")

local config = require("infergate.core.config")

local _M = {}

local type = type
local null = cjson.null

-- Longer values are not keys (ours are 46 characters); they are refused unhashed.
_M.MAX_KEY_LEN = 256

local function dict(ok)
    local shared = ngx.shared
    if ok then
        return shared[options.DICT_AUTH]
    end
    -- a hand-written config without the dict of invalid keys: both in one
    return shared[options.DICT_AUTH_NEG] or shared[options.DICT_AUTH]
end

-- The token of an "Authorization: Bearer <token>" value, or nil.
function _M.bearer(value)
    if type(value) ~= "string" then
        return nil
    end
    local scheme, token = value:match("^%s*(%S+)%s+(%S+)%s*$")
    if not scheme or scheme:lower() ~= "bearer" then
        return nil
    end
    return token
end

-- The priority classes a key may name (infergate.admission.fairqueue).
local PRIORITIES = { critical = true, standard = true, sheddable = true }

local function limit(v)
    if type(v) == "number" and v >= 1 then
        return v
    end
    return nil
end

-- A cache entry from the HGET reply (a JSON record string or ngx.null).
function _M.from_record(raw, now)
    if type(raw) ~= "string" then
        return { ok = false, at = now }
    end
    local r = cjson.decode(raw)
    if type(r) ~= "table" or type(r.tenant) ~= "string" or r.tenant == "" then
        return { ok = false, at = now }
    end
    if r.revoked ~= nil and r.revoked ~= null then
        return { ok = false, at = now }
    end
    return {
        ok = true,
        at = now,
        id = type(r.id) == "string" and r.id or "",
        tenant = r.tenant,
        rpm = limit(r.rpm),
        tpm = limit(r.tpm),
        weight = type(r.weight) == "number" and r.weight > 0 and r.weight or nil,
        priority = PRIORITIES[r.priority] and r.priority or nil,
    }
end

-- Decoded cache answers by their JSON text, per worker (read-only tables; emptied when
-- MEMO_MAX answers are held): a key in use costs a dict read, not a JSON decode.
_M.MEMO_MAX = 1000
local answers = memo.new(_M.MEMO_MAX)

local function decode(raw)
    if not raw then
        return nil
    end
    local e = answers:get(raw)
    if e then
        return e
    end
    e = cjson.decode(raw)
    if type(e) ~= "table" or type(e.at) ~= "number" then
        return nil
    end
    return answers:set(raw, e)
end

local first_lookup, wait_for_answer

local function cache_get(digest)
    local k = "k:" .. digest
    return decode(dict(true):get(k)) or decode(dict(false):get(k))
end

local function cache_set(digest, e, o)
    local ttl = e.ok and o.cache_ttl_s or o.negative_ttl_s
    local keep = ttl > o.stale_ttl_s and ttl or o.stale_ttl_s
    local k = "k:" .. digest
    local into, other = dict(e.ok), dict(not e.ok)
    into:set(k, cjson.encode(e), keep)
    if other ~= into then
        other:delete(k)  -- a revoked key forgets it was valid (and back)
    end
end

local function hget_key(c, digest)
    return c:command("HGET", keynames.apikeys, digest)
end

local function marker_exists(c)
    return c:command("EXISTS", keynames.apikeys_marker)
end

-- Redis answered without the record of a key this edge knew as valid (e). Returns the
-- renewed entry when the key store is missing (keep honouring it), false when the
-- store is intact (the key is gone), or nil, err when Redis cannot tell.
local function keep_known(digest, e, now, o)
    local n, err = ar.run(marker_exists)
    if n == 1 then
        return false
    end
    if n ~= 0 then
        return nil, err or "EXISTS failed"
    end
    local kept = { ok = true, at = now, id = e.id, tenant = e.tenant, rpm = e.rpm, tpm = e.tpm,
                   weight = e.weight, priority = e.priority }
    cache_set(digest, kept, o)
    astats.incr("auth_kept")
    astats.flag("auth_store_missing", math.max(2 * o.cache_ttl_s, 10))
    if ngx.shared[options.DICT_LIMITS]:add("auth_store_missing_logged", true, 60) then
        ngx.log(ngx.ERR, "infergate: API KEY STORE MISSING: Redis answers without ",
            keynames.apikeys_marker, " (it came back empty); honouring the valid keys this ",
            "edge knew, revoked and unknown keys stay refused; restore the keys with ",
            "`infergate keys import`")
    end
    return kept
end

-- The entry of a key this edge knows as valid: its cached answer, else (nothing cached:
-- an nginx started since, an idle key) the key store's record held by the worker
-- (infergate.admission.knownkeys, kept over a lost store). nil when neither says valid;
-- a cached refusal is never overruled.
local function known_valid(digest, e, now)
    if e then
        return e.ok and e or nil
    end
    local rec = knownkeys.record(digest)
    local k = rec and _M.from_record(rec, now)
    return k and k.ok and k or nil
end

-- The fresh answer of Redis for digest (e: the cached entry, possibly stale), or nil, err.
local function fetch(digest, e, now, o)
    local raw, err = ar.run(hget_key, digest)
    local kept
    local valid = raw and type(raw) ~= "string" and known_valid(digest, e, now)
    if valid then
        -- a key known as valid is gone: deleted, or the key store was lost
        kept, err = keep_known(digest, valid, now, o)
        if kept then
            return kept
        elseif kept == nil then
            raw = nil
        end
    end
    if not raw then
        -- nil: Redis unreachable (or backed off); false: an error reply. Either way the
        -- key cannot be checked now.
        if e and now - e.at < math.max(o.stale_ttl_s, o.cache_ttl_s) then
            -- a valid answer the store's records read since contradict (the key was
            -- revoked or deleted before the outage) is not used
            local newer = nil
            if e.ok then
                newer = knownkeys.newer_record(digest, e.at)
            end
            if newer == false or (newer and not _M.from_record(newer, now).ok) then
                astats.incr("auth_static")
                return { ok = false, at = now }
            end
            return e
        end
        local rec = knownkeys.record(digest)
        if rec then
            -- the key store's record as of the last refresh (infergate.admission.knownkeys)
            astats.incr("auth_static")
            return _M.from_record(rec, now)
        end
        return nil, err
    end
    local fresh = _M.from_record(raw, now)
    cache_set(digest, fresh, o)
    return fresh
end

-- A key whose cached answer is missing or past its TTL, looked up by many requests at
-- once (a client starting hundreds of requests with a key this edge has not seen, or
-- any busy key, valid or not, each time its answer expires): the first one asks Redis,
-- the others wait for its answer, up to LOOKUP_WAIT_S, instead of each asking Redis
-- (1,000 connections on one revoked key sent Redis about 300 HGETs every time its
-- answer expired) and each taking from the address's budget of failed lookups (which
-- would answer a valid key 429 auth_throttled). Returns the dict holding the lock when
-- this request asks, false when another one does, nil without the dict.
_M.LOOKUP_WAIT_S = 0.3
local LOOKUP_POLL_S = 0.005

function first_lookup(digest)
    local d = ngx.shared[options.DICT_AUTH_FAIL]
    if not d then
        return nil
    end
    if d:add("lk:" .. digest, true, 1) then
        return d
    end
    return false
end

-- The entry another request's lookup cached (one cached after `after`, the time of the
-- expired entry this request holds, when given), or nil after LOOKUP_WAIT_S or once that
-- lookup ended without caching one (Redis did not answer it). A wait that runs out is
-- counted (auth_wait_expired).
function wait_for_answer(digest, lock, after)
    for _ = 1, _M.LOOKUP_WAIT_S / LOOKUP_POLL_S do
        ngx.sleep(LOOKUP_POLL_S)
        local e = cache_get(digest)
        if e and (not after or e.at > after) then
            return e
        end
        if after and not lock:get("lk:" .. digest) then
            return nil
        end
    end
    astats.incr("auth_wait_expired")
    return nil
end

-- Cache entry for a key digest: cached, fetched, or stale when Redis is down.
-- addr: the client address, whose failed lookups are limited (nil: not limited).
-- Returns the entry, or nil, err when the key cannot be checked ("throttled", wait_s
-- when addr is past its budget of failed lookups).
function _M.lookup(digest, now, o, addr)
    local e = cache_get(digest)
    if e then
        local ttl = e.ok and o.cache_ttl_s or o.negative_ttl_s
        if now - e.at < ttl then
            return e
        end
    end
    local lock = first_lookup(digest)
    if lock == false then
        local w = wait_for_answer(digest, ngx.shared[options.DICT_AUTH_FAIL], e and e.at)
        if w then
            return w
        end
    end
    local charged = not (e and e.ok)
    local charged_all = false
    if charged then
        local wait = throttle.take(addr, now, o)
        if wait <= 0 then
            -- and from the budget of all addresses together (a flood spread over many)
            wait = throttle.take_all(now, o)
            charged_all = wait <= 0
            if not charged_all then
                throttle.refund(addr, now, o)
            end
        end
        if wait > 0 then
            if not knownkeys.has(digest) then
                if lock then
                    lock:delete("lk:" .. digest)  -- no lookup: its waiters go on at once
                end
                return nil, "throttled", wait
            end
            charged = false   -- a key of the store: looked up whatever its address did
        end
    end
    local fresh, err = fetch(digest, e, now, o)
    if lock then
        lock:delete("lk:" .. digest)
    end
    if charged and not (fresh and not fresh.ok) then
        throttle.refund(addr, now, o)  -- a valid key, or none could be checked
        if charged_all then
            throttle.refund_all(now, o)
        end
    end
    return fresh, err
end

-- SHA-256 hex of the key of an Authorization value, per worker, by the header value
-- (emptied when MEMO_MAX values are held): a key in use is parsed and hashed once, not on
-- every request. The memo lives only in this worker's memory.
local digests = memo.new(_M.MEMO_MAX)

local function unauthorized(message)
    astats.incr("auth_rejected")
    return {
        status = 401,
        message = message,
        type = "invalid_request_error",
        code = "invalid_api_key",
        headers = { ["WWW-Authenticate"] = 'Bearer realm="infergate"' },
    }
end

-- Access step: nil to continue, or an error table (see infergate.access).
function _M.step(req)
    local o = config.get().auth
    if o.mode ~= "required" then
        req.tenant = options.DEFAULT_TENANT
        return nil
    end
    local value = ngx_var("http_authorization")
    if not value or not value:find("%S") then
        -- the header Anthropic's SDK sends its key in (api_key=...), with no Authorization
        local xkey = ngx_var("http_x_api_key")
        if xkey and xkey:find("%S") then
            -- the key alone, or (some clients) with the Bearer scheme before it
            value = xkey:find("^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s") and xkey or "Bearer " .. xkey
        end
    end
    local digest = value and digests:get(value)
    if not digest then
        local token = _M.bearer(value)
        if not token and value and value:find("%S") and not value:find("^%s*[Bb][Ee][Aa][Rr][Ee][Rr]%s*$") then
            return unauthorized("The Authorization header must name the Bearer scheme: "
                .. "'Authorization: Bearer YOUR_KEY' (the value sent has no 'Bearer ' "
                .. "before the key, or more than one word after it).")
        elseif not token then
            return unauthorized("You didn't provide an API key. Send it in the Authorization "
                .. "header: 'Authorization: Bearer YOUR_KEY' (or in 'x-api-key: YOUR_KEY').")
        end
        if #token > _M.MAX_KEY_LEN then
            return unauthorized("Incorrect API key provided.")
        end
        digest = digests:set(value, cachekey.sha256_hex(token))
    end
    local e, err, wait = _M.lookup(digest, ngx_now(), o, ngx_var("remote_addr"))
    if not e and err == "throttled" then
        astats.incr("auth_throttled")
        return {
            status = 429,
            message = "Too many requests with unknown or invalid API keys from your "
                .. "address; retry shortly (a key created in the last seconds is known "
                .. "within 5 s).",
            type = "rate_limit_error",
            code = "auth_throttled",
            headers = { ["Retry-After"] = tostring(math.ceil(wait)) },
        }
    end
    if not e then
        -- err: the outage is logged once by infergate.admission.redis
        astats.incr("auth_unavailable")
        return {
            status = 503,
            message = "The API key cannot be checked right now (the key store is unreachable); "
                .. "retry shortly.",
            type = "service_unavailable",
            code = "auth_unavailable",
            headers = { ["Retry-After"] = "1" },
        }
    end
    if not e.ok then
        return unauthorized("Incorrect API key provided.")
    end
    req.tenant = e.tenant
    req.key_id = e.id
    req.key_limits = { rpm = e.rpm, tpm = e.tpm }
    if e.weight or e.priority then
        req.key_share = { weight = e.weight, priority = e.priority }
    end
    ngx.req.clear_header("Authorization")
    ngx.req.clear_header("x-api-key")
    return nil
end

return _M
