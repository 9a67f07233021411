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
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from tango_lm.errors import UserError
from tango_lm.serve.batcher import Batcher, Job
from tango_lm.serve.generate import MIN_TEMPERATURE, SEEDS, room_for_new_tokens

MAX_STOP = 16
ENDPOINTS = "POST /v1/completions, GET /v1/models and GET /health (a base model: no chat completions)"
MAX_BATCH_WAIT_MS = 60_000  # a minute; longer (or inf) is no batching policy, and inf kills queue.get


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    """OpenAI's `stream_options` (its one field; a string "no" was truthy, an unknown key ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    """OpenAI's completion parameters (unknown ones are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no true as token 1, no 2.0 as max_tokens 2

    model: str
    prompt: str | list[str] | list[int] | list[list[int]] = ""
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    # OpenAI parameters this server refuses unless they ask for nothing.
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None


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

    app = FastAPI(title="tango-lm", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        json_body = "json" in request.headers.get("content-type", "").lower()
        return JSONResponse(_validation_error(exc.errors(), json_body).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if exc.status_code == 404:  # a client pointed at another endpoint (chat completions, say) learns what is here
            message = f"no endpoint {request.url.path}; this server has {ENDPOINTS}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            message, code = _unreadable_body(exc.__cause__), "invalid_json"  # FastAPI's words for any such failure
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
        prompts, settings = _check(req, model_name, tokenizer, context, max_batch_size)
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


def _unreadable_body(cause: BaseException | None) -> str:
    """What was wrong with a body json.loads raised on for other than its syntax."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 (byte {cause.start}); send JSON in UTF-8"
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deep to read; send a flatter JSON object"
    said = " ".join(str(cause).split())[:200] if cause is not None else ""
    return f"the request body cannot be read as JSON ({said or 'no reason given'}); send a JSON object"


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON) is no text
        raise APIError(
            400, f"the {param} is not valid Unicode (a lone surrogate at character {exc.start})", param=param
        ) from None


def _validation_error(errors: list[dict[str, Any]], json_body: bool = True) -> APIError:
    """The first pydantic error as OpenAI's 400 (`json_body`: the request said its body is JSON)."""
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", []) if x != "body"]
    if not loc and not json_body:  # curl -d sends a form's content type: the JSON in it is not read as JSON
        return APIError(400, "send the request body as JSON, with the header Content-Type: application/json")
    if not loc and err.get("type") == "missing":
        return APIError(400, "the request body is empty; send a JSON object of completion parameters")
    if err.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON; send a JSON object", code="invalid_json")
    if err.get("type") == "extra_forbidden":
        return APIError(
            400, f"unrecognized request argument supplied: {loc[0] if loc else '?'}", param=loc[0] if loc else None
        )
    if err.get("type") == "missing":
        return APIError(
            400, f"you must provide a {loc[0] if loc else 'value'} parameter", param=loc[0] if loc else None
        )
    if not loc:
        return APIError(400, "the request body must be a JSON object of completion parameters")
    return APIError(400, f"invalid value for {loc[0]}: {err.get('msg', 'wrong type')}", param=loc[0])


def _check(
    req: Any, model_name: str, tokenizer: Any, context: int, max_batch_size: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """Validate a completion request: (tokenized prompts, the Job settings) or an APIError."""
    if req.model != model_name:
        raise APIError(
            404,
            f"the model '{req.model}' does not exist; this server serves '{model_name}'",
            param="model",
            code="model_not_found",
        )
    if req.stream_options is not None and not req.stream:  # as OpenAI answers it
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    refused = {
        "logprobs": req.logprobs is not None,
        "echo": bool(req.echo),
        "suffix": req.suffix is not None,
        "best_of": req.best_of not in (None, req.n or 1),  # best_of = n returns all n; below n OpenAI refuses
        "presence_penalty": bool(req.presence_penalty),
        "frequency_penalty": bool(req.frequency_penalty),
        "logit_bias": bool(req.logit_bias),
    }
    for name, asked in refused.items():
        if asked:
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0:
        raise APIError(400, f"max_tokens must be at least 0 (got {max_tokens})", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 2):
        raise APIError(
            400,
            f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and 2 (got {temperature})",
            param="temperature",
        )
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
    if req.seed is not None and req.seed not in SEEDS:
        raise APIError(400, f"seed must be between -2**63 and 2**64 - 1 (got {req.seed})", param="seed")
    n = 1 if req.n is None else req.n
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise APIError(400, f"stop takes at most {MAX_STOP} non-empty strings", param="stop")
    for text in stop:
        _check_unicode(text, "stop")  # one no text can contain, accepted, would never stop a row
    prompts = _prompts(req.prompt, tokenizer)
    if n < 1 or n * len(prompts) > max_batch_size:
        raise APIError(
            400,
            f"n x prompts must be between 1 and {max_batch_size} completions per request "
            f"(got n={n} for {len(prompts)} prompt(s)); the server decodes at most that many rows "
            "at once",
            param="n",
        )
    for ids in prompts:
        if len(ids) > context:
            raise APIError(
                400,
                f"a prompt of {len(ids)} tokens is longer than this model's context of {context} tokens; shorten it",
                param="prompt",
                code="context_length_exceeded",
            )
        room = room_for_new_tokens(len(ids), context)  # the model reads every new token but the last
        if max_tokens > room:
            raise APIError(
                400,
                f"this model's context is {context} tokens; a prompt of {len(ids)} tokens leaves room "
                f"for {room} new tokens (max_tokens is {max_tokens}): shorten the prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
    settings = {
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": None if top_p >= 1 else top_p,
        "stop": stop,
        "seed": req.seed,
    }
    return prompts, settings


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """A string, a list of strings, token ids or lists of token ids -> token id lists."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is an empty list; give a string or token ids", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            _check_unicode(item, "prompt")
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if any(not 0 <= i < tokenizer.vocab_size for i in ids):
            raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        out.append(ids or [tokenizer.eot_id])  # an empty prompt starts a document
    return out


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
    reason, optionally a usage chunk, then `[DONE]`."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return f"data: {json.dumps({**reply, 'choices': choices, **extra})}\n\n"

    left, completion = len(jobs) * n, 0
    try:
        while left:
            p, kind, *rest = await events.get()
            if kind == "error":
                yield f"data: {json.dumps(APIError(rest[1], rest[0], kind='server_error').body())}\n\n"
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


__all__ = ["APIError", "CompletionRequest", "build_app", "serve"]
