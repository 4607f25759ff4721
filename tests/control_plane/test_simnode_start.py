"""The simulated-node launcher (controlplane/simnode/launch.py) with real processes:
nodes of one call start together on distinct free ports and log where asked; nodes
started with faults that close or fail the main port are still ready; a node that
cannot start fails the call with its log tail and takes the others of the call down;
``into`` hands the processes to a process set."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from controlplane import procs
from controlplane.simnode import launch


def test_nodes_start_together_and_stop_together(tmp_path: Path) -> None:
    nodes = launch.start_nodes([("sim-a", ["--time-scale", "0.05"]), ("sim-b", [])], tmp_path)
    try:
        ports = {p for n in nodes for p in (n.port, n.control_port)}
        assert len(ports) == 4
        assert [n.state()["name"] for n in nodes] == ["sim-a", "sim-b"]
        assert all(n.healthy() for n in nodes)
        assert nodes[0].set_faults(slowdown=2.0)["slowdown"] == 2.0
        assert (tmp_path / "sim-a.log").exists() and (tmp_path / "sim-b.log").exists()
    finally:
        launch.stop_nodes(nodes)
    assert not any(n.alive() for n in nodes)


def test_a_node_whose_port_was_taken_starts_again_on_new_ports(tmp_path: Path,
                                                                monkeypatch) -> None:
    """A free port can be taken between its choice and the node's bind (another process
    on a shared host): the node then exits with "address already in use" and the
    launcher starts it again on new ports."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    real = procs.free_port
    handed = []

    def first_taken(host: str = "127.0.0.1") -> int:
        handed.append(taken if not handed else real(host))
        return handed[-1]

    monkeypatch.setattr(procs, "free_port", first_taken)
    try:
        (node,) = launch.start_nodes([("sim-p", [])], tmp_path, control=False)
        try:
            assert node.port != taken and node.healthy()
            assert handed[0] == taken and len(handed) == 2
        finally:
            launch.stop_nodes([node])
    finally:
        holder.close()


def test_specs_may_be_an_iterator_and_every_node_is_ready(tmp_path: Path) -> None:
    nodes = launch.start_nodes(((f"sim-i{i}", []) for i in range(2)), tmp_path, control=False)
    try:
        assert [n.name for n in nodes] == ["sim-i0", "sim-i1"]
        assert all(n.ready() for n in nodes)   # waited for, not just started
    finally:
        launch.stop_nodes(nodes)


def test_nodes_started_with_refuse_or_health_fail_are_ready(tmp_path: Path) -> None:
    refusing, failing = launch.start_nodes([("sim-r", ["--refuse"]), ("sim-h", ["--health-fail"])],
                                           tmp_path)
    try:
        assert refusing.state()["listening"] is False
        assert not procs.port_open("127.0.0.1", refusing.port)
        assert not failing.healthy()
        assert requests.get(f"{failing.url}/health", timeout=5).status_code == 503
        refusing.set_faults(refuse=False)
        procs.wait_until(refusing.healthy, 10, what="sim-r to listen")
    finally:
        launch.stop_nodes([refusing, failing])


def test_a_node_that_cannot_start_fails_the_call_and_stops_the_others(tmp_path: Path) -> None:
    stack = procs.ProcessSet()
    with pytest.raises(procs.StartError, match="sim-bad exited early") as exc:
        launch.start_nodes([("sim-ok", []), ("sim-bad", ["--output-tokens", "9:3"])], tmp_path,
                           into=stack, timeout=20)
    assert "MIN <= MAX" in str(exc.value)  # the log tail comes with the error
    assert [m.name for m in stack.items] == ["sim-ok", "sim-bad"]
    assert not any(m.alive() for m in stack.items)


def test_without_a_control_port_the_main_port_serves_the_control_api(tmp_path: Path) -> None:
    stack = procs.ProcessSet()
    try:
        node = launch.start_node("sim-n", tmp_path, "--speed", "2", control=False, into=stack)
        assert node.control_port is None and stack.items == [node.managed]
        assert node.state()["name"] == "sim-n"
    finally:
        stack.stop_all()
