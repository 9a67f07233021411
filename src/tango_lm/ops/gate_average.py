"""TANGO's wide-gate average (docs/design.md §2.2).

For each head h, `gbar^h_t = sum_{s<=t} softmax_s(q^h_t . k^h_s / sqrt(d_h)) g^h_s`, where the
values are the source gates g (width F/H per head, usually far wider than d_h). It is causal
attention with the gates as values, and the value width makes the probabilities-times-gates
matmuls the cost. `gate_average_sdpa` is one `scaled_dot_product_attention` call, batched over
heads (no per-head loop, no per-(t, s) products); `gate_average_reference` is the plain definition
it is tested against. The TANGO block uses `tango_mix.py`, which also folds in the SiLU and the
product by u (fused CPU ops, Triton kernels on CUDA).

The fused CPU op skips the all-zero blocks above the diagonal, with each matmul split so that
its pieces stay wide (`tango_mix._blocks`).

On GPUs no fused SDPA backend takes values that much wider than the queries (flash attention needs
equal widths up to 256, cuDNN widths up to 256, the memory-efficient kernel multiples of 8), so one
SDPA call runs PyTorch's math backend, which holds the [B, H, T, T] probabilities in fp32.
`gate_average_sliced` cuts the values into slices of at most `SDPA_SLICE` columns (a multiple of 8,
zero-padded) and runs them as extra heads with q and k broadcast to every slice, which the fused
backends take (`ops/attention.py`'s `sliced_attention`, which cached decoding uses too). It is the
CUDA path where the Triton kernels (`tango_mix_triton.py`) cannot run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops.attention import SDPA_SLICE, sliced_attention, slices
from tango_lm.ops.dispatch import check_devices, choose

__all__ = [
    "SDPA_SLICE",
    "gate_average",
    "gate_average_reference",
    "gate_average_sdpa",
    "gate_average_sliced",
    "merge_heads",
    "slices",
    "split_heads",
]


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*w] -> [B, H, T, w]."""
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, w] -> [B, T, H*w]."""
    b, h, t, w = x.shape
    return x.transpose(1, 2).reshape(b, t, h * w)


def gate_average_reference(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Naive reference: explicit score matrix, mask, softmax and weighted sum, in at least fp32."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    qf, kf, gf = q.to(dtype), k.to(dtype), g.to(dtype)
    t = q.shape[-2]
    scores = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ gf).to(g.dtype)


def gate_average_sdpa(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """q, k: [..., T, d_h]; g: [..., T, w] -> [..., T, w]."""
    return F.scaled_dot_product_attention(q, k, g, is_causal=True)


def gate_average_sliced(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, max_slice: int | None = None
) -> torch.Tensor:
    """Same contract as `gate_average_sdpa`, with the values run as n slices of s columns
    (`ops/attention.py`'s `sliced_attention`, `slices`): q, k [B, H, T, d_h] broadcast to
    [B, H * n, T, d_h], g to [B, H * n, T, s]; one copy of each."""
    return sliced_attention(q, k, g, None, max_slice)


def gate_average(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, *, kernels: str | None = None) -> torch.Tensor:
    """The causal average of the gates: the sliced SDPA on CUDA, one SDPA call elsewhere
    ('reference'); `kernels` or $TANGO_LM_KERNELS overrides (ops/dispatch.py)."""
    check_devices("gate_average", q=q, k=k, g=g)
    auto = "sdpa-sliced" if g.is_cuda else "reference"
    if choose({"reference": True, "sdpa-sliced": True}, auto, kernels) == "sdpa-sliced":
        return gate_average_sliced(q, k, g)
    return gate_average_sdpa(q, k, g)
