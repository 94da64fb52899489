"""Browsers cannot drive the server from another site: its Host, the request's Origin and a JSON
body's Content-Type are checked before anything else, and CORS is for the origins a user names.

A page of any site can make its visitor's browser send requests to http://127.0.0.1:8000. A POST
with ``Content-Type: text/plain`` (or a form's) is a "simple" request, sent without asking the
server first (no CORS preflight): the generation ran on the visitor's machine (CSRF). And through
DNS rebinding (attacker.example made to resolve to 127.0.0.1) the page is same-origin with the
server as far as the browser knows, so it reads the replies, unless the server refuses a Host that
is not its own. So:

- **Host** must be an IP address (rebinding needs a name the attacker controls), ``localhost`` or
  a ``*.localhost`` name, the name the server was told to listen on (``--host``), or a name the
  user allows (``--allow-host NAME``, repeatable; ``*``: any): else 403. Ports are not compared:
  a name the attacker cannot point here is safe on any port (a port forward, a proxy);
- **Origin**, which browsers send with every cross-origin request (and with same-origin POSTs),
  must be the server's own (the Host of the request, whichever the scheme: a proxy in front may
  serve it over https), or one the user allows
  (``--cors-origin ORIGIN``, repeatable; ``*``: any, as llama-server answers): else 403. An allowed
  origin gets CORS headers and its preflights answered (Starlette's CORSMiddleware);
- **Content-Type** of a POST must be ``application/json``: text/plain and the form types are what
  a page can send without a preflight (415).

A page the server serves itself (its chat page at ``/``) is same-origin and passes all three.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence
from typing import Optional
from urllib.parse import urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from mtad_edge.runtime.errors import MtadEdgeError, quoted

ANY = "*"
DEFAULT_PORTS = {"http": 80, "https": 443}
CORS_HEADERS = ("Authorization", "Content-Type")


def host_name(value: str) -> str:
    """The name (or address) part of a Host header, lower case, without port or brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1 : value.find("]")] if "]" in value else value
    name, _, port = value.rpartition(":")
    return (name if name and port.isdigit() else value).rstrip(".")


def check_allowed_host(name: str) -> str:
    """A --allow-host NAME: a host name or address (no scheme, port or path), or ``*``."""
    bare = name.strip().lower().rstrip(".")
    if bare != ANY and (not bare or any(c in bare for c in "/:@ \t") or not bare.isprintable()):
        raise MtadEdgeError(f"--allow-host {quoted(name)} is not a host name (give a name such as my-box.lan, or *)")
    return bare


def check_origin(origin: str) -> str:
    """A --cors-origin ORIGIN: scheme://host[:port] (no path), or ``*``; normalised as a browser
    sends it (lower case, no default port, no trailing slash)."""
    if origin.strip() == ANY:
        return ANY
    normal = _origin(origin.strip().rstrip("/"))
    if normal is None:
        raise MtadEdgeError(
            f"--cors-origin {quoted(origin)} is not an origin: give SCHEME://HOST[:PORT] such as "
            "http://localhost:3000, or *"
        )
    return normal


def _origin(value: str) -> Optional[str]:
    """``value`` as scheme://host[:port] in the form a browser sends it, or None."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query or parts.fragment:
        return None
    if parts.username is not None or parts.password is not None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    keep = port is not None and port != DEFAULT_PORTS[parts.scheme]
    return f"{parts.scheme}://{host}{f':{port}' if keep else ''}"


class BrowserGuard:
    """The three checks of the module's docstring, as a plain ASGI middleware in front of all
    else; ``listen_host``: the --host the server listens on (a name there is its own)."""

    def __init__(
        self,
        app: ASGIApp,
        listen_host: Optional[str] = None,
        allow_hosts: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
    ):
        self.app = app
        self.names = {check_allowed_host(h) for h in allow_hosts}
        if listen_host and not _is_address(host_name(listen_host)):
            self.names.add(host_name(listen_host))
        self.origins = {check_origin(o) for o in cors_origins}
        if self.origins:  # headers and preflights for the allowed origins
            self.app = CORSMiddleware(
                app,
                allow_origins=sorted(self.origins),
                allow_methods=("GET", "POST"),
                allow_headers=CORS_HEADERS,
                allow_private_network=True,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = self.problem(scope)
            if problem is not None:
                await _refuse(send, *problem)
                return
        await self.app(scope, receive, send)

    def problem(self, scope: Scope) -> Optional[tuple[int, str, str]]:
        """(status, message, param) for a request a browser must not make here, else None."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        name = host_name(host)
        if host and not (_is_address(name) or _local(name) or name in self.names or ANY in self.names):
            return (
                403,
                f"Host {quoted(host)} is not a name this server answers to (DNS rebinding protection): "
                f"start it with --allow-host {quoted(name, bare=True)} to serve it",
                "Host",
            )
        origin = headers.get(b"origin")
        if origin is not None:
            sent = origin.decode("latin-1")
            normal = _origin(sent.strip())
            scheme = normal.split(":", 1)[0] if normal else "http"
            own = _origin(f"{scheme}://{host}") if host else None
            allowed = ANY in self.origins or (normal is not None and normal in self.origins)
            if normal is None or (normal != own and not allowed):
                return (
                    403,
                    f"a cross-origin request from {quoted(sent)} is refused: start the server with "
                    f"--cors-origin {quoted(normal or sent, bare=True)} to let pages of that origin use it",
                    "Origin",
                )
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if kind != "application/json":
                shown = quoted(kind, bare=True) if kind else "none"
                return 415, f"Content-Type must be application/json (got {shown})", "Content-Type"
        return None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _local(name: str) -> bool:
    """localhost and its subdomains, which browsers resolve to loopback themselves (RFC 6761)."""
    return name == "localhost" or name.endswith(".localhost")


async def _refuse(send: Send, status: int, message: str, param: str) -> None:
    kind = "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head.append((b"connection", b"close"))  # its body, if any, is left unread
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
