"""The ``infergate`` command line (click). Subcommands live beside the code they run and
are imported only when called, so ``infergate simnode`` never loads Flask."""

from __future__ import annotations

import importlib

import click

from controlplane import __version__

#: command name -> "module:attribute" of a click command or group.
COMMANDS: dict[str, str] = {
    "up": "controlplane.cli.up:up_cmd",
    "controlplane": "controlplane.routing.service:controlplane_cmd",
    "simnode": "controlplane.cli.simnode:simnode_cmd",
    "render-nginx": "controlplane.edge.render:render_nginx_cmd",
    "nodes": "controlplane.cli.nodes:nodes_cmd",
    "embedder": "controlplane.cli.embedder:embedder_cmd",
    "warmup": "controlplane.cache.warmup:warmup_cmd",
    "cache": "controlplane.cli.cache:cache_cmd",
    "keys": "controlplane.cli.apikeys:keys_cmd",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="infergate")
def main() -> None:
    """infergate: GPU-aware load balancing and response caching for LLM inference."""


if __name__ == "__main__":
    main()
