"""Helpers of the control-plane tests: simulated nodes started on free ports, settings
for a fast poll cycle, the routing snapshot read back from Redis."""

from __future__ import annotations

import json
from pathlib import Path

import requests

from controlplane import procs
from controlplane.config import NodeSettings, Settings, settings_from_dict
from controlplane.redisdb import keynames
from controlplane.simnode import launch


class Sim(launch.SimNodeProcess):
    """A simulated node of the control-plane tests (see
    :class:`controlplane.simnode.launch.SimNodeProcess`) with shortcuts for them."""

    def faults(self, **faults: object) -> None:
        """``POST /_sim/faults`` on the control port; raises on an error status."""
        self.set_faults(**faults)

    def clear(self) -> None:
        """Turn off the faults the tests use and wait until ``/health`` answers 200."""
        self.faults(metrics_fail=False, health_fail=False, refuse=False)
        procs.wait_until(self.answers, timeout=10, what=f"{self.name} to answer")

    def answers(self) -> bool:
        return self.healthy()

    def chat(self, n: int = 1) -> None:
        for _ in range(n):
            requests.post(self.url + "/v1/chat/completions", timeout=10, json={
                "model": "sim-llama", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4}).raise_for_status()

    def node(self, kind: str = "vllm", **kw: object) -> NodeSettings:
        return NodeSettings(name=self.name, url=self.url, kind=kind, **kw)


def start_sim(folder: Path, name: str, dialect: str = "vllm", engines: int = 1) -> Sim:
    """A simulated node on free ports (main + control) at time scale 0.01 with 4-8
    output tokens, logging to ``folder/<name>.log``; ready when it answers (20 s)."""
    flags = ["--dialect", dialect, "--engines", str(engines), "--time-scale", "0.01",
             "--output-tokens", "4:8", "--log-level", "warning"]
    return launch.start_node(name, folder, *flags, timeout=20, cls=Sim)


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
