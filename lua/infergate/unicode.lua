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

-- NFC of a UTF-8 string; the string itself when it is ASCII, not UTF-8, or GLib is
-- missing. GLib stops at a NUL byte, so text with NULs is normalised piece by piece
-- (NUL is a starter: nothing composes across it).
function _M.nfc(s)
    if glib == nil or not find(s, "[\128-\255]") then
        return s
    end
    if find(s, "\0", 1, true) then
        return (gsub(s, "[^%z]+", nfc_segment))
    end
    return nfc_segment(s)
end

return _M
