"""What a worker that is gone (killed, crashed) held in the shared dicts is given back
(lua/infergate/core/workers.lua): a half-open breaker probe slot it held is free at once,
and its share of the admission gauges ("held", "waiting") comes off them at the next
reconciliation; a running worker's are kept. Run in nginx's init_by_lua with real shared
dicts (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = ("lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m; "
         "lua_shared_dict infergate_limits 1m;")
#: above Linux's largest pid (pid_max is at most 2^22): no such process
GONE = 4194304 + 4321


def run(workdir: Path, body: str):
    prelude = """
            local config = require("infergate.core.config")
            assert(config.init({}, """ + lua_string(json.dumps(option_spec())) + """))
            local GONE = """ + str(GONE) + """
"""
    return lua_eval(workdir, prelude + body, http_extra=DICTS)


def test_a_probe_slot_held_by_a_worker_that_is_gone_is_free_at_once(workdir: Path) -> None:
    got = run(workdir, """
            local breaker = require("infergate.routing.breaker")
            local workers = require("infergate.core.workers")
            local d = ngx.shared.infergate_stats
            local now = ngx.now()
            d:set("bo:n", now - 3600)                  -- open long ago: half-open
            d:set("bp:n", workers.pid(), 600)          -- this (running) worker's probe
            local out = {mine = breaker.allow("n", now)}
            d:set("bp:n", GONE, 600)                   -- a probe of a worker that is gone
            out.gone = breaker.allow("n", now)
            out.freed = d:get("bp:n") == nil
            out.taken = breaker.take_probe("n")
            out.holder = d:get("bp:n") == workers.pid()
            out.alive_self = workers.alive(workers.pid())
            out.gone_alive = workers.alive(GONE)
            out.holder_gone = {workers.holder_gone(GONE .. ":req-1"),
                               workers.holder_gone(workers.pid() .. ":req-1"),
                               workers.holder_gone("nostore"), workers.holder_gone(true)}
            return out
    """)
    assert got["mine"] is False and got["gone"] == "probe" and got["freed"] is True
    assert got["taken"] is True and got["holder"] is True
    assert got["alive_self"] is True and got["gone_alive"] is False
    assert got["holder_gone"] == [True, False, False, False]


def test_the_admission_gauges_of_a_worker_that_is_gone_come_off(workdir: Path) -> None:
    got = run(workdir, """
            local astats = require("infergate.admission.stats")
            local stats = require("infergate.routing.stats")
            local workers = require("infergate.core.workers")
            local d = ngx.shared.infergate_stats
            astats.incr("held", 2)            -- this worker: 2 held, 3 waiting
            astats.incr("waiting", 3)
            astats.incr("shed")               -- a counter, not a gauge: no share kept
            -- a worker that is gone held 4 and had 5 waiting
            ngx.shared.infergate_limits:incr("c:held", 4, 0)
            ngx.shared.infergate_limits:incr("c:waiting", 5, 0)
            d:set("ag:" .. GONE .. ":held", 4)
            d:set("ag:" .. GONE .. ":waiting", 5)
            local before = {astats.get("held"), astats.get("waiting")}
            stats.reconcile()
            return {before = before, after = {astats.get("held"), astats.get("waiting")},
                    keys_left = d:get("ag:" .. GONE .. ":held") == nil,
                    own = d:get("ag:" .. workers.pid() .. ":waiting"),
                    shed_share = d:get("ag:" .. workers.pid() .. ":shed") == nil}
    """)
    assert got["before"] == [6, 8] and got["after"] == [2, 3]
    assert got["keys_left"] is True and got["own"] == 3 and got["shed_share"] is True
