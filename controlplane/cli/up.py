"""``infergate up``: the whole stack on one machine.

Starts, in order: its own ``redis-server`` on a free loopback port (with ``maxmemory``,
``volatile-lru`` and an append-only file in the work folder, as recommended for
production) -- or, when a Redis is named (``--redis-url``, the file's ``redis.url``,
``INFERGATE_REDIS_URL``), that one (started there when nothing answers at a local
address); three simulated
nodes of different speeds unless ``--node URL`` names real servers; the control plane
(poller, scorer, admin page and API); nginx with the rendered infergate config. The
edge requires API keys (``auth.mode = "required"``) unless the file sets ``auth.mode``:
a key for the tenant ``demo`` is created at start (the one of an earlier start is
revoked). The response cache is on unless the file sets ``cache.enabled``, with the
semantic-cache embedder (``infergate embedder``, model ``cache.embedder_model``)
started on ``cache.embedder_url`` before nginx; when the
embedder cannot start (package missing, model not loadable, port taken), the stack runs
on with the exact cache only and says so ("semantic cache off"); when it exits later,
the edge is rendered again with the semantic cache off and nginx reloaded, the embedder is
started again (on a free port when another process holds its own) and the edge pointed at
it once it answers with this stack's id (:class:`EmbedderKeeper`); the rest keeps running. Prints the URLs, the key and
a curl example; Ctrl-C or SIGTERM stops every process it started, in reverse order.

Stays up: a part that dies is restarted with back-off (0.5 s doubling to 10 s; one
line per exit with the part, its exit code, the restarts so far and its log file); a
part that fails 5 times within 60 s stops everything and ``up`` exits non-zero naming
it (the embedder is optional: it then stays off). Stays alone: the node registry of a
shared Redis belongs to one running ``up`` (key ``infergate:v1:stack_owner`` with a TTL
the owner refreshes); another refuses to start on it unless ``--take-over`` (the old
owner then says so and runs on without renewing the key). Every part
inherits the stack's instance id (``INFERGATE_INSTANCE_ID``) and echoes it in its health
answer; ``up`` counts a part ready only with its own id there, so a process of another
stack that took a port first is never adopted (the part is retried on a new free port).
While it starts, it prints one line per part as it starts it (``starting ...``), flushed,
so a slow start (the embedder loading its model) shows where it is.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import click
import redis as redis_lib

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.routing import registry
from controlplane.config import (ConfigError, HostPort, HostPortError, NodeSettings, Settings,
                                 load_settings)
from controlplane.redisdb import keynames
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.url import redact
from controlplane.simnode import launch

#: (name, speed factor) of the simulated pool: a fast, a medium and a slow GPU.
SIM_NODES: tuple[tuple[str, float], ...] = (("sim-fast", 2.0), ("sim-medium", 1.0), ("sim-slow", 0.5))
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def cli_name() -> str:
    """How to run this infergate from the shell ``up`` was started in: ``infergate`` when
    that name is on PATH (a venv that is activated, the runtime install's wrapper), else
    the script beside this interpreter (``.venv/bin/infergate``, relative to the current
    folder when it is below it)."""
    if shutil.which("infergate"):
        return "infergate"
    here = Path(sys.executable).parent / "infergate"
    if not here.exists():
        return "infergate"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def _say(line: str) -> None:
    """One progress line on stdout, flushed at once (``up`` may run under a pipe)."""
    click.echo(line)
    sys.stdout.flush()


def _split_hostport(value: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port) (:class:`HostPort`); raises
    ``click.BadParameter`` naming ``what``."""
    try:
        hp = HostPort.parse(value, what)
    except HostPortError as exc:
        raise click.BadParameter(str(exc)) from None
    return hp.host, hp.port


def _redis_answers(settings: Settings) -> bool:
    try:
        return bool(make_redis(settings.redis).ping())
    except redis_lib.RedisError:
        return False


def _own_redis(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Start this stack's own ``redis-server`` (append-only file in ``workdir/redis``) on
    a free loopback port, chosen again when another process takes it first, with a new
    random password (``requirepass``: on a shared host another user's process could
    otherwise read the stored prompts and answers, or write API keys and nodes); point
    ``settings.redis.url`` at it, password included, and return the banner description.
    Never joins a Redis that already runs (e.g. another stack's at 6379). Raises
    :class:`controlplane.procs.StartError`."""
    _say("starting redis-server (this stack's own, on a free port, with a password)")
    password = secrets.token_urlsafe(24)
    m, port = procs.start_redis_free_port(workdir / "redis", persistent=True, password=password)
    stack.add(m)
    settings.redis.url = f"redis://:{password}@127.0.0.1:{port}/0"
    return (f"{settings.redis.url} (this stack's own redis-server, password required, "
            f"maxmemory 256mb, volatile-lru, append-only file in {workdir / 'redis'})")


#: Seconds the stack-owner key lives without a refresh; ``up`` refreshes it every
#: :data:`OWNER_REFRESH_S` seconds, so a stack that died frees its registry this long later.
OWNER_TTL_S = 15
OWNER_REFRESH_S = 3.0

#: SET the owner document (ARGV[1], TTL ARGV[2] s) when the key is missing or already
#: ours; else return the current owner's document.
_OWNER_REFRESH_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return cur
"""


_OWNER_REPLACE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
return 0
"""


def _owner_gone(raw: object) -> bool:
    """Whether the stack-owner value ``raw`` names an ``up`` process of this host that no
    longer exists (killed with SIGKILL, its claim not yet expired). Any doubt (another
    host, no pid, a pid that exists, whoever runs it) is "not gone"."""
    try:
        d = json.loads(raw)  # type: ignore[arg-type]
        pid = int(d["pid"])
        if d.get("host") != socket.gethostname() or pid <= 0 or pid == os.getpid():
            return False
    except (TypeError, ValueError, KeyError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _lock_workdir(wd: Path) -> object:
    """Hold ``wd/up.lock`` (an exclusive ``flock``, released when this process ends, also
    when it is killed) so that a second ``up`` on the same folder stops before it touches
    the Redis files of the first (its password, its append-only file). Returns the open
    file, to keep while ``up`` runs. Raises ``click.ClickException`` when another ``up``
    holds it."""
    import fcntl

    f = open(wd / "up.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise click.ClickException(
            f"the work folder {wd} is in use by another infergate up (pid {other}): stop "
            "it, or give this one another --workdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _owner_doc(instance: str) -> str:
    """The stack-owner value: JSON ``{"instance_id", "pid", "host", "since"}``."""
    return json.dumps({"instance_id": instance, "pid": os.getpid(),
                       "host": socket.gethostname(), "since": round(time.time(), 3)})


def _describe_owner(raw: object) -> str:
    try:
        d = json.loads(raw)  # type: ignore[arg-type]
        return f"instance {d['instance_id']} (pid {d.get('pid')} on {d.get('host')})"
    except (TypeError, ValueError, KeyError):
        return f"owner {raw!r}"


def _first_model(nodes: list[NodeSettings], timeout: float = 2.0) -> str | None:
    """A model the nodes serve, for the banner's example: the first configured ``models``
    entry, else the first id a node lists on its OpenAI-style ``GET /v1/models``
    (read as the control plane reads it: :func:`controlplane.routing.models.parse_models`),
    asked only of nodes whose models the control plane polls too
    (:meth:`NodeSettings.polls_models`: never llama-cpp-python's, which can end a running
    stream); None when none says."""
    import requests

    from controlplane.routing.models import parse_models

    for n in nodes:
        if n.models:
            return n.models[0]
    for n in nodes:
        if not n.polls_models():
            continue
        try:
            res = requests.get(n.url.rstrip("/") + "/v1/models", timeout=timeout)
            ids = parse_models(res.text) if res.status_code == 200 else []
        except (requests.RequestException, ValueError):
            continue
        if ids:
            return ids[0]
    return None


def claim_registry(r: redis_lib.Redis, doc: str, take_over: bool, where: str,
                   named_by: str = "--redis-url") -> None:
    """Make this stack the owner of the registry in ``r`` (key
    ``keynames.STACK_OWNER``, value ``doc``, TTL :data:`OWNER_TTL_S`). Raises
    ``click.ClickException`` naming the other stack when a live one owns it and
    ``take_over`` is false; with ``take_over`` the key is overwritten. ``named_by``: what
    pointed this stack at that Redis (``--redis-url``, ``INFERGATE_REDIS_URL``, the
    file's ``redis.url``), named in the hint to leave it out."""
    if take_over:
        r.set(keynames.STACK_OWNER, doc, ex=OWNER_TTL_S)
        return
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    if cur != 1 and _owner_gone(cur):
        # an up of this host that was killed outright: its claim has not expired yet
        if r.eval(_OWNER_REPLACE_LUA, 1, keynames.STACK_OWNER, cur, doc, OWNER_TTL_S) == 1:
            _say(f"the node registry's last owner, {_describe_owner(cur)}, is gone: "
                 "taking it over")
            return
        cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    if cur != 1:
        raise click.ClickException(
            f"the node registry in the Redis at {where} belongs to another running "
            f"infergate up: {_describe_owner(cur)}. Stop it (its claim expires {OWNER_TTL_S} s "
            f"after it stops), give this stack its own Redis (leave out {named_by}), or pass "
            "--take-over to replace its registry entries")


def refresh_owner(r: redis_lib.Redis, doc: str) -> str | None:
    """Renew the stack-owner key; ``None`` when it is ours (or was gone and is ours
    again), else the description of the stack that took it over. Raises
    ``redis.RedisError``."""
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    return None if cur == 1 else _describe_owner(cur)


def _release_owner(r: redis_lib.Redis, doc: str) -> None:
    """Delete the stack-owner key if it is still ours (a clean stop frees the registry
    at once); Redis errors are ignored (the key expires on its own)."""
    try:
        r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
               "return 0", 1, keynames.STACK_OWNER, doc)
    except redis_lib.RedisError:
        pass


def _again_command(workdir: Path) -> str:
    """The command line this ``up`` was started with (its options after ``up``, as
    typed, a ``--redis-url`` password shown as ``***``), with ``--workdir`` naming
    ``workdir``: what starts the same stack on its state again."""
    argv = sys.argv[1:]
    args = argv[argv.index("up") + 1:] if "up" in argv else []
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--workdir":
            skip = True
        elif a.startswith("--redis-url="):
            out.append("--redis-url=" + redact(a.partition("=")[2]))
        elif out and out[-1] == "--redis-url":
            out.append(redact(a))   # the password stays off the screen and the logs
        elif not a.startswith("--workdir="):
            out.append(a)
    return shlex.join(["infergate", "up", *out, "--workdir", str(workdir)])


def _ensure_redis(settings: Settings, workdir: Path, stack: procs.ProcessSet) -> str:
    """Return a description of the Redis at ``settings.redis.url`` (named explicitly);
    start one there if nothing answers and it is a local address, with the URL's password
    (``redis://:PASSWORD@127.0.0.1:PORT/0``) when it has one. Raises
    :class:`click.ClickException` when it cannot start one (not local, an ACL user, the
    port taken)."""
    if _redis_answers(settings):
        return f"{settings.redis.url} (already running)"
    parts = urlsplit(settings.redis.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    shown = redact(settings.redis.url)
    if parts.scheme != "redis" or host not in LOCAL_HOSTS:
        raise click.ClickException(f"no Redis answers at {shown} and it is not a local "
                                   "redis:// address infergate could start one on")
    user, pw = parts.username, parts.password
    if pw is None and user:
        user, pw = None, user    # redis://PASSWORD@host: a password, as redis-py reads it
    password = unquote(pw) if pw else None
    if user and unquote(user) != "default":
        raise click.ClickException(
            f"no Redis answers at {shown}; infergate starts a local Redis only for the "
            "default user (redis://:PASSWORD@host:port/db), not for the ACL user "
            f"{unquote(user)!r}")
    if procs.port_open("127.0.0.1", port):
        raise click.ClickException(f"port {port} is taken by something that is not Redis")
    _say(f"starting redis-server on 127.0.0.1:{port} (no Redis answers at {shown})")
    try:
        stack.add(procs.start_redis(workdir / "redis", port, persistent=True, password=password))
    except ValueError as exc:  # a password redis.conf cannot hold
        raise click.ClickException(f"no Redis answers at {shown}; cannot start one: {exc}") from None
    if password is None:
        _say(f"warning: this redis-server on port {port} has no password: any local user can "
             "read the cached prompts and answers and write API keys; put one in the URL "
             "(redis://:PASSWORD@127.0.0.1:PORT/0) to require it")
        access = "no password"
    else:
        access = "password from the URL required"
    return (f"{shown} (local redis-server started, {access}, maxmemory 256mb, volatile-lru, "
            f"append-only file in {workdir / 'redis'})")


def _sim_nodes(workdir: Path, stack: procs.ProcessSet, time_scale: float) -> list[NodeSettings]:
    """Start the :data:`SIM_NODES` on free loopback ports (no control port, logs in
    ``workdir/logs``), added to ``stack``; wait for them (20 s). Raises
    :class:`controlplane.procs.StartError` when one does not come up."""
    specs = [(name, ["--speed", str(speed), "--time-scale", str(time_scale)])
             for name, speed in SIM_NODES]
    instance = procs.instance_id()
    last: procs.StartError | None = None
    for _ in range(START_ATTEMPTS):  # new free ports when another process took one first
        n0 = len(stack.items)
        try:
            sims = launch.start_nodes(specs, workdir / "logs", control=False, timeout=20,
                                      into=stack)
        except procs.StartError as exc:
            del stack.items[n0:]  # stopped by start_nodes
            last = exc
            continue
        # a port another process bound in between answers with its id (or none)
        strangers = [s for s in sims
                     if procs.http_instance(f"{s.url}/health") != instance or not s.alive()]
        if not strangers:
            return [NodeSettings(name=s.name, url=s.url, kind="vllm") for s in sims]
        launch.stop_nodes(sims)
        del stack.items[n0:]
        last = procs.StartError(f"{strangers[0].name}: port {strangers[0].port} is held by "
                                "another process")
    assert last is not None
    raise last


#: Longest wait for the embedder to load its model and answer ``/healthz``, seconds.
EMBEDDER_START_S = 180.0


#: Tries of a part on a port a free-port helper chose, when it fails to bind it.
START_ATTEMPTS = 3
#: Health checks of the control plane (its admin ``/healthz``): every so many seconds,
#: each with this timeout; after so many failures in a row it is killed and restarted.
CP_PROBE_EVERY_S = 5.0
CP_PROBE_TIMEOUT_S = 2.0
CP_PROBE_FAILS = 3
#: Seconds nginx has, when the stack stops, to finish the requests in flight (SIGQUIT,
#: its graceful shutdown) before it is stopped at once (SIGTERM).
NGINX_FINISH_S = 10.0


def _embedder_healthy(url: str) -> bool:
    """``GET url/healthz`` answers 200 with this stack's instance id."""
    import requests

    try:
        res = requests.get(f"{url}/healthz", timeout=1)
    except requests.RequestException:
        return False
    return res.status_code == 200 and res.headers.get(procs.INSTANCE_HEADER) == procs.instance_id()


def _start_embedder(settings: Settings, workdir: Path, stack: procs.ProcessSet,
                    timeout: float = EMBEDDER_START_S, config_path: str | None = None) -> str:
    """Start the semantic-cache embedder for ``settings.cache`` and return a one-line
    description for the banner. Never starts one for a non-local URL (the operator runs
    it there). A local one is always this run's own, on the configured port or, when that
    is busy (another stack's embedder may use another Redis), on a free port.
    On any failure stops what it started, sets ``cache.semantic = False`` and returns
    ``"off (<reason>)"``: the stack then runs with the exact cache only. ``config_path``
    (the operator's infergate.toml) is handed to the embedder, which reads its
    ``[cache]`` section there (``semantic_domains`` written by ``infergate cache
    calibrate``, the verifier, per-route and per-model thresholds)."""
    c = settings.cache
    if not c.enabled:
        return "off (cache.enabled = false)"
    if not c.semantic:
        return "off (cache.semantic = false)"
    url = c.embedder_url
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host not in LOCAL_HOSTS:
        # an embedder the operator runs elsewhere; lookups fail open while it is away
        return f"{url} (remote, not started here)"
    port = parts.port or 80
    if procs.port_open("127.0.0.1", port):
        port = procs.free_port()
        url = c.embedder_url = f"http://127.0.0.1:{port}"
    argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                "--model", c.embedder_model)
    _say(f"starting the embedder on {url} (model {c.embedder_model}; loading it may take "
         "a while)")
    # the Redis URL (maybe with a password) through the environment, not the command line
    env = {**os.environ, "INFERGATE_REDIS_URL": settings.redis.url}
    if c.embedder_token:
        # the operator's file (or none) is what the embedder reads: the token this run
        # uses goes by the environment, which its restarts inherit
        env["INFERGATE_EMBEDDER_TOKEN"] = c.embedder_token
    env.pop("INFERGATE_CONFIG", None)  # up reads no config from the environment
    if config_path:
        env["INFERGATE_CONFIG"] = str(Path(config_path).resolve())
    for attempt in range(START_ATTEMPTS):
        m = procs.Managed("embedder", argv, workdir / "logs" / "embedder.log", env=env).start()
        try:
            # ready on a 200 with this stack's instance id: never another stack's embedder
            m.wait_ready(lambda: _embedder_healthy(url), timeout)
        except procs.StartError as exc:
            m.stop()
            if "in use" in m.log_tail(5).lower() and attempt < START_ATTEMPTS - 1:
                # another process bound the port in between: a new free one
                port = procs.free_port()
                url = c.embedder_url = f"http://127.0.0.1:{port}"
                argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                            "--model", c.embedder_model)
                continue
            c.semantic = False
            last = [ln for ln in str(exc).splitlines() if ln.strip()]
            return f"off (the embedder did not start: {last[-1] if last else exc}; see {m.log_path})"
        stack.add(m)
        return f"{url} (model {c.embedder_model})"
    return "off (the embedder did not start)"  # not reached: the last attempt returns


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    """The embedder could bind ``host:port`` now: a bind with ``SO_REUSEADDR`` (as the
    embedder's server does, so connections of the dead one in TIME_WAIT do not count)
    succeeds, i.e. no other process listens there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


class EmbedderKeeper:
    """Supervision of the stack's own embedder (instead of a plain restart on the same
    port): the edge never sends a prompt to an address no embedder of this stack holds.

    When the embedder exits, the edge config is rendered again with the semantic cache
    off and nginx reloads it (SIGHUP to its master: graceful, requests in flight finish),
    so lookups stop at once. After the back-off of ``policy`` the embedder is started
    again on its last port when that is free, else on a free one
    (:func:`controlplane.procs.free_port`); only once its ``/healthz`` answers with this
    stack's instance id is the edge rendered with the semantic cache on and the new
    ``cache.embedder_url``, and nginx reloaded again. When the port changes, the control
    plane is restarted on the runtime config with the new address first
    (:meth:`_repoint_controlplane`), so nothing of the stack calls the old one. An
    embedder that exits or is not ready within ``ready_timeout`` counts as a failure;
    after ``policy.max_failures`` within ``policy.window_s`` it stays off and the rest
    runs on. Call :meth:`tick` from the
    supervision loop; it never waits longer than one health probe (1 s)."""

    def __init__(self, m: procs.Managed, settings: Settings, stack: procs.ProcessSet,
                 workdir: Path, cfg: Path, say=None, policy: procs.RestartPolicy | None = None,
                 ready_timeout: float = 180.0, clock=time.monotonic):
        self.m = m
        self.settings = settings
        self.stack = stack
        self.workdir = workdir
        self.cfg = cfg
        self.say = say or _say
        self.policy = policy or procs.RestartPolicy()
        self.ready_timeout = ready_timeout
        self.clock = clock
        self.url = settings.cache.embedder_url
        self.failures: list[float] = []
        self.restart_at: float | None = None
        self.ready_by: float | None = None  # set while a restarted embedder starts
        self.given_up = False
        self.restarts = 0
        self.reloads = 0

    def _nginx(self) -> procs.Managed | None:
        return next((x for x in self.stack.items if x.name == "nginx"), None)

    def _point_edge(self, semantic: bool) -> None:
        """Render the edge config with the semantic cache ``semantic`` (and the current
        embedder URL) and make nginx reload it."""
        from controlplane.edge.render import render_nginx

        c = self.settings.cache
        c.semantic = semantic
        if semantic:
            c.embedder_url = self.url
        render_nginx(self.settings, self.workdir / "nginx", prefix=self.workdir / "nginx")
        _write_runtime_config(self.settings, self.cfg)
        ng = self._nginx()
        if ng is not None and ng.alive() and ng.pid:
            os.kill(ng.pid, signal.SIGHUP)
            self.reloads += 1

    def _repoint_controlplane(self) -> None:
        """Restart the stack's control plane on a runtime config with the embedder's new
        address: it reads ``cache.embedder_url`` at start, so its online verification
        (``POST /v1/embeddings`` with the embedder token and the answers' texts) and its
        node-address checks would go on using the old port, where another process now
        listens. The edges route on their last snapshot meanwhile."""
        c = self.settings.cache
        semantic = c.semantic
        c.semantic, c.embedder_url = True, self.url
        _write_runtime_config(self.settings, self.cfg)
        c.semantic = semantic
        cp = next((x for x in self.stack.items if x.name == "controlplane"), None)
        if cp is None or not cp.alive():
            return  # its next start reads the file written above
        cp.stop(grace=5.0)
        try:
            cp.start()
        except OSError as exc:
            self.say(f"control plane restart for the embedder's new address failed: {exc}")
            return
        self.say(f"control plane restarted for the embedder's new address {self.url} "
                 f"(pid {cp.pid})")

    def _failed(self, now: float, why: str) -> None:
        self.failures = [t for t in self.failures if now - t <= self.policy.window_s] + [now]
        if self.settings.cache.semantic:
            self._point_edge(False)
        if len(self.failures) >= self.policy.max_failures:
            self.given_up = True
            self.say(f"embedder gave up after {len(self.failures)} failures within "
                     f"{self.policy.window_s:.0f} s (log {self.m.log_path}); semantic cache "
                     "off, the rest runs on")
            return
        delay = self.policy.delay(len(self.failures))
        self.say(f"embedder {why} (restarts so far {self.restarts}, log {self.m.log_path}); "
                 f"semantic cache off until it is back; restarting in {delay:.1f} s")
        self.restart_at = now + delay

    def _restart(self, now: float) -> None:
        port = urlsplit(self.url).port or 80
        # what the dead embedder left in its process group (its model worker processes,
        # which share the listening socket) is stopped first, so its own port is free
        # again unless another process took it
        self.m.stop(grace=1.0)
        until = time.monotonic() + PORT_RELEASE_S
        while not _port_free(port) and time.monotonic() < until:
            time.sleep(0.05)
        if not _port_free(port):
            old = port
            port = procs.free_port()
            self.say(f"embedder port {old} is taken by another process; moving the embedder "
                     f"to 127.0.0.1:{port}")
        moved = f"http://127.0.0.1:{port}" != self.url
        self.url = f"http://127.0.0.1:{port}"
        if moved:
            self._repoint_controlplane()
        argv = procs.infergate_argv("embedder", "--listen", f"127.0.0.1:{port}",
                                    "--model", self.settings.cache.embedder_model)
        new = procs.Managed("embedder", argv, self.m.log_path, env=self.m.env)
        try:
            new.start()
        except OSError as exc:
            self._failed(now, f"restart failed: {exc}")
            return
        self.stack.items[self.stack.items.index(self.m)] = new
        self.m = new
        self.restarts += 1
        self.ready_by = now + self.ready_timeout
        self.say(f"embedder restarted on {self.url} (pid {new.pid}, restart {self.restarts})")

    def tick(self) -> None:
        """One supervision round (see the class)."""
        if self.given_up:
            return
        now = self.clock()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self._restart(now)
            return
        if not self.m.alive():
            rc = self.m.proc.returncode if self.m.proc is not None else None
            self.ready_by = None
            self._failed(now, f"exited (code {rc})")
            return
        if self.ready_by is not None:
            if _embedder_healthy(self.url):
                self.ready_by = None
                self._point_edge(True)
                self.say(f"embedder ready on {self.url}; semantic cache on again")
            elif now >= self.ready_by:
                self.ready_by = None
                self.m.stop(grace=1.0)
                self._failed(now, "did not become ready")


def _real_nodes(urls: tuple[str, ...], kind: str, health_path: str | None = None,
                max_concurrency: int | None = None) -> list[NodeSettings]:
    extra: dict = {}
    if health_path is not None:
        extra["health_path"] = health_path
    if max_concurrency is not None:
        extra["max_concurrency"] = max_concurrency
    nodes = []
    for i, url in enumerate(urls, 1):
        try:
            nodes.append(NodeSettings(name=f"node-{i}", url=url, kind=kind, **extra))  # type: ignore[arg-type]
        except ValueError as exc:
            raise click.BadParameter(f"--node {url}: {exc}") from None
    return nodes


def _write_runtime_config(settings: Settings, path: Path) -> None:
    import tomli_w  # small and only needed here

    data = settings.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    os.chmod(path, 0o600)


#: Seconds a restarted embedder waits for its port to be released by the processes of
#: the one that died (sockets close as they exit) before it moves to a free port.
PORT_RELEASE_S = 2.0

#: Seconds between two supervision rounds of :func:`_supervise`.
SUPERVISE_EVERY_S = 0.25


#: Label of the key ``up`` creates for the tenant ``demo`` (and revokes at its next start).
DEMO_KEY_LABEL = "infergate up demo key"


def _supervise(stack: procs.ProcessSet, stop: threading.Event, owner_r: redis_lib.Redis,
               owner_doc: str, policy: procs.RestartPolicy | None = None,
               embedder: EmbedderKeeper | None = None) -> str:
    """Keep the parts of ``stack`` running until ``stop`` is set (Ctrl-C, SIGTERM) and
    keep the stack-owner key alive. A part that dies is restarted with back-off
    (:class:`controlplane.procs.Supervisor`, one line per exit and per restart); the
    embedder is optional (the edge answers BYPASS while it is away, and when it keeps
    failing it stays off); nginx is required, and every other part that keeps failing is
    restarted on every 10 s while the edge serves without it. Returns ``""`` on a
    requested stop, else why everything must stop: nginx keeps failing. When another
    stack takes the registry over (``--take-over``) this one says so once and stops renewing the owner key, but keeps
    its parts running: its Redis may be the one the new owner uses. ``embedder``: the
    embedder is kept by it (:class:`EmbedderKeeper`: new port when its own is taken, edge
    re-pointed) instead of by the plain supervisor."""
    sup = procs.Supervisor(_say, policy)
    for m in stack.items:
        if embedder is not None and m is embedder.m:
            continue
        # only the edge itself is required: it serves on its last snapshot without the
        # control plane, without Redis (cache bypass) and without a node that is down
        sup.watch(m, optional=m.name == "embedder",
                  keep_trying=m.name not in ("embedder", "nginx"))
    next_refresh = 0.0
    owned = True
    while not stop.is_set():
        failed = sup.tick()
        if failed:
            return f"{failed}\nstopped everything"
        if embedder is not None:
            try:
                embedder.tick()
            except Exception as exc:  # noqa: BLE001 - the optional part never stops the stack
                _say(f"embedder supervision: {exc}")
        now = time.monotonic()
        if owned and now >= next_refresh:
            next_refresh = now + OWNER_REFRESH_S
            try:
                other = refresh_owner(owner_r, owner_doc)
            except redis_lib.RedisError:
                other = None  # Redis restarting: the key is renewed once it answers
            if other:
                owned = False
                _say(f"the node registry was taken over by {other}; this stack no longer "
                     "owns it (its parts keep running)")
        stop.wait(SUPERVISE_EVERY_S)
    return ""


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
              help="Requests each --node server runs at once [default: 64]; 1 for "
                   "llama-cpp-python, --parallel N for llama.cpp's server.")
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Edge address [default: edge.listen, 127.0.0.1:8080].")
@click.option("--admin-listen", default=None, metavar="HOST:PORT",
              help="Admin page and API address [default: controlplane.listen, 127.0.0.1:8081].")
@click.option("--redis-url", default=None, help="Redis URL [default: redis.url].")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Folder for logs, rendered nginx config and Redis [default: a new temp dir].")
@click.option("--time-scale", default=1.0, show_default=True, type=float,
              help="Time scale of the simulated nodes (0.1 = ten times faster).")
@click.option("--take-over", is_flag=True,
              help="With a shared Redis: replace the node registry even while another "
                   "running infergate up owns it.")
@click.option("--instance-id", default=None, metavar="ID",
              help="Id of this stack, echoed by every part's health answer "
                   "[default: a new random one].")
def up_cmd(config_path: str | None, node_urls: tuple[str, ...], node_kind: str,
           node_health_path: str | None, node_max_concurrency: int | None,
           listen: str | None, admin_listen: str | None, redis_url: str | None,
           workdir: str | None, time_scale: float, take_over: bool = False,
           instance_id: str | None = None) -> None:
    """Run the whole stack locally: Redis, nodes, control plane, nginx edge."""
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if "mode" not in settings.auth.model_fields_set:
        settings.auth.mode = "required"  # the stack runs with API keys unless the file says "off"
    if "enabled" not in settings.cache.model_fields_set:
        settings.cache.enabled = True  # the stack caches answers unless the file sets it
    if listen:
        _split_hostport(listen, "--listen")
        settings.edge.listen = listen
    if admin_listen:
        _split_hostport(admin_listen, "--admin-listen")
        settings.controlplane.listen = admin_listen
    # Only a Redis named on purpose (--redis-url, the file's redis.url, INFERGATE_REDIS_URL)
    # is shared; otherwise the stack runs its own and never joins another's at 6379.
    shared_redis = bool(redis_url) or "url" in settings.redis.model_fields_set
    if redis_url:
        redis_named_by = "--redis-url"
    elif os.environ.get("INFERGATE_REDIS_URL"):
        redis_named_by = "INFERGATE_REDIS_URL (unset it: the banner's export line sets it)"
    else:
        redis_named_by = f"redis.url in {config_path}" if config_path else "redis.url"
    if redis_url:
        settings.redis.url = redis_url
    instance = instance_id or f"up-{secrets.token_hex(6)}"
    os.environ[procs.INSTANCE_ENV] = instance  # every part inherits it and echoes it
    edge_host, edge_port = _split_hostport(settings.edge.listen, "edge.listen")
    admin_host, admin_port = _split_hostport(settings.controlplane.listen, "controlplane.listen")
    for host, port, what in ((edge_host, edge_port, "edge"), (admin_host, admin_port, "admin")):
        if procs.port_open("127.0.0.1" if host in ("0.0.0.0", "::") else host, port):
            raise click.ClickException(f"{what} address {host}:{port} is already in use "
                                       f"(choose another with --{'listen' if what == 'edge' else 'admin-listen'})")
    generated_token = False
    if not settings.controlplane.admin_token:
        settings.controlplane.admin_token = secrets.token_urlsafe(18)
        generated_token = True
    if not settings.cache.embedder_token:
        # only this stack's edge and control plane may ask its embedder (another process
        # on the host could read stored prompts, or point a question at another answer)
        settings.cache.embedder_token = secrets.token_urlsafe(24)

    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="infergate-up-"))
    wd.mkdir(parents=True, exist_ok=True)
    wd_lock = _lock_workdir(wd)  # noqa: F841 - held (and the folder locked) while up runs
    _say(f"infergate up: logs and config in {wd}")
    os.chmod(wd, 0o755)  # nginx workers (``nobody`` when started as root) traverse it
    stack = procs.ProcessSet()
    stop = threading.Event()
    owner_doc = _owner_doc(instance)
    owner_r: redis_lib.Redis | None = None
    cp_watch: procs.HangWatch | None = None

    hurry = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():
            hurry.set()  # a second Ctrl-C: cut the requests in flight
        stop.set()

    # Ctrl-C, kill, and a closed terminal or ssh session (SIGHUP) stop the stack alike;
    # if up itself is killed outright, the kernel stops its parts (procs.Managed)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        redis_desc = (_ensure_redis(settings, wd, stack) if shared_redis
                      else _own_redis(settings, wd, stack))
        owner_r = make_redis(settings.redis)
        try:
            claim_registry(owner_r, owner_doc, take_over, settings.redis.url.split("@")[-1],
                           redis_named_by)
        except redis_lib.RedisError as exc:
            raise click.ClickException(f"Redis at {settings.redis.url.split('@')[-1]}: {exc}") from None
        if node_urls:
            nodes = _real_nodes(node_urls, node_kind, node_health_path, node_max_concurrency)
        elif settings.nodes:
            nodes = settings.nodes
        else:
            _say(f"starting {len(SIM_NODES)} simulated nodes: {', '.join(n for n, _ in SIM_NODES)}")
            nodes = _sim_nodes(wd, stack, time_scale)
        settings.nodes = nodes
        r = make_redis(settings.redis)
        for n in nodes:  # the nodes of this run replace same-named entries of an earlier one
            try:
                registry.put_node_unique(r, n)
            except registry.UrlTaken as exc:
                _say(f"node {n.name} not registered: {exc} (one server, one node)")
        demo_key = None
        if settings.auth.mode == "required":
            # one demo key at a time: the one an earlier run printed is revoked
            old = [k for k in apikeys.list_keys(r, include_revoked=False)
                   if k.tenant == "demo" and k.label == DEMO_KEY_LABEL]
            for k in old:
                apikeys.revoke_key(r, k.id)
            if old:
                _say(f"revoked the demo key of an earlier run ({', '.join(k.id for k in old)})")
            demo_key, _ = apikeys.create_key(r, "demo", label=DEMO_KEY_LABEL)
        semantic_desc = _start_embedder(settings, wd, stack, config_path=config_path)
        if semantic_desc.startswith("off ("):
            click.echo(f"semantic cache is off: {semantic_desc[5:-1]}", err=True)
        metrics_desc = "off"
        metrics_moved = False
        if settings.edge.metrics_listen:
            m_host, m_port = _split_hostport(settings.edge.metrics_listen, "edge.metrics_listen")
            if procs.port_open("127.0.0.1" if m_host in ("0.0.0.0", "::") else m_host, m_port):
                # an internal port: take a free one rather than fail on another stack's edge
                m_url_host = HostPort.parse(settings.edge.metrics_listen).url_host
                settings.edge.metrics_listen = f"{m_url_host}:{procs.free_port(m_host)}"
                metrics_moved = True
            metrics_desc = f"http://{settings.edge.metrics_listen}/metrics"
        cfg = wd / "infergate.toml"
        _write_runtime_config(settings, cfg)

        _say(f"starting the control plane on {admin_host}:{admin_port}")
        cp = stack.add(procs.Managed("controlplane", procs.infergate_argv("controlplane", "--config", str(cfg)),
                                     wd / "logs" / "controlplane.log").start())
        admin_probe = admin_host if admin_host not in ("0.0.0.0", "::") else "127.0.0.1"
        # ready when the admin port answers with this stack's id (never another's process)
        admin_probe = f"[{admin_probe}]" if ":" in admin_probe else admin_probe
        cp.wait_ready(lambda: procs.http_instance(f"http://{admin_probe}:{admin_port}/healthz")
                      == instance, timeout=30)

        from controlplane.edge.render import render_nginx, start_nginx

        for attempt in range(START_ATTEMPTS):
            rendered = render_nginx(settings, wd / "nginx", prefix=wd / "nginx")
            _say(f"starting nginx on {edge_host}:{edge_port} (config {rendered.nginx_conf})")
            try:
                edge = stack.add(start_nginx(rendered.nginx_conf, wd / "nginx"))
                # a stop lets the requests in flight (streams too) finish, as
                # `nginx -s quit` does, for up to NGINX_FINISH_S
                edge.finish_signal = signal.SIGQUIT
                edge.finish_grace = NGINX_FINISH_S
                break
            except procs.StartError as exc:
                m_port = settings.edge.metrics_listen.rpartition(":")[2]
                lost = metrics_moved and f":{m_port} failed" in str(exc) and "in use" in str(exc)
                if not lost or attempt == START_ATTEMPTS - 1:
                    raise
                # the free metrics port was taken in between: render with a new one
                m_host = HostPort.parse(settings.edge.metrics_listen)
                settings.edge.metrics_listen = f"{m_host.url_host}:{procs.free_port(m_host.host)}"
                metrics_desc = f"http://{settings.edge.metrics_listen}/metrics"

        base = f"http://{edge_host}:{edge_port}"
        model = "sim-llama" if not node_urls else (_first_model(nodes) or "<your model>")
        key_line = f"\n  API key (demo)      {demo_key}" if demo_key else ""
        key_header = f" -H 'Authorization: Bearer {demo_key}'" if demo_key else ""
        cli = cli_name()
        click.echo(f"""
infergate is up.
  edge (OpenAI API)   {base}/v1
  admin page and API  http://{admin_host}:{admin_port}/   token: {settings.controlplane.admin_token}{' (generated)' if generated_token else ''}
  redis               {redis_desc}
  nodes               {', '.join(f'{n.name}={n.url}' for n in nodes)}
  response cache      {'on' if settings.cache.enabled else 'off'}; semantic cache {semantic_desc}
  edge metrics        {metrics_desc}
  logs and config     {wd}{key_line}

Try:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
  export INFERGATE_REDIS_URL={settings.redis.url}
  {cli} nodes list    # also: {cli} keys list, {cli} cache stats
  (or pass --config {cfg} to those commands)

Ctrl-C stops everything.""", err=False)
        sys.stdout.flush()
        emb = next((x for x in stack.items if x.name == "embedder"), None)
        keeper = (EmbedderKeeper(emb, settings, stack, wd, cfg) if emb is not None
                  and settings.cache.semantic else None)
        # a control plane that is frozen (never exits) would keep the edges on a stale
        # snapshot: drains and registry changes unapplied, health no longer polled
        cp_url = f"http://{admin_probe}:{admin_port}/healthz"
        cp_watch = procs.HangWatch(
            cp, lambda: procs.http_instance(cp_url, timeout=CP_PROBE_TIMEOUT_S) == instance,
            _say, every_s=CP_PROBE_EVERY_S, fail_after=CP_PROBE_FAILS)
        failed = _supervise(stack, stop, owner_r, owner_doc, embedder=keeper)
    except procs.StartError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if cp_watch is not None:
            cp_watch.stop()
        click.echo(f"stopping... (requests in flight get up to {NGINX_FINISH_S:.0f} s to "
                   "finish; Ctrl-C again cuts them)", err=True)
        if owner_r is not None:
            _release_owner(owner_r, owner_doc)
        stack.stop_all(hurry=hurry)
        # the state (Redis's append-only file: API keys, nodes, drains, cached answers)
        # is in the folder; only a start on the same folder finds it again
        click.echo(f"stopped; the work folder {wd} is kept (`{_again_command(wd)}` "
                   "starts on its state again)", err=True)
    if failed:
        raise click.ClickException(failed)
