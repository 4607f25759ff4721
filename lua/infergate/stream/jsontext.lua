-- Edits of JSON text that keep everything else byte for byte (infergate.stream.splice):
-- the lua-cjson of the edge decodes [] and {} alike and encodes an empty table as {},
-- so an event or a request body is never decoded and encoded again where an empty
-- array may sit ("choices": [] of a usage chunk, "stop": [], "tools": []). Pure.
--
--   set_string(text, key, value)   the first "key": "<string>" member with value
--                                  (JSON-encoded) instead; text unchanged without one
--   add_number(text, key, n)       every "key": <integer> member increased by n
--   decode(text) / encode(value)   a JSON document decoded and encoded again with its
--                                  empty arrays kept (marked before decoding)
local cjson = require("cjson.safe")

local _M = {}

local find = string.find
local sub = string.sub
local byte = string.byte
local re_gsub = ngx.re.gsub

-- The index of the quote that ends the JSON string whose opening quote is at `i`.
local function string_end(text, i)
    local j = i + 1
    local n = #text
    while j <= n do
        local c = byte(text, j)
        if c == 92 then       -- backslash: skip the escaped character
            j = j + 2
        elseif c == 34 then
            return j
        else
            j = j + 1
        end
    end
    return nil
end

function _M.set_string(text, key, value)
    local s, e = find(text, '"' .. key .. '"%s*:%s*"')
    if not s then
        return text
    end
    local q = string_end(text, e)
    if not q then
        return text
    end
    return sub(text, 1, e - 1) .. cjson.encode(value) .. sub(text, q + 1)
end

function _M.add_number(text, key, n)
    return (text:gsub('("' .. key .. '"%s*:%s*)(%d+)', function(pre, v)
        return pre .. tostring(tonumber(v) + n)
    end))
end

-- A string no JSON text holds as a whole value by chance: stands for [] while decoded.
local EMPTY = "\1infergate empty array\1"
-- JSON strings (kept as they are) or an empty array.
local RE_EMPTY = [=["(?:[^"\\]++|\\.)*+"|\[\s*\]]=]

function _M.decode(text)
    local marked = re_gsub(text, RE_EMPTY, function(m)
        if byte(m[0], 1) == 34 then
            return m[0]
        end
        return cjson.encode(EMPTY)
    end, "jo")
    return cjson.decode(marked or text)
end

function _M.encode(value)
    local text = cjson.encode(value)
    if not text then
        return nil
    end
    local quoted = cjson.encode(EMPTY)
    local out, pos, parts = {}, 1, 0
    while true do
        local s, e = find(text, quoted, pos, true)
        if not s then
            break
        end
        parts = parts + 1
        out[parts] = sub(text, pos, s - 1) .. "[]"
        pos = e + 1
    end
    out[parts + 1] = sub(text, pos)
    return table.concat(out)
end

return _M
