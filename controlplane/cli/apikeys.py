"""``infergate keys``: API keys of the edge from the shell, straight on Redis.

- ``create --tenant T [--rpm N] [--tpm N] [--label TEXT] [--json]``: makes a key and
  prints it **once** (only its SHA-256 is stored); ``--rpm`` / ``--tpm`` are requests and
  tokens per minute (left out = no limit).
- ``list [--active] [--json]``: id, tenant, label, rpm, tpm, created, revoked (UTC) —
  never the key, which is not stored.
- ``revoke ID``: the edges refuse the key at most ``auth.cache_ttl_s`` seconds later.

Changes write ``key_create`` / ``key_revoke`` events (actor ``cli:<user>``), like the
admin API. Errors (invalid value, unknown id, Redis unreachable, bad config) print a
message and exit with status 1. Storage: :mod:`controlplane.admin.apikeys`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from controlplane.admin import apikeys
from controlplane.routing import registry
from controlplane.cli.common import Ctx, actor, run_or_exit, table


def _run(ctx: Ctx, fn: Callable[[], Any]) -> Any:
    return run_or_exit(ctx, fn, (apikeys.ApiKeyError,))


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _limit(v: int | None) -> str:
    return "-" if v is None else str(v)


@click.group("keys")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (default: built-in defaults).")
@click.option("--redis-url", default=None, help="Redis URL; overrides the config file.")
@click.pass_context
def keys_cmd(ctx: click.Context, config: str | None, redis_url: str | None) -> None:
    """Create, list and revoke the API keys the edge checks (auth.mode = "required")."""
    ctx.obj = Ctx(config, redis_url)


@keys_cmd.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to (letters, digits, '-', '_', '.').")
@click.option("--rpm", type=int, default=None, help="Requests per minute (>= 1); default: no limit.")
@click.option("--tpm", type=int, default=None,
              help="Tokens per minute, prompt + completion (>= 1); default: no limit.")
@click.option("--label", default=None, help="A note shown in the list (at most 200 characters).")
@click.option("--json", "as_json", is_flag=True, help='Print {"key", "id", "tenant", ...} as JSON.')
@click.pass_obj
def create_cmd(c: Ctx, tenant: str, rpm: int | None, tpm: int | None, label: str | None,
               as_json: bool) -> None:
    """Create a key for TENANT and print it once."""
    plaintext, rec = _run(c, lambda: apikeys.create_key(c.r, tenant, rpm=rpm, tpm=tpm, label=label))
    _run(c, lambda: registry.add_event(c.r, "key_create", "", actor(),
                                       {"id": rec.id, "tenant": rec.tenant},
                                       maxlen=c.settings.controlplane.events_max))
    if as_json:
        click.echo(json.dumps({"key": plaintext, **rec.to_dict()}, indent=2))
        return
    click.echo(f"created key {rec.id} for tenant {rec.tenant} "
               f"(rpm {_limit(rec.rpm)}, tpm {_limit(rec.tpm)})")
    click.echo(plaintext)
    click.echo("Store it now: it is not shown again. Clients send it as "
               "'Authorization: Bearer <key>'.", err=True)


@keys_cmd.command("list")
@click.option("--active", is_flag=True, help="Leave out revoked keys.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
@click.pass_obj
def list_cmd(c: Ctx, active: bool, as_json: bool) -> None:
    """Keys, newest first: id, tenant, label, limits, created, revoked (never the key)."""
    recs = _run(c, lambda: apikeys.list_keys(c.r, include_revoked=not active))
    if as_json:
        click.echo(json.dumps([k.to_dict() for k in recs], indent=2))
        return
    if not recs:
        click.echo("no keys")
        return
    rows = [[k.id, k.tenant, k.label or "-", _limit(k.rpm), _limit(k.tpm), _when(k.created),
             _when(k.revoked)] for k in recs]
    click.echo(table(["ID", "TENANT", "LABEL", "RPM", "TPM", "CREATED (UTC)", "REVOKED (UTC)"], rows))


@keys_cmd.command("revoke")
@click.argument("key_id")
@click.pass_obj
def revoke_cmd(c: Ctx, key_id: str) -> None:
    """Revoke the key with id KEY_ID (edges refuse it within auth.cache_ttl_s)."""
    before = _run(c, lambda: apikeys.get_key(c.r, key_id))
    if before is None:
        raise click.ClickException(f"no key with id {key_id!r} (see 'infergate keys list')")
    if before.revoked is not None:
        click.echo(f"{key_id} was already revoked at {_when(before.revoked)} UTC")
        return
    rec = _run(c, lambda: apikeys.revoke_key(c.r, key_id))
    _run(c, lambda: registry.add_event(c.r, "key_revoke", "", actor(),
                                       {"id": rec.id, "tenant": rec.tenant},
                                       maxlen=c.settings.controlplane.events_max))
    click.echo(f"revoked {rec.id} (tenant {rec.tenant}); edges refuse it within "
               f"{c.settings.auth.cache_ttl_s:g} s")
