"""The processes of ``python -m bench.realnode compare``: a pool of llama-servers of
different slot counts, infergate in front of them (Redis + control plane, nginx per
run) and the calibration run that measures the pool's capacity.

infergate is started as ``bench.scheduler`` starts it (:func:`bench.scheduler.stack.
infergate_settings` at time scale 1, i.e. the defaults of every time constant), except
that the nodes are given by name and URL alone: no ``kind``, no ``max_concurrency``.
The control plane tells llama.cpp from ``/metrics`` and takes each node's slots from
``/props`` (``controlplane/routing/nodekind.py``); the runs start once the routing
snapshot shows every node healthy with its slot count. The nginx ``least_conn``
baseline is :func:`bench.scheduler.stack.render_plain` (via :class:`EdgeRun`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import redis
import requests

from bench.common import Stack
from bench.realnode.compare_load import parse_metrics, send_real
from bench.realnode.launch import RealNode
from bench.scheduler.stack import InfergateStack, infergate_settings, start_redis_and_controlplane
from bench.scheduler.workload import PoolSpec, Request, RequestMix
from controlplane import procs
from controlplane.config import Settings, settings_from_dict
from controlplane.redisdb import keynames

#: Seconds each llama-server gets to load the model.
NODE_READY_S = 120.0


@dataclass
class PoolNode:
    """One llama-server of the pool: its name (``p<slots>-<i>``) and slot count."""

    name: str
    slots: int
    node: RealNode

    @property
    def port(self) -> int:
        return self.node.port

    @property
    def url(self) -> str:
        return self.node.url


def start_pool(stack: Stack, slots: list[int], threads: int) -> list[PoolNode]:
    """Start one llama-server per entry of ``slots`` (``--parallel`` = the entry,
    ``--threads`` = ``threads``) on free ports, one after the other, each waited for;
    all are stopped with ``stack``."""
    logs = stack.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = []
    for i, n in enumerate(slots, 1):
        node = RealNode(port=procs.free_port(), parallel=n, threads=threads, log_dir=logs)
        node.start(timeout_s=NODE_READY_S)
        assert node.managed is not None
        stack.add(node.managed)
        out.append(PoolNode(name=f"p{n}-{i}", slots=n, node=node))
    return out


def node_metrics(url: str) -> dict[str, float]:
    """llama-server's ``/metrics`` (:func:`parse_metrics`); raises on no answer."""
    r = requests.get(f"{url}/metrics", timeout=2)
    r.raise_for_status()
    return parse_metrics(r.text)


def pool_idle(nodes: list[PoolNode]) -> bool:
    """No node is processing or holding back a request."""
    for n in nodes:
        m = node_metrics(n.url)
        if m.get("requests_processing", 0) or m.get("requests_deferred", 0):
            return False
    return True


# --------------------------------------------------------------------------- infergate

def realnode_settings(redis_url: str, nodes: list[PoolNode]) -> Settings:
    """bench.scheduler's infergate settings at time scale 1, nodes by name and URL only."""
    base = infergate_settings(redis_url, nodes, PoolSpec(), 1.0)  # type: ignore[arg-type]
    data = base.model_dump(mode="json", exclude_none=True)
    data["nodes"] = [{"name": n.name, "url": n.url} for n in nodes]
    return settings_from_dict(data, "realnode compare")


def pool_detected(r: redis.Redis, nodes: list[PoolNode]) -> bool:
    """The routing snapshot has every node active, healthy, with its slots as its
    max_concurrency."""
    raw = r.get(keynames.ROUTING)
    snap = json.loads(raw) if raw else {}
    by = {n.get("name"): n for n in snap.get("nodes", [])}
    return all(by.get(n.name, {}).get("healthy") and by[n.name].get("state") == "active"
               and by[n.name].get("max_concurrency") == n.slots for n in nodes)


def start_infergate(stack: Stack, nodes: list[PoolNode]) -> InfergateStack:
    """Start redis-server and ``infergate controlplane`` on free ports; wait (60 s) until
    :func:`pool_detected`. Raises :class:`controlplane.procs.StartError`."""
    return start_redis_and_controlplane(stack, lambda url: realnode_settings(url, nodes),
                                        lambda r: pool_detected(r, nodes))


# --------------------------------------------------------------------------- calibration

async def _saturate(session: aiohttp.ClientSession, node: PoolNode, reqs: list[Request],
                    end: float, deadline_s: float) -> float:
    """Keep ``node.slots`` requests in flight on ``node`` until the loop time ``end``;
    return the completed requests, one still running at ``end`` counting for the
    fraction of it done by then."""
    loop = asyncio.get_running_loop()
    done = 0.0

    async def worker() -> None:
        nonlocal done
        while reqs and loop.time() < end:
            req = reqs.pop()
            t0 = loop.time()
            res = await send_real(session, f"{node.url}/v1/chat/completions", req, deadline_s)
            t1 = loop.time()
            if res.outcome == "ok":
                done += 1.0 if t1 <= end else (end - t0) / (t1 - t0)

    await asyncio.gather(*(worker() for _ in range(node.slots)))
    return done


async def calibrate(nodes: list[PoolNode], mix: RequestMix, seconds: float,
                    deadline_s: float) -> dict:
    """Closed-loop saturation of every node at once (each with as many requests in flight
    as it has slots, straight to the node) for ``seconds``: ``{"seconds", "nodes": {name:
    {"slots", "rps"}}, "capacity_rps"}`` with rps = completed requests per second."""
    loop = asyncio.get_running_loop()
    reqs = list(reversed(mix.workload(1.0, max(200.0, seconds * 50)).requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = loop.time() + seconds
        t0 = time.monotonic()
        counts = await asyncio.gather(*(_saturate(session, n, reqs, end, deadline_s)
                                        for n in nodes))
        wall = time.monotonic() - t0
    per = {n.name: {"slots": n.slots, "rps": round(c / seconds, 4)} for n, c in zip(nodes, counts)}
    return {"seconds": seconds, "wall_s": round(wall, 2), "nodes": per,
            "capacity_rps": round(sum(v["rps"] for v in per.values()), 4)}
