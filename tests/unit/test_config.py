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
    sections = [n for n in type(d).model_fields if n != "nodes"]
    for section in sections:
        assert getattr(s, section) == getattr(d, section), section


def test_example_file_names_every_field():
    """Every field of every section is in the example, as a key, a commented line
    (``# key = ...``, for a field without a TOML default) or a sub-table header."""
    import re
    import tomllib

    text = EXAMPLE.read_text()
    doc = tomllib.loads(text)
    d = load_settings(None)
    missing = []
    for section in (n for n in type(d).model_fields if n != "nodes"):
        body = text.split(f"\n[{section}]\n", 1)[1]
        body = re.split(r"\n\[(?!" + section + r"\.)[a-z]", body, maxsplit=1)[0]
        for field in type(getattr(d, section)).model_fields:
            if field in doc.get(section, {}):
                continue
            if not re.search(rf"^# {field} =|^#? ?\[\[?{section}\.{field}\b", body, re.M):
                missing.append(f"{section}.{field}")
    assert missing == []


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("INFERGATE_REDIS_URL", "redis://127.0.0.1:7000/2")
    monkeypatch.setenv("INFERGATE_ADMIN_TOKEN", "t0ken")
    s = load_settings(None)
    assert s.redis.url == "redis://127.0.0.1:7000/2"
    assert s.controlplane.admin_token == "t0ken"


@pytest.mark.parametrize("node, msg", [
    ({"name": "a", "url": "ftp://x"}, "http://"),
    ({"name": "a", "url": "http://x:1/v1"}, "without a path"),
    ({"name": "a", "url": "http://x:1#frag"}, "without a path, query or fragment"),
    ({"name": "a", "url": "http://x:1/#"}, "without a path, query or fragment"),
    ({"name": "a", "url": "http://x:1?"}, "without a path, query or fragment"),
    ({"name": "a", "url": "http://x:1?a=b"}, "without a path, query or fragment"),
    ({"name": "a", "url": "http://x:" + "9" * 5000}, "port must be 1-65535"),
    ({"name": "a", "url": "http://x", "weight": 0}, "greater than or equal to 0.001"),
    ({"name": "a", "url": "http://x", "weight": 1e-300}, "greater than or equal to 0.001"),
    ({"name": "a", "url": "http://x", "weight": "NaN"}, "plain decimal number"),
    ({"name": "a", "url": "http://x", "weight": float("inf")}, "finite number"),
    ({"name": "a", "url": "http://x:0"}, "1-65535"),
    ({"name": "a", "url": "http://u:pw@x:80"}, "credentials"),
    ({"name": "a", "url": "http://[::1]]:5"}, "[IPv6] address, then at most :port"),
    ({"name": "a", "url": "http://[::1]x:5"}, "[IPv6] address, then at most :port"),
    ({"name": "a", "url": "http://[::1]a"}, "[IPv6] address, then at most :port"),
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


def test_node_urls_with_their_host_as_written_are_kept():
    for url in ("http://[::1]:8000", "http://[::1]", "http://[FE80::1%25eth0]:80",
                "https://Gpu-A.example:8443", "http://10.0.0.7:8000/", "http://x"):
        s = settings_from_dict({"nodes": [{"name": "a", "url": url}]})
        assert s.nodes[0].url == url.rstrip("/")


def test_duplicate_node_names():
    with pytest.raises(ConfigError, match="duplicate"):
        settings_from_dict({"nodes": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]})
    with pytest.raises(ConfigError, match=r"duplicate node names \(case aside\): \['SIM-FAST', 'sim-fast'\]"):
        settings_from_dict({"nodes": [{"name": "sim-fast", "url": "http://x"},
                                      {"name": "SIM-FAST", "url": "http://y"}]})


def test_unknown_field_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="edge.bogus"):
        settings_from_dict({"edge": {"bogus": 1}})
    p = tmp_path / "bad.toml"
    p.write_text("[edge\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(p)
    with pytest.raises(ConfigError, match="no such"):
        load_settings(tmp_path / "missing.toml")


# --------------------------------------------------------------------------- HostPort

@pytest.mark.parametrize("text, host, port, url", [
    ("127.0.0.1:8080", "127.0.0.1", 8080, "http://127.0.0.1:8080"),
    ("[::1]:8080", "::1", 8080, "http://[::1]:8080"),
    ("[2001:db8::5]:1", "2001:db8::5", 1, "http://[2001:db8::5]:1"),
    ("edge.internal:65535", "edge.internal", 65535, "http://edge.internal:65535"),
    ("0.0.0.0:80", "0.0.0.0", 80, "http://127.0.0.1:80"),
    ("*:80", "*", 80, "http://127.0.0.1:80"),
    ("[::]:80", "::", 80, "http://[::1]:80"),
])
def test_hostport_parses(text, host, port, url):
    from controlplane.config import HostPort

    hp = HostPort.parse(text)
    assert (hp, hp.host, hp.port, hp.client_url) == (text, host, port, url)
    assert hp.url_host == (f"[{host}]" if ":" in host else host)


@pytest.mark.parametrize("text", ["localhost", "::1:8080", "[::1]", "[::1]8080", "[nothost]:80",
                                  "a:0", "a:65536", ":80", "a:b", "", "a b:80", "a:80:80"])
def test_hostport_refuses_with_one_message(text):
    from controlplane.config import HostPort, HostPortError

    with pytest.raises(HostPortError) as exc:
        HostPort.parse(text, "--listen")
    assert str(exc.value) == ("--listen must be HOST:PORT or [IPv6]:PORT with a port from 1 to "
                              f"65535, got {text!r}")


def test_hostport_fields_and_the_cli_parsers():
    import click

    from controlplane.cli.common import split_listen as cli_split_listen
    from controlplane.cli.up import _split_hostport
    from controlplane.config import HostPort
    from controlplane.edge.render import RenderError, split_listen

    s = settings_from_dict({"edge": {"listen": "[::1]:9000", "metrics_listen": "[::1]:9001"},
                            "controlplane": {"listen": "127.0.0.1:9002"}})
    assert isinstance(s.edge.listen, HostPort) and s.edge.listen.port == 9000
    assert s.edge.metrics_listen.host == "::1" and s.controlplane.listen.port == 9002
    assert settings_from_dict({"edge": {"metrics_listen": ""}}).edge.metrics_listen == ""
    with pytest.raises(ConfigError, match="edge.listen: .*HOST:PORT"):
        settings_from_dict({"edge": {"listen": "::1:9000"}})
    with pytest.raises(ConfigError, match="edge.metrics_listen"):
        settings_from_dict({"edge": {"metrics_listen": "9145"}})
    for parse in (split_listen, cli_split_listen,
                  lambda v: _split_hostport(v, "--listen")):
        assert parse("[::1]:8081") == ("::1", 8081)
        assert parse("10.0.0.1:1") == ("10.0.0.1", 1)
        with pytest.raises((RenderError, click.BadParameter), match=r"HOST:PORT or \[IPv6\]:PORT"):
            parse("localhost")
