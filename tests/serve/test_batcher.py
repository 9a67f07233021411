"""The server's engine (serve/batcher.py) without HTTP: streamed text, stop strings and UTF-8 held
back until decided, and batches formed only from jobs that can share a decode cache."""

from __future__ import annotations

import threading

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.data.tokenizers import get_tokenizer
from tango_lm.serve import batcher as batcher_module
from tango_lm.serve.batcher import Batcher, Job, RowText, batch_bucket
from tango_lm.serve.generate import generate

BYTES = get_tokenizer("byte")
pytestmark = pytest.mark.usefixtures("one_thread")


def pushes(row: RowText, text: bytes | list[int]) -> list[str]:
    return [row.push(t) for t in text]


def test_row_text_holds_back_a_possible_stop_string_and_cuts_it_off():
    row = RowText(BYTES, ["</s>", "zz"], max_tokens=50)
    deltas = pushes(row, b"ab</x</s>cd")
    assert deltas == ["a", "b", "", "", "</x", "", "", "", "", "", ""]  # "<", "</" wait; "</x" cannot be a stop
    assert row.text == "ab</x" and row.finish == "stop" and "".join(deltas) == row.text
    assert row.push(ord("c")) == "" and row.text == "ab</x"  # nothing after the end


def test_row_text_waits_for_whole_utf8_characters():
    row = RowText(BYTES, [], max_tokens=50)
    deltas = pushes(row, "é🦜!".encode())
    assert "".join(deltas) == "é🦜!" and "\ufffd" not in "".join(deltas)
    assert deltas[0] == "" and deltas[1] == "é"


@pytest.mark.parametrize(("stop", "want"), [("fé", " wörld ca"), (" wö", ""), ("wörld", " "), ("é", " caf")])
def test_a_stop_string_ending_in_a_multibyte_character_is_never_sent(stop, want):
    # The half-decoded character (U+FFFD) hid that the text could still end a stop: its start went out.
    row = RowText(BYTES, [stop], max_tokens=50)
    deltas = pushes(row, " wörld café".encode() if stop != "é" else " café".encode())
    assert "".join(deltas) == want and row.text == want and row.finish == "stop"


def test_a_stop_string_of_a_replacement_character_is_matched_only_where_the_text_has_one():
    """A stop "\ufffd" matched the half-decoded character of an incomplete UTF-8 sequence: 'é' was
    cut off as the stop, and the completion ended early."""
    row = RowText(BYTES, ["\ufffd"], max_tokens=10)
    deltas = pushes(row, [0x41, 0xC3, 0xA9, 0xFF, 0x42])
    assert "".join(deltas) == "Aé" and row.text == "Aé" and row.finish == "stop"  # 0xff stays U+FFFD
    row = RowText(BYTES, ["\ufffd"], max_tokens=2)  # the text ends on an incomplete sequence: that is U+FFFD
    assert "".join(pushes(row, [0x41, 0xC3])) == "A" and row.finish == "stop"


def test_row_text_ends_at_end_of_text_and_at_max_tokens():
    row = RowText(BYTES, [], max_tokens=50)
    assert pushes(row, [104, 105, BYTES.eot_id]) == ["h", "i", ""] and (row.finish, row.ids) == ("stop", [104, 105])
    row = RowText(BYTES, ["xyz"], max_tokens=3)
    assert "".join(pushes(row, b"abxy")) == "abx" and row.finish == "length"  # 'x' sent once the budget ends


