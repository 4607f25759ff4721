"""The edge's Redis Cluster logic without a cluster (pure Lua in nginx's init_by_lua):
CRC16 and hash slots equal redis-py's (and so Redis'), hash tags, the key a command is
routed by, MOVED/ASK/TRYAGAIN parsing, the slot map's text form, and key names of one
group landing in one slot."""

from __future__ import annotations

import json
from pathlib import Path

from redis.crc import key_slot
from support.stack import lua_eval

from controlplane.redisdb import keynames

KEYS = ["", "a", "foo", "123456789", "{user1000}.following", "{user1000}.followers",
        "foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}", "{}", "}{", "\u00e9t\u00e9",
        keynames.APIKEYS, keynames.APIKEY_IDS, keynames.APIKEYS_MARKER, keynames.ROUTING,
        keynames.LEADER, keynames.LEADER_FENCE, keynames.ratelimit_key("ab12cd34", "rpm"),
        keynames.ratelimit_global("tpm"), keynames.cache_entry("ab" * 16)]


def test_slots_equal_redis_py(workdir: Path) -> None:
    got = lua_eval(workdir, f"""
        local crc16 = require("infergate.redis.crc16")
        local keys = require("cjson.safe").decode([==[{json.dumps(KEYS)}]==])
        local out = {{}}
        for i, k in ipairs(keys) do out[i] = crc16.slot(k) end
        return {{ slots = out, check = crc16.crc16("123456789") }}
    """)
    assert got["check"] == 0x31C3  # the CRC16-XMODEM check value (Redis src/crc16.c)
    assert got["slots"] == [key_slot(k.encode()) for k in KEYS]


def test_command_keys_redirects_and_map(workdir: Path) -> None:
    got = lua_eval(workdir, """
        local cluster = require("infergate.redis.cluster")
        local k = cluster.command_key
        local out = {
            keys = { k({"GET", "a"}), k({"evalsha", "sha", 2, "b", "c", "x"}),
                     k({"EVAL", "s", "0"}) or "none", k({"PING"}) or "none",
                     k({"TIME"}) or "none", k({"HSET", "h", "f", "v"}) },
            moved = { cluster.redirect("MOVED 3999 127.0.0.1:6381") },
            ask = { cluster.redirect("ASK 12 10.0.0.5:7000") },
            other = cluster.redirect("ERR wrong type") or "none",
            retry = { cluster.retryable("TRYAGAIN Multiple keys request during rehashing"),
                      cluster.retryable("CLUSTERDOWN The cluster is down"),
                      cluster.retryable("ERR x") },
        }
        local text = assert(cluster.encode_slots({
            { 0, 5460, { "127.0.0.1", 7000, "id0" }, { "127.0.0.1", 7003, "id3" } },
            { 5461, 10922, { "127.0.0.1", 7001, "id1" } },
            { 10923, 16383, { "127.0.0.1", 7002, "id2" } },
        }))
        local map = cluster.decode_map(text)
        out.map = { text = text, nodes = #map.nodes, s0 = map.nodes[map.slots[0]].id,
                    s5461 = map.nodes[map.slots[5461]].id, s16383 = map.nodes[map.slots[16383]].id }
        local _, bad = cluster.encode_slots({ { 0, 1, "x" } })
        out.bad = bad
        local _, empty = cluster.encode_slots({})
        out.empty = empty
        return out
    """)
    assert got["keys"] == ["a", "b", "none", "none", "none", "h"]
    assert got["moved"] == ["MOVED", 3999, "127.0.0.1", 6381]
    assert got["ask"] == ["ASK", 12, "10.0.0.5", 7000]
    assert got["other"] == "none"
    assert got["retry"] == [True, True, False]
    assert got["map"]["nodes"] == 3
    assert (got["map"]["s0"], got["map"]["s5461"], got["map"]["s16383"]) == (
        "127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002")
    assert "bad slot map entry 1" in got["bad"] and "empty" in got["empty"]
