"""``infergate nodes ...`` with click's CliRunner against a real redis-server."""

from __future__ import annotations

import getpass
import json
import threading
import time

import pytest
from click.testing import CliRunner

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.cli import main


@pytest.fixture
def run(redis_server):
    runner = CliRunner()

    def _run(*args: str):
        return runner.invoke(main, ["nodes", "--redis-url", redis_server.url, *args])

    return _run


@pytest.fixture
def r(redis_server):
    return redis_server.client()


def test_add_list_edit_remove(run, r):
    res = run("list")
    assert res.exit_code == 0 and "no nodes registered" in res.output
    res = run("add", "sim-a", "http://127.0.0.1:9001", "--weight", "2", "--kind", "tgi")
    assert res.exit_code == 0, res.output
    assert "added sim-a" in res.output
    assert run("add", "sim-b", "http://127.0.0.1:9002").exit_code == 0
    node = registry.get_node(r, "sim-a")
    assert node.weight == 2.0 and node.kind == "tgi"

    res = run("list")
    lines = res.output.splitlines()
    assert lines[0].split()[:5] == ["NAME", "STATE", "HEALTH", "KIND", "URL"]
    assert lines[1].split()[:6] == ["sim-a", "active", "?", "tgi", "http://127.0.0.1:9001", "2"]
    assert lines[2].split()[0] == "sim-b"
    data = json.loads(run("list", "--json").output)
    assert [n["name"] for n in data] == ["sim-a", "sim-b"]

    res = run("edit", "sim-a", "--max-concurrency", "8", "--url", "http://127.0.0.1:9009")
    assert res.exit_code == 0, res.output
    node = registry.get_node(r, "sim-a")
    assert node.max_concurrency == 8 and node.url == "http://127.0.0.1:9009"

    res = run("remove", "sim-a")
    assert res.exit_code == 0 and registry.get_node(r, "sim-a") is None
    kinds = [(e["kind"], e["actor"]) for e in registry.recent_events(r, 10)]
    user = f"cli:{getpass.getuser()}"
    assert kinds == [("node_remove", user), ("node_edit", user), ("node_add", user),
                     ("node_add", user)]


@pytest.mark.parametrize("args,frag", [
    (("add", "sim-a", "http://127.0.0.1:9001"), "already exists"),
    (("add", "x", "ftp://10.0.0.1"), "url"),
    (("add", "SIM-A", "http://10.0.0.1"), "a node named 'sim-a' already exists"),
    (("add", "x", "http://10.0.0.1:8000#frag"), "without a path, query or fragment"),
    (("edit", "sim-a", "--url", "http://10.0.0.1:8000/#"), "without a path, query or fragment"),
    (("add", "x", "http://10.0.0.1", "--weight", "0"), "weight"),
    (("add", "bad/name", "http://10.0.0.1"), "name"),
    (("edit", "sim-a", "--weight", "-1"), "weight"),
    (("edit", "sim-a", "--weight", "1_000"), "not a plain decimal number"),
    (("edit", "nope", "--weight", "1"), "no node named 'nope'"),
    (("remove", "nope"), "no node named 'nope'"),
    (("drain", "nope"), "no node named 'nope'"),
    (("undrain", "nope"), "no node named 'nope'"),
])
def test_errors_exit_non_zero_with_a_message(run, r, args, frag):
    assert run("add", "sim-a", "http://127.0.0.1:9001").exit_code == 0
    res = run(*args)
    assert res.exit_code in (1, 2), res.output   # 2: click's usage error of an option value
    assert "Error:" in res.output and frag in res.output
    assert "Traceback" not in res.output
    assert [n.name for n in registry.list_nodes(r)] == ["sim-a"]
    assert registry.get_node(r, "sim-a").weight == 1.0


def test_edit_without_changes_is_a_usage_error(run):
    run("add", "sim-a", "http://127.0.0.1:9001")
    res = run("edit", "sim-a")
    assert res.exit_code == 2 and "nothing to change" in res.output
    res = run("edit", "sim-a", "--weight", "1")
    assert res.exit_code == 0 and "sim-a: nothing changed" in res.output


def test_drain_undrain(run, r):
    run("add", "sim-a", "http://127.0.0.1:9001")
    run("add", "sim-b", "http://127.0.0.1:9002")   # still active: no warning of that either
    # a control plane publishes routing snapshots: no warning
    r.set(keynames.ROUTING, json.dumps({"version": 1, "generated_at": time.time(), "nodes": []}))
    res = run("drain", "sim-a")
    assert res.exit_code == 0 and "sim-a: draining" in res.output
    assert "warning" not in res.output
    assert registry.get_state(r, "sim-a").state == "draining"
    assert "already draining" in run("drain", "sim-a").output
    assert run("list").output.splitlines()[1].split()[1] == "draining"
    res = run("undrain", "sim-a")
    assert res.exit_code == 0 and registry.get_state(r, "sim-a").state == "active"
    assert "already active" in run("undrain", "sim-a").output
    ev = registry.recent_events(r, 2)
    assert [e["kind"] for e in ev] == ["undrain", "drain"]
    assert ev[0]["actor"].startswith("cli:")


