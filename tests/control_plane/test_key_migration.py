"""Upgrading a Redis written before the cluster hash tags: the control plane carries the
renamed state keys (API key ids and marker, seeded node names, drain states) over to their
new names at start, once, idempotently, merging when both exist; nothing is lost."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from controlplane.admin import apikeys
from controlplane.config import NodeSettings, settings_from_dict
from controlplane.redisdb import keynames
from controlplane.redisdb.migrate import migrate_key_names
from controlplane.routing import registry
from controlplane.routing.service import ControlPlane

pytestmark = pytest.mark.integration

#: The names an earlier version wrote (literal: the old layout must stay readable).
OLD = {
    "infergate:v1:apikeys:ids": keynames.APIKEY_IDS,
    "infergate:v1:apikeys:marker": keynames.APIKEYS_MARKER,
    "infergate:v1:nodes_seeded": keynames.NODES_SEEDED,
    "infergate:v1:node_states": keynames.NODE_STATES,
}


def test_renamed_keys_are_the_old_layout_and_share_their_groups_slot() -> None:
    assert keynames.RENAMED == OLD
    for group, keys in keynames.SLOT_GROUPS.items():
        assert len({key_slot(k.encode()) for k in keys}) == 1, group
    # the group's first key kept its pre-cluster name
    assert keynames.APIKEYS == "infergate:v1:apikeys"
    assert keynames.NODES == "infergate:v1:nodes"
    assert keynames.ROUTING == "infergate:v1:routing"


def _old_layout(r) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """State as an earlier version left it: two API keys, two nodes (one drained, one
    removed at run time after seeding)."""
    key1, rec1 = apikeys.create_key(r, "acme", rpm=60)
    _, rec2 = apikeys.create_key(r, "beta")
    n1 = NodeSettings(name="n1", url="http://127.0.0.1:9/")
    n2 = NodeSettings(name="n2", url="http://127.0.0.1:10/")
    registry.seed_nodes(r, [n1, n2])
    registry.remove_node(r, "n2")
    registry.set_state(r, "n1", "drained", actor="op")
    for old, new in OLD.items():
        r.rename(new, old)
    assert not any(r.exists(new) for new in OLD.values())
    return key1, rec2.id


def test_control_plane_carries_the_old_state_over_once(r) -> None:
    key1, id2 = _old_layout(r)
    settings = settings_from_dict({"nodes": [{"name": "n1", "url": "http://127.0.0.1:9/"},
                                             {"name": "n2", "url": "http://127.0.0.1:10/"}]})
    cp = ControlPlane(settings, r, ident="cp-test")
    assert cp._read_registry() is True
    assert not any(r.exists(old) for old in OLD)
    # API keys: listed and revocable by id (the id index), marker kept (no fail-static)
    assert {k.tenant for k in apikeys.list_keys(r)} == {"acme", "beta"}
    assert apikeys.lookup(r, key1).rpm == 60
    assert not apikeys.store_missing(r)
    assert apikeys.revoke_key(r, id2).revoked
    # registry: the node removed at run time is not seeded again; the drain state holds
    assert [n.name for n in registry.list_nodes(r)] == ["n1"]
    assert registry.get_state(r, "n1").state == "drained"
    # a second run finds nothing to do
    assert migrate_key_names(r) == {}


def test_both_names_present_are_merged_new_wins(r) -> None:
    r.hset("infergate:v1:node_states", mapping={"a": "old-a", "b": "old-b"})
    r.hset(keynames.NODE_STATES, "a", "new-a")
    r.sadd("infergate:v1:nodes_seeded", "x", "y")
    r.sadd(keynames.NODES_SEEDED, "z")
    r.set("infergate:v1:apikeys:marker", "old")
    r.set(keynames.APIKEYS_MARKER, "new")
    done = migrate_key_names(r)
    assert done == {"infergate:v1:node_states": 1, "infergate:v1:nodes_seeded": 2,
                    "infergate:v1:apikeys:marker": 0}
    assert r.hgetall(keynames.NODE_STATES) == {"a": "new-a", "b": "old-b"}
    assert r.smembers(keynames.NODES_SEEDED) == {"x", "y", "z"}
    assert r.get(keynames.APIKEYS_MARKER) == "new"
    assert migrate_key_names(r) == {}
