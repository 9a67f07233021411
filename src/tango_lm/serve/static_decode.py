"""Static-shape decoding (gpt-fast's scheme): one decode step with the same shapes and tensor
addresses every time, compiled once and, on CUDA, replayed as a CUDA graph.

A `StaticDecoder` holds one decode cache for one batch size and capacity and reuses it for every
request; `static_decoder` keeps one per (batch, capacity bucket), the capacity rounded up to a power
of two (at most the context length), since every step attends over the whole buffer and TANGO's
cache holds F gate channels per position. A request runs in three parts:

1. Prefill: the prompt goes through the ordinary cached forward (eager, any length); the cache's
   buffers are the decoder's own, preallocated to the context length.
2. `DecodeCache.begin_static`: the position becomes a device tensor [1]; mixers whose eager state
   has a varying size (FLASH's current group, windowed TANGO's window) copy it into a fixed-size
   layout (their `enter_static(state, position)`), and the other fixed-size state moves to persistent tensors.
3. Steps: `_step` embeds one token per row, runs the backbone (attention over the full-capacity
   buffers, masked past the position; every state updated in place), the head and the sampler, and
   the decoder advances the position tensor in place. `decode_static` hands each step's tokens to
   `on_token` when one streams them (the server), and stops when it returns True; on CUDA it reads
   them one step late (`HostTokens`: the next step is queued first), so the GPU never waits for the host.

Sampling happens inside the step from uniform noise drawn outside it with the caller's generator
(so a seed reproduces the tokens, with or without compilation): greedy is the argmax, temperature
sampling the Gumbel-max argmax of the (top-k / top-p filtered) scaled log-probs, an exact sample
of the softmax; onóna's untruncated temperature-1 sampling draws the component from the noise and
projects through that table only (`OnonaHead.sample_static`), in the same graph.

Modes: "eager" (the static step uncompiled: what the tests compare), "compile" (torch.compile, no
CUDA graphs) and "cuda-graphs" (`mode="reduce-overhead"`, the default on CUDA); `backend` is torch.compile's
(the tests trace with Dynamo's "eager" backend, which checks the same single graph cheaply). If compiling or
running the compiled step fails, the decoder logs one line and runs the step eagerly from then on.
The plain eager decode (`serve/generate.py`) stays the path on CPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tango_lm.errors import UserError
from tango_lm.layers.active_width import active_columns
from tango_lm.serve.generate import filter_logits, stop_after

log = logging.getLogger(__name__)

MODES = ("eager", "compile", "cuda-graphs")
# Each decoder (model, batch size, capacity) and the sampling options that shape its graph (greedy
# or not is one graph; top_p is a tensor, so its value is none; top_k, one projection) is one
# entry of the step's cache, which the decoders of the process share.
RECOMPILE_LIMIT = 64
MAX_DECODERS = 8  # decoders kept per model (`static_decoder`), each with its own preallocated cache


def default_mode(device: torch.device) -> str | None:
    """The static mode `generate` uses by default: CUDA graphs on CUDA, none (the eager decode) elsewhere."""
    return "cuda-graphs" if device.type == "cuda" else None


def sample_from_noise(
    log_probs: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: int | None = None,
    top_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of log_probs [B, V] with uniform noise [B, V]: the argmax where the
    temperature [] is 0, else the Gumbel-max argmax of the filtered log_probs / temperature (an
    exact sample of their softmax). No host sync and no branch on the temperature."""
    greedy = temperature == 0
    scaled = filter_logits(log_probs / torch.where(greedy, 1.0, temperature), top_k, top_p)
    gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(noise.dtype).tiny)))
    return torch.where(greedy, log_probs, scaled + gumbel).argmax(-1)


