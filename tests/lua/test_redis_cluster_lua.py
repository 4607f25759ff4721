"""The edge's Redis Cluster logic without a cluster (pure Lua in nginx's init_by_lua):
CRC16 and hash slots equal redis-py's (and so Redis'), hash tags, the key a command is
routed by, MOVED/ASK/TRYAGAIN parsing, the slot map's text form, key names of one group
landing in one slot; and the cluster client over fake nodes (a stub pool): pipelines
split per node, MOVED and ASK followed, a failed node failing only its own commands."""

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


FAKE_NODES = """
        local cluster = require("infergate.redis.cluster")
        local sent = {}                        -- "host:port" -> list of command names
        local replies = {}                     -- "host:port" -> function(cmd) -> reply
        local function fake_client(id)
            return {
                closed = function() return false end,
                close = function() end,
                command = function(self, ...)
                    return self:pipeline({ { ... } })[1]
                end,
                pipeline = function(_, cmds)
                    local out = {}
                    for i, cmd in ipairs(cmds) do
                        sent[id] = sent[id] or {}
                        table.insert(sent[id], table.concat(cmd, " "))
                        out[i] = replies[id](cmd)
                    end
                    return out
                end,
            }
        end
        local pool = {
            connect = function(conf) return fake_client(conf.host .. ":" .. conf.port) end,
            release = function() end,
            run = function(fn, conf) return fn(fake_client(conf.host .. ":" .. conf.port)) end,
        }
        cluster.set_pool(pool)
        local slots = {
            { 0, 8191, { "10.0.0.1", 7000, "a" } }, { 8192, 16383, { "10.0.0.2", 7000, "b" } },
        }
        local conf = { db = 0, cluster = { seeds = { { host = "10.0.0.1", port = 7000 } },
                                           id = "test-" .. ngx.now() } }
        local crc16 = require("infergate.redis.crc16")
        -- slots: "a" 15495 (node b), "b" 3300, "moved" 1999, "asked" 6467 (node a)
        replies["10.0.0.1:7000"] = function(cmd)
            if cmd[1] == "CLUSTER" then return slots end
            if cmd[2] == "moved" then return { false, "MOVED 1 10.0.0.3:7000" } end
            if cmd[2] == "asked" and cmd[1] ~= "ASKING" then
                return { false, "ASK 2 10.0.0.3:7000" }
            end
            return "A:" .. tostring(cmd[2])
        end
        replies["10.0.0.2:7000"] = function(cmd) return "B:" .. tostring(cmd[2]) end
        replies["10.0.0.3:7000"] = function(cmd)
            if cmd[1] == "ASKING" then return "OK" end
            return "C:" .. tostring(cmd[2])
        end
"""


def test_cluster_client_splits_pipelines_and_follows_redirects(workdir: Path) -> None:
    """A cluster client over fake nodes: a pipeline split per node with the replies in
    order, MOVED sent again to the node named (and remembered), ASK sent once with ASKING."""
    got = lua_eval(workdir, FAKE_NODES + """
        local c = assert(cluster.connect(conf, 100))
        local res = assert(c:pipeline({ { "GET", "a" }, { "GET", "b" }, { "GET", "moved" },
                                        { "GET", "asked" }, { "PING" } }))
        local single = c:command("GET", "b")
        local again = c:command("GET", "moved")   -- now routed to 10.0.0.3 directly
        return { res = res, single = single, again = again, sent = sent,
                 slot_a = crc16.slot("a"), slot_moved = crc16.slot("moved"),
                 slot_ask = crc16.slot("asked") }
    """, http_extra="lua_shared_dict infergate_snapshot 1m;")
    assert got["slot_a"] >= 8192 and got["slot_moved"] < 8192 and got["slot_ask"] < 8192
    assert got["res"] == ["B:a", "A:b", "C:moved", "C:asked", "A:nil"]
    assert got["single"] == "A:b" and got["again"] == "C:moved"
    sent = got["sent"]
    assert sent["10.0.0.3:7000"] == ["GET moved", "ASKING", "GET asked", "GET moved"]
    # one pipeline per node for the first call: a's keys went to node b, never to node a
    assert "GET a" not in sent["10.0.0.1:7000"] and "GET a" in sent["10.0.0.2:7000"]
    assert sent["10.0.0.1:7000"][0] == "CLUSTER SLOTS"


def test_cluster_client_a_failed_node_fails_only_its_commands(workdir: Path) -> None:
    got = lua_eval(workdir, FAKE_NODES + """
        local connect = pool.connect
        pool.connect = function(nc)
            if nc.host == "10.0.0.2" then return nil, "connection refused" end
            return connect(nc)
        end
        local c = assert(cluster.connect(conf, 100))
        local res = assert(c:pipeline({ { "GET", "a" }, { "GET", "b" } }))
        local v, err = c:command("GET", "a")
        return { first = res[1], second = res[2], v = v == nil, err = err,
                 stale = ngx.shared.infergate_snapshot:get("cluster:" .. conf.cluster.id .. ":fresh") }
    """, http_extra="lua_shared_dict infergate_snapshot 1m;")
    assert got["first"][0] is False and "refused" in got["first"][1]
    assert got["second"] == "A:b"
    assert got["v"] is True and "refused" in got["err"]
    assert got.get("stale") is None   # the map is to be read again (a replica may take over)
