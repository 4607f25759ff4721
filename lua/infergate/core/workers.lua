-- nginx worker processes: whether one is still running. Shared-dict state that a request
-- takes and gives back (in-flight counts, gauges, locks, probe slots) is marked with the
-- pid of the worker holding it, so that what a worker killed or crashed held (it never
-- reaches the code that gives it back; nginx starts another worker in its place) is
-- found and given back instead of leaking until nginx restarts.
-- No I/O (one kill(pid, 0) system call): safe in every phase.
local ffi = require("ffi")

local _M = {}

pcall(ffi.cdef, "int kill(int pid, int sig);")
local C = ffi.C
local ESRCH = 3

-- Whether process `pid` exists (kill(pid, 0): only ESRCH says it does not; EPERM, a
-- process of another user, exists).
function _M.alive(pid)
    return C.kill(pid, 0) == 0 or ffi.errno() ~= ESRCH
end

-- This worker's pid.
function _M.pid()
    return ngx.worker.pid()
end

-- Whether the holder named by a value "<pid>:..." (or a bare pid number) is a worker
-- that is gone; false for any other value.
function _M.holder_gone(v)
    local pid
    if type(v) == "number" then
        pid = v
    elseif type(v) == "string" then
        pid = tonumber(v:match("^(%d+):"))
    end
    return pid ~= nil and pid > 0 and not _M.alive(pid)
end

return _M
