"""``python -m bench.edge_overhead [--duration S] [--connections N] [--rounds R] [--out DIR]``

What the edge costs in front of an upstream that costs nothing: a static nginx that
answers every request with a fixed chat-completion JSON (``return 200 '...'``). Rows,
each measured with ``wrk --latency`` (POST bodies from a wrk Lua script):

- ``direct``: wrk -> upstream.
- ``nginx_proxy``: wrk -> plain nginx ``proxy_pass`` (keepalive upstream) -> upstream.
- ``infergate``: wrk -> infergate edge (rendered config, Redis, control plane; response
  cache off) -> upstream.
- ``infergate_exact_hit`` / ``infergate_semantic_hit``: the edge answering from its
  response cache, when this tree has one (``lua/infergate/cache/lookup.lua`` and a ``[cache]``
  section in the settings; the semantic row also needs the embedder and its bundled
  model). Otherwise the row says "not available" and why.

Every nginx runs one worker; wrk runs one thread. Each row is measured ``--rounds``
times, interleaved with the other rows, and the round with the median requests/s is
reported. Ratios are against ``nginx_proxy``. Writes ``edge_overhead.json``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click
import redis
import requests

from controlplane import paths, procs
from controlplane.redisdb import keynames
from controlplane.config import EdgeSettings, Settings, settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx

from ..common import (NGINX_HEAD, RESULTS_DIR, BenchError, Stack, format_table, log, machine_info,
                      sigterm_as_interrupt, tool_version, write_json)
from . import wrk

ROWS = ("direct", "nginx_proxy", "infergate", "infergate_exact_hit", "infergate_semantic_hit")
MODEL = "static"
#: The upstream's answer (a complete, small chat completion).
STATIC_ANSWER = json.dumps({
    "id": "chatcmpl-static", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Paris is the capital of France."}}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}},
    separators=(",", ":"))
PROMPT = "What is the capital of France?"
#: The semantic-hit row has its own prompt (the exact-hit edge shares Redis and has
#: already stored PROMPT), paraphrases cycled by wrk, and a probe paraphrase used only
#: to wait until the embedder has indexed SEM_PROMPT.
SEM_PROMPT = "How can I improve my English speaking skills?"
PARAPHRASES = ["How do I improve my spoken English?",
               "How can I get better at speaking English?",
               "What can I do to improve my English speaking?",
               "How can I improve my speaking skills in English?"]
PROBE = "How could I improve my English speaking skills?"
#: Distinct bodies of the semantic-hit row (case variants of the paraphrases); more than
#: wrk sends in one measurement, so each request is new to the cache.
SEMANTIC_BODIES = 20000
#: Time budget of a semantic lookup in this row (the default 150 ms is often exceeded by
#: a CPU-only embedder on a busy 2-core machine, and the row would measure bypasses).
SEMANTIC_BUDGET_MS = 2000
MIN_SIMILARITY = 0.8

UPSTREAM_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body_temp;
    proxy_temp_path {prefix}/proxy_temp;
    fastcgi_temp_path {prefix}/fastcgi_temp;
    uwsgi_temp_path {prefix}/uwsgi_temp;
    scgi_temp_path {prefix}/scgi_temp;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            default_type application/json;
            return 200 '{answer}';
        }}
    }}
}}
"""

