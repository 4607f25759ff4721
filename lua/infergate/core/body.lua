-- The request body: its text, and facts derived from the decoded JSON. The access
-- steps read the body once into the request's state (infergate.core.reqctx.body_text,
-- reqctx.prompt_chars); other modules take it from there.
--
--   local body = require("infergate.core.body")
--   local text, err = body.text()   -- after ngx.req.read_body()
--   local n = body.prompt_chars(obj)
--
-- text() returns the body as one string, whether nginx kept it in memory or spilled it
-- to a temp file (bodies over edge.client_body_buffer_size, 1m by default: the file was
-- just written and is read from the page cache): the body, nil when there is none, or
-- nil, err when the temp file cannot be read.
local ffi = require("ffi")

local _M = {}

local ffi_cast = ffi.cast
local U8P = ffi.typeof("const uint8_t *")
local io_open = io.open
local tostring = tostring
local type = type
local ipairs = ipairs

function _M.text()
    local data = ngx.req.get_body_data()
    if data then
        return data
    end
    local path = ngx.req.get_body_file()
    if not path then
        return nil
    end
    local f, err = io_open(path, "rb")
    if not f then
        return nil, "cannot read the buffered request body: " .. tostring(err)
    end
    data = f:read("*a")
    f:close()
    return data
end

-- Characters (Unicode code points) of a UTF-8 string: its bytes less the continuation
-- bytes (0x80-0xBF), counted in a loop the JIT compiles (gsub built a copy of the
-- string to count).
local function chars(s)
    local len = #s
    local p = ffi_cast(U8P, s)
    local cont = 0
    for i = 0, len - 1 do
        local b = p[i]
        if b >= 128 and b < 192 then
            cont = cont + 1
        end
    end
    return len - cont
end

_M.chars = chars

-- Characters of a message content or prompt `v` (a string, or a list of strings or
-- content parts {"type": "text", "text": ...}); `count` counts one string (chars).
local function text_chars(v, count)
    count = count or chars
    if type(v) == "string" then
        return count(v)
    end
    local n = 0
    if type(v) == "table" then
        for _, part in ipairs(v) do
            if type(part) == "string" then
                n = n + count(part)
            elseif type(part) == "table" and type(part.text) == "string" then
                n = n + count(part.text)
            end
        end
    end
    return n
end
_M.text_chars = text_chars

-- Characters of the prompt of a decoded request body (chat, completions, embeddings):
-- the message contents, "prompt" and "input"; 0 for anything but a table.
function _M.prompt_chars(obj)
    if type(obj) ~= "table" then
        return 0
    end
    local n = 0
    if type(obj.messages) == "table" then
        for _, m in ipairs(obj.messages) do
            if type(m) == "table" then
                n = n + text_chars(m.content)
            end
        end
    end
    n = n + text_chars(obj.prompt) + text_chars(obj.input)
    return n
end

return _M
