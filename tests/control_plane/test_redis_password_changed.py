"""Redis that starts asking for another password: the CLI says Redis refuses the URL's
credentials and names the fix, instead of "cannot reach Redis" or Redis's own HELLO
text. Real redis-server; the password changed with CONFIG SET."""

from __future__ import annotations

import pytest
import redis
from click.testing import CliRunner

from controlplane.cli import main
from controlplane.redisdb.conn import describe_error, refused_credentials

pytestmark = pytest.mark.integration


def test_a_refused_password_is_named_with_its_fix(redis_server) -> None:
    r = redis_server.client()
    r.config_set("requirepass", "other2")
    try:
        runner = CliRunner()
        for url in (redis_server.url,
                    redis_server.url.replace("redis://", "redis://:wrong@")):
            res = runner.invoke(main, ["nodes", "--redis-url", url, "list"])
            assert res.exit_code == 1, res.output
            assert "Redis answers but refuses this deployment's user or password" in res.output
            assert "[redis] url" in res.output and "cannot reach Redis" not in res.output
            assert "Traceback" not in res.output
        ok = redis_server.url.replace("redis://", "redis://:other2@")
        assert runner.invoke(main, ["nodes", "--redis-url", ok, "list"]).exit_code == 0
    finally:
        redis.Redis(host="127.0.0.1", port=redis_server.port, password="other2") \
            .config_set("requirepass", "")


def test_other_redis_errors_stay_cannot_reach() -> None:
    down = redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    assert not refused_credentials(down)
    assert describe_error(down) == ("cannot reach Redis: Error 111 connecting to "
                                    "127.0.0.1:1. Connection refused")
    assert refused_credentials(redis.AuthenticationError("invalid username-password pair"))
    assert refused_credentials(redis.ResponseError(
        "HELLO must be called with the client already authenticated, otherwise the HELLO "
        "AUTH <user> <pass> option can be used to authenticate the client and select the "
        "RESP protocol version at the same time"))
    assert not refused_credentials(ValueError("invalid password"))
