"""``python -m bench.edge_overhead.burst [--requests 200] [--bursts 3] [--new-connections]
[--out DIR]``

A burst of paraphrases against the semantic cache, as a client sees it: one stored
question, then ``--requests`` chat completions sent at the same moment (one connection
each, opened before the burst unless ``--new-connections``), each a text never sent before that the cache should answer semantically
(a case or punctuation variant of the stored question, with its spacing varied so that
its exact key is new). The edge runs with the default semantic budget
(``cache.semantic_budget_ms``, 150 ms) and the embedder with its defaults (the default
model and verifier, ``--processes auto``), so a lookup that waits past the budget goes to
the node as ``BYPASS``. Each burst reports how many answers were semantic hits, bypasses
or misses, HTTP statuses, latency p50/p99 (ms) and the burst's wall time; ``--bursts``
bursts run one after the other (the embedder quiet in between). Writes
``semantic_burst.json``. About a minute (most of it the embedder loading).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import click
import requests

from controlplane import procs

from ..common import (RESULTS_DIR, BenchError, Stack, log, machine_info, percentile, rounded,
                      sigterm_as_interrupt, write_json)
from . import __main__ as eo

#: Paraphrases of :data:`eo.SEM_PROMPT` that the default verifier serves (case and
#: punctuation variants; see :data:`eo.PARAPHRASES`).
BURST_PARAPHRASES = eo.PARAPHRASES[:2]


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Status and headers (lower-case names) of one HTTP/1.1 response; its body is read
    (Content-Length or chunked) and dropped."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status, headers


async def _burst(url: str, bodies: list[str], new_connections: bool) -> tuple[list[dict], float]:
    """Sends every body at the same moment, each on a connection of its own (opened
    beforehand, or at that moment with ``new_connections``), over plain asyncio streams:
    the client's own CPU time, on the cores the edge and the embedder use, stays small."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    requests_ = [(f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(b.encode())}\r\n"
                  f"Connection: close\r\n\r\n").encode() + b.encode() for b in bodies]
    start, ready = asyncio.Event(), asyncio.Event()
    waiting = [len(requests_)]

    async def one(req: bytes) -> dict:
        conn = None
        try:
            if not new_connections:
                conn = await asyncio.open_connection(host, port)
        finally:
            waiting[0] -= 1
            if waiting[0] == 0:
                ready.set()
        await start.wait()
        t = time.perf_counter()
        try:
            reader, writer = conn or await asyncio.open_connection(host, port)
            try:
                writer.write(req)
                status, headers = await asyncio.wait_for(_read_response(reader), 60)
            finally:
                writer.close()
            return {"status": status, "ms": (time.perf_counter() - t) * 1000,
                    "cache": headers.get("x-cache-status", ""),
                    "match": headers.get("x-cache-match", "")}
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            return {"status": 0, "ms": (time.perf_counter() - t) * 1000, "cache": "",
                    "match": "", "error": type(exc).__name__}

    tasks = [asyncio.ensure_future(one(r)) for r in requests_]
    await asyncio.wait_for(ready.wait(), 30)  # every task has its connection
    t0 = time.perf_counter()
    start.set()
    res = await asyncio.gather(*tasks)
    return list(res), (time.perf_counter() - t0) * 1000


def summarise(res: list[dict], wall_ms: float) -> dict:
    """Counts of one burst: ``semantic`` (X-Cache-Match semantic), ``bypass``, ``miss``,
    ``exact`` (X-Cache-Match exact), statuses, p50/p99 latency (ms) and wall time (ms)."""
    kinds = Counter()
    for r in res:
        if r["match"] == "semantic":
            kinds["semantic"] += 1
        elif r["match"] == "exact":
            kinds["exact"] += 1
        elif r["cache"].upper().startswith("BYPASS"):
            kinds["bypass"] += 1
        else:
            kinds["miss"] += 1
    n = len(res)
    return {"requests": n, "semantic_hits": kinds["semantic"], "bypass": kinds["bypass"],
            "miss": kinds["miss"], "exact": kinds["exact"],
            "semantic_share": round(kinds["semantic"] / n, 4) if n else 0.0,
            "statuses": dict(Counter(str(r["status"]) for r in res)),
            "p50_ms": rounded(percentile([r["ms"] for r in res], 50), 1),
            "p99_ms": rounded(percentile([r["ms"] for r in res], 99), 1),
            "wall_ms": round(wall_ms, 1)}


