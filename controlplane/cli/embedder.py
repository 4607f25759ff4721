"""``infergate embedder``: the semantic-cache embedder service (Flask under waitress).

Loads the embedding model and its learned verifier (``[cache] verifier``,
``verifier_file``), reads the per-domain thresholds (``[[cache.semantic_domains]]``, re-read
when ``--config`` changes), opens the vector index (Redis search when the server has it,
else in process), starts the index-queue consumer and serves the HTTP API
(``controlplane/embedder/app.py``). Options also read ``INFERGATE_EMBEDDER_*`` environment
variables (e.g. ``INFERGATE_EMBEDDER_MODEL``); the Redis URL comes from ``--redis-url``,
else ``INFERGATE_REDIS_URL``, else ``redis.url`` of the config file. The listen address
comes from ``--listen`` (``INFERGATE_EMBEDDER_LISTEN``), else the host and port of
``cache.embedder_url`` of the config file, so the edge and the embedder agree on it.

The address is bound first, before Redis and the model: a port already in use ends the
command at once with one line (``cannot listen on HOST:PORT: ...``, exit status 1).
Requests that arrive while the model loads wait in the listen backlog.

``--processes N`` (N > 1) serves the one listening socket from N forked processes, each
with its own model, index and threads: a lookup spends a few milliseconds of Python around
the model, under one interpreter lock per process, so one process cannot use a second core
(see :mod:`controlplane.cli.embedder_procs`).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
from urllib.parse import urlsplit

import click

from controlplane.cli.common import split_listen
from controlplane.cli.embedder_procs import bind_listener, supervise
from controlplane.config import ConfigError, load_settings


def listen_of_url(url: str) -> str:
    """``host:port`` of an ``http://host:port`` URL (``[v6]:port`` for IPv6; port 80 when
    the URL has none), e.g. ``cache.embedder_url``."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or 80}"


class _LateApp:
    """WSGI app that delegates to ``app`` once it is set. The server (and its socket) is
    created before Redis and the model are ready, with this in place of the Flask app;
    waitress accepts connections only once it runs, after ``app`` is set, so the 503 JSON
    answer below is a guard, not a state clients normally see."""

    def __init__(self) -> None:
        self.app = None

    def __call__(self, environ, start_response):
        if self.app is not None:
            return self.app(environ, start_response)
        body = (b'{"error": {"message": "the embedder is loading its model", '
                b'"type": "service_unavailable", "param": null, "code": "loading"}}')
        start_response("503 Service Unavailable", [("Content-Type", "application/json"),
                                                   ("Content-Length", str(len(body))),
                                                   ("Retry-After", "1")])
        return [body]


#: Connections one embedder process holds open at once (waitress ``connection_limit``;
#: under the usual 1024 open files).
CONNECTION_LIMIT = 512
#: Most processes ``--processes auto`` starts (one per core up to this).
AUTO_PROCESSES_MAX = 4


class AutoInt(click.ParamType):
    """An integer in ``[lo, hi]`` or ``auto`` (converted to None)."""

    name = "integer|auto"

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither an integer nor 'auto'", param, ctx)
        if not self.lo <= n <= self.hi:
            self.fail(f"{n} is not in the range {self.lo}<=x<={self.hi}", param, ctx)
        return n


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a cpuset or ``taskset`` counts),
    else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_auto(processes: int | None, model_workers: int | None,
                 cpus: int | None = None) -> tuple[int, int]:
    """``(processes, model_workers)`` with ``auto`` (None) resolved: one process per CPU
    this process may run on (``cpus``, else :func:`_usable_cpus`; at most
    :data:`AUTO_PROCESSES_MAX`), two model workers with one process, else one. Measured on
    2 cores at 16 clients (docs/performance.md "Semantic cache lookups"): 2 processes of 1 worker served
    1.2-2x the lookups/s of 1 process of 2 workers; 2 processes of 2 workers lost about a
    third of that to threads contending for the cores."""
    if processes is None:
        processes = max(1, min(AUTO_PROCESSES_MAX, cpus or _usable_cpus()))
    if model_workers is None:
        model_workers = 2 if processes == 1 else 1
    return processes, model_workers


