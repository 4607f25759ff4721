"""The ``infergate up`` command: its options, and the steps it runs in order (see the
package's docstring)."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import click
import redis as redis_lib

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.persistence import check_persistence
from controlplane.redisdb.url import redact
from controlplane.routing import registry

from .banner import REDIS_URL_FROM_ENV, _again_command, print_banner
from .common import _say
from .edge import (NGINX_FINISH_S, choose_metrics_port, start_controlplane, start_edge,
                   watch_controlplane)
from .embedder import EmbedderKeeper, _start_embedder
from .logs import DEFAULT_MAX_MB, LogCap, log_dirs
from .nodes import SIM_NODES, _sim_nodes
from .owner import _release_owner, check_workdir_free, claim_registry
from .plan import UpRun, make_plan, open_workdir
from .store import _ensure_redis, _own_cluster, _own_redis
from .supervise import _supervise

#: Label of the key ``up`` creates for the tenant ``demo`` (and revokes at its next start).
DEMO_KEY_LABEL = "infergate up demo key"


def trap_signals(run: UpRun) -> None:
    """Ctrl-C, kill, and a closed terminal or ssh session (SIGHUP) set ``run.stop``; a
    second one also sets ``run.hurry`` (cut the requests in flight). If up itself is
    killed outright, the kernel stops its parts (procs.Managed)."""
    def on_signal(signum: int, _frame: object) -> None:
        if run.stop.is_set():
            run.hurry.set()  # a second Ctrl-C: cut the requests in flight
        run.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)


def start_redis(run: UpRun) -> None:
    """The Redis named on purpose (started there when it is local and silent), else this
    stack's own; then this stack claims its node registry (``--take-over``). A Redis
    named on purpose that keeps nothing across a restart (or whose ``CONFIG`` is
    refused) gets one line (:mod:`controlplane.redisdb.persistence`)."""
    settings = run.settings
    if run.redis_cluster:
        if run.shared_redis:
            raise click.ClickException("--redis-cluster starts this stack's own cluster: "
                                       f"leave out the Redis named by {run.redis_named_by}")
        run.redis_desc = _own_cluster(settings, run.wd, run.stack)
    else:
        run.redis_desc = (_ensure_redis(settings, run.wd, run.stack) if run.shared_redis
                          else _own_redis(settings, run.wd, run.stack))
    run.owner_r = make_redis(settings.redis)
    where = settings.redis.url.split("@")[-1]
    try:
        claim_registry(run.owner_r, run.owner_doc, run.take_over, where, run.redis_named_by)
        # a Redis named on purpose may keep nothing across a restart (this stack's own
        # keeps an append-only file): say so once, now
        line = (check_persistence(run.owner_r).warning(settings.redis.url)
                if run.shared_redis else None)
    except redis_lib.RedisError as exc:
        raise click.ClickException(f"Redis at {where}: {exc}") from None
    if line:
        _say(line)


def start_nodes(run: UpRun) -> None:
    """The ``--node`` servers (a line says so when the file has nodes too: they are
    left out), else the file's nodes, else the simulated pool (started)."""
    if run.node_urls:
        nodes = run.nodes
        if run.settings.nodes:
            names = ", ".join(n.name for n in run.settings.nodes)
            _say(f"--node replaces the nodes of the file ({names}): they are not used "
                 "(leave out --node to front them)")
    elif run.settings.nodes:
        nodes = run.settings.nodes
    else:
        assert run.owner_r is not None   # start_redis comes first
        removed = registry.removed_at_run_time(run.owner_r, [n for n, _ in SIM_NODES])
        names = [n for n, _ in SIM_NODES if n not in removed]
        if removed:
            _say(f"simulated node(s) {', '.join(sorted(removed))} removed at run time by an "
                 "earlier run on this folder: not started again (a new folder starts the "
                 "whole pool)")
        _say(f"starting {len(names)} simulated nodes: {', '.join(names)}")
        nodes = _sim_nodes(run.wd, run.stack, run.time_scale, skip=frozenset(removed))
        run.simulated = True
    run.settings.nodes = run.nodes = nodes


