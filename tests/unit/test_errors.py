"""Every exception class of the controlplane package derives from InfergateError and keeps
its other base (code catching ValueError / RuntimeError is unchanged)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import controlplane
from controlplane.errors import InfergateError


def package_exceptions() -> dict[str, type[BaseException]]:
    """``module.Class`` -> class, for every exception class defined in the package."""
    out = {}
    for m in pkgutil.walk_packages(controlplane.__path__, "controlplane."):
        if m.name.endswith("__main__"):
            continue  # runs the command line when imported
        mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) \
                    and obj.__module__ == mod.__name__:
                out[f"{mod.__name__}.{name}"] = obj
    return out


def test_every_package_exception_is_an_infergate_error():
    found = package_exceptions()
    assert len(found) >= 20, sorted(found)
    assert [n for n, cls in sorted(found.items()) if not issubclass(cls, InfergateError)] == []


def test_the_other_bases_are_kept():
    from controlplane.admin import apikeys, ops
    from controlplane.cache.store import CacheStoreError
    from controlplane.config import ConfigError
    from controlplane.embedder.models import ModelLoadError
    from controlplane.procs import StartError
    from controlplane.redisdb.url import RedisURLError
    from controlplane.routing.nodemetrics import MetricsParseError
    from controlplane.simnode.faults import FaultsError

    for cls in (ConfigError, RedisURLError, MetricsParseError, FaultsError, CacheStoreError,
                apikeys.ApiKeyError):
        assert issubclass(cls, ValueError), cls
    for cls in (ModelLoadError, StartError):
        assert issubclass(cls, RuntimeError), cls
    assert issubclass(ops.NotFound, ops.AdminError) and not issubclass(ops.AdminError, ValueError)
    err = ConfigError("edge.workers: must be at least 1")
    assert str(err) == "edge.workers: must be at least 1" and isinstance(err, InfergateError)


def test_a_local_model_path_that_does_not_exist_fails_before_loading_anything(tmp_path) -> None:
    from controlplane.embedder.models import ModelLoadError, SentenceTransformerModel

    missing = tmp_path / "no-model"
    with pytest.raises(ModelLoadError, match="does not exist"):
        SentenceTransformerModel(str(missing))