class WholeRowText:
    """RowText as it was: the whole row decoded and searched at every token (the reference)."""

    def __init__(self, tokenizer, stop, max_tokens):
        self.tokenizer, self.stop, self.max_tokens = tokenizer, stop, max_tokens
        self.ids, self.text, self.sent, self.finish = [], "", 0, None

    def push(self, token):
        if self.finish is not None:
            return ""
        ends = "stop" if token == self.tokenizer.eot_id else None
        if ends is None:
            self.ids.append(token)
            self.text = self.tokenizer.decode(self.ids)
            ends = "length" if len(self.ids) >= self.max_tokens else None
        settled = len(self.text) if ends else len(self.text.rstrip("\ufffd"))
        cuts = [i for s in self.stop if 0 <= (i := self.text.find(s)) and i + len(s) <= settled]
        self.text, self.finish = (self.text[: min(cuts)], "stop") if cuts else (self.text, ends)
        safe = len(self.text) if self.finish is not None else len(self.text) - RowText._held_back(self)
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return delta


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_row_text_decodes_from_its_last_whole_character_as_the_whole_row_would(name):
    # Decoding the whole row at every token made a long completion quadratic (seconds per row at
    # 4,096 GPT-2 tokens); the row now decodes from its last complete character on.
    import random

    tokenizer = get_tokenizer(name)
    rng = random.Random(0)
    pieces = ["é", "🦜", "ab", " stop", "\ufffd", "zz", "文字", " ", "x"]
    decoded = []
    real_decode = tokenizer.decode

    class Counting:  # the tokenizer, counting the ids each decode is given
        eot_id = tokenizer.eot_id

        def decode(self, ids):
            decoded.append(len(ids))
            return real_decode(ids)

    for case in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text)
        if name == "byte" and case % 3 == 0:  # invalid UTF-8 too: lone continuation and lead bytes
            ids = [rng.choice([0x80, 0xC3, 0xFF, 0xE2, *ids]) for _ in ids]
        if case % 5 == 0:
            ids.append(tokenizer.eot_id)
        stop = rng.sample(["stop", "zz", "é", "\ufffd", "🦜x", "ab stop"], rng.randint(0, 2))
        budget = rng.randint(1, len(ids) + 2)
        row, whole = RowText(Counting(), stop, budget), WholeRowText(tokenizer, stop, budget)
        assert [row.push(t) for t in ids] == [whole.push(t) for t in ids], (ids, stop, budget)
        assert (row.text, row.finish, row.ids) == (whole.text, whole.finish, whole.ids)
    # a complete character ends a decode's ids: a few per token, not the row
    long_row = RowText(Counting(), ["never"], 10_000)
    decoded.clear()
    for t in tokenizer.encode("é🦜 text " * 400):
        long_row.push(t)
    assert max(decoded) <= 4


def test_batches_group_equal_prompt_lengths_and_sampling_oldest_first():
    model = build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=16, depth=1, vocab_size=257, context_length=32)
    )
    batcher = Batcher(model, BYTES, torch.device("cpu"), max_batch_size=4)
    settings = {"max_tokens": 3, "stop": [], "emit": lambda event: None}
    jobs = [
        Job(prompt=[1, 2], n=2, temperature=0, top_p=0.5, seed=None, **settings),  # top_p ignored when greedy
        Job(prompt=[1, 2, 3], n=1, temperature=0, top_p=None, seed=None, **settings),  # another length
        Job(prompt=[3, 4], n=1, temperature=0, top_p=None, seed=None, **settings),
        Job(prompt=[3, 4], n=1, temperature=1, top_p=None, seed=None, **settings),  # other sampling
        Job(prompt=[5, 6], n=2, temperature=0, top_p=None, seed=None, **settings),  # over 4 rows
        Job(prompt=[5, 6], n=1, temperature=0, top_p=None, seed=7, **settings),
    ]  # seeded: alone
    batcher.waiting = list(jobs)
    assert batcher._take_batch() == [jobs[0], jobs[2]]
    assert batcher._take_batch() == [jobs[1]]
    assert batcher._take_batch() == [jobs[3]]
    assert batcher._take_batch() == [jobs[4]]
    assert batcher._take_batch() == [jobs[5]]
    assert batcher._take_batch() == []


