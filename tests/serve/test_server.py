"""`tango-lm serve` (serve/server.py, serve/batcher.py): the real server in a subprocess on
127.0.0.1, driven by the real `openai` client and by plain HTTP. Greedy completions equal
`tango-lm generate --temperature 0`, also under concurrent load; bad requests get OpenAI-style 4xx
errors and the server stays up."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tango_lm.cli import main
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.train.checkpoint import save_checkpoint
from tango_lm.train.config import RunConfig
from tests import helpers

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
server_module = pytest.importorskip("tango_lm.serve.server")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
CONTEXT = 40
PROMPTS = ["Hello", "What is 12 + 35?\n", "ab", "The quick brown"]  # four prompt lengths


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny byte-level TANGO, its weights moved off their init so that greedy text varies."""
    root = tmp_path_factory.mktemp("serve")
    tok = get_tokenizer("byte")
    run = RunConfig.from_dict(
        {
            "model": {**helpers.TINY_MODEL, "context_length": CONTEXT},
            "data": {"dir": str(root / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(root)},
        }
    )
    torch.manual_seed(0)
    net = run.model.build()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return save_checkpoint(root / "checkpoints", 3, net.state_dict(), {}, run.to_dict(), tok.to_dict(), {})


@pytest.fixture(scope="module")
def server(checkpoint):
    """The server process and its base URL."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(helpers.ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tango_lm.cli",
            "serve",
            str(checkpoint),
            "--port",
            "0",
            "--model-name",
            MODEL,
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        assert line.startswith(f"serving {MODEL} "), line + proc.stdout.read()
        url = line.split(" at ")[-1].strip()
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def cli_greedy(checkpoint: Path, prompt: str, max_tokens: int, capsys, extra: tuple[str, ...] = ()) -> list[str]:
    """`tango-lm generate --temperature 0` (or the sampling in `extra`): its completions."""
    assert (
        main(
            [
                "generate",
                str(checkpoint),
                "--prompt",
                prompt,
                "--max-new-tokens",
                str(max_tokens),
                "--temperature",
                "0",
                *extra,
                "--json",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)["completions"]


def client(url: str):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)


def http_post(url: str, body: bytes | str) -> tuple[int, dict]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_openai_client_completions_equal_tango_generate(server, checkpoint, capsys):
    _, url = server
    api = client(url)
    assert [m.id for m in api.models.list().data] == [MODEL]
    want = cli_greedy(checkpoint, PROMPTS[1], 12, capsys)[0]
    got = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert got.choices[0].text == want and got.object == "text_completion"
    assert got.usage.prompt_tokens == len(PROMPTS[1].encode()) and got.usage.completion_tokens <= 12
    # streamed: the deltas add up to the same text, and the last chunk says why it ended
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # a stop string ends the text before it
    stop = want[3:5]
    cut = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == want[: want.index(stop)] and cut.choices[0].finish_reason == "stop"
    # n samples with a seed: reproducible, and tango-lm generate's samples for that seed
    kwargs = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 10, "n": 3, "seed": 5, "temperature": 1.0}
    first = [c.text for c in api.completions.create(**kwargs).choices]
    assert first == [c.text for c in api.completions.create(**kwargs).choices]
    assert first == cli_greedy(
        checkpoint, PROMPTS[0], 10, capsys, ("--temperature", "1", "--seed", "5", "--num-samples", "3")
    )


def test_bad_requests_get_openai_errors_and_the_server_stays_up(server):
    proc, url = server
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    cases = [
        ({**body, "model": "gpt-4"}, 404, "model_not_found"),
        ({**body, "prompt": "x" * (CONTEXT + 1)}, 400, "context_length_exceeded"),
        ({**body, "prompt": "x" * (CONTEXT + 1), "max_tokens": 0}, 400, "context_length_exceeded"),
        ({**body, "prompt": "ab\ud800cd"}, 400, None),  # a lone surrogate: no UTF-8 for it
        ({**body, "prompt": ["ok", "\udfff"]}, 400, None),
        ({**body, "stop": "\ud800"}, 400, None),  # accepted, it could never stop a row
        ({**body, "seed": 2**64}, 400, None),  # past what torch's generators take
        ({**body, "seed": -(2**63) - 1}, 400, None),
        ({**body, "max_tokens": CONTEXT}, 400, "context_length_exceeded"),  # "hi" leaves CONTEXT - 1
        ({**body, "max_tokens": -1}, 400, None),
        ({**body, "n": 10_000}, 400, None),
        ({**body, "n": 0}, 400, None),
        ({**body, "temperature": -0.5}, 400, None),
        ({**body, "temperature": 2.5}, 400, None),  # OpenAI's range is [0, 2]
        ({**body, "top_p": 0}, 400, None),
        ({**body, "prompt": [5, 300]}, 400, None),  # a token id outside the vocabulary
        ({**body, "prompt": [5, 257]}, 400, None),  # the first id past the byte tokenizer's
        ({**body, "logprobs": 2}, 400, "unsupported_parameter"),
        ({**body, "best_of": 1, "n": 2}, 400, "unsupported_parameter"),  # OpenAI: best_of must be >= n
        ({**body, "best_of": 3, "n": 2}, 400, "unsupported_parameter"),
        ({**body, "frobnicate": 1}, 400, None),
        ({**body, "max_tokens": "many"}, 400, None),
        ({**body, "max_tokens": True}, 400, None),  # lax parsing read true as 1 and 2.0 as 2
        ({**body, "prompt": [True, 5]}, 400, None),
        ({**body, "prompt": [1.0, 5]}, 400, None),
        ({**body, "n": 2.0}, 400, None),
        ({"prompt": "hi"}, 400, None),
        ([1, 2], 400, None),
        # stream_options: a truthy "no" sent the usage chunk, an unknown key or no stream passed silently
        ({**body, "stream": True, "stream_options": {"include_usage": "no"}}, 400, None),
        ({**body, "stream": True, "stream_options": {"foo": 1}}, 400, None),
        ({**body, "stream_options": {"include_usage": True}}, 400, None),
    ]
    for request, status, code in cases:
        got_status, reply = http_post(url, json.dumps(request))
        assert got_status == status, (request, reply)
        assert set(reply) == {"error"} and reply["error"]["message"], reply
        assert reply["error"]["type"] == "invalid_request_error"
        if code:
            assert reply["error"]["code"] == code
    assert http_post(url, b'{"model": "tiny", "prompt": ')[0] == 400  # malformed JSON
    # FastAPI said only "There was an error parsing the body" for a Latin-1 byte or deep nesting
    for payload, said in (
        (b'{"model": "tiny", "prompt": "caf\xe9"}', "is not UTF-8 (byte 32)"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests arrays or objects too deep"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "Exceeds the limit"),  # Python's cap on an integer's digits
    ):
        got_status, reply = http_post(url, payload)
        assert got_status == 400 and reply["error"]["code"] == "invalid_json", reply
        assert said in reply["error"]["message"], reply
    # A JSON body without its content type (curl -d's default) and an empty body say what to fix.
    for payload, headers, said in (
        (json.dumps(body), {"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type: application/json"),
        (b"", {"Content-Type": "application/json"}, "the request body is empty"),
    ):
        conn = http.client.HTTPConnection(*url.split("//")[1].split("/")[0].split(":"), timeout=60)
        conn.request("POST", "/v1/completions", body=payload, headers=headers)
        resp = conn.getresponse()
        assert resp.status == 400 and said in json.loads(resp.read())["error"]["message"]
    # an endpoint this server lacks: a client learns what it has (an OpenAI chat client, say)
    with pytest.raises(openai.NotFoundError, match="no endpoint /v1/chat/completions; this server has POST /v1/compl"):
        client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client(url).completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context"):
        client(url).completions.create(model=MODEL, prompt="y" * 100)
    assert proc.poll() is None
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"


def test_usage_streams_defaults_and_boundaries_are_as_openai_documents(server, checkpoint, capsys):
    _, url = server
    api = client(url)
    greedy = {"model": MODEL, "temperature": 0}
    # usage: the total is the prompts' tokens and the completions'
    got = api.completions.create(**greedy, prompt=PROMPTS[:2], max_tokens=5)
    prompt_tokens = sum(len(p.encode()) for p in PROMPTS[:2])
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.total_tokens == prompt_tokens + got.usage.completion_tokens
    # streamed choices of several prompts with n > 1 are numbered as unstreamed ones: prompt-major
    plain = api.completions.create(**greedy, prompt=PROMPTS[:2], max_tokens=5, n=2)
    texts = {c.index: c.text for c in plain.choices}
    assert [texts[i] for i in range(4)] == [texts[0], texts[0], texts[2], texts[2]] and texts[0] != texts[2]
    streamed: dict[int, str] = {}
    for chunk in api.completions.create(**greedy, prompt=PROMPTS[:2], max_tokens=5, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts
    # include_usage false: no usage chunk
    chunks = list(
        api.completions.create(
            **greedy, prompt="hi", max_tokens=3, stream=True, stream_options={"include_usage": False}
        )
    )
    assert all(c.usage is None for c in chunks)
    # max_tokens null is OpenAI's default, 16
    status, reply = http_post(url, json.dumps({**greedy, "prompt": "hi", "max_tokens": None}))
    sixteen = api.completions.create(**greedy, prompt="hi", max_tokens=16)
    assert status == 200 and reply["choices"][0]["text"] == sixteen.choices[0].text
    assert reply["usage"]["completion_tokens"] == sixteen.usage.completion_tokens
    # an empty prompt starts after end-of-text, as `tango-lm generate` does
    assert (
        api.completions.create(**greedy, prompt="", max_tokens=6).choices[0].text
        == cli_greedy(checkpoint, "", 6, capsys)[0]
    )
    # a prompt that fills the context still gets its one token; n as large as a batch is answered
    assert len(api.completions.create(**greedy, prompt="x" * CONTEXT, max_tokens=1).choices) == 1
    assert len(api.completions.create(**greedy, prompt="hi", max_tokens=2, n=32).choices) == 32
    # a top_p that keeps only the top token samples it, through the batcher too
    top = api.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, top_p=1e-6, seed=3)
    assert top.choices[0].text == api.completions.create(**greedy, prompt=PROMPTS[1], max_tokens=6).choices[0].text


def test_prompt_kinds_body_size_and_trailing_slashes_are_answered_in_json(server):
    proc, url = server
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = {"model": MODEL, "max_tokens": 1}
    for prompt in (None, {"a": 1}, 5, ["a", [1]], [[1], 2], [[1], "a"], [[True]], [["a"]]):
        got_status, reply = http_post(url, json.dumps({**body, "prompt": prompt}))
        assert got_status == 400 and reply["error"]["param"] == "prompt", (prompt, reply)
        assert reply["error"]["message"].startswith("prompt must be a string, a list of strings"), reply
    # Many prompts are refused by their count before each one is checked: pydantic's union of the
    # four prompt kinds took seconds on the event loop for such a body, holding every client.
    got_status, reply = http_post(url, json.dumps({**body, "prompt": [[1]] * 200_000}))
    assert got_status == 400 and "n x prompts must be between 1 and" in reply["error"]["message"]
    # A body past the limit is refused by its Content-Length, unread.
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    limit = server_module.body_limit(32, CONTEXT)  # the fixture's server: the default --max-batch-size
    assert limit == server_module.MAX_BODY_BYTES < server_module.body_limit(512, 16384)  # a big serving setup has room
    conn.putheader("Content-Length", str(limit + 1))
    conn.endheaders()
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    assert resp.status == 413 and reply["error"]["code"] == "request_too_large", reply
    conn.close()
    # A trailing slash had an empty 307 redirect: it is a path this server lacks, as any other.
    for method, path in (("POST", "/v1/completions/"), ("GET", "/health/")):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(
            method, path, body=json.dumps({**body, "prompt": "x"}), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        assert resp.status == 404 and reply["error"]["message"].startswith(f"no endpoint {path}; this server has")
    assert proc.poll() is None


def test_concurrent_clients_are_batched_and_answered_exactly(server, checkpoint, capsys):
    """32 clients x 4 requests (four prompt lengths, half of them streamed) within a time limit:
    every request is answered with `tango-lm generate --temperature 0`'s text."""
    _, url = server
    want = {p: cli_greedy(checkpoint, p, 8, capsys)[0] for p in PROMPTS}

    async def one_client(api, k: int) -> list[tuple[str, str]]:
        out = []
        for r in range(4):
            prompt = PROMPTS[(k + r) % len(PROMPTS)]
            if (k + r) % 2:
                stream = await api.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
                )
                text = "".join([c.choices[0].text async for c in stream])
            else:
                text = (
                    (await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0))
                    .choices[0]
                    .text
                )
            out.append((prompt, text))
        return out

    async def load() -> list[tuple[str, str]]:
        api = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        results = await asyncio.wait_for(asyncio.gather(*(one_client(api, k) for k in range(32))), timeout=120)
        await api.close()
        return [pair for client_pairs in results for pair in client_pairs]

    host, port = url.split("//")[1].split("/")[0].split(":")

    def batches() -> int:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())["batches"]

    before, t0 = batches(), time.perf_counter()
    answers = asyncio.run(load())
    assert len(answers) == 128
    assert all(text == want[prompt] for prompt, text in answers)
    assert batches() - before < 128 / 2, "concurrent requests were not batched"
    assert time.perf_counter() - t0 < 120


