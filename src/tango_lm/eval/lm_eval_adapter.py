"""tango-lm checkpoints as an lm-evaluation-harness model (docs/design.md §6: downstream tasks).

    pip install 'tango-lm[eval]'
    tango-lm-eval run --model tango-lm --model_args checkpoint=runs/x --tasks hellaswag
    tango-lm-eval run --model tango-lm --model_args checkpoint=runs/x --include_path my_tasks --tasks my_task

`tango-lm-eval` (or `python -m tango_lm.eval.lm_eval_adapter`) is lm-eval's own command line
(`lm_eval`) with this module imported first. lm-eval
0.4.x finds model classes only in its own registry (`lm_eval.models.MODEL_MAPPING` plus whatever
has been imported), and it resolves `--model` before it imports any task code, so `--include_path`
cannot register a model. In Python, import this module and pass `model="tango-lm"` (or a
`TangoLM(...)` instance) to `lm_eval.simple_evaluate`. The distribution also declares an
`lm_eval.models` entry point, which lm-eval versions with plugin discovery pick up, so there plain
`lm_eval --model tango-lm` works too.

Model arguments (`--model_args key=value,...`):

- `checkpoint` (required; `pretrained` is accepted too): a run directory (its best-dev checkpoint)
  or a `checkpoints/step-*` one.
- `max_length`: scoring window in tokens (default: the run's training sequence length, at most the
  model's context). Longer inputs are cut from the left; `loglikelihood_rolling` slides disjoint
  windows of this length over a document, so every token is predicted exactly once
  (`tango_lm.eval.perplexity.rolling_windows`, the same windows as `tango-lm eval --ppl`).
- `batch_size` (lm-eval's `--batch_size`; `auto` means 16), `device` (lm-eval's `--device`; its
  default `cuda:0` falls back to the CPU on machines without CUDA), `precision`
  (`auto`, `fp32`, `bf16`; default: the run's `train.precision`), `max_gen_toks` (default 256).

Scoring follows lm-eval's conventions: a request's text is the context followed by the
continuation, an empty context is replaced by the end-of-text token, and `loglikelihood` returns
the continuation's summed log-prob and whether greedy decoding reproduces it. MoE models are scored
with their external-evaluation capacity (`capacity_factor_eval`, by default n_experts / moe_top_k,
which drops nothing: 4.0 for the presets).
`generate_until` decodes one request at a time with the model's decode cache (greedy unless
`do_sample` with a temperature > 0), stopping at the end-of-text token, a stop string or
`max_gen_toks`. The prompt is cut from the left to leave `max_gen_toks` positions of the window,
as lm-eval's Hugging Face model cuts it, with `max_gen_toks` capped at half the window (with a
warning) so the prompt keeps the other half; on CUDA its steps are static steps replayed as CUDA graphs (serve/static_decode.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from tango_lm.errors import UserError

logger = logging.getLogger(__name__)

AUTO_BATCH_SIZE = 16


def _int_arg(name: str, value: Any, minimum: int | None = None) -> int:
    """A `--model_args` integer (lm-eval hands them over as strings), at least `minimum`."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be an integer (got {value!r})") from None
    if minimum is not None and number < minimum:
        raise UserError(f"{name} must be at least {minimum} (got {number})")
    return number


def _batch_size(value: Any, max_batch_size: Any = None) -> int:
    """lm-eval passes `--batch_size` as a string: an integer, `auto` or `auto:N`."""
    if value is None:
        return 1
    if isinstance(value, str) and value.startswith("auto"):
        size = AUTO_BATCH_SIZE
        if max_batch_size is not None:
            size = min(size, _int_arg("max_batch_size", max_batch_size, minimum=1))
        return size
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UserError(f"batch_size must be a positive integer or 'auto' (got {value!r})") from None
    if size < 1:
        raise UserError(f"batch_size must be a positive integer or 'auto' (got {value!r})")
    return size


