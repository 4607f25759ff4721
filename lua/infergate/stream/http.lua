-- HTTP/1.1 over a cosocket for the stream relay (infergate.stream.relay): one request
-- to a node, its status line and headers, then its body piece by piece (chunked,
-- Content-Length or until the node closes). Every call has the socket's timeouts; errors
-- are nil, err ("timeout", "closed", "bad chunk", ...).
--
--   request(sock, r)      writes r = {method, path, host, headers = {name = value},
--                         body}; returns bytes sent or nil, err
--   read_head(sock[, wait])  {status, headers = {lower-case name = value}, list = {{name,
--                         value}} as sent, http10 = an HTTP/1.0 answer, length = its
--                         body's (nil: chunked or until the node closes)} of the final
--                         answer (1xx dropped) or nil, err (INVALID[err]: not valid
--                         HTTP); wait(got_bytes): called at a read timeout of the head,
--                         true to read on (the bytes read so far are kept)
--   read_body(head, sock) the next piece of the body (a string), or "" at its end
--                         (head.done set), or nil, err
local _M = {}

local concat = table.concat
local tonumber = tonumber
local lower = string.lower
local pairs = pairs
local sub = string.sub
local find = string.find

-- Largest chunk read at once from a body without chunked framing (bytes).
_M.READ_MAX = 16384

function _M.request(sock, r)
    local lines = { r.method or "POST", " ", r.path, " HTTP/1.1\r\nHost: ", r.host, "\r\n" }
    for k, v in pairs(r.headers or {}) do
        if v and v ~= "" then
            lines[#lines + 1] = k .. ": " .. v .. "\r\n"
        end
    end
    local body = r.body or ""
    lines[#lines + 1] = "Content-Length: " .. #body .. "\r\n\r\n"
    lines[#lines + 1] = body
    return sock:send(concat(lines))
end

-- One line of the head (nil, err on a read that failed and was not read on: wait());
-- `more`: a line after the status line (bytes of the head came: wait(true), so a node
-- whose header lines come a while after its status line is read on as one still silent).
local function head_line(sock, wait, more)
    local buf = ""
    while true do
        local line, err, partial = sock:receive("*l")
        if line then
            return buf .. line
        end
        -- a read timeout: wait(got_bytes) -> true reads on (it may set a new timeout)
        if err ~= "timeout" or not wait then
            return nil, err
        end
        buf = buf .. (partial or "")
        if not wait(more or buf ~= "") then
            return nil, err
        end
    end
end

-- Errors of read_head for bytes that are not a valid HTTP answer (the proxy path's
-- "upstream sent invalid header": 502 upstream_invalid_answer, another node tried).
_M.INVALID = { ["not an HTTP status line"] = true, ["invalid header line"] = true,
               ["invalid Content-Length"] = true }

-- The length of the Content-Length values `cls` (one per header line; "244, 244" is one
-- length sent twice, RFC 9110 8.6): nil for a value that is not digits or lengths that
-- differ (the answer's framing is unknown: RFC 9112 6.3 makes it invalid).
local function content_length(cls)
    local n
    for i = 1, #cls do
        for part in (cls[i] .. ","):gmatch("([^,]*),") do
            local d = part:match("^[ \t]*(%d+)[ \t]*$")
            d = d and #d <= 15 and tonumber(d)
            if not d or n and d ~= n then
                return nil
            end
            n = d
        end
    end
    return n
end
_M._content_length = content_length

-- One answer's head: status line and header lines.
local function head_of(sock, wait)
    local line, err = head_line(sock, wait)
    if not line then
        return nil, err
    end
    local status = tonumber(line:match("^HTTP/1%.[01] (%d%d%d)"))
    if not status then
        return nil, "not an HTTP status line"
    end
    local headers, list, cls = {}, {}, {}
    while true do
        local h, herr = head_line(sock, wait, true)
        if not h then
            return nil, herr
        end
        if h == "" then
            break
        end
        -- a name without spaces, a colon: a folded line (obs-fold) or one without a
        -- colon is invalid, as nginx's proxy finds it
        local k, v = h:match("^([^:%s]+):[ \t]*(.-)[ \t]*$")
        if not k then
            return nil, "invalid header line"
        end
        local lk = lower(k)
        if lk == "content-length" then
            cls[#cls + 1] = v
        end
        headers[lk] = v
        list[#list + 1] = { k, v }
    end
    local head = { status = status, headers = headers, list = list,
                   http10 = sub(line, 8, 8) == "0" }
    local te = headers["transfer-encoding"]
    if te and lower(te):find("chunked", 1, true) then
        head.chunked = true
        head.raw = ""
    elseif #cls > 0 then
        head.left = content_length(cls)
        if not head.left then
            return nil, "invalid Content-Length"
        end
        head.length = head.left
    end
    if status == 204 or status == 304 or head.left == 0 then
        head.done = true
    end
    return head
end

-- The final answer's head: interim answers (100 Continue, 103 Early Hints), which
-- HTTP/1.1 lets a server send first (RFC 9110 15.2), are read and dropped.
function _M.read_head(sock, wait)
    while true do
        local head, err = head_of(sock, wait)
        if not head or head.status >= 200 or head.status == 101 then
            return head, err
        end
    end
end

-- The chunk data available in head.raw (framing removed); "" when none is complete.
-- Trailers after the last chunk are not read (the connection is not reused).
local function dechunk(head)
    if head.done then
        return ""
    end
    local buf, out, pos = head.raw, {}, 1
    while true do
        local need = head.need
        if need then
            local avail = #buf - pos + 1
            if avail <= 0 then
                break
            end
            local take = avail < need and avail or need
            out[#out + 1] = sub(buf, pos, pos + take - 1)
            pos = pos + take
            head.need = need - take
            if head.need == 0 then
                head.need, head.crlf = nil, true
            end
        elseif head.crlf then
            if #buf - pos + 1 < 2 then
                break
            end
            pos, head.crlf = pos + 2, nil
        else
            local e = find(buf, "\r\n", pos, true)
            if not e then
                break
            end
            local hex = sub(buf, pos, e - 1):match("^%s*(%x+)")
            local size = hex and tonumber(hex, 16)
            if not size then
                return nil, "bad chunk"
            end
            pos = e + 2
            if size == 0 then
                head.done = true
                break
            end
            head.need = size
        end
    end
    head.raw = sub(buf, pos)
    return concat(out)
end
_M._dechunk = dechunk

-- Chunked body: what the buffered bytes hold, else one more read (a timeout loses
-- nothing: the bytes read so far stay in head.raw).
local function read_chunked(head, sock)
    while true do
        local data, err = dechunk(head)
        if not data then
            return nil, err
        end
        if data ~= "" or head.done then
            return data
        end
        local more, rerr = sock:receiveany(_M.READ_MAX)
        if not more then
            return nil, rerr
        end
        head.raw = head.raw .. more
    end
end

function _M.read_body(head, sock)
    if head.done then
        return ""
    end
    if head.chunked then
        return read_chunked(head, sock)
    end
    local left = head.left
    local want = _M.READ_MAX
    if left and left < want then
        want = left
    end
    local data, err = sock:receiveany(want)
    if not data then
        if err == "closed" and not left then
            head.done = true -- the node closes the connection at the end
            return ""
        end
        return nil, err
    end
    if left then
        head.left = left - #data
        if head.left <= 0 then
            head.done = true
        end
    end
    return data
end

return _M
