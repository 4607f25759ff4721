-- A prompt far longer than any node serving its model can hold gets its 400 at the edge
-- (access phase), without reaching a node.
--
-- llama-server tokenizes a whole prompt before it refuses one longer than a slot's
-- context (exceed_context_size_error): a 7.8 MB prompt held a slot of a real node for
-- 14 s to end in that 400. The control plane reads each llama.cpp server's slot context
-- from its /props (default_generation_settings.n_ctx, the snapshot's ctx_tokens).
--
-- The prompt's tokens are estimated as characters / CHARS_PER_TOKEN (a chat request's
-- message contents, a completions request's prompt string; other bodies, a list of
-- prompts or inputs, are not checked: each of those has its own context), every 8
-- characters of a run of whitespace or of one ASCII punctuation mark counted
-- as one character: llama.cpp's tokenizers take such a run in few tokens (gemma 3: 31
-- spaces or newlines a token, 16 dashes a token), so a fixed-width table padded with
-- spaces (9.8 characters a token) was refused at over twice the context while it fit
-- in it; a run still counts (a body of spaces alone is refused too). The estimate
-- is rough (chars / 4 is 1.1x under for English text and far under for Chinese), so a
-- request is refused only when
-- it is over FACTOR times the largest context among the nodes serving its model, and
-- only when every one of them reports its context (a node that does not may hold
-- anything, and answers for itself). Below that the node answers, as it would without
-- the edge.
--
-- Nodes of different contexts: a prompt estimated over the context of some of the nodes
-- serving its model leaves them out for this request (marked tried, as
-- infergate.routing.upstream does with other groups: no pick, no retry there) while a
-- node with a larger context serves the model and is up -- a node whose context is
-- not known may hold it too; with every context known, the nodes of the largest stay.
-- The estimate is off either way (gemma 3: "lorem ipsum" 1.5x over, Chinese text
-- 3.5x under); a node left out for a prompt it would have held costs balance, not an
-- answer, where one sent a prompt it cannot hold answers 400
-- (exceed_context_size_error). No I/O.
--
-- Error: 400 {"type": "invalid_request_error", "code": "context_length_exceeded",
-- "param": "messages" | "prompt"}.
local snapshot = require("infergate.routing.snapshot")
local models = require("infergate.routing.models")
local body = require("infergate.core.body")

local _M = {}

_M.CHARS_PER_TOKEN = 4
_M.FACTOR = 2

local type = type
local ipairs = ipairs
local ceil = math.ceil
local re_gsub = ngx.re.gsub

-- Up to 8 characters of a run of whitespace, or of one ASCII punctuation
-- mark repeated (PCRE): one character of the estimate (a token per 32 of them, where
-- gemma 3 takes 31 spaces or 16 dashes in one).
local RUNS = [[\s{2,8}|([!-/:-@\[-`{-~])\1{1,7}]]

-- Characters (code points) of string `s`, each match of RUNS counted as one.
local function dense_chars(s)
    local t = re_gsub(s, RUNS, " ", "jo")
    return body.chars(t or s)
end

-- Characters of the one prompt of a decoded body (runs counted as one, see above) and
-- the field named in the error, or nil when the body is not one prompt.
local function prompt_of(b)
    if type(b) ~= "table" then
        return nil
    end
    if type(b.messages) == "table" then
        local n = 0
        for _, m in ipairs(b.messages) do
            if type(m) == "table" then
                n = n + body.text_chars(m.content, dense_chars)
            end
        end
        return n, "messages"
    end
    if type(b.prompt) == "string" then
        return dense_chars(b.prompt), "prompt"
    end
    return nil
end
_M._prompt_of = prompt_of

-- The smallest and largest slot contexts (tokens) known among the nodes of snapshot `t`
-- serving `model` (nil, nil: none known), and whether one of them does not report it.
local function contexts(t, model)
    local smallest, largest, unknown = nil, nil, false
    for _, node in ipairs(t.nodes) do
        if models.serves(node, model) then
            local c = node.ctx_tokens
            if not c then
                unknown = true
            else
                if not smallest or c < smallest then
                    smallest = c
                end
                if not largest or c > largest then
                    largest = c
                end
            end
        end
    end
    return smallest, largest, unknown
end

-- The largest slot context (tokens) among the nodes of snapshot `t` serving `model`,
-- or nil when none does or one of them does not report its context.
function _M.largest_context(t, model)
    local _, largest, unknown = contexts(t, model)
    return not unknown and largest or nil
end

local function up(node, tried)
    return node.addr and node.healthy and node.state == "active" and not tried[node.name]
end

-- Mark tried (req.tried) the nodes serving the model whose context is below `need`
-- tokens (the largest known context when it is below that and every one is known), if
-- a node that is up and serves the model stays.
local function leave_out_small(t, req, need, largest, unknown)
    if not unknown and need > largest then
        need = largest
    end
    local tried, out, stays = req.tried, {}, false
    for _, node in ipairs(t.nodes) do
        if models.serves(node, req.model) then
            local c = node.ctx_tokens
            if c and c < need then
                out[#out + 1] = node.name
            elseif up(node, tried) then
                stays = true
            end
        end
    end
    if stays then
        for _, name in ipairs(out) do
            tried[name] = true
        end
    end
end

-- Access step: nil to continue, or the 400 error table.
function _M.step(req)
    if req.route ~= "inference" then
        return nil
    end
    local t = snapshot.current()
    local smallest, largest, unknown = contexts(t, req.model)
    -- the cheap checks first: no context known, or a body too short to be over the
    -- smallest (a prompt has at most as many characters as its body has bytes)
    if not smallest or (req.body_bytes or 0) <= smallest * _M.CHARS_PER_TOKEN then
        return nil
    end
    local chars, param = prompt_of(req.body)
    local est = chars and ceil(chars / _M.CHARS_PER_TOKEN)
    if not est or est <= smallest then
        return nil
    end
    if unknown or est <= _M.FACTOR * largest then
        if smallest < largest or unknown then
            leave_out_small(t, req, est, largest, unknown)
        end
        return nil
    end
    return {
        status = 400,
        message = "This model's maximum context length is " .. largest .. " tokens; the "
            .. "prompt is about " .. est .. " tokens (estimated from its " .. chars
            .. " characters). Shorten the prompt.",
        type = "invalid_request_error",
        code = "context_length_exceeded",
        param = param,
    }
end

return _M