class StaticDecoder:
    """Static decode steps of one model for one batch size (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        mode: str = "eager",
        backend: str = "inductor",
        capacity: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"static decode mode must be one of {MODES}, got {mode!r}")
        self.model, self.batch, self.mode = model, batch, mode
        self.cache = model.new_cache(capacity)
        self.device = next(model.parameters()).device
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.length = 0  # the position on the host (the tensor is never read back)
        # Prefills so far: a caller that keeps this decoder's cache past its request (the Hugging Face
        # export's TangoLMCache) compares it to tell whether another request has prefilled it since.
        self.prefills = 0
        self._compiled = None
        self.compiled_failed = False
        if mode != "eager":
            options = {"mode": "reduce-overhead"} if mode == "cuda-graphs" else {}
            self._compiled = torch.compile(self._step, backend=backend, dynamic=False, fullgraph=True, **options)

    # -- a request -------------------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Run the prompt [B, T] through the eager cached forward, then switch to static steps.
        Returns the prompt's final-normed hidden states [B, T, d]."""
        if prompt.shape[0] != self.batch:
            raise ValueError(f"this decoder serves batches of {self.batch}, got {prompt.shape[0]}")
        self.prefills += 1
        self.cache.reset()
        h = self.model.hidden(prompt, self.cache)
        backbone = self.model.backbone
        for application, index in enumerate(backbone.schedule):
            state = self.cache.states[application]
            for module in backbone.layers[index].modules():
                hook = getattr(module, "enter_static", None)
                if hook is not None:
                    hook(state, self.cache.position)
            for name, value in state.extra.items():  # the remaining (fixed-size) state: persistent copies
                kept = state.static.get(name)
                if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
                    state.static[name] = value.clone()
                else:
                    kept.copy_(value)
        self.length = self.cache.position
        self.position.fill_(self.length)
        self.cache.begin_static(self.position)
        # The head's serving fold (onóna's), made here from the weights as they are, before a step
        # (compiled, it must not make it) reads it
        folded = self.model.head.serving_tensors()
        if self.mode == "cuda-graphs":  # the graph reads these in place: no copies into its inputs
            for state in self.cache.states:
                for t in (*state.buffers.values(), *state.static.values()):
                    torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static_address(self.position)
            for t in folded:
                torch._dynamo.mark_static_address(t)
        return h

    def step(
        self,
        ids: torch.Tensor,
        noise: torch.Tensor,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        one_projection: bool = False,
        vocab_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ids [B, 1] at the current position and sample the next token per row from noise
        [B, V] ([B, V + 1] for one projection), only ids below `vocab_size` (None: any); returns
        (tokens [B], log-probs [B, V] or None for one-projection sampling) and advances the position."""
        if self.length >= self.cache.capacity:
            raise UserError(
                f"sequence of {self.length + 1} tokens is longer than this decoder's cache of {self.cache.capacity} "
                f"positions (model.context_length={self.model.config.context_length}); shorten it or make a decoder "
                "with a larger capacity"
            )
        temp = torch.full((), float(temperature), device=self.device)
        # a tensor: every top_p (a server passes each request's) compiled a graph of its own
        nucleus = None if top_p is None else torch.full((), float(top_p), device=self.device)
        args = (ids, noise, temp, top_k, nucleus, one_projection, vocab_size)
        if self._compiled is not None and not self.compiled_failed:
            try:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    tokens, log_probs = self._compiled(*args)
                tokens = tokens.clone()  # a CUDA graph's outputs are overwritten by its next replay
                log_probs = log_probs.clone() if log_probs is not None else None
            except Exception as exc:  # noqa: BLE001 - any failure of the compiled step: decode eagerly
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                log.warning(
                    "static decode (%s) failed, decoding eagerly from here on: %s: %s",
                    self.mode,
                    type(exc).__name__,
                    first[:200],
                )
                self.compiled_failed = True
                tokens, log_probs = self._step(*args)
        else:
            tokens, log_probs = self._step(*args)
        self.position.add_(1)
        self.length += 1
        return tokens, log_probs

    @torch.no_grad()
    def _step(self, ids, noise, temperature, top_k, top_p, one_projection, vocab_size=None):
        model = self.model
        h = model.norm(model.backbone(model.head.embed(ids), self.cache))
        if one_projection:
            return model.head.sample_static(h[:, 0], ids[:, 0], noise, vocab_size), None
        log_probs = model.head.log_probs(h, ids)[:, 0]
        drawn = sample_from_noise(log_probs[:, :vocab_size], noise[:, :vocab_size], temperature, top_k, top_p)
        return drawn, log_probs


def decode_static(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    eos_id: int | None,
    mode: str,
    on_token: Callable[[torch.Tensor], bool] | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`generate`'s loop on static steps (inside the head's serving context): [B, T + n].
    `on_token(tokens [B])` sees each step's tokens (a copy the next step does not overwrite; on
    CUDA a host copy, read while the next step runs: `HostTokens`); when it returns True decoding
    stops there. The loop reads back to the host only what those stop checks need."""
    decoder = static_decoder(model, prompt.shape[0], mode, prompt.shape[1] + max_new_tokens - 1)
    one_projection = temperature == 1 and top_k is None and top_p is None and model.head.one_projection_sampling
    width = model.config.vocab_size + (1 if one_projection else 0)
    rows = prompt.shape[0]
    idle = torch.full((rows, width), 0.5, device=prompt.device)  # greedy reads no noise

    def noise() -> torch.Tensor:
        if temperature == 0:
            return idle
        return torch.rand(rows, width, generator=generator, device=prompt.device)

    h = decoder.prefill(prompt)[:, -1:]
    if one_projection:
        nxt = model.head.sample_static(h[:, 0], prompt[:, -1], noise(), vocab_size)
    else:
        log_probs = model.head.log_probs(h, prompt[:, -1:])[:, 0, :vocab_size]
        temp = torch.tensor(float(temperature), device=prompt.device)
        nxt = sample_from_noise(log_probs, noise()[:, :vocab_size], temp, top_k, top_p)

    def step() -> torch.Tensor:
        return decoder.step(nxt[:, None], noise(), temperature, top_k, top_p, one_projection, vocab_size)[0]

    host = HostTokens(rows, prompt.device, on_token, eos_id)
    host.stage(nxt)
    out = [prompt]
    for i in range(max_new_tokens):
        out.append(nxt[:, None])
        last = i + 1 == max_new_tokens
        ahead = step() if host.late and not last else None  # queued before the host reads this step's tokens
        if host.stop() or last:
            break  # a step run ahead is dropped
        nxt = ahead if ahead is not None else step()
        host.stage(nxt)
    return torch.cat(out, dim=1)


def reads_one_step_late(device: torch.device) -> bool:
    """Whether `HostTokens` reads a step's tokens after the next step is queued: on CUDA, where the
    GPU would otherwise idle while the host reads them and launches the next step."""
    return device.type == "cuda"


class HostTokens:
    """The host's reads of the decode loop (the stop checks: `on_token`, and every row at `eos_id`)
    without stalling the GPU. `stage(tokens)` queues their copy to pinned host memory behind the
    step that drew them; `stop()` waits for that copy alone and runs `stop_after` on it. Where
    `late` (CUDA) the loop queues the next step between the two, so the GPU runs it while the host
    reads; a decode that stops there drops that one step. Nothing is read when nothing is checked."""

    def __init__(
        self, rows: int, device: torch.device, on_token: Callable[[torch.Tensor], bool] | None, eos_id: int | None
    ) -> None:
        self.on_token, self.eos_id = on_token, eos_id
        self.needed = on_token is not None or eos_id is not None
        self.late = self.needed and reads_one_step_late(device)
        self.cuda = device.type == "cuda"
        self.done = torch.zeros(rows, dtype=torch.bool)
        self.staged: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def stage(self, tokens: torch.Tensor) -> None:
        if not self.needed:
            return
        if not self.cuda:
            self.staged = tokens.cpu()  # the same tensor on a CPU; `done` lives on the host
            return
        self.staged = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.staged.copy_(tokens, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def stop(self) -> bool:
        if not self.needed:
            return False
        if self.copied is not None:
            self.copied.synchronize()
        return stop_after(self.staged, self.on_token, self.eos_id, self.done)


def capacity_bucket(positions: int, context_length: int) -> int:
    """The cache capacity for `positions`: the next power of two (at least 64), at most the context."""
    return min(context_length, max(64, 1 << max(positions - 1, 0).bit_length()))


def static_decoder(model: torch.nn.Module, batch: int, mode: str, positions: int | None = None) -> StaticDecoder:
    """The model's decoder for this batch size, mode and the capacity bucket of `positions` (None:
    the context length), built once and kept on the model (a new one after the model moves to
    another device or dtype, or another segment of rotating narrow width becomes active). At most
    `MAX_DECODERS` are kept, the least recently used dropped first: each holds a whole decode
    cache, and a server meets many batch sizes."""
    context = model.config.context_length
    capacity = capacity_bucket(positions, context) if positions is not None else context
    param = next(model.parameters())
    # Rotating narrow width: a decoder's buffers hold the active segment's gate columns.
    segment = next((c.segment for c in active_columns(model)), None)
    key = (batch, capacity, mode, param.device, param.dtype, segment)
    decoders = model.__dict__.setdefault("_static_decoders", {})
    decoder = decoders.pop(key, None)
    if decoder is None:
        while len(decoders) >= MAX_DECODERS:
            del decoders[next(iter(decoders))]  # the least recently used (dicts keep insertion order)
        decoder = StaticDecoder(model, batch, mode, capacity=capacity)
    decoders[key] = decoder  # the most recently used last
    return decoder
