"""``infergate embedder``: the semantic-cache embedder service (Flask under waitress).

Loads the embedding model, opens the vector index (Redis search when the server has it,
else in process), starts the index-queue consumer and serves the HTTP API
(``controlplane/embedder/app.py``). Options also read ``INFERGATE_EMBEDDER_*`` environment
variables (e.g. ``INFERGATE_EMBEDDER_MODEL``); the Redis URL comes from ``--redis-url``,
else ``INFERGATE_REDIS_URL``, else ``redis.url`` of the config file.
"""

from __future__ import annotations

import logging
import signal

import click

from controlplane.config import ConfigError, load_settings


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"expected host:port, got {listen!r}", param_hint="--listen")
    return host.strip("[]"), int(port)


@click.command("embedder")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="INFERGATE_CONFIG", help="infergate.toml (for redis.url).")
@click.option("--listen", default="127.0.0.1:8090", show_default=True,
              envvar="INFERGATE_EMBEDDER_LISTEN", help="host:port of the HTTP API.")
@click.option("--redis-url", default=None, envvar="INFERGATE_REDIS_URL")
@click.option("--model", default="all-MiniLM-L6-v2", show_default=True,
              envvar="INFERGATE_EMBEDDER_MODEL",
              help="sentence-transformers name or path, all-MiniLM-L6-v2 (bundled) or "
                   "use-multilingual-v3.")
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
              help="CPU threads of a local model (0 = library default).")
@click.option("--redis-wait-s", default=30.0, show_default=True, type=click.FloatRange(0),
              help="How long to wait for Redis at start.")
@click.option("--no-queue", is_flag=True, help="Do not consume the index queue.")
def embedder_cmd(config_path: str | None, listen: str, redis_url: str | None, model: str,
                 embeddings_url: str, embeddings_model: str, embeddings_api_key: str,
                 index_backend: str, max_batch: int, max_wait_ms: float, top_k: int,
                 threads: int, model_threads: int, redis_wait_s: float,
                 no_queue: bool) -> None:
    """Serve semantic lookups and index cache entries (see docs/internals.md)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("infergate.embedder")
    host, port = _split_listen(listen)
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    url = redis_url or settings.redis.url

    import waitress

    from controlplane import procs
    from controlplane.embedder.app import create_app
    from controlplane.embedder.consumer import QueueConsumer
    from controlplane.embedder.engine import Engine, connect
    from controlplane.embedder.models import ModelLoadError, ModelSpec, load_model

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

    spec = ModelSpec(model=model, embeddings_url=embeddings_url,
                     embeddings_model=embeddings_model, embeddings_api_key=embeddings_api_key,
                     threads=model_threads)
    try:
        m = load_model(spec)
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from None
    log.info("model %s loaded (dim %d, default min_similarity %.2f)", m.model_id, m.dim,
             m.default_min_similarity)
    try:
        engine = Engine(m, r, index_backend=index_backend, max_batch=max_batch,
                        max_wait_ms=max_wait_ms, top_k=top_k)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    consumer = None if no_queue else QueueConsumer(engine, r_block, batch=max_batch).start()

    server = waitress.create_server(create_app(engine), host=host, port=port,
                                    threads=threads, ident="infergate-embedder")
    def _stop(signum, frame):  # noqa: ARG001
        raise SystemExit(0)  # waitress's run() catches it and shuts its threads down

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("embedder listening on http://%s:%d (index %s)", host, port,
             engine.index.backend)
    try:
        server.run()
    finally:
        if consumer is not None:
            consumer.stop()
        engine.close()
        log.info("embedder stopped")
