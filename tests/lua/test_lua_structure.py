"""The Lua code keeps its structure, read from ``luac5.1 -p -l`` listings of lua/ (the
compiler parses, nothing runs; Debian package lua5.1, installed by .ci/install):

- no function over 80 lines (``function`` line to ``end`` line; the main chunk of a
  module is not a function);
- no require circle among the modules of lua/infergate, counting the requires inside
  functions too (a ``require`` deferred into a function hides a circle at load time but
  keeps the two modules tangled);
- lua/infergate/core/ is the bottom layer: none of its modules requires, at module level
  or inside a function, anything from admission/, cache/, routing/ or redis/.
- a shared-dict key prefix ("<prefix>:" .. x) belongs to one module, but for the
  deliberate ones listed in SHARED_PREFIXES (read from the sources).

The Python checks and the file-length check are in tests/unit/test_structure.py; the
checkers are in tests/support/structure.py. The tests at the end run luac on a tiny tree
with a good and a bad example."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import structure as st

UPPER_LAYERS = ["infergate.admission", "infergate.cache", "infergate.routing", "infergate.redis"]


@pytest.fixture(scope="module")
def listing() -> list[st.LuaFunction]:
    return st.lua_listing(st.lua_files(), st.ROOT)


def test_the_listing_covers_every_module_and_require(listing: list[st.LuaFunction]) -> None:
    mains = {fn.file for fn in listing if fn.main}
    assert mains == {str(f.relative_to(st.ROOT)) for f in st.lua_files()}
    graph = st.lua_requires(listing, module_level_only=False)
    required = {d for deps in graph.values() for d in deps}
    assert len(required) > len(graph) // 2          # the requires were read
    assert required <= set(graph), f"requires of no module file: {sorted(required - set(graph))}"


def test_no_lua_function_over_80_lines(listing: list[st.LuaFunction]) -> None:
    found = st.long_lua_functions(listing)
    assert not found, "Lua functions over 80 lines:\n" + "\n".join(found)


def test_no_lua_require_circle(listing: list[st.LuaFunction]) -> None:
    found = st.cycles(st.lua_requires(listing, module_level_only=False))
    assert not found, "require circles among lua/infergate modules (requires at module " \
        "level and inside functions):\n" + "\n".join(found)


def test_core_requires_no_upper_layer(listing: list[st.LuaFunction]) -> None:
    graph = st.lua_requires(listing, module_level_only=False)
    found = st.layer_violations(graph, "infergate.core", UPPER_LAYERS)
    assert not found, "lua/infergate/core/ is the bottom layer; it requires:\n" + "\n".join(found)


# ------------------------------------------------------------- the checkers on a tiny tree

GOOD = {
    "lua/infergate/core/a.lua": """
local b = require("infergate.core.b")
local _M = {}
function _M.f()
    -- require("infergate.cache.key") in a comment is not a require
    return b.g()
end
return _M
""",
    "lua/infergate/core/b.lua": """
local _M = {}
function _M.g()
    local a = require("infergate.core.a")   -- deferred: no circle at load time
    return a ~= nil
end
return _M
""",
}

BAD = {
    "lua/infergate/core/a.lua": """
local b = require("infergate.core.b")
local _M = {}
function _M.f()
    local ok, key = pcall(require, "infergate.cache.key")
    return ok and key and b
end
return _M
""",
    "lua/infergate/core/b.lua": """
local a = require("infergate.core.a")
local _M = {}
local function long()
""" + "    local x = 1\n" * 79 + """end
_M.long = long
return _M
""",
}


def _tree(root: Path, files: dict[str, str]) -> list[st.LuaFunction]:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return st.lua_listing(st.lua_files(root / "lua"), root)


#: Shared-dict key prefixes ("<prefix>:" .. name) that more than one module writes or
#: reads, each on purpose: the modules read one another's keys, or the keys cannot meet.
SHARED_PREFIXES = {
    # a node's last byte and first byte: stall detection and the outlier rule write,
    # liveness reads both (last_byte)
    "fb": {"routing/liveness.lua", "routing/outlier.lua"},
    "lb": {"routing/liveness.lua", "routing/outlier.lua", "routing/stall.lua"},
    # learned tail "tq:<node>" and the outlier rule's "tq:s:<node>" / "tq:n:<node>"
    # (node names have no ':')
    "tq": {"routing/learned.lua", "routing/outlier.lua"},
    # two dicts: infergate_auth_fail and infergate_limits
    "b": {"admission/auththrottle.lua", "admission/localbuckets.lua"},
    # a node's failure rate "fr:<node>" and a fair-queue flow "fr:<pool>\1<flow>"
    "fr": {"admission/fairqueue.lua", "routing/stats.lua"},
}


def test_shared_dict_key_prefixes_are_each_one_modules() -> None:
    """A module that takes a key prefix another module already uses for its own keys
    shares them by accident (a model named like a node read the node's failure rate):
    every "<prefix>:" .. x (or key("<prefix>:", x)) key of lua/infergate belongs to one module, except the
    deliberate ones of SHARED_PREFIXES."""
    import re

    users: dict[str, set[str]] = {}
    for f in st.lua_files():
        rel = str(f.relative_to(st.ROOT / "lua" / "infergate"))
        # "<prefix>:" .. x, or through a key memo: key("<prefix>:", x)
        code = "\n".join(line.split("--", 1)[0] for line in f.read_text().splitlines())
        for m in re.finditer(r'"([a-z]{1,8}):"\s*(?:\.\.|,)', code):
            users.setdefault(m.group(1), set()).add(rel)
    assert len(users) > 30                      # the keys were found
    shared = {k: v for k, v in users.items() if len(v) > 1}
    assert shared == SHARED_PREFIXES, shared


def test_checkers_pass_a_good_tree(tmp_path: Path) -> None:
    listing = _tree(tmp_path, GOOD)
    assert st.long_lua_functions(listing) == []
    assert st.lua_requires(listing, module_level_only=False) == {
        "infergate.core.a": {"infergate.core.b"}, "infergate.core.b": {"infergate.core.a"}}
    assert st.cycles(st.lua_requires(listing, module_level_only=True)) == []
    assert st.layer_violations(st.lua_requires(listing, module_level_only=False),
                               "infergate.core", UPPER_LAYERS) == []


def test_checkers_name_what_is_wrong_in_a_bad_tree(tmp_path: Path) -> None:
    listing = _tree(tmp_path, BAD)
    assert st.long_lua_functions(listing) == [
        "lua/infergate/core/b.lua:4-84: function of 81 lines (limit 80)"]
    assert st.cycles(st.lua_requires(listing, module_level_only=True)) == [
        "infergate.core.a -> infergate.core.b -> infergate.core.a"]
    assert st.layer_violations(st.lua_requires(listing, module_level_only=False),
                               "infergate.core", UPPER_LAYERS) == [
        "infergate.core.a requires infergate.cache.key"]


def test_a_file_that_does_not_compile_is_named(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="broken.lua"):
        _tree(tmp_path, {"lua/infergate/broken.lua": "local function f(\n"})