def seed_registry(run: UpRun) -> None:
    """Register the nodes, keeping what an earlier run on the same folder changed at run
    time (:func:`registry.seed_run_nodes`: edits kept, a removed simulated node not
    brought back, a ``--node`` server known under another name kept under it, a node of
    the file whose settings there differ from the registry's; a line for each such case)
    and, when API keys are required, create the demo key (revoking the
    one an earlier run printed)."""
    r = make_redis(run.settings.redis)
    overrides = ({"max_concurrency": run.node_max_concurrency}
                 if run.node_urls and run.node_max_concurrency is not None else None)
    seeded = registry.seed_run_nodes(r, run.nodes, by_url=bool(run.node_urls),
                                     overrides=overrides,
                                     from_file=not run.node_urls and not run.simulated)
    for note in seeded.notes:
        _say(note)
    run.settings.nodes = run.nodes = seeded.nodes
    states = registry.get_states(r)
    run.registered = [(n, states.get(n.name, registry.NodeState()).state)
                      for n in registry.list_nodes(r)]
    if run.settings.auth.mode != "required":
        return
    # one demo key at a time: the one an earlier run printed is revoked
    old = [k for k in apikeys.list_keys(r, include_revoked=False)
           if k.tenant == "demo" and k.label == DEMO_KEY_LABEL]
    done = [k.id for k in old if apikeys.revoke_key(r, k.id) is not None]
    if done:
        _say(f"revoked the demo key of an earlier run ({', '.join(done)})")
    missed = [k.id for k in old if k.id not in done]
    if missed:
        _say(f"warning: could not revoke the demo key of an earlier run ({', '.join(missed)}):"
             " revoke it with `infergate keys revoke ID`")
    run.demo_key, _ = apikeys.create_key(r, "demo", label=DEMO_KEY_LABEL)


def start_semantic_cache(run: UpRun) -> None:
    """The embedder (:func:`_start_embedder`); says on stderr when the semantic cache is
    off."""
    run.semantic_desc = _start_embedder(run.settings, run.wd, run.stack,
                                        config_path=run.config_path)
    if run.semantic_desc.startswith("off ("):
        click.echo(f"semantic cache is off: {run.semantic_desc[5:-1]}", err=True)


def supervise(run: UpRun) -> str:
    """Keep the stack running until a stop (:func:`_supervise`; the embedder kept by an
    :class:`EmbedderKeeper`, the control plane by a health watch); returns why it stopped
    everything, ``""`` on a requested stop."""
    emb = next((x for x in run.stack.items if x.name == "embedder"), None)
    keeper = (EmbedderKeeper(emb, run.settings, run.stack, run.wd, run.cfg) if emb is not None
              and run.settings.cache.semantic else None)
    watch_controlplane(run)
    assert run.owner_r is not None
    logs = LogCap(log_dirs(run.wd), run.log_max_mb * 2**20, _say)
    return _supervise(run.stack, run.stop, run.owner_r, run.owner_doc, embedder=keeper,
                      logs=logs)


def stop_all(run: UpRun) -> None:
    """Stop every part started, in reverse order (nginx finishing the requests in flight
    unless a second Ctrl-C hurries it), and free the registry; the work folder is kept."""
    if run.cp_watch is not None:
        run.cp_watch.stop()
    if run.owner_r is not None:
        _release_owner(run.owner_r, run.owner_doc)
    if not run.stack.items and not run.up:
        # refused before any part started (Redis not there or owned by another stack):
        # nothing to stop, no log to keep, and a temp folder of its own is removed
        if run.wd_made:
            shutil.rmtree(run.wd, ignore_errors=True)
        return
    click.echo(f"stopping... (requests in flight get up to {NGINX_FINISH_S:.0f} s to "
               "finish; Ctrl-C again cuts them)", err=True)
    run.stack.stop_all(hurry=run.hurry)
    # the state (Redis's append-only file: API keys, nodes, drains, cached answers)
    # is in the folder; only a start on the same folder finds it again
    if not run.up:
        click.echo(f"stopped before the stack was up; its logs are in {run.wd}", err=True)
        return
    again = _again_command(run.wd)
    env = (f" with INFERGATE_REDIS_URL exported as the banner showed, "
           f"{redact(run.settings.redis.url)}" if REDIS_URL_FROM_ENV in again else "")
    click.echo(f"stopped; the work folder {run.wd} is kept (`{again}`{env} "
               "starts on its state again)", err=True)


