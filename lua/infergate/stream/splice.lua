-- One client stream out of several node answers (infergate.stream.relay). Pure: no I/O.
--
--   engine(node)                    how node can continue a partial answer:
--                                   "continue_final_message" (kinds vllm, sglang),
--                                   "prefill" (a llama.cpp server: slots_source
--                                   "server" in the snapshot) or nil (cannot)
--   continuation(body, path, partial, produced, how)
--                                   the JSON body asking a node to continue, or nil, why
--   new_out()                       the client stream's state
--   rewrite(out, ev, text, leg)     the bytes to send the client for one node event, or
--                                   nil (dropped)
--   error_event(message, code)      an SSE error event the OpenAI clients raise on
--
-- Engines (checked in their source):
--   vLLM   ChatCompletionRequest.continue_final_message (with add_generation_prompt
--          false): the last assistant message is left open and generation continues it
--          (vllm/entrypoints/openai/protocol.py).
--   SGLang ChatCompletionRequest.continue_final_message, the same contract
--          (python/sglang/srt/entrypoints/openai/protocol.py, serving_chat.py).
--   llama.cpp server: a last message from the assistant is a prefill the answer
--          continues, unless started with --no-prefill-assistant
--          (tools/server/server-common.cpp oaicompat_chat_params_parse,
--          prefill_assistant: it sets continue_final_message; common/chat.cpp renders
--          the earlier turns, the generation prompt and the partial text with a Jinja
--          chat template, the default; its built-in templates, --no-jinja, close the
--          turn instead).
--   TGI and any other OpenAI-compatible server ("openai", "json", "tgi"): no such
--          contract; their streams cannot be continued.
-- /v1/completions continues on every engine: the prompt followed by the partial text.
local cjson = require("cjson.safe")
local jsontext = require("infergate.stream.jsontext")

local _M = {}

local type = type
local ipairs = ipairs

function _M.engine(node)
    if node.slots_source == "server" then
        return "prefill"
    end
    local k = node.kind
    if k == "vllm" or k == "sglang" or k == nil then
        return "continue_final_message"
    end
    return nil
end

local function copy(t)
    local c = {}
    for k, v in pairs(t) do
        c[k] = v
    end
    return c
end

-- max_tokens / max_completion_tokens reduced by `produced`; false when nothing is left.
local function reduce_limits(b, produced)
    for _, f in ipairs({ "max_tokens", "max_completion_tokens" }) do
        local v = b[f]
        if type(v) == "number" then
            if v - produced < 1 then
                return false
            end
            b[f] = v - produced
        end
    end
    return true
end

