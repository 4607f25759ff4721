"""Concurrent changes to one node through the admin API (real redis-server, one Flask
test client per thread, the calls released together by a barrier, many trials): a
removal never loses to an edit or a drain that checked the node before it, and two
edits of different fields both survive."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from controlplane.admin import create_app
from controlplane.config import Settings
from controlplane.redisdb import keynames
from controlplane.routing import registry

TOKEN = "race-admin-token-789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRIALS = 60


@pytest.fixture
def app(r):
    return create_app(Settings.model_validate({"controlplane": {"admin_token": TOKEN}}), r)


def together(calls: list[Callable[[], object]]) -> list[object]:
    """Run the calls in threads released at once; their results in order."""
    start = threading.Barrier(len(calls))
    out: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _add(c, name: str) -> None:
    resp = c.post("/api/v1/nodes", json={"name": name, "url": "http://127.0.0.1:9"},
                  headers=AUTH)
    assert resp.status_code == 201, resp.get_json()


@pytest.mark.parametrize("change", [
    ("patch", "/api/v1/nodes/zz", {"weight": 2}),
    ("post", "/api/v1/nodes/zz/drain", None),
    ("post", "/api/v1/nodes/zz/undrain", None),
])
def test_a_removal_racing_an_edit_or_a_drain_leaves_nothing_behind(app, r, change):
    method, path, body = change
    clients = [app.test_client(), app.test_client()]
    for _ in range(TRIALS):
        _add(clients[0], "zz")
        if path.endswith("undrain"):
            registry.set_state(r, "zz", "drained")
        deleted, changed = together([
            lambda: clients[0].delete("/api/v1/nodes/zz", headers=AUTH),
            lambda: getattr(clients[1], method)(path, json=body, headers=AUTH),
        ])
        assert deleted.status_code == 200, deleted.get_json()
        assert changed.status_code in (200, 404), changed.get_json()
        # DELETE answered 200: the node is gone, with its state, whatever the other did
        assert registry.get_node(r, "zz") is None, f"{method} {path}: node resurrected"
        assert r.hget(keynames.NODE_STATES, "zz") is None, f"{method} {path}: state left"
        # a node added again under the name starts afresh (active)
        _add(clients[0], "zz")
        assert registry.get_state(r, "zz").state == "active"
        assert clients[0].delete("/api/v1/nodes/zz", headers=AUTH).status_code == 200


def test_two_edits_of_different_fields_both_survive(app, r):
    clients = [app.test_client(), app.test_client()]
    _add(clients[0], "x1")
    for i in range(TRIALS):
        w, m = 1.0 + (i + 1) / 100, 2 + i
        a, b = together([
            lambda: clients[0].patch("/api/v1/nodes/x1", json={"weight": w}, headers=AUTH),
            lambda: clients[1].patch("/api/v1/nodes/x1", json={"max_concurrency": m},
                                     headers=AUTH),
        ])
        assert a.status_code == 200 and b.status_code == 200
        node = registry.get_node(r, "x1")
        assert (node.weight, node.max_concurrency) == (w, m), f"trial {i}: a change was lost"


def test_two_removals_one_is_404(app, r):
    clients = [app.test_client(), app.test_client()]
    for _ in range(TRIALS // 2):
        _add(clients[0], "zz")
        a, b = together([lambda: clients[0].delete("/api/v1/nodes/zz", headers=AUTH),
                         lambda: clients[1].delete("/api/v1/nodes/zz", headers=AUTH)])
        assert sorted([a.status_code, b.status_code]) == [200, 404]
        assert [e["kind"] for e in registry.recent_events(r, 2)].count("node_remove") == 1
