"""The control plane writes back the state it last read when Redis loses it
(controlplane/routing/statecopy.py): API keys with their revocations, nodes with their
weights, nodes added at run time, drain states; never a key revoked or a node removed
before the loss. Real redis-server (without persistence, as a shared Redis may run),
cycles driven directly, nodes that do not answer (their polls fail at once)."""

from __future__ import annotations

import json
import logging
import time

import pytest

from controlplane import procs
from controlplane.admin import apikeys, ops
from controlplane.config import NodeSettings
from controlplane.redisdb import keynames
from controlplane.routing import keycopies, registry, statecopy
from controlplane.routing.service import ControlPlane, make_client
from support.controlplane import cp_settings

pytestmark = pytest.mark.integration


def _node(name: str) -> NodeSettings:
    return NodeSettings(name=name, url=f"http://127.0.0.1:{procs.free_port()}")


@pytest.fixture
def cps():
    made: list[ControlPlane] = []

    def make(*args, **kw) -> ControlPlane:
        cp = ControlPlane(*args, **kw)
        made.append(cp)
        return cp

    try:
        yield make
    finally:
        for cp in made:
            cp.shutdown()


def _events(r, kind: str) -> list[dict]:
    return [e for e in registry.recent_events(r, 200) if e["kind"] == kind]


