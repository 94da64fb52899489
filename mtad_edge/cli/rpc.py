"""`mtad-edge rpc build|server`: llama.cpp's RPC backend and its ggml-rpc-server, for --rpc."""

from __future__ import annotations

import ipaddress
import os
import signal
from pathlib import Path
from typing import Optional

import click

import mtad_edge.rpc_build as rpc_build
from mtad_edge.cli.options import errors_as_click


def _say(message: str) -> None:
    click.echo(message, err=True)


@click.group()
def rpc():
    """The target on other machines: build llama.cpp's RPC backend, run a ggml-rpc-server."""


@rpc.command()
@click.option(
    "--source",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="A llama-cpp-python sdist folder or a llama.cpp tree of the installed version (default: its sdist, "
    "fetched with pip once).",
)
@click.option("--force", is_flag=True, help="Build again even where it is built.")
@errors_as_click
def build(source: Optional[Path], force: bool) -> None:
    """Build the RPC backend and ggml-rpc-server for the installed llama.cpp (about a minute) into the
    cache; prints their folder."""
    click.echo(rpc_build.build(source, _say, force))


@rpc.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads (default: the server's, half the cores).")
@click.option("--cache", is_flag=True, help="Keep received weights on this disk (ggml-rpc-server -c).")
@errors_as_click
def server(host: str, port: int, threads: Optional[int], cache: bool) -> None:
    """Run ggml-rpc-server (built by `mtad-edge rpc build`) on HOST:PORT. It has no authentication:
    whoever reaches the port can run graphs on it and read what it holds."""
    cmd = rpc_build.server_command(host, port, threads, cache)
    if not _loopback(host):
        _say(
            f"mtad-edge: ggml-rpc-server on {host}:{port} has no authentication: anyone who reaches it can use "
            "this machine and read what it holds; only on a network you trust"
        )
    # ggml-rpc-server sends without MSG_NOSIGNAL: a client gone before its reply (one that timed out,
    # one killed) would end it by SIGPIPE. An ignored signal stays ignored across exec.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.execv(cmd[0], cmd)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
