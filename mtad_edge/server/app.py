"""An OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn).

Requests run one at a time (the engine's lock); up to ``queue_size`` more wait, the rest get a
429. A request's place is taken before its prompt is rendered and tokenized, which happens in its
worker thread (seconds for a large prompt), never on the event loop. Whatever ends a request
early stops its generation at the next decoding step, and a waiting one leaves the queue at once:
a client that goes away (streaming or not), or the server stopping (``app.state.runs.stop_all()``,
called by `mtad-edge serve` on SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response as HttpResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mtad_edge.engine import CANCELLED, Engine, Response
from mtad_edge.runtime.errors import MtadEdgeError, json_problem, quoted
from mtad_edge.server import page
from mtad_edge.server import protocol as P
from mtad_edge.server.limits import BODY_TIMEOUT_S, MAX_HEADER_BYTES
from mtad_edge.server.origins import BrowserGuard

# One line per request (RequestLog); `mtad-edge serve` prints it on stderr unless --quiet.
log = logging.getLogger("mtad_edge.server.requests")
# What load balancers and container runtimes poll (llama-server's paths): no key, no log line.
HEALTH_PATHS = ("/health", "/v1/health")


class Ticket:
    """A place in the queue, taken before its Response exists: building one renders the chat
    template and tokenizes the prompt (seconds for a large one), which runs in the worker after
    admission, never on the server's loop. A cancel that comes first (the client gone, the server
    stopping) cancels the response as soon as it is attached."""

    def __init__(self) -> None:
        self.cancelled = False
        self.response: Optional[Response] = None

    def attach(self, response: Response) -> None:
        self.response = response
        if self.cancelled:  # read after the store, as cancel reads after its own: one of the two sees the other
            response.cancel()

    def cancel(self) -> None:
        self.cancelled = True
        response = self.response
        if response is not None:
            response.cancel()


class Runs:
    """The generations the server holds: one running and up to ``queue_size`` waiting, each in a
    worker thread from its admission on. ``stop_all`` may be called from a signal handler: it only
    sets flags and events (set.add/discard and list(set) are atomic under the GIL, so no lock is
    needed)."""

    def __init__(self, queue_size: int):
        self.capacity = queue_size + 1
        self.active: set[Ticket] = set()
        self.closing = False
        self.pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="mtad-gen")

    def admit(self) -> Ticket:
        """A place for a new request, or BadRequest (503 stopping, 429 full)."""
        if self.closing:
            raise P.BadRequest("the server is shutting down", status=503, kind="server_error")
        if len(self.active) >= self.capacity:
            raise P.BadRequest(
                f"server busy: {self.capacity - 1} requests already waiting; retry later",
                status=429,
                kind="rate_limit_error",
            )
        ticket = Ticket()
        self.active.add(ticket)
        if self.closing:  # stop_all ran (a signal) between the check and the add
            ticket.cancel()
        return ticket

    def run(self, ticket: Ticket, work: Callable[[], Any]) -> Any:
        """``work`` (building and iterating the ticket's response) in this worker thread; the
        place is freed after it."""
        try:
            return work()
        finally:
            self.active.discard(ticket)

    def stop_all(self) -> None:
        """Refuse new requests and cancel every generation (each ends at its next step, one
        still being built as soon as it exists)."""
        self.closing = True
        for t in list(self.active):
            t.cancel()

    def close(self) -> None:
        self.stop_all()
        self.pool.shutdown(wait=True, cancel_futures=True)


class Guard:
    """API key, body size and framing, checked before a route runs, and the body's size and pace
    while it is read. A plain ASGI middleware (not BaseHTTPMiddleware), so routes see the
    connection's own ``receive`` (wrapped by BodyLimit) and notice a client that disconnects."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: Optional[str],
        max_body: int,
        read_timeout: float = 10.0,
        body_timeout: float = BODY_TIMEOUT_S,
    ):
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.read_timeout, self.body_timeout = read_timeout, body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            error = None
            auth = headers.get(b"authorization", b"")
            head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            head += sum(len(k) + len(v) + 4 for k, v in scope["headers"])
            if head > MAX_HEADER_BYTES:  # h11 bounds an incomplete head only: one that came whole is checked here
                error = P.BadRequest(f"request headers over {MAX_HEADER_BYTES} bytes", status=431)
            elif b"transfer-encoding" in headers and b"content-length" in headers:
                # h11 reads such a body as chunked, and a proxy in front may read its Content-Length:
                # whatever follows could be taken for another request (smuggling). RFC 9112 6.1: refuse, close.
                error = P.BadRequest(
                    "a request may not give both Transfer-Encoding and Content-Length (RFC 9112 6.1)", close=True
                )
            elif (
                self.api_key is not None
                and not page.public(scope["method"], scope["path"])  # the page asks for the key itself
                and scope["path"] not in HEALTH_PATHS
                and not hmac.compare_digest(auth, f"Bearer {self.api_key}".encode())
            ):
                error = P.BadRequest("invalid or missing API key", status=401, kind="authentication_error")
            elif int(headers.get(b"content-length", b"0") or 0) > self.max_body:
                error = P.BadRequest(f"request body over {self.max_body} bytes", status=413)
            if error is not None:
                await _error(error)(scope, receive, send)
                return
            receive = BodyLimit(receive, self.max_body, self.read_timeout, self.body_timeout)
        await self.app(scope, receive, send)


