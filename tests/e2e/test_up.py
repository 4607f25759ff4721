"""`infergate up`, the README's run command: the whole stack starts, answers the README's
requests (plain, streaming, OpenAI client), survives a busy internal port, and stops
every process it started on SIGTERM. Restarts: test_up_restarts.py; stacks side by side:
test_up_supervision.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest
import requests

from controlplane import procs
from controlplane.cli.up.nodes import SIM_NODES, SIM_SLOTS
from support.upstack import alive, children


def start_up(workdir: Path, config: str, edge: int, admin: int, redis_port: int,
             redis_userinfo: str = ""):
    """`infergate up` with ``config`` on the given ports (``--redis-url`` with the user
    info ``redis_userinfo`` when given), waited for until its banner (or its exit);
    returns the process and its open log file."""
    cfg = workdir / "up.toml"
    cfg.write_text(config)
    auth = f"{redis_userinfo}@" if redis_userinfo else ""
    log = open(workdir / "up.log", "w")
    p = subprocess.Popen(
        procs.infergate_argv("up", "--config", str(cfg), "--listen", f"127.0.0.1:{edge}",
                             "--admin-listen", f"127.0.0.1:{admin}",
                             "--redis-url", f"redis://{auth}127.0.0.1:{redis_port}/0",
                             "--workdir", str(workdir / "stack"), "--time-scale", "0.05"),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        procs.wait_until(lambda: "infergate is up." in (workdir / "up.log").read_text()
                         or p.poll() is not None, timeout=90, what="infergate up banner")
    except procs.StartError:
        os.killpg(p.pid, signal.SIGKILL)
        log.close()
        raise
    return p, log


def test_up_serves_the_readme_requests_and_stops_cleanly(workdir: Path) -> None:
    edge, admin, redis_port = procs.free_port(), procs.free_port(), procs.free_port()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    metrics_port = busy.getsockname()[1]
    # The semantic cache is covered elsewhere; here the exact cache is enough.
    p, log = start_up(workdir, f'[edge]\nmetrics_listen = "127.0.0.1:{metrics_port}"\n'
                      '[cache]\nenabled = true\nsemantic = false\n', edge, admin, redis_port)
    try:
        text = (workdir / "up.log").read_text()
        assert p.poll() is None, text
        assert f"redis-server on port {redis_port} has no password" in text   # said so
        key = re.search(r"API key \(demo\)\s+(\S+)", text).group(1)
        metrics = re.search(r"edge metrics\s+(\S+)", text).group(1)
        assert f":{metrics_port}/" not in metrics          # the busy port was left alone
        base = f"http://127.0.0.1:{edge}"
        h = {"Authorization": f"Bearer {key}"}
        body = {"model": "sim-llama", "messages": [{"role": "user", "content": "Hello!"}]}
        procs.wait_until(lambda: requests.post(f"{base}/v1/chat/completions", json=body,
                                               headers=h, timeout=10).status_code == 200,
                         timeout=30, what="first answer")
        # the README's third example: a repeat is a hit once the answer is stored (by the
        # worker's flush timer, just after the answer was sent)
        repeats: list[requests.Response] = []
        procs.wait_until(lambda: repeats.append(requests.post(
            f"{base}/v1/chat/completions", json=body, headers=h, timeout=10))
            or repeats[-1].headers.get("X-Cache-Status") == "HIT", timeout=10,
            what="the repeat answered from the cache")
        r = repeats[-1]
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        assert requests.post(f"{base}/v1/chat/completions", json=body, timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key)
        chunks = client.chat.completions.create(
            model="sim-llama", stream=True,
            messages=[{"role": "user", "content": "Tell me about load balancers."}])
        text_out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text_out) > 10
        assert requests.get(metrics, timeout=5).text.count("infergate_edge_requests_total") > 0
        # the simulated nodes' batch slots are known to the edge (requests beyond them
        # wait at the edge, the fair share applies), as for a vLLM node with max_concurrency
        # set to its --max-num-seqs
        slots = {n["name"]: n["slots"] for n in
                 requests.get(f"{base}/infergate/status", timeout=5).json()["nodes"]}
        assert slots == {name: SIM_SLOTS for name, _ in SIM_NODES}, slots
        kids = children(p.pid)
        assert len(kids) >= 6                               # redis, 3 nodes, control plane, nginx
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(timeout=30)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            busy.close()
            log.close()
    assert rc == 0
    # the way back names every option of this run, the work folder included
    again = next(line for line in (workdir / "up.log").read_text().splitlines()
                 if "starts on its state again" in line)
    assert f"--listen 127.0.0.1:{edge} --admin-listen 127.0.0.1:{admin}" in again
    assert f"--workdir {workdir / 'stack'}" in again and "--time-scale 0.05" in again
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(k) for k in kids), "processes left after SIGTERM"
    for port in (edge, admin, redis_port):
        assert not procs.port_open("127.0.0.1", port)


@pytest.mark.parametrize("userinfo", [":s3cret-pw", "s3cret-pw"],
                         ids=["colon", "password-only"])
def test_up_starts_its_local_redis_with_the_urls_password(workdir: Path, userinfo: str) -> None:
    """A local ``--redis-url`` with a password and nothing listening: up starts Redis
    there requiring that password (no warning), and the stack works through it. The user
    info without a colon is a password too, as infergate reads it everywhere."""
    edge, admin, redis_port = procs.free_port(), procs.free_port(), procs.free_port()
    p, log = start_up(workdir, '[auth]\nmode = "off"\n[cache]\nenabled = false\n',
                      edge, admin, redis_port, redis_userinfo=userinfo)
    try:
        text = (workdir / "up.log").read_text()
        assert p.poll() is None, text
        assert "no password" not in text and "s3cret-pw" not in text.split("export")[0]
        with socket.create_connection(("127.0.0.1", redis_port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(200).startswith(b"-NOAUTH")
        body = {"model": "sim-llama", "messages": [{"role": "user", "content": "Hello!"}]}
        procs.wait_until(lambda: requests.post(f"http://127.0.0.1:{edge}/v1/chat/completions",
                                               json=body, timeout=10).status_code == 200,
                         timeout=30, what="an answer through the stack")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            log.close()
    # the way back names the Redis URL by the variable the banner exports (its password
    # masked and pasted back, Redis would have been started with "***" for one)
    again = next(line for line in (workdir / "up.log").read_text().splitlines()
                 if "starts on its state again" in line)
    assert "s3cret-pw" not in again and '--redis-url "$INFERGATE_REDIS_URL"' in again
    assert f"@127.0.0.1:{redis_port}/0" in again.split("exported as the banner showed")[1]
    assert not procs.port_open("127.0.0.1", redis_port)


def test_up_warns_when_the_shared_redis_keeps_nothing(workdir: Path) -> None:
    """``--redis-url`` to a Redis with a password, ``appendonly no`` and ``save ""``: up
    says in one line, before the banner, that a Redis restart loses the run-time
    configuration, and so does the control plane in its log; the password stays out of
    both."""
    from support.upstack import NO_CACHE, UpStack

    m, port = procs.start_redis_free_port(workdir / "shared-redis", password="pw-shared-1")
    up = None
    try:
        up = UpStack.start(workdir / "up", NO_CACHE,
                           redis_url=f"redis://:pw-shared-1@127.0.0.1:{port}/0")
        text = up.text()
        assert up.proc.poll() is None, text
        lines = [ln for ln in text.splitlines() if "keeps nothing across a restart" in ln]
        assert len(lines) == 1 and lines[0].startswith("warning: "), text
        assert "pw-shared-1" not in lines[0] and "run-time configuration" in lines[0]
        assert text.index(lines[0]) < text.index("infergate is up.")
        cp_log = workdir / "up" / "stack" / "logs" / "controlplane.log"
        procs.wait_until(lambda: "keeps nothing across a restart" in cp_log.read_text(), 15,
                         what="the control plane's warning")
        assert "pw-shared-1" not in cp_log.read_text()
    finally:
        if up is not None:
            up.stop()
        m.stop()


def test_the_cli_without_the_config_refuses_the_stacks_own_ports(workdir: Path) -> None:
    """Used as the banner says (``export INFERGATE_REDIS_URL=...``, no ``--config``),
    ``infergate nodes add`` refuses the stack's edge and admin ports as nodes: its
    control plane publishes them in Redis. A real node is still taken."""
    from support.upstack import NO_CACHE, UpStack, registry

    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        env = {**os.environ, "INFERGATE_REDIS_URL": up.redis_url}
        env.pop("INFERGATE_CONFIG", None)

        def nodes_add(name: str, url: str) -> subprocess.CompletedProcess:
            return subprocess.run(procs.infergate_argv("nodes", "add", name, url), env=env,
                                  capture_output=True, text=True, timeout=60)

        for name, port, what in (("loop", up.edge, "own edge API port"),
                                 ("loop2", up.admin, "own admin port")):
            res = nodes_add(name, f"http://127.0.0.1:{port}")
            assert res.returncode == 1 and what in res.stderr + res.stdout, (res.stdout, res.stderr)
        assert not {"loop", "loop2"} & set(registry(up.redis_url))
        res = nodes_add("extra", f"http://127.0.0.1:{procs.free_port()}")
        assert res.returncode == 0, res.stderr
        assert "extra" in registry(up.redis_url)
    finally:
        up.stop()


def test_a_start_refused_before_any_part_leaves_no_folder(tmp_path: Path) -> None:
    """A Redis that ``up`` cannot use (an ACL user at a local port where nothing answers):
    it says why and exits 1 before starting anything, without the lines of a stop
    ("stopping...", "its logs are in") and without leaving the temp folder it made."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = procs.free_port()
    res = subprocess.run(
        procs.infergate_argv("up", "--listen", f"127.0.0.1:{procs.free_port()}",
                             "--admin-listen", f"127.0.0.1:{procs.free_port()}",
                             "--redis-url", f"redis://alice:pw@127.0.0.1:{port}/0"),
        env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "not for the ACL user 'alice'" in res.stderr
    assert "stopping" not in res.stderr and "logs are in" not in res.stderr
    assert "logs and config in" in res.stdout    # the folder was made, then removed
    assert list(tmp.iterdir()) == []
