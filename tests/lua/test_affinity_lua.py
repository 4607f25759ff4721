"""Prefix affinity of the edge (infergate.routing.affinity), pure logic run in nginx's
init_by_lua: the key derived from a request body, the rendezvous order and the load
bound of consistent hashing with bounded loads."""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from support.stack import lua_eval, lua_node_helpers

from controlplane.edge.options import lua_string, option_spec

DICTS = ("lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m; "
         "lua_shared_dict infergate_affinity 1m;")

PRELUDE = """
            local config = require("infergate.core.config")
            assert(config.init({edge = {inflight_cost = 1, stale_after_s = 10,
                                        affinity_header = "", prefix_min_tokens = 8,
                                        prefix_max_tokens = 64, prefix_load_factor = 0.25},
                                scoring = {latency_norm_s = 30}},
                               """ + lua_string(json.dumps(option_spec())) + """))
            local stats = require("infergate.routing.stats")
            local balancer = require("infergate.routing.balancer")
            local affinity = require("infergate.routing.affinity")
            local o = config.get()
""" + lua_node_helpers(max_concurrency=10, score=0) + """
            local function msgs(...)
                local out = {}
                for i, pair in ipairs({...}) do
                    out[i] = {role = pair[1], content = pair[2]}
                end
                return {model = "m", messages = out}
            end
            local SYS = string.rep("You are a careful assistant. ", 4)   -- 112 chars
"""


def run(workdir: Path, body: str):
    return lua_eval(workdir, PRELUDE + body, http_extra=DICTS)


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _rank(key: int, name: str, weight: float = 1.0) -> float:
    h = _fmix32((key ^ zlib.crc32(name.encode())) & 0xFFFFFFFF)
    return weight / -math.log((h + 0.5) / 2**32)


def test_key_follows_the_leading_messages(workdir: Path) -> None:
    got = run(workdir, """
            local k1 = affinity.key(msgs({"system", SYS}, {"user", "hi"}), o)
            local k2 = affinity.key(msgs({"system", SYS}, {"user", "hi"}, {"assistant", "hello"},
                                         {"user", "more"}), o)
            local other = affinity.key(msgs({"system", SYS .. "!"}, {"user", "hi"}), o)
            local role = affinity.key(msgs({"user", SYS}, {"user", "hi"}), o)
            local short = affinity.key(msgs({"system", "be brief"}, {"user", "hi"}), o)
            -- two short messages that reach the minimum together: both in the key
            local a = affinity.key(msgs({"system", "be brief"}, {"user", "tell me about it"}), o)
            local b = affinity.key(msgs({"system", "be brief"}, {"user", "tell me about it"},
                                        {"assistant", "sure"}, {"user", "go on"}), o)
            local c = affinity.key(msgs({"system", "be brief"}, {"user", "tell me about that"}), o)
            -- cut at prefix_max_tokens (64 tokens = 256 chars): a late difference is ignored
            local long1 = affinity.key(msgs({"system", string.rep("x", 400) .. "A"}), o)
            local long2 = affinity.key(msgs({"system", string.rep("x", 400) .. "B"}), o)
            local parts = affinity.key({messages = {{role = "system",
                content = {{type = "text", text = SYS}}}, {role = "user", content = "hi"}}}, o)
            local prompt = affinity.key({prompt = SYS}, o)
            local _, src = affinity.key(msgs({"system", SYS}), o)
            o.edge.prefix_affinity = false
            local off = affinity.key(msgs({"system", SYS}), o)
            o.edge.prefix_affinity = true
            o.edge.affinity_user_field = true
            local user = affinity.key({messages = {{role = "user", content = "hi"}}, user = "u1"}, o)
            local user_long = affinity.key({messages = {{role = "system", content = SYS}},
                                            user = "u1"}, o)
            o.edge.affinity_user_field = false
            local user_off = affinity.key({messages = {{role = "user", content = "hi"}}, user = "u1"}, o)
            return {same_turns = k1 == k2, other = k1 ~= other, role = k1 ~= role,
                    short = short == nil, pair = a == b and a ~= c, cut = long1 == long2,
                    parts = parts == k1, prompt = type(prompt) == "number", src = src,
                    off = off == nil, user = type(user) == "number",
                    user_long = user_long == k1, user_off = user_off == nil}
    """)
    assert got == {"same_turns": True, "other": True, "role": True, "short": True,
                   "pair": True, "cut": True, "parts": True, "prompt": True,
                   "src": "prefix", "off": True, "user": True, "user_long": True,
                   "user_off": True}


