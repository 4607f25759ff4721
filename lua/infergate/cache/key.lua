-- Response-cache keys: exact key and semantic namespace of a request, as SHA-256 hex.
--
--   local ck = require("infergate.cache.key")
--   local k = ck.keys("/v1/chat/completions", body_table, "default")
--   -- k.exact (64 hex), k.namespace (64 hex or nil), k.text (last user text or nil)
--
-- The specification (canonical text, excluded fields, namespace rule, no Unicode
-- normalisation) is in controlplane/cache/key.py, which computes the same keys in Python;
-- tests/parity/test_cache_keys.py compares both on many bodies. Pure functions, no I/O.
--
-- SHA-256: Debian's nginx-lua has no sha256 (lua-resty-string is not packaged), so the
-- one-shot SHA256() of the libcrypto that nginx itself links is called through the FFI;
-- when that symbol is missing (an nginx built without OpenSSL) a pure-Lua SHA-256 on the
-- `bit` library is used. Both are tested against Python's hashlib.
local bit = require("bit")
local ffi = require("ffi")
local cjson = require("cjson.safe")
local jsonenc = require("infergate.core.jsonenc")

local _M = {}

local type = type
local pairs = pairs
local ipairs = ipairs
local floor = math.floor
local format = string.format
local concat = table.concat
local byte = string.byte
local char = string.char
local null = cjson.null
local array_len = jsonenc.seq_len

local SCHEMA = 1

_M.EXCLUDED = { stream = true, stream_options = true, user = true }

-- ------------------------------------------------------------------ SHA-256

local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
local rshift, lshift, ror, tobit, tohex = bit.rshift, bit.lshift, bit.ror, bit.tobit, bit.tohex

local K = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
}
for i = 1, 64 do
    K[i] = tobit(K[i])
end

-- Pure-Lua SHA-256 of a byte string; returns 64 lowercase hex digits.
function _M.sha256_hex_lua(msg)
    local H = {
        tobit(0x6a09e667), tobit(0xbb67ae85), tobit(0x3c6ef372), tobit(0xa54ff53a),
        tobit(0x510e527f), tobit(0x9b05688c), tobit(0x1f83d9ab), tobit(0x5be0cd19),
    }
    local len = #msg
    local tail = len % 64
    local pad = (tail < 56) and (56 - tail) or (120 - tail)
    local bits = len * 8
    local hi = floor(bits / 4294967296)
    local lo = bits % 4294967296
    msg = msg .. "\128" .. string.rep("\0", pad - 1)
        .. char(band(rshift(hi, 24), 255), band(rshift(hi, 16), 255), band(rshift(hi, 8), 255), band(hi, 255))
        .. char(band(rshift(lo, 24), 255), band(rshift(lo, 16), 255), band(rshift(lo, 8), 255), band(lo, 255))
    local W = {}
    for chunk = 1, #msg, 64 do
        for i = 0, 15 do
            local a, b, c, d = byte(msg, chunk + i * 4, chunk + i * 4 + 3)
            W[i] = bor(lshift(a, 24), lshift(b, 16), lshift(c, 8), d)
        end
        for i = 16, 63 do
            local w15, w2 = W[i - 15], W[i - 2]
            local s0 = bxor(ror(w15, 7), ror(w15, 18), rshift(w15, 3))
            local s1 = bxor(ror(w2, 17), ror(w2, 19), rshift(w2, 10))
            W[i] = tobit(W[i - 16] + s0 + W[i - 7] + s1)
        end
        local a, b, c, d, e, f, g, h = H[1], H[2], H[3], H[4], H[5], H[6], H[7], H[8]
        for i = 0, 63 do
            local S1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
            local ch = bxor(band(e, f), band(bnot(e), g))
            local t1 = tobit(h + S1 + ch + K[i + 1] + W[i])
            local S0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
            local maj = bxor(band(a, b), band(a, c), band(b, c))
            local t2 = tobit(S0 + maj)
            h, g, f, e, d, c, b, a = g, f, e, tobit(d + t1), c, b, a, tobit(t1 + t2)
        end
        H[1], H[2], H[3], H[4] = tobit(H[1] + a), tobit(H[2] + b), tobit(H[3] + c), tobit(H[4] + d)
        H[5], H[6], H[7], H[8] = tobit(H[5] + e), tobit(H[6] + f), tobit(H[7] + g), tobit(H[8] + h)
    end
    local out = {}
    for i = 1, 8 do
        out[i] = tohex(H[i], 8)
    end
    return concat(out)
end

