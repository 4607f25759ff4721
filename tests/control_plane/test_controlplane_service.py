"""``infergate controlplane`` as a process: serves /healthz, writes the snapshot as
leader, and on SIGTERM stops, releases the leader lock and exits 0."""

from __future__ import annotations

import json
import signal
import socket

import pytest
import requests
from click.testing import CliRunner

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.routing.service import controlplane_cmd
from support.controlplane import start_sim


@pytest.mark.integration
def test_service_runs_and_stops_cleanly(redis_server, workdir):
    sim = start_sim(workdir, "sim-s")
    port = procs.free_port()
    cfg = workdir / "infergate.toml"
    cfg.write_text(f"""
[controlplane]
listen = "127.0.0.1:1"
poll_interval_s = 0.2
poll_timeout_s = 0.5
leader_ttl_s = 2.0

[[nodes]]
name = "sim-s"
url = "{sim.url}"
""")
    argv = procs.infergate_argv("controlplane", "--config", str(cfg),
                                "--listen", f"127.0.0.1:{port}", "--redis-url", redis_server.url)
    m = procs.Managed("controlplane", argv, workdir / "cp.log").start()
    r = redis_server.client()
    try:
        m.wait_ready(lambda: requests.get(f"http://127.0.0.1:{port}/healthz",
                                          timeout=0.5).status_code == 200, timeout=30)
        m.wait_ready(lambda: r.get(keynames.ROUTING) is not None, timeout=15)
        first = json.loads(r.get(keynames.ROUTING))
        assert [n["name"] for n in first["nodes"]] == ["sim-s"]
        holder = r.get(keynames.LEADER)
        assert holder == first["leader"] and holder.split(":")[-2] == str(m.pid)
        # The scheduler keeps cycling.
        m.wait_ready(lambda: json.loads(r.get(keynames.ROUTING))["version"] >= first["version"] + 2,
                     timeout=15)

        m.signal(signal.SIGTERM)
        assert m.proc.wait(timeout=15) == 0
        assert r.get(keynames.LEADER) is None
        log = m.log_tail(200)
        assert "leadership acquired" in log and "leadership released" in log
    finally:
        m.stop()
        sim.managed.stop()


def test_bad_config_and_listen_are_clear_errors(tmp_path):
    runner = CliRunner()
    res = runner.invoke(controlplane_cmd, ["--config", str(tmp_path / "missing.toml")])
    assert res.exit_code != 0 and "no such configuration file" in res.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[controlplane]\npoll_interval_s = 'often'\n")
    res = runner.invoke(controlplane_cmd, ["--config", str(bad)])
    assert res.exit_code != 0 and "controlplane.poll_interval_s" in res.output
    res = runner.invoke(controlplane_cmd, ["--listen", "nowhere"])
    assert res.exit_code != 0 and "HOST:PORT" in res.output
    # an address another process holds: named, with the setting and the flags
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        res = runner.invoke(controlplane_cmd, ["--listen", f"127.0.0.1:{port}",
                                               "--redis-url", "redis://127.0.0.1:1/0"])
    assert res.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in res.output
    assert "controlplane.listen" in res.output and "--admin-listen" in res.output
