-- The edge's last known good state on disk, so that nginx started (or restarted) while
-- Redis is unreachable serves as it did before, not from the rendered defaults: the
-- last routing snapshot (drains, nodes added at run time; infergate.routing.snapshot)
-- and the key store's records (infergate.admission.knownkeys). Files in edge.state_dir
-- (default: "infergate-state" under nginx's prefix, which `infergate render` creates),
-- written whole (mode 0600) to a temporary file and renamed over the old one (a reader
-- never sees half a file), by one worker, only from timers (never on the request path), read at
-- worker start. A directory the workers cannot write to turns this off, with one
-- warning per file and worker.
--
--   write(name, text)  true, or nil, err
--   read(name)         the text, or nil
--   path(name)         the file's path
local config = require("infergate.core.config")
local ffi = require("ffi")

pcall(ffi.cdef, "int chmod(const char *path, unsigned int mode);")
local MODE = 384   -- 0600: the records of the key store are for the workers' user only

local _M = {}

local log = ngx.log
local WARN = ngx.WARN

local warned = {}

function _M.path(name)
    local dir = config.get().edge.state_dir
    if type(dir) ~= "string" or dir == "" then
        dir = ngx.config.prefix() .. "infergate-state"
    end
    return dir .. "/" .. name
end

local function failed(name, what, err)
    if not warned[name] then
        warned[name] = true
        log(WARN, "infergate: cannot ", what, " ", _M.path(name), ": ", err,
            " (the edge starts from its rendered config if Redis is unreachable then)")
    end
    return nil, err
end

function _M.write(name, text)
    local path = _M.path(name)
    local tmp = path .. ".tmp." .. ngx.worker.pid()
    local f, err = io.open(tmp, "wb")
    if not f then
        return failed(name, "write", err)
    end
    local ok, werr = f:write(text)
    f:close()
    ffi.C.chmod(tmp, MODE)
    if not ok then
        os.remove(tmp)
        return failed(name, "write", werr)
    end
    local renamed, rerr = os.rename(tmp, path)
    if not renamed then
        os.remove(tmp)
        return failed(name, "replace", rerr)
    end
    warned[name] = nil
    return true
end

function _M.read(name)
    local f = io.open(_M.path(name), "rb")
    if not f then
        return nil
    end
    local text = f:read("*a")
    f:close()
    return text
end

return _M
