"""`tango-lm serve RUN`: an OpenAI-compatible completions server (FastAPI + uvicorn).

    POST /v1/completions   prompt (text, token ids, or a list of either), max_tokens (16), temperature (1),
                           top_p (1), stop (a string or a list), n (1), stream (server-sent events), seed
    GET  /v1/models        the one model this server holds
    GET  /health           {"status": "ok", ...}

Requests are decoded by `serve/batcher.py`: concurrent requests with prompts of the same length and
the same sampling share a batch on the device; requests that arrive while a batch decodes join the
next batch. Each batch is one `generate` call, streamed or not: on CUDA its static decode steps
replayed as CUDA graphs, on CPUs the eager decode. An empty prompt starts from the end-of-text token (the start of a document). Every
error is OpenAI's JSON error object (`{"error": {"message", "type", "param", "code"}}`) with a 4xx
status; a bad request never stops the server. Parameters the server does not implement (logprobs,
echo, suffix, a best_of other than n, penalties, logit_bias) are refused with 400 rather than ignored.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from tango_lm.errors import UserError
from tango_lm.serve.batcher import Batcher, Job
from tango_lm.serve.completions_request import (
    APIError,
    CompletionRequest,
    check_request,
    unreadable_body,
    validation_error,
)

ENDPOINTS = "POST /v1/completions, GET /v1/models and GET /health (a base model: no chat completions)"
MAX_BATCH_WAIT_MS = 60_000  # a minute; longer (or inf) is no batching policy, and inf kills queue.get
# A body is parsed as JSON on the event loop: one larger than this (by its Content-Length) gets a
# 413 unread. At least 16 MiB, and room for --max-batch-size prompts of a whole context each, at
# BODY_BYTES_PER_TOKEN (a token id's digits and comma, or a token's text, escaped).
MAX_BODY_BYTES = 16 * 2**20
BODY_BYTES_PER_TOKEN = 32


def body_limit(max_batch_size: int, context: int) -> int:
    return max(MAX_BODY_BYTES, max_batch_size * context * BODY_BYTES_PER_TOKEN)


class BodyLimit:
    """ASGI middleware: a request whose Content-Length is past `limit` (`body_limit`) gets OpenAI's
    JSON error with status 413 before its body is read."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.limit:
                error = APIError(
                    413,
                    f"the request body is {int(length):,} bytes; this server reads at most {self.limit:,}",
                    code="request_too_large",
                )
                await JSONResponse(error.body(), status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    model: Any, tokenizer: Any, model_name: str, device: Any, max_batch_size: int = 32, batch_wait: float = 0.02
) -> FastAPI:
    """The FastAPI app serving `model`; its batcher thread starts and stops with the app."""
    batcher = Batcher(model, tokenizer, device, max_batch_size=max_batch_size, batch_wait=batch_wait)
    context = model.config.context_length
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        batcher.start()
        yield
        batcher.stop()

    # No /docs, /redoc or /openapi.json: the endpoints below are all there is (a 404 lists them).
    # redirect_slashes off: `/v1/completions/` got an empty 307, not the 404 that lists the endpoints.
    app = FastAPI(
        title="tango-lm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    app.add_middleware(BodyLimit, limit=body_limit(max_batch_size, context))
    app.state.batcher = batcher

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        json_body = "json" in request.headers.get("content-type", "").lower()
        return JSONResponse(validation_error(exc.errors(), json_body).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404:  # a client pointed at another endpoint (chat completions, say) learns what is here
            message = f"no endpoint {request.url.path}; this server has {ENDPOINTS}"
        elif exc.status_code == 405:  # Starlette's "Method Not Allowed" named no method to use
            message = f"{request.url.path} does not take {request.method}; this server has {ENDPOINTS}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message, code = unreadable_body(exc.__cause__), "invalid_json"  # FastAPI's words for any such failure
        error = APIError(exc.status_code, message, code=code)
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "batches": batcher.batches}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "tango-lm",
                    "context_length": context,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        # Off the event loop: tokenizing a large prompt held every other client (and /health) for seconds.
        prompts, settings = await asyncio.to_thread(check_request, req, model_name, tokenizer, context, max_batch_size)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        jobs = []
        for p, ids in enumerate(prompts):

            def emit(event: tuple, p: int = p) -> None:  # called by the batcher thread
                if not loop.is_closed():  # a server shutting down has no one left to answer
                    loop.call_soon_threadsafe(events.put_nowait, (p, *event))

            jobs.append(Job(prompt=ids, emit=emit, **settings))
        for job in jobs:
            batcher.submit(job)
        reply = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        n = settings["n"]
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(events, jobs, n, reply, usage, sum(map(len, prompts))),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            collected = await _collect_while_connected(request, _collect(events, jobs, n))
        finally:
            for job in jobs:
                job.cancelled.set()  # no-op once done; stops the rows of a client that went away
        if collected is None:  # the client left: nobody reads an answer
            return Response(status_code=499)
        texts, finish, tokens = collected
        choices = [
            {"text": texts[k], "index": k, "logprobs": None, "finish_reason": finish[k]} for k in range(len(jobs) * n)
        ]
        completion = sum(tokens)
        return {
            **reply,
            "choices": choices,
            "usage": {
                "prompt_tokens": sum(map(len, prompts)),
                "completion_tokens": completion,
                "total_tokens": sum(map(len, prompts)) + completion,
            },
        }

    return app


DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


async def _collect_while_connected(request: Request, collect: Any) -> Any:
    """`collect`'s result, or None once the client has disconnected (Starlette does not cancel a
    handler then: without this, a client that timed out left its rows decoding to the end)."""
    task = asyncio.ensure_future(collect)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                return None
        return task.result()
    finally:
        task.cancel()


async def _collect(events: asyncio.Queue, jobs: list[Any], n: int) -> tuple[list[str], list[str], list[int]]:
    rows = len(jobs) * n
    texts, finish, tokens = [""] * rows, [""] * rows, [0] * rows
    left = rows
    while left:
        p, kind, *rest = await events.get()
        if kind == "error":  # (message, status): a failed batch 500, a server shutting down 503
            raise APIError(rest[1], rest[0], kind="server_error")
        k = p * n + rest[0]
        if kind == "text":
            texts[k] += rest[1]
        elif kind == "done":
            finish[k], tokens[k] = rest[1], rest[2]
            left -= 1
    return texts, finish, tokens


async def _stream(
    events: asyncio.Queue, jobs: list[Any], n: int, reply: dict[str, Any], usage: bool, prompt_tokens: int
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per text delta, a final chunk per choice with its finish
    reason, optionally a usage chunk, then `[DONE]`; after an error event only `[DONE]`."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**reply, 'choices': choices, **extra})}\n\n"

    left, completion = len(jobs) * n, 0
    try:
        while left:
            p, kind, *rest = await events.get()
            if kind == "error":  # then [DONE] alone: a usage chunk would count only the rows finished
                yield f"data: {json.dumps(APIError(rest[1], rest[0], kind='server_error').body())}\n\n"
                usage = False
                break
            k = p * n + rest[0]
            if kind == "text":
                yield chunk([{"text": rest[1], "index": k, "logprobs": None, "finish_reason": None}])
            elif kind == "done":
                left -= 1
                completion += rest[2]
                yield chunk([{"text": "", "index": k, "logprobs": None, "finish_reason": rest[1]}])
        if usage:
            yield chunk(
                [],
                usage={
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            )
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            job.cancelled.set()


def serve(
    run_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str | None = None,
    device: str = "auto",
    max_batch_size: int = 32,
    batch_wait_ms: float = 20.0,
    threads: int | None = None,
    log_level: str = "warning",
) -> None:
    """Load a checkpoint and serve it until interrupted. Port 0 picks a free port; the address is
    printed once the socket listens."""

    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.train.checkpoint import load_checkpoint
    from tango_lm.train.device import pick_device

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be 0 (any free port) to 65535 (got {port})")
    if max_batch_size < 1:
        raise UserError(f"--max-batch-size must be at least 1 (got {max_batch_size})")
    if not 0 <= batch_wait_ms <= MAX_BATCH_WAIT_MS:  # NaN fails too
        raise UserError(f"--batch-wait-ms must be between 0 and {MAX_BATCH_WAIT_MS} (got {batch_wait_ms})")
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be at least 1 (got {threads})")
        import torch

        torch.set_num_threads(threads)
    ckpt = load_checkpoint(run_dir)
    dev = pick_device(device)
    model = ckpt.build_model(dev)
    tokenizer = tokenizer_from_dict(ckpt.tokenizer)
    name = model_name or _default_name(ckpt.path)
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as exc:
        raise UserError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host"
        ) from None
    app = build_app(model, tokenizer, name, dev, max_batch_size=max_batch_size, batch_wait=batch_wait_ms / 1000)

    server = uvicorn_server(app, log_level)
    if note := ckpt.untrained_positions_note(model.config.context_length, "a request as long as the context"):
        print(note, file=sys.stderr)
    print(f"serving {name} ({ckpt.path}, step {ckpt.meta.get('step')}) at {base_url(sock)}", flush=True)
    server.run(sockets=[sock])


def uvicorn_server(app: Any, log_level: str = "info") -> Any:
    """uvicorn's server for `app`, whose exit signal first answers the requests in flight (a 503
    each, their rows no longer decoded): they then end within its 5 s grace period instead of being
    cancelled with a plain-text 500 when it ends."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.batcher.shut_down()
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))


def base_url(sock: socket.socket) -> str:
    """The API's URL on the socket it listens on; an IPv6 address in brackets, as URLs write it."""
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _default_name(path: Any) -> str:
    """The run directory's name (a step directory names its run)."""
    from pathlib import Path

    path = Path(path).resolve()  # `serve .` inside a run names the run, not ""
    return path.parent.parent.name if path.parent.name == "checkpoints" else path.name


__all__ = ["APIError", "CompletionRequest", "build_app", "serve"]  # the first two: completions_request.py
