"""``infergate nodes``: the node registry and drain from the shell, straight on Redis.

Changes write events with actor ``cli:<user>``. Errors (unknown node, invalid value,
duplicate name, Redis unreachable, bad config) print a message and exit with status 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import click
import redis

from controlplane.redisdb import keynames
from controlplane.config import Settings
from controlplane.routing import ownaddrs, registry
from controlplane.routing.nodekind import hint_of
from controlplane.cli.common import (ConnectedGroup, Ctx, PlainNumber, actor, read_json_file,
                                     run_or_exit, table, write_text_file)
from controlplane.admin import nodebackup, ops
from controlplane.admin.nodeview import NodeView, build_views

KINDS = ("vllm", "tgi", "sglang", "json", "openai")
#: Age (s) of the routing snapshot past which no control plane is taken to publish (at
#: least five of its poll intervals).
STALE_SNAPSHOT_S = 10.0


def run(ctx: Ctx, fn: Callable[[], Any]) -> Any:
    """Call ``fn`` and turn admin and Redis errors into a clean exit 1."""
    return run_or_exit(ctx, fn, (ops.AdminError,))


def _f(x: float | None, fmt: str = "{:g}") -> str:
    return "-" if x is None else fmt.format(x)


@click.group("nodes", cls=ConnectedGroup)
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (default: built-in defaults).")
@click.option("--redis-url", default=None, help="Redis URL; overrides the config file.")
@click.pass_context
def nodes_cmd(ctx: click.Context, config: str | None, redis_url: str | None) -> None:
    """Inspect and change the node registry; drain and undrain nodes."""
    ctx.obj = Ctx(config, redis_url)


def _maxconc(v: NodeView) -> str:
    """``64``, or ``2 (slots)`` when the snapshot routes fewer (a llama.cpp node's slots)."""
    routed = v.routed_max_concurrency
    if routed is not None and routed < v.max_concurrency:
        return f"{routed} (slots)"
    return str(v.max_concurrency)


def _kind(v: NodeView) -> str:
    """KIND column: the configured kind, or the metrics dialect the control plane read
    from the node after it when it differs (``vllm: llamacpp (detected)`` for a llama.cpp
    server added with the default kind, whose metrics are read under it)."""
    if v.dialect and v.dialect != v.kind:
        return f"{v.kind}: {v.dialect} (detected)"
    return v.kind


def _health(v: NodeView) -> str:
    """HEALTH column: up, down, credentials refused (401/403 to the polls), stalled (no
    progress, not busy) or ? (never polled)."""
    if v.status in ("credentials refused", "stalled"):
        return v.status
    return {True: "up", False: "down", None: "?"}[v.healthy]


@nodes_cmd.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the merged node views as JSON.")
@click.pass_obj
def list_cmd(c: Ctx, as_json: bool) -> None:
    """Registered nodes with state, health and latest metrics."""
    views = run(c, lambda: build_views(c.r, c.settings))
    if as_json:
        click.echo(json.dumps([v.to_dict() for v in views], indent=2))
        return
    if not views:
        click.echo("no nodes registered")
        return
    rows = [[v.name, v.state, _health(v), _kind(v), v.url,
             _f(v.weight), _maxconc(v), _f(v.queue_depth), _f(v.running),
             _f(None if v.kv_cache_usage is None else v.kv_cache_usage * 100, "{:.0f}%"),
             str(v.inflight), _f(v.poll_age_s, "{:.1f}s")] for v in views]
    click.echo(table(["NAME", "STATE", "HEALTH", "KIND", "URL", "WEIGHT", "MAXCONC", "QUEUE",
                      "RUNNING", "KV", "INFLIGHT", "POLLED"], rows))
    for v in views:  # a node whose kind needs a setting: one line each
        if (hint := hint_of(v.last_error)) is not None:
            click.echo(f"{v.name}: {hint}")


def _node_options(fn: Callable) -> Callable:
    fn = click.option("--health-path", default=None, help="Health path (default /health).")(fn)
    fn = click.option("--metrics-path", default=None, help="Metrics path (default /metrics).")(fn)
    fn = click.option("--max-concurrency", type=int, default=None,
                      help="Requests the node runs at once (>= 1, default 64).")(fn)
    fn = click.option("--weight", type=PlainNumber(), default=None,
                      help="Routing weight, relative to the other nodes (0.001 to 1000, "
                           "default 1).")(fn)
    fn = click.option("--kind", type=click.Choice(KINDS), default=None,
                      help="Metrics dialect (default vllm).")(fn)
    fn = click.option("--model", "models", multiple=True, callback=_models_given,
                      help="A model id the node serves (repeat for several; default: read "
                           "from its /v1/models, unless kind openai).")(fn)
    return fn


def _models_given(_ctx: click.Context, _param: click.Parameter,
                  value: tuple[str, ...]) -> list[str] | None:
    return list(value) if value else None


def _given(**kw: Any) -> dict:
    return {k: v for k, v in kw.items() if v is not None}


def url_settings(c: Ctx) -> Settings | None:
    """The settings a node URL is checked against (:func:`ops.node_url_refusal`): the
    configuration file's; without ``--config``, the defaults only while no running stack
    publishes its addresses (:func:`ownaddrs.published`, always checked): the defaults'
    ports (8080, 8081, ...) are not that stack's, and may be a node's (llama-server's
    default is 8080)."""
    if c.config is not None:
        return c.settings
    return None if run(c, lambda: ownaddrs.published(c.r)) else c.settings


@nodes_cmd.command("add")
@click.argument("name")
@click.argument("url")
@_node_options
@click.pass_obj
def add_cmd(c: Ctx, name: str, url: str, **opts: Any) -> None:
    """Register node NAME at URL (server root, e.g. http://10.0.0.5:8000)."""
    check = url_settings(c)
    node = run(c, lambda: ops.add_node(c.r, {"name": name, "url": url, **_given(**opts)},
                                       actor(), c.events_max, settings=check))
    click.echo(f"added {node.name} ({node.kind}, {node.url}, weight {node.weight:g})")
    warn_if_unreachable(node.url)
    warn_if_unpublished(c)


def warn_if_unreachable(url: str, timeout_s: float = 1.0) -> None:
    """A warning on stderr when nothing accepts a TCP connection at ``url``'s host and
    port within ``timeout_s`` (the node is registered all the same: it may start
    later; the control plane reports it down until it answers)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        click.echo(f"warning: nothing answers at {parts.hostname}:{port} now "
                   f"({exc.strerror or exc}); the node is added and shows down until it does",
                   err=True)


@nodes_cmd.command("edit")
@click.argument("name")
@click.option("--url", default=None, help="New server root URL.")
@_node_options
@click.pass_obj
def edit_cmd(c: Ctx, name: str, **opts: Any) -> None:
    """Change fields of node NAME (only those given; "nothing changed" when they have
    these values already)."""
    changes = _given(**opts)
    if not changes:
        raise click.UsageError("nothing to change: give --url, --kind, --weight, "
                               "--max-concurrency, --metrics-path, --health-path or --model")
    check = url_settings(c)
    res = run(c, lambda: ops.change_node(c.r, name, changes, actor(), c.events_max,
                                         settings=check))
    if not res.diff:
        click.echo(f"{name}: nothing changed (it has these values already)")
        return
    click.echo(f"saved {res.node.name}: " + ", ".join(f"{k}={getattr(res.node, k)}"
                                                      for k in res.diff))
    warn_if_unpublished(c)


@nodes_cmd.command("remove")
@click.argument("name")
@click.pass_obj
def remove_cmd(c: Ctx, name: str) -> None:
    """Remove node NAME with its state, metrics and history."""
    run(c, lambda: ops.remove_node(c.r, name, actor(), c.events_max))
    click.echo(f"removed {name}")
    warn_if_unpublished(c)


def snapshot_age(c: Ctx) -> float | None:
    """Seconds since a control plane last published the routing snapshot (its
    ``generated_at``), None when there is none or it cannot be read."""
    try:
        raw = c.r.get(keynames.ROUTING)
        return max(0.0, time.time() - float(json.loads(raw)["generated_at"])) if raw else None
    except (redis.RedisError, ValueError, TypeError, KeyError):
        return None


def warn_if_unpublished(c: Ctx) -> None:
    """A warning on stderr when no control plane has published a routing snapshot lately:
    the edges see registry and drain changes only through it, so a change written here
    waits until one runs again (none started, or it is stopped or frozen)."""
    age = snapshot_age(c)
    limit = max(STALE_SNAPSHOT_S, 5 * c.settings.controlplane.poll_interval_s)
    if age is not None and age <= limit:
        return
    when = "yet" if age is None else f"for {age:.0f} s"
    click.echo(f"warning: no control plane has published a routing snapshot {when} (none "
               "runs, or it is stopped or frozen): the edges apply this change once one "
               "does", err=True)


@nodes_cmd.command("drain")
@click.argument("name")
@click.option("--wait", is_flag=True, help="Wait until the control plane marks it drained.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds to wait with --wait.")
@click.pass_obj
def drain_cmd(c: Ctx, name: str, wait: bool, timeout: float) -> None:
    """Stop sending new requests to NAME; in-flight ones finish. Warns when no active
    node is left for a model NAME serves (its requests get 503 until one is back)."""
    ch = run(c, lambda: ops.drain(c.r, name, actor(), c.events_max))
    click.echo(f"{name}: {'draining' if ch.changed else 'already ' + ch.state}")
    if ch.warning:
        click.echo(f"warning: {ch.warning}", err=True)
    if ch.changed:
        warn_if_unpublished(c)
    if not wait or ch.state == "drained":
        return
    deadline = time.monotonic() + timeout
    while True:
        st = run(c, lambda: registry.get_state(c.r, name))
        if st.state == "drained":
            click.echo(f"{name}: drained")
            return
        if st.state == "active":
            raise click.ClickException(f"{name} was undrained while waiting")
        if time.monotonic() >= deadline:
            raise click.ClickException(f"{name} still {st.state} after {timeout:g} s")
        time.sleep(0.25)


@nodes_cmd.command("undrain")
@click.argument("name")
@click.pass_obj
def undrain_cmd(c: Ctx, name: str) -> None:
    """Send requests to NAME again (its share ramps up during slow start)."""
    ch = run(c, lambda: ops.undrain(c.r, name, actor(), c.events_max))
    click.echo(f"{name}: {'active' if ch.changed else 'already active'}")
    if ch.changed:
        warn_if_unpublished(c)


@nodes_cmd.command("export")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write to this file instead of stdout.")
@click.pass_obj
def export_cmd(c: Ctx, out_path: str | None) -> None:
    """Print every node with its drain state as JSON, for a backup (what `nodes import`
    writes back: run-time nodes, weights and drains live only in Redis)."""
    doc = run(c, lambda: nodebackup.export_nodes(c.r))
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if out_path is None:
        click.echo(text, nl=False)
        return
    write_text_file(out_path, text)
    click.echo(f"exported {len(doc['nodes'])} node(s) to {out_path}", err=True)


@nodes_cmd.command("import")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--overwrite", is_flag=True,
              help="Replace the fields and drain state of nodes already registered.")
@click.pass_obj
def import_cmd(c: Ctx, path: str, overwrite: bool) -> None:
    """Write the nodes of an export file (PATH, - for stdin) back into the registry."""
    doc = read_json_file(path)
    check = url_settings(c)
    res = run(c, lambda: nodebackup.import_nodes(c.r, doc, actor(), overwrite=overwrite,
                                                 events_max=c.events_max, settings=check))
    click.echo(f"imported {len(res.added)} node(s), replaced {len(res.replaced)}, "
               f"{len(res.kept)} already registered"
               + ("" if overwrite or not res.kept else " (kept as they are; --overwrite "
                  "replaces them)"))
    for name, why in res.skipped.items():
        click.echo(f"skipped {name}: {why}", err=True)
    if res.added or res.replaced:
        warn_if_unpublished(c)
    if res.skipped:
        raise SystemExit(1)