@pytest.mark.parametrize("pad_to_buckets", [False, True])
def test_a_batch_streams_each_rows_greedy_tokens(pad_to_buckets, monkeypatch):
    """Rows of different jobs decoded together give what each prompt gives alone; rows end at
    their own max_tokens; a cancelled job stops receiving text. Padded to a power of two rows
    (as on CUDA, where each batch size compiles its own static step), the 3 rows decode as 4 and
    stream the same text."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=16, depth=1, vocab_size=257, context_length=32)
    ).double()
    decoded_rows = []

    def recording_generate(model, prompt, *args, **kwargs):
        decoded_rows.append(prompt.shape[0])
        return generate(model, prompt, *args, **kwargs)

    monkeypatch.setattr(batcher_module, "generate", recording_generate)
    batcher = Batcher(model, BYTES, torch.device("cpu"), pad_to_buckets=pad_to_buckets)
    assert Batcher(model, BYTES, torch.device("cpu")).pad_to_buckets is False  # CPUs decode eagerly: no padding
    events: dict[int, list] = {0: [], 1: []}
    done = threading.Event()
    a = Job(
        prompt=[97, 98, 99], n=2, max_tokens=6, temperature=0, top_p=None, stop=[], seed=None, emit=events[0].append
    )
    b = Job(
        prompt=[120, 121, 122], n=1, max_tokens=3, temperature=0, top_p=None, stop=[], seed=None, emit=events[1].append
    )
    batcher.start()
    try:
        batcher.submit(a)
        batcher.submit(b)
        for _ in range(600):
            if sum(e[0] == "done" for e in events[0]) == 2 and any(e[0] == "done" for e in events[1]):
                done.set()
                break
            threading.Event().wait(0.05)
    finally:
        batcher.stop()
    assert done.is_set() and batcher.batches == 1 and decoded_rows == [4 if pad_to_buckets else 3]
    for job, got in ((a, events[0]), (b, events[1])):
        want = generate(model, torch.tensor([job.prompt]), job.max_tokens, temperature=0)[0, 3:].tolist()
        for row in range(job.n):
            text = "".join(e[2] for e in got if e[0] == "text" and e[1] == row)
            end = [e for e in got if e[0] == "done" and e[1] == row]
            assert end == [("done", row, "length", job.max_tokens)] or BYTES.eot_id in want
            assert text == BYTES.decode(want[: want.index(BYTES.eot_id)] if BYTES.eot_id in want else want)


@pytest.mark.parametrize("stop_at", [None, 2])
def test_generate_on_token_sees_every_step_and_can_stop(stop_at):
    model = build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=16, depth=1, vocab_size=61, context_length=32)
    )
    prompt = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(0))
    seen = []

    def on_token(tokens):
        seen.append(tokens.clone())
        return len(seen) == stop_at

    out = generate(model, prompt, 6, temperature=0, on_token=on_token)
    assert torch.equal(torch.stack(seen, 1), out[:, 5:])
    assert out.shape[1] == 5 + (stop_at or 6)
    assert torch.equal(out, generate(model, prompt, 6, temperature=0)[:, : out.shape[1]])


def test_serve_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    from tango_lm.cli import main
    from tests import helpers

    if importlib.util.find_spec("fastapi") and importlib.util.find_spec("uvicorn"):
        assert main(["serve", str(tmp_path / "missing")]) == 2
        assert "does not exist" in helpers.assert_one_error_line(capsys.readouterr().err)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find_spec(name, *a)
    )
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "pip install 'tango-lm[serve]'" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_onona_requests_at_temperature_1_sample_with_one_projection(monkeypatch):
    """The server's untruncated temperature-1 rows go through the head's one-projection sampler
    (generate's exact path), and with a seed give generate's samples."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch="tango", head="onona", d_model=16, head_dim=8, width=16, depth=1, vocab_size=257, context_length=32
        )
    )
    calls = []
    real = type(model.head).sample
    monkeypatch.setattr(type(model.head), "sample", lambda self, *a: calls.append(1) or real(self, *a))
    events: list = []
    job = Job(prompt=[97, 98], n=3, max_tokens=5, temperature=1.0, top_p=None, stop=[], seed=11, emit=events.append)
    batcher = Batcher(model, BYTES, torch.device("cpu"))
    batcher.waiting = [job]
    batcher._decode(batcher._take_batch())
    assert calls  # the one-projection sampler drew the tokens
    want = generate(model, torch.tensor([job.prompt] * 3), 5, temperature=1.0, seed=11)[:, 2:].tolist()
    for row in range(3):
        text = "".join(e[2] for e in events if e[0] == "text" and e[1] == row)
        ids = want[row][: want[row].index(BYTES.eot_id)] if BYTES.eot_id in want[row] else want[row]
        assert text == BYTES.decode(ids)


