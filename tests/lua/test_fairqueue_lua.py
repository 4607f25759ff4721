"""The fair share's logic (infergate.admission.fairqueue, .vtc, .fairshare) and the token
reservation (infergate.admission.tokencount.reserved_output), run in nginx's
init_by_lua with real shared dicts (support.stack.lua_eval): one nginx for all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stack import lua_eval

from controlplane.edge.options import lua_string, option_spec

DICTS = "lua_shared_dict infergate_snapshot 1m; lua_shared_dict infergate_stats 1m;"

PRELUDE = """
    local config = require("infergate.core.config")
    assert(config.init({admission = {tenants = {gold = {weight = 3}, ops = {priority = "critical"}}}},
                       """ + lua_string(json.dumps(option_spec())) + """))
    local fq = require("infergate.admission.fairqueue")
    local vtc = require("infergate.admission.vtc")
    local fairshare = require("infergate.admission.fairshare")
    local tokencount = require("infergate.admission.tokencount")
    local out = {}
"""

# A pool with one free slot at a time: every round, each waiting request computes its
# rank; the one at rank 0 is served and its tenant charged `cost` tokens (/ weight).
SIMULATE = """
    local waiting = {}         -- {flow, ticket, tenant, weight}
    local function arrive(pool, tenant, class, weight)
        local flow = fq.flow(tenant, class)
        local t, err = fq.join(pool, flow, 1000, 0.02)
        assert(t, err)
        waiting[#waiting + 1] = {flow = flow, ticket = t, tenant = tenant, weight = weight or 1}
    end
    local function serve_one(pool, cost)
        local now = ngx.now()
        local zero = {}
        for i, w in ipairs(waiting) do
            if fq.position(pool, w.flow, w.ticket, now, 0.02) == 0 then
                zero[#zero + 1] = i
            end
        end
        assert(#zero == 1, "one request at rank 0, got " .. #zero)
        local w = table.remove(waiting, zero[1])
        fq.leave(pool, w.flow, w.ticket, now)
        vtc.charge(w.tenant, cost, w.weight)
        return w.tenant
    end
"""


def run(workdir: Path, body: str):
    return lua_eval(workdir, PRELUDE + SIMULATE + body + "\n    return out", http_extra=DICTS)


@pytest.fixture(scope="module")
def got(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(tmp_path_factory.mktemp("fairqueue"), """
    -- ordering: class first, then the smaller counter, then the name
    local a = {class = 2, vc = 10, n = 1, name = "2a"}
    local b = {class = 2, vc = 5, n = 9, name = "2b"}
    local c = {class = 3, vc = 99, n = 1, name = "3c"}
    local d = {class = 2, vc = 10, n = 4, name = "2d"}
    out.before = {fq.before(b, a), fq.before(c, b), fq.before(a, b), fq.before(a, d)}
    out.rank = {fq.rank(a, 0, {a, b, c}), fq.rank(b, 2, {a, b, c}), fq.rank(c, 0, {a, b, c})}
    -- every waiting request of a higher class ranks first: with 2 slots free at once, a
    -- sheddable head (rank 5 behind 5 critical ones) takes none
    local hi = {class = 3, vc = 50, n = 5, name = "3hi"}
    local lo = {class = 1, vc = 0, n = 3, name = "1lo"}
    out.rank_classes = {fq.rank(lo, 0, {hi, lo}), fq.rank(hi, 1, {hi, lo})}

    -- a noisy tenant with 12 waiting, two quiet ones with 3 each, one slot at a time
    for _ = 1, 12 do arrive("m", "noisy", 2) end
    for _ = 1, 3 do arrive("m", "q1", 2); arrive("m", "q2", 2) end
    local order = {}
    for i = 1, 9 do order[i] = serve_one("m", 100) end
    out.order = order
    -- a tenant that starts waiting now is lifted to the smallest waiting counter
    out.before_lift = vtc.get("late")
    arrive("m", "late", 2)
    out.late = vtc.get("late")
    out.min_waiting = math.min(vtc.get("noisy"), vtc.get("q1"), vtc.get("q2"))
    vtc.charge("busy", 1e6)          -- served a lot before it went idle
    arrive("m", "busy", 2)
    out.busy = vtc.get("busy")
    while #waiting > 0 do serve_one("m", 100) end
    out.empty_after = fq.any_waiting("m")

    -- weights: tenant w2 (weight 2) is served twice as often as w1 under backlog
    for _ = 1, 12 do arrive("w", "w1", 2, 1); arrive("w", "w2", 2, 2) end
    local n = {w1 = 0, w2 = 0}
    for _ = 1, 12 do local t = serve_one("w", 60); n[t] = n[t] + 1 end
    out.weighted = n
    while #waiting > 0 do serve_one("w", 60) end

    -- a critical flow goes before every standard one, whatever the counters
    vtc.charge("vip", 1e6)
    for _ = 1, 3 do arrive("p", "bulk", 2) end
    arrive("p", "vip", 3)
    arrive("p", "cheap", 1)
    local porder = {}
    for i = 1, 5 do porder[i] = serve_one("p", 10) end
    out.priority_order = porder

    -- the per-flow bound: a flow waiting alone is not held to it; once another flow
    -- waits in the pool, a request past it is refused
    local t1 = fq.join("b", fq.flow("x", 2), 2, 0.02)
    local t2 = fq.join("b", fq.flow("x", 2), 2, 0.02)
    local t3 = fq.join("b", fq.flow("x", 2), 2, 0.02)
    local other = fq.join("b", fq.flow("y", 2), 2, 0.02)
    local t4, err = fq.join("b", fq.flow("x", 2), 2, 0.02)
    out.bound = {t1 ~= nil, t2 ~= nil, t3 ~= nil, other ~= nil, t4 == nil, err}
    -- alone, a flow holds up to ALONE_FACTOR times its bound
    local alone = {}
    for i = 1, 2 * fq.ALONE_FACTOR + 1 do
        alone[i] = fq.join("c", fq.flow("z", 2), 2, 0.02) ~= nil
    end
    out.alone = alone

    -- the counters' flush: one EVAL with the changes, the hash read back, pending cleared
    vtc.commands(false)        -- (what the runs above charged)
    vtc.charge("zed", 40, 4)
    local cmds, sent = vtc.commands(true)
    local c = cmds[1]
    out.cmd = {#cmds, c[1], c[6], c[7], c[8], c[9]}
    vtc.settle(sent, true, {{"zed", "10", "other", "7.5"}}, nil)
    out.after_read = {vtc.get("zed"), vtc.get("other")}
    out.nothing_left = vtc.commands(false) == nil
    -- a start goes as the value to set, the charges after it as the delta
    vtc.start("zed", 50)
    vtc.charge("zed", 5)
    local lc = vtc.commands(false)[1]
    out.lift = {lc[7], lc[8], lc[9]}
    -- a failed flush keeps the changes for the next one
    vtc.charge("zed", 8)
    local _, sent2 = vtc.commands(false)
    vtc.settle(sent2, false, nil, "connection refused")
    local again = vtc.commands(false)
    out.kept = again ~= nil and again[1][9]

    -- class and weight: the key's, else the tenant's default, else the section's
    local o = config.get().admission
    local function share(req) local c, w = fairshare.share(req, o); return {c, w} end
    out.share = {
        share({tenant = "gold"}),
        share({tenant = "gold", key_share = {weight = 0.5, priority = "sheddable"}}),
        share({tenant = "ops"}),
        share({tenant = "other"}),
    }

    -- the output tokens a request reserves at admission
    local lo = {default_max_tokens = 256, model_max_tokens = {big = 2048}}
    out.reserved = {
        tokencount.reserved_output({messages = {}, max_tokens = 100}, "m", lo),
        tokencount.reserved_output({messages = {}, max_completion_tokens = 50, max_tokens = 9}, "m", lo),
        tokencount.reserved_output({prompt = "x", max_tokens = 100, n = 3}, "m", lo),
        tokencount.reserved_output({messages = {}}, "big", lo),
        tokencount.reserved_output({messages = {}}, "m", lo),
        tokencount.reserved_output({input = "embed me"}, "m", lo),
    }
""")


def test_flows_are_ordered_by_class_then_counter_then_fewer_waiting(got: dict) -> None:
    assert got["before"] == [True, True, False, True]
    # a (vc 10) has b (vc 5) and c (critical) before it; b at position 2 has c; c none
    assert got["rank"] == [2, 3, 0]
    assert got["rank_classes"] == [5, 1]


def test_a_noisy_tenant_does_not_get_more_than_the_quiet_ones(got: dict) -> None:
    # equal counters at the start: the flows with fewer waiting first, then every
    # tenant in turn (one slot each)
    assert got["order"] == ["q1", "q2", "noisy"] * 3


def test_a_tenant_that_starts_waiting_starts_at_the_smallest_waiting_counter(got: dict) -> None:
    assert got["before_lift"] == 0
    assert got["late"] == got["min_waiting"] > 0    # not at zero
    assert got["busy"] == got["min_waiting"]        # nor 1e6 behind from before
    assert got["empty_after"] is False


def test_weights_share_the_slots(got: dict) -> None:
    assert got["weighted"] == {"w1": 4, "w2": 8}


def test_higher_class_first_whatever_the_counter(got: dict) -> None:
    assert got["priority_order"] == ["vip", "bulk", "bulk", "bulk", "cheap"]


def test_a_flow_holds_at_most_its_bound_while_another_waits(got: dict) -> None:
    assert got["bound"] == [True, True, True, True, True, "full"]
    assert got["alone"] == [True] * 16 + [False]          # ALONE_FACTOR 8 x bound 2


def test_counters_go_to_redis_in_the_flush_and_come_back(got: dict) -> None:
    # one command: EVAL ..., read back "1", then tenant, floor ("" = none), delta
    assert got["cmd"] == [1, "EVAL", "1", "zed", "", "10"]   # 40 tokens / weight 4
    assert got["after_read"] == [10, 7.5]  # what Redis holds, nothing pending
    assert got["nothing_left"] is True
    assert got["lift"] == ["zed", "50", "5"]
    assert float(got["kept"]) == 8


def test_class_and_weight_come_from_key_then_tenant_then_default(got: dict) -> None:
    assert got["share"] == [[2, 3], [1, 0.5], [3, 1], [2, 1]]


def test_reservation_is_max_tokens_or_the_model_default(got: dict) -> None:
    assert got["reserved"] == [100, 50, 300, 2048, 256, 0]


def test_a_waiter_far_back_polls_less_but_never_outlives_its_alive_mark(workdir: Path) -> None:
    """infergate.admission.shed's step between two looks of a waiting request: the poll
    while it could be served, longer the further back it waits (at most 10 x), and never
    over half the TTL of its alive mark (queue.alive_ttl_s), whatever admission.poll_ms."""
    got = lua_eval(workdir, PRELUDE + """
    local shed = require("infergate.admission.shed")
    local queue = require("infergate.admission.queue")
    out.front = shed.FAIR_STEP(0.02, 1, 2)
    out.back = shed.FAIR_STEP(0.02, 200, 0)
    out.slow_poll = shed.FAIR_STEP(1.0, 200, 0)
    out.ttl = queue.alive_ttl_s(1.0)
    return out
""", http_extra=DICTS)
    assert got["front"] == pytest.approx(0.02)
    assert got["back"] == pytest.approx(0.2)
    assert got["slow_poll"] == pytest.approx(got["ttl"] / 2) and got["slow_poll"] < 10


def test_admission_charges_the_expected_output_and_the_log_settles_it(workdir: Path) -> None:
    """infergate.admission.fairshare: a request admitted is charged its prompt and its
    expected output at once (the model's learned quantile of completion tokens, or its
    max_tokens when smaller or nothing is learned), so long requests in flight count
    before they finish; the answer's usage settles the charge, down as well as up."""
    got = lua_eval(workdir, PRELUDE + """
    local lengths = require("infergate.routing.lengths")
    local o = config.get().admission
    local function exp(model, body) return fairshare.expected_output({model = model, body = body}) end
    out.none = exp("m0", {messages = {}})
    out.max_tokens = exp("m0", {max_tokens = 200})
    lengths.observe("m1", 40)                  -- the first answer sets the quantile
    out.learned = exp("m1", {})
    out.capped = exp("m1", {max_completion_tokens = 10, max_tokens = 900})
    out.above = exp("m1", {max_tokens = 500})
    local req = {tenant = "t-exp", model = "m0", body = {max_tokens = 200}, est_tokens = 10}
    fairshare.admitted(req, o)
    out.admitted = vtc.get("t-exp")
    req.usage = {total_tokens = 60}
    fairshare.log(req)
    out.settled = vtc.get("t-exp")
    local cut = {tenant = "t-cut", model = "m0", body = {max_tokens = 50}, est_tokens = 5}
    fairshare.admitted(cut, o)
    fairshare.log(cut)                          -- no usage known: the charge stays
    out.cut = vtc.get("t-cut")
    return out
""", http_extra=DICTS)
    assert (got["none"], got["max_tokens"]) == (0, 200)
    assert (got["learned"], got["capped"], got["above"]) == (40, 10, 40)
    assert got["admitted"] == pytest.approx(210)
    assert got["settled"] == pytest.approx(60)
    assert got["cut"] == pytest.approx(55)


def test_an_answer_without_usage_is_charged_what_its_slot_could_write_while_held(workdir: Path) -> None:
    """infergate.admission.fairshare: a request cut by its deadline never says its usage;
    it is charged the output its slot could have written since its admission (the time
    held over its node's learned time per token, at most its max_tokens) when that is
    above the admission charge, so a tenant whose requests hold slots for the whole
    deadline is not charged a typical short answer per request."""
    got = lua_eval(workdir, PRELUDE + """
    local learned = require("infergate.routing.learned")
    local lengths = require("infergate.routing.lengths")
    local o = config.get().admission
    learned.observe("n-held", 1.0, 10)          -- 0.1 s per output token
    lengths.observe("m-held", 16)               -- the model's answers: 16 tokens
    local function cut(tenant, body, held_s, node)
        local req = {tenant = tenant, model = "m-held", body = body, est_tokens = 5}
        fairshare.admitted(req, o)
        out[tenant .. "_admitted"] = vtc.get(tenant)
        req.fair.at = req.fair.at - held_s
        req.attempts = {{node = node}}
        fairshare.log(req)
        out[tenant] = vtc.get(tenant)
    end
    cut("t-long", {max_tokens = 10000000}, 30, "n-held")   -- 30 s held: 300 tokens
    cut("t-capped", {max_tokens = 100}, 30, "n-held")      -- at most its max_tokens
    cut("t-short", {max_tokens = 10000000}, 0.5, "n-held") -- 5 tokens < the charge: kept
    cut("t-unknown", {max_tokens = 10000000}, 30, "n-none") -- no time per token: kept
    return out
""", http_extra=DICTS)
    assert got["t-long_admitted"] == pytest.approx(21)
    assert got["t-long"] == pytest.approx(305)
    assert got["t-capped"] == pytest.approx(105)
    assert got["t-short"] == pytest.approx(21)
    assert got["t-unknown"] == pytest.approx(21)
