-- The up-front token estimate of the rate limits (infergate.admission.ratelimit):
-- ceil(characters of the prompt / limits.chars_per_token), at least 1; characters are
-- Unicode code points of the message contents (chat), the prompt (completions) or the
-- input (embeddings).
local request_body = require("infergate.core.body")

local _M = {}

local ceil = math.ceil
local max = math.max

-- Characters of the prompt of a decoded request body (infergate.core.body.prompt_chars;
-- per request, infergate.core.reqctx.prompt_chars counts them once).
_M.prompt_chars = request_body.prompt_chars

-- Estimated prompt tokens: ceil(chars / chars_per_token), at least 1.
function _M.estimate_tokens(body, chars_per_token)
    return max(1, ceil(_M.prompt_chars(body) / chars_per_token))
end

return _M