def test_redis_back_empty_gets_the_state_back(redis_server, workdir, cps, caplog) -> None:
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    a, gone = _node("a"), _node("gone")
    cp = cps(cp_settings([a, gone]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    cp.run_cycle()
    # run-time changes: a weight, a node added, a drain, a configured node removed
    registry.put_node(r, a.model_copy(update={"weight": 3.0}))
    added = _node("added")
    registry.put_node(r, added)
    registry.set_state(r, "added", "draining", actor="test")
    registry.remove_node(r, "gone")
    valid, valid_rec = apikeys.create_key(r, "acme", rpm=60)
    revoked, revoked_rec = apikeys.create_key(r, "acme")
    apikeys.revoke_key(r, revoked_rec.id)
    cp.run_cycle()
    late, late_rec = apikeys.create_key(r, "acme")
    apikeys.revoke_key(r, late_rec.id)         # revoked after the copy had it valid
    apikeys.revoke_key(r, valid_rec.id)
    valid2, valid2_rec = apikeys.create_key(r, "acme")
    cp.run_cycle()

    redis_server.stop()
    assert not cp.run_cycle().redis_ok
    redis_server.start_again(workdir / "redis")   # empty: nothing was persisted
    rep = cp.run_cycle()
    assert rep.redis_ok and rep.wrote

    nodes = {n.name: n for n in registry.list_nodes(r)}
    assert set(nodes) == {"a", "added"}, "the removed node stays removed"
    assert nodes["a"].weight == 3.0
    assert registry.get_states(r)["added"].state in ("draining", "drained")
    assert apikeys.lookup(r, valid2).id == valid2_rec.id
    assert apikeys.lookup(r, valid) is None and apikeys.get_key(r, valid_rec.id).revoked
    assert apikeys.lookup(r, revoked) is None and apikeys.get_key(r, revoked_rec.id).revoked
    assert apikeys.lookup(r, late) is None and apikeys.get_key(r, late_rec.id).revoked
    assert apikeys.get_key(r, valid2_rec.id).rpm is None
    assert not apikeys.store_missing(r) and cp.apikeys_missing is False
    assert "REDIS STATE LOST" in caplog.text and "REDIS STATE RESTORED" in caplog.text
    (lost,) = _events(r, "state_lost")
    assert lost["detail"]["restored"]["apikeys"] == 4
    (restored,) = _events(r, "state_restored")
    assert restored["detail"]["apikeys"] == 4 and restored["detail"]["revoked"] == 3
    assert restored["detail"]["nodes"] == 2 and restored["detail"]["states"] == 1
    assert cp.state_losses == 1 and cp.state_restores == 1
    # the snapshot the edges read holds the restored registry
    snap = json.loads(r.get(keynames.ROUTING))
    assert {n["name"]: n["weight"] for n in snap["nodes"]} == {"a": 3.0, "added": 1.0}
    # nothing more written back by the next cycles
    cp.run_cycle()
    assert len(_events(r, "state_restored")) == 1 and cp.state_restores == 1


def test_what_was_written_after_the_loss_is_kept(redis_server, workdir, cps) -> None:
    """A key created and a node edited after Redis came back, before the control plane's
    next cycle, stay as they are; the copy fills in the rest."""
    a = _node("a")
    cp = cps(cp_settings([a]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    old, old_rec = apikeys.create_key(r, "acme")
    cp.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")
    new, new_rec = apikeys.create_key(r, "acme")
    registry.put_node(r, a.model_copy(update={"weight": 5.0}))
    cp.run_cycle()
    assert apikeys.lookup(r, old).id == old_rec.id
    assert apikeys.lookup(r, new).id == new_rec.id
    assert registry.get_node(r, "a").weight == 5.0


def test_key_store_lost_alone_is_written_back(redis_server, cps, caplog) -> None:
    """The key store gone while the state marker stayed (a Redis Cluster shard without
    replica, an eviction): the keys come back the same way."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme")
    cp.run_cycle()
    r.delete(keynames.APIKEYS, keynames.APIKEY_IDS, keynames.APIKEYS_MARKER)
    cp.run_cycle()
    assert apikeys.lookup(r, key).id == rec.id and not apikeys.store_missing(r)
    assert "REDIS STATE LOST in part: apikeys" in caplog.text
    assert _events(r, "state_restored")[0]["detail"]["apikeys"] == 1
    assert not _events(r, "state_lost")


def test_a_registry_evicted_alone_is_written_back(redis_server, cps, caplog) -> None:
    """The node registry's hash evicted (``maxmemory-policy allkeys-lru``) while the
    seeded names, the generation and the state marker stayed: not taken for a removal of
    every node (nothing would seed them again), the copy is written back. Nodes removed
    for real (a write, which moves the generation) stay removed."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    cp = cps(cp_settings([_node("a"), _node("b")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    cp.run_cycle()
    registry.put_node(r, _node("added"))
    cp.run_cycle()
    r.delete(keynames.NODES)
    cp.run_cycle()
    cp.run_cycle()
    assert {n.name for n in registry.list_nodes(r)} == {"a", "b", "added"}
    assert "REDIS STATE LOST in part: registry" in caplog.text
    assert _events(r, "state_restored")[0]["detail"]["nodes"] == 3

    for name in ("a", "b", "added"):
        registry.remove_node(r, name)
    cp.run_cycle()
    cp.run_cycle()
    assert registry.list_nodes(r) == []


def test_a_key_store_evicted_without_its_marker_is_written_back(redis_server, cps,
                                                                caplog) -> None:
    """The key store's hash evicted while its marker stayed (the edges then refuse every
    key as deleted): the copy is written back."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme")
    cp.run_cycle()
    r.delete(keynames.APIKEYS)
    assert not apikeys.store_missing(r)
    cp.run_cycle()
    found = apikeys.lookup(r, key)
    assert found is not None and found.id == rec.id
    assert "REDIS STATE LOST in part: apikeys" in caplog.text


def test_a_second_control_plane_notices_the_loss_and_adds_nothing_twice(
        redis_server, cps) -> None:
    """Two control planes: the first to find Redis empty writes its copy back; the other
    sees the state marker created anew (another value), counts the loss, and finds
    nothing left to write."""
    first = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    second = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme")
    first.run_cycle()
    second.run_cycle()
    r.flushall()
    second.run_cycle()
    first.run_cycle()
    assert apikeys.lookup(r, key) is not None
    assert first.state_losses == 1 and second.state_losses == 1
    assert second.state_restores == 1 and first.state_restores == 0
    assert len(_events(r, "state_restored")) == 1
    # the first's event says the other wrote its copy back, not that keys must be restored
    by = {e["detail"]["by"]: e["detail"]["message"] for e in _events(r, "state_lost")}
    assert "another control plane wrote its copy back" in by[first.id], by
    assert "must be restored" not in by[first.id] and "written back" in by[second.id]


def test_redis_back_empty_after_a_long_outage_gets_the_state_back(redis_server, workdir,
                                                                  cps) -> None:
    """Redis away for a minute (a reboot, a Redis without persistence restarted late)
    comes back empty: the control plane tried it every cycle meanwhile, so its copy,
    read just before Redis stopped answering, is as new as the state was (nothing could
    change it in a Redis that was down) and is written back, however long the outage."""
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    cp.run_cycle()                                # seeds the configured node
    key, _ = apikeys.create_key(r, "acme")
    registry.put_node(r, _node("added"))
    registry.set_state(r, "a", "draining", actor="test")
    cp.run_cycle()
    redis_server.stop()
    assert not cp.run_cycle().redis_ok
    # a minute passed: the copy was read, and Redis stopped answering, 60 s ago
    c = cp.keeper.copy
    c.registry_at -= 60
    c.apikeys_at -= 60
    cp.redis_unreachable_since -= 60
    redis_server.start_again(workdir / "redis")   # empty: nothing was persisted
    cp.run_cycle()
    assert cp.state_restores == 1
    assert {n.name for n in registry.list_nodes(r)} == {"a", "added"}
    assert registry.get_state(r, "a").state in ("draining", "drained")
    assert apikeys.lookup(r, key) is not None


def test_a_control_plane_that_notices_the_loss_late_writes_nothing_back(redis_server,
                                                                         cps) -> None:
    """One restore per loss: after the first control plane wrote its copy back, the
    operators remove a node and add another under a removed name; a second control plane
    that notices the same loss only now (it was frozen) writes none of its older copy."""
    conf = [_node("a")]
    first = cps(cp_settings(conf), make_client(redis_server.url, 0.5))
    late = cps(cp_settings(conf), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    extra = _node("extra")
    registry.put_node(r, extra)
    registry.set_state(r, "a", "draining", actor="test")
    first.run_cycle()
    late.run_cycle()
    r.flushall()
    first.run_cycle()                                   # the restore
    assert {n.name for n in registry.list_nodes(r)} == {"a", "extra"}
    registry.remove_node(r, "extra")                    # the operators move on
    registry.remove_node(r, "a")
    registry.put_node(r, _node("a"))
    late.run_cycle()
    assert {n.name for n in registry.list_nodes(r)} == {"a"}, "the removed node came back"
    assert "a" not in registry.get_states(r), "the re-added node was drained again"
    assert late.state_losses == 1 and late.state_restores == 0
    assert len(_events(r, "state_restored")) == 1


def test_a_copy_never_makes_one_server_two_nodes(redis_server, workdir, cps, caplog) -> None:
    """A control plane restarted while Redis was down has no copy and seeds the
    configuration's nodes when Redis comes back empty; the copy of another, which had
    the configured node removed and its server added under a new name, does not add
    that second name for the same server."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    n1, n2 = _node("n1"), _node("n2")
    holder = cps(cp_settings([n1, n2]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    holder.run_cycle()
    registry.remove_node(r, "n1")
    registry.put_node(r, NodeSettings(name="n1b", url=n1.url))
    holder.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")
    fresh = cps(cp_settings([n1, n2]), make_client(redis_server.url, 0.5))
    fresh.run_cycle()                                   # no copy: seeds n1 and n2
    holder.run_cycle()
    urls = [n.url for n in registry.list_nodes(r)]
    assert len(urls) == len(set(urls)), registry.list_nodes(r)
    assert holder.state_restores == 1
    assert "their server or name is another node's now: n1b" in caplog.text


def test_a_control_plane_without_a_copy_restores_nothing(redis_server, cps) -> None:
    """A control plane started on an empty Redis has seen nothing: no loss, nothing
    written back (the configured nodes are seeded)."""
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    cp.run_cycle()
    r = redis_server.client()
    assert [n.name for n in registry.list_nodes(r)] == ["a"]
    assert cp.state_losses == 0 and not _events(r, "state_restored")
    assert apikeys.store_missing(r)


def test_the_copy_is_not_taken_from_a_store_whose_marker_went(redis_server) -> None:
    """Redis loses the key store between two reads: the copy keeps the keys it held."""
    r = redis_server.client()
    keeper = statecopy.StateKeeper(r)
    r.set(keynames.STATE_MARKER, "{}")
    key, _ = apikeys.create_key(r, "acme")
    keeper.read()
    assert keeper.copy is not None and len(keeper.copy.apikeys) == 1
    r.delete(keynames.APIKEYS, keynames.APIKEY_IDS, keynames.APIKEYS_MARKER)
    assert keeper.read().lost == {statecopy.APIKEYS}
    assert len(keeper.copy.apikeys) == 1
    r.flushall()                     # the state marker gone too: nothing copied
    assert keeper.read().lost == set()
    assert len(keeper.copy.apikeys) == 1
    assert keeper.restore().apikeys == 1
    assert apikeys.lookup(r, key) is not None


def test_changes_after_an_older_snapshot_are_put_back(redis_server, workdir, cps,
                                                     caplog) -> None:
    """Redis restarted from a snapshot taken before some changes (``SAVE``, then a
    restart that loads that dump.rdb, as after a crash with the default save points)
    holds the state of the snapshot, markers and all: the control plane, whose copy
    holds the changes, writes them back in its next cycle -- a node added, edited and
    removed, a drain, a key created and one revoked -- says so and records it once."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    a, b, gone = _node("a"), _node("b"), _node("gone")
    cp = cps(cp_settings([a, b, gone]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    bad, bad_rec = apikeys.create_key(r, "acme")
    good, good_rec = apikeys.create_key(r, "acme")
    cp.run_cycle()
    r.save()                                            # the older snapshot
    apikeys.revoke_key(r, bad_rec.id)
    new, new_rec = apikeys.create_key(r, "acme", rpm=30)
    registry.set_state(r, "b", "draining", actor="test")
    registry.put_node(r, a.model_copy(update={"weight": 4.0}))
    added = _node("added")
    registry.put_node(r, added)
    registry.remove_node(r, "gone")
    cp.run_cycle()                                      # the copy sees the changes
    redis_server.stop()
    redis_server.start_again(workdir / "redis")         # back from the snapshot
    assert apikeys.lookup(r, bad).id == bad_rec.id      # as the snapshot was
    assert apikeys.lookup(r, new) is None
    assert "gone" in {n.name for n in registry.list_nodes(r)}
    cp.run_cycle()
    assert apikeys.lookup(r, bad) is None and apikeys.get_key(r, bad_rec.id).revoked
    assert apikeys.lookup(r, new).rpm == 30
    assert apikeys.lookup(r, good).id == good_rec.id
    nodes = {n.name: n for n in registry.list_nodes(r)}
    assert set(nodes) == {"a", "b", "added"}, "the removed node is removed again"
    assert nodes["a"].weight == 4.0
    assert registry.get_states(r)["b"].state in ("draining", "drained")  # idle: may finish
    assert not apikeys.store_missing(r)
    assert "REDIS STATE WENT BACK" in caplog.text and "gone" in caplog.text
    cp.run_cycle()                                      # events are written by the cycle
    evs = {e["detail"]["group"]: e["detail"] for e in _events(r, "state_went_back")}
    assert set(evs) == {statecopy.REGISTRY, statecopy.APIKEYS}, evs
    assert evs[statecopy.REGISTRY]["removed"] == ["gone"]
    assert {"a", "added"} <= set(evs[statecopy.REGISTRY]["written"])
    assert evs[statecopy.REGISTRY]["states"] == ["b"]
    assert set(evs[statecopy.APIKEYS]["written"]) == {bad_rec.id, new_rec.id}
    assert not _events(r, "state_lost")                 # nothing was lost: it went back
    registry.set_state(r, "b", "active", actor="test")  # later changes read as usual
    cp.run_cycle()
    cp.run_cycle()
    assert len(_events(r, "state_went_back")) == 2
    assert registry.get_states(r)["b"].state == "active"


def test_one_control_plane_puts_the_state_back(redis_server, workdir, cps) -> None:
    """Two control planes read the same changes, then Redis goes back: one writes its
    copy back; the other, reading after it, finds the state as its copy holds it and
    writes nothing (one event per group)."""
    a = _node("a")
    one = cps(cp_settings([a]), make_client(redis_server.url, 0.5))
    two = cps(cp_settings([a]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    one.run_cycle()
    two.run_cycle()
    r.save()
    registry.set_state(r, "a", "drained", actor="test")
    one.run_cycle()
    two.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")
    assert registry.get_state(r, "a").state == "active"
    one.run_cycle()
    two.run_cycle()
    one.run_cycle()
    assert registry.get_state(r, "a").state == "drained"
    assert one.state_restores + two.state_restores == 1
    assert len(_events(r, "state_went_back")) == 1


def test_a_lost_state_written_back_does_not_read_as_gone_back(redis_server, workdir,
                                                              cps) -> None:
    """After Redis came back empty and the copy was written back, the generations are
    at least the copy's: the next cycles find nothing gone back, and a change made
    after the restore stays."""
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    cp.run_cycle()
    for _ in range(3):
        apikeys.create_key(r, "acme")
        registry.set_state(r, "a", "draining", actor="test")
    cp.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")         # empty: nothing was persisted
    cp.run_cycle()
    assert cp.state_restores == 1
    registry.set_state(r, "a", "active", actor="test")
    cp.run_cycle()
    cp.run_cycle()
    assert cp.state_restores == 1 and not _events(r, "state_went_back")
    assert registry.get_state(r, "a").state == "active"


def test_a_key_made_active_by_hand_is_revoked_again(redis_server, cps, caplog) -> None:
    """A revoked key's record written back active by hand (no generation change): the
    control plane, whose copy holds the revocation, revokes it again within a cycle,
    says so and records it; the other keys stay as they are."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    bad, bad_rec = apikeys.create_key(r, "acme")
    good, good_rec = apikeys.create_key(r, "acme")
    digest = apikeys.hash_key(bad)
    active = r.hget(keynames.APIKEYS, digest)
    apikeys.revoke_key(r, bad_rec.id)
    cp.run_cycle()                                      # the copy sees the revocation
    r.hset(keynames.APIKEYS, digest, active)
    apikeys.mark_written(r)
    assert apikeys.lookup(r, bad).id == bad_rec.id
    cp.run_cycle()
    assert apikeys.lookup(r, bad) is None and apikeys.get_key(r, bad_rec.id).revoked
    assert apikeys.lookup(r, good).id == good_rec.id
    assert "REDIS STATE WENT BACK" in caplog.text and bad_rec.id in caplog.text
    cp.run_cycle()
    (ev,) = _events(r, "keys_revoked_again")
    assert ev["detail"]["ids"] == [bad_rec.id]
    assert not _events(r, "state_went_back")


@pytest.mark.parametrize("operators_write", [True, False])
def test_a_copy_refused_after_a_loss_is_not_written_back_later(redis_server, cps, caplog,
                                                               operators_write) -> None:
    """A control plane frozen for 30 s notices a loss that one without a copy re-seeded:
    its copy, refused as read too long before the loss, is not written back at its next
    cycles either -- not as a store that went back (its generations are higher than the
    new Redis'), nor as a key store lost -- so the keys and nodes the operators wrote
    since stay, and nothing of the old copy comes back."""
    caplog.set_level(logging.INFO, logger="infergate.controlplane")
    conf = [_node("a")]
    late = cps(cp_settings(conf), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    registry.put_node(r, _node("extra"))
    for _ in range(3):
        registry.set_state(r, "extra", "draining", actor="test")
        registry.set_state(r, "extra", "active", actor="test")
    old = [apikeys.create_key(r, "acme")[0] for _ in range(4)]
    late.run_cycle()
    assert late.keeper.copy is not None
    late.keeper.copy.registry_at -= 30                  # frozen since
    late.keeper.copy.apikeys_at -= 30
    r.flushall()
    fresh = cps(cp_settings(conf), make_client(redis_server.url, 0.5))
    fresh.run_cycle()                                   # no copy: seeds the file's node
    new = None
    if operators_write:
        registry.put_node(r, _node("b"))
        new, _ = apikeys.create_key(r, "ops")
    for _ in range(3):
        late.run_cycle()
    names = {n.name for n in registry.list_nodes(r)}
    assert "extra" not in names, "the refused copy's node came back"
    assert all(apikeys.lookup(r, k) is None for k in old), "the refused copy's keys came back"
    if operators_write:
        assert "b" in names and apikeys.lookup(r, new) is not None
    assert "REDIS STATE WENT BACK" not in caplog.text
    assert late.state_restores == 0


def test_keys_revoked_or_created_after_an_older_snapshot_came_back_stay(
        redis_server, workdir, cps) -> None:
    """Redis back from an older snapshot; before the control plane's next cycle an
    operator revokes a leaked key and creates a new one. Keys are never deleted and a
    revocation is for good, so the put-back keeps both: the key stays revoked and the new
    key valid (the copy's keys that the snapshot lacked are written back too)."""
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    leaked, leaked_rec = apikeys.create_key(r, "acme")
    cp.run_cycle()
    r.save()                                            # the older snapshot
    later = [apikeys.create_key(r, "acme")[0] for _ in range(3)]
    cp.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")         # back from the snapshot
    apikeys.revoke_key(r, leaked_rec.id)                # the operators, at once
    fresh, fresh_rec = apikeys.create_key(r, "ops")
    cp.run_cycle()
    cp.run_cycle()
    assert all(apikeys.lookup(r, k) is not None for k in later), "the copy's keys are lost"
    assert apikeys.lookup(r, leaked) is None, "a key revoked after the restart is valid again"
    assert apikeys.get_key(r, leaked_rec.id).revoked
    assert apikeys.lookup(r, fresh) is not None, "a key created after the restart is gone"
    assert apikeys.get_key(r, fresh_rec.id) is not None


def test_an_older_snapshot_is_told_after_as_many_writes_since(redis_server, workdir,
                                                             cps) -> None:
    """Redis back from a snapshot three key writes and a node write older than the copy,
    then three keys created and two nodes written at once (its generations as high as
    the copy's again, or higher): the control plane still tells it went back by the
    write logs and puts the copy's keys and nodes back, keeping the imported keys."""
    cp = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    apikeys.create_key(r, "acme")
    cp.run_cycle()
    r.save()                                            # the older snapshot
    later = [apikeys.create_key(r, "acme")[0] for _ in range(3)]
    registry.put_node(r, _node("added"))
    cp.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")         # back from the snapshot
    fresh = [apikeys.create_key(r, "ops")[0] for _ in range(3)]
    registry.put_node(r, _node("b"))
    registry.put_node(r, _node("c"))
    cp.run_cycle()
    assert all(apikeys.lookup(r, k) is not None for k in later), "the copy's keys are lost"
    assert all(apikeys.lookup(r, k) is not None for k in fresh)
    assert "added" in {n.name for n in registry.list_nodes(r)}, "the copy's node is lost"
    assert cp.state_restores == 2
    cp.run_cycle()
    assert cp.state_restores == 2, "put back once"


def test_a_newer_copy_is_put_back_after_an_older_one(redis_server, workdir, cps) -> None:
    """Two control planes; a key created between their reads is in one copy only. Redis
    goes back; the control plane with the older copy puts it back first (its generation
    then the newer copy's): the other still tells its key is missing and puts its copy
    back; then neither writes again."""
    a = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    b = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    apikeys.create_key(r, "acme")
    a.run_cycle()
    b.run_cycle()
    r.save()
    k1, _ = apikeys.create_key(r, "acme")
    a.run_cycle()
    b.run_cycle()
    k2, _ = apikeys.create_key(r, "acme")              # in a's copy only
    a.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")
    b.run_cycle()                                      # the older copy first
    a.run_cycle()
    assert apikeys.lookup(r, k1) is not None and apikeys.lookup(r, k2) is not None
    restores = a.state_restores + b.state_restores
    for cp in (b, a, b, a):
        cp.run_cycle()
    assert a.state_restores + b.state_restores == restores
    assert apikeys.lookup(r, k2) is not None


def test_a_put_back_is_not_undone_by_a_copy_of_the_older_redis(redis_server, workdir,
                                                              cps) -> None:
    """Redis back from an older snapshot, then more writes than it lost; a control plane
    started meanwhile copies that state. The one whose copy holds the lost keys puts
    them back at a generation past the other's copy, so the other reads the put-back
    state and does not write its older copy over it."""
    old = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    apikeys.create_key(r, "acme")
    old.run_cycle()
    r.save()
    lost = [apikeys.create_key(r, "acme")[0] for _ in range(2)]
    old.run_cycle()
    redis_server.stop()
    redis_server.start_again(workdir / "redis")
    fresh = [apikeys.create_key(r, "ops")[0] for _ in range(4)]
    new = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    new.run_cycle()                                    # copies the older Redis
    old.run_cycle()                                    # puts the lost keys back
    for cp in (new, old, new, old):
        cp.run_cycle()
    assert all(apikeys.lookup(r, k) is not None for k in lost + fresh)
    assert new.state_restores == 0 and old.state_restores == 1


def _cut_pair(redis_server, cps):
    """A TCP proxy in front of Redis that can cut one control plane off (Redis up for the
    others), that control plane behind it and another one, each after a first cycle."""
    from support.tcpcut import TcpCut

    proxy = TcpCut("127.0.0.1", redis_server.port)
    cut_off = cps(cp_settings([_node("a")]),
                  make_client(f"redis://127.0.0.1:{proxy.port}/0", 0.5))
    other = cps(cp_settings([_node("a")]), make_client(redis_server.url, 0.5))
    cut_off.run_cycle()
    other.run_cycle()
    return proxy, cut_off, other


def test_a_revocation_made_while_a_control_plane_was_cut_off_is_not_undone(
        redis_server, workdir, cps) -> None:
    """A control plane cut off from Redis (Redis up for the others) while an operator
    revokes a key through another control plane, then Redis restarted empty: the cut-off
    one may write its copy back first (read just before Redis stopped answering it, it
    counts as fresh), with the key valid; the other's copy, which has the revocation, is
    refused the restore but still revokes the key again (a revocation is for good)."""
    proxy, cut_off, other = _cut_pair(redis_server, cps)
    try:
        r = redis_server.client()
        key, rec = apikeys.create_key(r, "acme")
        cut_off.run_cycle()
        other.run_cycle()
        proxy.cut()
        assert not cut_off.run_cycle().redis_ok
        apikeys.revoke_key(r, rec.id)        # through the other control plane's admin page
        other.run_cycle()
        assert apikeys.lookup(r, key) is None
        redis_server.stop()
        redis_server.start_again(workdir / "redis")   # empty: nothing was persisted
        proxy.open()
        cut_off.run_cycle()                  # first to notice: writes its copy back
        assert cut_off.state_restores == 1
        other.run_cycle()
        assert apikeys.lookup(r, key) is None, "the revoked key is valid again"
        assert apikeys.get_key(r, rec.id).revoked
        other.run_cycle()
        cut_off.run_cycle()
        assert apikeys.lookup(r, key) is None
    finally:
        proxy.close()


def test_a_control_plane_cut_off_while_another_restored_writes_nothing_back(
        redis_server, workdir, cps) -> None:
    """A control plane cut off from Redis for over an hour (Redis up for the others),
    while Redis came back empty, another control plane wrote its copy back and an
    operator removed a node: the cut-off one finds a state marker another control plane
    made long before Redis answered it again (Redis was up, it alone was cut off), so
    its copy, read just before Redis stopped answering it and half an hour before the
    loss, is not written back (the restore's claim had expired)."""
    proxy, cut_off, other = _cut_pair(redis_server, cps)
    try:
        r = redis_server.client()
        registry.put_node(r, _node("gone"))
        cut_off.run_cycle()
        other.run_cycle()
        proxy.cut()
        assert not cut_off.run_cycle().redis_ok
        redis_server.stop()
        redis_server.start_again(workdir / "redis")   # empty: nothing was persisted
        other.run_cycle()
        assert other.state_restores == 1
        registry.remove_node(r, "gone")
        other.run_cycle()
        # the cut came an hour ago, Redis' restart (the marker, the restore's claim)
        # half an hour ago
        marker = json.loads(r.get(keynames.STATE_MARKER))
        marker["created"] -= 1800
        r.set(keynames.STATE_MARKER, json.dumps(marker))
        other._marker_value = r.get(keynames.STATE_MARKER)
        for k in r.scan_iter(keynames.STATE_RESTORE_CLAIM_PREFIX + "*"):
            r.delete(k)
        c = cut_off.keeper.copy
        c.registry_at -= 3600
        c.apikeys_at -= 3600
        cut_off.redis_unreachable_since -= 3600
        proxy.open()
        cut_off.run_cycle()
        assert cut_off.state_restores == 0
        assert {n.name for n in registry.list_nodes(r)} == {"a"}, "the removed node is back"
    finally:
        proxy.close()


def test_a_control_plane_frozen_during_an_outage_writes_nothing_back(
        redis_server, workdir, cps) -> None:
    """A control plane that saw Redis fail once and was then frozen (SIGSTOP) for an
    hour, while Redis answered again, an operator revoked a key and added a node, and
    Redis was restarted empty: it did not try Redis every cycle meanwhile, so its copy,
    read an hour ago, is not written back (the key stays refused, no stale registry)."""
    from support.tcpcut import TcpCut

    proxy = TcpCut("127.0.0.1", redis_server.port)
    try:
        cp = cps(cp_settings([_node("a")]),
                 make_client(f"redis://127.0.0.1:{proxy.port}/0", 0.5))
        r = redis_server.client()
        cp.run_cycle()
        key, rec = apikeys.create_key(r, "acme")
        cp.run_cycle()
        proxy.cut()
        assert not cp.run_cycle().redis_ok   # one failed cycle, then frozen
        proxy.open()
        apikeys.revoke_key(r, rec.id)
        registry.put_node(r, _node("added"))
        redis_server.stop()
        redis_server.start_again(workdir / "redis")   # empty: nothing was persisted
        # resumed an hour later
        c = cp.keeper.copy
        c.registry_at -= 3600
        c.apikeys_at -= 3600
        cp.redis_unreachable_since -= 3600
        cp._redis_failed_at -= 3600
        cp.run_cycle()
        assert cp.state_restores == 0
        assert apikeys.lookup(r, key) is None
    finally:
        proxy.close()


def test_a_key_revoked_just_before_a_loss_stays_revoked(redis_server, cps) -> None:
    """Redis loses its data right after a revocation: the revocation returned once the
    running control plane's copy held it, so the copy written back keeps the key revoked.
    Without that wait the copy, up to a poll interval old, held the key valid and wrote
    it back so, for good."""
    cp = cps(cp_settings([_node("a")], poll_interval_s=0.3), make_client(redis_server.url, 0.5))
    r = redis_server.client()
    _, rec = apikeys.create_key(r, "acme")
    cp.start()
    procs.wait_until(lambda: cp.id in keycopies.fresh_reports(r), 5,
                     what="the control plane's report of its copy")
    ch = ops.revoke_key(r, rec.id, "test")
    assert ch.changed and ch.copied is True
    held = keycopies.fresh_reports(r)[cp.id]["gen"]
    assert held >= keycopies.current_gen(r)
    r.flushall()   # the loss, before the next poll
    procs.wait_until(lambda: _events(r, "state_restored"), 10, what="the write-back")
    assert apikeys.get_key(r, rec.id).revoked == ch.record.revoked
    # its report went with the rest: made again at once, so revocations wait for it again
    procs.wait_until(lambda: cp.id in keycopies.fresh_reports(r), 3,
                     what="the control plane's report after the loss")
    cp.shutdown()
    assert cp.id not in keycopies.fresh_reports(r), "a stopped control plane is not waited for"


def test_a_revocation_waits_only_for_running_control_planes(redis_server) -> None:
    """No control plane reports a copy: the revocation returns at once (copied None). One
    reports a copy that does not move (frozen): it returns after two of its poll intervals
    and a second, copied False. A report older than FRESH_S is of a stopped one: ignored."""
    r = redis_server.client()
    _, rec = apikeys.create_key(r, "acme")
    ch = ops.revoke_key(r, rec.id, "test")
    assert ch.changed and ch.copied is None
    _, rec2 = apikeys.create_key(r, "acme")
    keycopies.report(r, "frozen", keycopies.current_gen(r), every_s=0.1)
    t0 = time.monotonic()
    ch = ops.revoke_key(r, rec2.id, "test")
    took = time.monotonic() - t0
    assert ch.changed and ch.copied is False and took >= 1.2
    assert ops.revoke_key(r, rec2.id, "test").copied is None   # revoked before: no wait
    _, rec3 = apikeys.create_key(r, "acme")
    keycopies.report(r, "stopped", 0, every_s=0.1, now=time.time() - keycopies.FRESH_S - 1)
    r.hdel(keynames.APIKEYS_COPIES, "frozen")
    assert ops.revoke_key(r, rec3.id, "test").copied is None
