"""Helpers of the control-plane tests: simulated nodes started on free ports, settings
for a fast poll cycle, the routing snapshot read back from Redis."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import requests

from controlplane import procs
from controlplane.config import NodeSettings, Settings, settings_from_dict
from controlplane.redisdb import keynames


@dataclass
class Sim:
    name: str
    port: int
    control_port: int
    managed: procs.Managed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def faults(self, **faults: object) -> None:
        requests.post(f"http://127.0.0.1:{self.control_port}/_sim/faults", json=faults,
                      timeout=5).raise_for_status()

    def clear(self) -> None:
        self.faults(metrics_fail=False, health_fail=False, refuse=False)
        procs.wait_until(self.answers, timeout=10, what=f"{self.name} to answer")

    def answers(self) -> bool:
        return requests.get(self.url + "/health", timeout=0.5).status_code == 200

    def chat(self, n: int = 1) -> None:
        for _ in range(n):
            requests.post(self.url + "/v1/chat/completions", timeout=10, json={
                "model": "sim-llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}).raise_for_status()

    def node(self, kind: str = "vllm", **kw: object) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, kind=kind, **kw)


def start_sim(folder: Path, name: str, dialect: str = "vllm", engines: int = 1) -> Sim:
    """A simulated node on free ports (main + control), ready when /health answers."""
    port = procs.free_port()
    control = procs.free_port()
    while control == port:
        control = procs.free_port()
    argv = procs.infergate_argv(
        "simnode", "--port", str(port), "--control-port", str(control), "--name", name,
        "--dialect", dialect, "--engines", str(engines), "--time-scale", "0.01",
        "--output-tokens", "4:8", "--log-level", "warning")
    m = procs.Managed(name, argv, folder / f"{name}.log").start()
    sim = Sim(name, port, control, m)
    try:
        m.wait_ready(sim.answers, timeout=20)
    except Exception:
        m.stop()
        raise
    return sim


def cp_settings(nodes: list[NodeSettings], **controlplane: object) -> Settings:
    cp = {"poll_interval_s": 0.2, "poll_timeout_s": 0.5, "unhealthy_after": 3,
          "healthy_after": 2, "leader_ttl_s": 1.0, "metrics_ttl_s": 30.0,
          "history_points": 5, "slow_start_s": 30.0, "drain_timeout_s": 600.0}
    cp.update(controlplane)
    return settings_from_dict({
        "controlplane": cp, "edge": {"sync_interval_s": 0.05, "stale_after_s": 10.0},
        "nodes": [n.model_dump() for n in nodes]})



def routing(r) -> dict:
    raw = r.get(keynames.ROUTING)
    assert raw is not None, "no routing snapshot written"
    return json.loads(raw)
