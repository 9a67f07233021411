"""Sampling from a trained model with a decode cache: greedy, temperature, top-k and top-p.

On CUDA `generate` decodes with static steps replayed as CUDA graphs (`serve/static_decode.py`);
on CPUs, and with `static=None`, with the eager cached forward below."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from tango_lm.errors import UserError, counted


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | torch.Tensor | None = None
) -> torch.Tensor:
    """Set logits outside the top-k and outside the smallest nucleus of mass top_p to -inf. A
    tensor top_p (the static decode step's, so that a new value is no new graph) always filters."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if isinstance(top_p, torch.Tensor) or (top_p is not None and top_p < 1.0):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p. The first always stays, also
        # when top_p is below float32's smallest number (1e-300 compares as 0 >= 0).
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    log_probs: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from log-probs [B, V]; temperature 0 is greedy."""
    if temperature == 0:
        return log_probs.argmax(-1)
    logits = filter_logits(log_probs / temperature, top_k, top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


MIN_TEMPERATURE = 1e-4  # below it sampling is greedy in all but name, and logits / T overflow float32
MAX_TEMPERATURE = torch.finfo(torch.float32).max  # the static decode step holds it in float32


def is_seed(seed: object) -> bool:
    """Whether `seed` is what torch.Generator.manual_seed takes: an integer in [-2**63, 2**64) (any
    integer type; `x in range(...)` walked the range one by one for a float or a NumPy integer)."""
    return isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and -(2**63) <= int(seed) < 2**64


def _is_count(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    max_new_tokens: int = 0,
    seed: int | None = None,
) -> None:
    """UserError for sampling settings that cannot be honoured (NaN, tiny or negative temperature, ...)."""
    # At most MAX_TEMPERATURE: 1e39 raised in the static decode step.
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise UserError(
            f"temperature must be 0 (greedy decoding) or a number from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:.4g} "
            f"(got {temperature!r})"
        )
    if top_k is not None and not (_is_count(top_k) and top_k >= 1):
        raise UserError(
            f"top_k must be a whole number of at least 1 (got {top_k!r}); leave it out to sample from every token"
        )
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1] (got {top_p})")
    if not (_is_count(max_new_tokens) and max_new_tokens >= 0):
        raise UserError(
            f"max_new_tokens (--max-new-tokens) must be a whole number of at least 0 (got {max_new_tokens!r})"
        )
    if seed is not None and not is_seed(seed):
        raise UserError(f"seed must be a whole number between -2**63 and 2**64 - 1 (got {seed!r})")


def room_for_new_tokens(prompt_tokens: int, context_length: int) -> int:
    """How many tokens a prompt can be continued by: the model reads the prompt and every new
    token but the last, at most `context_length` positions."""
    return context_length - prompt_tokens + 1


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
    on_token: Callable[[torch.Tensor], bool] | None = None,
    static: str | None = "auto",
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Continue prompt [B, T] by up to max_new_tokens; returns [B, T + n] (rows stop early only
    when every row has produced eos_id). The last new token is never fed back, so a prompt of
    the whole context still gets one (`room_for_new_tokens`). `on_token(tokens [B])` sees each
    step's tokens as they are drawn (streaming); when it returns True, decoding stops there.
    `static`: "auto" (CUDA graphs on CUDA, the eager decode elsewhere), None (the eager decode),
    or a `serve.static_decode` mode ("eager", "compile", "cuda-graphs"); streaming (`on_token`)
    works with both. Static and eager decoding draw their random numbers differently, so a seed
    gives the same samples within one of them (greedy tokens agree). `vocab_size`: draw only ids
    below it, the tokenizer's vocabulary (a model's table is often padded past it, 50257 -> 50304,
    and an id there has no text); None draws from the whole table."""
    check_sampling(temperature, top_k, top_p, max_new_tokens, seed)
    if vocab_size is not None and not (_is_count(vocab_size) and vocab_size >= 1):
        raise UserError(
            f"vocab_size must be a whole number of at least 1 (got {vocab_size!r}), or None for the whole table"
        )
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise UserError(
            f"the prompt must be token ids of shape [batch, length] with length >= 1 (got shape {tuple(prompt.shape)}); "
            "add a batch dimension with prompt[None] or start from the end-of-text token"
        )
    if top_p == 1:  # the whole distribution, as no top_p (and as the server reads it): the same draws
        top_p = None
    room = room_for_new_tokens(prompt.shape[1], model.config.context_length)
    if prompt.shape[1] > model.config.context_length:  # said so, not "room for 0 new tokens (asked for 0)"
        raise UserError(
            f"a prompt of {prompt.shape[1]} tokens is longer than the model's context of "
            f"{model.config.context_length} tokens; shorten it"
        )
    if max_new_tokens > room:
        raise UserError(
            f"a prompt of {counted(prompt.shape[1], 'token')} leaves room for {counted(max(room, 0), 'new token')} "
            f"in the model's context of {model.config.context_length:,} (asked for {max_new_tokens:,}); shorten the prompt or lower --max-new-tokens"
        )
    total = prompt.shape[1] + max(max_new_tokens - 1, 0)  # positions the model reads
    generator = None
    if seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(int(seed))
    from tango_lm.serve.static_decode import MODES, decode_static, default_mode

    if static not in (None, "auto", *MODES):
        raise UserError(f"static must be None, 'auto' or one of {', '.join(map(repr, MODES))} (got {static!r})")
    mode = default_mode(prompt.device) if static == "auto" else static
    was_training = model.training  # sampling mid-training must not leave the model in eval mode
    model.eval()
    try:
        with model.head.serving():
            if mode is not None and max_new_tokens > 0:
                return decode_static(
                    model,
                    prompt,
                    max_new_tokens,
                    temperature,
                    top_k,
                    top_p,
                    generator,
                    eos_id,
                    mode,
                    on_token,
                    vocab_size,
                )
            return _decode(
                model, prompt, max_new_tokens, total, temperature, top_k, top_p, generator, eos_id, on_token, vocab_size
            )
    finally:
        model.train(was_training)


def _decode(
    model, prompt, max_new_tokens, total, temperature, top_k, top_p, generator, eos_id, on_token=None, vocab_size=None
) -> torch.Tensor:
    cache = model.new_cache(total)
    # Untruncated temperature-1 sampling from a mixture head needs only one of its projections per
    # position (onóna, seed 001 Appendix B): the head samples from the hidden state directly.
    one_projection = temperature == 1 and top_k is None and top_p is None and model.head.one_projection_sampling

    def step(ids: torch.Tensor) -> torch.Tensor:
        h = model.hidden(ids, cache)[:, -1:]  # a prompt's earlier positions need no log-probs
        if one_projection:
            return h
        return model.head.log_probs(h, ids[:, -1:])[:, 0, :vocab_size]  # the ids that may be drawn

    state = step(prompt)
    last = prompt[:, -1:]
    out = [prompt]
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if one_projection:
            nxt = model.head.sample(state, last, generator, vocab_size).reshape(-1)
        else:
            nxt = sample_next(state, temperature, top_k, top_p, generator)
        last = nxt[:, None]
        out.append(last)
        if stop_after(nxt, on_token, eos_id, done):
            break
        if len(out) - 1 == max_new_tokens:
            break
        state = step(last)
    return torch.cat(out, dim=1)


def stop_after(
    tokens: torch.Tensor, on_token: Callable[[torch.Tensor], bool] | None, eos_id: int | None, done: torch.Tensor
) -> bool:
    """Both decode loops' check after a step's tokens [B]: hand them to `on_token` (True: stop), and
    stop once every row has drawn `eos_id` (`done` [B] is updated in place)."""
    if on_token is not None and on_token(tokens):
        return True
    if eos_id is None:
        return False
    done |= tokens == eos_id
    return bool(done.all())
