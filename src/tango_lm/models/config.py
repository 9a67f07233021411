"""`ModelConfig`: the single source of truth for a model (docs/design.md §7).

Checkpoints store it, `params` and `match` read it, reports print it. Validation happens in
`validate()`, which raises `UserError` with one sentence naming the bad field and the fix.
"""

from __future__ import annotations

import dataclasses
import datetime
import numbers
from dataclasses import dataclass
from typing import Any

from tango_lm.config_checks import check_finite, check_model_numbers
from tango_lm.errors import UserError, did_you_mean

HEAD_DIM = 32  # ModelConfig.head_dim's default, the TANGO paper's d_h


def _check_heads_agree(heads: int, head_dim: int, d_model: int) -> None:
    if heads * head_dim != d_model:
        raise UserError(
            f"model.n_heads={heads} heads of head_dim={head_dim} are {heads * head_dim} channels, not "
            f"d_model={d_model}; give two of d_model, n_heads and head_dim (or three that agree)"
        )


@dataclass(kw_only=True)
class ModelConfig:
    """Every field of every architecture; each architecture reads the ones it needs.

    `n_heads` None means `d_model // head_dim` (the TANGO paper's d_h = 32); when given,
    `head_dim` follows from it, and a head_dim other than 32 that disagrees is refused. `width`
    is F: the gate width of TANGO, the FFN width of Transformer++.
    """

    arch: str = "tango"
    head: str = "standard"
    d_model: int = 256
    n_heads: int | None = None
    n_kv_heads: int | None = None
    head_dim: int = HEAD_DIM
    width: int = 1024
    depth: int = 4
    vocab_size: int = 50257
    context_length: int = 1024
    window: int = 64  # windowed TANGO: exact scores for the last `window` sources
    feature_map: str = "elu+1"  # windowed TANGO: positive feature map for older sources
    controller_width: int | None = None  # compact-controller TANGO: r (default d_model)
    qk_dim: int = 128  # GAU / FLASH: s, the shared query/key width
    group_size: int = 256  # FLASH: g, the quadratic attention group
    gau_norm: str = "rmsnorm"  # GAU / FLASH: rmsnorm (design.md §2.7) | layernorm (with a bias: +d per layer)
    active_width: int | None = None  # rotating narrow-width training: K active columns per head / FFN
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    loss_chunk: int = 1024  # positions per chunk of the fused loss: never more than chunk x V logits at once
    # -- onóna-paper backbones (docs/design.md §4): dense, gdn-hybrid, moe, attnres ----------------------
    # Their attention layers are GQA with QK-norm: `n_kv_heads` above (None: n_heads).
    attention_every: int = 4  # gdn-hybrid: every 4th layer is full attention (3 GDN : 1); 0 = GDN only
    gdn_head_dim: int = 128  # gdn-hybrid: key width per GDN head
    gdn_n_heads: int | None = None  # gdn-hybrid: GDN heads (default d_model // gdn_head_dim)
    gdn_expand_v: float = 1.0  # gdn-hybrid: value width per head = gdn_head_dim * gdn_expand_v
    conv_size: int = 4  # gdn-hybrid: causal depthwise short-convolution kernel on q, k, v
    gdn_chunk: int = 64  # gdn-hybrid: chunk length of the chunkwise-parallel delta rule
    gdn_backend: str = "auto"  # gdn-hybrid: auto (fla's kernels on CUDA if installed) | torch | fla
    n_experts: int = 8  # moe: routed SwiGLU experts per layer
    moe_top_k: int = 2  # moe: experts per token
    moe_expert_width: int | None = None  # moe: expert SwiGLU width (default width // moe_top_k: k experts = F)
    moe_renormalize: bool = True  # moe: rescale the top-k router probabilities to sum to 1
    capacity_factor_train: float = 1.25  # moe: expert capacity in training and validation
    # moe: expert capacity in external evaluation and cached decoding; None: n_experts / moe_top_k, which
    # never drops a token (4.0 for 8 experts, top-2: the paper's), so scores and decoding do not depend on batch mates
    capacity_factor_eval: float | None = None
    aux_loss_weight: float = 0.01  # moe: alpha of the load-balancing loss alpha * E * sum_i f_i P_i
    attnres_block: int | None = None  # attnres: layers summed per block (Block AttnRes); None or 0 = full

    def __post_init__(self) -> None:
        self.validate()

    # -- derived ----------------------------------------------------------------------------
    def validate(self) -> None:
        """Check types and the constraints every architecture shares; fill derived fields."""
        from tango_lm.heads.registry import HEADS
        from tango_lm.models.registry import ARCHITECTURES

        for f in dataclasses.fields(self):
            setattr(self, f.name, check_type(f"model.{f.name}", getattr(self, f.name), f.type, f.default))
        if self.arch not in ARCHITECTURES:
            raise UserError(
                f"unknown architecture {self.arch!r}{did_you_mean(self.arch, ARCHITECTURES)}; "
                f"choose one of: {', '.join(sorted(ARCHITECTURES))}"
            )
        if self.head not in HEADS:
            raise UserError(
                f"unknown head {self.head!r}{did_you_mean(self.head, HEADS)}; choose one of: {', '.join(sorted(HEADS))}"
            )
        if self.active_width is not None and not ARCHITECTURES[self.arch].rotating_width:
            raise active_width_unsupported(self.arch)  # here, not at build: params, match and sweeps check configs
        for name in ("d_model", "head_dim", "width", "depth", "vocab_size", "context_length", "window", "loss_chunk"):
            if getattr(self, name) < 1:
                raise UserError(f"model.{name} must be at least 1 (got {getattr(self, name)})")
        if self.capacity_factor_eval is None and self.moe_top_k >= 1 and self.n_experts >= 1:
            self.capacity_factor_eval = self.n_experts / self.moe_top_k  # filled for every arch: one config.json
        check_model_numbers(self)  # finite, in range (config_checks.py)
        if not ARCHITECTURES[self.arch].uses_heads:
            ARCHITECTURES[self.arch].validate(self)
            return
        if self.n_heads is None:
            if self.d_model % self.head_dim:
                raise UserError(
                    f"model.d_model={self.d_model} is not a multiple of head_dim={self.head_dim}; "
                    "set d_model to a multiple of head_dim, or choose head_dim (tango-lm match --head-dim) or n_heads"
                )
            self.n_heads = self.d_model // self.head_dim
        else:
            if self.n_heads < 1 or self.d_model % self.n_heads:
                raise UserError(
                    f"model.d_model={self.d_model} is not a multiple of n_heads={self.n_heads}; "
                    "choose n_heads that divides d_model"
                )
            if self.head_dim != HEAD_DIM and self.n_heads * self.head_dim != self.d_model:
                # a head_dim other than the default was given: it followed n_heads unsaid (heads of
                # 64 for an asked 128); the default cannot be told from a given 32
                _check_heads_agree(self.n_heads, self.head_dim, self.d_model)
            self.head_dim = self.d_model // self.n_heads
        if self.head_dim % 2:
            raise UserError(f"head width d_model/n_heads = {self.head_dim} must be even for RoPE; change n_heads")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        ARCHITECTURES[self.arch].validate(self)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (derived fields recomputed unless given)."""
        data = self.to_dict()
        if "n_heads" not in changes and "d_model" in changes:
            data["n_heads"] = None
        if "head_dim" not in changes and "n_heads" in changes:  # follows the new heads
            data["head_dim"] = HEAD_DIM
        if "n_kv_heads" not in changes and ("n_heads" in changes or "d_model" in changes):
            data["n_kv_heads"] = None
        if "capacity_factor_eval" not in changes and ("n_experts" in changes or "moe_top_k" in changes):
            data["capacity_factor_eval"] = None
        data.update(changes)
        return ModelConfig(**data)

    @staticmethod
    def overridden(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
        """A config mapping's model fields with `changes` (a user's overrides, a sweep's axes) applied.

        A preset writes `n_heads` and `head_dim` follows from it, so `head_dim=64` or `d_model=128`
        alone would be ignored or would narrow every head. The field the user changed wins:
        `head_dim` or `d_model` without `n_heads` drops the base's `n_heads` (heads keep their
        width unless `head_dim` is given); `n_heads` without `head_dim` drops the base's `head_dim`.
        The base's GQA group (`n_heads / n_kv_heads`) is kept for the new head count, and a
        `capacity_factor_eval` that was its default E/k follows new `n_experts` or `moe_top_k`, and a
        `moe_expert_width` that was its default F/k new `width` or `moe_top_k` (a base may be a
        run's config.yaml, which writes every derived field). `replace()`, which
        matching uses on MHA models, resets `n_kv_heads` instead."""
        out = dict(base)
        heads, kv = base.get("n_heads"), base.get("n_kv_heads")
        reshaped = bool(changes.keys() & {"n_heads", "head_dim", "d_model"})
        if heads is not None and changes.get("n_heads") is None and reshaped:  # n_heads unchanged or null
            d_model = base.get("d_model", ModelConfig.d_model)
            if _positive_ints(heads, d_model) and d_model % heads == 0:
                out["head_dim"] = d_model // heads  # the width in use (a written head_dim follows n_heads)
            del out["n_heads"]
        if changes.get("n_heads") is not None and "head_dim" not in changes:
            out.pop("head_dim", None)
        out.update(changes)
        old_heads = _head_count(base)  # also where the base writes n_kv_heads but not n_heads
        if reshaped and "n_kv_heads" not in changes and _positive_ints(old_heads, kv) and old_heads % kv == 0:
            group, new_heads = old_heads // kv, _head_count(out)
            if new_heads is not None and new_heads % group == 0:
                out["n_kv_heads"] = new_heads // group
        for derived, (inputs, default) in DERIVED_DEFAULTS.items():
            if changes.keys() & set(inputs) and derived not in changes:
                values = [base.get(name, getattr(ModelConfig, name)) for name in inputs]
                if _positive_ints(*values) and base.get(derived) == default(*values):
                    out.pop(derived)  # written as its default: it follows the changed inputs
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(
                f"unknown model field {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
                f"known fields are: {', '.join(sorted(known))}"
            )
        heads, width, d_model = data.get("n_heads"), data.get("head_dim"), data.get("d_model", cls.d_model)
        if _positive_ints(heads, width, d_model):  # head_dim would follow n_heads unsaid
            _check_heads_agree(heads, width, d_model)
        return cls(**data)

    # -- convenience ------------------------------------------------------------------------
    def build(self):
        from tango_lm.models.model import LanguageModel

        return LanguageModel(self)

    def num_params(self) -> dict[str, int]:
        from tango_lm.models.params import count_params

        return count_params(self)

    def flops_per_token(self, seq_len: int | None = None, *, full_width: bool = False) -> int:
        """Training FLOPs per token (`models/flops.py`). With `active_width`, those of the columns a
        step runs (averaged over a rotation); `full_width=True` counts every column (evaluation)."""
        from tango_lm.models.flops import flops_per_token

        return flops_per_token(self, seq_len or self.context_length, full_width=full_width)


# Model fields that choose how a forward is computed (chunk lengths, a kernel backend), not what it
# computes: a sweep's finished run stays done, and a report compares runs, across them.
MODEL_LOGISTICS_FIELDS = frozenset({"loss_chunk", "gdn_chunk", "gdn_backend"})

_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def active_width_unsupported(arch: str) -> UserError:
    from tango_lm.models.registry import ARCHITECTURES

    supported = ", ".join(a for a, c in ARCHITECTURES.items() if c.rotating_width)
    return UserError(
        f"model.active_width (rotating narrow-width training) is not supported by arch={arch}; "
        f"remove active_width or use one of: {supported}"
    )


def _int64(name: str, value: int) -> int:
    """`value` if torch's sizes and indices (64-bit) can hold it: a wider one overflowed deep in a
    forward (window=1e20) with a traceback."""
    if not -(2**63) <= value < 2**63:
        shown = value if value.bit_length() <= 100 else f"a {value.bit_length()}-bit number"  # no 4,000 digits
        raise UserError(f"{name}={shown} does not fit in 64 bits; a typo? give a smaller value")
    return value


def check_type(name: str, value: Any, annotation: Any, default: Any = None) -> Any:
    """The value, coerced where lossless (an int for a float field, `1e9` for an int field), or
    UserError when it does not fit a simple annotation like `int` or `int | None` (a non-finite
    float's names the field's `default`)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    options = [part.strip() for part in text.split("|")]
    if value is None and "None" in options:
        return value
    for opt in options:
        typ = _SCALARS.get(opt)
        if typ is None or (typ in (int, float) and isinstance(value, bool)):
            continue
        if typ is float and isinstance(value, (int, float)):
            return check_finite(name, value, default)
        if typ is float and isinstance(value, numbers.Real):  # numpy's scalars
            return check_finite(name, float(value), default)
        if typ is int and isinstance(value, numbers.Integral):  # numpy's integers too
            return _int64(name, int(value))
        if typ is int and isinstance(value, float) and value.is_integer():
            return _int64(name, int(value))
        if isinstance(value, typ):
            return value
    wanted = " or ".join(o for o in options)
    hint = ""
    if "str" in options and isinstance(value, bool):  # YAML 1.1 reads a bare on/off/yes/no/true/false so
        hint = (
            f"; YAML read a bare on/off/yes/no/true/false as a boolean: quote what you wrote, {name}: 'off' in a "
            f"file or \"{name}='off'\" as an override"
        )
    elif "str" in options and isinstance(value, (int, float, datetime.date)):  # YAML's reading of a bare 2024
        kind = "date" if isinstance(value, datetime.date) else "number"
        hint = f"; YAML read it as a {kind}: quote what you wrote, {name}: '...' in a file or \"{name}='...'\" as an override"
    raise UserError(f"{name} must be {wanted} (got {value!r} of type {type(value).__name__}){hint}")


# Fields whose default is computed from others (a run's config.yaml writes them out): the inputs,
# and the default from them. An override of an input drops a base value equal to that default.
DERIVED_DEFAULTS = {
    "capacity_factor_eval": (("n_experts", "moe_top_k"), lambda e, k: e / k),
    "moe_expert_width": (("width", "moe_top_k"), lambda f, k: f // k),
}


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def _head_count(model: dict[str, Any]) -> int | None:
    """The query heads a config mapping asks for, where it says (None where validation decides)."""
    if model.get("n_heads") is not None:
        return model["n_heads"] if _positive_ints(model["n_heads"]) else None
    d_model, head_dim = model.get("d_model", ModelConfig.d_model), model.get("head_dim", ModelConfig.head_dim)
    return d_model // head_dim if _positive_ints(d_model, head_dim) and d_model % head_dim == 0 else None
