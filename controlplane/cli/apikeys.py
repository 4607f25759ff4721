"""``infergate keys``: API keys of the edge from the shell, straight on Redis.

- ``create --tenant T [--rpm N] [--tpm N] [--weight W] [--priority P] [--label TEXT]
  [--json]``: makes a key and
  prints it **once** (only its SHA-256 is stored); ``--rpm`` / ``--tpm`` are requests and
  tokens per minute (left out = no limit); ``--weight`` / ``--priority`` its fair share
  (``critical``, ``standard``, ``sheddable``; left out = the tenant's default).
- ``list [--active] [--json]``: id, tenant, label, rpm, tpm, weight, priority
  (``default``: the tenant's), created, revoked (UTC) —
  never the key, which is not stored.
- ``edit ID [--rpm N|none] [--tpm N|none] [--weight W|none] [--priority P|none]
  [--label TEXT]``: new limits (``none`` = no limit), fair share (``none`` = the
  tenant's default) or label; the edges apply them at most ``auth.cache_ttl_s`` seconds later.
- ``revoke ID``: the edges refuse the key at most ``auth.cache_ttl_s`` seconds later (an
  edge that cannot reach Redis meanwhile keeps a key it knew valid for up to
  ``auth.stale_ttl_s``: fail-static); returns once the running control planes' copies of
  the state hold the revocation (:mod:`controlplane.routing.keycopies`, a poll interval
  or two), and warns on stderr when they did not.
- ``export [--out FILE]``: every key's hash and record as JSON (a backup: only hashes
  are stored, so a lost key store cannot be rebuilt any other way; the file holds no
  usable key). ``import FILE [--overwrite]``: writes them back; keys already present are
  kept (``--overwrite``: the file's label, limits and fair share win, but a key revoked
  here stays revoked: named in the output), an id taken by another key is refused.

Changes go through the same operations as the admin API and page
(:mod:`controlplane.admin.ops`) and write ``key_create`` / ``key_edit`` / ``key_revoke`` events (actor
``cli:<user>``). Errors (invalid value, unknown id, Redis unreachable, bad config) print
a message and exit with status 1. Storage: :mod:`controlplane.admin.apikeys`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click

from controlplane.admin import apikeys, ops
from controlplane.cli.common import (ConnectedGroup, Ctx, PlainNumber, actor, read_json_file,
                                     run_or_exit, table, write_text_file)


def _run(ctx: Ctx, fn: Callable[[], Any]) -> Any:
    return run_or_exit(ctx, fn, (ops.AdminError, apikeys.ApiKeyError))


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _limit(v: int | None) -> str:
    return "-" if v is None else str(v)


def _share(v: float | str | None) -> str:
    """A key's weight or priority: ``default`` when unset (the tenant's, ``[admission]``)."""
    return "default" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _summary(rec: apikeys.ApiKey) -> str:
    return (f"rpm {_limit(rec.rpm)}, tpm {_limit(rec.tpm)}, weight {_share(rec.weight)}, "
            f"priority {_share(rec.priority)}, label {rec.label or '-'}")


@click.group("keys", cls=ConnectedGroup)
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (default: built-in defaults).")
@click.option("--redis-url", default=None, help="Redis URL; overrides the config file.")
@click.pass_context
def keys_cmd(ctx: click.Context, config: str | None, redis_url: str | None) -> None:
    """Create, list, edit and revoke the API keys the edge checks (auth.mode = "required")."""
    ctx.obj = Ctx(config, redis_url)


@keys_cmd.command("create")
@click.option("--tenant", required=True, help="Tenant the key belongs to (letters, digits, '-', '_', '.').")
@click.option("--rpm", type=int, default=None, help="Requests per minute (>= 1); default: no limit.")
@click.option("--tpm", type=int, default=None,
              help="Tokens per minute, prompt + completion (>= 1); default: no limit.")
@click.option("--label", default=None, help="A note shown in the list (at most 200 characters).")
@click.option("--weight", type=PlainNumber(), default=None,
              help="Fair-share weight (0.01-1000); default: the tenant's ([admission]).")
@click.option("--priority", type=click.Choice(apikeys.PRIORITIES), default=None,
              help="Priority class; default: the tenant's ([admission]).")
@click.option("--json", "as_json", is_flag=True, help='Print {"key", "id", "tenant", ...} as JSON.')
@click.pass_obj
def create_cmd(c: Ctx, tenant: str, rpm: int | None, tpm: int | None, label: str | None,
               weight: float | None, priority: str | None, as_json: bool) -> None:
    """Create a key for TENANT and print it once."""
    plaintext, rec = _run(c, lambda: ops.create_key(
        c.r, {"tenant": tenant, "rpm": rpm, "tpm": tpm, "label": label, "weight": weight,
              "priority": priority}, actor(), c.events_max))
    if as_json:
        click.echo(json.dumps({"key": plaintext, **rec.to_dict()}, indent=2))
        return
    click.echo(f"created key {rec.id} for tenant {rec.tenant} "
               f"(rpm {_limit(rec.rpm)}, tpm {_limit(rec.tpm)}, weight {_share(rec.weight)}, "
               f"priority {_share(rec.priority)})")
    click.echo(plaintext)
    click.echo("Store it now: it is not shown again. Clients send it as "
               "'Authorization: Bearer <key>'.", err=True)
    if _run(c, lambda: apikeys.loss_pending(c.r)):
        click.echo("warning: the key store was lost (Redis came back without it) and is not "
                   "restored: the edges keep honouring the keys they knew and this one; "
                   "restore the others with `infergate keys import`.", err=True)


@keys_cmd.command("list")
@click.option("--active", is_flag=True, help="Leave out revoked keys.")
@click.option("--json", "as_json", is_flag=True, help="Print the records as JSON.")
@click.pass_obj
def list_cmd(c: Ctx, active: bool, as_json: bool) -> None:
    """Keys, newest first: id, tenant, label, limits, fair share, created, revoked
    (never the key)."""
    recs = _run(c, lambda: apikeys.list_keys(c.r, include_revoked=not active))
    if as_json:
        click.echo(json.dumps([k.to_dict() for k in recs], indent=2))
        return
    if not recs:
        click.echo("no keys")
        return
    rows = [[k.id, k.tenant, k.label or "-", _limit(k.rpm), _limit(k.tpm), _share(k.weight),
             _share(k.priority), _when(k.created), _when(k.revoked)] for k in recs]
    click.echo(table(["ID", "TENANT", "LABEL", "RPM", "TPM", "WEIGHT", "PRIORITY",
                      "CREATED (UTC)", "REVOKED (UTC)"], rows))


def _limit_arg(v: str | None) -> object:
    """``--rpm`` / ``--tpm`` text: ``none`` = no limit, else validated by the operation."""
    return None if v is not None and v.strip().lower() in ("none", "") else v


@keys_cmd.command("edit")
@click.argument("key_id")
@click.option("--rpm", default=None, help="Requests per minute (>= 1), or 'none' for no limit.")
@click.option("--tpm", default=None, help="Tokens per minute (>= 1), or 'none' for no limit.")
@click.option("--label", default=None, help="A new note (at most 200 characters).")
@click.option("--weight", default=None,
              help="Fair-share weight (0.01-1000), or 'none' for the tenant's default.")
@click.option("--priority", default=None,
              help="critical, standard or sheddable, or 'none' for the tenant's default.")
@click.pass_obj
def edit_cmd(c: Ctx, key_id: str, rpm: str | None, tpm: str | None, label: str | None,
             weight: str | None, priority: str | None) -> None:
    """Change the limits, the fair share or the label of the key with id KEY_ID."""
    changes = {k: (_limit_arg(v) if k != "label" else v)
               for k, v in (("rpm", rpm), ("tpm", tpm), ("label", label), ("weight", weight),
                            ("priority", priority)) if v is not None}
    if not changes:
        raise click.UsageError("nothing to change: give --rpm, --tpm, --weight, --priority "
                               "or --label")
    res = _run(c, lambda: ops.change_key(c.r, key_id, changes, actor(), c.events_max))
    rec = res.record
    if not res.changed:
        click.echo(f"{rec.id} (tenant {rec.tenant}): nothing changed ({_summary(rec)})")
        return
    click.echo(f"saved {rec.id} (tenant {rec.tenant}): {_summary(rec)}; edges apply it "
               f"within {c.settings.auth.cache_ttl_s:g} s")


@keys_cmd.command("revoke")
@click.argument("key_id")
@click.pass_obj
def revoke_cmd(c: Ctx, key_id: str) -> None:
    """Revoke the key with id KEY_ID (edges refuse it within auth.cache_ttl_s)."""

    def revoke() -> ops.KeyRevocation | None:
        try:
            return ops.revoke_key(c.r, key_id, actor(), c.events_max)
        except ops.NotFound:
            return None

    ch = _run(c, revoke)
    if ch is None:
        if _run(c, lambda: apikeys.store_missing(c.r)):
            raise click.ClickException(
                f"no key with id {key_id!r} in Redis, whose key store is missing (lost): the "
                "edges keep accepting the keys they knew until it is restored. Restore a "
                "backup ('infergate keys import FILE'), then revoke the key; without one, "
                "importing an export that holds no key ends the edges' kept keys, all of "
                "them (see docs/operations.md, durable state)")
        raise click.ClickException(f"no key with id {key_id!r} (see 'infergate keys list')")
    rec = ch.record
    if not ch.changed:
        click.echo(f"{key_id} was already revoked at {_when(rec.revoked)} UTC")
        return
    a = c.settings.auth
    click.echo(f"revoked {rec.id} (tenant {rec.tenant}); edges refuse it within "
               f"{a.cache_ttl_s:g} s (an edge that cannot reach Redis keeps accepting a key "
               f"it knew for up to {a.stale_ttl_s:g} s)")
    if ch.copied is False:
        click.echo("warning: no confirmation that the control planes' copies of the state "
                   "hold this revocation: should Redis lose its data before they read it, "
                   "their write-back would make the key valid again. Check it with "
                   "'infergate keys list' after a restart of Redis, and revoke it again if "
                   "needed.", err=True)


@keys_cmd.command("export")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write to this file (mode 0600) instead of stdout.")
@click.pass_obj
def export_cmd(c: Ctx, out_path: str | None) -> None:
    """Print every key's hash and record as JSON, for a backup (no plaintext keys)."""
    doc = _run(c, lambda: apikeys.export_keys(c.r))
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if out_path is None:
        click.echo(text, nl=False)
        return
    write_text_file(out_path, text, 0o600)
    click.echo(f"exported {len(doc['keys'])} key(s) to {out_path}", err=True)


@keys_cmd.command("import")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--overwrite", is_flag=True,
              help="Replace keys already present with the file's records (a key revoked "
                   "here stays revoked).")
@click.pass_obj
def import_cmd(c: Ctx, path: str, overwrite: bool) -> None:
    """Write the keys of an export file (PATH, - for stdin) back into Redis."""
    doc = read_json_file(path)
    res = _run(c, lambda: apikeys.import_keys(c.r, doc, overwrite=overwrite))
    if overwrite:
        click.echo(f"imported {len(res.added)} new key(s), replaced {len(res.kept)} "
                   "already present")
        if res.kept_revoked:
            click.echo(f"kept revoked: {', '.join(res.kept_revoked)} (revoked here, valid "
                       "in the file: an import never un-revokes a key; create a new key "
                       "instead)")
    else:
        click.echo(f"imported {len(res.added)} key(s), {len(res.kept)} already present "
                   "(kept as they are; --overwrite replaces them)")
    if res.conflicts:
        click.echo(f"refused {len(res.conflicts)}: id taken by another key here: "
                   + ", ".join(res.conflicts), err=True)
        raise SystemExit(1)
