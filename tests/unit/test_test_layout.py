"""The layout rules of the test suite, checked on the source (ast, no import):

- no test module imports another test module (shared helpers live in tests/support/);
- no test of tests/unit/ asks for a fixture that starts processes (those tests belong
  in an integration layer; tests/unit/conftest.py also refuses to start any process);
- the fast loop (``-m "not integration"``) is tests/unit/ and tests/lua/; a test of
  tests/lua/ that asks for a fixture starting a server carries the ``integration`` marker
  (tests/lua/conftest.py also refuses a server to any other);
- test module names are unique over all layers (the folders are not packages, so two
  ``test_x.py`` would clash at import).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
#: Fixtures of tests/conftest.py and tests/support/ that start processes.
PROCESS_FIXTURES = {"redis_server", "shared_redis_port", "r", "simnodes", "edge_factory",
                    "controlplane_factory", "realnodes", "redis_cluster"}
#: Fixtures of tests/lua/ modules that start servers.
LUA_SERVER_FIXTURES = {"lua_runner", "redis_auth"}


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "output" not in p.relative_to(TESTS).parts)


def _imported(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.append("." * node.level + (node.module or ""))
            else:
                names.append(node.module or "")
    return names


def _is_test_module(name: str) -> bool:
    parts = name.lstrip(".").split(".")
    return (name.startswith(".") or parts[0] == "tests" or parts[0] == "conftest"
            or any(p.startswith("test_") for p in parts))


def test_no_test_module_imports_another() -> None:
    bad = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        bad += [f"{path.relative_to(TESTS)}: {n}" for n in _imported(tree) if _is_test_module(n)]
    assert not bad, "test modules imported (move shared code to tests/support/):\n" + "\n".join(bad)


def test_unit_tests_ask_for_no_process_fixture() -> None:
    found = []
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    node.name.startswith("test_") or any(
                        "fixture" in ast.unparse(d) for d in node.decorator_list)):
                args = {a.arg for a in node.args.args + node.args.kwonlyargs}
                for name in sorted(args & PROCESS_FIXTURES):
                    found.append(f"{path.name}:{node.lineno} {node.name}({name})")
    assert not found, "unit tests asking for process fixtures (move them out of tests/unit/):\n" \
        + "\n".join(found)


def _marked_integration(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d).endswith("mark.integration") for d in decorators)


def _unmarked_server_tests(path: Path) -> list[str]:
    """Tests of ``path`` that ask for a server fixture without the integration marker
    (on the function, or ``pytestmark`` of the module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets) \
                and "mark.integration" in ast.unparse(node.value):
            return []
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test_") and not _marked_integration(node.decorator_list):
            args = {a.arg for a in node.args.args + node.args.kwonlyargs}
            for name in sorted(args & (PROCESS_FIXTURES | LUA_SERVER_FIXTURES)):
                found.append(f"{path.name}:{node.lineno} {node.name}({name})")
    return found


def test_fast_loop_is_unit_and_lua() -> None:
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    layers = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "FAST_LAYERS" for t in n.targets)]
    assert layers == [{"unit", "lua"}]
    assert "Managed" in (TESTS / "lua" / "conftest.py").read_text(encoding="utf-8")


def test_lua_tests_that_start_servers_are_marked_integration() -> None:
    found = []
    for path in sorted((TESTS / "lua").glob("test_*.py")):
        found += _unmarked_server_tests(path)
    assert not found, "tests/lua/ tests starting servers without @pytest.mark.integration " \
        "(tests/lua/ is in the fast loop):\n" + "\n".join(found)


def test_test_module_names_are_unique() -> None:
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def test_the_layout_checks_can_fail() -> None:
    tree = ast.parse("import test_other\nfrom .helpers import x\nfrom support.stack import y\n")
    assert [_is_test_module(n) for n in _imported(tree)] == [True, True, False]


def test_the_marker_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "test_bad.py"
    bad.write_text("import pytest\n\n"
                   "def test_a(redis_server):\n    pass\n\n"
                   "@pytest.mark.integration\ndef test_b(redis_server):\n    pass\n\n"
                   "def test_c(workdir):\n    pass\n")
    assert _unmarked_server_tests(bad) == ["test_bad.py:3 test_a(redis_server)"]
    bad.write_text("import pytest\npytestmark = pytest.mark.integration\n\n"
                   "def test_a(redis_server):\n    pass\n")
    assert _unmarked_server_tests(bad) == []
