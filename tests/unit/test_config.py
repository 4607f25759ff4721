"""Configuration loading: defaults, the example file, and clear errors."""

from pathlib import Path

import pytest

from controlplane.config import ConfigError, load_settings, settings_from_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "infergate.example.toml"


def test_defaults_without_file():
    s = load_settings(None)
    assert s.edge.listen == "127.0.0.1:8080"
    assert s.controlplane.listen == "127.0.0.1:8081"
    assert s.nodes == []


def test_example_file_is_valid_and_matches_defaults():
    s = load_settings(EXAMPLE)
    d = load_settings(None)
    assert [n.name for n in s.nodes] == ["gpu-a", "gpu-b"]
    # The example documents the defaults: every section but nodes equals them.
    for section in ("redis", "edge", "controlplane", "scoring"):
        assert getattr(s, section) == getattr(d, section), section


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("INFERGATE_REDIS_URL", "redis://127.0.0.1:7000/2")
    monkeypatch.setenv("INFERGATE_ADMIN_TOKEN", "t0ken")
    s = load_settings(None)
    assert s.redis.url == "redis://127.0.0.1:7000/2"
    assert s.controlplane.admin_token == "t0ken"


@pytest.mark.parametrize("node, msg", [
    ({"name": "a", "url": "ftp://x"}, "http://"),
    ({"name": "a", "url": "http://x:1/v1"}, "without a path"),
    ({"name": "a", "url": "http://x", "weight": 0}, "greater than or equal to 0.001"),
    ({"name": "a", "url": "http://x", "weight": 1e-300}, "greater than or equal to 0.001"),
    ({"name": "a", "url": "http://x:0"}, "1-65535"),
    ({"name": "a", "url": "http://u:pw@x:80"}, "credentials"),
    ({"name": "a", "url": "http://x", "health_path": "@evil:80/health"}, "absolute path"),
    ({"name": "a", "url": "http://x", "metrics_path": "//evil/metrics"}, "absolute path"),
    ({"name": "a", "url": "http://x", "metrics_path": "/a/../b"}, "absolute path"),
    ({"name": "bad name", "url": "http://x"}, "node name"),
    ({"name": "a", "url": "http://x", "kind": "nope"}, "kind"),
])
def test_invalid_nodes_are_named(node, msg):
    with pytest.raises(ConfigError) as exc:
        settings_from_dict({"nodes": [node]})
    assert msg in str(exc.value)


def test_duplicate_node_names():
    with pytest.raises(ConfigError, match="duplicate"):
        settings_from_dict({"nodes": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]})


def test_unknown_field_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="edge.bogus"):
        settings_from_dict({"edge": {"bogus": 1}})
    p = tmp_path / "bad.toml"
    p.write_text("[edge\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(p)
    with pytest.raises(ConfigError, match="no such"):
        load_settings(tmp_path / "missing.toml")
