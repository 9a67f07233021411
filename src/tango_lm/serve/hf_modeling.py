"""A tango-lm model as a Hugging Face transformers causal LM (remote code).

`tango-lm export CHECKPOINT --hf DIR` copies this file into DIR as `modeling_tango_lm.py`, and
`config.json`'s `auto_map` points `AutoConfig` and `AutoModelForCausalLM` at the two classes
below, so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

loads the model offline. The file builds the network with the installed `tango_lm` package
instead of carrying a copy of it: one implementation of every architecture and head, at the cost
that loading needs `pip install tango-lm` (of a version that knows the exported config).

- `forward(input_ids, labels=None)` returns `logits` [B, T, V]: the model's normalized next-token
  log-probs (fp32), which are valid logits (softmax gives back the same distribution), and with
  `labels` the mean next-token NLL over labels != -100 (labels are shifted inside, as in every
  transformers causal LM).
- `generate()` runs on tango-lm's own decode cache (`TangoLMCache`, a `DecodeCache` behind the few
  attributes transformers reads): each step feeds only the tokens the cache has not seen, so
  greedy `generate()` gives the tokens of `tango-lm generate --temperature 0`. `use_cache=False`
  recomputes the whole prefix every step (same tokens, slower). Beam search reorders the cache.
  On CUDA the steps after the prompt are tango-lm's static decode steps replayed as CUDA graphs
  (`tango_lm.serve.static_decode`; the same log-probs as the eager cache). Their decoder is kept on
  the model, one per batch size: a cache kept past a later request of that size is read again
  from the start when `generate()` continues it.
- `forward(ids, use_cache=True)` returns a new cache as `past_key_values` to continue with; left
  unset, a plain forward keeps none. `generate(do_sample=True)` samples the whole distribution
  (top_k 0 unless one is given), not transformers' default top 50.
- MoE models run at `capacity_factor_eval` (tango-lm's external-evaluation capacity) outside
  training, so the cached and uncached paths agree (at its default, E / k, which drops nothing).
- Padding is not supported (the model takes no attention mask): batch prompts of equal length or
  generate one prompt at a time.
"""

import contextlib
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 passes the cache between generation steps as `cache`, 4 as `past_key_values`.
CACHE_NAME = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


class TangoLMConfig(PretrainedConfig):
    """The tango-lm `ModelConfig` (as a dict, `tango_config`) plus the token ids generation needs."""

    model_type = "tango_lm"

    def __init__(self, tango_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.tango_config = dict(tango_config or {})
        cfg = self.tango_config
        self.vocab_size = cfg.get("vocab_size")
        self.hidden_size = cfg.get("d_model")
        self.num_hidden_layers = cfg.get("depth")
        self.max_position_embeddings = cfg.get("context_length")
        kwargs.setdefault("tie_word_embeddings", False)  # the head owns its tables; nothing to tie
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)


