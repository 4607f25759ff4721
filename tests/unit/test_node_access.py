"""Node access settings: https URLs, API keys from an environment variable or a file,
CA files; how a key is read, carried in the snapshot and redacted; 401/403 polls."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from controlplane.admin import ops
from controlplane.config import NodeSettings
from controlplane.routing import nodeaccess
from controlplane.routing.nodeaccess import AccessTable, CredentialError, KeyFiles, resolve
from controlplane.routing.poller import HttpResult, classify, models_refusal
from controlplane.routing.snapshot import build_snapshot
from controlplane.routing.wire import RoutingSnapshot


def test_https_urls_and_access_fields_are_validated(tmp_path):
    n = NodeSettings(name="a", url="https://vllm-1.internal:8443/", ca_file="/etc/ca.pem",
                     api_key_env="VLLM_KEY")
    assert n.url == "https://vllm-1.internal:8443" and n.has_credential()
    assert not NodeSettings(name="b", url="http://10.0.0.1:8000").has_credential()
    bad = [
        {"url": "ftp://10.0.0.1:21"},
        {"url": "https://h:1", "api_key_env": "A", "api_key_file": "/k"},
        {"url": "http://h:1", "ca_file": "/etc/ca.pem"},
        {"url": "https://h:1", "api_key_env": "Bearer abc"},
        {"url": "https://h:1", "api_key_file": "relative/key"},
        {"url": "https://h:1", "ca_file": "/etc/ca file.pem"},
    ]
    for fields in bad:
        with pytest.raises(ValidationError):
            NodeSettings(name="x", **fields)


def test_a_key_is_read_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("T_NODE_KEY", "  abc123\n")
    assert resolve(NodeSettings(name="a", url="http://h:1", api_key_env="T_NODE_KEY")) \
        == "Bearer abc123"
    monkeypatch.delenv("T_NODE_KEY")
    with pytest.raises(CredentialError, match="T_NODE_KEY is not set"):
        resolve(NodeSettings(name="a", url="http://h:1", api_key_env="T_NODE_KEY"))
    f = tmp_path / "key"
    f.write_text("first-line\nsecond\n")
    files = KeyFiles()
    node = NodeSettings(name="a", url="http://h:1", api_key_file=str(f))
    assert resolve(node, files) == "Bearer first-line"
    f.write_text("rotated-key\n")
    os.utime(f, ns=(1, 10**18))
    assert resolve(node, files) == "Bearer rotated-key"
    for text, why in (("", "is empty"), ("two words\n", "space")):
        f.write_text(text)
        os.utime(f, ns=(1, 10**18 + len(text) + 7))
        with pytest.raises(CredentialError, match=why) as exc:
            resolve(node, files)
        assert "two words" not in str(exc.value)
    assert resolve(NodeSettings(name="a", url="http://h:1")) is None


def test_the_access_table_gives_each_origin_its_key_and_cas(monkeypatch):
    monkeypatch.setenv("T_NODE_KEY2", "k2")
    t = AccessTable(global_ca="/etc/global.pem")
    errors = t.update([
        NodeSettings(name="a", url="https://Node-A:8443", api_key_env="T_NODE_KEY2",
                     ca_file="/etc/a.pem"),
        NodeSettings(name="b", url="http://10.0.0.2:8000"),
        NodeSettings(name="c", url="http://10.0.0.3:8000", api_key_env="T_UNSET_KEY_9"),
    ])
    assert errors["a"] is None and errors["b"] is None and "T_UNSET_KEY_9" in errors["c"]
    a = t.for_url("https://node-a:8443/metrics")
    assert a.auth == "Bearer k2" and a.verify == "/etc/a.pem"
    assert t.for_url("http://10.0.0.2:8000/health").auth is None
    assert t.for_url("http://10.0.0.3:8000/health").auth is None
    assert t.for_url("https://elsewhere/").verify == "/etc/global.pem"


def test_the_snapshot_carries_the_key_and_every_serving_path_redacts_it():
    nodes = [NodeSettings(name="a", url="https://vllm-a:8443", api_key_env="X"),
             NodeSettings(name="b", url="http://10.0.0.2:8000")]
    snap = build_snapshot(version=1, now=10.0, leader="cp", nodes=nodes, states={},
                          statuses={}, hosts={"a": "10.0.0.1", "b": "10.0.0.2"},
                          slow_start_s=0, auths={"a": "Bearer zzz"})
    doc = json.loads(snap.to_json())
    a, b = doc["nodes"]
    assert (a["scheme"], a["tls_name"], a["auth"], a["port"]) == ("https", "vllm-a",
                                                                   "Bearer zzz", 8443)
    assert "scheme" not in b and "auth" not in b and "tls_name" not in b
    assert RoutingSnapshot.from_json(snap.to_json()) == snap
    assert "zzz" not in repr(snap)
    red = nodeaccess.redact_snapshot(snap.to_json())
    assert "zzz" not in red and json.loads(red)["nodes"][0]["auth"] == "[redacted]"
    assert nodeaccess.redact_snapshot("not json") == "not json"


def test_401_or_403_is_credentials_refused():
    res = classify(HttpResult(status=401, body=""), HttpResult(status=401, body=""))
    assert not res.good and res.credentials_refused and res.reachable
    assert "credentials refused (HTTP 401)" in res.error
    res = classify(HttpResult(status=200, body="ok"), HttpResult(status=403, body=""))
    assert not res.good and res.credentials_refused
    res = classify(HttpResult(status=503, body=""), None)
    assert not res.good and not res.credentials_refused
    ok = classify(HttpResult(status=200, body="ok"), None)
    assert models_refusal(ok, "HTTP 500") is ok and models_refusal(ok, None) is ok
    res = models_refusal(ok, "HTTP 401")
    assert not res.good and res.credentials_refused
    assert res.error == "models: credentials refused (HTTP 401)"


def test_keys_and_ca_files_cannot_be_set_at_run_time():
    for extra in ({"api_key_env": "HOME"}, {"api_key_file": "/etc/hostname"},
                  {"ca_file": "/etc/ssl/certs/ca-certificates.crt"}):
        with pytest.raises(ops.BadInput, match="TOML"):
            ops.add_node(None, {"name": "x", "url": "https://10.1.2.3:8443", **extra}, "test")
