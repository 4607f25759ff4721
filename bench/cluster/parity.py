"""Fair share and rate limits on one Redis and on the loopback cluster, each with two
edges and two control planes (``python -m bench.cluster``'s ``parity`` rows).

Per back end: two ``infergate controlplane`` processes (one leads, the other stands by)
and two edges with fair share on, in front of one simulated pool (two nodes, batch 4,
every request 16 output tokens; each edge has half of every node's slots, so the two
together fill the batches exactly; time constants scaled by ``TIME_SCALE`` as in
:mod:`bench.scheduler.stack`). The same arrivals on both back ends (fixed seed,
requests split alternately between the edges):

- ``fair_share``: tenants ``a`` at 0.6 and ``b`` at 1.8 times the pool's capacity
  (both backlogged: fair share gives each about half of what the pool serves, where one
  FIFO queue would give ``b`` three quarters). Figures per tenant: requests served and
  served tokens; and the shared virtual token counters (hash
  ``keynames.FAIRSHARE_COUNTERS``, one key: one slot on the cluster) read at the end.
- ``rate_limit``: one API key limited to ``RPM`` requests a minute, ``2 x RPM``
  requests one at a time alternating between the edges: how many were let through.

``ratio`` = cluster over single.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import replace

import requests
import tomli_w

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from controlplane.routing import registry

from ..common import Stack, log
from ..scheduler.noisy import PROMPT, _drive
from ..scheduler.noisy_stats import summarise
from ..scheduler.stack import (EdgeRun, InfergateStack, infergate_settings, pool_idle,
                               snapshot_all_healthy, start_pool)
from ..scheduler.workload import PoolSpec, pool_capacity_rps, prompt_tokens

SPEC = PoolSpec(n_fast=2, n_slow=0, max_running=4)
TIME_SCALE = 0.2
OUTPUT_TOKENS = 16
RATES = {"a": 0.6, "b": 1.8}     # times the pool's capacity
RPM = 60


def arrivals(cap_rps: float, duration_s: float, seed: int = 11) -> list[tuple[float, str]]:
    """(send time s, tenant), sorted: each tenant evenly spaced at its rate, 10 % jitter."""
    rng = random.Random(seed)
    out = []
    for tenant, share in RATES.items():
        gap = 1.0 / (share * cap_rps)
        t = rng.uniform(0, gap)
        while t < duration_s:
            out.append((max(0.0, t + rng.uniform(-0.1, 0.1) * gap), tenant))
            t += gap
    return sorted(out)


def _backend(stack: Stack, name: str, url: str,  # type: ignore[no-untyped-def]
             nodes) -> tuple[list[procs.Managed], list[EdgeRun]]:
    """Two control planes (processes) and two fair-share edges on ``url``."""
    s = infergate_settings(url, nodes, SPEC, TIME_SCALE, max_concurrency=SPEC.max_running // 2)
    s.auth.mode = "required"
    s.admission.fair_share = True
    s.admission.tenant_queue_max = 256
    r = make_redis(settings_from_dict({"redis": {"url": url}}).redis)
    for n in registry.list_nodes(r):   # the other drills' nodes: only this pool is routed to
        registry.remove_node(r, n.name)
    cps = []
    for i in range(2):
        s.controlplane.listen = f"127.0.0.1:{procs.free_port()}"
        cfg = stack.dir / f"{name}-cp{i}.toml"
        cfg.write_text(tomli_w.dumps(s.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
        cps.append(stack.add(procs.Managed(
            f"{name}-cp{i}", procs.infergate_argv("controlplane", "--config", str(cfg)),
            stack.dir / "logs" / f"{name}-cp{i}.log").start()))
    procs.wait_until(lambda: snapshot_all_healthy(r, len(nodes)), 60,
                     what=f"the {name} control planes' snapshot")
    base = InfergateStack(settings=s, redis_url=url, cp_log=stack.dir / "logs" / f"{name}-cp0.log")
    edges = [EdgeRun(stack, "infergate", nodes, TIME_SCALE, replace(base), f"{name}-parity-{i}")
             for i in range(2)]
    return cps, edges


def _rate_limit(r, edges: list[EdgeRun], name: str) -> dict:  # type: ignore[no-untyped-def]
    key, _ = apikeys.create_key(r, f"parity-rl-{name}", rpm=RPM)
    sess = requests.Session()
    t0, ok = time.monotonic(), 0
    for i in range(2 * RPM):
        res = sess.post(edges[i % 2].url, timeout=10, headers={"Authorization": f"Bearer {key}"},
                        json={"messages": [{"role": "user", "content": f"rl {i}"}],
                              "max_tokens": 1, "sim_output_tokens": 1})
        ok += res.status_code == 200
    return {"allowed": ok, "requests": 2 * RPM, "seconds": round(time.monotonic() - t0, 2)}


def _fair(r, edges: list[EdgeRun], nodes, load, duration_s: float, name: str) -> dict:  # type: ignore[no-untyped-def]
    keys = {t: apikeys.create_key(r, f"{t}-{name}")[0] for t in RATES}
    r.delete(keynames.FAIRSHARE_COUNTERS)
    before = os.getloadavg()[0]
    outs, use = asyncio.run(_drive([e.url for e in edges], keys, load, 30.0 * TIME_SCALE + 5,
                                   {n.name: n.control_url for n in nodes}, duration_s))
    rec = summarise(outs, duration_s, duration_s, {t: prompt_tokens(PROMPT) + OUTPUT_TOKENS
                                                   for t in RATES})
    vtc = {k: float(v) for k, v in (r.hgetall(keynames.FAIRSHARE_COUNTERS) or {}).items()}
    return {"tenants": {t: {k: v[k] for k in ("sent", "ok", "r429", "errors", "served_tokens")}
                        for t, v in rec["tenants"].items()},
            "vtc": {t: round(vtc.get(f"{t}-{name}", 0.0), 1) for t in RATES},
            "batch_use": round(use, 3) if use is not None else None,
            "load_average_1m": [round(before, 2), round(os.getloadavg()[0], 2)]}


def run(stack: Stack, urls: dict[str, str], duration_s: float) -> dict:
    """Both rows on every back end of ``urls`` (name -> Redis URL, ``single`` and
    ``cluster``), one back end after the other on one pool; the record."""
    nodes = start_pool(stack, SPEC, TIME_SCALE)
    cap = pool_capacity_rps(SPEC, OUTPUT_TOKENS, prompt_tokens(PROMPT)) / TIME_SCALE
    load = arrivals(cap, duration_s)
    out: dict = {"capacity_rps": round(cap, 2), "rates": RATES, "duration_s": duration_s,
                 "time_scale": TIME_SCALE, "rpm": RPM, "backends": {}}
    for name, url in urls.items():
        log(f"parity: {name}, two control planes and two edges")
        cps, edges = _backend(stack, name, url, nodes)
        r = make_redis(settings_from_dict({"redis": {"url": url}}).redis)
        fair = _fair(r, edges, nodes, load, duration_s, name)
        procs.wait_until(lambda: pool_idle(nodes), 30, what="the pool to drain")
        fair["rate_limit"] = _rate_limit(r, edges, name)
        fair["leader"] = r.get(keynames.LEADER)
        out["backends"][name] = fair
        for m in [*(e.managed for e in edges), *cps]:
            m.stop()
    return out


def rows(data: dict) -> list[dict]:
    """Table rows: per tenant served requests/tokens and VTC, and the rate limit."""
    b = data["backends"]
    s, c = b["single"], b["cluster"]
    out = []

    def ratio(x: float, y: float) -> float | None:
        return round(y / x, 3) if x else None

    for t in RATES:
        st, ct = s["tenants"].get(t, {}), c["tenants"].get(t, {})
        out.append({"row": f"fair share: {t} served tokens", "single": st.get("served_tokens"),
                    "cluster": ct.get("served_tokens"),
                    "ratio": ratio(st.get("served_tokens", 0), ct.get("served_tokens", 0))})
        sv, cv = s["vtc"].get(t, 0.0), c["vtc"].get(t, 0.0)
        out.append({"row": f"fair share: {t} VTC counter", "single": sv, "cluster": cv,
                    "ratio": ratio(sv, cv)})
    sa, ca = s["rate_limit"]["allowed"], c["rate_limit"]["allowed"]
    out.append({"row": f"rate limit: allowed of {s['rate_limit']['requests']} ({RPM}/min key)",
                "single": sa, "cluster": ca, "ratio": ratio(sa, ca)})
    return out