def test_rank_order_is_the_documented_function(workdir: Path) -> None:
    """Every edge computes the same order: the Lua rank equals the formula in the
    module's header (crc32, MurmurHash3's fmix32, weighted rendezvous)."""
    keys = [1, 0x7FFFFFFF, 0xDEADBEEF, 123456789, 4000000000]
    names = ["gpu-a", "gpu-b", "node-3", "x"]
    got = run(workdir, """
            local out = {}
            for _, k in ipairs({""" + ",".join(map(str, keys)) + """}) do
                local row = {}
                for _, name in ipairs({"gpu-a", "gpu-b", "node-3", "x"}) do
                    row[#row + 1] = affinity.rank(k, {name = name, effective_weight = 2})
                end
                out[#out + 1] = row
            end
            return out
    """)
    for key, row in zip(keys, got, strict=True):
        want = [_rank(key, n, 2.0) for n in names]
        assert [round(x, 6) for x in row] == [round(x, 6) for x in want]


def test_choice_is_sticky_spread_and_moves_only_a_removed_nodes_keys(workdir: Path) -> None:
    got = run(workdir, """
            local now = ngx.now()
            local nodes = {node("a"), node("b"), node("c"), node("d")}
            local t = tbl(nodes)
            local first, counts, sticky = {}, {}, true
            for k = 1, 4000 do
                local key = k * 2654435761 % 4294967296
                local n1 = balancer.pick(t, {}, now, false, nil, key)
                local n2 = balancer.pick(t, {}, now, false, nil, key)
                sticky = sticky and n1 == n2
                first[k] = n1.name
                counts[n1.name] = (counts[n1.name] or 0) + 1
            end
            local t3 = tbl({nodes[1], nodes[2], nodes[4]})
            local moved_other = 0
            for k = 1, 4000 do
                local key = k * 2654435761 % 4294967296
                local n = balancer.pick(t3, {}, now, false, nil, key)
                if first[k] ~= "c" and n.name ~= first[k] then
                    moved_other = moved_other + 1
                end
            end
            -- a retry skips the tried node and takes the key's next one
            local key = 99991
            local top = balancer.pick(t, {}, now, false, nil, key)
            local retry = balancer.pick(t, {[top.name] = true}, now, true, nil, key)
            return {sticky = sticky, counts = counts, moved_other = moved_other,
                    retry_differs = retry.name ~= top.name}
    """)
    assert got["sticky"] is True
    assert got["moved_other"] == 0
    assert got["retry_differs"] is True
    assert set(got["counts"]) == {"a", "b", "c", "d"}
    for name, c in got["counts"].items():
        assert 800 <= c <= 1200, (name, c)


def test_a_burst_spills_within_the_load_bound(workdir: Path) -> None:
    """One key for every request, nothing finishing: no node gets more than
    max(ceil(1.25 x (T + 1) / 4), ceil(concurrency / 4)) of this edge's in-flight, and
    the first node gets the most."""
    got = run(workdir, """
            local now = ngx.now()
            local nodes = {node("a"), node("b"), node("c"), node("d")}
            local t = tbl(nodes)
            local key = 424242
            local worst, picks = 0, {}
            for i = 1, 200 do
                local n = balancer.pick(t, {}, now, false, nil, key)
                local total = 0
                for _, x in ipairs(nodes) do total = total + stats.inflight(x.name) end
                -- at least a quarter of the node's concurrency (10): not loaded below it
                local bound = math.max(math.ceil(1.25 * (total + 1) / 4), 3)
                if stats.inflight(n.name) >= bound then worst = worst + 1 end
                stats.open_attempt(n.name, now)
                picks[n.name] = (picks[n.name] or 0) + 1
            end
            local order = {}
            for _, x in ipairs(nodes) do order[#order + 1] = {x.name, affinity.rank(key, x)} end
            table.sort(order, function(p, q) return p[2] > q[2] end)
            return {worst = worst, picks = picks, top = order[1][1], counts = affinity.counts()}
    """)
    assert got["worst"] == 0
    picks = got["picks"]
    assert max(picks.values()) <= math.ceil(1.25 * 200 / 4)
    assert picks[got["top"]] == max(picks.values())
    assert got["counts"]["first"] + got["counts"]["spill"] == 200
    assert got["counts"]["spill"] > 0


