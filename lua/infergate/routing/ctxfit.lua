-- A prompt far longer than any node serving its model can hold gets its 400 at the edge
-- (access phase), without reaching a node.
--
-- llama-server tokenizes a whole prompt before it refuses one longer than a slot's
-- context (exceed_context_size_error): a 7.8 MB prompt held a slot of a real node for
-- 14 s to end in that 400. The control plane reads each llama.cpp server's slot context
-- from its /props (default_generation_settings.n_ctx, the snapshot's ctx_tokens).
--
-- The prompt's tokens (a chat request's message contents, a completions request's
-- prompt string; other bodies, a list of prompts or inputs, are not checked: each of
-- those has its own context) are estimated from its text (estimate()): a token for
-- each word (a run of letters, or of other characters that are none of whitespace,
-- digits and ASCII punctuation), each digit and each pair of ASCII punctuation marks
-- in a row, a lone mark one (gemma 3 has "</", "></", "!?", "[]" in a token; a run of
-- one mark repeated counting one per 16, as llama.cpp's tokenizers take such a run:
-- gemma 3 has 16 dashes in a token), CJK_TOKENS a Han, kana or hangul character, and
-- one per 16 pairs of whitespace (gemma 3: 31 spaces or newlines a token); a word of
-- over 128 bytes counts one per 64 bytes (LONG_WORD). Measured
-- against gemma 3's own count: 0.84-1.19x for English prose, digits, hex, Spanish,
-- Chinese, Japanese and Korean, a fixed-width table padded with spaces and lines of
-- dashes; 0.78-1.07x for code (CSS, Lisp, Python, Lua, minified JavaScript, LaTeX),
-- 0.97x JSON, 1.0-1.45x markup (XML 1.18x, HTML 1.45x); at most 2.14x for text of
-- marks only (closing tags, "[],[]", "!?!?": 2.9-4x when each mark counted one);
-- under for long words (German 0.62x, Russian 0.70x, base64 0.47x).
-- Characters / 4 was 0.25-2.6x (2.3x over for a Spanish prompt of 919 tokens, which
-- the edge then refused while the node served it; 4x under for digits). Gemma 3's 262k
-- vocabulary is among the largest, so other tokenizers, taking more tokens for a text,
-- read further under it. A request is refused only when it is over FACTOR times the
-- largest context among the nodes serving its model, and only when every one of them
-- reports its context (a node that does not may hold anything, and answers for
-- itself). Below that a node answers, as it would without the edge. No I/O.
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
-- 400 whenever that node was picked. The estimate errs (see above): a node left out
-- for a prompt it would have held (its context within a fifth of the estimate) costs
-- balance, not an answer; a prompt estimated under a node's context still goes to it. One
-- estimated over every context (all known, under FACTOR times the largest) goes to the
-- nodes of the largest context.
local snapshot = require("infergate.routing.snapshot")
local models = require("infergate.routing.models")
local candidates = require("infergate.routing.candidates")
local body = require("infergate.core.body")

local _M = {}

_M.FACTOR = 2
_M.CJK_TOKENS = 0.6

local type = type
local ipairs = ipairs
local ceil = math.ceil
local floor = math.floor
local re_gsub = ngx.re.gsub
local re_find = ngx.re.find

-- A run of one ASCII punctuation mark, up to 16 (PCRE): one mark of the estimate.
local PUNCT_RUN = [[([!-/:-@\[-`{-~])\1{1,15}]]
-- Han, kana and hangul (gemma 3: 0.76 tokens a Chinese character; CJK_TOKENS stays
-- under the tokenizers that pack Chinese tighter).
local CJK = [=[[\x{3040}-\x{30ff}\x{3400}-\x{4dbf}\x{4e00}-\x{9fff}\x{ac00}-\x{d7af}]=]
    .. [=[\x{f900}-\x{faff}]]=]
local WORD = [[[^\s\d!-/:-@\[-`{-~]+]]
local DIGIT = [[\d]]
local PUNCT = [=[[!-/:-@\[-`{-~]{1,2}]=]
local WS_PAIR = [[\s\s]]
-- A word of over 128 bytes, matched from its start only (the lookbehind: linear time).
-- It counts a token per 64 bytes: gemma 3 takes 8 bytes a token of "aaa...", 48 of
-- "………" (its densest run measured); one token, a 1 MB word passed as one.
local LONG_WORD = [[(?<![^\s\d!-/:-@\[-`{-~])[^\s\d!-/:-@\[-`{-~]{129,}]]
local LONG_BYTES = 64

-- Matches of `pat` in `s` (0 on a regex error).
local function count(s, pat, flags)
    local _, n = re_gsub(s, pat, "", flags)
    return n or 0
end

-- The estimated tokens of string `s` (see the top of this file).
local function estimate(s)
    -- a run's mark, then a space: a token of its own, not paired with the next mark
    local t = re_gsub(s, PUNCT_RUN, "$1 ", "jo") or s
    local cjk = 0
    -- lead bytes of U+3000-U+FFFF: CJK may be there. The text is checked as UTF-8 once
    -- ("u" checks the whole text again at each match: 64 KB of Chinese took 2.4 s)
    if t:find("[\227-\239]") and re_find(t, "^", "jou") then
        local u, n = re_gsub(t, CJK, " ", "joU")
        if u and n > 0 then
            t, cjk = u, n
        end
    end
    local long = 0
    re_gsub(t, LONG_WORD, function(m)
        long = long + floor(#m[0] / LONG_BYTES) - 1
        return ""
    end, "jo")
    return count(t, WORD, "jo") + long + count(t, DIGIT, "jo") + count(t, PUNCT, "jo")
        + count(s, WS_PAIR, "jo") / 16 + cjk * _M.CJK_TOKENS
end
_M._estimate = estimate

-- The estimated tokens of the one prompt of a decoded body (see above) and the field
-- named in the error, or nil when the body is not one prompt.
local function prompt_of(b)
    if type(b) ~= "table" then
        return nil
    end
    if type(b.messages) == "table" then
        local n = 0
        for _, m in ipairs(b.messages) do
            if type(m) == "table" then
                n = n + body.text_chars(m.content, estimate)
            end
        end
        return n, "messages"
    end
    if type(b.prompt) == "string" then
        return estimate(b.prompt), "prompt"
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

-- Whether a node of snapshot table `t` reports its slot context or slots, worked out
-- once per table (cached on it): a pool where none does (vLLM, TGI...) skips the step.
local function reports(t)
    local r = t.ctxfit_reports
    if r == nil then
        r = false
        for _, node in ipairs(t.nodes) do
            if node.ctx_tokens or node.slots_source == "server" then
                r = true
                break
            end
        end
        t.ctxfit_reports = r
    end
    return r
end

-- Access step: nil to continue, or the 400 error table.
function _M.step(req)
    if req.route ~= "inference" then
        return nil
    end
    local t = snapshot.current()
    if not reports(t) then
        return nil
    end
    local b = req.body
    local n = type(b) == "table" and b.n
    if type(n) == "number" and n > 1 then
        leave_out(req, t, "n", n)
    end
    local largest, smallest = contexts(t, req.model)
    -- the cheap checks first: no context known, or a body too short to be over any (the
    -- estimate counts at most a token a byte)
    if not smallest or (req.body_bytes or 0) <= smallest then
        return nil
    end
    local tokens, param = prompt_of(b)
    local est = tokens and ceil(tokens)
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
            .. "prompt is about " .. est .. " tokens (estimated from its words, digits and "
            .. "punctuation). Shorten the prompt.",
        type = "invalid_request_error",
        code = "context_length_exceeded",
        param = param,
    }
end

return _M