@click.command("embedder")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="INFERGATE_CONFIG", help="infergate.toml (for redis.url).")
@click.option("--listen", default=None, envvar="INFERGATE_EMBEDDER_LISTEN",
              help="host:port of the HTTP API [default: host and port of cache.embedder_url, "
                   "127.0.0.1:8090].")
@click.option("--redis-url", default=None, envvar="INFERGATE_REDIS_URL")
@click.option("--model", default="use-multilingual-v3", show_default=True,
              envvar="INFERGATE_EMBEDDER_MODEL",
              help="use-multilingual-v3 (numpy, no torch), all-MiniLM-L6-v2 (bundled with "
                   "the semantic extra) or any sentence-transformers name or path.")
@click.option("--embeddings-url", default="", envvar="INFERGATE_EMBEDDER_EMBEDDINGS_URL",
              help="Use a remote OpenAI-compatible /v1/embeddings (TEI, vLLM, Ollama).")
@click.option("--embeddings-model", default="", envvar="INFERGATE_EMBEDDER_EMBEDDINGS_MODEL",
              help="Model name sent to --embeddings-url.")
@click.option("--embeddings-api-key", default="", envvar="INFERGATE_EMBEDDER_EMBEDDINGS_API_KEY")
@click.option("--index", "index_backend", default="auto", show_default=True,
              type=click.Choice(["auto", "redis-search", "local"]),
              envvar="INFERGATE_EMBEDDER_INDEX")
@click.option("--max-batch", default=32, show_default=True, type=click.IntRange(1, 512))
@click.option("--max-wait-ms", default=5.0, show_default=True, type=click.FloatRange(0, 100))
@click.option("--top-k", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--threads", default=32, show_default=True, type=click.IntRange(1, 256),
              help="waitress worker threads (requests handled at once; they wait on the "
                   "micro-batcher, so more threads allow bigger batches).")
@click.option("--model-threads", default=1, show_default=True, type=click.IntRange(0, 256),
              envvar="INFERGATE_EMBEDDER_MODEL_THREADS",
              help="CPU threads of a local model, and of every BLAS call of the process "
                   "(0 = library default).")
@click.option("--model-workers", default="auto", show_default=True, type=AutoInt(1, 64),
              envvar="INFERGATE_EMBEDDER_MODEL_WORKERS",
              help="Micro-batches embedded at once in a process (thread-safe models such as "
                   "use-multilingual-v3; others use one); auto: 2 with one process, else 1.")
@click.option("--redis-wait-s", default=30.0, show_default=True, type=click.FloatRange(0),
              help="How long to wait for Redis at start.")
@click.option("--processes", default="auto", show_default=True, type=AutoInt(1, 64),
              envvar="INFERGATE_EMBEDDER_PROCESSES",
              help="Processes serving the one socket, each with its own copy of the model "
                   "(~190 MB for use-multilingual-v3); auto: one per core, at most "
                   f"{AUTO_PROCESSES_MAX}.")