def test_drain_wait(run, r, redis_server):
    run("add", "sim-a", "http://127.0.0.1:9001")
    res = run("drain", "sim-a", "--wait", "--timeout", "0.3")
    assert res.exit_code == 1 and "still draining after 0.3 s" in res.output

    # what the leader does once in-flight reaches 0
    r2 = redis_server.client()
    t = threading.Thread(target=lambda: (
        procs.wait_until(lambda: registry.get_state(r2, "sim-a").state == "draining", 5),
        registry.set_state(r2, "sim-a", "drained", "cp")))
    run("undrain", "sim-a")
    t.start()
    res = run("drain", "sim-a", "--wait", "--timeout", "10")
    t.join()
    assert res.exit_code == 0 and "sim-a: drained" in res.output


def test_redis_unreachable(redis_server):
    port = procs.free_port()
    res = CliRunner().invoke(main, ["nodes", "--redis-url", f"redis://127.0.0.1:{port}/0", "list"])
    assert res.exit_code == 1 and "cannot reach Redis" in res.output
    res = CliRunner().invoke(main, ["nodes", "--redis-url", "nonsense://x", "list"])
    assert res.exit_code == 1 and "Redis URL" in res.output


def test_config_file(tmp_path, redis_server, r):
    cfg = tmp_path / "infergate.toml"
    cfg.write_text(f'[redis]\nurl = "{redis_server.url}"\n')
    res = CliRunner().invoke(main, ["nodes", "--config", str(cfg), "add", "n1", "http://10.1.1.1"])
    assert res.exit_code == 0, res.output
    assert registry.get_node(r, "n1") is not None
    bad = tmp_path / "bad.toml"
    bad.write_text("[redis\n")
    res = CliRunner().invoke(main, ["nodes", "--config", str(bad), "list"])
    assert res.exit_code == 1 and "not valid TOML" in res.output


def test_connection_options_also_follow_the_subcommand(redis_server, tmp_path):
    runner = CliRunner()
    r = redis_server.client()
    res = runner.invoke(main, ["nodes", "add", "late", "http://127.0.0.1:9001",
                               "--redis-url", redis_server.url])
    assert res.exit_code == 0, res.output
    assert registry.get_node(r, "late") is not None
    cfg = tmp_path / "infergate.toml"
    cfg.write_text(f'[redis]\nurl = "{redis_server.url}"\n')
    for args in (["nodes", "list", "--config", str(cfg)], ["keys", "list", "--config", str(cfg)],
                 ["cache", "stats", "--config", str(cfg)]):
        res = runner.invoke(main, args)
        assert res.exit_code == 0, (args, res.output)
    assert "late" in runner.invoke(main, ["nodes", "list", "--config", str(cfg)]).output
    # the subcommand's value wins over the group's
    res = runner.invoke(main, ["nodes", "--redis-url", "redis://127.0.0.1:1/0", "list",
                               "--redis-url", redis_server.url])
    assert res.exit_code == 0 and "late" in res.output


def test_a_change_no_control_plane_publishes_is_warned_about(run, r):
    """The edges see drains and registry changes through the control plane's routing
    snapshot: with none published lately (no control plane, or one frozen), the change
    is made and a warning says the edges apply it only once one publishes again."""
    res = run("add", "sim-a", "http://127.0.0.1:9001")
    assert res.exit_code == 0 and "no control plane has published a routing snapshot yet" in res.output
    r.set(keynames.ROUTING, json.dumps({"version": 7, "generated_at": time.time() - 60,
                                        "nodes": []}))
    res = run("drain", "sim-a")
    assert res.exit_code == 0 and registry.get_state(r, "sim-a").state == "draining"
    assert "no control plane has published a routing snapshot for 60 s" in res.output
    assert "the edges apply this change once one does" in res.output


