"""The control plane's model-aware routing and slow start against real simulated nodes
and redis-server, cycles driven with ControlPlane.run_cycle(): served models in the
snapshot (read from /v1/models rarely, never from kind openai, configured lists win),
and the slow-start ramp for a node added at run time or back from unhealthy."""

from __future__ import annotations

import pytest

from controlplane.config import Settings
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane
from support.controlplane import Sim, cp_settings, routing, start_sim

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("sims-models")
    started: list[Sim] = []
    try:
        for name, dialect in (("mv", "vllm"), ("mt", "tgi"), ("mo", "none")):
            started.append(start_sim(folder, name, dialect))
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.managed.stop()


@pytest.fixture
def cp_factory(redis_server):
    made: list[ControlPlane] = []

    def make(settings: Settings) -> ControlPlane:
        cp = ControlPlane(settings, redis_server.client())
        made.append(cp)
        return cp

    yield make
    for cp in made:
        cp.shutdown()


def _by_name(r) -> dict:
    return {n["name"]: n for n in routing(r)["nodes"]}


def _models_reads(sim: Sim) -> int:
    return int(sim.state()["by_path"].get("/v1/models", 0))


def test_served_models_in_the_snapshot(redis_server, sims, cp_factory):
    r = redis_server.client()
    for s in sims.values():
        s.clear()
    before = {name: _models_reads(s) for name, s in sims.items()}
    pool = [sims["mv"].node("vllm"), sims["mt"].node("tgi", models=["cfg-model"]),
            sims["mo"].node("openai")]
    cp = cp_factory(cp_settings(pool))
    cp.run_cycle()
    cp.models.wait_idle()
    for _ in range(10):
        cp.run_cycle()
    by = _by_name(r)
    assert by["mv"]["models"] == ["sim-llama"]       # read from its /v1/models
    assert by["mt"]["models"] == ["cfg-model"]       # configured: never read
    assert by["mo"]["models"] is None                # kind openai: never read, unknown
    after = {name: _models_reads(s) for name, s in sims.items()}
    assert after["mv"] - before["mv"] == 1            # once at add, not every cycle
    assert after["mt"] == before["mt"] and after["mo"] == before["mo"]


def test_slow_start_for_added_and_recovered_nodes(redis_server, sims, cp_factory):
    r = redis_server.client()
    for s in sims.values():
        s.clear()
    mv, mt = sims["mv"].node("vllm", weight=2.0), sims["mt"].node("tgi")
    cp = cp_factory(cp_settings([mv], slow_start_s=30.0, unhealthy_after=2, healthy_after=1))
    cp.run_cycle()
    assert _by_name(r)["mv"]["effective_weight"] == 2.0   # present at start: no ramp
    registry.put_node(r, mt)                              # added at run time
    cp.run_cycle()
    by = _by_name(r)
    assert by["mt"]["effective_weight"] == pytest.approx(0.1, abs=0.01)
    assert by["mv"]["effective_weight"] == 2.0
    try:
        sims["mv"].faults(health_fail=True)
        cp.run_cycle()
        cp.run_cycle()
        assert _by_name(r)["mv"]["healthy"] is False
    finally:
        sims["mv"].clear()
    cp.run_cycle()
    by = _by_name(r)
    assert by["mv"]["healthy"] is True
    assert by["mv"]["effective_weight"] == pytest.approx(2.0 * 0.1, abs=0.02)


def test_cli_sets_and_edits_served_models(redis_server):
    from click.testing import CliRunner

    from controlplane.cli import main

    r = redis_server.client()
    runner = CliRunner()

    def nodes(*args: str):
        return runner.invoke(main, ["nodes", "--redis-url", redis_server.url, *args])

    res = nodes("add", "mm", "http://127.0.0.1:9", "--kind", "openai",
                "--model", "m-1", "--model", "m-2")
    assert res.exit_code == 0, res.output
    assert registry.get_node(r, "mm").models == ["m-1", "m-2"]
    res = nodes("edit", "mm", "--model", "m-3")
    assert res.exit_code == 0, res.output
    assert registry.get_node(r, "mm").models == ["m-3"]
    res = nodes("edit", "mm", "--weight", "2")     # other edits keep the models
    assert res.exit_code == 0, res.output
    node = registry.get_node(r, "mm")
    assert node.models == ["m-3"] and node.weight == 2.0
    registry.remove_node(r, "mm")
