"""``infergate warmup``: fill the response cache with answers to known prompts.

Every prompt goes through the edge like a client request, so its answer is stored the
normal way (same key, TTL, index job for the semantic cache). Prompts already cached are
skipped: the exact key is computed in Python (:mod:`controlplane.cache.key`, the same as
the edge's) and looked up in Redis.

Prompt file, one prompt per line (blank lines ignored):

- plain text: sent as ``{"model": M, "messages": [{"role": "user", "content": LINE}]}`` to
  ``/v1/chat/completions``;
- a JSON object with a ``messages`` array: the request body itself (``model`` defaults to
  ``--model``), to ``/v1/chat/completions``;
- a JSON object with a string ``prompt``: a ``/v1/completions`` body.

The cache key covers every parameter, so warm up with the parameters (temperature,
max_tokens, system prompt, ...) the clients will send; put them in JSONL lines.

Summary (printed at the end): ``sent`` requests answered by a node, ``skipped`` prompts
already cached (in Redis before sending, or answered by the edge from its cache),
``stored`` sent prompts whose entry is in Redis afterwards, ``failed`` requests that
got an error or no answer. Exit status 1 when any prompt failed.

The edge's ``GET /v1/models`` is asked first (it names the default model): an edge that
does not answer stops the run there ("cannot reach the edge at URL: pass --edge URL, or
--config WORKDIR/infergate.toml ..."), exit status 1. An edge that requires API keys and
answers ``401`` stops the run at once (no further prompt is sent): "pass --api-key or set
INFERGATE_API_KEY", exit status 1. On a terminal the progress is a bar; otherwise (piped, in a log) one line per step of about 5 % or
every 2 s: ``warmup: 40/800 done (sent 38, skipped 2, failed 0)``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import click
import redis as redis_lib
import requests

from controlplane.redisdb import keynames
from controlplane.cache.key import UnkeyableBody, keys_for
from controlplane.config import ConfigError, HostPort, load_settings
from controlplane.redisdb.conn import make_redis
from controlplane.errors import InfergateError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: What to do about a 401 from the edge.
KEY_HINT = "pass --api-key or set INFERGATE_API_KEY"


class PromptError(InfergateError, ValueError):
    """A line of the prompt file cannot be turned into a request (message names the line)."""


@dataclass(frozen=True)
class Prompt:
    """One request to send: ``path`` and JSON ``body``; ``line`` is its 1-based line."""

    line: int
    path: str
    body: dict


@dataclass
class Summary:
    """Outcome counts of a warm-up run (see the module docstring)."""

    sent: int = 0
    skipped: int = 0
    stored: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    #: the edge's message when it answered 401 (the run stopped there), else "".
    unauthorized: str = ""

    def text(self) -> str:
        return (f"sent {self.sent}, skipped {self.skipped}, stored {self.stored}, "
                f"failed {self.failed}")


def parse_line(line: str, lineno: int, model: str | None) -> Prompt | None:
    """The request of one prompt-file line; ``None`` for a blank line.

    Raises :class:`PromptError` when the line is JSON of the wrong shape or no model is
    known for it."""
    text = line.rstrip("\r\n")
    if not text.strip():
        return None
    obj = None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            if re.match(r'\s*\{\s*"', text):
                # a JSON object cut or mistyped: sent as a prompt, its answer would be
                # stored under the broken text
                raise PromptError(f"line {lineno}: not valid JSON ({exc})") from None
            obj = None  # plain text that happens to start with "{" ("{x} is a set")
    if obj is None:
        if not model:
            raise PromptError(f"line {lineno}: plain-text prompt needs --model")
        return Prompt(lineno, CHAT, {"model": model, "messages": [{"role": "user", "content": text}]})
    if not isinstance(obj, dict):
        raise PromptError(f"line {lineno}: a JSON line must be an object")
    body = dict(obj)
    if "model" not in body:
        if not model:
            raise PromptError(f"line {lineno}: no \"model\" in the line and no --model")
        body["model"] = model
    if isinstance(body.get("messages"), list) and body["messages"]:
        return Prompt(lineno, CHAT, body)
    if isinstance(body.get("prompt"), str):
        return Prompt(lineno, COMPLETIONS, body)
    raise PromptError(f"line {lineno}: a JSON line needs a non-empty \"messages\" array or a "
                      "string \"prompt\"")


def read_prompts(path: Path, model: str | None) -> list[Prompt]:
    """Every prompt of the file. Raises :class:`PromptError` for a bad line, ``OSError``
    when the file cannot be read."""
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            p = parse_line(line, i, model)
            if p is not None:
                out.append(p)
    return out


def tenant_of_key(r: redis_lib.Redis | None, api_key: str | None) -> str:
    """Tenant the edge will file the requests under: the API key's record
    (``keynames.APIKEYS``, by SHA-256 of the key) or ``default``."""
    if not api_key or r is None:
        return "default"
    try:
        raw = r.hget(keynames.APIKEYS, hashlib.sha256(api_key.encode()).hexdigest())
    except redis_lib.RedisError:
        return "default"
    if not raw:
        return "default"
    try:
        rec = json.loads(raw)
    except ValueError:
        return "default"
    t = rec.get("tenant") if isinstance(rec, dict) else None
    return t if isinstance(t, str) and t else "default"


def _cached(r: redis_lib.Redis | None, key: str) -> bool:
    if r is None:
        return False
    try:
        return bool(r.exists(keynames.cache_entry(key)))
    except redis_lib.RedisError:
        return False


def _error_message(res: requests.Response) -> str:
    """``error.message`` of an OpenAI-style JSON error, else the start of the body."""
    try:
        msg = res.json()["error"]["message"]
        if isinstance(msg, str):
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    return res.text[:200].strip()


#: How to point warmup at a stack started by ``infergate up`` (its edge is not on the
#: default address when ``--listen`` moved it).
EDGE_HINT = "pass --edge URL, or --config WORKDIR/infergate.toml for a stack of `infergate up`"


def _default_model(edge: str, headers: dict[str, str]) -> str | None:
    """First model id of the edge's ``GET /v1/models``; None when it lists none. Raises
    :class:`click.ClickException` when nothing answers at ``edge`` (connection refused,
    timeout: nothing could be warmed), on 401 (no or a wrong key), and on an answer that is
    not 200 JSON (the edge answers /v1/models itself: something else listens there)."""
    try:
        res = requests.get(f"{edge}/v1/models", headers=headers, timeout=10)
    except requests.RequestException as exc:
        raise click.ClickException(f"cannot reach the edge at {edge} ({exc.__class__.__name__}"
                                   f"): {EDGE_HINT}") from None
    if res.status_code == 401:
        raise click.ClickException(f"the edge at {edge} answered 401 ({_error_message(res)}): "
                                   f"{KEY_HINT}")
    if res.status_code != 200 or "json" not in res.headers.get("Content-Type", ""):
        # the edge answers /v1/models itself, always 200 JSON: this is something else (the
        # admin page, the metrics port, a web server)
        raise click.ClickException(
            f"{edge} answered GET /v1/models with {res.status_code} "
            f"{res.headers.get('Content-Type', 'no content type')}: not an infergate edge? "
            f"{EDGE_HINT}")
    try:
        data = res.json().get("data")
        if isinstance(data, list) and data and isinstance(data[0], dict):
            mid = data[0].get("id")
            return mid if isinstance(mid, str) else None
    except ValueError:
        return None
    return None


class ProgressLines:
    """Progress for a log or a pipe: ``warmup: DONE/TOTAL done (sent S, skipped K,
    failed F)``, flushed, every ``step`` prompts (default about 5 % of ``total``) or
    ``every_s`` seconds, and at the last prompt. Call with (done, summary)."""

    def __init__(self, total: int, *, step: int | None = None, every_s: float = 2.0,
                 out=None) -> None:
        self.total = total
        self.step = step or max(1, total // 20)
        self.every_s = every_s
        self.out = out
        self._last_done = 0
        self._last_t = time.monotonic()

    def __call__(self, done: int, summary: Summary) -> None:
        now = time.monotonic()
        if (done - self._last_done >= self.step or now - self._last_t >= self.every_s
                or done == self.total):
            self._last_done, self._last_t = done, now
            click.echo(f"warmup: {done}/{self.total} done (sent {summary.sent}, skipped "
                       f"{summary.skipped}, failed {summary.failed})", file=self.out)


class _Warmer:
    """What the threads of one warmup run share: the :class:`Summary`, the keys seen
    and sent, a ``requests.Session`` per thread, and the stop after a ``401``."""

    def __init__(self, edge: str, r: redis_lib.Redis | None, headers: dict[str, str],
                 tenant: str, timeout_s: float) -> None:
        self.edge, self.r, self.headers = edge, r, headers
        self.tenant, self.timeout_s = tenant, timeout_s
        self.summary = Summary()
        self.local = threading.local()
        self.lock = threading.Lock()
        self.sent_keys: list[str] = []
        self.seen: set[str] = set()
        self.unauthorized = threading.Event()

    def session(self) -> requests.Session:
        s = getattr(self.local, "s", None)
        if s is None:
            s = self.local.s = requests.Session()
        return s

    def _skip(self, p: Prompt) -> tuple[bool, str | None]:
        """(whether ``p`` is skipped: already sent in this run or in the cache, its
        exact cache key or None when the body has none); a skip is counted."""
        try:
            key: str | None = keys_for(p.path, p.body, self.tenant).exact
        except UnkeyableBody:
            key = None  # never cached: sent, and the edge answers it as BYPASS
        with self.lock:
            duplicate = key is not None and key in self.seen
            if key is not None:
                self.seen.add(key)
        if duplicate or (key is not None and _cached(self.r, key)):
            with self.lock:
                self.summary.skipped += 1
            return True, key
        return False, key

    def one(self, p: Prompt) -> None:
        """Send ``p`` unless skipped (or the run stopped on a 401) and count the answer."""
        if self.unauthorized.is_set():
            return
        skipped, key = self._skip(p)
        if skipped:
            return
        try:
            res = self.session().post(self.edge + p.path, data=json.dumps(p.body),
                                      headers=self.headers, timeout=self.timeout_s)
            status = res.status_code
            cache_status = res.headers.get("X-Cache-Status", "")
            detail = res.text[:200] if status != 200 else ""
        except requests.RequestException as exc:
            status, cache_status, detail = 0, "", str(exc)
        summary = self.summary
        with self.lock:
            if status == 401:
                if not self.unauthorized.is_set():
                    self.unauthorized.set()
                    summary.failed += 1
                    summary.unauthorized = _error_message(res)
            elif status != 200:
                summary.failed += 1
                summary.errors.append(f"line {p.line}: {status or 'no answer'} {detail}".strip())
            elif cache_status == "HIT":
                summary.skipped += 1
            else:
                summary.sent += 1
                self.sent_keys.append(key)


def _wait_stored(r: redis_lib.Redis, keys: list[str], store_wait_s: float) -> int:
    """How many of the entries ``keys`` are in the cache, once all are there, none
    appeared for 1 s, or ``store_wait_s`` seconds passed (entries land a few ms after
    their answer; the rest were not storable: cut short, ...)."""
    deadline = time.monotonic() + store_wait_s
    last, last_change = -1, time.monotonic()
    while True:
        try:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(keynames.cache_entry(k))
            found = sum(int(x) for x in pipe.execute())
        except redis_lib.RedisError:
            found = 0
        now = time.monotonic()
        if found != last:
            last, last_change = found, now
        if found >= len(keys) or now >= deadline or now - last_change >= 1.0:
            return found
        time.sleep(0.1)


def run_warmup(prompts: list[Prompt], edge: str, r: redis_lib.Redis | None, *,
               concurrency: int = 5, api_key: str | None = None, tenant: str = "default",
               timeout_s: float = 120.0, store_wait_s: float = 5.0,
               progress=None) -> Summary:
    """Send ``prompts`` through ``edge`` (``http://host:port``) with at most
    ``concurrency`` requests at once; skip those already in the cache (``r`` None: no
    skipping). ``progress``: callable(done, summary), called once per prompt handled
    (``done`` counts them, 1..len(prompts)). A ``401`` answer stops the run: no further
    prompt is sent and ``summary.unauthorized`` holds the edge's message. After
    sending, waits for the entries to appear (they are written just after each answer):
    until all are there, none appeared for 1 s, or ``store_wait_s`` seconds passed.
    Returns the :class:`Summary`."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    w = _Warmer(edge, r, headers, tenant, timeout_s)
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = [pool.submit(w.one, p) for p in prompts]
        done = 0
        for fut in as_completed(futures):
            fut.result()
            done += 1
            if progress is not None and not w.unauthorized.is_set():
                progress(done, w.summary)
    if r is not None and w.sent_keys:
        w.summary.stored = _wait_stored(r, w.sent_keys, store_wait_s)
    return w.summary


@click.command("warmup")
@click.option("--file", "prompts_file", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Prompts, one per line: plain text or JSONL request bodies.")
@click.option("--concurrency", default=5, show_default=True, type=click.IntRange(1, 256),
              help="Requests in flight at once.")
@click.option("--edge", "edge_url", default=None, metavar="URL",
              help="Edge root, e.g. http://127.0.0.1:8080 [default: from edge.listen].")
@click.option("--model", default=None,
              help="Model for plain-text lines [default: the first of the edge's /v1/models].")
@click.option("--api-key", default=None, envvar="INFERGATE_API_KEY",
              help="API key sent as Bearer (env INFERGATE_API_KEY).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="infergate TOML file (edge address, Redis URL).")
@click.option("--redis-url", default=None,
              help="Redis of the cache, to skip cached prompts [default: redis.url].")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              type=click.FloatRange(0.1), help="Seconds to wait for one answer.")
def warmup_cmd(prompts_file: Path, concurrency: int, edge_url: str | None, model: str | None,
               api_key: str | None, config_path: str | None, redis_url: str | None,
               timeout_s: float) -> None:
    """Send prompts through the edge so their answers are cached."""
    try:
        settings = load_settings(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if redis_url:
        settings.redis.url = redis_url
    if not edge_url:
        edge_url = HostPort.parse(settings.edge.listen, "edge.listen").client_url
    edge_url = edge_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # asked even with --model: an edge that is not there fails the run before any prompt
    first_model = _default_model(edge_url, headers)
    model = model or first_model
    try:
        prompts = read_prompts(prompts_file, model)
    except PromptError as exc:
        raise click.ClickException(f"{prompts_file}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise click.ClickException(f"cannot read {prompts_file}: {exc}") from None
    r: redis_lib.Redis | None
    try:
        r = make_redis(settings.redis)
        r.ping()
    except (redis_lib.RedisError, ValueError) as exc:
        click.echo(f"warning: Redis at {settings.redis.url} unreachable ({exc}); "
                   "cached prompts are not skipped and stores are not counted", err=True)
        r = None
    tenant = tenant_of_key(r, api_key)
    if sys.stdout.isatty():
        with click.progressbar(length=len(prompts), label="warming up") as bar:
            summary = run_warmup(prompts, edge_url, r, concurrency=concurrency,
                                 api_key=api_key, tenant=tenant, timeout_s=timeout_s,
                                 progress=lambda _done, _summary: bar.update(1))
    else:
        summary = run_warmup(prompts, edge_url, r, concurrency=concurrency, api_key=api_key,
                             tenant=tenant, timeout_s=timeout_s,
                             progress=ProgressLines(len(prompts)))
    if summary.unauthorized:
        raise click.ClickException(f"the edge at {edge_url} answered 401 "
                                   f"({summary.unauthorized}): {KEY_HINT}")
    for e in summary.errors[:10]:
        click.echo(f"  {e}", err=True)
    if len(summary.errors) > 10:
        click.echo(f"  ... {len(summary.errors) - 10} more errors", err=True)
    click.echo(summary.text())
    if r is not None and summary.sent and not summary.stored:
        click.echo(f"warning: none of the {summary.sent} answers sent was stored: is {edge_url} "
                   "an infergate edge with the response cache on (cache.enabled), using the "
                   f"Redis at {settings.redis.url.split('@')[-1]}?", err=True)
    if summary.failed:
        raise SystemExit(1)
