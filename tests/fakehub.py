"""A loopback stand-in for the Hugging Face Hub, for tests that must not touch the network.

It serves files in the hub's URL layout to the real ``huggingface_hub`` client (pointed at it with HF_ENDPOINT):

- ``GET /api/models/OWNER/REPO[/revision/REV]``: the model-info API (``siblings`` with size and LFS sha256);
- ``HEAD|GET /OWNER/REPO/resolve/REV/PATH``: the file, with ``X-Repo-Commit``, ``ETag`` / ``X-Linked-Etag`` (the
  file's sha256, as the hub sends for LFS files), ``X-Linked-Size`` and byte ranges (206) for resumed downloads;
- errors the way the hub signals them, with ``X-Error-Code``: RepoNotFound (404), RevisionNotFound (404),
  EntryNotFound (404), GatedRepo (401 without a token, 403 with a token that has no access).

Test knobs: ``cut(repo, path, n1, n2, ...)`` breaks the next transfers of a file off after n1, n2, ... bytes
(the connection closes mid-body); ``add(..., etags={path: sha})`` makes the hub advertise a wrong hash; the
``log`` records every request (method, path, Range header, Authorization header).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional, Union
from urllib.parse import unquote, urlsplit

Source = Union[bytes, Path]


@dataclass
class Repo:
    files: dict[str, Source]
    commit: str
    gated: bool = False
    token: Optional[str] = None  # the token that has access to a gated repo
    etags: dict[str, str] = field(default_factory=dict)  # path -> advertised sha256 (default: the real one)
    _meta: dict[str, tuple[str, int]] = field(default_factory=dict)

    def meta(self, path: str) -> tuple[str, int]:
        """(sha256, size) of a file, computed once."""
        if path not in self._meta:
            src = self.files[path]
            h = hashlib.sha256()
            if isinstance(src, bytes):
                h.update(src)
                size = len(src)
            else:
                with open(src, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                size = src.stat().st_size
            self._meta[path] = (h.hexdigest(), size)
        return self._meta[path]

    def etag(self, path: str) -> str:
        return self.etags.get(path) or self.meta(path)[0]


class FakeHub:
    """``with FakeHub() as hub: hub.add("org/repo", {"m-Q4_K_M.gguf": Path(...)})``; ``hub.url`` is the endpoint."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, Optional[str], Optional[str]]] = []
        self.cuts: dict[tuple[str, str], list[int]] = {}  # (repo, path) -> bytes the next transfers stop after
        self._lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None

    def add(
        self,
        repo: str,
        files: dict[str, Source],
        *,
        gated: bool = False,
        token: Optional[str] = None,
        etags: Optional[dict[str, str]] = None,
        commit: Optional[str] = None,
    ) -> Repo:
        commit = commit or hashlib.sha1(repo.encode()).hexdigest()
        self.repos[repo] = Repo(dict(files), commit, gated, token, dict(etags or {}))
        return self.repos[repo]

    def cut(self, repo: str, path: str, *afters: int) -> None:
        self.cuts[(repo, path)] = list(afters)

    def gets(self, path_part: str = "/resolve/") -> list[tuple[str, Optional[str]]]:
        """(path, Range header) of the GET requests whose path contains ``path_part``."""
        return [(p, r) for m, p, r, _ in self.log if m == "GET" and path_part in p]

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def closed_port_url() -> str:
    """An endpoint where nothing listens: the network is down as far as the client can tell."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._handle(body=False)

    def do_GET(self) -> None:
        self._handle(body=True)

    # -- routing ---------------------------------------------------------------------------------
    def _handle(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.hub._lock:
            self.hub.log.append((self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
        if m := _INFO.match(path):
            return self._model_info(m["repo"], m["rev"] or "main", "blobs=" in self.path)
        if m := _RESOLVE.match(path):
            return self._resolve(m["repo"], m["rev"], m["path"], body)
        self._error(404, None, "Not Found")

    def _repo(self, name: str, rev: str) -> Optional[Repo]:
        repo = self.hub.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif rev not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, repo)
        else:
            return repo
        return None

    def _model_info(self, name: str, rev: str, blobs: bool) -> None:
        repo = self._repo(name, rev)
        if repo is None:
            return
        siblings = []
        for path in sorted(repo.files):
            s = {"rfilename": path}
            if blobs:
                sha, size = repo.etag(path), repo.meta(path)[1]
                s.update(
                    size=size,
                    blobId=hashlib.sha1(path.encode()).hexdigest(),
                    lfs={"sha256": sha, "size": size, "pointerSize": 134},
                )
            siblings.append(s)
        data = {
            "_id": repo.commit[:24],
            "id": name,
            "modelId": name,
            "author": name.split("/")[0],
            "sha": repo.commit,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["gguf"],
            "siblings": siblings,
        }
        self._send(200, {"Content-Type": "application/json"}, json.dumps(data).encode())

    def _resolve(self, name: str, rev: str, path: str, body: bool) -> None:
        repo = self._repo(name, rev)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
            has_token = self.headers.get("Authorization") is not None
            return self._error(
                403 if has_token else 401,
                "GatedRepo",
                f"Access to model {name} is restricted and you are not in the authorized list.",
                repo,
            )
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f'{path} does not exist on "{rev}"', repo)
        sha, size = repo.meta(path)
        start = 0
        if body and (m := re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")):
            start = int(m[1])
        etag = f'"{repo.etag(path)}"'
        headers = {
            "X-Repo-Commit": repo.commit,
            "ETag": etag,
            "X-Linked-Etag": etag,
            "X-Linked-Size": str(size),
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
        }
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        headers["Content-Length"] = str(size - start)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not body:
            return
        limit = size - start
        with self.hub._lock:
            cuts = self.hub.cuts.get((name, path))
            if cuts:
                limit = min(limit, cuts.pop(0))
        self._write_file(repo.files[path], start, limit)
        if limit < size - start:  # break the transfer off mid-body, as a dropped connection does
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _write_file(self, src: Source, start: int, length: int) -> None:
        if isinstance(src, bytes):
            self.wfile.write(src[start : start + length])
            return
        with open(src, "rb") as f:
            f.seek(start)
            while length > 0:
                block = f.read(min(length, 1 << 20))
                if not block:
                    break
                self.wfile.write(block)
                length -= len(block)

    # -- responses -------------------------------------------------------------------------------
    def _error(self, status: int, code: Optional[str], message: str, repo: Optional[Repo] = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if repo is not None:
            headers["X-Repo-Commit"] = repo.commit
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _send(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)
