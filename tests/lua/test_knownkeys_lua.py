"""infergate.admission.knownkeys: the time a set of the key store's records is dated
(what newer_record compares a cached answer with) is when its HGETALL was asked, not when
its answer came: an answer cached between the two (a key created just after the read ran)
is not taken for older than the set. Run in nginx's init_by_lua with the flush queue and
the clock replaced (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec


def test_a_set_is_dated_when_its_read_was_asked(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            config.get().auth.mode = "required"
            local clock = 100
            require("infergate.core.ngxapi").now = function() return clock end
            local asked = {}
            package.loaded["infergate.core.flush"] = {
                push = function(_name, _cmds, cb) asked[#asked + 1] = cb; return true end,
            }
            package.loaded["infergate.core.statefile"] = {
                read = function() return nil end, write = function() return true end,
            }
            local knownkeys = require("infergate.admission.knownkeys")
            knownkeys.tick(false)
            asked[1]({1, "marker-1"})            -- HLEN, GET: the HGETALL is asked at 100
            clock = 100.5                        -- a new key's answer cached at 100.4
            local list = {"old-digest", '{"id":"a"}'}
            clock = 101
            asked[2]({list})                     -- its answer handled at 101
            local out = {}
            out.new_key = knownkeys.newer_record("new-digest", 100.4)
            out.old_key = knownkeys.newer_record("old-digest", 99)
            out.before = knownkeys.newer_record("new-digest", 99.9)
            if out.new_key == nil then out.new_key = "nil" end
            return out
    """, http_extra="lua_shared_dict infergate_snapshot 1m;")
    assert got["new_key"] == "nil", got              # the set is not newer than that answer
    assert got["old_key"] == '{"id":"a"}', got
    assert got["before"] is False, got               # an answer cached before the read