local ffi_sha256
do
    local ok = pcall(ffi.cdef, "unsigned char *SHA256(const unsigned char *d, size_t n, unsigned char *md);")
    if ok then
        local found, fn = pcall(function()
            return ffi.C.SHA256
        end)
        if found and fn ~= nil then
            local buf = ffi.new("unsigned char[32]")
            local hex = {}
            -- byte -> two hex digits, worked out once (a string.format per byte costs
            -- more than the hash itself)
            local HEX = {}
            for b = 0, 255 do
                HEX[b] = format("%02x", b)
            end
            ffi_sha256 = function(msg)
                ffi.C.SHA256(msg, #msg, buf)
                for i = 0, 31 do
                    hex[i + 1] = HEX[buf[i]]
                end
                return concat(hex)
            end
        end
    end
end
_M.ffi_available = ffi_sha256 ~= nil

-- SHA-256 hex of a byte string (libcrypto through the FFI, else pure Lua).
function _M.sha256_hex(msg)
    if ffi_sha256 then
        return ffi_sha256(msg)
    end
    return _M.sha256_hex_lua(msg)
end

-- ------------------------------------------------------------------ canonical text

local CANONICAL = { canonical = true }

-- Canonical text of a decoded JSON value (see controlplane/cache/key.py; written by
-- infergate.core.jsonenc in its canonical spelling). Returns the text, or nil, err for values
-- JSON cannot hold or nesting deeper than 200.
function _M.canonical(v)
    return jsonenc.encode(v, CANONICAL)
end

-- ------------------------------------------------------------------ keys

local function text_of(content)
    if type(content) == "string" then
        return content
    end
    if type(content) == "table" and array_len(content) then
        local texts = {}
        for _, p in ipairs(content) do
            if type(p) == "table" and p.type == "text" and type(p.text) == "string" then
                texts[#texts + 1] = p.text
            end
        end
        if #texts > 0 then
            return concat(texts, "\n")
        end
    end
    return nil
end
_M.text_of = text_of

local function shallow(t)
    local c = {}
    for k, v in pairs(t) do
        c[k] = v
    end
    return c
end

local function doc(kind, tenant, path, body)
    return { v = SCHEMA, kind = kind, tenant = tenant, path = path, body = body }
end

-- Keys of a request body (decoded JSON object) sent to `path` by `tenant`.
-- Returns {exact = hex, namespace = hex|nil, text = string|nil} or nil, err (also for a
-- body holding a number of absolute value 2^53 or more: the decoded double stands for
-- many texts, so such a request is not cached); with
-- exact_only, only {exact = hex} (the namespace costs a second canonical encoding).
function _M.keys(path, body, tenant, exact_only)
    if type(body) ~= "table" then
        return nil, "request body must be a JSON object"
    end
    tenant = tenant or "default"
    local kept = {}
    for k, v in pairs(body) do
        if not _M.EXCLUDED[k] then
            kept[k] = v
        end
    end
    local text, err = _M.canonical(doc("exact", tenant, path, kept))
    if not text then
        return nil, err
    end
    if jsonenc.canonical_inexact() then
        -- "seed": 9007199254740993 and 9007199254740992 decode to the same double
        return nil, "a number of 2^53 or more, which the key cannot tell from its neighbours"
    end
    local res = { exact = _M.sha256_hex(text) }
    if exact_only then
        return res
    end

    local ns_body, stext
    if path == "/v1/chat/completions" then
        local msgs = kept.messages
        local n = type(msgs) == "table" and array_len(msgs)
        if n and n > 0 and type(msgs[n]) == "table" and msgs[n].role == "user" then
            stext = text_of(msgs[n].content)
            if stext then
                local last = shallow(msgs[n])
                last.content = null
                local copy = {}
                for i = 1, n - 1 do
                    copy[i] = msgs[i]
                end
                copy[n] = last
                ns_body = shallow(kept)
                ns_body.messages = copy
            end
        end
    elseif path == "/v1/completions" then
        if type(kept.prompt) == "string" then
            stext = kept.prompt
            ns_body = shallow(kept)
            ns_body.prompt = null
        end
    end
    if ns_body and stext and stext:find("[^ \t\n\r\f\v]") then
        local ntext = _M.canonical(doc("namespace", tenant, path, ns_body))
        if ntext then
            res.namespace = _M.sha256_hex(ntext)
            res.text = stext
        end
    end
    return res
end

-- Keys by the raw request body, per worker: a body seen again (what an exact hit is)
-- costs a table lookup instead of the canonical encoding and the hash. Only bodies of
-- at most MEMO_BODY_MAX bytes are kept, MEMO_MAX of them (then the memo starts afresh):
-- at most MEMO_MAX x MEMO_BODY_MAX bytes of bodies per worker. The same bytes always
-- decode to the same body, so the keys are the same as keys() would compute.
_M.MEMO_MAX = 512
_M.MEMO_BODY_MAX = 8192
local bodies = require("infergate.core.memo").new(_M.MEMO_MAX)

-- keys(path, body, tenant, exact_only) of `raw`, the body's JSON text as received
-- (read-only result: callers must not change it).
function _M.keys_for(raw, path, body, tenant, exact_only)
    if type(raw) ~= "string" or #raw > _M.MEMO_BODY_MAX then
        return _M.keys(path, body, tenant, exact_only)
    end
    tenant = tenant or "default"
    local variant = path .. "\0" .. tenant .. (exact_only and "\0e" or "\0n")
    local slot = bodies:get(raw)
    local k = slot and slot[variant]
    if k then
        return k
    end
    local err
    k, err = _M.keys(path, body, tenant, exact_only)
    if not k then
        return nil, err
    end
    if not slot then
        slot = bodies:set(raw, {})
    end
    slot[variant] = k
    return k
end

return _M
