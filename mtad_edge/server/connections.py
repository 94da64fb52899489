"""The connection limits uvicorn lacks: a deadline for each request's head and a cap on open
connections, with refusals logged in one line.

uvicorn closes a keep-alive connection that sends nothing (``timeout_keep_alive``) but waits
forever for the rest of a half-sent request head, and accepts every connection: 1,100 idle
half-sent requests exhausted the file descriptors, a normal request timed out, and asyncio logged
a traceback per refused accept (50 MB of log). Here a connection has ``header_timeout`` seconds to
send each request's head (then a 408, or a plain close when it sent nothing; the body has its own
deadline, app.BodyLimit), and a connection over ``max_connections`` closes the one that has waited
longest for its request to arrive whole (a 503): slow senders, which a few clients can keep open
for the whole of their deadlines, cannot lock out everyone else. Only when every other connection
has a whole request in progress is the new one answered 503 and closed at once.

Not a cap per client address: every local client, and every client behind a reverse proxy, comes
from the same address.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

FD_RESERVE = 64  # descriptors beside the connections: model files, logs, the listening socket, ...
LOG_EVERY_S = 10.0  # refused connections are summed into one log line at most this often

log = logging.getLogger("uvicorn.error")


class Refusals:
    """Counts refused (or closed) connections; logs one line for the first and then one per LOG_EVERY_S."""

    def __init__(self, done: str = "refused") -> None:
        self.done, self.count, self.last = done, 0, -LOG_EVERY_S

    def note(self, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            log.warning("%s %d connection(s): %s", self.done, self.count, why)
            self.count, self.last = 0, now


def _response(status: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response with an OpenAI-style body, written before closing."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": None}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n"
    )
    return head.encode() + (b"retry-after: 1\r\n" if status.startswith("503") else b"") + b"\r\n" + body


def limited_protocol(header_timeout: float, max_connections: int, refusals: Optional[Refusals] = None) -> type:
    """uvicorn's h11 protocol with a head deadline and a connection cap (pass it as Config(http=...))."""
    refused = refusals or Refusals()
    evicted = Refusals("closed")
    busy = _response(
        "503 Service Unavailable", f"server busy: {max_connections} connections open (--max-connections); retry later"
    )
    made_room = _response(
        "503 Service Unavailable",
        f"server busy: {max_connections} connections open (--max-connections), and this one had waited longest "
        "for its request to arrive; retry later",
    )
    slow = _response("408 Request Timeout", f"request head not received within {header_timeout:g} s")

    class LimitedH11Protocol(H11Protocol):
        _timer: Optional[asyncio.TimerHandle] = None
        _armed_cycle: Any = None
        _partial = False  # bytes arrived since the deadline was set
        _since = 0.0  # when this connection began to wait for its current request

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._make_room():  # this one counted
                refused.note(f"{max_connections} open (--max-connections)")
                transport.write(busy)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._partial = True
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head has its own deadline

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            if self.transport.is_closing():
                return
            self._armed_cycle, self._partial, self._since = self.cycle, False, self.loop.time()
            self._timer = self.loop.call_later(header_timeout, self._deadline)

        def _deadline(self) -> None:
            """No new request head since the deadline was set, and none running: close (a 408
            when part of a head came)."""
            running = self.cycle is not None and not self.cycle.response_complete
            if self.transport.is_closing() or running or self.cycle is not self._armed_cycle:
                return
            if self._partial:
                self.transport.write(slow)
            self.transport.close()

        def _waiting(self) -> bool:
            """Still waiting for a request to arrive whole: its head, its body, or the next one."""
            return self.cycle is None or self.cycle.response_complete or self.cycle.more_body

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for its request (a 503), if one is
            still waiting: connections closing already count as gone. False when every other one
            has a whole request in progress (queued, running or answering)."""
            others = [c for c in self.connections if c is not self and not c.transport.is_closing()]
            if len(others) < max_connections:
                return True
            waiting = [c for c in others if isinstance(c, LimitedH11Protocol) and c._waiting()]
            if not waiting:
                return False
            oldest = min(waiting, key=lambda c: c._since)
            evicted.note(f"waited longest for a request, to make room for a new one ({max_connections} open)")
            oldest.transport.write(made_room)
            oldest.transport.close()
            return True

    return LimitedH11Protocol


def ensure_descriptors(max_connections: int) -> None:
    """Raise the soft open-files limit to what ``max_connections`` needs (up to the hard limit),
    so the cap, not the process's descriptors, is what refuses a connection."""
    try:
        import resource
    except ImportError:  # Windows: no such limit to raise
        return
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        from mtad_edge.runtime.errors import MtadEdgeError

        raise MtadEdgeError(
            f"--max-connections {max_connections} needs {need} open files, and this process may open {soft} "
            f"(ulimit -n): give --max-connections {max(1, soft - FD_RESERVE)} or less"
        )


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the models load (as uvicorn binds it: IPv6 where the host
    has a colon, SO_REUSEADDR), so a port in use or a bad host is a one-line error at once, not
    after a load of seconds or minutes."""
    from mtad_edge.runtime.errors import MtadEdgeError

    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MtadEdgeError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, refusals: Refusals) -> None:
    """Out of descriptors anyway (other files): asyncio's traceback per refused accept becomes
    the same rate-limited line as a refused connection."""
    default = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            refusals.note(f"out of file descriptors ({context.get('exception')})")
        elif default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