def test_requests_draw_only_the_tokenizers_ids():
    """A table padded past the tokenizer's 257 ids (as GPT-2's 50257 are padded to 50304): the
    padding rows, scaled up here, would win every greedy step; the server's rows skip them."""
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=16, depth=1, vocab_size=300, context_length=32)
    )
    with torch.no_grad():
        model.head.embed_tokens.weight[257:] *= 50
    prompt = torch.tensor([[97, 98]])
    assert (generate(model, prompt, 5, temperature=0)[0, 2:] >= 257).all()
    want = generate(model, prompt, 5, temperature=0, vocab_size=257)[0, 2:].tolist()
    events: list = []
    job = Job(prompt=[97, 98], n=1, max_tokens=5, temperature=0, top_p=None, stop=[], seed=None, emit=events.append)
    batcher = Batcher(model, BYTES, torch.device("cpu"))
    batcher.waiting = [job]
    batcher._decode(batcher._take_batch())
    text = "".join(e[2] for e in events if e[0] == "text")
    assert max(want) < 257 and text == BYTES.decode(want[: want.index(BYTES.eot_id)] if BYTES.eot_id in want else want)
    assert text


def test_batch_buckets_are_the_next_power_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32)] == [1, 2, 4, 4, 8, 8, 16, 32, 32]


def test_a_server_shutting_down_answers_the_jobs_in_flight_with_a_503_and_stops_their_rows():
    # SIGTERM left a running request to be cancelled when uvicorn's grace period ran out (a plain
    # 500, a traceback) and the worker decoding its rows for up to 30 s more.
    import asyncio

    from tango_lm.serve.server import APIError, _collect

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=16, depth=1, vocab_size=257, context_length=32)
    )
    batcher = Batcher(model, BYTES, torch.device("cpu"))
    events: list = []

    def emit(event):  # the worker's thread: the first text of the job shuts the server down
        events.append(event)
        if event[0] == "text" and sum(e[0] == "text" for e in events) == 1:
            batcher.shut_down()

    job = Job(prompt=[97, 98], n=1, max_tokens=29, temperature=0, top_p=None, stop=[], seed=None, emit=emit)
    batcher.start()
    try:
        batcher.submit(job)
        for _ in range(600):
            if any(e[0] == "error" for e in events) and batcher.worker.is_alive():
                break
            threading.Event().wait(0.05)
    finally:
        batcher.stop()
    assert ("error", batcher_module.SHUTTING_DOWN, 503) in events and not batcher.worker.is_alive()
    assert sum(e[0] == "text" for e in events) <= 2  # its rows stopped, not decoded to max_tokens
    late: list = []
    batcher.submit(Job(prompt=[97], n=1, max_tokens=3, temperature=0, top_p=None, stop=[], seed=None, emit=late.append))
    assert late == [("error", batcher_module.SHUTTING_DOWN, 503)]  # answered, not queued for nobody

    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait((0, "error", batcher_module.SHUTTING_DOWN, 503))
    with pytest.raises(APIError) as answered:
        asyncio.run(_collect(queue, [job], 1))
    assert answered.value.status == 503


def test_the_servers_exit_signal_shuts_the_batcher_down_first():
    # uvicorn's own exit left the requests in flight to its grace period's end (then a 500).
    import signal
    from types import SimpleNamespace

    pytest.importorskip("uvicorn")
    from tango_lm.serve.server import uvicorn_server

    calls = []
    app = SimpleNamespace(state=SimpleNamespace(batcher=SimpleNamespace(shut_down=lambda: calls.append("shut_down"))))
    server = uvicorn_server(app)
    server.handle_exit(signal.SIGTERM, None)
    assert calls == ["shut_down"] and server.should_exit
