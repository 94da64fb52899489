"""`mtad-edge models list|prepare|path`: the named pairs and their prepared files."""

from __future__ import annotations

import click

from mtad_edge.cli.options import errors_as_click
from mtad_edge.pairs import DEFAULT_PAIR, builtin_names, home, load_manifest, prepare


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.group()
def models():
    """Named model pairs: list them, prepare their files, print their paths."""


@models.command("list")
def list_():
    """List the named pairs and whether they are prepared."""
    click.echo(f"cache: {home()}")
    for name in builtin_names():
        m = load_manifest(name)
        ready = all(m.file(r).is_file() for r in ("target", "aux"))
        flag = "prepared" if ready else "not prepared"
        default = " (default)" if name == DEFAULT_PAIR else ""
        click.echo(f"{name}{default}  [{flag}]  {m.data.get('description', '')}")


@models.command("prepare")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Prepare every named pair.")
@errors_as_click
def prepare_(names, all_):
    """Derive the files of NAMES (default: the default pair) into the cache. Idempotent; every
    file's sha256 is checked, and a file whose content changed is derived again (the other
    commands check only its size and modification time)."""
    for name in builtin_names() if all_ else (names or [DEFAULT_PAIR]):
        p = prepare(load_manifest(name), _say, verify=True)
        click.echo(f"{name}: ready (sha256 verified)")
        click.echo(f"  target: {p.target}\n  aux: {p.aux}")


@models.command("path")
@click.argument("name", default=DEFAULT_PAIR)
@errors_as_click
def path(name):
    """Print `target: PATH` and `aux: PATH` for NAME, preparing it first if needed."""
    p = prepare(load_manifest(name), _say)
    click.echo(f"target: {p.target}")
    click.echo(f"aux: {p.aux}")
