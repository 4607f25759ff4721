"""The Redis-backed subcommands say when they use the built-in default Redis URL: on a
shared host, redis://127.0.0.1:6379 may be another team's (pure logic, no Redis)."""

from __future__ import annotations

import click
import pytest

from controlplane.cli import common


@pytest.mark.parametrize("config,url,env,default", [
    (None, None, None, True),
    ("/etc/infergate.toml", None, None, False),
    (None, "redis://127.0.0.1:7000/0", None, False),
    (None, None, "redis://127.0.0.1:7001/0", False),
])
def test_the_default_url_is_named(monkeypatch, capsys, config, url, env, default) -> None:
    if env:
        monkeypatch.setenv("INFERGATE_REDIS_URL", env)
    else:
        monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    ctx = common.Ctx(config, url)
    assert ctx.from_defaults() is default
    if config:
        return  # (the file is not read here)
    made = []
    monkeypatch.setattr(common, "make_redis", lambda s: made.append(s.url) or object())
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    assert ctx.r is not None and len(made) == 1
    err = capsys.readouterr().err
    assert ("note: using Redis at redis://127.0.0.1:6379/0, the default" in err) is default
    assert "export line" in err or not default


def test_the_note_goes_to_stderr_once(monkeypatch) -> None:
    monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    said: list[tuple[str, bool]] = []
    monkeypatch.setattr(click, "echo", lambda msg, err=False: said.append((msg, err)))
    monkeypatch.setattr(common, "make_redis", lambda s: object())
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    ctx = common.Ctx(None, None)
    _ = ctx.r, ctx.r
    assert len(said) == 1 and said[0][1] is True
