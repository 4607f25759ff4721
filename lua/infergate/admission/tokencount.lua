-- The up-front token estimate of the rate limits (infergate.admission.ratelimit):
-- ceil(characters of the prompt / limits.chars_per_token), at least 1; characters are
-- Unicode code points of the message contents (chat), the prompt (completions) or the
-- input (embeddings). And the output tokens a request reserves (reserved_output).
local request_body = require("infergate.core.body")

local _M = {}

local ceil = math.ceil
local max = math.max
local min = math.min
local type = type

-- Characters of the prompt of a decoded request body (infergate.core.body.prompt_chars;
-- per request, infergate.core.reqctx.prompt_chars counts them once).
_M.prompt_chars = request_body.prompt_chars

-- Estimated prompt tokens: ceil(chars / chars_per_token), at least 1.
function _M.estimate_tokens(body, chars_per_token)
    return max(1, ceil(_M.prompt_chars(body) / chars_per_token))
end

-- Output tokens a request reserves at admission (o: the limits options): for a chat or
-- completions body (messages or prompt), its max_completion_tokens / max_tokens, else
-- o.model_max_tokens[model], else o.default_max_tokens; times its n (1..128); 0 for
-- other bodies (embeddings, audio, ...).
function _M.reserved_output(body, model, o)
    if type(body) ~= "table" or (body.messages == nil and body.prompt == nil) then
        return 0
    end
    local m = body.max_completion_tokens
    if type(m) ~= "number" then
        m = body.max_tokens
    end
    if type(m) ~= "number" or m <= 0 then
        local per = o.model_max_tokens
        m = (per and model and per[model]) or o.default_max_tokens or 0
    end
    local n = body.n
    if type(n) ~= "number" or n < 1 then
        n = 1
    end
    return ceil(m) * min(ceil(n), 128)
end

return _M
