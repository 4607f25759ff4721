"""A node's circuit breaker skips the rest of its cooldown once the control plane saw
the node come back after the breaker opened (the snapshot's "back_at": healthy again, or
a new process behind its address): one half-open probe goes at once. A "back_at" from
before the opening, or none, keeps the cooldown; a failed probe opens it again for the
full cooldown until a later "back_at". Run in nginx's init_by_lua with real shared dicts
(support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def test_a_node_seen_back_after_its_breaker_opened_gets_its_probe_at_once(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local snapshot = require("infergate.routing.snapshot")
            local breaker = require("infergate.routing.breaker")
            local cjson = require("cjson.safe")
            local function put(back_at)
                assert(snapshot.store(cjson.encode({version = 1, generated_at = 1000,
                    nodes = {{name = "n", url = "http://127.0.0.1:9", host = "127.0.0.1",
                              port = 9, kind = "openai", state = "active", healthy = true,
                              weight = 1, effective_weight = 1, max_concurrency = 4,
                              back_at = back_at}}}), 1000))
                snapshot.refresh()   -- as the sync timer does after each fetch
            end
            put(nil)
            for _ = 1, config.get().edge.breaker_failures do
                breaker.failure("n", false, 999, 1000)
            end
            local out = {opened = breaker.state("n", 1001), none = breaker.allow("n", 1001)}
            put(999.5)
            out.before = breaker.allow("n", 1001)
            put(1000.8)
            out.after = breaker.allow("n", 1001)
            out.after_state = breaker.state("n", 1001)
            out.taken = breaker.take_probe("n")
            out.probing = breaker.allow("n", 1001.2)
            breaker.failure("n", true, 1001, 1002)       -- the probe failed: open again
            out.reopened = breaker.allow("n", 1002.5)
            out.reopened_state = breaker.state("n", 1002.5)
            put(1003)
            out.back_again = breaker.allow("n", 1003.1)
            out.taken_again = breaker.take_probe("n")
            breaker.success("n", true, 1003.1)
            out.closed = breaker.state("n", 1003.5)
            return out
    """, http_extra=DICTS)
    assert got["opened"] == "open" and got["none"] is False
    assert got["before"] is False, "seen back before the breaker opened: cooldown holds"
    assert got["after"] == "probe" and got["after_state"] == "half_open"
    assert got["taken"] is True and got["probing"] is False, "one probe at a time"
    assert got["reopened"] is False and got["reopened_state"] == "open"
    assert got["back_again"] == "probe" and got["taken_again"] is True
    assert got["closed"] == "closed"