def test_hot_key_is_spread_and_ordinary_keys_stay(workdir: Path) -> None:
    """Requests that finish (at most 3 in flight, as at a light load, where the load
    bound alone lets the first node take most): a key carrying all traffic is spread
    evenly over the nodes; 40 keys of equal traffic each stay on one node."""
    got = run(workdir, """
            local now = ngx.now()
            local nodes = {node("a"), node("b"), node("c"), node("d")}
            local t = tbl(nodes)
            local function drive(keys, rounds)
                local live, picks, homes = {}, {}, {}
                for i = 1, rounds do
                    now = now + 0.05
                    if #live >= 3 then
                        local done = table.remove(live, 1)
                        stats.release(done[1])
                        affinity.untrack(done[2])
                    end
                    local key = keys[(i - 1) % #keys + 1]
                    affinity.count_request(now)
                    local n = balancer.pick(t, {}, now, false, nil, key)
                    affinity.track(key)
                    live[#live + 1] = {stats.open_attempt(n.name, now), key}
                    picks[n.name] = (picks[n.name] or 0) + 1
                    homes[key] = homes[key] or {}
                    homes[key][n.name] = true
                end
                for _, a in ipairs(live) do stats.release(a[1]); affinity.untrack(a[2]) end
                return picks, homes
            end
            local hot = drive({5150}, 800)
            local many = {}
            for k = 1, 40 do many[k] = k * 7919 end
            local _, homes = drive(many, 800)
            local multi = 0
            for _, h in pairs(homes) do
                local c = 0
                for _ in pairs(h) do c = c + 1 end
                if c > 1 then multi = multi + 1 end
            end
            -- one request at a time: the key is all the traffic, and stays on one node
            local lone = drive({4242}, 1)
            local seq = {}
            for _ = 1, 20 do
                affinity.count_request(now)
                seq[balancer.pick(t, {}, now, false, nil, 4242).name] = true
            end
            local seq_nodes = 0
            for _ in pairs(seq) do seq_nodes = seq_nodes + 1 end
            return {hot = hot, multi = multi, lone = lone ~= nil, seq_nodes = seq_nodes,
                    live_after = affinity.live(5150), width = affinity.width(1, 4, 0.25),
                    width_small = affinity.width(1 / 40, 4, 0.25),
                    width_half = affinity.width(0.5, 4, 0.25)}
    """)
    hot = got["hot"]
    assert set(hot) == {"a", "b", "c", "d"}, hot
    assert max(hot.values()) <= 1.25 * 800 / 4, hot
    assert got["multi"] <= 2, got
    assert got["seq_nodes"] == 1 and got["live_after"] == 0, got
    assert (got["width"], got["width_small"], got["width_half"]) == (4, 1, 2)


def test_saturated_first_node_is_passed_over(workdir: Path) -> None:
    got = run(workdir, """
            local now = ngx.now()
            local key = 777
            local nodes = {node("a"), node("b"), node("c")}
            local top = balancer.pick(tbl(nodes), {}, now, false, nil, key)
            top.saturated = true
            local next1 = balancer.pick(tbl(nodes), {}, now, false, nil, key)
            for _, x in ipairs(nodes) do x.saturated = true end
            local all = balancer.pick(tbl(nodes), {}, now, false, nil, key)
            o.edge.prefix_affinity = false
            local plain = {}
            for _ = 1, 50 do plain[balancer.pick(tbl({node("a"), node("b"), node("c")}), {}, now,
                                                  false, nil, key).name] = true end
            local n = 0
            for _ in pairs(plain) do n = n + 1 end
            return {moved = next1.name ~= top.name, all = all.name == top.name, plain = n}
    """)
    assert got == {"moved": True, "all": True, "plain": 3}


