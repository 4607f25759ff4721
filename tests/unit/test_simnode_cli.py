"""Command-line checks of ``infergate simnode`` that start no process: usage errors are
rejected before anything listens, and a taken port is reported (the command runs in
this process through click's test runner)."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from controlplane.cli.simnode import simnode_cmd


@pytest.mark.parametrize("args", [["--refuse"], ["--output-tokens", "9:3"],
                                  ["--output-tokens", "abc"], ["--dialect", "triton"],
                                  ["--port", "9100", "--control-port", "9100"],
                                  ["--prefix-cache-blocks", "-1"]])
def test_cli_usage_errors(args):
    res = CliRunner().invoke(simnode_cmd, args)
    assert res.exit_code == 2, res.output


def test_cli_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = CliRunner().invoke(simnode_cmd, ["--port", str(s.getsockname()[1])])
    assert res.exit_code == 1 and "cannot listen" in res.output


def test_cli_prefix_cache_flags_are_accepted():
    # Parsed and turned into an engine config: the run then fails only on the taken port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = CliRunner().invoke(simnode_cmd, ["--port", str(s.getsockname()[1]),
                                               "--no-prefix-caching", "--prefix-cache-blocks", "8"])
    assert res.exit_code == 1 and "cannot listen" in res.output