@click.option("--no-queue", is_flag=True, help="Do not consume the index queue.")
def embedder_cmd(config_path: str | None, listen: str | None, redis_url: str | None, model: str,
                 embeddings_url: str, embeddings_model: str, embeddings_api_key: str,
                 index_backend: str, max_batch: int, max_wait_ms: float, top_k: int,
                 threads: int, model_threads: int, model_workers: int | None,
                 redis_wait_s: float, processes: int | None, no_queue: bool) -> None:
    """Serve semantic lookups and index cache entries (see docs/internals.md)."""
    processes, model_workers = resolve_auto(processes, model_workers)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("infergate.embedder")
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    host, port = split_listen(listen or listen_of_url(settings.cache.embedder_url))
    url = redis_url or settings.redis.url
    try:
        sock = bind_listener(host, port)
    except OSError as exc:
        hint = (" (another process has it? choose the address with cache.embedder_url, or "
                "--listen)") if exc.errno == errno.EADDRINUSE else ""
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None

    from controlplane.embedder.activity import LookupActivity

    # lookups running in any of the processes (shared memory, made before they fork)
    activity = LookupActivity(processes)

    def serve(ready=lambda: None, slot: int = 0) -> None:
        activity.bind(slot)
        _serve(sock, host, port, settings, config_path, url, log, model=model,
               embeddings_url=embeddings_url, embeddings_model=embeddings_model,
               embeddings_api_key=embeddings_api_key, index_backend=index_backend,
               max_batch=max_batch, max_wait_ms=max_wait_ms, top_k=top_k, threads=threads,
               model_threads=model_threads, model_workers=model_workers,
               redis_wait_s=redis_wait_s, no_queue=no_queue, ready=ready,
               activity=activity)

    if processes > 1:
        raise SystemExit(supervise(processes, serve, log, reset_slot=activity.reset))
    serve()


def _create_server(late_app: _LateApp, sock, threads: int):
    """The waitress server of one process, on the bound ``sock``."""
    import waitress

    from controlplane.logthrottle import throttle

    throttle("waitress.queue")   # one "Task queue depth" line per 30 s in a burst

    # connection_limit: waitress's default of 100 would let the edges' idle keepalive
    # connections (64 per nginx worker, nginx/infergate-http.conf.j2) and a burst's
    # lookups hold every slot, leaving new connections in the kernel's backlog
    # channel_request_lookahead: waitress reads on while a request waits for a thread, so
    # it notices a caller that closed the connection (the edge after its lookup budget)
    # and skips that request instead of running the model for nobody
    # asyncore_use_poll: select() fails once a descriptor passes 1023
    return waitress.create_server(late_app, sockets=[sock], threads=threads,
                                  asyncore_use_poll=True,
                                  connection_limit=CONNECTION_LIMIT,
                                  channel_request_lookahead=1,
                                  ident="infergate-embedder")


def _connect_redis(settings, url: str, redis_wait_s: float):
    """(client, blocking client) of the Redis at ``url``, once it answers (waiting up to
    ``redis_wait_s`` s). Raises ``click.ClickException``."""
    from controlplane import procs
    from controlplane.embedder.engine import connect
    from controlplane.redisdb.url import RedisURLError

    timeout = settings.redis.socket_timeout_s
    try:
        r = connect(url, timeout, redis_settings=settings.redis)
        r_block = connect(url, timeout, blocking=True, redis_settings=settings.redis)
    except RedisURLError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        procs.wait_until(lambda: bool(r.ping()), redis_wait_s, interval=0.5,
                         what=f"Redis at {url}")
    except procs.StartError as exc:
        raise click.ClickException(str(exc)) from None
    return r, r_block


def _limit_blas(model_threads: int, log: logging.Logger) -> None:
    """Process-wide BLAS threads: the index search's matrix product and the verifier
    run in request threads beside the model's batch; extra BLAS threads spinning
    against each other made a 1000-entry search 25x slower on 2 shared cores."""
    if not model_threads:
        return
    try:
        import numpy  # noqa: F401 - load the BLAS library before limiting it
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=model_threads)
    except ImportError:
        log.warning("threadpoolctl not installed: BLAS threads not limited "
                    "(pip install '.[cache]')")