def test_a_prompt_seen_first_goes_to_its_node_only_when_that_node_is_not_much_dearer(
        workdir: Path) -> None:
    """First sight of a leading prompt: its first node when that node's plain cost is
    within FIRST_SIGHT_MARGIN of the cheapest (so idle edges agree), else the cheapest;
    the key is counted either way and its next request follows it."""
    got = run(workdir, """
            local now = ngx.now()
            local nodes = {node("a"), node("b"), node("c")}
            local t = tbl(nodes)
            local key = 777001
            local top = affinity.top(nodes, 3, key)
            local out = {top = top.name, unseen_before = affinity.unseen(key)}
            -- all idle: the first node, even on first sight
            out.idle = balancer.pick(t, {}, now, false, nil, key, true).name
            out.unseen_after = affinity.unseen(key)
            -- another key whose first node carries a score far above the others
            local key2 = 880002
            local top2 = affinity.top(nodes, 3, key2)
            top2.score = 0.5
            out.top2 = top2.name
            out.busy_first = balancer.pick(t, {}, now, false, nil, key2, true).name
            out.busy_unseen_after = affinity.unseen(key2)
            -- later requests of that key follow it (the bound has room: nothing in flight)
            out.busy_next = balancer.pick(t, {}, now, false, nil, key2, false).name
            -- a small difference keeps the first node
            top2.score = 0
            local top3 = affinity.top(nodes, 3, 990003)
            top3.score = 0.05
            out.close_first = balancer.pick(t, {}, now, false, nil, 990003, true).name
            out.close_top = top3.name
            return out
    """)
    assert got["unseen_before"] is True and got["unseen_after"] is False
    assert got["idle"] == got["top"]
    assert got["busy_first"] != got["top2"]
    assert got["busy_unseen_after"] is False
    assert got["busy_next"] == got["top2"]
    assert got["close_first"] == got["close_top"]


def test_first_sights_follow_the_key_only_while_the_traffic_reuses_prefixes(
        workdir: Path) -> None:
    """Observed reuse (affinity.reuse): a prior of 0.5; after a run of prompts that share
    nothing it falls under REUSE_MIN and a first sight is placed by the plain cost (here:
    away from its first node, which costs a little more); a key seen again is still
    followed; with no keyed traffic for a while the share decays back to its prior."""
    got = run(workdir, """
            local now = ngx.now()
            local nodes = {node("a"), node("b"), node("c")}
            local t = tbl(nodes)
            local out = {prior = affinity.reuse(now), min = affinity.REUSE_MIN}
            local function first_of(key, at)
                local top = affinity.top(nodes, 3, key)
                for _, n in ipairs(nodes) do n.score = 0 end
                top.score = 0.05            -- within FIRST_SIGHT_MARGIN of the others
                local first = affinity.first_sight("prefix", key, at)
                local pick = balancer.pick(t, {}, at, false, nil, key, first).name
                return pick == top.name, first
            end
            out.before = first_of(123457, now)
            for k = 1, 60 do
                affinity.first_sight("prefix", 500000 + k, now)
            end
            out.low = affinity.reuse(now)
            out.after = first_of(123499, now)
            local seen_top, seen_first = first_of(123499, now)
            out.seen_top, out.seen_first = seen_top, seen_first
            out.session_counted = affinity.first_sight("session", 42, now)
            out.decayed = affinity.reuse(now + 20 * affinity.REUSE_HALF_LIFE_S)
            out.later = first_of(123511, now + 20 * affinity.REUSE_HALF_LIFE_S)
            return out
    """)
    assert got["prior"] == 0.5
    assert got["before"] is True
    assert got["low"] < got["min"]
    assert got["after"] is False
    assert got["seen_first"] is False and got["seen_top"] is True
    assert got["session_counted"] is False
    assert abs(got["decayed"] - 0.5) < 0.01
    assert got["later"] is True
