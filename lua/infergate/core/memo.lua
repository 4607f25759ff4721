-- A bounded worker-local memo: a table that starts afresh once it holds `max` keys (no
-- eviction order to keep up, so a get is one table read).
--
--   local memo = require("infergate.core.memo")
--   local m = memo.new(1000)
--   local v = m:get(k)            -- nil when absent
--   m:set(k, v)                   -- returns v
--   local key_of = memo.prefixer("if:")
--   key_of("node-a")              -- "if:node-a", built once
--   local key = memo.keyer()
--   key("xy:", "node-a")          -- "xy:node-a", built once
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

-- A function (prefix, name) -> prefix .. name that builds each string once, for the
-- shared-dict keys of a node (names of a bounded set) on paths run for every request:
-- a table read instead of a concatenation, which hashes a new string and leaves
-- garbage. Starts afresh past `max` keys (default 4096).
function _M.keyer(max)
    max = max or 4096
    local built, n = {}, 0
    return function(prefix, name)
        local by = built[prefix]
        if not by then
            by = {}
            built[prefix] = by
        end
        local k = by[name]
        if not k then
            if n >= max then
                built, n = {}, 0
                by = {}
                built[prefix] = by
            end
            k = prefix .. name
            by[name] = k
            n = n + 1
        end
        return k
    end
end

return _M
