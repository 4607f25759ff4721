"""The layout rules of the test suite, checked on the source (ast, no import):

- no test module imports another test module (shared helpers live in tests/support/);
- no test of tests/unit/ asks for a fixture that starts processes (those tests belong
  in an integration layer; tests/unit/conftest.py also refuses to start any process);
- test module names are unique over all layers (the folders are not packages, so two
  ``test_x.py`` would clash at import).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
#: Fixtures of tests/conftest.py and tests/support/ that start processes.
PROCESS_FIXTURES = {"redis_server", "shared_redis_port", "r", "simnodes", "edge_factory",
                    "controlplane_factory", "realnodes"}


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


def test_test_module_names_are_unique() -> None:
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def test_the_layout_checks_can_fail() -> None:
    tree = ast.parse("import test_other\nfrom .helpers import x\nfrom support.stack import y\n")
    assert [_is_test_module(n) for n in _imported(tree)] == [True, True, False]
