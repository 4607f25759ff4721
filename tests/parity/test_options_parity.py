"""The edge's options have one source of truth: the pydantic fields of
controlplane/config.py. The spec generated from them (controlplane/edge/options.py) is
what the edge's validator (lua/infergate/core/options.lua) checks the rendered document
against, so for every field of the spec its default, each bound, a value just outside
each bound and a value outside an enum must get the same verdict, and the same message,
from pydantic (the one validator on the Python side, the one render-nginx runs) and from
the edge. A spec changed on the edge's side only must show up as a mismatch."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from support.stack import lua_eval

from controlplane.config import ConfigError, load_settings, settings_from_dict
from controlplane.edge.options import edge_document, option_spec, rendered_options
from controlplane.edge.render import render_nginx, render_nginx_cmd


class Key(str):
    """A map key in a field path (``cache.min_similarity_models["m"]``)."""


def _text(path: tuple) -> str:
    out = ""
    for p in path:
        out += f'["{p}"]' if isinstance(p, Key) else (f".{p}" if out else str(p))
    return out


def _step(b: float, kind: str) -> float:
    return 1 if kind == "integer" else 1e-6 * max(1.0, abs(b))


def _leaf_cases(path: tuple, s: dict) -> list[tuple[tuple, Any, str]]:
    """(path, value, why) cases of one field spec."""
    cases = []
    if "default" in s:
        cases.append((path, s["default"], "default"))
    elif s.get("nullable"):
        cases.append((path, None, "default null"))
    kind = s.get("type")
    if kind in ("number", "integer"):
        cases.append((path, True, "a boolean for a number"))
        for name, inside, outside in (("minimum", 0, -1), ("maximum", 0, 1),
                                      ("exclusiveMinimum", 1, 0), ("exclusiveMaximum", -1, 0)):
            if name not in s:
                continue
            b = s[name]
            d = _step(b, kind)
            if name.startswith("exclusive"):
                cases.append((path, b + inside * d, f"just inside {name} {b}"))
                cases.append((path, b, f"at {name} {b}"))
            else:
                cases.append((path, b, f"at {name} {b}"))
                cases.append((path, b + outside * d, f"just outside {name} {b}"))
    for v in s.get("enum", []):
        cases.append((path, v, "enum value"))
    if "enum" in s:
        cases.append((path, f"not-{s['enum'][0]}", "outside the enum"))
    if kind == "object" and "fields" in s:
        for name, fs in s["fields"].items():
            cases += _leaf_cases(path + (name,), fs)
    if kind == "object" and "values" in s:
        keys = (s.get("keys") or {}).get("enum") or ["m"]
        cases += _leaf_cases(path + (Key(keys[0]),), s["values"])
    return cases


def spec_cases(spec: dict) -> list[tuple[tuple, Any, str]]:
    """Every case of every field of ``spec`` (an edge option spec)."""
    return _leaf_cases((), spec)


def _fragment(path: tuple, value: Any) -> dict:
    doc: Any = value
    for p in reversed(path):
        doc = {str(p): doc}
    return doc


def pydantic_verdict(path: tuple, value: Any) -> str:
    """``"ok"`` or the message of the refusal (the line naming the field)."""
    try:
        settings_from_dict(_fragment(path, value))
    except ConfigError as exc:
        lines = exc.fields
        return next((ln for ln in lines if ln.startswith(_text(path))), lines[0])
    return "ok"


def lua_verdicts(workdir: Path, docs: list[dict], spec: dict) -> list[str]:
    """The edge's verdict on each document: ``"ok"`` or its message (one nginx run)."""
    d = workdir / f"parity-{len(list(workdir.glob('parity-*')))}"
    d.mkdir(parents=True)
    (d / "docs.json").write_text(json.dumps(docs))
    (d / "spec.json").write_text(json.dumps(spec))
    return lua_eval(workdir, f"""
            local cjson = require("cjson.safe")
            local function read(name)
                local f = assert(io.open("{d}/" .. name, "rb"))
                local text = f:read("*a")
                f:close()
                return text
            end
            local config = require("infergate.core.config")
            local docs = cjson.decode(read("docs.json"))
            local spec = read("spec.json")
            local out = {{}}
            for i, doc in ipairs(docs) do
                local ok, err = config.init(doc, spec)
                out[i] = ok and "ok" or err
            end
            return out
    """)


def compare(workdir: Path, spec: dict, lua_spec: dict) -> list[str]:
    """Cases of ``spec`` on which pydantic and the edge (validating against ``lua_spec``)
    disagree, as ``"<path> = <value> (<why>): pydantic ..., edge ..."`` lines."""
    cases = spec_cases(spec)
    lua = lua_verdicts(workdir, [_fragment(p, v) for p, v, _ in cases], lua_spec)
    problems = []
    for (path, value, why), edge in zip(cases, lua):
        py = pydantic_verdict(path, value)
        if py != edge:
            problems.append(f"{_text(path)} = {value!r} ({why}): pydantic {py!r}, "
                            f"edge {edge!r}")
    return problems


# --------------------------------------------------------------------------- parity

def test_cases_cover_every_field_and_can_fail() -> None:
    spec = option_spec()
    cases = spec_cases(spec)
    paths = {_text(p) for p, _, _ in cases}
    for section in ("edge", "redis", "auth", "limits", "admission", "deadlines", "cache"):
        fields = spec["fields"][section]["fields"]
        assert all(f"{section}.{name}" in paths or fields[name].get("type") == "object"
                   for name in fields), section
    assert 'cache.min_similarity_models["m"]' in paths
    assert 'deadlines.routes["/v1/chat/completions"].request_ms' in paths
    # the bounds the edge used to own are the pydantic ones now
    edge = spec["fields"]["edge"]["fields"]
    assert edge["redis_timeout_ms"]["maximum"] == 60000
    assert spec["fields"]["limits"]["fields"]["chars_per_token"]["minimum"] == 0.01
    refused = [(p, v) for p, v, why in cases if why.startswith(("just outside", "at exclusive",
                                                                "outside the enum"))]
    assert len(refused) > 40
    assert all(pydantic_verdict(p, v) != "ok" for p, v in refused)


