"""The Redis-backed subcommands say when they use the built-in default Redis URL: on a
shared host, redis://127.0.0.1:6379 may be another team's (pure logic, no Redis)."""

from __future__ import annotations

import click
import fakeredis
import pytest

from controlplane.cli import common
from controlplane.redisdb import keynames


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
    held = fakeredis.FakeRedis()
    held.set(keynames.ROUTING, "{}")                 # a Redis that infergate uses
    monkeypatch.setattr(common, "make_redis", lambda s: made.append(s.url) or held)
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    assert ctx.r is not None and len(made) == 1
    err = capsys.readouterr().err
    assert ("note: using Redis at redis://127.0.0.1:6379/0, the default" in err) is default
    assert "export line" in err or not default


def test_the_note_goes_to_stderr_once(monkeypatch) -> None:
    monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    said: list[tuple[str, bool]] = []
    monkeypatch.setattr(click, "echo", lambda msg, err=False: said.append((msg, err)))
    held = fakeredis.FakeRedis()
    held.hset(keynames.NODES, "a", "{}")
    monkeypatch.setattr(common, "make_redis", lambda s: held)
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    ctx = common.Ctx(None, None)
    _ = ctx.r, ctx.r
    assert len(said) == 1 and said[0][1] is True


@pytest.mark.parametrize("url,refused", [(None, True), ("redis://127.0.0.1:6379/0", False)])
def test_a_default_redis_without_infergate_state_is_refused(monkeypatch, url, refused) -> None:
    """On a shared host the default redis://127.0.0.1:6379 may be another service's: with
    no infergate key in it, a command that did not name it reads and writes nothing.
    Naming it (``--redis-url``) uses it."""
    monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    foreign = fakeredis.FakeRedis()
    foreign.set("someone:else", "1")
    monkeypatch.setattr(common, "make_redis", lambda s: foreign)
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    ctx = common.Ctx(None, url)
    if refused:
        with pytest.raises(click.ClickException, match="holds no infergate state") as exc:
            _ = ctx.r
        assert "--redis-url redis://127.0.0.1:6379/0" in exc.value.message
    else:
        assert ctx.r is foreign
    assert foreign.keys("*") == [b"someone:else"]


@pytest.mark.parametrize("file_redis,said", [
    ('[redis]\nurl = "redis://:pw@127.0.0.1:6380/0"\n', True),
    ("", True),                                       # the file's default 6379
    ('[redis]\nurl = "redis://127.0.0.1:7001/0"\n', False),  # the same URL
])
def test_a_config_files_redis_replaced_by_the_environment_is_said(
        tmp_path, monkeypatch, capsys, file_redis, said) -> None:
    """``--config F`` with an ``INFERGATE_REDIS_URL`` left in the shell (an ``infergate up``
    banner's export line): the environment wins, as documented, and the command says so
    on standard error, naming both URLs (passwords hidden)."""
    cfg = tmp_path / "infergate.toml"
    cfg.write_text(file_redis)
    monkeypatch.setenv("INFERGATE_REDIS_URL", "redis://127.0.0.1:7001/0")
    held = fakeredis.FakeRedis()
    held.set(keynames.ROUTING, "{}")
    made: list[str] = []
    monkeypatch.setattr(common, "make_redis", lambda s: made.append(s.url) or held)
    monkeypatch.setattr(common, "migrate_key_names", lambda r: None)
    assert common.Ctx(str(cfg), None).r is held
    assert made == ["redis://127.0.0.1:7001/0"]
    err = capsys.readouterr().err
    assert ("note: using Redis at redis://127.0.0.1:7001/0 from INFERGATE_REDIS_URL, which "
            f"overrides the [redis] url of {cfg}" in err) is said, err
    assert "pw" not in err
    # --redis-url names the Redis itself: nothing to say
    assert common.Ctx(str(cfg), "redis://127.0.0.1:7002/0").r is held
    assert capsys.readouterr().err == ""
