"""Model-aware routing in the edge's pure logic (infergate.routing.models, the balancer's
pick and the shedding capacity with a model), run in nginx's init_by_lua with real
shared dicts (support.stack.lua_eval)."""

from __future__ import annotations

import json
from pathlib import Path

from support.stack import lua_eval, lua_node_helpers

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"

PRELUDE = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {stale_after_s = 10}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local snapshot = require("infergate.routing.snapshot")
            local models = require("infergate.routing.models")
            local balancer = require("infergate.routing.balancer")
            local shed = require("infergate.admission.shed")
            local stats = require("infergate.routing.stats")
""" + lua_node_helpers(max_concurrency=2) + """
            local plain_node = node
            local function node(name, served, extra)
                local n = plain_node(name, {models = snapshot.model_set(served)})
                for k, v in pairs(extra or {}) do n[k] = v end
                return n
            end
            local function picks(t, model, rounds)
                local seen = {}
                for _ = 1, rounds do
                    local n = balancer.pick(t, {}, ngx.now(), false, model)
                    local k = n and n.name or "none"
                    seen[k] = (seen[k] or 0) + 1
                end
                return seen
            end
"""


def run(workdir: Path, body: str):
    return lua_eval(workdir, PRELUDE + body, http_extra=DICTS)


def test_model_sets_serves_and_known(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            out.empty_is_unknown = snapshot.model_set({}) == nil
            out.null_is_unknown = snapshot.model_set(nil) == nil
            out.list = snapshot.model_set({"b", "a", "b", 3, ""}).list
            local a, u = node("a", {"m-a"}), node("u", nil)
            out.serves = {models.serves(a, "m-a"), models.serves(a, "m-b"),
                          models.serves(a, nil), models.serves(u, "m-b")}
            out.known_with_unknown_node = models.known(tbl({a, u}), "m-b")
            out.known_all_listed = models.known(tbl({a, node("b", {"m-b"})}), "m-c")
            out.known_listed = models.known(tbl({a, node("b", {"m-b"})}), "m-b")
            out.known_no_nodes = models.known(tbl({}), "m-x")
            -- the union over eligible nodes only; nil when none lists models
            out.union = models.list(tbl({a, node("b", {"m-b", "m-a"}),
                                         node("sick", {"m-z"}, {healthy = false}),
                                         node("gone", {"m-y"}, {state = "drained"}), u}), ngx.now())
            out.union_none = models.list(tbl({u}), ngx.now()) == nil
            out.empty_json = models.encode_list({})
            return out
    """)
    assert got["empty_is_unknown"] and got["null_is_unknown"]
    assert got["list"] == ["b", "a"]
    assert got["serves"] == [True, False, True, True]
    assert got["known_with_unknown_node"] is True
    assert got["known_all_listed"] is False and got["known_listed"] is True
    assert got["known_no_nodes"] is True
    assert got["union"] == ["m-a", "m-b"] and got["union_none"] is True
    assert json.loads(got["empty_json"]) == {"object": "list", "data": []}


def test_pick_and_capacity_follow_the_model(workdir: Path) -> None:
    got = run(workdir, """
            local out = {}
            local t = tbl({node("a", {"m-a"}), node("b", {"m-b"}), node("u", nil)})
            out.m_a = picks(t, "m-a", 200)
            out.m_b = picks(t, "m-b", 200)
            out.any = picks(t, nil, 300)
            out.none = balancer.pick(tbl({node("a", {"m-a"})}), {}, ngx.now(), false, "m-b") == nil
            out.count_a = balancer.count_eligible(t, {}, ngx.now(), "m-a")
            out.count_all = balancer.count_eligible(t, {}, ngx.now())
            -- shedding per model: a full (2 of 2 in flight), b free
            local t2 = tbl({node("a", {"m-a"}), node("b", {"m-b"})})
            stats.open_attempt("a", ngx.now()); stats.open_attempt("a", ngx.now())
            out.cap_a = shed.capacity(t2, ngx.now(), "m-a")
            out.cap_b = shed.capacity(t2, ngx.now(), "m-b")
            out.cap_any = shed.capacity(t2, ngx.now(), nil)
            out.cap_c = shed.capacity(t2, ngx.now(), "m-c")
            return out
    """)
    assert set(got["m_a"]) == {"a", "u"} and got["m_a"]["a"] > 40 and got["m_a"]["u"] > 40
    assert set(got["m_b"]) == {"b", "u"}
    assert set(got["any"]) == {"a", "b", "u"}
    assert got["none"] is True
    assert got["count_a"] == 2 and got["count_all"] == 3
    assert got["cap_a"] == "saturated" and got["cap_b"] == "free" and got["cap_any"] == "free"
    assert got["cap_c"] == "none"


def test_unscored_nodes_are_all_costed(workdir: Path) -> None:
    got = run(workdir, """
            -- four nodes without scores (kind openai): 0, 1, 2 and 3 requests in flight
            local nodes = {}
            for i, name in ipairs({"n0", "n1", "n2", "n3"}) do
                nodes[i] = node(name, nil, {score = false, max_concurrency = 4})
                for _ = 1, i - 1 do stats.open_attempt(name, ngx.now()) end
            end
            local unscored = picks(tbl(nodes), nil, 200)
            -- with fresh scores it stays power of two choices: n0 is not always sampled
            local scored = {}
            for i, n in ipairs(nodes) do
                scored[i] = node(n.name, nil, {score = 0, max_concurrency = 4})
            end
            return {unscored = unscored, scored = picks(tbl(scored), nil, 400)}
    """)
    assert got["unscored"] == {"n0": 200}
    assert got["scored"]["n0"] < 400 and "n3" not in got["scored"]
