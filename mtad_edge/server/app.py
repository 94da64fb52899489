"""An OpenAI-compatible HTTP server over one Engine (FastAPI + uvicorn).

Requests run one at a time (the engine's lock); up to ``queue_size`` more wait, the rest get a
429. A streaming client that disconnects cancels its generation at the next block.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mtad_edge.engine import Engine, Response
from mtad_edge.runtime.errors import MtadEdgeError
from mtad_edge.server import protocol as P


def create_app(
    engine: Engine, model_name: str, api_key: str | None = None, queue_size: int = 8, max_body: int = 1 << 20
) -> FastAPI:
    app = FastAPI(title="mtad-edge", docs_url=None, redoc_url=None)
    pool = ThreadPoolExecutor(max_workers=queue_size + 1, thread_name_prefix="mtad-gen")
    slots = threading.BoundedSemaphore(queue_size + 1)  # one running + queue_size waiting

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None:
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {api_key}".encode()):
                return _error(P.BadRequest("invalid or missing API key", status=401, kind="authentication_error"))
        if int(request.headers.get("content-length") or 0) > max_body:
            return _error(P.BadRequest(f"request body over {max_body} bytes", status=413))
        return await call_next(request)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "mtad-edge"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str):
        try:
            body = await _json_body(request, max_body)
            opts, stop = P.generation_options(body), P.stop_strings(body)
            if kind == "chat":
                response = engine.chat(P.chat_messages(body), stop=stop, **opts)
            else:
                response = engine.generate(P.completion_prompt(body), stop=stop, **opts)
            n_prompt = response.prompt_tokens
        except P.BadRequest as e:
            return _error(e)
        except (ValueError, MtadEdgeError) as e:
            return _error(P.BadRequest(str(e), getattr(e, "param", None)))
        if not slots.acquire(blocking=False):
            return _error(
                P.BadRequest(
                    f"server busy: {queue_size} requests already waiting; retry later",
                    status=429,
                    kind="rate_limit_error",
                )
            )
        rid = P.new_id("chatcmpl" if kind == "chat" else "cmpl")
        if body.get("stream"):
            return StreamingResponse(_stream(response, kind, rid, n_prompt), media_type="text/event-stream")
        try:
            text = await asyncio.get_running_loop().run_in_executor(pool, response.text)
        except MtadEdgeError as e:
            return _error(P.BadRequest(str(e)))
        finally:
            slots.release()
        stats = response.stats.to_dict() if response.stats else {}
        return P.full(
            kind, rid, model_name, text, P.finish_reason(response.finish_reason), n_prompt, len(response.tokens), stats
        )

    async def _stream(response: Response, kind: str, rid: str, n_prompt: int) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        created = int(time.time())

        def produce():
            try:
                for piece in response:
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", piece))
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as e:  # reported to the client as a final error event
                loop.call_soon_threadsafe(queue.put_nowait, ("error", str(e)))
            finally:
                slots.release()

        pool.submit(produce)
        try:
            if kind == "chat":
                yield _sse(P.chunk(kind, rid, model_name, created, None, None, role=True))
            while True:
                what, value = await queue.get()
                if what == "text":
                    yield _sse(P.chunk(kind, rid, model_name, created, value, None))
                elif what == "error":
                    yield _sse(P.BadRequest(value, kind="server_error").body())
                    break
                else:
                    last = P.chunk(kind, rid, model_name, created, None, P.finish_reason(response.finish_reason))
                    last["usage"] = P.usage(n_prompt, len(response.tokens))
                    yield _sse(last)
                    break
            yield "data: [DONE]\n\n"
        finally:
            response.cancel()  # a client that went away stops the generation at the next block

    app.state.pool = pool
    return app


async def _json_body(request: Request, max_body: int) -> dict:
    raw = await request.body()
    if len(raw) > max_body:
        raise P.BadRequest(f"request body over {max_body} bytes", status=413)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.BadRequest(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise P.BadRequest("the JSON body must be an object")
    return body


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _error(e: P.BadRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)
