"""The `mtad-edge` command: a click group whose default command is `generate`."""

from __future__ import annotations

import click

from mtad_edge import __version__


class DefaultGroup(click.Group):
    """`mtad-edge "prompt"` means `mtad-edge generate "prompt"` (as `llm "prompt"` does)."""

    default_command = "generate"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup)
@click.version_option(__version__, prog_name="mtad-edge")
def cli():
    """Multi-token assisted decoding (MTAD) on llama.cpp: a small model drafts, a big one verifies."""


def _register() -> None:
    from mtad_edge.cli.bench import bench
    from mtad_edge.cli.chat import chat
    from mtad_edge.cli.export import export
    from mtad_edge.cli.generate import generate
    from mtad_edge.cli.models import models
    from mtad_edge.cli.rpc import rpc
    from mtad_edge.cli.serve import serve
    from mtad_edge.cli.tune import tune

    cli.add_command(generate)
    cli.add_command(models)
    cli.add_command(bench)
    cli.add_command(serve)
    cli.add_command(chat)
    cli.add_command(export)
    cli.add_command(tune)
    cli.add_command(rpc)


_register()
