"""Checkers of the code's structure (tests/unit/test_structure.py and
tests/lua/test_lua_structure.py): long files, long functions, import circles, layers.
Each returns a sorted list of human-readable violations (empty: none), naming the file,
function or cycle, so a failing assertion says what to fix.

The Lua checkers read ``luac5.1 -p -l`` listings (Debian package lua5.1): one
``function <FILE:first,last>`` header per function (``main <FILE:0,0>`` for the chunk
itself), and a ``require("infergate.x")`` call compiles to ``GETGLOBAL ... ; require``
followed by ``LOADK ... ; "infergate.x"``. Nothing here imports the code it checks."""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LUA_ROOT = ROOT / "lua"
PY_PACKAGE = ROOT / "controlplane"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

_HEADER = re.compile(r"^(main|function) <(.+):(\d+),(\d+)> ")
_REQUIRE = re.compile(r"\bGETGLOBAL\b.*; require$")
_LOADK = re.compile(r'\bLOADK\b.*; "(.*)"$')


def rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def lua_files(root: Path = LUA_ROOT) -> list[Path]:
    return sorted(root.rglob("*.lua"))


def long_files(files: Iterable[Path], root: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    """``"lua/x.lua: 561 lines"`` for each file with more than ``limit`` lines."""
    out = []
    for f in files:
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{rel(f, root)}: {n} lines (limit {limit})")
    return sorted(out)


# ----------------------------------------------------------------------------- Lua

@dataclass
class LuaFunction:
    """One function of a luac listing: ``first``/``last`` source lines (0, 0 for the
    main chunk), the ``infergate.*`` modules it requires (string constant right after
    ``GETGLOBAL require``)."""
    file: str
    first: int
    last: int
    main: bool
    requires: list[str] = field(default_factory=list)


def luac() -> str:
    """Path of luac5.1; AssertionError when missing (install lua5.1: .ci/install)."""
    exe = shutil.which("luac5.1")
    assert exe, "luac5.1 not found: install the Debian package lua5.1 (see .ci/install)"
    return exe


def lua_listing(files: Iterable[Path], cwd: Path) -> list[LuaFunction]:
    """Every function of ``files`` from one ``luac5.1 -p -l`` run in ``cwd`` (file names
    relative to it). Raises AssertionError with luac's message when a file does not
    compile. luac's own chunk that joins several files, ``(luac)``, is left out."""
    names = [rel(f, cwd) for f in files]
    res = subprocess.run([luac(), "-p", "-l", *names], cwd=cwd, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, f"luac5.1 failed: {res.stderr}"
    out: list[LuaFunction] = []
    current: LuaFunction | None = None
    after_require = False
    for line in res.stdout.splitlines():
        m = _HEADER.match(line)
        if m:
            current = None
            if m.group(2) != "(luac)":            # luac's own chunk that runs the files
                current = LuaFunction(m.group(2), int(m.group(3)), int(m.group(4)),
                                      m.group(1) == "main")
                out.append(current)
            after_require = False
            continue
        if after_require and current is not None:
            k = _LOADK.search(line)
            if k:
                current.requires.append(k.group(1))
        after_require = bool(_REQUIRE.search(line))
    return out


def long_lua_functions(listing: Iterable[LuaFunction],
                       limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"lua/x.lua:87-199: 113 lines"`` for each function (not the main chunk) whose
    lines from ``function`` to ``end`` number more than ``limit``."""
    out = []
    for fn in listing:
        n = fn.last - fn.first + 1
        if not fn.main and n > limit:
            out.append((fn.file, fn.first, fn.last, n))
    return [f"{file}:{first}-{last}: function of {n} lines (limit {limit})"
            for file, first, last, n in sorted(out)]


def lua_module_name(file: str) -> str:
    """``lua/infergate/core/config.lua`` -> ``infergate.core.config`` (the path below the
    folder on lua_package_path, here the first component)."""
    parts = Path(file).with_suffix("").parts
    return ".".join(parts[1:]) if len(parts) > 1 else parts[0]


def lua_requires(listing: Iterable[LuaFunction], *, module_level_only: bool,
                 prefix: str = "infergate.") -> dict[str, set[str]]:
    """module -> the ``prefix*`` modules it requires: from its main chunk only (run when
    the module loads) or from any of its functions."""
    graph: dict[str, set[str]] = {}
    for fn in listing:
        mod = lua_module_name(fn.file)
        deps = graph.setdefault(mod, set())
        if fn.main or not module_level_only:
            deps.update(r for r in fn.requires if r.startswith(prefix))
    return graph


def layer_violations(graph: dict[str, set[str]], layer: str, forbidden: Iterable[str]) -> list[str]:
    """``"infergate.core.x requires infergate.cache.y"`` for each module under ``layer``
    (a module name prefix, e.g. ``infergate.core``) that requires one under a forbidden
    prefix."""
    out = []
    for mod, deps in graph.items():
        if mod == layer or mod.startswith(layer + "."):
            for dep in deps:
                if any(dep == f or dep.startswith(f + ".") for f in forbidden):
                    out.append(f"{mod} requires {dep}")
    return sorted(out)


def files_containing(files: Iterable[Path], word: str, root: Path) -> list[str]:
    """``"lua/x.lua:12: <line>"`` for each line of ``files`` that contains ``word``."""
    out = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if word in line:
                out.append(f"{rel(f, root)}:{i}: {line.strip()}")
    return out


# ----------------------------------------------------------------------------- Python

def parse(path: Path) -> ast.Module:
    """The syntax tree of ``path``, parsed once per content (several checks read it)."""
    return _parse(path.read_text(encoding="utf-8"), str(path))


@functools.lru_cache(maxsize=None)
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename)


def python_files(package: Path = PY_PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def long_python_functions(files: Iterable[Path], root: Path,
                          limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"controlplane/x.py:12 Class.method: 95 lines"`` for each function or method
    (nested ones too) whose lines from ``def`` to its last line number more than
    ``limit`` (decorators not counted)."""
    out: list[tuple[str, int, str]] = []
    for f in files:
        tree = parse(f)
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}"
                    if not isinstance(child, ast.ClassDef):
                        n = (child.end_lineno or child.lineno) - child.lineno + 1
                        if n > limit:
                            out.append((rel(f, root), child.lineno,
                                        f"{name}: {n} lines (limit {limit})"))
                    name += "."
                stack.append((child, name))
    return [f"{file}:{line} {what}" for file, line, what in sorted(out)]


def python_module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]) -> Iterable[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module loads: the module body and the blocks of
    its top-level if/try/with statements, but not ``if TYPE_CHECKING:`` nor anything in a
    function or class body."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _module_level_imports(stmt.body)
            yield from _module_level_imports(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody,
                          *[h.body for h in stmt.handlers]):
                yield from _module_level_imports(block)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _module_level_imports(stmt.body)


def python_imports(files: Iterable[Path], root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports at module level (see
    :func:`_module_level_imports`). ``from a.b import c`` is an edge to ``a.b.c`` when
    that is a module of the tree, else to ``a.b``; a package's own ``__init__`` is
    ``a.b``. Parent packages a dotted import runs first are not counted as edges."""
    paths = list(files)
    modules = {python_module_name(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for p in paths:
        mod = python_module_name(p, root)
        is_pkg = p.name == "__init__.py"
        deps = graph.setdefault(mod, set())
        tree = parse(p)
        for node in _module_level_imports(tree.body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.add(t)
    return graph


# ----------------------------------------------------------------------------- cycles

def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One cycle ``"a -> b -> c -> a"`` for each strongly connected group of modules
    that import one another (Tarjan's algorithm, then a shortest path back through the
    group), plus ``"a -> a"`` for a module that requires itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})

    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                groups.append(sorted(group))

    out = []
    for group in groups:
        first = group[0]
        if len(group) == 1:
            if first in graph.get(first, ()):
                out.append(f"{first} -> {first}")
            continue
        out.append(" -> ".join(_path_back(graph, first, set(group))))
    return sorted(out)


def _path_back(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """Shortest path start -> ... -> start inside ``within`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w not in within:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if v != start else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, "?", start]
