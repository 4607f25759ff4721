-- A bounded worker-local memo: a table that starts afresh once it holds `max` keys (no
-- eviction order to keep up, so a get is one table read).
--
--   local memo = require("infergate.core.memo")
--   local m = memo.new(1000)
--   local v = m:get(k)            -- nil when absent
--   m:set(k, v)                   -- returns v
--   local key_of = memo.prefixer("if:")
--   key_of("node-a")              -- "if:node-a", built once
local _M = {}

local setmetatable = setmetatable
local mt = { __index = _M }

-- A memo of at most `max` keys.
function _M.new(max)
    return setmetatable({ t = {}, n = 0, max = max }, mt)
end

function _M:get(k)
    return self.t[k]
end

-- Stores v under k (v must not be nil); a new key in a full memo empties it first.
function _M:set(k, v)
    local t = self.t
    if t[k] == nil then
        if self.n >= self.max then
            t = {}
            self.t = t
            self.n = 0
        end
        self.n = self.n + 1
    end
    t[k] = v
    return v
end

-- A function name -> prefix .. name that builds each string once: for names of a
-- bounded set (the nodes of the registry), on paths run for every request.
function _M.prefixer(prefix)
    local built = {}
    return function(name)
        local k = built[name]
        if not k then
            k = prefix .. name
            built[name] = k
        end
        return k
    end
end

return _M
