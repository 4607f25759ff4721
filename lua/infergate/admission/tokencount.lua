-- The up-front token estimate of the rate limits (infergate.admission.ratelimit):
-- ceil(characters of the prompt / limits.chars_per_token), at least 1; characters are
-- Unicode code points of the message contents (chat), the prompt (completions) or the
-- input (embeddings).
local _M = {}

local type = type
local ipairs = ipairs
local ceil = math.ceil
local max = math.max

-- Characters (Unicode code points) of a UTF-8 string.
local function chars(s)
    local _, n = s:gsub("[^\128-\191]", "")
    return n
end

local function text_chars(v)
    if type(v) == "string" then
        return chars(v)
    end
    local n = 0
    if type(v) == "table" then
        for _, part in ipairs(v) do
            if type(part) == "string" then
                n = n + chars(part)
            elseif type(part) == "table" and type(part.text) == "string" then
                n = n + chars(part.text)   -- content parts {"type": "text", "text": ...}
            end
        end
    end
    return n
end

-- Characters of the prompt of a decoded request body (chat, completions, embeddings).
function _M.prompt_chars(body)
    if type(body) ~= "table" then
        return 0
    end
    local n = 0
    if type(body.messages) == "table" then
        for _, m in ipairs(body.messages) do
            if type(m) == "table" then
                n = n + text_chars(m.content)
            end
        end
    end
    n = n + text_chars(body.prompt) + text_chars(body.input)
    return n
end

-- Estimated prompt tokens: ceil(chars / chars_per_token), at least 1.
function _M.estimate_tokens(body, chars_per_token)
    return max(1, ceil(_M.prompt_chars(body) / chars_per_token))
end

return _M
