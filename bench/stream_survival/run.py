"""``python -m bench.stream_survival [--streams 100] [--rounds 2] [--ttft-rounds 5]``

Streams that survive their node (docs/streams.md), on three ``infergate simnode`` nodes
behind Redis and infergate edges (static routing snapshot, no control plane):

1. **Drill.** ``--streams`` concurrent streamed chat completions (80-120 tokens each);
   one node, drawn at random, is killed (SIGKILL) at a random moment while they stream.
   Each stream is classified (:func:`classify`): failed before content (no content, an
   error answer), completed well-formed (one ``id``, one ``finish_reason``, one
   ``[DONE]`` last, the text exactly the node's deterministic answer: nothing repeated
   or lost at a seam), ended with an SSE error event, or cut silently (anything else).
   Streams that had content from the killed node are counted apart ("mid-stream on
   the killed node"). Run with the relay (``edge.stream_relay`` on, the default) and
   once with nginx's proxy path for comparison; the killed node is started again
   between rounds.
2. **TTFT.** Healthy streams, sequential, interleaved over three edges on the same
   nodes: relay with first-byte holding (``stream_hold_s`` 2), relay without holding
   (0) and the proxy path (``stream_relay`` false); the client leaves after the first
   content token. Time to first content token, p50 per
   round and over all; the ratio of the p50s; the noise is the spread of the per-round
   p50s of each edge.

Writes ``bench/results/stream_survival.json`` and prints the tables (:func:`tables`,
also used by ``python -m bench.report``).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import redis
import requests

from controlplane import procs
from controlplane.config import settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx
from controlplane.redisdb import keynames
from controlplane.simnode import launch, wire

from ..common import (RESULTS_DIR, Stack, format_table, git_commit, log, machine_info,
                      percentile, rounded, sigterm_as_interrupt, write_json)

MODEL = "sim-llama"
OUTPUT = (80, 120)
NAMES = ("a", "b", "c")


def expected_text(content: str) -> str:
    """The answer every simulated node gives to ``content`` (deterministic)."""
    req = wire.parse_request("chat", {"model": MODEL, "messages": [
        {"role": "user", "content": content}]}, MODEL)
    return "".join(wire.plan_output(req, *OUTPUT).tokens)


def _events(raw: str) -> list[str]:
    return [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]


def classify(status: int, raw: str, expected: str) -> dict[str, Any]:
    """What one stream was: {"outcome": failed_before_content | completed | sse_error |
    silent_cut, "seam_ok": text as expected, "writers": nodes that wrote content}."""
    if status != 200:
        return {"outcome": "failed_before_content", "seam_ok": False, "writers": []}
    events = _events(raw)
    chunks, error = [], False
    for e in events:
        if e == "[DONE]":
            continue
        try:
            obj = json.loads(e)
        except ValueError:
            return {"outcome": "silent_cut", "seam_ok": False, "writers": []}
        if "error" in obj:
            error = True
        else:
            chunks.append(obj)
    content = [c for c in chunks if c.get("choices") and c["choices"][0]["delta"].get("content")]
    writers = sorted({c.get("system_fingerprint") for c in content})
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    if error:
        return {"outcome": "sse_error", "seam_ok": False, "writers": writers, "content": bool(content)}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks
                if c.get("choices") and c["choices"][0].get("finish_reason")]
    well = (events and events[-1] == "[DONE]" and events.count("[DONE]") == 1
            and len(finishes) == 1 and len({c["id"] for c in chunks}) == 1)
    if not well:
        return {"outcome": "failed_before_content" if not content else "silent_cut",
                "seam_ok": False, "writers": writers, "content": bool(content)}
    return {"outcome": "completed", "seam_ok": text == expected, "writers": writers,
            "content": True}


def _snapshot(r: redis.Redis, nodes: list[launch.SimNodeProcess]) -> None:
    version = int(r.incr(keynames.ROUTING_VERSION))
    snap = {"version": version, "generated_at": time.time(), "leader": "bench", "nodes": [
        {"name": n.name, "url": n.url, "host": n.host, "port": n.port, "kind": "vllm",
         "state": "active", "healthy": True, "weight": 1.0, "effective_weight": 1.0,
         "max_concurrency": 256, "score": 0.0, "saturated": False, "queue_depth": 0,
         "running": 0, "kv_cache_usage": 0.0, "has_metrics": True, "models": [MODEL]}
        for n in nodes]}
    r.set(keynames.ROUTING, json.dumps(snap))


def _edge(stack: Stack, name: str, redis_url: str, **edge: Any) -> str:
    port = procs.free_port()
    s = settings_from_dict({"redis": {"url": redis_url}, "edge": {
        "workers": 1, "sync_interval_s": 0.1, "stale_after_s": 3600, "metrics_listen": "",
        "breaker_failures": 3, "breaker_cooldown_s": 30, "read_timeout_ms": 30000, **edge}})
    d = stack.dir / name
    rendered = render_nginx(s, d / "conf", listen=f"127.0.0.1:{port}", prefix=d / "prefix")
    stack.add(start_nginx(rendered.nginx_conf, rendered.prefix))
    url = f"http://127.0.0.1:{port}"

    def routed() -> bool:
        try:
            st = requests.get(f"{url}/infergate/status", timeout=2).json()
        except (requests.RequestException, ValueError):
            return False
        return st["snapshot"]["source"] == "redis"

    procs.wait_until(routed, 15, what=f"edge {name} routing")
    return url


def _one_stream(url: str, content: str, first_only: bool = False) -> tuple[int, str, float | None]:
    """status, raw body (what arrived before a cut), seconds to the first content token;
    first_only: the client leaves after the first content token."""
    t0 = time.perf_counter()
    ttft, status, parts = None, 0, []
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": content}]}
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True,
                           timeout=60) as res:
            status = res.status_code
            for piece in res.iter_content(None):
                if ttft is None and b'"content":"' in piece.replace(b'"content":""', b""):
                    ttft = time.perf_counter() - t0
                    if first_only:
                        break
                parts.append(piece)
    except requests.RequestException:
        pass
    return status, b"".join(parts).decode(errors="replace"), ttft


def drill_round(url: str, nodes: list[launch.SimNodeProcess], n: int, rng: random.Random,
                tag: str) -> dict[str, Any]:
    """One drill: n concurrent streams, one node killed at a random moment."""
    victim = rng.choice(nodes)
    delay = rng.uniform(0.3, 1.5)
    killer = threading.Timer(delay, lambda: victim.managed.signal(signal.SIGKILL))
    prompts = [f"{tag} stream {i}" for i in range(n)]
    killer.start()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: _one_stream(url, p), prompts))
    killer.join()
    counts = {"failed_before_content": 0, "completed": 0, "sse_error": 0, "silent_cut": 0}
    seam_ok = mid = mid_completed = 0
    for p, (status, raw, _) in zip(prompts, results):
        c = classify(status, raw, expected_text(p))
        counts[c["outcome"]] += 1
        seam_ok += c["outcome"] == "completed" and c["seam_ok"]
        if victim.name in c["writers"]:
            mid += 1
            mid_completed += c["outcome"] == "completed" and c["seam_ok"]
    return {"killed": victim.name, "kill_after_s": round(delay, 3), "streams": n, **counts,
            "seam_ok": seam_ok, "mid_stream_on_killed": mid,
            "mid_stream_completed": mid_completed}


def _restart(stack: Stack, r: redis.Redis, nodes: list[launch.SimNodeProcess],
             flags: list[str], rnd: int) -> None:
    """The killed node again, under a new name (its breaker at the edges is open)."""
    for i, nd in enumerate(nodes):
        if not nd.managed.alive():
            nodes[i] = launch.start_node(f"{nd.name[0]}{rnd}", stack.dir / "logs", *flags,
                                         into=stack)
    _snapshot(r, nodes)
    time.sleep(0.5)  # the edges sync every 0.1 s


def ttft_runs(urls: dict[str, str], rounds: int, per_round: int) -> dict[str, Any]:
    """Interleaved healthy streams over the edges: TTFT p50 per round and over all."""
    samples: dict[str, list[float]] = {k: [] for k in urls}
    per: dict[str, list[float]] = {k: [] for k in urls}
    for rnd in range(rounds):
        this: dict[str, list[float]] = {k: [] for k in urls}
        for i in range(per_round):
            for k, url in urls.items():
                status, _, ttft = _one_stream(url, f"ttft {rnd} {i}", first_only=True)
                if status == 200 and ttft is not None:
                    this[k].append(ttft * 1000)
        for k, v in this.items():
            samples[k].extend(v)
            per[k].append(percentile(v, 50) or 0.0)
    out = {}
    for k in urls:
        out[k] = {"p50_ms": rounded(percentile(samples[k], 50), 3),
                  "p90_ms": rounded(percentile(samples[k], 90), 3), "n": len(samples[k]),
                  "round_p50_ms": [rounded(x, 3) for x in per[k]],
                  "noise_ms": rounded(max(per[k]) - min(per[k]), 3)}
    return out


DRILL_COLUMNS = [("edge", "edge"), ("killed", "killed"), ("kill_after_s", "kill at s"),
                 ("streams", "streams"), ("failed_before_content", "failed before content"),
                 ("completed", "completed well-formed"), ("seam_ok", "text exact"),
                 ("sse_error", "SSE error"), ("silent_cut", "silent cuts"),
                 ("mid", "mid-stream on killed: completed")]
TTFT_COLUMNS = [("edge", "edge"), ("p50_ms", "TTFT p50 ms"), ("p90_ms", "p90 ms"),
                ("n", "streams"), ("rounds", "per-round p50 ms"), ("noise_ms", "noise ms"),
                ("ratio", "p50 / proxy")]


def tables(data: dict[str, Any]) -> None:
    """Print the drill and TTFT tables of a result document."""
    rows = [{**d, "mid": f"{d['mid_stream_completed']} / {d['mid_stream_on_killed']}"}
            for d in data["drill"]]
    print(format_table(rows, DRILL_COLUMNS))
    print()
    t = data["ttft"]
    base = t["proxy"]["p50_ms"] or 1.0
    trow = [{"edge": k, **v, "rounds": " ".join(f"{x:.1f}" for x in v["round_p50_ms"]),
             "ratio": f"{(v['p50_ms'] or 0) / base:.3f}"} for k, v in t.items()]
    print(format_table(trow, TTFT_COLUMNS))


@click.command()
@click.option("--streams", default=100, show_default=True, help="Concurrent streams per drill.")
@click.option("--rounds", default=2, show_default=True, help="Drills with the relay.")
@click.option("--ttft-rounds", default=5, show_default=True)
@click.option("--ttft-per-round", default=20, show_default=True)
@click.option("--time-scale", default=0.5, show_default=True)
@click.option("--seed", default=1, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=RESULTS_DIR / "stream_survival.json")
def main(streams: int, rounds: int, ttft_rounds: int, ttft_per_round: int, time_scale: float,
         seed: int, out: Path) -> None:
    """The drill and the TTFT comparison (module docstring)."""
    rng = random.Random(seed)
    started = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())
    load_before = Path("/proc/loadavg").read_text().split()[0]
    flags = ["--time-scale", str(time_scale), "--output-tokens", f"{OUTPUT[0]}:{OUTPUT[1]}",
             "--max-running", "256"]
    with sigterm_as_interrupt(), Stack(prefix="infergate-streams-") as stack:
        rport = procs.free_port()
        stack.add(procs.start_redis(stack.dir / "redis", rport))
        r = redis.Redis(host="127.0.0.1", port=rport, socket_timeout=2)
        nodes = launch.start_nodes([(n, flags) for n in NAMES], stack.dir / "logs", into=stack)
        _snapshot(r, nodes)
        rurl = f"redis://127.0.0.1:{rport}/0"
        urls = {"relay, hold 2 s": _edge(stack, "hold", rurl),
                "relay, no hold": _edge(stack, "nohold", rurl, stream_hold_s=0),
                "proxy": _edge(stack, "proxy", rurl, stream_relay=False)}
        log("TTFT, healthy nodes")
        ttft = ttft_runs(urls, ttft_rounds, ttft_per_round)
        drill = []
        for i, (edge, url) in enumerate([*[("relay", urls["relay, hold 2 s"])] * rounds,
                                         ("proxy", urls["proxy"])]):
            log(f"drill {i + 1}: {edge}")
            d = drill_round(url, nodes, streams, rng, f"{edge} {i}")
            drill.append({"edge": edge, **d})
            log(json.dumps(drill[-1]))
            _restart(stack, r, nodes, flags, i + 1)
    data = {"meta": {"command": "python -m bench.stream_survival", "started": started,
                     "commit": git_commit(), "machine": machine_info(),
                     "loadavg_before": load_before,
                     "loadavg_after": Path("/proc/loadavg").read_text().split()[0],
                     "time_scale": time_scale, "output_tokens": list(OUTPUT), "seed": seed},
            "drill": drill, "ttft": {"relay, hold 2 s": ttft["relay, hold 2 s"],
                                     "relay, no hold": ttft["relay, no hold"],
                                     "proxy": ttft["proxy"]}}
    write_json(out, data)
    tables(data)
