"""`mtad-edge rpc build|server`: llama.cpp's RPC backend and its ggml-rpc-server, for --rpc."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
from pathlib import Path
from typing import Optional

import click

import mtad_edge.rpc_build as rpc_build
from mtad_edge.cli.options import errors_as_click
from mtad_edge.runtime.errors import RpcError


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
    address = listen_address(host, port)
    cmd = rpc_build.server_command(address, port, threads, cache)
    if not _loopback(address):
        _say(
            f"mtad-edge: ggml-rpc-server on {host}:{port} has no authentication: anyone who reaches it can use "
            "this machine and read what it holds; only on a network you trust"
        )
    # ggml-rpc-server sends without MSG_NOSIGNAL: a client gone before its reply (one that timed out,
    # one killed) would end it by SIGPIPE. An ignored signal stays ignored across exec.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.execv(cmd[0], cmd)


def listen_address(host: str, port: int) -> str:
    """The IPv4 address ggml-rpc-server will listen on for ``host`` (it takes dotted IPv4 alone, and
    ends with status 0 where it cannot listen), bound here first: an empty, IPv6 or unknown host, a
    port in use or an address of another machine is a one-line error."""
    if not host.strip():
        raise RpcError("--host is empty: give the address to listen on (127.0.0.1: this machine alone)")
    try:
        version: int = ipaddress.ip_address(host).version
    except ValueError:
        version = 0
    if version == 6:
        raise RpcError(f"--host {host}: ggml-rpc-server listens on IPv4 addresses only (127.0.0.1: this machine alone)")
    try:
        address = str(socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError) as e:
        raise RpcError(f"--host {host}: not an IPv4 address or a name of one ({getattr(e, 'strerror', e)})") from None
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ggml-rpc-server binds
        probe.bind((address, port))
    except OSError as e:
        raise RpcError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    finally:
        probe.close()
    return address


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
