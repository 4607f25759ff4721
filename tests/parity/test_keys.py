"""Every Redis key name in lua/infergate/redis/keynames.lua equals the one in controlplane/redisdb/keynames.py.

keynames.lua is evaluated for real (inside nginx's init_by_lua, see support.stack.lua_eval):
its string fields are compared with ``keynames.FIXED`` both ways, and every public key
function of ``controlplane.redisdb.keynames`` is called in both languages with the same arguments."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from controlplane import paths
from controlplane.redisdb import keynames
from support.stack import lua_eval


def _key_functions() -> dict[str, list]:
    """Public functions of controlplane.redisdb.keynames -> sample arguments from their annotations."""
    out = {}
    for name, fn in inspect.getmembers(keynames, inspect.isfunction):
        if name.startswith("_") or fn.__module__ != keynames.__name__:
            continue
        args = []
        for i, p in enumerate(inspect.signature(fn).parameters.values()):
            ann = str(p.annotation)
            args.append(384 + i if "int" in ann else f"arg{i}-x")
        out[name] = args
    return out


def _lua_view(workdir: Path, calls: dict[str, list]) -> dict:
    code = f"""
            local cjson = require("cjson.safe")
            local k = require("infergate.redis.keynames")
            local calls = cjson.decode([==[{json.dumps(calls)}]==])
            local strings, functions, results = {{}}, {{}}, {{}}
            for name, v in pairs(k) do
                if type(v) == "string" then strings[name] = v
                elseif type(v) == "function" then functions[#functions + 1] = name end
            end
            for name, args in pairs(calls) do
                if type(k[name]) == "function" then
                    results[name] = k[name](unpack(args))
                end
            end
            return {{ strings = strings, functions = functions, results = results }}
    """
    return lua_eval(workdir, code)


def test_fixed_keys_equal(workdir: Path) -> None:
    view = _lua_view(workdir, {})
    lua_strings = dict(view["strings"])
    assert lua_strings.pop("BASE") == keynames.BASE
    assert lua_strings == keynames.FIXED


def test_key_functions_equal(workdir: Path) -> None:
    calls = _key_functions()
    assert "node_metrics" in calls and "node_history" in calls
    view = _lua_view(workdir, calls)
    assert sorted(view["functions"]) == sorted(calls), "same key functions in both languages"
    for name, args in calls.items():
        assert view["results"][name] == getattr(keynames, name)(*args), name


def test_every_key_starts_with_schema_prefix() -> None:
    for name, value in keynames.FIXED.items():
        assert value.startswith("infergate:v1:"), name
    text = (paths.lua_dir() / "infergate" / "redis" / "keynames.lua").read_text()
    assert re.search(r'local BASE = "infergate:v1"', text)
    # no key name spelled out in the code of any other edge module (comments may cite them)
    for lua in (paths.lua_dir() / "infergate").glob("*.lua"):
        if lua.name != "keys.lua":
            code = re.sub(r"--.*$", "", lua.read_text(), flags=re.M)
            assert not re.search(r"infergate:v[0-9]", code), lua.name