class TangoLMCache:
    """tango-lm's `DecodeCache` with the attributes transformers' `generate()` reads."""

    is_compileable = False
    is_croppable = False

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self.static: Any = None  # a tango_lm StaticDecoder once a CUDA request has been prefilled
        self.static_position = 0
        self.static_prefill = 0  # which of its prefills was this cache's

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def position(self) -> int:
        return self.static_position if self.static is not None else self.decode.position

    def lost_static(self) -> bool:
        """Whether this cache's static decoder (kept on the model, one per batch size) was prefilled
        since by another request, which overwrote the tensors this cache reads."""
        return self.static is not None and self.static.prefills != self.static_prefill

    def restart(self, decode: Any) -> None:
        """Empty again, on `decode` (a fresh eager cache): the next call prefills the whole sequence."""
        self.decode, self.static, self.static_position = decode, None, 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.position

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the rows `beam_idx` (beam search): every cached tensor is batch-first (in place
        for a static decoder, whose tensors keep their addresses)."""
        for state in self.decode.states:
            for group in (state.buffers, state.extra, state.static):
                for name, t in group.items():
                    rows = t.index_select(0, beam_idx.to(t.device))
                    if self.static is not None:
                        t.copy_(rows)
                    else:
                        group[name] = rows


class TangoLMForCausalLM(PreTrainedModel, GenerationMixin):
    """The tango-lm `LanguageModel` under `self.model` (state-dict keys `model.backbone...`,
    `model.head...`)."""

    config_class = TangoLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_cache_class = False  # transformers 4: no DynamicCache; the cache comes from prepare_inputs
    _no_split_modules: list[str] = []

    def __init__(self, config: TangoLMConfig) -> None:
        super().__init__(config)
        from tango_lm.layers.moe import moe_layers
        from tango_lm.models.config import ModelConfig
        from tango_lm.models.model import build_model

        self.model = build_model(ModelConfig.from_dict(dict(config.tango_config)))
        self._has_moe = bool(moe_layers(self.model))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """tango-lm's modules initialize themselves; loaded weights replace them anyway."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # transformers 5: generate() must not make a DynamicCache for this model

    def new_cache(self) -> TangoLMCache:
        return TangoLMCache(self.model.new_cache())

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: TangoLMCache | None = None,
        past_key_values: TangoLMCache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        if input_ids is None:
            raise ValueError("tango-lm models take input_ids (inputs_embeds is not supported)")
        state = cache if cache is not None else past_key_values
        if state is not None and not isinstance(state, TangoLMCache):
            raise TypeError(
                f"tango-lm models use their own decode cache (TangoLMCache from model.new_cache()), "
                f"not {type(state).__name__}"
            )
        if state is None and use_cache is True and not self.training:
            # Asked for one (as transformers' models are): a cache to pass back with the next tokens.
            # Left None (the config's use_cache), a plain forward keeps none: scoring stays cache-free.
            state = self.new_cache()
        if state is not None and state.lost_static():
            raise ValueError(
                "this cache's static decoder served another request since (its tensors are that request's "
                f"now); continue with generate(..., {CACHE_NAME}=cache), which recomputes it, or a new cache"
            )
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "tango-lm models do not support padding: give prompts of equal length, one batch "
                "per length, or one prompt at a time"
            )
        from tango_lm.layers.moe import capacity_factor

        # MoE layers outside training run at their evaluation capacity, with or without the cache.
        moe = capacity_factor(self.model, "eval") if self._has_moe and not self.training else contextlib.nullcontext()
        with moe:
            if state is not None and self._static_mode(input_ids, state) is not None:
                logits = self._static_forward(input_ids, state)
            else:
                logits = self.model(input_ids, state.decode if state is not None else None)
        loss = None
        if labels is not None:
            loss = F.nll_loss(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        if return_dict is False:
            out = (logits, state) if state is not None else (logits,)
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: state})

    def _static_mode(self, input_ids: torch.Tensor, state: TangoLMCache) -> str | None:
        """The static decode mode for this call: CUDA graphs on CUDA outside training, for a fresh
        cache or one already decoding statically; None: the eager cache."""
        from tango_lm.serve.static_decode import default_mode

        if self.training or torch.is_grad_enabled() or (state.static is None and state.decode.position != 0):
            return None
        return default_mode(input_ids.device)

    def _static_forward(self, input_ids: torch.Tensor, state: TangoLMCache) -> torch.Tensor:
        """Log-probs [B, T, V]: a prefill on the model's static decoder, then static steps."""
        from tango_lm.serve.static_decode import static_decoder

        if state.static is None:
            decoder = static_decoder(self.model, input_ids.shape[0], self._static_mode(input_ids, state))
            h = decoder.prefill(input_ids)
            state.static_prefill = decoder.prefills  # a later prefill, by any caller, takes it over (lost_static)
            state.static, state.decode, state.static_position = decoder, decoder.cache, input_ids.shape[1]
            return self.model.head.log_probs(h, input_ids)
        idle = torch.full((input_ids.shape[0], self.model.config.vocab_size), 0.5, device=input_ids.device)
        steps = []
        for i in range(input_ids.shape[1]):  # generate() feeds one token per step
            steps.append(state.static.step(input_ids[:, i : i + 1], idle, 0.0)[1])
            state.static_position += 1
        return torch.stack(steps, 1)

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None, **kwargs: Any) -> Any:
        """transformers' generate(), refusing up front a length past the model's context (the
        forward refused it only once the sequence had grown there, after that many steps)."""
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        config = generation_config if generation_config is not None else self.generation_config
        # Sampling draws from the whole distribution, as `tango-lm generate` does, where the caller
        # left top_k at the library's default (None in transformers 5, which then samples the top 50;
        # 50 itself in 4.x). Not in the generation config: there, with do_sample false,
        # transformers warns of it, and 4.x refuses to save it.
        unset = getattr(config, "top_k", None) == getattr(type(config)(), "top_k", None)
        if kwargs.get("do_sample", config.do_sample) and "top_k" not in kwargs and unset:
            kwargs["top_k"] = 0
        context = self.config.max_position_embeddings
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and context:
            new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
            length = ids.shape[1] + new if new is not None else kwargs.get("max_length", config.max_length)
            # The last new token is never fed back: context + 1 tokens fit, as in `tango-lm generate`.
            if ids.shape[1] > context:  # no max_new_tokens helps: transformers refuses 0
                raise ValueError(
                    f"a prompt of {ids.shape[1]} tokens is longer than the model's context of {context}; shorten it"
                )
            if length is not None and length - 1 > context:
                raise ValueError(
                    f"generating to {length} tokens (a prompt of {ids.shape[1]}) passes the model's context of "
                    f"{context}; give max_new_tokens of at most {max(context - ids.shape[1] + 1, 0)}"
                )
        return super().generate(inputs, generation_config, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Feed only the tokens the decode cache has not processed (all of them without a cache)."""
        inputs: dict[str, Any] = {"attention_mask": attention_mask}
        if use_cache is False:
            return {**inputs, "input_ids": input_ids, "use_cache": False}
        state = kwargs.get("cache")
        if state is None:
            state = kwargs.get("past_key_values")
        if state is None:
            state = self.new_cache()
        elif not isinstance(state, TangoLMCache):
            raise TypeError(
                f"tango-lm models use their own decode cache, not {type(state).__name__}; "
                "call generate() without one (or with model.new_cache())"
            )
        elif state.lost_static():  # another request's prefill took its decoder: read the whole sequence again
            state.restart(self.model.new_cache())
        return {**inputs, "input_ids": input_ids[:, state.position :], CACHE_NAME: state, "use_cache": True}


# transformers 5's AutoTokenizer builds the model config before it reads tokenizer_config.json, so
# for a remote-code config it asks whether to run the code (and, answered "no" or with stdin closed,
# logs "You are using a model of type `tango_lm` to instantiate a model of type ``"). Registering the
# model type when this module runs (an export loaded with trust_remote_code=True, or `import
# tango_lm.serve.hf_modeling`) makes `tango_lm` a known type for the rest of the process: both Auto
# classes then load an export without trust_remote_code, without a prompt or that warning.
try:
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(TangoLMConfig.model_type, TangoLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(TangoLMConfig, TangoLMForCausalLM, exist_ok=True)
except (ImportError, ValueError):  # a transformers without these registries: loading still works with remote code
    pass