def test_draining_the_last_node_of_a_model_is_done_with_a_warning(run, r):
    r.set(keynames.ROUTING, json.dumps({"version": 1, "generated_at": time.time(), "nodes": []}))
    run("add", "gpu-a", "http://127.0.0.1:9001", "--model", "llama")
    run("add", "gpu-b", "http://127.0.0.1:9002", "--model", "llama", "--model", "qwen")
    res = run("drain", "gpu-a")
    assert res.exit_code == 0 and "warning" not in res.output   # gpu-b serves llama
    res = run("drain", "gpu-b")
    assert res.exit_code == 0 and "gpu-b: draining" in res.output
    assert ("warning: no active node is left: every request will get 503 "
            "no_healthy_upstream") in res.output
    assert registry.get_state(r, "gpu-b").state == "draining"
    run("undrain", "gpu-a")
    res = run("drain", "gpu-b")
    assert "already draining" in res.output
    assert ("warning: no active node is left for model(s) qwen: requests for it will get "
            "503 no_healthy_upstream") in res.output


def test_export_and_import_restore_nodes_weights_and_drains(run, r, tmp_path):
    """A backup of the registry brings back what a Redis without persistence loses:
    run-time nodes with their fields and drain state. An import keeps registered nodes
    unless --overwrite; a bad file is refused whole with the entry named."""
    assert run("add", "gpu-a", "http://127.0.0.1:9001", "--weight", "2.5",
               "--max-concurrency", "8", "--model", "qwen").exit_code == 0
    assert run("add", "gpu-b", "http://127.0.0.1:9002", "--kind", "tgi").exit_code == 0
    assert run("drain", "gpu-b").exit_code == 0
    backup = tmp_path / "nodes.json"
    res = run("export", "--out", str(backup))
    assert res.exit_code == 0 and "exported 2 node(s)" in res.output, res.output
    doc = json.loads(backup.read_text())
    assert [(n["name"], n["state"]) for n in doc["nodes"]] == [("gpu-a", "active"),
                                                              ("gpu-b", "draining")]
    r.flushdb()                                          # the Redis came back empty
    res = run("import", str(backup))
    assert res.exit_code == 0 and "imported 2 node(s)" in res.output, res.output
    a, b = registry.get_node(r, "gpu-a"), registry.get_node(r, "gpu-b")
    assert (a.weight, a.max_concurrency, a.models, a.url) == (2.5, 8, ["qwen"],
                                                               "http://127.0.0.1:9001")
    assert b.kind == "tgi" and registry.get_state(r, "gpu-b").state == "draining"
    assert registry.get_state(r, "gpu-a").state == "active"

    # registered nodes are kept unless --overwrite
    assert run("edit", "gpu-a", "--weight", "1").exit_code == 0
    assert run("undrain", "gpu-b").exit_code == 0
    res = run("import", str(backup))
    assert res.exit_code == 0 and "2 already registered (kept" in res.output
    assert registry.get_node(r, "gpu-a").weight == 1.0
    res = run("import", "--overwrite", str(backup))
    assert res.exit_code == 0 and "replaced 2" in res.output, res.output
    assert registry.get_node(r, "gpu-a").weight == 2.5
    assert registry.get_state(r, "gpu-b").state == "draining"

    # a bad entry refuses the whole file, naming it; nothing is written
    r.flushdb()
    bad = {**doc, "nodes": [doc["nodes"][0], {**doc["nodes"][1], "weight": -1}]}
    backup.write_text(json.dumps(bad))
    res = run("import", str(backup))
    assert res.exit_code == 1 and "nodes[1]" in res.output and "weight" in res.output
    assert registry.list_nodes(r) == []
    backup.write_text('{"nodes": []}')
    res = run("import", str(backup))
    assert res.exit_code == 1 and "not an export of infergate nodes" in res.output
    backup.write_text("{")
    res = run("import", str(backup))
    assert res.exit_code == 1 and "not JSON" in res.output

    # a node whose URL another registered node has is skipped with the reason (exit 1)
    assert run("add", "other", "http://127.0.0.1:9001").exit_code == 0
    backup.write_text(json.dumps(doc))
    res = run("import", str(backup))
    assert res.exit_code == 1 and "skipped gpu-a:" in res.output, res.output
    assert registry.get_node(r, "gpu-b") is not None and registry.get_node(r, "gpu-a") is None


def test_add_warns_when_nothing_answers_at_the_url(run, r):
    """A node added where nothing listens is registered, with a warning that it shows
    down until it answers; one where something accepts connections gets none."""
    import socket

    from controlplane import procs

    port = procs.free_port()
    res = run("add", "later", f"http://127.0.0.1:{port}")
    assert res.exit_code == 0 and "added later" in res.output
    assert f"warning: nothing answers at 127.0.0.1:{port} now" in res.output
    assert registry.get_node(r, "later") is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        there = listener.getsockname()[1]
        res = run("add", "there", f"http://127.0.0.1:{there}")
    assert res.exit_code == 0, res.output
    assert "warning: nothing answers" not in res.output
