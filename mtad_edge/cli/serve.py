"""`mtad-edge serve`: an OpenAI-compatible local HTTP server on the pair."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import sys
from types import FrameType
from typing import Any, Optional

import click

from mtad_edge.cli.options import (
    FiniteRange,
    ModelChoice,
    decode_config,
    decode_options,
    errors_as_click,
    given,
    missing_extra,
    model_options,
    recommended_note,
)
from mtad_edge.runtime.backends import rpc
from mtad_edge.runtime.errors import MtadEdgeError
from mtad_edge.server.limits import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_HEADER_BYTES,
)
from mtad_edge.signals import interrupts

TIMEOUT_MAX_S = 86400.0  # a day: past any client's patience (and asyncio's timers take any finite value)


def _log_requests(log: logging.Logger, quiet: bool) -> None:
    """The server's one line per request on stderr, as it happens (--quiet: none)."""
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    if not quiet and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False


def check_api_key(key: Optional[str]) -> None:
    """A key that no request can match is refused at start (every request was a 401): an empty one
    ('Bearer ' loses its space in the HTTP parser), one that starts or ends with whitespace (HTTP
    strips it from a header), one with characters a header cannot carry. The key is never shown."""
    if key is None:
        return
    where = "--api-key (or MTAD_EDGE_API_KEY)"
    if not key:
        raise MtadEdgeError(f"{where} is empty: no request could match it; give a key, or leave the option out")
    if key != key.strip():
        raise MtadEdgeError(f"{where} starts or ends with a space or other whitespace, which HTTP drops from a header")
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        raise MtadEdgeError(
            f"{where} has a character an HTTP header cannot carry (character {bad + 1}): use printable ASCII"
        )


@click.command()
@model_options
@decode_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--api-key", envvar="MTAD_EDGE_API_KEY", help="Require 'Authorization: Bearer KEY' (env MTAD_EDGE_API_KEY)."
)
@click.option(
    "--queue-size",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Requests that may wait while one runs; more get 429.",
)
@click.option(
    "--max-body",
    type=click.IntRange(min=1024),
    default=1 << 20,
    show_default=True,
    help="Largest request body in bytes (413 above).",
)
@click.option(
    "--header-timeout",
    type=FiniteRange(min=0.1, max=TIMEOUT_MAX_S),
    default=HEADER_TIMEOUT_S,
    show_default=True,
    help="Seconds a client has to send a request's headers, and at most between two pieces of its body (408).",
)
@click.option(
    "--body-timeout",
    type=FiniteRange(min=0.1, max=TIMEOUT_MAX_S),
    default=BODY_TIMEOUT_S,
    show_default=True,
    help="Seconds a client has to send a request's whole body, once its headers are in (408).",
)
@click.option(
    "--idle-timeout",
    type=click.IntRange(min=1),
    default=IDLE_TIMEOUT_S,
    show_default=True,
    help="Seconds a keep-alive connection may stay idle between requests before it is closed.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=MAX_CONNECTIONS,
    show_default=True,
    help="Open connections at most; a new one closes the one that has waited longest for its request "
    "to arrive (503), or is answered 503 when every other one has a request in progress.",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests whose Host is NAME (repeatable; * for any): the name a reverse proxy or the "
    "network uses for this machine. IP addresses, localhost and --host are answered anyway; any other Host is "
    "refused (403), so a web page cannot reach the server through DNS rebinding.",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="Let web pages of ORIGIN (SCHEME://HOST[:PORT]; repeatable; * for any) call the API from a browser "
    "(CORS). Without it a request from another site's page is refused (403).",
)
@click.option("--model-name", help="The model id clients see (default: the pair's name).")
@click.option(
    "--strict-model",
    is_flag=True,
    help="Answer 404 to a request for another model name (default: any name gets this model).",
)
@click.option("--quiet", is_flag=True, help="No log line per request on stderr.")
@errors_as_click
def serve(
    model: ModelChoice,
    host: str,
    port: int,
    api_key: Optional[str],
    queue_size: int,
    max_body: int,
    header_timeout: float,
    body_timeout: float,
    idle_timeout: int,
    max_connections: int,
    allow_hosts: tuple[str, ...],
    cors_origins: tuple[str, ...],
    model_name: Optional[str],
    strict_model: bool,
    quiet: bool,
    **decode: Any,
) -> None:
    """Serve /v1/chat/completions, /v1/completions, /v1/models and /health (OpenAI-compatible)."""
    import asyncio

    check_api_key(api_key)

    try:
        import uvicorn

        from mtad_edge.server import connections
        from mtad_edge.server.app import create_app, log
        from mtad_edge.server.origins import check_allowed_host, check_origin
    except ImportError as e:
        raise missing_extra("the server", "serve", e) from None

    for name in allow_hosts:  # one line at start, before the load
        check_allowed_host(name)
    for origin in cors_origins:
        check_origin(origin)
    connections.ensure_descriptors(max_connections)
    cfg = decode_config(**decode)
    with contextlib.ExitStack() as stack:  # the engine closes first, then the socket
        sock = stack.enter_context(connections.listening_socket(host, port))
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        # The address bound, not --host: a name may resolve to loopback, and 0.0.0.0 / :: are every interface.
        if api_key is None and not ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback:
            click.echo(
                f"warning: serving on {host} without --api-key: anyone who can reach port {port} can use the model "
                "(give --api-key KEY, or set MTAD_EDGE_API_KEY)",
                err=True,
            )
        interrupts.hold()  # a signal during the load ends the command once it is loaded
        engine = stack.enter_context(model.engine(cfg, given=given(decode)))
        if interrupts.code:
            return
        model_name = model_name or model.label
        app = create_app(
            engine,
            model_name,
            api_key=api_key,
            queue_size=queue_size,
            max_body=max_body,
            read_timeout=header_timeout,
            body_timeout=body_timeout,
            listen_host=host,
            allow_hosts=allow_hosts,
            cors_origins=cors_origins,
            strict_model=strict_model,
        )
        _log_requests(log, quiet)
        runs = app.state.runs
        refusals = connections.Refusals()

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
                """SIGINT/SIGTERM: cancel every generation first (each ends at its next step),
                so uvicorn's graceful shutdown has only short requests left to wait for; a call
                an rpc server does not answer is cut short after its grace (runtime/backends/rpc.py)."""
                runs.stop_all()
                rpc.interrupt_all(sig)
                super().handle_exit(sig, frame)

            async def startup(self, sockets: Any = None) -> None:
                connections.quiet_accept_errors(asyncio.get_running_loop(), refusals)
                await super().startup(sockets)
                if interrupts.code:  # a signal between the load and uvicorn's own handlers: stop now
                    runs.stop_all()
                    self.should_exit = True

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=10,
            http=connections.limited_protocol(header_timeout, max_connections, refusals),
            timeout_keep_alive=idle_timeout,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        click.echo(
            f"mtad-edge serving {model_name} on http://{host}:{port}/v1 (method {cfg.method}"
            f"{recommended_note(engine.recommended)}); chat page: http://{host}:{port}/",
            err=True,
        )
        Server(config).run(sockets=[sock])  # uvicorn handles the signals while it runs, then hands them on to ours
        runs.close()
    interrupts.hard_exit = True  # models freed: see signals.Interrupts.finish