@click.command("up")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (defaults apply without one).")
@click.option("--node", "node_urls", multiple=True, metavar="URL",
              help="A real inference server to front (repeatable), e.g. http://10.0.0.5:8000. "
                   "Without it, three simulated nodes are started.")
@click.option("--node-kind", default="vllm", show_default=True,
              type=click.Choice(["vllm", "tgi", "sglang", "json", "openai"]),
              help="Metrics dialect of the --node servers (openai = no metrics endpoint).")
@click.option("--node-health-path", default=None, metavar="PATH",
              help="Health path of the --node servers [default: /health]. Must not wait on "
                   "the model; for openai nodes without one, any HTTP answer counts as alive.")
@click.option("--node-max-concurrency", default=None, type=click.IntRange(1, 100000),
              help="Most requests the edge keeps in flight on each --node server. "
                   "Default 64: only a cap; the edge learns how many the server really "
                   "runs at once (at most this) and queues by that. Any other value is a "
                   "hard limit: requests beyond it wait at the edge; give the server's own "
                   "slots (1 for llama-cpp-python, --parallel N for llama.cpp's server).")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Edge address [default: edge.listen, 127.0.0.1:8080].")
@click.option("--admin-listen", default=None, metavar="HOST:PORT",
              help="Admin page and API address [default: controlplane.listen, 127.0.0.1:8081].")
@click.option("--redis-url", default=None,
              help="A Redis to share (one started here when nothing answers at a loopback "
                   "redis:// URL) [default: INFERGATE_REDIS_URL, else the file's redis.url, "
                   "else this stack's own redis-server on a free port].")
@click.option("--redis-cluster", is_flag=True,
              help="Start this stack's own loopback Redis Cluster (3 masters + 3 replicas) "
                   "instead of one redis-server: a demo of the cluster support.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Folder for logs, rendered nginx config and Redis [default: a new temp dir].")
@click.option("--time-scale", default=1.0, show_default=True,
              type=click.FloatRange(min=0.0, min_open=True),
              help="Time scale of the simulated nodes (0.1 = ten times faster).")
@click.option("--take-over", is_flag=True,
              help="With a shared Redis: replace the node registry even while another "
                   "running infergate up owns it.")
@click.option("--log-max-mb", default=DEFAULT_MAX_MB, show_default=True,
              type=click.IntRange(0, 10**6),
              help="Cap of each log file of the stack (nginx's access log included), MiB: "
                   "one past it keeps its last quarter in <name>.1 and starts again "
                   "empty. 0: no cap.")
@click.option("--instance-id", default=None, metavar="ID",
              help="Id of this stack, echoed by every part's health answer "
                   "[default: a new random one].")
def up_cmd(config_path: str | None, node_urls: tuple[str, ...], node_kind: str,
           node_health_path: str | None, node_max_concurrency: int | None,
           listen: str | None, admin_listen: str | None, redis_url: str | None,
           workdir: str | None, time_scale: float, take_over: bool = False,
           instance_id: str | None = None, redis_cluster: bool = False,
           log_max_mb: int = DEFAULT_MAX_MB) -> None:
    """Run the whole stack locally: Redis, nodes, embedder, control plane, nginx edge."""
    if workdir:
        check_workdir_free(Path(workdir))
    run = make_plan(config_path, node_urls, node_kind, node_health_path,
                    node_max_concurrency, listen, admin_listen, redis_url, time_scale,
                    take_over, instance_id)
    run.redis_cluster = redis_cluster
    run.log_max_mb = log_max_mb
    open_workdir(run, workdir)
    trap_signals(run)
    try:
        start_redis(run)
        start_nodes(run)
        seed_registry(run)
        start_semantic_cache(run)
        choose_metrics_port(run)
        start_controlplane(run)
        start_edge(run)
        print_banner(run)
        run.up = True
        failed = supervise(run)
    except procs.StartError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        stop_all(run)
    if failed:
        raise click.ClickException(failed)
