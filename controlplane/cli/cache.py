"""``infergate cache stats|purge``: the response cache from the shell (via Redis).

- ``infergate cache stats [--json]``: entries, estimated memory, counters and hit rates
  (0-1) from :func:`controlplane.cache.store.stats`.
- ``infergate cache purge --tenant T --model M --namespace N`` (any of them, combined
  with AND) or ``--all``: deletes entries and their index memberships
  (:func:`controlplane.cache.store.purge`) and writes a ``cache_purge`` event with actor
  ``cli:<user>``. ``--all`` also deletes the embedder's vector hashes
  (``infergate:v1:cache:vec:*``); after a scoped purge the vectors of the deleted entries
  stay until their TTL, and the embedder never answers with a vector whose entry is gone
  (a semantic hit on a purged entry is a miss). ``--all`` asks for confirmation unless
  ``--yes``.

Errors (no scope, bad value, Redis unreachable) exit 1 with a message.
"""

from __future__ import annotations

import json

import click

from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.cli.nodes import Ctx, actor, run, table


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1048576:.2f} MiB"


@click.group("cache")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (default: built-in defaults).")
@click.option("--redis-url", default=None, help="Redis URL; overrides the config file.")
@click.pass_context
def cache_cmd(ctx: click.Context, config: str | None, redis_url: str | None) -> None:
    """Response cache: counters, hit rates and purge."""
    ctx.obj = Ctx(config, redis_url)


@cache_cmd.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.pass_obj
def stats_cmd(c: Ctx, as_json: bool) -> None:
    """Entries, memory, counters and hit rates of the response cache."""
    st = run(c, lambda: cache_store.stats(c.r))
    if as_json:
        click.echo(json.dumps(st.to_dict(), indent=2))
        return
    rows = [
        ("entries", str(st.entries)),
        ("memory (entries, estimated)", _mib(st.memory_bytes)),
        ("redis used_memory", _mib(st.redis_used_memory)),
        ("lookups", str(st.lookups)),
        ("hits exact", str(st.hits_exact)),
        ("hits semantic", str(st.hits_semantic)),
        ("misses", str(st.misses)),
        ("bypass", str(st.bypass)),
        ("stores", str(st.stores)),
        ("hit rate", _rate(st.hit_rate)),
        ("hit rate exact", _rate(st.hit_rate_exact)),
        ("hit rate semantic", _rate(st.hit_rate_semantic)),
    ]
    click.echo(table(("figure", "value"), rows))


def _purge_vectors(c: Ctx, batch: int = 500) -> int:
    n = 0
    buf: list[str] = []
    for k in c.r.scan_iter(match=keynames.CACHE_VEC_PREFIX + "*", count=1000):
        buf.append(k)
        if len(buf) >= batch:
            n += int(c.r.unlink(*buf))
            buf = []
    if buf:
        n += int(c.r.unlink(*buf))
    return n


@cache_cmd.command("purge")
@click.option("--tenant", default=None, help="Only entries of this tenant.")
@click.option("--model", default=None, help="Only entries of this model.")
@click.option("--namespace", default=None, help="Only entries of this semantic namespace (hex).")
@click.option("--all", "purge_all", is_flag=True, help="Every entry, index and vector.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation of --all.")
@click.pass_obj
def purge_cmd(c: Ctx, tenant: str | None, model: str | None, namespace: str | None,
              purge_all: bool, yes: bool) -> None:
    """Delete cache entries by tenant/model/namespace (AND), or all of them."""
    scoped = any(v not in (None, "") for v in (tenant, model, namespace))
    if purge_all and scoped:
        raise click.UsageError("--all cannot be combined with --tenant/--model/--namespace")
    if not purge_all and not scoped:
        raise click.UsageError("give --tenant, --model, --namespace or --all")
    if purge_all and not yes:
        n = run(c, lambda: cache_store.estimate(c.r, all=True))
        click.confirm(f"Delete all {n} cache entries?", abort=True)

    def do() -> tuple[int, int, dict]:
        if purge_all:
            scope: dict = {"all": True}
            n = cache_store.purge(c.r, all=True)
            vecs = _purge_vectors(c)
        else:
            scope = {k: v for k, v in (("tenant", tenant), ("model", model),
                                       ("namespace", namespace)) if v not in (None, "")}
            n = cache_store.purge(c.r, **scope)
            vecs = 0
        registry.add_event(c.r, "cache_purge", "", actor(), {**scope, "purged": n},
                           maxlen=c.events_max)
        return n, vecs, scope

    try:
        n, vecs, scope = run(c, do)
    except cache_store.CacheStoreError as exc:
        raise click.ClickException(str(exc)) from None
    extra = f", {vecs} vectors" if purge_all else ""
    click.echo(f"purged {n} entries{extra} ({', '.join(f'{k}={v}' for k, v in scope.items())})")
