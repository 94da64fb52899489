"""The chat page `mtad-edge serve` answers ``GET /`` with: static files shipped in the package
(mtad_edge/server/static/), read once when the app is built. No API key is needed to fetch them
(they hold no secret; the page asks for the key where /v1 answers 401), and a strict
Content-Security-Policy keeps the page to its own scripts and its own origin."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from starlette.responses import Response

# URL path -> (file in static/, media type). Only these paths are public.
FILES = {
    "/": ("index.html", "text/html"),
    "/static/chat.js": ("chat.js", "text/javascript"),
    "/static/chat.css": ("chat.css", "text/css"),
}
# Defence in depth: the page builds model text as DOM text nodes, never HTML; were one to slip
# through, no inline script or handler runs, and nothing loads or posts beyond this server.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new version of the package is picked up at the next load
}


def public(method: str, path: str) -> bool:
    """Whether a request is for one of the page's files (served without the API key)."""
    return method in ("GET", "HEAD") and path in FILES


def load() -> dict[str, tuple[bytes, str]]:
    """Each public path's body and media type, read from the package's files."""
    folder = resources.files("mtad_edge.server") / "static"
    return {path: ((folder / name).read_bytes(), media) for path, (name, media) in FILES.items()}


def route(body: bytes, media: str) -> Callable[[], Awaitable[Response]]:
    """The endpoint that answers with one file (Starlette adds "; charset=utf-8" to text/ types)."""

    async def serve() -> Response:
        return Response(body, media_type=media, headers=HEADERS)

    return serve
