-- Model-aware routing: which nodes serve which model.
--
-- A node's served models come with the routing snapshot ("models", see
-- docs/internals.md; in the static list from [[nodes]] models = [...]) and are kept in
-- the worker-local node table as node.models = {list = {id, ...}, set = {id = true}}, or
-- nil when unknown (the control plane could not read them, or none are configured).
--
--   serves(node, model)  the node may be sent `model`: no model asked, models unknown,
--                        the model is in its list, or the node takes any model
--                        (models.any: a single-model llama.cpp server, which answers any
--                        name), every node's list is known and none lists it
--   known(t, model)      some node of the table (whatever its state or health) may serve
--                        `model`; false = the table has nodes, every node's list is known
--                        and none lists it
--   list(t, now)         union of the known lists of the eligible nodes (healthy, active,
--                        an IP address, breaker not open), sorted; nil when no eligible
--                        node has a known list
--   step(req)            access step, after "body": a proxied request (routes inference,
--                        api, tokenizer, passthrough; the model of a JSON body or of a multipart
--                        form field) for a model no
--                        node serves gets 404 model_not_found from the edge (no node is
--                        touched); GET /v1/models is answered by the edge with list() in
--                        the OpenAI shape {"object": "list", "data": [{"id", "object":
--                        "model", "created": <epoch s, now, as vLLM gives it>, "owned_by":
--                        "infergate"}]}, and GET /v1/models/<id> (the OpenAI SDKs'
--                        models.retrieve; the id may hold "/") with that one object, or
--                        404 model_not_found when list() does not hold it; both go to a
--                        node as before when list() is nil
-- No I/O: safe in every phase.
local cjson = require("cjson.safe")
local ngxapi = require("infergate.core.ngxapi")
local ngx_now = ngxapi.now
local ngx_var = ngxapi.var
local breaker = require("infergate.routing.breaker")
local snapshot = require("infergate.routing.snapshot")

local _M = {}

local ipairs = ipairs
local pairs = pairs
local sort = table.sort
local sub = string.sub
local match = string.match
local gsub = string.gsub

function _M.serves(node, model)
    if not model then
        return true
    end
    local m = node.models
    if m == nil or m.set[model] == true then
        return true
    end
    local listed = m.listed
    return m.any == true and listed and not listed[model] or false
end

function _M.known(t, model)
    if not model then
        return true
    end
    local nodes = t.nodes
    for _, node in ipairs(nodes) do
        if _M.serves(node, model) then
            return true
        end
    end
    -- no node at all: nothing is known to be missing (the "eligible" step answers 503)
    return #nodes == 0
end

function _M.list(t, now)
    local set, any = {}, false
    for _, node in ipairs(t.nodes) do
        local m = node.models
        if m and node.addr and node.healthy and node.state == "active"
                and breaker.allow(node.name, now) then
            any = true
            for _, id in ipairs(m.list) do
                set[id] = true
            end
        end
    end
    if not any then
        return nil
    end
    local ids = {}
    for id in pairs(set) do
        ids[#ids + 1] = id
    end
    sort(ids)
    return ids
end

local function model_object(id, now)
    return { id = id, object = "model", created = now, owned_by = "infergate" }
end

-- The OpenAI model list for ids (JSON text); `now`: epoch s for "created" (default the
-- request's time).
function _M.encode_list(ids, now)
    now = now or ngx.time()
    local data = {}
    for i, id in ipairs(ids) do
        data[i] = model_object(id, now)
    end
    local body = cjson.encode({ object = "list", data = data })
    if #ids == 0 then
        body = '{"object":"list","data":[]}'  -- cjson encodes an empty table as {}
    end
    return body
end

-- Longest model name echoed in an error message (bytes; a longer one is cut, with "...").
_M.NAME_SHOWN_MAX = 256

local function not_found(model)
    if #model > _M.NAME_SHOWN_MAX then
        -- cut at a character boundary: not inside a UTF-8 sequence
        local cut = _M.NAME_SHOWN_MAX
        local b = string.byte(model, cut + 1)
        while cut > 0 and b >= 0x80 and b < 0xC0 do   -- a continuation byte
            cut = cut - 1
            b = string.byte(model, cut + 1)
        end
        model = sub(model, 1, cut) .. "..."
    end
    return {
        status = 404,
        message = "The model '" .. model .. "' does not exist or is not served by any node of "
            .. "this gateway; GET /v1/models lists the models it serves.",
        type = "invalid_request_error",
        code = "model_not_found",
        param = "model",
    }
end

-- The id of GET /v1/models/<id> as the client wrote it, decoded. Not from $uri, nginx's
-- normalised path: its merged slashes turn llama-server's default id, the model file's
-- path ("/models/m.gguf", which the OpenAI SDK sends as "%2Fmodels%2Fm.gguf"), into
-- "models/m.gguf". "%20", "%2B" are decoded as in $uri, a "+" stays one. A raw path
-- that does not start with the prefix ("/v1//models/...") falls back to $uri.
local MODELS_PREFIX = "/v1/models/"

local function requested_id(uri)
    local path = match(ngx_var("request_uri") or "", "^[^?]*")
    if sub(path, 1, #MODELS_PREFIX) == MODELS_PREFIX then
        -- ngx.unescape_uri reads "+" as a space
        return ngx.unescape_uri((gsub(sub(path, #MODELS_PREFIX + 1), "+", "%%2B")))
    end
    return sub(uri, #MODELS_PREFIX + 1)
end

function _M.step(req)
    local t = snapshot.current()
    if req.route ~= "models" then
        -- every proxied route (inference, api, tokenizer, passthrough): its body's model
        local model = req.model
        if model and not _M.known(t, model) then
            return not_found(model)
        end
        return nil
    end
    local ids = _M.list(t, ngx_now())
    if not ids then
        return nil -- nothing known: a node answers, as without model routing
    end
    local uri = ngx_var("uri")
    local body
    if uri == "/v1/models" then
        body = _M.encode_list(ids)
    else
        -- GET /v1/models/<id>: location ^~ /v1/models/
        local id = requested_id(uri)
        local found = false
        for _, v in ipairs(ids) do
            if v == id then
                found = true
                break
            end
        end
        if not found then
            return not_found(id)
        end
        body = cjson.encode(model_object(id, ngx.time()))
    end
    req.answered_by_edge = true
    ngx.status = 200
    ngx.header["Content-Type"] = "application/json"
    ngx.print(body)
    return ngx.exit(ngx.HTTP_OK)
end

return _M
