"""The pure parts of the simulated-node launcher (controlplane/simnode/launch.py): flags
from keyword options, argv, URLs. Starting nodes: tests/control_plane/test_simnode_start.py."""

from __future__ import annotations

import sys
from pathlib import Path

from controlplane import procs
from controlplane.simnode import launch


def test_option_flags() -> None:
    assert launch.option_flags(time_scale=0.05, hang=True, refuse=False, name=None,
                               output_tokens="8:16") == [
        "--time-scale", "0.05", "--hang", "--output-tokens", "8:16"]
    assert launch.option_flags() == []


def test_argv_with_and_without_a_control_port() -> None:
    argv = launch.simnode_argv("sim-a", 9001, ["--speed", "2"], control_port=9101)
    assert argv[:3] == [sys.executable, "-m", "controlplane.cli"]
    assert argv[3:] == ["simnode", "--host", "127.0.0.1", "--port", "9001",
                        "--control-port", "9101", "--name", "sim-a", "--speed", "2"]
    assert "--control-port" not in launch.simnode_argv("sim-b", 9002, host="127.0.0.2")
    assert launch.simnode_argv("sim-b", 9002, host="127.0.0.2")[4:6] == ["--host", "127.0.0.2"]


def test_urls_fall_back_to_the_main_port_without_a_control_port() -> None:
    m = procs.Managed("sim-a", ["true"], Path("/nonexistent/sim-a.log"))
    with_ctl = launch.SimNodeProcess("sim-a", "127.0.0.1", 9001, 9101, m)
    without = launch.SimNodeProcess("sim-a", "127.0.0.1", 9001, None, m)
    assert with_ctl.url == without.url == "http://127.0.0.1:9001"
    assert with_ctl.control_url == "http://127.0.0.1:9101"
    assert without.control_url == "http://127.0.0.1:9001"
    assert with_ctl.log_path == Path("/nonexistent/sim-a.log") and not with_ctl.alive()
