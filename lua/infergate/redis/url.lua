-- Parsing of redis.url without any I/O: redis://, rediss:// (TLS), redis+sentinel:// and
-- redis+cluster:// / rediss+cluster:// (Redis Cluster seeds). The same forms as the
-- control plane's controlplane/redisdb/url.py (tests compare both).
local _M = {}

local concat = table.concat
local tonumber = tonumber
local type = type
local byte = string.byte

local DEFAULT_PORT = 6379
local DEFAULT_SENTINEL_PORT = 26379

-- The URL without its credentials, for error messages (they end up in error.log).
local function redact(url)
    return (url:gsub("//[^/@]*@", "//***@"))
end
_M.redact = redact

local function host_port(hostport, default_port, url)
    local host, port
    if byte(hostport, 1) == 91 then -- "[" IPv6 literal
        host, port = hostport:match("^%[([^%]]+)%]:?(%d*)$")
    else
        host, port = hostport:match("^([^:]+):?(%d*)$")
    end
    if not host or host == "" then
        return nil, "redis url has no host: " .. redact(url)
    end
    port = (port and port ~= "") and tonumber(port) or default_port
    if not port or port < 1 or port > 65535 then
        return nil, "redis url port out of range: " .. redact(url)
    end
    return host, port
end

-- TLS and Sentinel options of the edge (infergate.core.config), unless given; none (TLS
-- verification on, no client certificate) where the edge options are not loaded.
local function url_options(o)
    if o then
        return o
    end
    local ok, c = pcall(require("infergate.core.config").get)
    if not ok or type(c) ~= "table" then
        return {}
    end
    return {
        tls_verify = c.redis.tls_verify,
        tls_cert_pem = c.redis.tls_cert_pem,
        tls_key_pem = c.redis.tls_key_pem,
        sentinel_password = c.redis.sentinel_password,
    }
end

-- The host and the credentials of a URL's authority part: hostport, username, password
-- (percent-decoded; nil when absent or empty).
local function split_authority(authority)
    local userinfo, hostport = authority:match("^(.*)@([^@]*)$")
    if not userinfo then
        hostport = authority
    end
    local username, password
    if userinfo and userinfo ~= "" then
        local u, p = userinfo:match("^([^:]*):(.*)$")
        if u then
            username, password = u, p
        else
            password = userinfo
        end
        if username == "" then username = nil end
        if password == "" then password = nil end
        -- percent-decoding of the credentials
        if password then password = ngx.unescape_uri(password) end
        if username then username = ngx.unescape_uri(username) end
    end
    return hostport, username, password
end