PROXY_CONF = NGINX_HEAD + """\
    upstream static_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            proxy_pass http://static_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def case_variant(text: str, i: int) -> str:
    """``text`` with the case of its letters flipped where the bits of ``i`` are set
    (letter k <-> bit k): ``i`` = 0 is ``text`` itself, and distinct ``i`` below
    2**letters give distinct texts. The embedding model is uncased, so every variant
    has the same embedding; the exact cache key differs."""
    out = []
    k = 0
    for ch in text:
        if ch.isalpha():
            out.append(ch.swapcase() if (i >> k) & 1 else ch)
            k += 1
        else:
            out.append(ch)
    return "".join(out)


def body(prompt: str) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0}, separators=(",", ":"))


def cache_support(home: Path) -> tuple[bool, str]:
    """Whether this tree's edge has a response cache the bench can turn on: returns
    (available, reason when not)."""
    if not (home / "lua" / "infergate" / "cache" / "lookup.lua").exists():
        return False, ("the edge has no response cache in this tree (lua/infergate/cache/lookup.lua "
                       "is missing)")
    cache = Settings.model_fields.get("cache")
    if cache is None or "enabled" not in getattr(cache.annotation, "model_fields", {}):
        return False, "the settings have no [cache] section with 'enabled'"
    return True, ""


def edge_settings(redis_url: str, upstream_url: str, cache: dict | None) -> Settings:
    """One-worker edge with the static upstream as its only node (kind ``openai``: no
    metrics endpoint), without the edge's own Prometheus listener; ``cache`` is the ``[cache]`` section (``None``: left out when the
    settings have no cache, else ``enabled = false``)."""
    data: dict = {"redis": {"url": redis_url}, "edge": {"workers": 1},
                  "nodes": [{"name": "static", "url": upstream_url, "kind": "openai"}]}
    if "metrics_listen" in EdgeSettings.model_fields:
        data["edge"]["metrics_listen"] = ""  # several edges run at once: no fixed port
    if cache is not None:
        data["cache"] = cache
    elif "cache" in Settings.model_fields:
        data["cache"] = {"enabled": False}
    return settings_from_dict(data, "edge overhead benchmark")


class EdgeProc:
    """A running infergate edge (nginx with the rendered config)."""

    def __init__(self, stack: Stack, name: str, settings: Settings) -> None:
        port = procs.free_port()
        d = stack.dir / name
        rendered = render_nginx(settings, d / "conf", listen=f"127.0.0.1:{port}",
                                prefix=d / "prefix", source="edge overhead benchmark")
        self.managed = stack.add(start_nginx(rendered.nginx_conf, rendered.prefix))
        self.url = f"http://127.0.0.1:{port}"
        procs.wait_until(self._routes, 20, what=f"edge {name} to route on the snapshot")

    def _routes(self) -> bool:
        st = requests.get(f"{self.url}/infergate/status", timeout=2).json()
        return st["snapshot"]["source"] == "redis" and any(n["eligible"] for n in st["nodes"])

    def post(self, prompt: str) -> requests.Response:
        return requests.post(f"{self.url}/v1/chat/completions", data=body(prompt),
                             headers={"Content-Type": "application/json"}, timeout=10)


def _wait_hit(edge: EdgeProc, prompt: str, timeout: float) -> str:
    """Post ``prompt`` until the answer carries ``X-Cache-Status: HIT``; returns the
    last status seen. Raises ``procs.StartError`` on timeout."""
    seen = {"status": ""}

    def hit() -> bool:
        r = edge.post(prompt)
        seen["status"] = r.headers.get("X-Cache-Status", f"(no X-Cache-Status, HTTP {r.status_code})")
        return r.status_code == 200 and seen["status"].upper().startswith("HIT")

    procs.wait_until(hit, timeout, interval=0.2, what=f"a cache HIT for {prompt!r}")
    return seen["status"]


@click.command()
@click.option("--duration", type=click.FloatRange(1, 120), default=4.0, show_default=True,
              help="Seconds of each wrk measurement.")
@click.option("--connections", type=click.IntRange(1, 1000), default=16, show_default=True,
              help="wrk connections.")
@click.option("--rounds", type=click.IntRange(1, 9), default=3, show_default=True,
              help="Measurements per row (interleaved); the median one is reported.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True, help="Folder for edge_overhead.json.")
@click.option("--keep", is_flag=True, help="Keep the scratch folder (configs, logs).")
def main(duration: float, connections: int, rounds: int, out_dir: str, keep: bool) -> None:
    """Requests/s and p50/p99 latency of the infergate edge against plain nginx (wrk)."""
    home = paths.home()
    out = Path(out_dir)
    meta = {"benchmark": "edge_overhead", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.edge_overhead", *sys.argv[1:]]),
            "machine": machine_info(), "wrk": tool_version(["wrk", "-v"]),
            "duration_s": duration, "connections": connections, "threads": 1, "rounds": rounds,
            "nginx_workers": 1, "request_body": body(PROMPT), "upstream_answer": STATIC_ANSWER}
    rows: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        wrk.wrk_binary()
        with sigterm_as_interrupt(), Stack("infergate-bench-edge-", keep=keep) as stack:
            targets = _start_targets(stack, home, rows)
            scripts = {}
            for name, (_, bodies) in targets.items():
                p = stack.dir / f"{name}.lua"
                p.write_text(wrk.post_script(bodies, {"Content-Type": "application/json"}))
                scripts[name] = p
            results: dict[str, list[wrk.WrkResult]] = {n: [] for n in targets}
            for rnd in range(rounds):
                for name, (url, _) in targets.items():
                    # a short warm-up fills keepalive pools and the Lua code cache
                    wrk.run(url, scripts[name], duration_s=1, connections=connections)
                    res = wrk.run(url, scripts[name], duration_s=duration, connections=connections)
                    results[name].append(res)
                    log(f"round {rnd + 1}/{rounds} {name}: {res.rps:.0f} req/s, p50 "
                        f"{res.p50_ms:.3f} ms, p99 {res.p99_ms:.3f} ms, non-2xx {res.non_2xx}, "
                        f"statuses {res.statuses}")
            for name, rs in results.items():
                rs = sorted(rs, key=lambda r: r.rps)
                best = rs[len(rs) // 2]
                rows[name] = {"row": name, "available": True, "reason": None,
                              **{k: v for k, v in asdict(best).items()},
                              "rounds_rps": [round(r.rps, 1) for r in results[name]]}
            if "infergate_semantic_hit" in targets:
                # one connection: the cost of a lookup without queueing behind others
                url, _ = targets["infergate_semantic_hit"]
                one = wrk.run(url, scripts["infergate_semantic_hit"], duration_s=duration,
                              connections=1)
                rows["infergate_semantic_hit"]["one_connection"] = asdict(one)
                log(f"infergate_semantic_hit, 1 connection: {one.rps:.0f} req/s, p50 "
                    f"{one.p50_ms:.3f} ms, p99 {one.p99_ms:.3f} ms, statuses {one.statuses}")
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        sys.exit(130)
    except (procs.StartError, wrk.WrkError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None

    records = finish_records(rows)
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(out / "edge_overhead.json", {"meta": meta, "rows": records})
    print(format_table(table_rows(records), COLUMNS))
    for r in records:
        if not r["available"]:
            print(f"{r['row']}: not available: {r['reason']}")
    print(f"\nwrk -t1 -c{connections} -d{duration:g}s --latency, median of {rounds} rounds; "
          f"{meta['machine']['nproc']} CPUs; wrote {out / 'edge_overhead.json'}")


def _start_targets(stack: Stack, home: Path, rows: dict[str, dict]) -> dict[str, tuple[str, list[str]]]:
    """Start the upstream, the proxies and the edges; return row -> (url, bodies).
    Rows that cannot run are recorded in ``rows`` as not available."""
    up_port = procs.free_port()
    d = stack.dir / "upstream"
    (d / "logs").mkdir(parents=True)
    conf = d / "nginx.conf"
    conf.write_text(UPSTREAM_CONF.format(prefix=d, port=up_port, answer=STATIC_ANSWER))
    stack.add(start_nginx(conf, d))
    upstream = f"http://127.0.0.1:{up_port}"

    px_port = procs.free_port()
    d = stack.dir / "proxy"
    (d / "logs").mkdir(parents=True)
    conf = d / "nginx.conf"
    conf.write_text(PROXY_CONF.format(prefix=d, port=px_port, upstream_port=up_port))
    stack.add(start_nginx(conf, d))
    proxy = f"http://127.0.0.1:{px_port}"

    rport = procs.free_port()
    stack.add(procs.start_redis(stack.dir / "redis", rport))
    redis_url = f"redis://127.0.0.1:{rport}/0"
    base = edge_settings(redis_url, upstream, None)
    _start_controlplane(stack, base)

    chat = "/v1/chat/completions"
    targets = {"direct": (upstream + chat, [body(PROMPT)]),
               "nginx_proxy": (proxy + chat, [body(PROMPT)])}
    edge = EdgeProc(stack, "edge", base)
    targets["infergate"] = (edge.url + chat, [body(PROMPT)])

    ok, reason = cache_support(home)
    if not ok:
        for row in ("infergate_exact_hit", "infergate_semantic_hit"):
            rows[row] = {"row": row, "available": False, "reason": reason}
        return targets
    try:
        exact = EdgeProc(stack, "edge-exact",
                         edge_settings(redis_url, upstream, {"enabled": True, "semantic": False}))
        status = _wait_hit(exact, PROMPT, 15)
        log(f"exact-hit edge primed ({status})")
        targets["infergate_exact_hit"] = (exact.url + chat, [body(PROMPT)])
    except (procs.StartError, requests.RequestException, ValueError) as exc:
        rows["infergate_exact_hit"] = {"row": "infergate_exact_hit", "available": False,
                                       "reason": f"cache on, but no exact hit: {exc}"}
    try:
        targets["infergate_semantic_hit"] = _semantic_target(stack, redis_url, upstream)
    except (procs.StartError, requests.RequestException, ValueError, BenchError) as exc:
        rows["infergate_semantic_hit"] = {"row": "infergate_semantic_hit", "available": False,
                                          "reason": f"semantic hit path could not be set up: {exc}"}
    return targets


def _start_controlplane(stack: Stack, settings: Settings) -> None:
    import tomli_w

    s = settings.model_copy(deep=True)
    cport = procs.free_port()
    s.controlplane.listen = f"127.0.0.1:{cport}"
    cfg = stack.dir / "infergate.toml"
    cfg.write_text(tomli_w.dumps(s.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
    m = stack.add(procs.Managed("controlplane",
                                procs.infergate_argv("controlplane", "--config", str(cfg)),
                                stack.dir / "logs" / "controlplane.log").start())
    r = redis.Redis.from_url(s.redis.url, socket_timeout=2)
    m.wait_ready(lambda: r.get(keynames.ROUTING) is not None, 60)


def _semantic_target(stack: Stack, redis_url: str, upstream: str) -> tuple[str, list[str]]:
    """Start the embedder (bundled all-MiniLM-L6-v2, in-process index) and an edge with
    the semantic cache on; store SEM_PROMPT, wait until a probe paraphrase hits it
    semantically, keep the paraphrases whose upper-case form is a semantic hit, and return
    :data:`SEMANTIC_BODIES` case variants of them (each text new to the cache).
    Raises :class:`BenchError` when no paraphrase hits."""
    eport = procs.free_port()
    emb = stack.add(procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", redis_url,
        "--index", "local", "--threads", "4"), stack.dir / "logs" / "embedder.log").start())
    emb.wait_ready(lambda: requests.get(f"http://127.0.0.1:{eport}/healthz", timeout=2).ok, 180)
    settings = edge_settings(redis_url, upstream, {
        "enabled": True, "semantic": True, "embedder_url": f"http://127.0.0.1:{eport}",
        "min_similarity": MIN_SIMILARITY, "semantic_budget_ms": SEMANTIC_BUDGET_MS})
    edge = EdgeProc(stack, "edge-semantic", settings)
    first = _wait_hit(edge, SEM_PROMPT, 30)
    log(f"semantic edge: the prompt is stored ({first})")
    seen = {"match": "", "n": 0}

    def probe_hits() -> bool:
        # a new text every time: a probe that hit once would be an exact hit afterwards
        seen["n"] += 1
        r = edge.post(case_variant(PROBE, seen["n"]))
        seen["match"] = (f"{r.status_code} {r.headers.get('X-Cache-Status')} "
                         f"{r.headers.get('X-Cache-Match')} {r.headers.get('X-Cache-Similarity')}")
        return r.headers.get("X-Cache-Match") == "semantic"

    try:
        procs.wait_until(probe_hits, 60, interval=0.2, what=f"a semantic hit for {PROBE!r}")
    except procs.StartError as exc:
        raise BenchError(f"{exc} (last answer: {seen['match']})") from None
    kept = []
    for p in PARAPHRASES:
        r = edge.post(p.upper())
        match = r.headers.get("X-Cache-Match")
        log(f"paraphrase {p!r}: {r.headers.get('X-Cache-Status')} {match} "
            f"similarity {r.headers.get('X-Cache-Similarity')}")
        if match == "semantic":
            kept.append(p)
    if not kept:
        raise BenchError(f"no paraphrase hit semantically at min_similarity {MIN_SIMILARITY}")
    # A semantic hit is remembered under the paraphrase's own exact key, so only a text
    # never sent before takes the semantic path: every body is a new case variant (the
    # precision guard rejects added words or numbers, the uncased model ignores case).
    return edge.url + "/v1/chat/completions", [
        body(case_variant(kept[i % len(kept)], 1 + i // len(kept))) for i in range(SEMANTIC_BODIES)]


COLUMNS = [("row", "path"), ("rps", "req/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"),
           ("rps_ratio", "req/s vs nginx"), ("p50_ratio", "p50 vs nginx"),
           ("p99_ratio", "p99 vs nginx"), ("non_2xx", "non-2xx")]


def finish_records(rows: dict[str, dict]) -> list[dict]:
    """Rows in :data:`ROWS` order with the ratios to ``nginx_proxy`` (``rps_ratio`` =
    rps / nginx rps; ``p50_ratio``, ``p99_ratio`` = latency / nginx latency); rows never
    measured become "not available"."""
    ref = rows.get("nginx_proxy") if rows.get("nginx_proxy", {}).get("available") else None
    out = []
    for name in ROWS:
        r = dict(rows.get(name) or {"row": name, "available": False,
                                    "reason": "not measured"})
        if r.get("available") and ref:
            r["rps_ratio"] = round(r["rps"] / ref["rps"], 3) if ref["rps"] else None
            r["p50_ratio"] = round(r["p50_ms"] / ref["p50_ms"], 3) if ref["p50_ms"] else None
            r["p99_ratio"] = round(r["p99_ms"] / ref["p99_ms"], 3) if ref["p99_ms"] else None
        out.append(r)
    return out


def table_rows(records: list[dict]) -> list[dict]:
    """Records for the printed table; unavailable rows say so in the req/s column."""
    out = []
    for r in records:
        if r.get("available"):
            out.append(r)
        else:
            out.append({"row": r["row"], "rps": "not available"})
    return out


if __name__ == "__main__":
    main()
