-- The embedder as the semantic lookup sees it: one call of its POST /v1/lookups through
-- the internal location, and the embedder circuit breaker (see infergate.cache.lookup).
local cjson = require("cjson.safe")
local ngx_now = require("infergate.core.ngxapi").now
local replay = require("infergate.cache.replay")
local prometheus = require("infergate.core.prometheus")
local shared = require("infergate.cache.shared")

local _M = {}

local type = type
local tostring = tostring
local log = ngx.log
local WARN = ngx.WARN

-- Embedder circuit breaker (see the header), shared by the workers in the cache dict:
-- "emb:fails" failed lookup calls in a row, "emb:open" present while open (its TTL the
-- cooldown), "emb:ok_at" when a lookup call last succeeded. A call that timed out within
-- EMBEDDER_BUSY_S of a success is a busy embedder (a burst queued behind the model),
-- not a hung one: it is a BYPASS but does not count toward opening the breaker, so
-- a burst does not turn the semantic cache off for the cooldown after it.
_M.EMBEDDER_BREAKER_FAILURES = 5
_M.EMBEDDER_COOLDOWN_S = 5
_M.EMBEDDER_BUSY_S = 1

function _M.open()
    local dict = ngx.shared[shared.DICT]
    return dict ~= nil and dict:get("emb:open") ~= nil
end

local function embedder_result(ok, why)
    local dict = ngx.shared[shared.DICT]
    if not dict then
        return
    end
    if ok then
        dict:set("emb:ok_at", ngx_now())
        local before = dict:get("emb:fails") or 0
        if before ~= 0 then
            dict:set("emb:fails", 0)
            if before >= _M.EMBEDDER_BREAKER_FAILURES then
                log(WARN, "infergate: the embedder answers lookups again")
            end
        end
        return
    end
    local fails = dict:incr("emb:fails", 1, 0)
    if fails and fails >= _M.EMBEDDER_BREAKER_FAILURES and dict:get("emb:open") == nil then
        dict:set("emb:open", ngx_now(), _M.EMBEDDER_COOLDOWN_S)
        if fails == _M.EMBEDDER_BREAKER_FAILURES then
            log(WARN, "infergate: ", fails, " semantic lookups in a row failed (", why,
                "): lookups skipped for ", _M.EMBEDDER_COOLDOWN_S, " s at a time until the ",
                "embedder answers again")
        end
    end
end

local function embedder_busy()
    local dict = ngx.shared[shared.DICT]
    local ok_at = dict and dict:get("emb:ok_at")
    return ok_at ~= nil and ngx_now() - ok_at < _M.EMBEDDER_BUSY_S
end

-- One call of the embedder's POST /v1/lookups for `items` (lookup bodies), through the
-- internal location: the list of answers, or nil, err. Feeds the breaker: one outcome per
-- call.
function _M.send_lookups(items)
    prometheus.semantic_call(#items)
    local body = replay.encode({ lookups = items, brief = true })
    local res = ngx.location.capture(shared.LOOKUP_LOCATION, { method = ngx.HTTP_POST, body = body })
    if not res then
        embedder_result(false, "subrequest failed")
        return nil, "embedder subrequest failed"
    end
    -- a timeout (504, or an answer cut while it was being read) soon after a lookup that
    -- succeeded: the embedder is busy, not hung
    local timed_out = res.status == ngx.HTTP_GATEWAY_TIMEOUT or res.truncated
    if timed_out and embedder_busy() then
        return nil, "embedder busy (lookup timed out)"
    end
    if res.status == ngx.HTTP_GATEWAY_TIMEOUT then -- nginx's own, as the 502 below
        embedder_result(false, "timed out")
        return nil, "embedder timed out (no answer within the lookup budget)"
    end
    if res.status == ngx.HTTP_BAD_GATEWAY then -- nginx's own: no connection, or not HTTP
        embedder_result(false, "unreachable")
        return nil, "embedder unreachable (connection refused or reset, or not HTTP)"
    end
    if res.status ~= 200 then
        if res.status >= 500 then
            embedder_result(false, "answered " .. tostring(res.status))
        end
        return nil, "embedder answered " .. tostring(res.status)
    end
    if res.truncated then
        embedder_result(false, "answer truncated")
        return nil, "embedder answer truncated"
    end
    local doc = cjson.decode(res.body or "")
    local results = type(doc) == "table" and doc.results
    if type(results) ~= "table" then
        embedder_result(false, "answer not JSON")
        return nil, "embedder answer is not a list of lookup results"
    end
    embedder_result(true)
    return results
end

return _M
