"""Which attempts went to a node's process that was replaced since
(infergate.routing.restarts.sent_before): only those started before the snapshot's
"restarted_after" less the clock margin; none of a node without one, nor of a node the
snapshot does not list. Run in nginx's init_by_lua with real shared dicts."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"


def test_only_attempts_sent_before_the_restart_went_to_the_old_process(workdir: Path) -> None:
    got = lua_eval(workdir, """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local snapshot = require("infergate.routing.snapshot")
            local restarts = require("infergate.routing.restarts")
            local cjson = require("cjson.safe")
            local function node(name, extra)
                local n = {name = name, url = "http://127.0.0.1:9", host = "127.0.0.1",
                           port = 9, kind = "vllm", state = "active", healthy = true,
                           weight = 1, effective_weight = 1, max_concurrency = 4}
                for k, v in pairs(extra or {}) do n[k] = v end
                return n
            end
            assert(snapshot.store(cjson.encode({version = 1, generated_at = 1000,
                nodes = {node("r", {restarted_after = 1000}), node("n")}}), 1000))
            local r, n = snapshot.current().by_name.r, snapshot.current().by_name.n
            return {
                long_before = restarts.sent_before(r, {started = 990}),
                in_margin = restarts.sent_before(r, {started = 999.9}),
                just_before = restarts.sent_before(r, {started = 999.5}),
                after = restarts.sent_before(r, {started = 1001}),
                no_restart = restarts.sent_before(n, {started = 990}),
                unlisted = restarts.sent_before({name = "gone"}, {started = 990}),
            }
    """, http_extra=DICTS)
    assert got == {"long_before": True, "in_margin": False, "just_before": True,
                   "after": False,
                   "no_restart": False, "unlisted": False}
