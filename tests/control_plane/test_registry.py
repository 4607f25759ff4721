"""Node registry, node states and events against a real redis-server."""

import pytest

from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.config import NodeSettings


def node(name: str, port: int | None = None, **kw) -> NodeSettings:
    """A node on its own server: port 9000 + the name's first letter unless given."""
    port = port if port is not None else 9000 + ord(name[0]) - ord("a")
    return NodeSettings(name=name, url=f"http://127.0.0.1:{port}", **kw)


def test_seed_keeps_runtime_edits(redis_server):
    r = redis_server.client()
    assert registry.seed_nodes(r, [node("a"), node("b")]) == 2
    registry.put_node(r, node("a", 9100, weight=3))
    # A restart seeds again from the file: the edit of "a" survives, nothing is duplicated.
    assert registry.seed_nodes(r, [node("a"), node("b")]) == 0
    nodes = {n.name: n for n in registry.list_nodes(r)}
    assert nodes["a"].url.endswith(":9100") and nodes["a"].weight == 3
    assert sorted(nodes) == ["a", "b"]


def test_seed_never_brings_back_a_node_removed_at_run_time(redis_server):
    r = redis_server.client()
    assert registry.seed_nodes(r, [node("a"), node("b")]) == 2
    assert registry.remove_node(r, "b")
    # the next start: "b" is still in the file, and stays removed; "c" is new there
    assert registry.seed_nodes(r, [node("a"), node("b"), node("c")]) == 1
    assert [n.name for n in registry.list_nodes(r)] == ["a", "c"]
    # added again at run time, it is back
    registry.put_node(r, node("b"))
    assert registry.seed_nodes(r, [node("a"), node("b"), node("c")]) == 0
    assert [n.name for n in registry.list_nodes(r)] == ["a", "b", "c"]
    # a Redis that lost its data: everything in the file is seeded again
    r.flushdb()
    assert registry.seed_nodes(r, [node("a"), node("b")]) == 2


def test_remove_deletes_state_and_metrics(redis_server):
    r = redis_server.client()
    registry.put_node(r, node("a"))
    registry.set_state(r, "a", "draining", actor="t")
    r.set(keynames.node_metrics("a"), "{}")
    assert registry.remove_node(r, "a") is True
    assert registry.get_node(r, "a") is None
    assert registry.get_state(r, "a").state == "active"
    assert not r.exists(keynames.node_metrics("a"))
    assert registry.remove_node(r, "a") is False


def test_states(redis_server):
    r = redis_server.client()
    assert registry.get_state(r, "x").state == "active"
    st = registry.set_state(r, "x", "draining", actor="admin", now=100.0)
    assert (st.state, st.since, st.actor) == ("draining", 100.0, "admin")
    assert registry.get_states(r)["x"] == st
    with pytest.raises(ValueError):
        registry.set_state(r, "x", "paused")  # type: ignore[arg-type]
    r.hset(keynames.NODE_STATES, "junk", "not json")
    assert "junk" not in registry.get_states(r)


def test_invalid_registry_entry_is_skipped(redis_server):
    r = redis_server.client()
    registry.put_node(r, node("good"))
    r.hset(keynames.NODES, "bad", '{"name": "bad", "url": "ftp://x"}')
    assert [n.name for n in registry.list_nodes(r)] == ["good"]


def test_events_newest_first_filter_and_cap(redis_server):
    r = redis_server.client()
    for i in range(5):
        registry.add_event(r, "drain", node="a" if i % 2 == 0 else "b", actor="admin", detail={"i": i})
    ev = registry.recent_events(r, count=10)
    assert [e["detail"]["i"] for e in ev] == [4, 3, 2, 1, 0]
    assert all(e["kind"] == "drain" and e["actor"] == "admin" for e in ev)
    only_b = registry.recent_events(r, count=10, node="b")
    assert [e["detail"]["i"] for e in only_b] == [3, 1]
    for i in range(300):
        registry.add_event(r, "x", maxlen=100)
    # Approximate trimming keeps the stream near its cap, never unbounded.
    assert r.xlen(keynames.EVENTS) < 250