def test_the_served_model_is_named_after_its_run_however_the_path_is_written(checkpoint, monkeypatch):
    from tango_lm.serve.server import _default_name
    from tango_lm.train.checkpoint import load_checkpoint

    run = checkpoint.parent.parent
    monkeypatch.chdir(run)
    assert _default_name(load_checkpoint(".").path) == run.name  # `tango-lm serve .` inside the run
    monkeypatch.chdir(checkpoint)
    assert _default_name(load_checkpoint(".").path) == run.name
    assert _default_name(load_checkpoint(str(run)).path) == run.name


def test_a_waiting_request_whose_client_left_stops_waiting():
    # Starlette does not cancel a plain handler when its client leaves: a non-streamed request's
    # rows decoded to the end for nobody. The wait now notices and lets the jobs be cancelled.

    class Client:
        def __init__(self, gone: bool) -> None:
            self.gone = gone

        async def is_disconnected(self) -> bool:
            return self.gone

    async def forever() -> None:
        await asyncio.sleep(3600)

    async def answer() -> int:
        await asyncio.sleep(2 * server_module.DISCONNECT_POLL_S)
        return 7

    started = time.monotonic()
    assert asyncio.run(server_module._collect_while_connected(Client(gone=True), forever())) is None
    assert time.monotonic() - started < 5
    assert asyncio.run(server_module._collect_while_connected(Client(gone=False), answer())) == 7