def test_pydantic_and_the_edge_agree_on_every_field(workdir: Path) -> None:
    spec = option_spec()
    assert compare(workdir, spec, spec) == []


def test_a_bound_changed_on_the_edge_only_is_reported(workdir: Path) -> None:
    spec = option_spec()
    drifted = copy.deepcopy(spec)
    drifted["fields"]["edge"]["fields"]["redis_timeout_ms"]["maximum"] = 50000
    drifted["fields"]["auth"]["fields"]["mode"]["enum"] = ["off", "required", "optional"]
    drifted["fields"]["cache"]["fields"]["min_similarity_models"]["values"]["minimum"] = 0.5
    problems = compare(workdir, spec, drifted)
    reported = {line.split(" = ")[0] for line in problems}
    assert reported == {"edge.redis_timeout_ms", "auth.mode",
                        'cache.min_similarity_models["m"]'}, problems


# --------------------------------------------------------------------------- defaults

def test_defaults_are_the_same_on_both_sides(workdir: Path) -> None:
    got = _lua_defaults(workdir, option_spec())
    want = edge_document(load_settings(None))
    want.pop("nodes")
    # a null (cache.min_similarity unset) is an absent field at the edge
    assert got["doc"] == {sec: {k: v for k, v in fields.items() if v is not None}
                          for sec, fields in want.items()}
    assert got["cache_enabled"] is False and want["cache"]["enabled"] is False
    assert got["edge_id"] == "edge"  # an empty edge.edge_id; render-nginx sets host:port
    assert got["shed"] is True and got["redis_url"] == want["redis"]["url"]
    assert got["latency_norm_s"] == want["scoring"]["latency_norm_s"]


def _lua_defaults(workdir: Path, spec: dict) -> dict:
    (workdir / "spec.json").write_text(json.dumps(spec))
    return lua_eval(workdir, f"""
            local f = assert(io.open("{workdir / 'spec.json'}", "rb"))
            local spec = f:read("*a")
            f:close()
            local config = require("infergate.core.config")
            assert(config.init("{{}}", spec))
            local o = config.get()
            return {{ doc = config.document(), cache_enabled = o.cache.enabled,
                      edge_id = o.edge.edge_id, shed = o.admission.shed,
                      redis_url = o.redis.url, latency_norm_s = o.scoring.latency_norm_s }}
    """)


def test_rendered_document_is_valid_and_carries_every_field(workdir: Path) -> None:
    s = settings_from_dict({"redis": {"url": "redis://127.0.0.1:6390/0"},
                            "edge": {"metrics_listen": ""}})
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18177")
    doc, spec = rendered_options(r.http_conf.read_text())
    assert spec == option_spec()
    # the edge accepts it and has nothing left to fill in (a null is an absent field there)
    assert _lua_document(workdir, doc, spec) == {
        sec: {k: v for k, v in fields.items() if v is not None}
        for sec, fields in doc.items() if sec != "nodes"}
    for section, sspec in spec["fields"].items():
        assert set(doc[section]) == set(sspec["fields"]), section


def _lua_document(workdir: Path, doc: dict, spec: dict) -> dict:
    """The document as the edge validated it (``config.document()``)."""
    (workdir / "doc.json").write_text(json.dumps(doc))
    (workdir / "spec.json").write_text(json.dumps(spec))
    return lua_eval(workdir, f"""
            local function read(name)
                local f = assert(io.open("{workdir}/" .. name, "rb"))
                local text = f:read("*a")
                f:close()
                return text
            end
            local config = require("infergate.core.config")
            assert(config.init(read("doc.json"), read("spec.json")))
            return config.document()
    """)


# --------------------------------------------------------------------------- the named bugs

@pytest.mark.parametrize("toml, path, value", [
    ("[edge]\nredis_timeout_ms = 100000\n", ("edge", "redis_timeout_ms"), 100000),
    ("[limits]\nchars_per_token = 0.005\n", ("limits", "chars_per_token"), 0.005),
])
def test_render_nginx_refuses_what_the_edge_refuses(workdir: Path, toml: str, path: tuple,
                                                   value: Any) -> None:
    [edge_message] = lua_verdicts(workdir, [_fragment(path, value)], option_spec())
    assert edge_message.startswith(".".join(path) + ": ")
    assert "above the maximum 60000" in edge_message or "below the minimum 0.01" in edge_message
    cfg = workdir / "bad.toml"
    cfg.write_text(toml)
    res = CliRunner().invoke(render_nginx_cmd, ["--config", str(cfg), "--out", str(workdir / "o")])
    assert res.exit_code != 0
    assert edge_message in res.output
    assert "Traceback" not in res.output


def test_render_refuses_a_value_assigned_after_loading(workdir: Path) -> None:
    """Values set on the settings after loading (as ``infergate up`` does) are checked
    when rendering, in the same words."""
    from controlplane.edge.render import RenderError

    s = settings_from_dict({"redis": {"url": "redis://127.0.0.1:6390/0"}})
    s.edge.redis_timeout_ms = 100000
    with pytest.raises(RenderError, match="edge.redis_timeout_ms: 100000 is above the maximum 60000"):
        render_nginx(s, workdir / "out", listen="127.0.0.1:18178")
