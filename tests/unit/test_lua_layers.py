"""The import graph of the edge's Lua modules, read from the source (every
``require("infergate.…")``, at the top or inside a function): ``core/`` imports nothing
above it, every required module exists, and no import circle passes through ``core/``
or the phase modules (``phases``, ``access``, ``filters``, ``log``, ``errorpage``)."""

from __future__ import annotations

import re
from pathlib import Path

LUA = Path(__file__).resolve().parents[2] / "lua"
REQUIRE = re.compile(r"""require\(?\s*["'](infergate\.[\w.]+)["']""")
PHASE_MODULES = {"infergate.phases", "infergate.access", "infergate.filters", "infergate.log",
                 "infergate.errorpage"}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in LUA.rglob("*.lua"):
        name = ".".join(path.relative_to(LUA).with_suffix("").parts)
        text = re.sub(r"--\[(=*)\[.*?\]\1\]", "", path.read_text(encoding="utf-8"), flags=re.S)
        text = re.sub(r"--[^\n]*", "", text)
        graph[name] = set(REQUIRE.findall(text))
    return graph


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_core_imports_nothing_above_it() -> None:
    graph = _graph()
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith("infergate.core.")
                 for d in deps if not d.startswith("infergate.core."))
    assert "infergate.phases" in graph and "infergate.core.reqctx" in graph
    assert not bad, bad


def test_every_required_module_exists() -> None:
    graph = _graph()
    missing = sorted({d for deps in graph.values() for d in deps} - graph.keys())
    assert not missing, missing


def test_no_import_circle_through_core_or_the_phases() -> None:
    bad = [sorted(c) for c in _circles(_graph())
           if any(m.startswith("infergate.core.") or m in PHASE_MODULES for m in c)]
    assert not bad, bad


def test_circles_are_found() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
