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
local byte = string.byte
local concat = table.concat
local G_NORMALIZE_NFC = 1

local glib
do
    local ok = pcall(ffi.cdef, [[
        char *g_utf8_normalize(const char *str, long len, int mode);
        void g_free(void *mem);
        int g_unichar_combining_class(uint32_t uc);
        size_t g_unichar_fully_decompose(uint32_t ch, int compat, uint32_t *result,
                                         size_t result_len);
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

-- Non-starters in the canonical decomposition of each code point that has any (GLib's
-- own tables: g_unichar_fully_decompose, g_unichar_combining_class), as UAX #15 counts
-- them: cp -> {leading non-starters, trailing non-starters, all of them non-starters,
-- length}. A mark is {1, 1, true, 1}; U+0F75 TIBETAN VOWEL SIGN UU, a starter itself,
-- decomposes into two marks: {2, 2, true, 2}; "é" into e + U+0301: {0, 1, false, 2}.
-- None lies below U+00C0 or above U+1FFFF.
local nsinfo = {}
if glib then
    local buf = ffi.new("uint32_t[18]") -- G_UNICHAR_MAX_DECOMPOSITION_LENGTH
    for cp = 0xC0, 0x1FFFF do
        local n = tonumber(glib.g_unichar_fully_decompose(cp, 0, buf, 18))
        if n >= 1 and (n > 1 or glib.g_unichar_combining_class(cp) ~= 0) then
            local lead, trail = 0, 0
            while lead < n and glib.g_unichar_combining_class(buf[lead]) ~= 0 do
                lead = lead + 1
            end
            while trail < n and glib.g_unichar_combining_class(buf[n - 1 - trail]) ~= 0 do
                trail = trail + 1
            end
            if lead > 0 or trail > 0 then
                nsinfo[cp] = { lead, trail, lead == n, n }
            end
        end
    end
end

-- UTF-8 lead bytes of every code point whose decomposition begins with a non-starter
-- (U+0300-U+07FF, U+0800-U+3FFF, U+A000-U+AFFF, U+F000-U+FFFF, U+10000 and up): text
-- without them has no run to bound.
local MAY_HAVE_NONSTARTERS = "[\204-\227\234\239\240-\244]"

-- Code point of the character starting at byte i of s and its length in bytes (a stray
-- byte counts as one character of its own).
local function char_at(s, i)
    local b = byte(s, i)
    if b < 0xC0 then
        return b, 1
    elseif b < 0xE0 then
        return (b - 0xC0) * 64 + ((byte(s, i + 1) or 0x80) - 0x80), 2
    elseif b < 0xF0 then
        return ((b - 0xE0) * 64 + ((byte(s, i + 1) or 0x80) - 0x80)) * 64
            + ((byte(s, i + 2) or 0x80) - 0x80), 3
    end
    return (((b - 0xF0) * 64 + ((byte(s, i + 1) or 0x80) - 0x80)) * 64
        + ((byte(s, i + 2) or 0x80) - 0x80)) * 64 + ((byte(s, i + 3) or 0x80) - 0x80), 4
end

-- Stream-safe text (Unicode UAX #15, section 13): a COMBINING GRAPHEME JOINER (U+034F, a
-- starter that nothing reorders across or composes with) goes in before a character
-- whose leading non-starters would make the run of non-starters, counted in the
-- characters' decompositions, longer than MAX_NONSTARTERS. GLib's canonical ordering is
-- a bubble sort over each run of non-starters, quadratic in its length (128,000 marks of
-- alternating classes took 8 s of a worker): bounded runs keep the cost linear. Text
-- without such runs is returned as it is (and its NFC is the exact NFC); with them the
-- key text is canonically equivalent to what was sent and the same for the same text.
_M.MAX_NONSTARTERS = 30
local CGJ = "\205\143"

function _M.stream_safe(s)
    if not find(s, MAY_HAVE_NONSTARTERS) then
        return s
    end
    local n, max_run = #s, _M.MAX_NONSTARTERS
    local out, last, run, i = nil, 1, 0, 1
    while i <= n do
        local cp, len = char_at(s, i)
        local info = nsinfo[cp]
        if info then
            if run + info[1] > max_run then
                out = out or {}
                out[#out + 1] = sub(s, last, i - 1)
                out[#out + 1] = CGJ
                last, run = i, 0
            end
            if info[3] then
                run = run + info[4]
            else
                run = info[2]
            end
        else
            run = 0
        end
        i = i + len
    end
    if not out then
        return s
    end
    out[#out + 1] = sub(s, last)
    return concat(out)
end

-- The first byte at or after `from` that starts a starter (never a non-starter, so the
-- cut keeps a mark with its base), or nil when none follows.
local function starter_from(s, from)
    local n = #s
    local i = find(s, "[%z\1-\127\192-\255]", from)
    while i and i <= n do
        local cp, len = char_at(s, i)
        local info = nsinfo[cp]
        if not info or info[1] == 0 then
            return i
        end
        i = i + len
    end
    return nil
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
-- pieces, joined, is the NFC of the whole. Text with no such character within WINDOW
-- bytes past SEGMENT (e.g. 1 MB of kana) is cut there anyway, before a starter: GLib
-- then composes nothing across that cut, which leaves a key canonically equivalent to
-- the text, never one of a different text.
_M.SEGMENT = 4096
_M.WINDOW = 1024
local SAFE_CUT = "[%z\1-\127\195-\203\228-\233\235\236]"

-- NFC of a UTF-8 string (of its stream-safe form, see above); the string itself when it
-- is ASCII, not UTF-8, or GLib is missing.
function _M.nfc(s)
    if glib == nil or not find(s, "[\128-\255]") then
        return s
    end
    s = _M.stream_safe(s)
    local n, seg, window = #s, _M.SEGMENT, _M.WINDOW
    if n <= seg then
        return nfc_piece(s)
    end
    local out, pos = {}, 1
    local safe = 0 -- the next safe cut at or after pos + seg found so far (n + 1: none)
    while pos <= n do
        local stop = n
        if pos + seg <= n then
            if safe ~= n + 1 and safe < pos + seg then
                safe = find(s, SAFE_CUT, pos + seg) or n + 1
            end
            local cut = safe
            if cut > pos + seg + window then
                cut = starter_from(s, pos + seg + window) or n + 1
            end
            stop = cut - 1
        end
        out[#out + 1] = nfc_piece(sub(s, pos, stop))
        pos = stop + 1
    end
    return concat(out)
end

return _M
