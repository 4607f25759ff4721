-- A prompt far longer than any node serving its model can hold gets its 400 at the edge
-- (access phase), without reaching a node.
--
-- llama-server tokenizes a whole prompt before it refuses one longer than a slot's
-- context (exceed_context_size_error): a 7.8 MB prompt held a slot of a real node for
-- 14 s to end in that 400. The control plane reads each llama.cpp server's slot context
-- from its /props (default_generation_settings.n_ctx, the snapshot's ctx_tokens).
--
-- The prompt's tokens are estimated as characters / CHARS_PER_TOKEN, a CJK character as
-- CJK_TOKENS (a chat request's
-- message contents, a completions request's prompt string; other bodies, a list of
-- prompts or inputs, are not checked: each of those has its own context), every 8
-- characters of a run of whitespace or of one ASCII punctuation mark counted
-- as one character: llama.cpp's tokenizers take such a run in few tokens (gemma 3: 31
-- spaces or newlines a token, 16 dashes a token), so a fixed-width table padded with
-- spaces (9.8 characters a token) was refused at over twice the context while it fit
-- in it; a run still counts (a body of spaces alone is refused too). The estimate
-- is rough (gemma 3: 1.1x under for English text, 1.5x over for "lorem ipsum", 1.3x
-- under for Chinese; chars / 4 alone was 3x under there; 2.3x over for a Spanish
-- prompt of 919 tokens, 8,330 characters, and 2.6x for long English words), so a request
-- is refused only when
-- it is over FACTOR times the largest context among the nodes serving its model, and
-- only when every one of them reports its context (a node that does not may hold
-- anything, and answers for itself). Below that a node answers, as it would without
-- the edge. No I/O.
--
-- Error: 400 {"type": "invalid_request_error", "code": "context_length_exceeded",
-- "param": "messages" | "prompt"}.
--
-- Which node: those that would refuse the request are left out of its choice (marked
-- tried, as infergate.routing.upstream does with other groups) while a usable node
-- serving its model would not: a node whose slot context is under the prompt's
-- estimate (llama-server answers 400 exceed_context_size_error, and a node's 4xx is the
-- client's answer), and a llama.cpp server (slots_source "server") with fewer slots
-- than the request's `n` (llama-server refuses an `n` over its --parallel). In a pool of
-- a 4,096-token and a 1,024-token llama-server, a 2,231-token prompt went to the small
-- node 10 times out of 10 (both idle), and an `n` = 2 request got the one-slot node's
-- 400 whenever that node was picked. The estimate is rough (see above): a node left
-- out for a prompt it would have held costs balance,
-- not an answer; a prompt estimated under a node's context still goes to it. One
-- estimated over every context (all known, under FACTOR times the largest) goes to the
-- nodes of the largest context.
local snapshot = require("infergate.routing.snapshot")
local models = require("infergate.routing.models")
local candidates = require("infergate.routing.candidates")
local body = require("infergate.core.body")

local _M = {}

_M.CHARS_PER_TOKEN = 4
_M.FACTOR = 4

local type = type
local ipairs = ipairs
local ceil = math.ceil
local re_gsub = ngx.re.gsub

-- Up to 8 characters of a run of whitespace, or of one ASCII punctuation
-- mark repeated (PCRE): one character of the estimate (a token per 32 of them, where
-- gemma 3 takes 31 spaces or 16 dashes in one).
local RUNS = [[\s{2,8}|([!-/:-@\[-`{-~])\1{1,7}]]

-- Han, kana and hangul: about CJK_TOKENS tokens each where other text takes 1 /
-- CHARS_PER_TOKEN (gemma 3: 1,880 Chinese characters read as 1,431 tokens, 0.76 each;
-- 0.6 stays under the tokenizers that pack Chinese tighter).
local CJK = [=[[\x{3040}-\x{30ff}\x{3400}-\x{4dbf}\x{4e00}-\x{9fff}\x{ac00}-\x{d7af}]=]
    .. [=[\x{f900}-\x{faff}]]=]
_M.CJK_TOKENS = 0.6

-- Characters (code points) of string `s`, each match of RUNS counted as one and each
-- CJK character as CJK_TOKENS x CHARS_PER_TOKEN.
local function dense_chars(s)
    local t = re_gsub(s, RUNS, " ", "jo") or s
    local n = body.chars(t)
    local _, cjk = re_gsub(t, CJK, "", "jou")
    if cjk and cjk > 0 then
        n = n + cjk * (_M.CJK_TOKENS * _M.CHARS_PER_TOKEN - 1)
    end
    return n
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

-- The largest slot context (tokens) among the nodes of snapshot `t` serving `model`
-- (nil when none does or one of them does not report its context), and the smallest
-- one reported (nil: none).
local function contexts(t, model)
    local largest, smallest, unknown = nil, nil, false
    for _, node in ipairs(t.nodes) do
        if models.serves(node, model) then
            local c = node.ctx_tokens
            if not c then
                unknown = true
            else
                if not largest or c > largest then
                    largest = c
                end
                if not smallest or c < smallest then
                    smallest = c
                end
            end
        end
    end
    return not unknown and largest or nil, smallest
end

function _M.largest_context(t, model)
    return (contexts(t, model))
end

-- Whether `node` would refuse a request of `need` prompt tokens (what = "ctx") or of
-- `n` = need (what = "n"); a node that does not report the figure is taken to hold it.
local function refuses(node, what, need)
    if what == "ctx" then
        local c = node.ctx_tokens
        return c ~= nil and c < need
    end
    return node.slots_source == "server" and node.slots ~= nil and node.slots < need
end

-- Marks tried the nodes serving the request's model that would refuse it, when a
-- usable node of the model, not tried yet, would not.
local function leave_out(req, t, what, need)
    local tried, model, other = req.tried, req.model, false
    for _, node in ipairs(t.nodes) do
        if candidates.usable(node, tried, model) and not refuses(node, what, need) then
            other = true
            break
        end
    end
    if not other then
        return
    end
    for _, node in ipairs(t.nodes) do
        if models.serves(node, model) and refuses(node, what, need) then
            tried[node.name] = true
        end
    end
end

-- Access step: nil to continue, or the 400 error table.
function _M.step(req)
    if req.route ~= "inference" then
        return nil
    end
    local t = snapshot.current()
    local b = req.body
    local n = type(b) == "table" and b.n
    if type(n) == "number" and n > 1 then
        leave_out(req, t, "n", n)
    end
    local largest, smallest = contexts(t, req.model)
    -- the cheap checks first: no context known, or a body too short to be over any (a
    -- prompt has at most as many characters as its body has bytes)
    if not smallest or (req.body_bytes or 0) <= smallest * _M.CHARS_PER_TOKEN then
        return nil
    end
    local chars, param = prompt_of(b)
    local est = chars and ceil(chars / _M.CHARS_PER_TOKEN)
    if not est or est <= smallest then
        return nil
    end
    if not largest or est <= _M.FACTOR * largest then
        -- over every context (all known): the nodes of the largest, the best chance
        leave_out(req, t, "ctx", (largest and est > largest) and largest or est)
        return nil
    end
    return {
        status = 400,
        message = "This model's maximum context length is " .. largest .. " tokens; the "
            .. "prompt is about " .. est .. " tokens (estimated from its " .. ceil(chars)
            .. " characters, a CJK character counted as " .. _M.CJK_TOKENS
            .. " token). Shorten the prompt.",
        type = "invalid_request_error",
        code = "context_length_exceeded",
        param = param,
    }
end

return _M