class RequestLog:
    """One log line per request once its response is sent (a stream: once it ended): who, what,
    the status and, for a generation, its method, tokens, speed and finish reason. The route
    leaves the generation in the request's state (``scope["state"]["generation"]``)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), [0]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            generation = (scope.get("state") or {}).get("generation")
            log.info(request_line(scope, status[0] or 500, time.monotonic() - start, generation))


def request_line(scope: Scope, status: int, seconds: float, generation: Optional[Response]) -> str:
    """``127.0.0.1 POST /v1/chat/completions 200 1.63 s: mtad, prompt 12 (8 cached), 64 tokens,
    41.2 tok/s, stop`` (the path as the client sent it, escaped: it is untrusted text)."""
    client = (scope.get("client") or ("-",))[0]
    line = f"{client} {scope.get('method', '-')} {quoted(scope.get('path', ''), bare=True)} {status} {seconds:.2f} s"
    if generation is None:
        return line
    st = generation.stats
    speed = f"{st.tokens_per_s:.1f} tok/s" if st.tokens_per_s is not None else "- tok/s"
    return (
        f"{line}: {st.method}, prompt {generation.prompt_tokens} ({st.cached_tokens} cached), "
        f"{len(generation.tokens)} tokens, {speed}, {generation.finish_reason or 'cancelled'}"
    )


class BodyLimit:
    """The connection's ``receive``, counting body bytes as they stream in: a body over
    ``max_body`` is cut there (413) whether or not it said its Content-Length (a chunked 1 GB body
    was read whole before the 413), and a body that sends nothing for ``timeout`` seconds, or is
    not whole ``total`` seconds after its head (a byte every few seconds held a connection for
    ever), is a 408. Once the body is complete, messages pass through untouched."""

    def __init__(self, receive: Receive, max_body: int, timeout: float, total: float):
        self.receive, self.max_body, self.timeout, self.total = receive, max_body, timeout, total
        self.deadline = time.monotonic() + total
        self.size, self.done = 0, False

    async def __call__(self) -> Any:
        if self.done:
            return await self.receive()
        left = self.deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(self.receive(), max(0.0, min(self.timeout, left)))
        except asyncio.TimeoutError:
            if left <= self.timeout:
                raise P.BadRequest(f"request body not received within {self.total:g} s", status=408) from None
            raise P.BadRequest(f"request body stalled: nothing for {self.timeout:g} s", status=408) from None
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.max_body:
                raise P.BadRequest(f"request body over {self.max_body} bytes", status=413)
            self.done = not message.get("more_body", False)
        else:
            self.done = True  # http.disconnect
        return message


class GenerationStream(StreamingResponse):
    """SSE events of one generation. However the response ends (finished, the client gone, the
    server stopping, even before its first byte), the generation is cancelled."""

    def __init__(self, events: AsyncIterator[str], ticket: Ticket):
        super().__init__(events, media_type="text/event-stream")
        self.generation = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()


def create_app(
    engine: Engine,
    model_name: str,
    api_key: Optional[str] = None,
    queue_size: int = 8,
    max_body: int = 1 << 20,
    read_timeout: float = 10.0,
    body_timeout: float = BODY_TIMEOUT_S,
    listen_host: Optional[str] = None,
    allow_hosts: Sequence[str] = (),
    cors_origins: Sequence[str] = (),
    strict_model: bool = False,
) -> FastAPI:
    """``read_timeout``: the longest a request's body may pause between two pieces;
    ``body_timeout``: the longest it may take in all, from the end of its head (408 after either).
    ``listen_host``, ``allow_hosts``, ``cors_origins``: what browsers may do (server/origins.py).
    Any ``model`` a request names is served by the one model, unless ``strict_model`` (then a name
    other than ``model_name`` is a 404, as from OpenAI)."""
    app = FastAPI(title="mtad-edge", docs_url=None, redoc_url=None, openapi_url=None)
    runs = Runs(queue_size)
    app.add_middleware(Guard, api_key=api_key, max_body=max_body, read_timeout=read_timeout, body_timeout=body_timeout)
    # a browser's request from another site never reaches the rest
    app.add_middleware(BrowserGuard, listen_host=listen_host, allow_hosts=allow_hosts, cors_origins=cors_origins)
    app.add_middleware(RequestLog)  # outermost: a request the guards refuse is logged too

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404 / 405 as OpenAI errors
        return _error(P.BadRequest(str(exc.detail), status=exc.status_code))

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "mtad-edge"}
    for path, (body, media) in page.load().items():  # the chat page (mtad_edge/server/page.py)
        app.add_api_route(path, page.route(body, media), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        return model_card if model == model_name or not strict_model else _error(P.model_not_found(model))

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Any:
        """llama-server's readiness check: 200 {"status": "ok"} once the model serves (it is
        loaded before the server listens), 503 while the server is stopping."""
        if runs.closing:
            return _error(P.BadRequest("the server is shutting down", status=503, kind="unavailable_error"))
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _serve(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str) -> Any:
        try:
            req = P.parse(await _json_body(request, max_body), kind, model_name if strict_model else None)
            ticket = runs.admit()
        except P.BadRequest as e:
            return _error(e)
        except ClientDisconnect:  # gone before its body arrived
            return HttpResponse(status_code=499)
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if req.stream:
            return await _stream(request, ticket, req, kind, rid)
        return await _complete(request, ticket, req, kind, rid)

    def _build(req: P.Parsed) -> Response:
        """The request's Response (renders the chat template, tokenizes the prompt: in a worker)."""
        extra = dict(stop=req.stop, logprobs=req.logprobs, **req.options, **(req.structured or {}))
        if req.messages is not None:
            return engine.chat(req.messages, **extra)
        return engine.generate(req.prompt or "", parse_special=req.parse_special, **extra)

    def _start(ticket: Ticket, req: P.Parsed, then: Callable[[Response], Any]) -> tuple[Future, asyncio.Future]:
        """In a worker: build the response, then ``then(response)``. ``built`` holds the response,
        or the error that refused the request (then nothing runs); the place is freed when the
        worker ends."""
        built: Future = Future()

        def job() -> Any:
            if not built.set_running_or_notify_cancel():  # the handler was cancelled before this began
                return None
            try:
                response = _build(req)
            except Exception as e:  # answered by the handler: a 400 naming the parameter, as before
                built.set_exception(e)
                return None
            ticket.attach(response)
            built.set_result(response)
            return then(response)

        return built, asyncio.get_running_loop().run_in_executor(runs.pool, runs.run, ticket, job)

    async def _stream(request: Request, ticket: Ticket, req: P.Parsed, kind: str, rid: str) -> Any:
        """Build the response in a worker, then run it there (its place is freed when the worker
        ends, even if the events are never sent). The stream's headers go out only once it is
        built, so a refused request is still a 4xx."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item: tuple[str, Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server has gone
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce(response: Response) -> None:
            if req.blocks:
                response.watch_blocks()
            try:
                for piece in response:
                    # with tools: the answer as content and tool calls, as far as they are known
                    said: Any = response.take_tool_deltas() if response.reads_calls else piece
                    put(("text", (said, response.take_blocks() if req.blocks else None)))
                if response.reads_calls and (rest := response.take_tool_deltas()):
                    put(("text", (rest, None)))
                put(("end", response.take_blocks() if req.blocks else None))
            except Exception as e:  # reported to the client as a final error event
                put(("error", str(e)))

        built, _ = _start(ticket, req, produce)
        ready = asyncio.wrap_future(built)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({ready, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ready.done():
                ticket.cancel()  # the client left while it was built, or this task was cancelled (shutdown)
                ready.cancel()  # what the build ends with is nobody's (nor logged as never retrieved)
            gone.cancel()
        if ready.cancelled():
            return HttpResponse(status_code=499)  # nobody reads it
        problem = ready.exception()
        if problem is not None:
            return _refused(problem)
        request.state.generation = ready.result()  # for the request's log line
        return GenerationStream(_events(queue, ready.result(), kind, rid, req.include_usage, req.blocks), ticket)

    async def _complete(request: Request, ticket: Ticket, req: P.Parsed, kind: str, rid: str) -> Any:
        """Build and run to the end, unless the client goes away first: then cancel (the worker
        stops at the next step, or leaves the queue) and answer no one."""
        built, work = _start(ticket, req, lambda response: response.text())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                ticket.cancel()  # the client left, or this task was cancelled (shutdown)
            left = gone.done()
            gone.cancel()
        try:
            text = await work
        except MtadEdgeError as e:
            return _error(P.BadRequest(str(e), status=500, kind="server_error"))
        if left:
            return HttpResponse(status_code=499)  # nobody reads it
        problem = built.exception()
        if problem is not None:
            return _refused(problem)
        response = built.result()
        request.state.generation = response  # for the request's log line
        if response.finish_reason == CANCELLED:
            return _error(P.BadRequest("the server is shutting down", status=503, kind="server_error"))
        logprobs = P.logprobs_object(kind, response.logprobs, text) if response.logprobs is not None else None
        return P.full(
            kind,
            rid,
            model_name,
            text,
            P.finish_reason(response.finish_reason),
            response.prompt_tokens,
            len(response.tokens),
            response.stats.to_dict(),
            logprobs,
            response.tool_calls,
        )

    async def _events(
        queue: asyncio.Queue, response: Response, kind: str, rid: str, include_usage: bool, blocks: bool
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def event(text: Any, reason: Optional[str], role: bool = False, records: Any = None) -> dict:
            calls = None
            if isinstance(text, list):  # a response that may make tool calls: its CallStream events
                text, calls = P.call_deltas(text)
            obj = P.chunk(kind, rid, model_name, created, text, reason, role=role, calls=calls)
            if include_usage:  # OpenAI: a null usage on every chunk but the last
                obj["usage"] = None
            if blocks:  # asked for: how the chunk's tokens came (BlockMeter.record)
                obj["mtad_blocks"] = records or []
            return obj

        if kind == "chat":
            yield _sse(event(None, None, role=True))
        while True:
            what, value = await queue.get()
            if what == "text":
                text, records = value
                if text or records or not response.reads_calls:
                    yield _sse(event(text, None, records=records))
                continue
            if what == "error":
                yield _sse(P.BadRequest(value, kind="server_error").body())
            elif response.finish_reason == CANCELLED:  # the server is stopping
                yield _sse(P.BadRequest("the server is shutting down", kind="server_error").body())
            else:
                usage, stats = P.usage(response.prompt_tokens, len(response.tokens)), response.stats.to_dict()
                last = event(None, P.finish_reason(response.finish_reason), records=value)
                if include_usage:
                    yield _sse(last)
                    yield _sse(P.usage_chunk(kind, rid, model_name, created, usage, stats))
                else:  # usage: not OpenAI's here, kept for the clients that read it there
                    yield _sse({**last, "usage": usage, "mtad_stats": stats})
            break
        yield "data: [DONE]\n\n"

    app.state.runs = runs
    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (uvicorn answers ``receive`` with http.disconnect
    once the body has been read and the connection is gone)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the connection broke in some other way: gone too
        pass


async def _json_body(request: Request, max_body: int) -> dict:
    raw = await request.body()
    if len(raw) > max_body:
        raise P.BadRequest(f"request body over {max_body} bytes", status=413)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's bound, ...
        raise P.BadRequest(f"invalid JSON body: {json_problem(e)}") from None
    if not isinstance(body, dict):
        raise P.BadRequest("the JSON body must be an object")
    return body


def _refused(e: BaseException) -> JSONResponse:
    """What building a response raised: a bad option or a prompt too long is a 400 naming the
    parameter; anything else is a bug, raised for the server's 500."""
    if isinstance(e, (ValueError, MtadEdgeError)):
        return _error(P.BadRequest(str(e), getattr(e, "param", None)))
    raise e


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(e: P.BadRequest) -> JSONResponse:
    # A body cut short (413) or stalled (408) leaves the rest unread: the connection is closed after.
    close = {"connection": "close"} if e.status in (408, 413) or e.close else None
    return JSONResponse(e.body(), status_code=e.status, headers=close)
