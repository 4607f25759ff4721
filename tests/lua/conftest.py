"""Lua unit tests, part of the fast loop (pytest -m "not integration"): Lua runs inside
short-lived nginx processes (``support.stack.lua_eval``: init_by_lua, no server, no
Redis), and ``nginx -t`` checks rendered configurations. A test here that starts a
server (redis-server, a serving nginx, a simulated node: anything through
:meth:`controlplane.procs.Managed.start`) must carry ``@pytest.mark.integration`` (or its
module ``pytestmark``); for any other test the start is refused, so a server cannot slip
into the fast loop unmarked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlplane import procs

MESSAGE = ("this test starts a server: mark it @pytest.mark.integration "
           "(tests/lua/ is in the fast loop)")


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError(MESSAGE)


@pytest.fixture(autouse=True)
def _no_servers_unless_integration(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("integration"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(procs.Managed, "start", _refuse)
        yield