@register_model("tango-lm")
class TangoLM(TemplateLM):
    """An lm-eval model backed by a tango-lm checkpoint (see the module docstring)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        batch_size: int | str | None = 1,
        max_batch_size: int | None = None,
        device: str | None = None,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        precision: str | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        from tango_lm.data.tokenizers import tokenizer_from_dict
        from tango_lm.train.checkpoint import load_checkpoint
        from tango_lm.train.device import autocast_dtype, pick_device

        checkpoint = checkpoint or unused.pop("pretrained", None)  # the name lm-eval's `hf` model uses
        if not checkpoint:
            raise UserError("the tango-lm model needs a checkpoint: --model_args checkpoint=RUN_OR_STEP_DIR")
        for key in unused:
            logger.warning("tango-lm: ignoring model argument %s=%r", key, unused[key])
        ckpt = load_checkpoint(checkpoint)
        self.checkpoint = ckpt
        context = int(ckpt.config["model"]["context_length"])
        self._max_length = _int_arg("max_length", max_length) if max_length is not None else ckpt.trained_length
        if not 1 <= self._max_length <= context:
            raise UserError(
                f"max_length must be between 1 and the model's context of {context} (got {self._max_length})"
            )
        precision = precision or (ckpt.config.get("train") or {}).get("precision", "auto")
        if precision not in ("auto", "fp32", "bf16"):
            raise UserError(f"precision must be auto, fp32 or bf16 (got {precision!r})")
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, minimum=1)  # below 1, every answer was empty
        self._batch_size = _batch_size(batch_size, max_batch_size)
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's --device defaults to cuda:0 whatever the machine has.
            logger.warning("tango-lm: device %s is not available; using %s", device, pick_device("auto"))
            device = None
        self._device = pick_device(device or "auto")
        self.dtype = autocast_dtype(precision, self._device)
        self.model = ckpt.build_model(self._device)
        self.tok = tokenizer_from_dict(ckpt.tokenizer)

    # -- what lm-eval reads --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"tango-lm-{self.tok.name}-{self.tok.fingerprint()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """No chat template: these are base language models (lm-eval's own default raised a
        NotImplementedError traceback for --apply_chat_template)."""
        if chat_template:
            raise UserError(
                "tango-lm models are base language models without a chat template; drop --apply_chat_template "
                "(and --fewshot_as_multiturn)"
            )
        return ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat_template(True) or ""

    def get_model_info(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "tango_lm_checkpoint": str(self.checkpoint.path),
            "tango_lm_step": self.checkpoint.meta.get("step"),
            "tango_lm_arch": cfg.arch,
            "tango_lm_head": cfg.head,
            "tango_lm_max_length": self._max_length,
        }

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.tok.decode(tokens)

    # -- scoring -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _scoring(self) -> Iterator[None]:
        """Eval mode, no grad, autocast, and MoE layers at their external-evaluation capacity."""
        from tango_lm.layers.moe import capacity_factor, moe_layers
        from tango_lm.train.device import autocast

        moe = capacity_factor(self.model, "eval") if moe_layers(self.model) else contextlib.nullcontext()
        self.model.eval()
        with torch.no_grad(), moe, autocast(self._device, self.dtype):
            yield

    def _decode_steps(self, prompt: torch.Tensor, capacity: int):
        from tango_lm.serve.static_decode import default_mode

        return decode_steps(self.model, prompt, default_mode(prompt.device), capacity)

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Summed continuation log-prob and greedy flag per (key, context ids, continuation ids).

        Each input is (context + continuation) cut from the left to `max_length + 1` ids, fed
        without its last id. Requests are batched longest first and padded on the right, which
        leaves every real position unchanged because the model is causal (for MoE only while
        `capacity_factor_eval` >= E / k, its default: below it padding takes expert capacity)."""
        items = []
        for i, (_, context, continuation) in enumerate(requests):
            if len(continuation) > self._max_length:
                raise UserError(
                    f"a continuation of {len(continuation)} tokens is longer than the scoring window "
                    f"max_length={self._max_length}; raise max_length or shorten the task's targets"
                )
            # lm-eval conditions an empty context on end-of-text; a whitespace-only one reaches here
            # empty too (its _encode_pair moves trailing spaces into the continuation).
            ids = ((list(context) or [self.tok.eot_id]) + list(continuation))[-(self._max_length + 1) :]
            items.append((i, ids, len(continuation)))
        items.sort(key=lambda item: -len(item[1]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(items), desc="tango-lm loglikelihood", disable=disable_tqdm or self.rank != 0)
        with self._scoring():
            for start in range(0, len(items), self._batch_size):
                chunk = items[start : start + self._batch_size]
                width = len(chunk[0][1]) - 1
                inputs = torch.zeros(len(chunk), width, dtype=torch.long)
                for row, (_, ids, _) in enumerate(chunk):
                    inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
                logp = self.model(inputs.to(self._device)).float()
                for row, (i, ids, n) in enumerate(chunk):
                    if n == 0:
                        results[i] = (0.0, True)
                        continue
                    end = len(ids) - 1
                    targets = torch.tensor(ids[-n:], device=logp.device)
                    window = logp[row, end - n : end]
                    picked = window.gather(-1, targets[:, None]).squeeze(-1)
                    greedy = window[..., : self.tok.vocab_size].argmax(-1)  # as generate_until draws: no padding row
                    answer = (float(picked.double().sum()), bool((greedy == targets).all()))
                    results[i] = answer
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-prob of each whole text, after the end-of-text token, in disjoint windows of
        `max_length` tokens (the last one moved back to a full window), every token once."""
        from tango_lm.eval.perplexity import document_logprobs

        docs = [self.tok.encode(req.args[0]) for req in requests]
        with self._scoring():
            logps = document_logprobs(
                self.model,
                docs,
                self.tok.eot_id,
                self._max_length,
                None,
                self._batch_size,
                self._device,
                self.dtype,
                progress=not disable_tqdm and self.rank == 0,
                desc="tango-lm loglikelihood_rolling",
            )
        out = []
        for req, lp in zip(requests, logps, strict=True):
            total = float(sum(lp))
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
            out.append(total)
        return out

    # -- generation ----------------------------------------------------------------------------
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        out = []
        warned: set[str] = set()
        for req in tqdm(requests, desc="tango-lm generate_until", disable=disable_tqdm or self.rank != 0):
            context, gen_kwargs = req.args
            text = self._generate_one(context, dict(gen_kwargs or {}), warned)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate_one(self, context: str, kwargs: dict[str, Any], warned: set[str]) -> str:
        from tango_lm.serve.generate import check_sampling, sample_next

        until = kwargs.pop("until", None) or []
        if isinstance(until, str):
            until = [until]
        stops = [s for s in until if s]  # the byte tokenizer decodes end-of-text to ""
        max_new = int(kwargs.pop("max_gen_toks", self._max_gen_toks))
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        if not do_sample:
            temperature = 0.0
        top_k, top_p, seed = kwargs.pop("top_k", None), kwargs.pop("top_p", None), kwargs.pop("seed", None)
        if top_k == 0:  # Hugging Face's (and so lm-eval users') "no top-k"
            top_k = None
        # As `generate` and the server refuse them (a negative temperature sampled the least likely
        # tokens); greedy decoding reads none of them.
        if do_sample:
            check_sampling(temperature, top_k, top_p, max_new, seed)
        for key in kwargs:
            if key not in warned:
                warned.add(key)
                logger.warning("tango-lm: ignoring generation argument %s=%r", key, kwargs[key])
        # The prompt leaves max_gen_toks positions of the window for the answer, as lm-eval's Hugging
        # Face model cuts it, but keeps at least half: lm-eval's default 256 left a model of a 256-token
        # (or shorter) context one token of its prompt.
        if max_new > self._max_length // 2 and "max_gen_toks" not in warned:
            warned.add("max_gen_toks")
            logger.warning(
                "tango-lm: max_gen_toks=%d is over half the %d-token window; generating at most %d tokens "
                "so the prompt keeps the other half",
                max_new,
                self._max_length,
                self._max_length // 2,
            )
        max_new = max(0, min(max_new, self._max_length // 2))
        ids = self.tok.encode(context) or [self.tok.eot_id]
        ids = ids[-(self._max_length - max_new) :]
        if max_new == 0:
            return ""
        generator = torch.Generator(device=self._device).manual_seed(int(seed)) if seed is not None else None
        new: list[int] = []
        with self._scoring():
            step = self._decode_steps(torch.tensor([ids], device=self._device), len(ids) + max_new)
            log_probs = next(step)
            while True:
                drawable = log_probs[..., : self.tok.vocab_size]  # not the table's padding past the tokenizer
                nxt = int(sample_next(drawable, temperature, top_k, top_p, generator)[0])
                if nxt == self.tok.eot_id:
                    break
                new.append(nxt)
                if len(new) == max_new or (stops and any(s in self.tok.decode(new) for s in stops)):
                    break
                log_probs = step.send(nxt)
        return truncate_at_stops(self.tok.decode(new), stops)


def decode_steps(model: torch.nn.Module, prompt: torch.Tensor, mode: str | None, capacity: int):
    """A generator of next-token log-probs [1, V] (fp32): first the prompt's, then, after each
    `send(token)`, that token's. With a static mode (CUDA graphs on CUDA) the steps run on the
    model's static decoder, otherwise on an eager decode cache of `capacity` positions."""
    if mode is None:
        cache = model.new_cache(capacity)
        log_probs = model(prompt, cache)[:, -1]
        while True:
            nxt = yield log_probs.float()
            log_probs = model(torch.tensor([[nxt]], device=prompt.device), cache)[:, -1]
    from tango_lm.serve.static_decode import static_decoder

    decoder = static_decoder(model, 1, mode, capacity)
    h = decoder.prefill(prompt)[:, -1:]
    log_probs = model.head.log_probs(h, prompt[:, -1:])[:, 0]
    idle = torch.full((1, model.config.vocab_size), 0.5, device=prompt.device)  # greedy steps read no noise
    while True:
        nxt = yield log_probs.float()
        _, log_probs = decoder.step(torch.tensor([[nxt]], device=prompt.device), idle, 0.0)


def truncate_at_stops(text: str, stops: list[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    cut = len(text)
    for s in stops:
        at = text.find(s)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


def main() -> None:
    """`tango-lm-eval`: lm-eval's command line with the `tango-lm` model registered."""
    from lm_eval.__main__ import cli_evaluate

    from tango_lm.cli.output import one_line

    try:
        cli_evaluate()
    except UserError as exc:  # a bad checkpoint or model argument: one line, as tango-lm's own commands
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