@click.command()
@click.option("--requests", "n", type=click.IntRange(1, 2000), default=200, show_default=True)
@click.option("--bursts", type=click.IntRange(1, 20), default=3, show_default=True)
@click.option("--embedder-args", default="", help="Extra embedder options, space separated.")
@click.option("--new-connections", is_flag=True,
              help="Open each request's connection at the burst's moment (default: opened "
                   "before, so the burst is the requests alone).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True, help="Folder for semantic_burst.json.")
def main(n: int, bursts: int, embedder_args: str, new_connections: bool, out_dir: str) -> None:
    """Share of a burst of paraphrases answered by the semantic cache within its budget."""
    meta = {"benchmark": "semantic_burst", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.edge_overhead.burst", *sys.argv[1:]]),
            "machine": machine_info(), "requests": n, "embedder_args": embedder_args,
            "semantic_budget_ms": "default", "new_connections": new_connections}
    results = []
    try:
        with sigterm_as_interrupt(), Stack("infergate-bench-burst-") as stack:
            up_port = procs.free_port()
            d = stack.dir / "upstream"
            (d / "logs").mkdir(parents=True)
            conf = d / "nginx.conf"
            conf.write_text(eo.UPSTREAM_CONF.format(
                prefix=d, port=up_port, answer=eo.STATIC_ANSWER,
                length_answer=eo.LENGTH_ANSWER, filter_answer=eo.FILTER_ANSWER))
            stack.add(eo.start_nginx(conf, d))
            upstream = f"http://127.0.0.1:{up_port}"
            rport = procs.free_port()
            stack.add(procs.start_redis(stack.dir / "redis", rport))
            redis_url = f"redis://127.0.0.1:{rport}/0"
            eo._start_controlplane(stack, eo.edge_settings(redis_url, upstream, None))
            eport = procs.free_port()
            emb = stack.add(procs.Managed("embedder", procs.infergate_argv(
                "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", redis_url,
                "--index", "local", *embedder_args.split()),
                stack.dir / "logs" / "embedder.log").start())
            emb.wait_ready(lambda: requests.get(f"http://127.0.0.1:{eport}/healthz",
                                                timeout=2).ok, 180)
            edge = eo.EdgeProc(stack, "edge", eo.edge_settings(redis_url, upstream, {
                "enabled": True, "semantic": True,
                "embedder_url": f"http://127.0.0.1:{eport}"}))
            log(f"stored: {eo._wait_hit(edge, eo.SEM_PROMPT, 30)}")
            k = 0

            def variant() -> str:
                nonlocal k
                k += 1
                return eo.body(eo.space_variant(BURST_PARAPHRASES[k % len(BURST_PARAPHRASES)],
                                                1 + k // len(BURST_PARAPHRASES)))

            def warm() -> bool:
                r = requests.post(edge.url + "/v1/chat/completions", data=variant(),
                                  headers={"Content-Type": "application/json"}, timeout=10)
                return r.headers.get("X-Cache-Match") == "semantic"

            procs.wait_until(warm, 60, interval=0.2, what="a semantic hit for a paraphrase")
            for i in range(bursts):
                bodies = [variant() for _ in range(n)]
                res, wall = asyncio.run(_burst(edge.url + "/v1/chat/completions", bodies,
                                               new_connections))
                s = summarise(res, wall)
                results.append(s)
                log(f"burst {i + 1}: {s['semantic_hits']}/{n} semantic hits "
                    f"({100 * s['semantic_share']:.1f} %), {s['bypass']} bypass, "
                    f"{s['miss']} miss, statuses {s['statuses']}, p50 {s['p50_ms']} ms, "
                    f"p99 {s['p99_ms']} ms, wall {s['wall_ms']} ms")
                time.sleep(1.0)  # let the embedder's queues drain between bursts
            Path("/tmp/edge_err.log").write_text(edge.error_log())
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    worst = min(results, key=lambda s: s["semantic_share"])
    line = (f"{n}-request burst of paraphrases: worst of {bursts} bursts "
            f"{100 * worst['semantic_share']:.1f} % semantic hits (target >= 90 %) -> "
            f"{'met' if worst['semantic_share'] >= 0.9 else 'MISSED'}")
    print(line)
    path = write_json(Path(out_dir) / "semantic_burst.json",
                      {**meta, "loadavg_after": machine_info()["loadavg_1m"],
                       "bursts": results, "check": line})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
