-- Per-request state shared by the access, balancer, header_filter and log phases.
--
-- ngx.ctx is emptied by internal redirects, and nginx answers an upstream failure
-- through error_page (an internal redirect to a named location), so the state is also
-- kept in a worker-local table keyed by $request_id until the log phase ends it.
--
-- State: {id, route = "inference"|"models", stream = bool, model = string|nil,
--         http_version = client's (1.0, 1.1, 2.0), attempts = {attempt records, see
--         infergate.routing.stats}, tried = {name = true}, invalid_answer = node name|nil}
-- Admission control adds: tenant ("default" with auth off), key_id, key_limits
-- (infergate.admission.auth); est_tokens, ratelimit, track_usage, usage, headers_out
-- (infergate.admission.ratelimit, infergate.admission.usage); deadline (infergate.admission.deadline).
local _M = {}

local pending = {}
local pending_count = 0

function _M.new(route)
    local id = ngx.var.request_id
    local req = { id = id, route = route, stream = false, attempts = {}, tried = {},
                  http_version = ngx.req.http_version() }
    ngx.ctx.infergate = req
    if id then
        if not pending[id] then
            pending_count = pending_count + 1
        end
        pending[id] = req
    end
    return req
end

-- The state of the current request, or nil when the request never had one.
function _M.get()
    local ctx = ngx.ctx
    local req = ctx.infergate
    if req then
        return req
    end
    local id = ngx.var.request_id
    req = id and pending[id]
    if req then
        ctx.infergate = req
    end
    return req
end

-- Log phase: forget the request.
function _M.finish(req)
    local id = req.id
    if id and pending[id] then
        pending[id] = nil
        pending_count = pending_count - 1
    end
end

-- Requests of this worker between access and log (for the status endpoint).
function _M.pending()
    return pending_count
end

return _M