-- The configuration of a redis+sentinel:// URL (see parse_url), or nil, err.
local function sentinel_url(url, hostport, dbpath, username, password, o)
    local hosts = {}
    for hp in (hostport .. ","):gmatch("([^,]*),") do
        local h, p = host_port(hp, DEFAULT_SENTINEL_PORT, url)
        if not h then
            return nil, p
        end
        hosts[#hosts + 1] = { host = h, port = p }
    end
    local service, dbs = dbpath:match("^/([^/]+)/?(%d*)/?$")
    if not service and dbpath:match("^/[^/]+/") then
        return nil, "redis url path must be /<service>[/<db number>]: " .. redact(url)
    end
    if not service then
        return nil, "redis+sentinel:// url needs the service (master) name: "
            .. "redis+sentinel://host1:26379,host2:26379/mymaster[/db]"
    end
    service = ngx.unescape_uri(service)
    if not service:match("^[%w_.%-]+$") or #service > 128 then
        return nil, "redis+sentinel:// service name '" .. service
            .. "': letters, digits, '_', '.', '-'"
    end
    local db = dbs ~= "" and tonumber(dbs) or 0
    local ids = {}
    for i, h in ipairs(hosts) do
        ids[i] = h.host .. ":" .. h.port
    end
    return {
        db = db,
        username = username,
        password = password,
        sentinel = {
            service = service,
            hosts = hosts,
            password = (o.sentinel_password ~= "" and o.sentinel_password) or nil,
            id = service .. "@" .. concat(ids, ","),
        },
    }
end

-- TLS fields of a configuration (rediss:// and rediss+cluster://).
local function tls_fields(conf, server_name, o)
    conf.ssl = true
    conf.server_name = server_name
    conf.ssl_verify = o.tls_verify ~= false
    if o.tls_cert_pem and o.tls_cert_pem ~= "" then
        conf.ssl_cert_pem = o.tls_cert_pem
        conf.ssl_key_pem = o.tls_key_pem
    end
end

-- The configuration of a redis+cluster:// or rediss+cluster:// URL (see parse_url), or
-- nil, err: cluster = {seeds = {{host, port}...}, id}; db is always 0.
local function cluster_url(url, scheme, hostport, dbpath, username, password, o)
    local seeds, ids = {}, {}
    for hp in (hostport .. ","):gmatch("([^,]*),") do
        local h, p = host_port(hp, DEFAULT_PORT, url)
        if not h then
            return nil, p
        end
        if h == "localhost" then
            h = "127.0.0.1"
        end
        seeds[#seeds + 1] = { host = h, port = p }
        ids[#ids + 1] = h .. ":" .. p
    end
    if dbpath ~= "" and dbpath ~= "/" and dbpath ~= "/0" then
        return nil, "a Redis Cluster has only database 0: " .. redact(url)
    end
    local conf = {
        db = 0,
        username = username,
        password = password,
        cluster = { seeds = seeds, id = concat(ids, ",") },
    }
    if scheme == "rediss+cluster" then
        -- each node's certificate is checked against the address the slot map names
        tls_fields(conf, nil, o)
    end
    return conf
end

-- The configuration of a redis:// or rediss:// URL (see parse_url), or nil, err.
local function server_url(url, scheme, hostport, dbpath, username, password, o)
    if hostport:find(",", 1, true) then
        return nil, "several hosts need redis+sentinel:// or redis+cluster://: " .. redact(url)
    end
    local host, port = host_port(hostport, DEFAULT_PORT, url)
    if not host then
        return nil, port
    end
    local server_name = host
    if host == "localhost" then
        host = "127.0.0.1"
    end
    local db = 0
    if dbpath ~= "" and dbpath ~= "/" then
        local d = dbpath:match("^/(%d+)$")
        if not d then
            return nil, "redis url path must be /<db number>: " .. redact(url)
        end
        db = tonumber(d)
    end
    local conf = {
        host = host,
        port = port,
        db = db,
        username = username,
        password = password,
    }
    if scheme == "rediss" then
        tls_fields(conf, server_name, o)
    end
    return conf
end

-- redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or
-- redis+sentinel://[[user]:password@]h1[:port1][,h2[:port2]...]/<service>[/db], or
-- redis+cluster://[[user]:password@]h1[:port1][,h2[:port2]...][/0] (rediss+cluster: TLS).
-- Returns a table {host, port, db, password, username} (plus ssl, server_name,
-- ssl_verify, ssl_cert_pem, ssl_key_pem for TLS; sentinel = {service, hosts, password,
-- id} and no host for Sentinel; cluster = {seeds, id} and no host for a cluster) or
-- nil, err. The connection pool of a configuration is named by infergate.redis.pool.
-- opts: {tls_verify, tls_cert_pem, tls_key_pem, sentinel_password}, default from
-- infergate.core.config.
function _M.parse_url(url, opts)
    if type(url) ~= "string" or url == "" then
        return nil, "redis url must be a non-empty string"
    end
    local scheme, rest = url:match("^(%a[%w+.-]*)://(.*)$")
    if not scheme then
        return nil, "redis url must look like redis://[:password@]host:port/db"
    end
    scheme = scheme:lower()
    if scheme == "rediss+sentinel" then
        return nil, "rediss+sentinel:// is not supported: Sentinel works over plain TCP only "
            .. "(no TLS); use redis+sentinel://, or rediss:// to one server"
    end
    if scheme ~= "redis" and scheme ~= "rediss" and scheme ~= "redis+sentinel"
            and scheme ~= "redis+cluster" and scheme ~= "rediss+cluster" then
        return nil, "unsupported redis url scheme '" .. scheme .. "'"
    end
    local authority, path = rest:match("^([^/?#]*)(.*)$")
    local hostport, username, password = split_authority(authority)
    local o = url_options(opts)
    local dbpath = path:gsub("[?#].*$", "")
    if scheme == "redis+sentinel" then
        return sentinel_url(url, hostport, dbpath, username, password, o)
    end
    if scheme == "redis+cluster" or scheme == "rediss+cluster" then
        return cluster_url(url, scheme, hostport, dbpath, username, password, o)
    end
    return server_url(url, scheme, hostport, dbpath, username, password, o)
end

return _M
