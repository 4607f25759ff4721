-- luacheck settings for the edge's Lua modules: `luacheck lua/` (or `bash .ci/lint`).
--
-- ngx_lua = the LuaJIT 2.1 standard library (read-only) plus what lua-nginx-module
-- adds: the globals ngx and ndk, table.new, table.clear, coroutine extensions.
-- Every module is `local _M = {} ... return _M`: setting or reading any other global
-- is reported (nginx warns "writing a global Lua variable" at run time).
std = "ngx_lua"

-- Arguments and locals that are unused on purpose start with an underscore.
max_line_length = 120