def test_seed_skips_a_configured_node_whose_server_is_registered(redis_server, caplog):
    r = redis_server.client()
    registry.put_node(r, node("runtime", 8000))
    # the file names the same server (another spelling) under another name: not added
    assert registry.seed_nodes(r, [NodeSettings(name="file", url="HTTP://127.0.0.1:8000/"),
                                   node("other", 8001)]) == 1
    assert [n.name for n in registry.list_nodes(r)] == ["other", "runtime"]
    assert "configured node file not added" in caplog.text


def test_put_node_unique_is_one_transaction(redis_server):
    """Writers racing to register one server under two names: exactly one wins."""
    import threading

    for i in range(10):
        r = redis_server.client()
        r.flushdb()
        registry.put_node(r, node("a", 9100))
        registry.put_node(r, node("b", 9200))
        results: list[str] = []
        start = threading.Barrier(2)

        def move(name: str) -> None:
            c = redis_server.client()
            start.wait()
            try:
                registry.put_node_unique(c, node(name, 9300 + i))
                results.append("ok")
            except registry.UrlTaken:
                results.append("taken")

        ts = [threading.Thread(target=move, args=(n,)) for n in ("a", "b")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert sorted(results) == ["ok", "taken"]
        urls = [n.url for n in registry.list_nodes(r)]
        assert len(set(urls)) == 2, urls


@pytest.mark.parametrize("a,b,same", [
    ("http://127.0.0.1:8000", "HTTP://127.0.0.1:8000/", True),
    ("http://127.0.0.1:8000", "http://127.1:8000", True),
    ("http://127.0.0.1:8000", "http://0x7f000001:8000", True),
    ("http://127.0.0.1:8000", "http://2130706433:8000", True),   # one number, as curl reads it
    ("http://127.0.0.1:8000", "http://017700000001:8000", True),  # octal
    ("http://10.0.0.5:8000", "http://167772165:8000", True),
    ("http://127.0.0.1:8000", "http://2130706434:8000", False),
    ("http://127.0.0.1:8000", "http://1gpu:8000", False),          # a name starting with a digit
    ("http://127.0.0.1:8000", "http://127.000.000.001:8000", True),
    ("http://127.0.0.1:8000", "http://[::ffff:127.0.0.1]:8000", True),
    ("http://10.0.0.5", "http://10.0.0.5.:80/", True),
    ("https://gpu.example.com", "https://GPU.example.com:443", True),
    ("http://127.0.0.1:8000", "http://127.0.0.2:8000", False),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8001", False),
    ("http://127.0.0.1:8000", "https://127.0.0.1:8000", False),
    ("http://localhost:8000", "http://127.0.0.1:8000", True),  # the loopback name
    ("http://LOCALHOST.:8000", "http://[::ffff:127.0.0.1]:8000", True),
    ("http://gpu-1:8000", "http://127.0.0.1:8000", False),  # other names are not resolved
])
def test_same_server(a, b, same):
    assert registry.same_server(a, b) is same
    assert registry.same_server(b, a) is same


def test_a_restart_of_up_keeps_run_time_edits_and_removals_of_the_simulated_pool(redis_server):
    """``infergate up`` on the same folder: simulated nodes (a node is its name) get this
    start's URL and keep their edits; one removed at run time stays removed; a node added
    at run time stays, with a note."""
    r = redis_server.client()
    first = registry.seed_run_nodes(r, [node("a"), node("b"), node("c")], by_url=False)
    assert [n.name for n in first.nodes] == ["a", "b", "c"] and first.notes == []
    registry.put_node(r, node("a", weight=4, max_concurrency=10))   # edited
    assert registry.remove_node(r, "b")                              # removed
    registry.put_node(r, node("x", 9500))                            # added at run time
    again = registry.seed_run_nodes(r, [node("a", 9200), node("b", 9201), node("c", 9202)],
                                    by_url=False)
    got = {n.name: n for n in registry.list_nodes(r)}
    assert sorted(got) == ["a", "c", "x"]
    assert got["a"].url.endswith(":9200") and got["a"].weight == 4 and got["a"].max_concurrency == 10
    assert got["c"].url.endswith(":9202")
    assert [n.name for n in again.nodes] == ["a", "c"]
    assert any("node b was removed at run time: not added again" in x for x in again.notes)
    assert any(x.startswith("node x (") and "stays registered" in x for x in again.notes)
    # the next start does not even start the removed one
    assert registry.removed_at_run_time(r, ["a", "b", "c", "new"]) == {"b"}


def test_a_restart_of_up_with_node_urls_keeps_each_server_as_registered(redis_server):
    """``--node URL`` (a node is its server): a server registered under another name
    keeps that name and its settings (with the options the command line gives); a new
    server gets the run's name or the next free one; one removed at run time that the
    command line names again is added again; the others stay, with a note."""
    r = redis_server.client()
    registry.seed_run_nodes(r, [node("node-1", 8600)], by_url=True)
    registry.put_node(r, node("node-1", 8600, weight=3))
    registry.put_node(r, node("node-2", 8601))                       # added at run time
    again = registry.seed_run_nodes(r, [node("node-1", 8601), node("node-2", 8602)],
                                    by_url=True, overrides={"max_concurrency": 2})
    got = {n.name: n for n in registry.list_nodes(r)}
    assert [(n.name, n.url[-4:]) for n in again.nodes] == [("node-2", "8601"), ("node-3", "8602")]
    assert got["node-2"].max_concurrency == 2
    assert got["node-1"].url.endswith(":8600") and got["node-1"].weight == 3
    assert any("is registered as node node-2" in x for x in again.notes)
    assert any(x.startswith("node node-1 (") and "stays registered" in x for x in again.notes)
    assert registry.remove_node(r, "node-3")
    back = registry.seed_run_nodes(r, [node("node-1", 8602)], by_url=True)
    assert [(n.name, n.url[-4:]) for n in back.nodes] == [("node-3", "8602")]
    assert any("was removed at run time: added again" in x for x in back.notes)


def test_a_configured_node_refused_for_its_server_is_tried_again_once_the_server_is_free(
        redis_server, caplog):
    """The control plane's seeding: file-c names the server of a node registered at run
    time, so it is not added; once that node is removed, the next start adds file-c
    (it was never registered, so it was not removed at run time)."""
    r = redis_server.client()
    registry.put_node(r, node("rt-node", 9))
    assert registry.seed_nodes(r, [node("file-c", 9)]) == 0
    assert "configured node file-c not added" in caplog.text
    assert registry.seed_nodes(r, [node("file-c", 9)]) == 0   # still taken
    assert registry.remove_node(r, "rt-node")
    assert registry.seed_nodes(r, [node("file-c", 9)]) == 1
    assert [n.name for n in registry.list_nodes(r)] == ["file-c"]
    # registered now: removed at run time, it stays removed
    assert registry.remove_node(r, "file-c")
    assert registry.seed_nodes(r, [node("file-c", 9)]) == 0
    assert registry.list_nodes(r) == []


def test_a_node_of_up_refused_for_its_server_is_registered_once_the_server_is_free(redis_server):
    """``infergate up`` with the file's nodes: the same, with its notes."""
    r = redis_server.client()
    registry.put_node(r, node("rt-node", 9))
    first = registry.seed_run_nodes(r, [node("file-c", 9)], by_url=False)
    assert first.nodes == []
    assert any(x.startswith("node file-c not registered: http://127.0.0.1:9 is already "
                            "registered as node 'rt-node'") for x in first.notes), first.notes
    assert registry.remove_node(r, "rt-node")
    again = registry.seed_run_nodes(r, [node("file-c", 9)], by_url=False)
    assert [n.name for n in again.nodes] == ["file-c"], again.notes
    assert not any("removed at run time" in x for x in again.notes), again.notes
    assert registry.remove_node(r, "file-c")
    third = registry.seed_run_nodes(r, [node("file-c", 9)], by_url=False)
    assert third.nodes == [] and any("node file-c was removed at run time: not added again" in x
                                     for x in third.notes)


def test_a_node_registered_under_its_name_at_run_time_counts_as_seeded(redis_server):
    r = redis_server.client()
    registry.put_node(r, node("a", weight=3))           # added at run time, same name
    assert registry.seed_nodes(r, [node("a")]) == 0
    assert registry.get_node(r, "a").weight == 3
    assert registry.remove_node(r, "a")
    assert registry.seed_nodes(r, [node("a")]) == 0     # removed at run time: stays out


def test_file_settings_the_registry_overrides_get_one_line_per_node():
    file_nodes = [node("file-a", 9001), node("file-b", 9002, weight=2.0),
                  node("file-c", 9003, weight=2.0, max_concurrency=8), node("file-d", 9004)]
    registered = [node("file-a", 9001), node("file-b", 9002), node("file-c", 9100)]
    lines = registry.file_drift(file_nodes, registered)
    assert lines == [
        "node file-b: the file says weight 2.0, the registry keeps 1.0 (changed at run time "
        "or seeded before); edit it with `infergate nodes edit` or the admin page",
        "node file-c: the file says url http://127.0.0.1:9003, weight 2.0, max_concurrency 8; "
        "the registry keeps url http://127.0.0.1:9100, weight 1.0, max_concurrency 64 (changed "
        "at run time or seeded before); edit it with `infergate nodes edit` or the admin page",
    ]
    assert registry.file_drift(file_nodes, registered, skip=("url",))[1].startswith(
        "node file-c: the file says weight 2.0, max_concurrency 8; the registry keeps weight")


def test_up_and_the_control_plane_say_which_file_settings_the_registry_overrides(
        redis_server, caplog):
    from controlplane.config import Settings
    from controlplane.routing.service import ControlPlane

    r = redis_server.client()
    registry.seed_run_nodes(r, [node("file-a", 9001), node("file-b", 9002)], by_url=False, from_file=True)
    # the file is edited before the next start: up applies its URL, keeps the registry's rest
    again = registry.seed_run_nodes(r, [node("file-a", 9200), node("file-b", 9002, weight=2.0)],
                                    by_url=False, from_file=True)
    assert [x for x in again.notes if "the file says" in x] == [
        "node file-b: the file says weight 2.0, the registry keeps 1.0 (changed at run time "
        "or seeded before); edit it with `infergate nodes edit` or the admin page"]
    assert registry.get_node(r, "file-b").weight == 1.0
    # the simulated pool is not a file: no such line
    sim = registry.seed_run_nodes(r, [node("file-b", 9002, weight=2.0)], by_url=False)
    assert not any("the file says" in x for x in sim.notes)
    # the control plane started on that file logs the same line once
    settings = Settings.model_validate({"redis": {"url": redis_server.url},
                                        "nodes": [node("file-a", 9200).model_dump(),
                                                  node("file-b", 9002, weight=2.0).model_dump()]})
    cp = ControlPlane(settings, r)
    try:
        assert cp._read_registry()
        assert cp._read_registry()
    finally:
        cp.shutdown()
    found = [m for m in caplog.messages if "the file says" in m]
    assert found == ["node file-b: the file says weight 2.0, the registry keeps 1.0 (changed "
                     "at run time or seeded before); edit it with `infergate nodes edit` or "
                     "the admin page"]


def test_a_configured_name_equal_to_a_registered_one_but_for_case_is_not_added(redis_server,
                                                                            caplog):
    r = redis_server.client()
    registry.put_node(r, node("sim-fast", 9001))
    assert registry.seed_nodes(r, [node("SIM-FAST", 9002)]) == 0
    assert "configured node SIM-FAST not added: a node named 'sim-fast' already exists" \
        in caplog.text
    assert [n.name for n in registry.list_nodes(r)] == ["sim-fast"]
