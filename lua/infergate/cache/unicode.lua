-- Unicode normalisation form C (NFC) for the cache key, through the FFI to GLib's
-- g_utf8_normalize (libglib-2.0.so.0, Debian package libglib2.0-0; GLib reference
-- manual, "Unicode Manipulation": G_NORMALIZE_NFC = G_NORMALIZE_DEFAULT_COMPOSE = 1).
-- nginx's Lua has no normaliser of its own. ASCII text is returned as it is, without a
-- call. Without GLib (or for bytes that are not UTF-8) the text is returned unchanged,
-- _M.available tells which, and loading the module logs a warning without GLib.
local ffi = require("ffi")

local _M = {}

local find = string.find
local gsub = string.gsub
local sub = string.sub
local concat = table.concat
local G_NORMALIZE_NFC = 1

local glib
do
    local ok = pcall(ffi.cdef, [[
        char *g_utf8_normalize(const char *str, long len, int mode);
        void g_free(void *mem);
    ]])
    if ok then
        local loaded, lib = pcall(ffi.load, "glib-2.0.so.0")
        if loaded then
            glib = lib
        end
    end
end
_M.available = glib ~= nil
if not glib then
    ngx.log(ngx.WARN, "infergate: libglib-2.0.so.0 not found: cache keys are taken over text ",
            "as sent, without NFC normalisation (apt-get install libglib2.0-0)")
end

local function nfc_segment(s)
    local p = glib.g_utf8_normalize(s, #s, G_NORMALIZE_NFC)
    if p == nil then
        return s
    end
    local out = ffi.string(p)
    glib.g_free(p)
    return out
end

-- One piece: ASCII as it is; GLib stops at a NUL byte, so text with NULs is normalised
-- between them (NUL is a starter: nothing composes across it).
local function nfc_piece(s)
    if not find(s, "[\128-\255]") then
        return s
    end
    if find(s, "\0", 1, true) then
        return (gsub(s, "[^%z]+", nfc_segment))
    end
    return nfc_segment(s)
end

-- GLib's composition is quadratic in the length of the text, so long text is cut into
-- pieces of about SEGMENT bytes, each cut placed just before a character that no
-- normalisation step can join with what precedes it: a starter that is never the second
-- character of a canonical composition (ASCII, U+00C0-U+02FF, U+4000-U+9FFF CJK,
-- U+B000-U+CFFF Hangul syllables, found by their UTF-8 lead bytes). The NFC of the
-- pieces, joined, is the NFC of the whole.
_M.SEGMENT = 4096
local SAFE_CUT = "[%z\1-\127\195-\203\228-\233\235\236]"

-- NFC of a UTF-8 string; the string itself when it is ASCII, not UTF-8, or GLib is
-- missing.
function _M.nfc(s)
    if glib == nil or not find(s, "[\128-\255]") then
        return s
    end
    local n, seg = #s, _M.SEGMENT
    if n <= seg then
        return nfc_piece(s)
    end
    local out, pos = {}, 1
    while pos <= n do
        local cut = pos + seg <= n and find(s, SAFE_CUT, pos + seg) or nil
        local stop = cut and cut - 1 or n
        out[#out + 1] = nfc_piece(sub(s, pos, stop))
        pos = stop + 1
    end
    return concat(out)
end

return _M
