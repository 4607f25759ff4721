"""The relay's node choice for a retry (infergate.routing.relaypick): a request that is
not a stream is not moved to a node that cannot answer its max_tokens before its
deadline, and a node the request tried that the control plane saw come back since may
take its retry. Run in nginx's init_by_lua with real shared dicts
(support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"
PRELUDE = """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local relaypick = require("infergate.routing.relaypick")
            local learned = require("infergate.routing.learned")
            local function node(name)
                return {name = name, addr = "127.0.0.1", host = "127.0.0.1", port = 9,
                        state = "active", healthy = true, weight = 1, effective_weight = 1}
            end
"""


def test_a_request_not_streamed_is_not_moved_to_a_node_that_cannot_answer_it_in_time(
        workdir: Path) -> None:
    """Node b writes 0.05 s per token: 400 tokens take 20 s there. With 10 s left before
    the deadline no node is left for the retry of a request asking for 400 (it waits on
    its node, which may resume in time); 100 tokens (5 s), a stream, a request without
    max_tokens or a node not learned yet leave one."""
    got = lua_eval(workdir, PRELUDE + """
            local now = 1000
            for i = 1, 20 do learned.observe("b", 0.05 * (10 + i), 10 + i, now) end
            local t = {nodes = {node("a"), node("b")}}
            local function req(body, stream)
                return {model = "m", body = body, stream = stream, tried = {a = true},
                        deadline = {at = now + 10, idle_s = 30}}
            end
            local out = {}
            out.long = relaypick.other_left(req({max_tokens = 400}), now, t)
            out.short = relaypick.other_left(req({max_tokens = 100}), now, t)
            out.stream = relaypick.other_left(req({max_tokens = 400}, true), now, t)
            out.no_max = relaypick.other_left(req({}), now, t)
            local t2 = {nodes = {node("a"), node("c")}}
            out.unknown = relaypick.other_left(req({max_tokens = 400}), now, t2)
            return out
    """, http_extra=DICTS)
    assert got == {"long": False, "short": True, "stream": True, "no_max": True,
                   "unknown": True}, got


def test_a_node_seen_back_since_it_failed_the_request_is_untried(workdir: Path) -> None:
    """A node whose connection was refused (killed) and that the control plane saw come
    back after (restarted: the snapshot's back_at) may take the request's retry; one seen
    back only before the attempt, or never, stays tried."""
    got = lua_eval(workdir, PRELUDE + """
            local backat = require("infergate.routing.backat")
            local req = {tried = {a = true, b = true, c = true},
                         attempts = {{node = "a", started = 1000}, {node = "b", started = 1000},
                                     {node = "c", started = 1000}}}
            backat.update({{name = "a", back_at = 1008}, {name = "b", back_at = 990}})
            relaypick.untry_back(req)
            return {a = req.tried.a or false, b = req.tried.b or false, c = req.tried.c or false}
    """, http_extra=DICTS)
    assert got == {"a": False, "b": True, "c": True}, got