local function chat_body(b, partial, how)
    if type(b.messages) ~= "table" or #b.messages == 0 then
        return nil, "no messages"
    end
    local msgs = {}
    for i, m in ipairs(b.messages) do
        msgs[i] = m
    end
    local last = msgs[#msgs]
    if type(last) == "table" and last.role == "assistant" and type(last.content) == "string" then
        local m = copy(last)
        m.content = last.content .. partial -- the client's own prefill, continued further
        msgs[#msgs] = m
    else
        msgs[#msgs + 1] = { role = "assistant", content = partial }
    end
    b.messages = msgs
    if how == "continue_final_message" then
        b.continue_final_message = true
        b.add_generation_prompt = false
    elseif how ~= "prefill" then
        return nil, "the node cannot continue an answer"
    end
    return b
end

-- The body that asks a node to continue `partial` (text already sent, `produced`
-- tokens) of the request `body` (JSON text) on `path`. Returns text, or nil, reason
-- ("done": no token left; else why it cannot).
function _M.continuation(body, path, partial, produced, how)
    local b = jsontext.decode(body) -- empty arrays stay arrays when encoded again
    if type(b) ~= "table" then
        return nil, "body is not a JSON object"
    end
    if type(b.n) == "number" and b.n > 1 then
        return nil, "n > 1"
    end
    if not reduce_limits(b, produced) then
        return nil, "done"
    end
    local err
    if path == "/v1/completions" then
        if type(b.prompt) ~= "string" then
            return nil, "the prompt is not one string"
        end
        b.prompt = b.prompt .. partial
        b.echo = nil
    else
        b, err = chat_body(b, partial, how)
        if not b then
            return nil, err
        end
    end
    return jsontext.encode(b)
end

function _M.new_out()
    return { id = nil, role_sent = false, finish = nil, produced = 0, text = {},
             usage_done = 0 }
end

local function encode_event(obj)
    return "data: " .. cjson.encode(obj) .. "\n\n"
end

-- The bytes for the client for event `ev` (raw `text`) of leg `leg` (1: the first
-- node answering; later: continuations and retries): the first leg passes unchanged;
-- later legs get the first leg's id, drop their role chunk, and their usage adds the
-- tokens of the earlier legs. [DONE] and the finish are the relay's (see relay.finish).
function _M.rewrite(out, ev, text, leg)
    local obj = ev.obj
    if ev.kind == "comment" or ev.kind == "other" then
        return text
    end
    if type(obj) ~= "table" then
        return nil
    end
    if not out.id then
        out.id, out.object, out.model, out.created = obj.id, obj.object, obj.model, obj.created
    end
    local content = ev.kind == "content"
    if content then
        out.produced = out.produced + 1
        out.text[#out.text + 1] = ev.content or ""
    end
    if ev.finish then
        out.finish = ev.finish
    end
    local role = ev.kind == "meta" and not ev.finish and not ev.other_finish and not ev.usage
    if leg == 1 then
        out.role_sent = true
        return text -- as the node sent it (with n > 1, a role chunk per choice)
    end
    if role and out.role_sent then
        return nil -- a later leg's role chunk
    end
    out.role_sent = true
    -- a later leg: edited as text (infergate.stream.jsontext), the rest as the node sent it
    if obj.id ~= out.id and type(out.id) == "string" then
        text = jsontext.set_string(text, "id", out.id)
    end
    if ev.usage and out.usage_done > 0 then
        text = jsontext.add_number(text, "completion_tokens", out.usage_done)
        text = jsontext.add_number(text, "total_tokens", out.usage_done)
    end
    if ev.changed then
        text = jsontext.set_string(text, "content", ev.content)
    end
    return text
end

-- A llama.cpp server streams the prefilled assistant text back as the start of its
-- answer (seen with the build of bench/realnode, 11434: the first delta is the prefill
-- followed by the first new token): what of `echo` (the partial text sent already)
-- content event `ev` repeats is taken out of it. Returns what is left to strip ("" or
-- nil: done). An answer that does not repeat it is left alone.
function _M.strip_echo(ev, echo)
    if not echo or echo == "" or ev.kind ~= "content" or type(ev.obj) ~= "table" then
        return echo
    end
    local c = ev.obj.choices and ev.obj.choices[1]
    local delta = type(c) == "table" and c.delta
    local text = type(delta) == "table" and delta.content
    if type(text) ~= "string" then
        return nil
    end
    local n = math.min(#text, #echo)
    if text:sub(1, n) ~= echo:sub(1, n) then
        return nil
    end
    delta.content = text:sub(n + 1)
    ev.content, ev.changed = delta.content, true -- rewrite() edits the event's text
    if delta.content == "" then
        ev.kind = "meta" -- nothing new in it: dropped as a later leg's role chunk is
    end
    return echo:sub(n + 1)
end

-- The partial answer sent so far (choice 0).
function _M.partial(out)
    return table.concat(out.text)
end

-- The finish chunk the relay writes itself (no token was left for a continuation):
-- choice 0 with an empty delta (chat) or text (completions) and `reason`.
function _M.finish_event(out, path, reason)
    local choice = { index = 0, finish_reason = reason }
    if path == "/v1/completions" then
        choice.text = ""
    else
        choice.delta = {}
    end
    return encode_event({ id = out.id, object = out.object, created = out.created,
                          model = out.model, choices = { choice } })
end

function _M.error_event(message, code)
    return encode_event({ error = { message = message, type = "server_error", param = cjson.null,
                                    code = code } })
end

return _M
