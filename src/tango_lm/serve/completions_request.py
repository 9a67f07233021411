"""What `POST /v1/completions` takes (OpenAI's completion parameters) and how a request is
checked: every refusal is an `APIError`, OpenAI's JSON error object with a 4xx status, saying what
to fix. `check_request` runs off the server's event loop (it tokenizes), so one large request never
stalls the others."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from tango_lm.errors import counted
from tango_lm.serve.generate import MIN_TEMPERATURE, is_seed, room_for_new_tokens

MAX_STOP = 16


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
    # A string, strings, token ids or lists of them, checked by `check_request` (off the event
    # loop, after the count): pydantic's union of the four built an error per element for each
    # kind that failed, 18 s on the event loop for a body of 3 million one-id lists.
    prompt: Any = ""
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


def unreadable_body(cause: BaseException | None) -> str:
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


def validation_error(errors: list[dict[str, Any]], json_body: bool = True) -> APIError:
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


def check_request(
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
    if req.seed is not None and not is_seed(req.seed):
        raise APIError(400, f"seed must be between -2**63 and 2**64 - 1 (got {req.seed})", param="seed")
    n = 1 if req.n is None else req.n
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise APIError(400, f"stop takes at most {MAX_STOP} non-empty strings", param="stop")
    for text in stop:
        _check_unicode(text, "stop")  # one no text can contain, accepted, would never stop a row
    items = _prompt_items(req.prompt)
    if n < 1 or n * len(items) > max_batch_size:  # before tokenizing: 2 million prompts took seconds
        raise APIError(
            400,
            f"n x prompts must be between 1 and {max_batch_size} completions per request "
            f"(got n={n} for {counted(len(items), 'prompt')}); the server decodes at most that many rows "
            "at once",
            param="n",
        )
    if not (all(isinstance(item, str) for item in items) or all(_is_ids(item) for item in items)):
        raise APIError(400, f"prompt must be {PROMPT_KINDS}", param="prompt")
    prompts = _tokenized(items, tokenizer)
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
                f"this model's context is {context:,} tokens; a prompt of {counted(len(ids), 'token')} leaves room "
                f"for {counted(room, 'new token')} (max_tokens is {max_tokens:,}): shorten the prompt or lower max_tokens",
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


PROMPT_KINDS = "a string, a list of strings, a list of token ids (integers) or a list of lists of token ids"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(x) is int for x in value)  # not true for 1, nor 1.0


def _prompt_items(prompt: Any) -> list[Any]:
    """A string, a list of strings, token ids or lists of token ids -> one item per prompt (each
    item's kind is checked once they are counted)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not isinstance(prompt, list):
        raise APIError(400, f"prompt must be {PROMPT_KINDS}", param="prompt")
    elif prompt and _is_ids(prompt):
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise APIError(400, "prompt is an empty list; give a string or token ids", param="prompt")
    return items


def _tokenized(items: list[Any], tokenizer: Any) -> list[list[int]]:
    """Prompt items -> token id lists (an empty one: the end-of-text token)."""
    out = []
    for item in items:
        if isinstance(item, str):
            _check_unicode(item, "prompt")
        ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
        if any(not 0 <= i < tokenizer.vocab_size for i in ids):
            raise APIError(400, f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        out.append(ids or [tokenizer.eot_id])  # an empty prompt starts a document
    return out
