"""The systemd units of docs/systemd/ pass ``systemd-analyze verify`` with no warning:
the control plane and embedder services (with their paths pointed at a scratch install
whose ``infergate`` is this checkout's), and the nginx drop-in that orders nginx after
Redis, loaded over Debian's own nginx.service. Runs without systemd as PID 1."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "docs" / "systemd"
SERVICES = ("infergate-controlplane.service", "infergate-embedder.service")
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(ANALYZE is None,
                                reason="systemd-analyze missing: apt-get install systemd")


def _verify(*units: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, "verify", "--man=no", *map(str, units)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def _install(workdir: Path) -> Path:
    """The services with /opt/infergate pointed at ``workdir/opt`` (its venv's
    infergate is this checkout's), as .ci/install-runtime would write them."""
    opt = workdir / "opt"
    (opt / "venv" / "bin").mkdir(parents=True)
    exe = Path(shutil.which("infergate", path=str(ROOT / ".venv" / "bin")) or "")
    assert exe.is_file(), "the checkout's .venv/bin/infergate"
    (opt / "venv" / "bin" / "infergate").symlink_to(exe)
    out = workdir / "units"
    out.mkdir()
    for name in SERVICES:
        text = (UNITS / name).read_text().replace("/opt/infergate", str(opt))
        (out / name).write_text(text)
    return out


def test_services_verify_clean(workdir: Path) -> None:
    out = _install(workdir)
    res = _verify(*(out / n for n in SERVICES))
    assert res.returncode == 0 and (res.stdout + res.stderr).strip() == "", res.stdout + res.stderr

    # the check bites: a wrong path or key is reported
    bad = out / "infergate-bad.service"
    bad.write_text((out / SERVICES[0]).read_text()
                   .replace(str(workdir / "opt" / "venv"), "/nonexistent")
                   .replace("Restart=on-failure", "Restart=sometimes"))
    res = _verify(bad)
    assert res.returncode != 0 and "not executable" in res.stderr
    assert "restart specifier" in res.stderr


def test_services_run_the_documented_commands() -> None:
    for name, command in zip(SERVICES, ("controlplane", "embedder")):
        text = (UNITS / name).read_text()
        assert (f"ExecStart=/opt/infergate/venv/bin/infergate {command} "
                "--config /etc/infergate/infergate.toml") in text
        assert "Environment=INFERGATE_HOME=/opt/infergate" in text
        assert "User=infergate" in text and "After=network-online.target redis-server.service" in text
        assert "WantedBy=multi-user.target" in text


@pytest.mark.skipif(not Path("/lib/systemd/system/nginx.service").exists(),
                    reason="Debian's nginx.service is not installed (apt-get install nginx)")
def test_nginx_dropin_verifies_over_debians_unit(workdir: Path) -> None:
    units = workdir / "units"
    (units / "nginx.service.d").mkdir(parents=True)
    shutil.copy("/lib/systemd/system/nginx.service", units / "nginx.service")
    dropin = (UNITS / "nginx.service.d" / "infergate.conf").read_text()
    assert "After=redis-server.service" in dropin and "Wants=redis-server.service" in dropin
    (units / "nginx.service.d" / "infergate.conf").write_text(dropin)
    env = {"SYSTEMD_UNIT_PATH": f"{units}:"}  # ":" = then the usual folders
    res = _verify(units / "nginx.service", env=env)
    assert res.returncode == 0 and (res.stdout + res.stderr).strip() == "", res.stdout + res.stderr

    # the drop-in folder is read: a wrong key in a drop-in there is reported
    (units / "nginx.service.d" / "zz-wrong.conf").write_text("[Unit]\nAftr=redis-server.service\n")
    res = _verify(units / "nginx.service", env=env)
    assert "zz-wrong.conf" in res.stderr and "Aftr" in res.stderr