def test_the_printed_url_brackets_an_ipv6_address():
    import socket

    from tango_lm.serve.server import base_url

    with socket.create_server(("127.0.0.1", 0)) as sock:
        assert base_url(sock) == f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    if socket.has_ipv6:
        try:
            sock = socket.create_server(("::1", 0), family=socket.AF_INET6)
        except OSError:  # no IPv6 loopback in this container
            return
        with sock:
            assert base_url(sock) == f"http://[::1]:{sock.getsockname()[1]}/v1"


def test_too_many_prompts_are_refused_before_any_is_tokenized():
    # 2 million prompts were each checked and tokenized before the count was: 6.5 s of refusal.
    from types import SimpleNamespace

    from tango_lm.serve.completions_request import APIError, CompletionRequest, check_request

    encoded = []
    tokenizer = SimpleNamespace(vocab_size=257, eot_id=256, encode=lambda text: encoded.append(text) or [97])
    request = CompletionRequest(model=MODEL, prompt=["ab"] * 100)
    with pytest.raises(APIError, match="n x prompts must be between 1 and 32"):
        check_request(request, MODEL, tokenizer, CONTEXT, 32)
    assert encoded == []
    prompts, _ = check_request(request.model_copy(update={"prompt": ["ab"] * 32}), MODEL, tokenizer, CONTEXT, 32)
    assert prompts == [[97]] * 32 and len(encoded) == 32


