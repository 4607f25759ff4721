"""What a request body is on the routes beyond completions, and the form fields of a
multipart/form-data body (infergate.core.bodykind), run in nginx's init_by_lua
(support.stack.lua_eval); the multipart bodies are written by the encoder the requests
library uses, as clients send them."""

from __future__ import annotations

import json
from pathlib import Path

from requests.models import RequestEncodingMixin
from support.stack import lua_eval

from controlplane.edge.options import lua_string


def _form(fields: dict) -> tuple[bytes, str]:
    return RequestEncodingMixin._encode_files(
        {k: v for k, v in fields.items() if isinstance(v, tuple)},
        {k: v for k, v in fields.items() if not isinstance(v, tuple)})


def test_kind_of_a_body(workdir: Path) -> None:
    cases = [
        ("multipart/form-data; boundary=x", "", "multipart"),
        ("Multipart/Form-Data;boundary=x", "{", "multipart"),
        ("application/json", "", "json"),
        ("application/json; charset=utf-8", "[1]", "json"),
        ("application/vnd.api+json", "x", "json"),
        ("application/x-www-form-urlencoded", '  {"a": 1}', "json"),
        (None, '{"a": 1}', "json"),
        ("text/plain; note=json", "hello", "opaque"),
        ("application/octet-stream", "\x00\x01", "opaque"),
        (None, "", "opaque"),
        (None, None, "opaque"),
    ]
    got = lua_eval(workdir, """
        local bodykind = require("infergate.core.bodykind")
        local cases = require("cjson.safe").decode(""" + lua_string(json.dumps(cases)) + """)
        local null = require("cjson.safe").null
        local out = {}
        for i, c in ipairs(cases) do
            local ct = c[1] ~= null and c[1] or nil
            local text = c[2] ~= null and c[2] or nil
            out[i] = bodykind.kind(ct, text)
        end
        out[#out + 1] = bodykind.kind({"multipart/form-data; boundary=a", "text/plain"}, "")
        return out
    """)
    assert got == [c[2] for c in cases] + ["multipart"]


def test_form_fields_of_a_multipart_body(workdir: Path) -> None:
    audio = bytes(range(256)) * 4 + b"\r\n--not-the-boundary\r\n"
    before, ct_before = _form({"model": "m-a", "file": ("a.wav", audio, "audio/wav")})
    after, ct_after = _form({"file": ("a.wav", audio, "audio/wav"), "language": "en",
                             "model": "org/Model 7B"})
    none, ct_none = _form({"file": ("a.wav", audio, "audio/wav"), "filename": "x"})
    hand = (b"--q\r\ncontent-disposition: form-data; name=model\r\n"
            b"content-type: text/plain\r\n\r\nbare\r\n--q--\r\n")
    cut = before[: before.index(b"m-a") + 2]
    cases = [
        (before, ct_before), (after, ct_after), (none, ct_none),
        (hand, 'multipart/form-data; BOUNDARY="q"'), (cut, ct_before),
        (before, "multipart/form-data"), (before, ct_before.replace("boundary=", "boundary=z")),
    ]
    got = lua_eval(workdir, """
        local bodykind = require("infergate.core.bodykind")
        local cases = require("cjson.safe").decode(""" + lua_string(json.dumps(
        [[b.decode("latin-1"), ct] for b, ct in cases])) + """)
        local function bytes(s)   -- latin-1 text back to the bytes
            return (ngx.re.gsub(s, "[\\\\x{80}-\\\\x{ff}]", function(m)
                local cp = m[0]:byte(1) % 4 * 64 + m[0]:byte(2) % 64
                return string.char(cp)
            end, "jou"))
        end
        local out = {}
        for i, c in ipairs(cases) do
            out[i] = bodykind.form_field(bytes(c[1]), c[2], "model") or false
        end
        out[#out + 1] = bodykind.boundary('multipart/form-data; boundary="a b"; charset=x')
        out[#out + 1] = bodykind.boundary("multipart/form-data; boundary=" .. string.rep("b", 71))
            or false
        return out
    """)
    assert got == ["m-a", "org/Model 7B", False, "bare", False, False, False, "a b", False]
