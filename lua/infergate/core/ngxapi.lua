-- The clock and nginx variables for the request path, without resty.core's wrappers.
--
--   local ngxapi = require("infergate.core.ngxapi")
--   local now = ngxapi.now()                   -- seconds (float, ms resolution), as ngx.now()
--   local t0 = ngxapi.req_start_time()         -- seconds, as ngx.req.start_time()
--   local v = ngxapi.var("upstream_status")    -- string or nil, as ngx.var.upstream_status
--
-- Why: resty.core (lua-resty-core 0.1.25, Debian 12; the same code in OpenResty) defines
-- ngx.now() as `return tonumber(C.ngx_http_lua_ffi_now())`, ngx.req.start_time() likewise,
-- and ngx.var's __index ends in `return ffi_str(...)`: a tail call of a built-in at the
-- depth where a trace that starts at the function's entry began, which LuaJIT cannot
-- record ("leaving loop in root trace" / "NYI: return to lower frame"). After a few such
-- aborts LuaJIT blacklists the function, and from then on every trace that calls it
-- aborts too ("blacklisted at time.lua:74"): in a running edge (jit.v), the hot functions
-- of the access, balancer and log phases that read the clock or a variable all ran in
-- the interpreter. The functions here call the same C functions of lua-nginx-module and
-- return through a local, which LuaJIT records like any other call.
--
-- var() reads only named variables (not captures), at the phases where ngx.var works (a
-- request is required: raises "no request found" elsewhere, like ngx.var); a variable
-- nginx does not know raises, as ngx.var does. Setting variables stays with ngx.var.
local ffi = require("ffi")
require("resty.core.time") -- declares the C functions used below
require("resty.core.request")
require("resty.core.var")
local base = require("resty.core.base")

local _M = {}

local C = ffi.C
local ffi_str = ffi.string
local error = error
local get_request = base.get_request
local get_size_ptr = base.get_size_ptr
local get_string_buf = base.get_string_buf
local errmsg = base.get_errmsg_ptr()
local value_ptr = ffi.new("unsigned char *[1]")

local ffi_now = C.ngx_http_lua_ffi_now
local ffi_start_time = C.ngx_http_lua_ffi_req_start_time
local ffi_var_get = C.ngx_http_lua_ffi_var_get

-- ngx.now(): nginx's cached time of the current event loop iteration, in seconds.
function _M.now()
    local t = ffi_now()
    return t
end

-- ngx.req.start_time(): when nginx created the current request, in seconds.
function _M.req_start_time()
    local r = get_request()
    if not r then
        error("no request found")
    end
    local t = ffi_start_time(r)
    return t
end

-- ngx.var[name] for a named variable: its value as a string, or nil when it has none.
function _M.var(name)
    local r = get_request()
    if not r then
        error("no request found")
    end
    local len = get_size_ptr()
    local n = #name
    local rc = ffi_var_get(r, name, n, get_string_buf(n), 0, value_ptr, len, errmsg)
    if rc == 0 then -- NGX_OK
        local v = ffi_str(value_ptr[0], len[0])
        return v
    end
    if rc == -5 then -- NGX_DECLINED: no value
        return nil
    end
    error(ffi_str(errmsg[0]), 2)
end

return _M
