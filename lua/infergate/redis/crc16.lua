-- Redis Cluster key hashing: CRC16 (XMODEM: polynomial 0x1021, initial 0) of the key's
-- hash tag, modulo 16384 (redis src/cluster.c keyHashSlot, src/crc16.c). The hash tag is
-- the part between the first "{" and the next "}" after it, when that part is not empty;
-- otherwise the whole key.
--
--   local crc16 = require("infergate.redis.crc16")
--   crc16.slot("infergate:v1:apikeys:ids:{infergate:v1:apikeys}")  -- 12348
--
-- Pure Lua (LuaJIT's bit library), no I/O: usable in every phase.
local bit = require("bit")

local _M = {}

local band, bxor, lshift, rshift = bit.band, bit.bxor, bit.lshift, bit.rshift
local byte = string.byte
local find = string.find
local sub = string.sub

_M.SLOTS = 16384

-- The 256-entry table of CRC16-XMODEM, built once.
local TABLE = {}
for i = 0, 255 do
    local crc = lshift(i, 8)
    for _ = 1, 8 do
        if band(crc, 0x8000) ~= 0 then
            crc = band(bxor(lshift(crc, 1), 0x1021), 0xffff)
        else
            crc = band(lshift(crc, 1), 0xffff)
        end
    end
    TABLE[i] = crc
end

-- CRC16-XMODEM of the bytes of `s` from position i to j (default: all of it).
function _M.crc16(s, i, j)
    local crc = 0
    for k = i or 1, j or #s do
        crc = band(bxor(lshift(crc, 8), TABLE[bxor(rshift(crc, 8), byte(s, k))]), 0xffff)
    end
    return crc
end

-- The part of `key` that is hashed: its hash tag, or the whole key.
function _M.hashed_part(key)
    local open = find(key, "{", 1, true)
    if open then
        local close = find(key, "}", open + 1, true)
        if close and close > open + 1 then
            return sub(key, open + 1, close - 1)
        end
    end
    return key
end

-- The cluster hash slot (0-16383) of `key` (a string; numbers are hashed as text).
function _M.slot(key)
    key = type(key) == "string" and key or tostring(key)
    local open = find(key, "{", 1, true)
    if open then
        local close = find(key, "}", open + 1, true)
        if close and close > open + 1 then
            return _M.crc16(key, open + 1, close - 1) % 16384
        end
    end
    return _M.crc16(key) % 16384
end

return _M