def _make_engine(settings, config_path: str | None, r, log: logging.Logger, *,
                 model: str, embeddings_url: str, embeddings_model: str,
                 embeddings_api_key: str, model_threads: int, index_backend: str,
                 max_batch: int, max_wait_ms: float, top_k: int, model_workers: int,
                 activity=None):
    """Load the model and the verifier, read the thresholds (re-read from
    ``config_path`` when it changes) and build the :class:`Engine`. Raises
    ``click.ClickException``."""
    from controlplane.embedder import verifier as verifier_mod
    from controlplane.embedder.engine import Engine
    from controlplane.embedder.models import ModelLoadError, ModelSpec, load_model
    from controlplane.embedder.policy import PolicySource, ThresholdPolicy

    spec = ModelSpec(model=model, embeddings_url=embeddings_url,
                     embeddings_model=embeddings_model, embeddings_api_key=embeddings_api_key,
                     threads=model_threads)
    try:
        m = load_model(spec)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        ver = verifier_mod.load_for(m.model_id, m.dim, settings.cache.verifier_file or None)
    except verifier_mod.VerifierError as exc:
        raise click.ClickException(str(exc)) from None
    # thresholds per domain: re-read from the file when it changes
    policy = PolicySource(config_path) if config_path else \
        PolicySource(policy=ThresholdPolicy.from_cache_settings(settings.cache))
    try:
        engine = Engine(m, r, index_backend=index_backend, max_batch=max_batch,
                        max_wait_ms=max_wait_ms, top_k=top_k, verifier=ver, policy=policy,
                        model_workers=model_workers, activity=activity,
                        endpoint_ca=settings.controlplane.node_ca_file,
                        index_max_rows=settings.cache.semantic_index_max_rows)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    log.info("model %s loaded (dim %d); default min_similarity %.2f, verifier %s, "
             "%d semantic domains", m.model_id, m.dim, engine.default_min_similarity,
             f"on (min score {engine.thresholds('')[1]:.3f})" if engine.verifier_active
             else "off", len(policy.current().domains))
    return engine


def _serve(sock, host: str, port: int, settings, config_path: str | None, url: str,
           log: logging.Logger, *, model: str, embeddings_url: str, embeddings_model: str,
           embeddings_api_key: str, index_backend: str, max_batch: int, max_wait_ms: float,
           top_k: int, threads: int, model_threads: int, model_workers: int,
           redis_wait_s: float, no_queue: bool, ready, activity=None) -> None:
    """One serving process on the bound ``sock``: Redis, model, engine, waitress.
    ``ready()`` is called once requests are answered by the app (the supervisor's signal
    that this process started). Raises ``click.ClickException`` on a start failure."""
    from controlplane.embedder.app import create_app
    from controlplane.embedder.consumer import QueueConsumer

    late_app = _LateApp()
    server = _create_server(late_app, sock, threads)
    r, r_block = _connect_redis(settings, url, redis_wait_s)
    _limit_blas(model_threads, log)
    engine = _make_engine(settings, config_path, r, log, model=model,
                          embeddings_url=embeddings_url, embeddings_model=embeddings_model,
                          embeddings_api_key=embeddings_api_key, model_threads=model_threads,
                          index_backend=index_backend, max_batch=max_batch,
                          max_wait_ms=max_wait_ms, top_k=top_k, model_workers=model_workers,
                          activity=activity)
    consumer = None if no_queue else QueueConsumer(engine, r_block, batch=max_batch).start()

    late_app.app = create_app(engine, settings.cache.embedder_token)

    def _stop(signum, frame):  # noqa: ARG001
        raise SystemExit(0)  # waitress's run() catches it and shuts its threads down

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    ready()  # before the log line: what reads the log may count this process as serving
    log.info("embedder listening on http://%s:%d (index %s)", host, port,
             engine.index.backend)
    if not settings.cache.embedder_token:
        log.warning("no cache.embedder_token set: any process that reaches this port can "
                    "read stored prompts or index a question under another answer; set "
                    "one on a shared host (docs/cache.md)")
    try:
        server.run()
    finally:
        if consumer is not None:
            consumer.stop()
        engine.close()
        log.info("embedder stopped")
