"""What the Redis-backed subcommands (``infergate nodes``, ``infergate keys``) share:
the lazily built settings and Redis client, the actor name written into events, error
handling and plain-text tables."""

from __future__ import annotations

import getpass
import os
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import redis

from controlplane.config import ConfigError, HostPort, HostPortError, Settings, load_settings
from controlplane.config.routing import DECIMAL_RE
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import describe_error, make_redis, refused_credentials
from controlplane.redisdb.migrate import migrate_key_names
from controlplane.redisdb.url import redact


class Ctx:
    """Settings and a Redis client, built on first use (so ``--help`` needs neither)."""

    def __init__(self, config: str | None, redis_url: str | None):
        self.config = config
        self.redis_url = redis_url
        self._settings: Settings | None = None
        self._r: redis.Redis | None = None

    @property
    def settings(self) -> Settings:
        """The configuration; a bad file exits 1 with the loader's message."""
        if self._settings is None:
            try:
                s = load_settings(self.config)
            except ConfigError as exc:
                raise click.ClickException(str(exc)) from None
            if self.redis_url:
                s.redis.url = self.redis_url
            self._settings = s
        return self._settings

    @property
    def r(self) -> redis.Redis:
        """The Redis client; an unparseable URL exits 1."""
        if self._r is None:
            if self.from_defaults():
                click.echo(f"note: using Redis at {redact(self.settings.redis.url)}, the "
                           "default: no --config, --redis-url or INFERGATE_REDIS_URL was "
                           "given (for a stack started by `infergate up`, run the export "
                           "line its banner prints first)", err=True)
            file_url = self.url_overridden_by_env()
            if file_url is not None:
                click.echo(f"note: using Redis at {redact(self.settings.redis.url)} from "
                           f"INFERGATE_REDIS_URL, which overrides the [redis] url of "
                           f"{self.config} ({redact(file_url)}); unset it, or pass "
                           "--redis-url, to use another", err=True)
            try:
                self._r = make_redis(self.settings.redis)
            except ValueError as exc:
                raise click.ClickException(f"invalid Redis URL {self.settings.redis.url!r}: {exc}")
            if self.from_defaults() and not holds_infergate_state(self._r):
                url = redact(self.settings.redis.url)
                self._r = None
                raise click.ClickException(
                    f"the Redis at {url} (the default: no --config, --redis-url or "
                    "INFERGATE_REDIS_URL was given) holds no infergate state, so it may be "
                    "another service's; nothing was read or written. For a stack started by "
                    "`infergate up`, run the export line its banner prints; to start "
                    f"infergate's state in this Redis, name it: --redis-url {url}")
            try:  # state keys under their old names (an earlier version) are carried over
                migrate_key_names(self._r)
            except redis.RedisError:
                pass  # Redis unreachable: the command itself reports it
        return self._r

    def url_overridden_by_env(self) -> str | None:
        """The ``[redis] url`` of the ``--config`` file (its default when the file names
        none) when ``INFERGATE_REDIS_URL`` replaces it with another, else ``None``: an
        export line of an ``infergate up`` banner left in the shell would otherwise send a
        command given ``--config F`` to that stack's Redis without a word."""
        env = os.environ.get("INFERGATE_REDIS_URL")
        if not self.config or self.redis_url or not env:
            return None
        try:
            data = tomllib.loads(Path(self.config).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None  # the loader reports the file itself
        redis_section = data.get("redis")
        url = redis_section.get("url") if isinstance(redis_section, dict) else None
        if not isinstance(url, str):
            url = Settings().redis.url
        return url if url != env else None

    def from_defaults(self) -> bool:
        """Whether the Redis URL is the built-in default (no --config, --redis-url or
        ``INFERGATE_REDIS_URL``): on a shared host that Redis may be someone else's."""
        return (self.config is None and not self.redis_url
                and not os.environ.get("INFERGATE_REDIS_URL"))

    @property
    def events_max(self) -> int:
        return self.settings.controlplane.events_max


#: Keys one of which a Redis that infergate uses holds: the control plane's routing
#: snapshot and leader lease, the node registry, the API keys, the event log, the state
#: marker, an ``up`` stack's owner record, the edges' list.
STATE_PROBE_KEYS = (keynames.ROUTING, keynames.LEADER, keynames.NODES, keynames.APIKEYS,
                    keynames.EVENTS, keynames.STATE_MARKER, keynames.STACK_OWNER,
                    keynames.EDGES)


def holds_infergate_state(r: redis.Redis) -> bool:
    """Whether ``r`` holds any of :data:`STATE_PROBE_KEYS` or of the older names that
    :func:`migrate_key_names` carries over. ``True`` when Redis cannot be reached: the
    command then reports that itself."""
    try:
        keys = list(STATE_PROBE_KEYS) + [old for old in keynames.RENAMED]
        return bool(r.exists(*keys))
    except redis.RedisError:
        return True


def _late_option(field: str):
    """Callback of a subcommand's ``--config`` / ``--redis-url``: sets that field of the
    group's :class:`Ctx` (built lazily, so it is not used before this)."""
    def set_field(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value is not None and isinstance(ctx.obj, Ctx):
            setattr(ctx.obj, field, value)
    return set_field


class ConnectedGroup(click.Group):
    """A command group whose ``--config`` and ``--redis-url`` (options of the group,
    stored in a :class:`Ctx`) are also accepted after the subcommand:
    ``infergate nodes list --config F`` as well as ``infergate nodes --config F list``."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        known = {o for p in cmd.params for o in getattr(p, "opts", [])}
        if "--config" not in known:
            cmd.params.append(click.Option(
                ["--config", "late_config"], type=click.Path(dir_okay=False), default=None,
                expose_value=False, callback=_late_option("config"),
                help="infergate TOML file (as the group's --config)."))
        if "--redis-url" not in known:
            cmd.params.append(click.Option(
                ["--redis-url", "late_redis_url"], default=None, expose_value=False,
                callback=_late_option("redis_url"),
                help="Redis URL; overrides the config file (as the group's --redis-url)."))
        super().add_command(cmd, name)


def actor() -> str:
    """``cli:<login name>`` (``cli:unknown`` when the user cannot be determined). A name
    that is not UTF-8 (``LOGNAME`` of other bytes, which Python holds as surrogates) or
    holds control characters gets ``?`` for those, so the events and pages that show it
    can always be written."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        return "cli:unknown"
    clean = "".join(c if c.isprintable() and not c.isspace() else "?" for c in name)[:64]
    return f"cli:{clean or 'unknown'}"


def run_or_exit(ctx: Ctx, fn: Callable[[], Any], errors: tuple[type[Exception], ...]) -> Any:
    """Call ``fn``; the given errors (their message) and Redis errors become exit 1."""
    try:
        return fn()
    except errors as exc:
        raise click.ClickException(getattr(exc, "message", None) or str(exc)) from None
    except redis.exceptions.RedisError as exc:
        url = ctx.settings.redis.url
        if refused_credentials(exc):
            raise click.ClickException(f"at {redact(url)}: {describe_error(exc)}") from None
        if (os.environ.get("INFERGATE_REDIS_URL") or "").strip() == url:
            hint = ("INFERGATE_REDIS_URL names it: the stack whose banner printed that line may "
                    "have stopped; unset it, or export the line of the running stack's banner")
        else:
            hint = ("for a stack started by `infergate up`, pass --config WORKDIR/infergate.toml "
                    "or set INFERGATE_REDIS_URL as its banner shows")
        raise click.ClickException(f"cannot reach Redis at {redact(url)}: {exc} ({hint})") from None


def read_json_file(path: str) -> Any:
    """The JSON document in file ``path`` (``-``: standard input), for the import
    commands. Raises ``click.ClickException`` naming the file when it is not JSON."""
    import json

    with click.open_file(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as exc:
            raise click.ClickException(f"{path}: not JSON: {exc}") from None


class PlainNumber(click.ParamType):
    """A click option value that is a plain decimal number ("1", "0.5"), as a float:
    ``type=float`` would also read "1_000", "1e3" and "inf"."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        if not DECIMAL_RE.match(str(value).strip()):
            self.fail(f"{value!r} is not a plain decimal number such as 1 or 0.5", param, ctx)
        return float(value)


def write_text_file(path: str, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to file ``path`` (created with ``mode``, or truncated), for the
    export commands. Raises ``click.ClickException`` naming the file when it cannot be
    written (no such folder, no room, no permission)."""
    import os

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror or exc}") from None


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain text table, columns padded to their widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def split_listen(value: str, what: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> ``(host, port)`` (:class:`HostPort`); raises
    ``click.BadParameter`` naming ``what``."""
    try:
        hp = HostPort.parse(value, what)
    except HostPortError as exc:
        raise click.BadParameter(str(exc), param_hint=what) from None
    return hp.host, hp.port
