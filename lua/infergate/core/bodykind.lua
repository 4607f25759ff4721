-- What a request body is, for the routes that take more than JSON (infergate.access,
-- routes "api" and "passthrough"), and the fields of a multipart/form-data body.
-- Pure string functions, no I/O.
--
--   kind(content_type, text) -> "multipart" | "json" | "opaque"
--       "multipart": Content-Type multipart/form-data (audio uploads: a file part and
--                    form fields such as "model");
--       "json":      a Content-Type naming JSON (application/json, application/*+json), or
--                    any other type (curl -d sends application/x-www-form-urlencoded) whose
--                    text starts with "{" after white space;
--       "opaque":    anything else (binary audio, plain text, an empty body).
--   boundary(content_type) -> the multipart boundary, or nil
--   form_field(text, content_type, name) -> the value of the first form field `name`
--       (a part whose Content-Disposition names it), or nil: no boundary, no such part,
--       or a body cut short. The scan stops at that part: a large file part after it is
--       not read.
local _M = {}

local find = string.find
local lower = string.lower
local match = string.match
local sub = string.sub
local type = type

local function lc(content_type)
    if type(content_type) == "table" then
        content_type = content_type[1]  -- a repeated header: the first one
    end
    if type(content_type) ~= "string" then
        return nil
    end
    return lower(content_type)
end

function _M.kind(content_type, text)
    local ct = lc(content_type)
    if ct and find(ct, "^%s*multipart/form%-data") then
        return "multipart"
    end
    if ct and match(ct, "^%s*[^;]*json") then
        return "json"
    end
    if type(text) == "string" and find(text, "^%s*{") then
        return "json"
    end
    return "opaque"
end

function _M.boundary(content_type)
    if type(content_type) == "table" then
        content_type = content_type[1]
    end
    if type(content_type) ~= "string" then
        return nil
    end
    -- RFC 2046 section 5.1.1: 1 to 70 characters, quoted or a token; the parameter name
    -- is case-insensitive
    local s, e = find(lower(content_type), ";%s*boundary%s*=%s*")
    if not s then
        return nil
    end
    local rest = sub(content_type, e + 1)
    local b = match(rest, '^"([^"]+)"') or match(rest, "^([^;%s]+)")
    if not b or #b > 70 then
        return nil
    end
    return b
end

-- The form field name of a part's header block, or nil.
local function part_name(headers)
    for line in (headers .. "\r\n"):gmatch("([^\r\n]*)\r\n") do
        if find(lower(line), "^content%-disposition%s*:") then
            return match(line, '[;%s][Nn][Aa][Mm][Ee]%s*=%s*"([^"]*)"')
                or match(line, "[;%s][Nn][Aa][Mm][Ee]%s*=%s*([^;%s\"]+)")
        end
    end
    return nil
end

function _M.form_field(text, content_type, name)
    local b = _M.boundary(content_type)
    if not b or type(text) ~= "string" then
        return nil
    end
    local delim = "--" .. b
    local _, e = find(text, delim, 1, true)
    while e do
        if sub(text, e + 1, e + 2) == "--" then
            return nil -- the closing delimiter
        end
        -- the rest of the delimiter line (transport padding), then the part's headers
        local line_end = find(text, "\r\n", e + 1, true)
        if not line_end then
            return nil
        end
        local head_end = find(text, "\r\n\r\n", line_end, true)
        if not head_end then
            return nil
        end
        local headers = sub(text, line_end + 2, head_end - 1)
        local next_s, next_e = find(text, "\r\n" .. delim, head_end + 4, true)
        if not next_s then
            return nil
        end
        if part_name(headers) == name then
            return sub(text, head_end + 4, next_s - 1)
        end
        e = next_e
    end
    return nil
end

return _M
