-- JSON text of Lua values, in two spellings that share one encoder.
--
--   local jsonenc = require("infergate.core.jsonenc")
--   local text, err = jsonenc.encode(v)                       -- default spelling
--   local text, err = jsonenc.encode(v, { canonical = true })  -- cache-key spelling
--   jsonenc.seq_len(t)  -- n when t is a sequence 1..n (0 when empty), else nil
--
-- Both spellings: no spaces; object members sorted by key (byte order); `"` and `\` escaped
-- and every other byte >= 0x20 written raw (UTF-8 passes through unchanged); nil and
-- cjson.null are null; an unmarked non-empty sequence 1..n is an array; a number that is
-- whole with absolute value below 2^53 is written as an integer (-0 as 0).
--
-- Default spelling (answers served from the cache, entries and jobs written to Redis):
--   - a table with ARRAY_MT is an array (of its elements 1..#t, even when empty), with
--     OBJECT_MT an object; any other empty table is {}. Debian's lua-cjson (2.1.0) cannot
--     tell [] from {} and has no empty-array marker, hence these marks.
--   - \n, \r, \t as short escapes, other bytes 0x00-0x1F as \u00xx (lowercase hex);
--   - other numbers as %.14g when that reads back as the same double, else %.17g;
--     NaN and +-Inf as null;
--   - only string keys are written; values JSON cannot hold (functions, other userdata,
--     cdata, ...) as null; a table more than 100 levels below the top one is an error.
-- Canonical spelling (controlplane/cache/key.py gives its specification; the Python and
-- the Lua cache keys must match byte for byte):
--   - marks are not looked at; an empty table is [];
--   - every byte 0x00-0x1F as \u00xx (lowercase hex);
--   - other numbers as %.17g (NaN and +-Inf as C printf writes them);
--   - non-string keys are written as tostring(key) and their values looked up by
--     tonumber(key); values JSON cannot hold and a table more than 200 levels below
--     the top one are errors.
-- Errors are returned as nil, err (err: "nesting too deep" or "not a JSON value: <type>").
local cjson = require("cjson.safe")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local next = next
local pcall = pcall
local error = error
local getmetatable = getmetatable
local tostring = tostring
local tonumber = tonumber
local floor = math.floor
local abs = math.abs
local huge = math.huge
local format = string.format
local char = string.char
local gsub = string.gsub
local concat = table.concat
local sort = table.sort
local null = cjson.null

local MAX_SAFE = 2 ^ 53
local re_find = ngx.re.find
-- A byte that needs an escape (control, quote, backslash) or may need NFC (non-ASCII).
local PLAIN_UNSAFE = [=[[\x00-\x1f"\\\x80-\xff]]=]

_M.ARRAY_MT = { __jsontype = "array" }
_M.OBJECT_MT = { __jsontype = "object" }
local ARRAY_MT, OBJECT_MT = _M.ARRAY_MT, _M.OBJECT_MT

-- n when t is a sequence 1..n (only number keys, none missing; 0 when empty), else nil.
local function seq_len(t)
    local n = 0
    for k in pairs(t) do
        if type(k) ~= "number" then
            return nil
        end
        n = n + 1
    end
    for i = 1, n do
        if t[i] == nil then
            return nil
        end
    end
    return n
end
_M.seq_len = seq_len

-- ------------------------------------------------------------------ spellings

local function escapes(short)
    local esc = { ['"'] = '\\"', ["\\"] = "\\\\" }
    if short then
        esc["\n"], esc["\r"], esc["\t"] = "\\n", "\\r", "\\t"
    end
    for c = 0, 31 do
        local ch = char(c)
        if not esc[ch] then
            esc[ch] = format("\\u%04x", c)
        end
    end
    return esc
end

local function number_default(v)
    if v ~= v or v == huge or v == -huge then
        return "null"
    end
    if v == floor(v) and abs(v) < MAX_SAFE then
        return format("%d", v)
    end
    local s = format("%.14g", v)
    if tonumber(s) ~= v then
        s = format("%.17g", v)
    end
    return s
end

-- Set when a canonical encoding writes a number of absolute value 2^53 or more (or an
-- infinity): such a double stands for many decimal texts (9007199254740993 and
-- 9007199254740992 decode alike), so the text does not name the value sent.
local inexact = false

local function number_canonical(v)
    if v == floor(v) and abs(v) < MAX_SAFE then
        return format("%d", v)
    end
    if abs(v) >= MAX_SAFE then
        inexact = true
    end
    return format("%.17g", v)
end

local DEFAULT = {
    esc = escapes(true),
    number = number_default,
    max_depth = 100,
    marks = true,           -- ARRAY_MT / OBJECT_MT decide
    empty_array = false,    -- a plain empty table is {}
    all_keys = false,       -- non-string keys left out
    strict = false,         -- values JSON cannot hold: null
}

local CANONICAL = {
    esc = escapes(false),
    number = number_canonical,
    max_depth = 200,
    marks = false,
    empty_array = true,     -- every empty table is []
    all_keys = true,        -- non-string keys as tostring(key)
    strict = true,          -- values JSON cannot hold: error
    normalize = require("infergate.core.unicode").nfc, -- strings (and keys) in NFC
}

-- ------------------------------------------------------------------ encoder

-- enc_string(s) of a spelling: quoted, escaped with `esc`, in NFC when `normalize` is
-- given (only strings with a byte that needs it).
local function string_encoder(esc, normalize)
    return function(s)
        -- most strings need neither escapes nor normalisation: one PCRE scan (FFI, no
        -- trace abort) instead of a Lua pattern pass
        if not re_find(s, PLAIN_UNSAFE, "jo") then
            return '"' .. s .. '"'
        end
        if normalize then
            s = normalize(s)
        end
        return '"' .. gsub(s, '[%z\1-\31"\\]', esc) .. '"'
    end
end

-- n when t is written as an array of n elements, nil when as an object.
local function array_len(t, marks, empty_array)
    local mt = marks and getmetatable(t) or nil
    if mt == ARRAY_MT then
        return #t
    elseif mt == OBJECT_MT then
        return nil
    end
    if next(t) == nil then
        return empty_array and 0 or nil
    end
    return seq_len(t)
end

-- The keys of an object in the order they are written (byte order): string keys, and
-- with all_keys the others as tostring(key).
local function object_keys(t, all_keys)
    local ks = {}
    for k in pairs(t) do
        if type(k) == "string" then
            ks[#ks + 1] = k
        elseif all_keys then
            ks[#ks + 1] = tostring(k)
        end
    end
    sort(ks)
    return ks
end

-- An encode(v) function for one spelling; errors are raised (caught by _M.encode).
local function encoder(mode)
    local number, max_depth = mode.number, mode.max_depth
    local marks, empty_array, all_keys, strict =
        mode.marks, mode.empty_array, mode.all_keys, mode.strict
    local enc_string = string_encoder(mode.esc, mode.normalize)

    local enc

    local function enc_table(t, out, depth)
        if depth > max_depth then
            error("nesting too deep", 0)
        end
        local n = array_len(t, marks, empty_array)
        if n then
            out[#out + 1] = "["
            for i = 1, n do
                if i > 1 then
                    out[#out + 1] = ","
                end
                enc(t[i], out, depth + 1)
            end
            out[#out + 1] = "]"
            return
        end
        out[#out + 1] = "{"
        for i, k in ipairs(object_keys(t, all_keys)) do
            if i > 1 then
                out[#out + 1] = ","
            end
            out[#out + 1] = enc_string(k)
            out[#out + 1] = ":"
            local v = t[k]
            if v == nil and all_keys then
                v = t[tonumber(k)]
            end
            enc(v, out, depth + 1)
        end
        out[#out + 1] = "}"
    end

    enc = function(v, out, depth)
        local t = type(v)
        if v == nil or v == null then
            out[#out + 1] = "null"
        elseif t == "boolean" then
            out[#out + 1] = v and "true" or "false"
        elseif t == "number" then
            out[#out + 1] = number(v)
        elseif t == "string" then
            out[#out + 1] = enc_string(v)
        elseif t == "table" then
            enc_table(v, out, depth)
        elseif strict then
            error("not a JSON value: " .. t, 0)
        else
            out[#out + 1] = "null"
        end
    end

    return function(v)
        local out = {}
        local ok, err = pcall(enc, v, out, 0)
        if not ok then
            return nil, tostring(err)
        end
        return concat(out)
    end
end

local encode_default = encoder(DEFAULT)
local encode_canonical = encoder(CANONICAL)

-- True when the last canonical encoding wrote a number of absolute value 2^53 or more
-- (whose decimal text the decoder may have rounded).
function _M.canonical_inexact()
    return inexact
end

-- JSON text of v: the canonical spelling when opts.canonical is true, else the default
-- one (see the top of this file). Returns the text, or nil, err.
function _M.encode(v, opts)
    if opts ~= nil and opts.canonical then
        inexact = false
        return encode_canonical(v)
    end
    return encode_default(v)
end

return _M
