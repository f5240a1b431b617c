"""The HTTP side: Starlette routes over a `SessionPool`.

Every endpoint runs inside `_guarded`, which turns any exception into an OpenAI-shaped JSON error
(APIError with its status, anything else a 500 with one log line) and counts the request, so no
request can take the server down or show a traceback. Streaming answers are server-sent events in
OpenAI's chunk shapes ending with `data: [DONE]`; the last chunk carries `usage` and `timings`.
Tool calls stream as OpenAI's `delta.tool_calls` (per call: its id and name, then its arguments),
after the reply's plain content and before the last chunk.

A client that disconnects: while streaming, Starlette cancels the response's body iterator, whose
`finally` cancels the job; while waiting for a non-streaming answer, the handler polls
`request.is_disconnected()`. Either way the worker stops at the next token.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..models.base import Model
from .errors import APIError, bad_request, internal
from .metrics import Metrics
from .pool import Job, SessionPool
from .schemas import (GenRequest, GenResult, ModelCard, chunk_body, completion_body, model_list, new_id, now,
                      parse_chat, parse_completion, tool_call_chunks)

DISCONNECT_POLL_S = 0.25


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def _wait(job: Job, request: Request) -> GenResult:
    """The final event of a non-streaming job; cancels it if the client disconnects first."""
    while True:
        try:
            kind, payload = await asyncio.wait_for(job.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise APIError(499, "client closed the request", code="client_closed") from None
            continue
        if kind == "done":
            return payload
        if kind == "error":
            raise payload


async def _stream(job: Job, rid: str, created: int, tokenizer) -> AsyncIterator[str]:
    req = job.request
    try:
        if req.kind == "chat":
            yield _sse(chunk_body(req, rid, created, first=True))
        while True:
            kind, payload = await job.get()
            if kind == "text":
                text, entries = payload
                yield _sse(chunk_body(req, rid, created, text=text, entries=entries, tokenizer=tokenizer))
            elif kind == "tool_calls":
                for body in tool_call_chunks(req, rid, created, payload):
                    yield _sse(body)
            elif kind == "done":
                yield _sse(chunk_body(req, rid, created, result=payload))
                break
            else:
                yield _sse(payload.body())
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()       # no-op after "done"; stops the worker when the client went away


def create_app(model: Model, pool: SessionPool, card: ModelCard, metrics: Metrics) -> Starlette:
    """The ASGI app. Starting it (its lifespan) starts the pool's workers; stopping it stops them."""

    def _guarded(endpoint: str, handler: Callable[[Request], Awaitable[Response]]):
        async def run(request: Request) -> Response:
            try:
                response = await handler(request)
            except APIError as e:
                response = _error_response(e)
            except Exception as e:      # noqa: BLE001 - the server stays up, the client gets JSON
                print(f"hybridrt serve: {endpoint}: {type(e).__name__}: {e}", file=sys.stderr)
                response = _error_response(internal(e))
            metrics.request(endpoint, response.status_code)
            return response
        return run

    def generation(parse: Callable[[dict, Model, ModelCard], GenRequest]):
        async def handler(request: Request) -> Response:
            req = parse(await _json_body(request), model, card)
            job = Job(req, asyncio.get_running_loop())
            pool.submit(job)
            rid, created = new_id(req.kind), now()
            if req.stream:
                return StreamingResponse(_stream(job, rid, created, model.tokenizer), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            return JSONResponse(completion_body(req, rid, created, await _wait(job, request), model.tokenizer))
        return handler

    async def models(request: Request) -> Response:
        return JSONResponse(model_list(card))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "sessions": len(pool.sessions), "sessions_in_use": pool.in_use,
                             "requests_waiting": pool.waiting})

    async def prometheus(request: Request) -> Response:
        b = pool.batcher
        return PlainTextResponse(metrics.render(pool.in_use, pool.waiting, (b.evals, b.steps, b.rows) if b else None),
                                 media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # unknown paths and wrong methods answer in the same JSON shape as everything else
        return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code="not_found" if exc.status_code == 404 else None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        pool.start()
        try:
            yield
        finally:
            pool.stop()

    routes = [
        Route("/v1/chat/completions", _guarded("/v1/chat/completions", generation(parse_chat)), methods=["POST"]),
        Route("/v1/completions", _guarded("/v1/completions", generation(parse_completion)), methods=["POST"]),
        Route("/v1/models", _guarded("/v1/models", models), methods=["GET"]),
        Route("/health", _guarded("/health", health), methods=["GET"]),
        Route("/metrics", _guarded("/metrics", prometheus), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