def test_context_errors_count_one_token_as_one_token():
    # "a prompt of 1 tokens leaves room for ..." read wrong at a count of one.
    from types import SimpleNamespace

    from tango_lm.serve.completions_request import APIError, CompletionRequest, check_request

    tokenizer = SimpleNamespace(vocab_size=257, eot_id=256, encode=lambda text: [97] * len(text))
    for prompt, max_tokens, said in [
        ("a", CONTEXT + 1, f"a prompt of 1 token leaves room for {CONTEXT} new tokens"),
        ("a" * CONTEXT, 2, f"a prompt of {CONTEXT} tokens leaves room for 1 new token (max_tokens is 2)"),
    ]:
        request = CompletionRequest(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        with pytest.raises(APIError, match=re.escape(said)):
            check_request(request, MODEL, tokenizer, CONTEXT, 32)
    with pytest.raises(APIError, match=re.escape("(got n=40 for 1 prompt)")):
        check_request(CompletionRequest(model=MODEL, prompt="a", n=40), MODEL, tokenizer, CONTEXT, 32)


def test_a_request_being_tokenized_does_not_hold_the_other_clients():
    # Tokenizing ran on the event loop: one 50 MB prompt held /health and every stream for seconds.
    # Here the tokenizer waits until /health has answered; on the event loop it would wait in vain.
    import threading
    from types import SimpleNamespace

    import httpx

    from tango_lm.serve.server import build_app

    answered, order = threading.Event(), []

    def encode(text: str) -> list[int]:
        order.append("encode" if answered.wait(timeout=20) else "encode, /health still waiting")
        return [97] * (CONTEXT + 1)  # longer than the context: refused, nothing is decoded

    model = SimpleNamespace(config=SimpleNamespace(context_length=CONTEXT))
    tokenizer = SimpleNamespace(vocab_size=257, eot_id=256, encode=encode)
    app = build_app(model, tokenizer, MODEL, torch.device("cpu"))

    async def both() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            slow = asyncio.ensure_future(http.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
            await asyncio.sleep(0.05)
            health = await http.get("/health")
            order.append("health")
            answered.set()
            return await slow, health

    slow, health = asyncio.run(both())
    assert health.json()["status"] == "ok" and order == ["health", "encode"]
    assert slow.status_code == 400 and slow.json()["error"]["code"] == "context_length_exceeded"


def test_a_stream_that_fails_ends_with_its_error_and_done_without_a_usage_count():
    # After a shutdown (503) or a failed batch (500) the usage chunk counted only the rows finished:
    # 0 completion tokens after 39 streamed.
    import threading
    from types import SimpleNamespace

    async def stream(*events: tuple) -> list[str]:
        queue: asyncio.Queue = asyncio.Queue()
        for event in events:
            queue.put_nowait(event)
        job = SimpleNamespace(cancelled=threading.Event())
        return [c async for c in server_module._stream(queue, [job], 1, {"id": "x"}, True, 3)]

    failed = asyncio.run(stream((0, "text", 0, "ab"), (0, "error", "the server is shutting down", 503)))
    assert len(failed) == 3 and '"server_error"' in failed[1] and "shutting down" in failed[1]
    assert failed[2] == "data: [DONE]\n\n" and not any("usage" in c for c in failed)
    finished = asyncio.run(stream((0, "text", 0, "ab"), (0, "done", 0, "length", 2)))
    assert '"completion_tokens": 2' in finished[-2] and finished[-1] == "data: [DONE]\n\n"


def test_other_methods_and_pages_name_the_endpoints(server):
    # FastAPI's /docs, /redoc and /openapi.json answered 200 (the README says any other path is a
    # 404 listing the endpoints), and a wrong method said only "Method Not Allowed".
    _, url = server
    host, port = url.split("//")[1].split("/")[0].split(":")
    for method, path, status, said in (
        ("GET", "/docs", 404, "no endpoint /docs; this server has POST /v1/completions"),
        ("GET", "/openapi.json", 404, "no endpoint /openapi.json"),
        ("GET", "/v1/completions", 405, "/v1/completions does not take GET; this server has POST /v1/completions"),
        ("DELETE", "/health", 405, "/health does not take DELETE"),
    ):
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request(method, path)
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        assert resp.status == status and said in reply["error"]["message"], (method, path, reply)


def test_generate_and_serve_warn_of_positions_the_run_never_trained(tmp_path, capsys, monkeypatch):
    # A run of train.seq_len=8 in a context of 40 learned positions 1-8 only; eval and lm-eval score
    # windows of 8, but generate and serve read up to 40 without a word (a RoPE model's text falls
    # apart there, GAU's relative bias past 8 is its initial zero).
    tok = get_tokenizer("byte")
    run = RunConfig.from_dict(
        {
            "model": {**helpers.TINY_MODEL, "context_length": CONTEXT},
            "data": {"dir": str(tmp_path / "data")},
            "train": {**helpers.TINY_TRAIN, "seq_len": 8, "out_dir": str(tmp_path)},
        }
    )
    ckpt = save_checkpoint(
        tmp_path / "checkpoints", 3, run.model.build().state_dict(), {}, run.to_dict(), tok.to_dict(), {}
    )
    argv = ["generate", str(ckpt), "--temperature", "0", "--device", "cpu", "--max-new-tokens"]
    assert main([*argv, "3", "--prompt", "abcdef"]) == 0  # reads 8 positions: 6 + 3 - 1
    assert capsys.readouterr().err == ""
    assert main([*argv, "4", "--prompt", "abcdef"]) == 0
    assert capsys.readouterr().err == (
        "warning: the prompt with its new tokens reads up to position 9, past the 8 the run trained on "
        f"(train.seq_len=8, model.context_length={CONTEXT}); what the model does there is untrained\n"
    )
    monkeypatch.setattr(
        server_module,
        "uvicorn_server",
        lambda app, log_level: type("S", (), {"run": lambda self, sockets: sockets[0].close()})(),
    )
    server_module.serve(str(ckpt), port=0, device="cpu")
    assert capsys.readouterr().err == (
        f"warning: a request as long as the context reads up to position {CONTEXT}, past the 8 the run trained on "
        f"(train.seq_len=8, model.context_length={CONTEXT}); what the model does there is untrained\n"
    )
