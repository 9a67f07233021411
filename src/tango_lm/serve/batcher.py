"""The server's engine: completion jobs from concurrent requests, decoded together in batches on
one device by one worker thread (`serve/server.py` puts HTTP around it).

Batching: the decode caches keep one position for a whole batch and the models take no padding, so
rows decode together only when their prompts have the same length. The worker takes the oldest
queued job, waits `batch_wait` seconds for more to arrive, and decodes it with every queued job of
the same prompt length and sampling (temperature, top_p), up to `max_batch_size` rows, oldest
first. A job with a seed decodes alone, so its samples do not depend on other traffic (they equal
`tango-lm generate --seed S --num-samples n` on the same device: streaming decodes as `generate`
does, with static steps replayed as CUDA graphs on CUDA and the eager decode on CPUs). Jobs that
arrive while a batch decodes join the *next batch*, not the running one (its rows are already at
another position).

Each batch is one `serve.generate.generate` call (cached decoding; onóna's one-projection sampling
when the sampling is untruncated at temperature 1) whose `on_token` hook streams every row's text
as it grows: a row ends at the end-of-text token, at a stop string (cut off, not returned) or at
its `max_tokens`; the batch stops when every row has ended. Text that could still become a stop
string, or an incomplete UTF-8 character, is held back until the next token decides.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tango_lm.serve.generate import generate
from tango_lm.serve.static_decode import default_mode

Event = tuple[Any, ...]  # ("text", row, delta) | ("done", row, finish_reason, tokens) | ("error", message)
_ids = itertools.count()


@dataclass
class Job:
    """`n` completions of one tokenized prompt. `emit` is called from the worker thread."""

    prompt: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float | None
    stop: list[str]
    seed: int | None
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_ids))

    def batch_key(self) -> tuple:
        """Jobs with equal keys may share a batch."""
        if self.seed is not None:
            return ("seeded", self.id)
        return (len(self.prompt), self.temperature, None if self.temperature == 0 else self.top_p)


class RowText:
    """The text of one completion as its tokens arrive: what may be sent now, and when it ends."""

    def __init__(self, tokenizer: Any, stop: list[str], max_tokens: int) -> None:
        self.tokenizer, self.stop, self.max_tokens = tokenizer, stop, max_tokens
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.finish: str | None = None  # "stop" | "length" once ended
        # Decoding and the stop search go on from where the text is final, not from its start: the
        # whole row each token made long completions quadratic (seconds per row at 4,096 tokens).
        # The tokenizers are byte-level, so text decoded up to a complete character is final.
        self._final_ids, self._final_text = 0, ""  # the ids whose text ends in a complete character
        self._searched = 0  # settled characters the stop strings were looked for in
        self._longest_stop = max(map(len, stop), default=1)

    def push(self, token: int) -> str:
        """Add a token; return the text that became safe to send."""
        if self.finish is not None:
            return ""
        if token == self.tokenizer.eot_id:
            ends = "stop"
        else:
            self.ids.append(token)
            tail = self.tokenizer.decode(self.ids[self._final_ids :])
            self.text = self._final_text + tail
            if not tail.endswith("\ufffd"):
                self._final_ids, self._final_text = len(self.ids), self.text
            ends = "length" if len(self.ids) >= self.max_tokens else None
        # A stop string is matched in settled text only: a trailing U+FFFD of an incomplete UTF-8
        # sequence becomes another character with the next token (unless the text ends here). One
        # not found before starts past what was searched, less its own length.
        settled = len(self.text) if ends else len(self.text.rstrip("\ufffd"))
        start = max(0, self._searched - self._longest_stop + 1)
        cuts = [i for s in self.stop if 0 <= (i := self.text.find(s, start)) and i + len(s) <= settled]
        self._searched = settled
        if cuts:
            self.text, self.finish = self.text[: min(cuts)], "stop"
        else:
            self.finish = ends
        safe = len(self.text) if self.finish is not None else len(self.text) - self._held_back()
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return delta

    def _held_back(self) -> int:
        """Trailing characters that may still change: an incomplete UTF-8 sequence (decoded as
        U+FFFD) or the start of a stop string."""
        text = self.text.rstrip("\ufffd")
        partial = len(self.text) - len(text)  # the incomplete character may complete a stop begun before it
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return partial + hold


class Batcher:
    """Queue jobs from any thread; one worker thread decodes them in batches."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        device: torch.device,
        max_batch_size: int = 32,
        batch_wait: float = 0.02,
        pad_to_buckets: bool | None = None,
    ) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_batch_size, self.batch_wait = max_batch_size, batch_wait
        # Unseeded batches grow to a power of two rows (copies of their last prompt, decoded and
        # dropped; never past max_batch_size), so the static CUDA-graph decode compiles one step per
        # bucket, not per batch size: log2(max_batch_size) + 1 of them per cache size. Default:
        # where generate decodes with static steps (CUDA).
        self.pad_to_buckets = (
            default_mode(torch.device(device)) is not None if pad_to_buckets is None else pad_to_buckets
        )
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.in_flight: dict[int, Job] = {}  # by id: submitted and not finished (any thread; under the lock)
        self._lock = threading.Lock()
        self.closing = False  # set by `shut_down`: no job is taken any more
        self.waiting: list[Job] = []  # taken from the queue, not yet decoded (worker thread only)
        self.batches = 0  # batches started (tests and /health read it)
        self.worker = threading.Thread(target=self._run, name="tango-lm-batcher", daemon=True)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.shut_down()
        self.queue.put(None)
        self.worker.join(timeout=30)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closing:
                job.emit(("error", SHUTTING_DOWN, 503))
                return
            self.in_flight[job.id] = job
        self.queue.put(job)

    def shut_down(self) -> None:
        """A server stopping (SIGTERM, Ctrl-C): every job in flight is answered at once with a 503
        and its rows stop decoding, instead of a request cut off with a 500 when the grace period
        ends, and a worker decoding abandoned rows for up to its join's 30 s."""
        with self._lock:
            self.closing = True
            jobs, self.in_flight = list(self.in_flight.values()), {}
        for job in jobs:
            job.cancelled.set()
            job.emit(("error", SHUTTING_DOWN, 503))

    def _finished(self, job: Job) -> None:
        with self._lock:
            self.in_flight.pop(job.id, None)

    # -- worker thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self.waiting:
                job = self.queue.get()
                if job is None:
                    return
                self.waiting.append(job)
                deadline = time.monotonic() + self.batch_wait  # let simultaneous requests arrive
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        job = self.queue.get(timeout=left)
                    except queue.Empty:
                        break
                    if job is None:
                        return
                    self.waiting.append(job)
            while True:  # everything that arrived meanwhile
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                self.waiting.append(job)
            batch = self._take_batch()
            if batch:
                try:
                    self._decode(batch)
                finally:
                    for job in batch:
                        self._finished(job)

    def _take_batch(self) -> list[Job]:
        for job in self.waiting:
            if job.cancelled.is_set():
                self._finished(job)
        self.waiting = [j for j in self.waiting if not j.cancelled.is_set()]
        if not self.waiting:
            return []
        key, batch, rows, rest = self.waiting[0].batch_key(), [], 0, []
        for job in self.waiting:
            if job.batch_key() == key and rows + job.n <= self.max_batch_size:
                batch.append(job)
                rows += job.n
            else:
                rest.append(job)
        self.waiting = rest
        return batch

    def _decode(self, batch: list[Job]) -> None:
        rows = [(job, i, RowText(self.tokenizer, job.stop, job.max_tokens)) for job in batch for i in range(job.n)]
        for job, i, row in rows:  # zero new tokens: nothing to decode
            if job.max_tokens == 0:
                row.finish = "length"
                job.emit(("done", i, "length", 0))
        if all(row.finish for _, _, row in rows):
            return
        first = batch[0]

        def on_token(tokens: torch.Tensor) -> bool:
            for (job, i, row), token in zip(rows, tokens.tolist()[: len(rows)], strict=True):
                if row.finish is not None:
                    continue
                if job.cancelled.is_set():  # the client went away: stop decoding its rows
                    row.finish = "cancelled"
                    continue
                delta = row.push(token)
                if delta:
                    job.emit(("text", i, delta))
                if row.finish is not None:
                    job.emit(("done", i, row.finish, len(row.ids)))
            return all(row.finish is not None for _, _, row in rows)

        prompts = [job.prompt for job, _, _ in rows]
        if self.pad_to_buckets and first.seed is None:
            rows_padded = min(batch_bucket(len(prompts)), max(self.max_batch_size, len(prompts)))
            prompts += [prompts[-1]] * (rows_padded - len(prompts))
        prompt = torch.tensor(prompts, device=self.device)
        self.batches += 1
        try:
            generate(
                self.model,
                prompt,
                max(job.max_tokens for job in batch),
                temperature=first.temperature,
                top_p=first.top_p,
                seed=first.seed,
                on_token=on_token,
                vocab_size=self.tokenizer.vocab_size,
            )
        except Exception as exc:  # noqa: BLE001 - a failed batch answers its requests; the server stays up
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            for job in batch:
                job.emit(("error", f"decoding failed: {first_line}", 500))


SHUTTING_DOWN = "the server is shutting down; send the request again to a running server"


def batch_bucket(rows: int) -> int:
    """The smallest power of two that holds `rows` rows."""
    return 1 << (rows - 1).bit_length()
