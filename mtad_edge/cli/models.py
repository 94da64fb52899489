"""`mtad-edge models list|prepare|pull|path`: the named pairs and their prepared or downloaded files."""

from __future__ import annotations

import click

import mtad_edge.hub as hub
from mtad_edge.cli.options import errors_as_click
from mtad_edge.pairs import DEFAULT_PAIR, Manifest, builtin_names, hub_pair_names, load_manifest, prepare
from mtad_edge.store import home


def _say(msg: str) -> None:
    click.echo(msg, err=True)


@click.group()
def models():
    """Named model pairs: list them, prepare their files, print their paths."""


@models.command("list")
@errors_as_click
def list_():
    """List the named pairs: local ones (derived from installed packages) and known pairs on the Hugging Face Hub
    (remote until pulled, then cached), with their sizes. Never touches the network."""
    click.echo(f"cache: {home()}\nhub cache: {hub.cache_dir()}")
    for name in builtin_names() + hub_pair_names():
        m = load_manifest(name)
        default = " (default)" if name == DEFAULT_PAIR else ""
        click.echo(f"{name}{default}  [{_status(m)}]  {m.data.get('description', '')}")


def _status(m: Manifest) -> str:
    """local (prepared / not prepared), or remote / partly cached / cached for a pair with hub files, with the size
    on disk or the size a pull would download (from the manifest: nothing is asked of the hub)."""
    on_disk = to_download = uncached = hub_roles = unsized = 0
    local_missing = False
    for role in ("target", "aux"):
        spec = m.data[role]
        if spec.get("hub"):
            ref, hub_roles = hub.from_spec(spec["hub"]), hub_roles + 1
            path = hub.cached(ref)
            on_disk += path.stat().st_size if path else 0
            uncached, to_download = uncached + (path is None), to_download + (0 if path else ref.size or 0)
            unsized += path is None and ref.size is None
        elif m.file(role).is_file():
            on_disk += m.file(role).stat().st_size
        else:
            local_missing = True
    if not hub_roles:
        return "local, not prepared" if local_missing else f"local, prepared, {hub.human_size(on_disk)}"
    if uncached:
        state = "remote" if uncached == hub_roles else "partly cached"
        if not to_download:
            return f"{state}, size unknown"
        return f"{state}, {hub.human_size(to_download)}{' + a file of unknown size' if unsized else ''} to download"
    return f"cached, {hub.human_size(on_disk)}"


@models.command("prepare")
@click.argument("names", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Prepare every named pair.")
@errors_as_click
def prepare_(names, all_):
    """Derive the files of NAMES (default: the default pair) into the cache. Idempotent; every
    file's sha256 is checked against the manifest's, a file whose content changed is derived
    again (the other commands check only its size and modification time), and a file the
    manifest pins that is not the one it names is an error."""
    for name in builtin_names() if all_ else (names or [DEFAULT_PAIR]):
        p = prepare(load_manifest(name), _say, verify=True)
        if p.unverified:
            click.echo(f"{name}: ready (sha256 not verified: {'; '.join(p.unverified)})")
        else:
            click.echo(f"{name}: ready (sha256 verified)")
        click.echo(f"  target: {p.target}\n  aux: {p.aux}")


@models.command("pull")
@click.argument("names", nargs=-1, required=True)
@errors_as_click
def pull(names):
    """Download NAMES without running them: known pairs, manifests, or hf:OWNER/REPO[/FILE.gguf|:QUANT]."""
    for name in names:
        if hub.is_ref(name):
            click.echo(f"{name}: {hub.fetch(name, _say, refresh=True)}")
            continue
        p = prepare(load_manifest(name), _say)
        click.echo(f"{name}: ready")
        click.echo(f"  target: {p.target}\n  aux: {p.aux}")


@models.command("path")
@click.argument("name", default=DEFAULT_PAIR)
@errors_as_click
def path(name):
    """Print `target: PATH` and `aux: PATH` for NAME, preparing it first if needed."""
    p = prepare(load_manifest(name), _say)
    click.echo(f"target: {p.target}")
    click.echo(f"aux: {p.aux}")
