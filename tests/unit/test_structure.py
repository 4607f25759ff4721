"""The code keeps its structure (read from the source, nothing imported or run):

- no Lua file in lua/ over 500 lines;
- no Python function or method in controlplane/ over 80 lines (``def`` line to its last
  line; nested functions count on their own and inside their parent);
- no import circle among the modules of controlplane/. Only module-level imports count
  (those that run when the module loads: the module body and its top-level
  if/try/with blocks, not ``if TYPE_CHECKING:``): an import inside a function runs when
  the function is called, the usual way to break a circle at load time;
- no step of the access phase is inserted from outside: no ``insert_step`` in lua/ (one
  module lists every step of every phase).

The luac-based Lua checks (function length, require circles, the core layer) are in
tests/lua/test_lua_structure.py; the checkers are in tests/support/structure.py, and the
tests at the end run them on tiny trees with a good and a bad example."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import structure as st


def test_no_lua_file_over_500_lines() -> None:
    found = st.long_files(st.lua_files(), st.ROOT)
    assert not found, "Lua files over 500 lines (split them by concern):\n" + "\n".join(found)


def test_no_python_function_over_80_lines() -> None:
    found = st.long_python_functions(st.python_files(), st.ROOT)
    assert not found, "Python functions over 80 lines:\n" + "\n".join(found)


def test_the_python_import_graph_is_read() -> None:
    graph = st.python_imports(st.python_files(), st.ROOT)
    assert set(graph) == {st.python_module_name(p, st.ROOT) for p in st.python_files()}
    assert sum(len(deps) for deps in graph.values()) > len(graph)


def test_no_python_import_circle() -> None:
    found = st.cycles(st.python_imports(st.python_files(), st.ROOT))
    assert not found, "import circles among controlplane/ modules (module-level imports):\n" \
        + "\n".join(found)


def test_no_insert_step_in_lua() -> None:
    found = st.files_containing(st.lua_files(), "insert_step", st.ROOT)
    assert not found, "insert_step in lua/ (list the step in the module of the phases):\n" \
        + "\n".join(found)


# ------------------------------------------------------------- the checkers on tiny trees

def _write(root: Path, files: dict[str, str]) -> list[Path]:
    out = []
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        out.append(p)
    return sorted(out)


def test_long_files_names_only_the_long_one(tmp_path: Path) -> None:
    files = _write(tmp_path, {"lua/a.lua": "x\n" * 500, "lua/b.lua": "x\n" * 501})
    assert st.long_files(files, tmp_path) == ["lua/b.lua: 501 lines (limit 500)"]


def test_long_python_functions_names_the_function(tmp_path: Path) -> None:
    def body(indent: int, n: int) -> str:
        return (" " * indent + "x = 1\n") * n

    files = _write(tmp_path, {"pkg/m.py": (
        "def short():\n" + body(4, 79)                          # lines 1-80: 80 lines
        + "class K:\n    @staticmethod\n    def long():\n" + body(8, 80)  # 83-163: 81
        + "async def outer():\n    def inner():\n" + body(8, 80)  # 164-246, 165-245
        + "    return inner\n")})
    assert st.long_python_functions(files, tmp_path) == [
        "pkg/m.py:83 K.long: 81 lines (limit 80)",
        "pkg/m.py:164 outer: 83 lines (limit 80)",
        "pkg/m.py:165 outer.inner: 81 lines (limit 80)",
    ]


def test_python_imports_count_module_level_only(tmp_path: Path) -> None:
    files = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\nimport os\n",
        "pkg/b.py": "from . import c\ntry:\n    import pkg.sub.d\nexcept ImportError:\n    pass\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                    "def f():\n    from pkg import a\n",
        "pkg/sub/__init__.py": "from .d import thing\n",
        "pkg/sub/d.py": "from ..c import name\nthing = 1\n",
    })
    assert st.python_imports(files, tmp_path) == {
        "pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c", "pkg.sub.d"}, "pkg.c": set(),
        "pkg.sub": {"pkg.sub.d"}, "pkg.sub.d": {"pkg.c"},
    }
    assert st.cycles(st.python_imports(files, tmp_path)) == []
    (tmp_path / "pkg/c.py").write_text("import pkg.a\n")
    assert st.cycles(st.python_imports(files, tmp_path)) == ["pkg.a -> pkg.b -> pkg.c -> pkg.a"]


@pytest.mark.parametrize("graph, expect", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, ["a -> b -> a"]),
    ({"a": {"a"}}, ["a -> a"]),
    ({"a": {"b", "x"}, "b": {"c"}, "c": {"a", "b"}, "x": {"y"}, "y": {"x"}},
     ["a -> b -> c -> a", "x -> y -> x"]),
])
def test_cycles(graph: dict[str, set[str]], expect: list[str]) -> None:
    assert st.cycles(graph) == expect


def test_layer_violations_and_lua_requires() -> None:
    listing = [
        st.LuaFunction("lua/infergate/core/a.lua", 0, 0, True, ["infergate.core.b", "cjson"]),
        st.LuaFunction("lua/infergate/core/a.lua", 3, 9, False, ["infergate.cache.key"]),
        st.LuaFunction("lua/infergate/core/b.lua", 0, 0, True, []),
        st.LuaFunction("lua/infergate/routing/r.lua", 0, 0, True, ["infergate.core.a"]),
    ]
    assert st.lua_requires(listing, module_level_only=True) == {
        "infergate.core.a": {"infergate.core.b"}, "infergate.core.b": set(),
        "infergate.routing.r": {"infergate.core.a"}}
    every = st.lua_requires(listing, module_level_only=False)
    assert every["infergate.core.a"] == {"infergate.core.b", "infergate.cache.key"}
    assert st.layer_violations(every, "infergate.core", ["infergate.cache", "infergate.routing"]) \
        == ["infergate.core.a requires infergate.cache.key"]
    assert st.layer_violations(every, "infergate.routing", ["infergate.cache"]) == []


def test_files_containing(tmp_path: Path) -> None:
    files = _write(tmp_path, {"lua/a.lua": "local x = 1\n  m.insert_step(1)\n",
                              "lua/b.lua": "return {}\n"})
    assert st.files_containing(files, "insert_step", tmp_path) == ["lua/a.lua:2: m.insert_step(1)"]
