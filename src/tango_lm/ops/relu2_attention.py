"""GAU's and FLASH's causal squared-ReLU attention with a relative-position bias (docs/design.md §2.7),
and the one door to its implementations.

    A[t, j] = relu(q_t . k_j * scale + rel_bias[t - j])^2 for j <= t, else 0;   out = A V

`relu2_attention` picks the implementation (`ops/dispatch.py`) for a full forward (as many queries
as keys): on CPUs the composition with its product on `ops/causal_matmul.py`'s blocked op or C
kernels (`blocked`, `c`), on CUDA the Triton kernels of `relu2_attention_triton.py` (`triton`,
also inside torch.compile graphs), elsewhere, or for inputs the kernels do not take, the plain
composition (`reference`). Decoding (keys beyond the queries, or a static step's `position`)
always runs the composition: it is one or a few rows of A.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops.causal_matmul import causal_matmul
from tango_lm.ops.dispatch import check_devices, check_installed, choose, requested

try:  # registers the Triton custom ops (before any torch.compile trace reaches `relu2_attention`)
    from tango_lm.ops import relu2_attention_triton
except ImportError:  # no triton: CUDA runs the composition
    relu2_attention_triton = None


def _relu2_kernel(
    q: torch.Tensor, k: torch.Tensor, rel_bias: torch.Tensor, scale: float, position: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(relu(q k^T * scale + bias)^2 over every key, unmasked; the offsets t - j)."""
    t, s = q.shape[-2], k.shape[-2]
    half = (rel_bias.shape[0] + 1) // 2
    rows = torch.arange(s - t, s, device=q.device) if position is None else position
    offset = rows[:, None] - torch.arange(s, device=q.device)[None, :]
    scores = (q @ k.transpose(-1, -2)) * scale + rel_bias[(offset + half - 1).clamp_min(0)].to(q.dtype)
    return F.relu(scores).square(), offset


def relu2_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_bias: torch.Tensor,
    scale: float,
    position: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain composition; the contract of `relu2_attention` (which checks the bias's range)."""
    kernel, offset = _relu2_kernel(q, k, rel_bias, scale, position)
    return kernel.masked_fill(offset < 0, 0.0) @ v


def relu2_attention_blocked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor, scale: float, kernels: str | None = None
) -> torch.Tensor:
    """A full forward with the product on `causal_matmul` (`kernels`: its implementation; None: its
    own choice), which on CPUs skips the blocks above the diagonal."""
    kernel, _ = _relu2_kernel(q, k, rel_bias, scale, None)
    return causal_matmul(kernel, v, kernels=kernels)


def relu2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rel_bias: torch.Tensor,
    scale: float,
    position: torch.Tensor | None = None,
    *,
    kernels: str | None = None,
) -> torch.Tensor:
    """Causal squared-ReLU attention with a relative-position bias.

    q [..., T, s], k [..., S, s], v [..., S, e] -> [..., T, e]; the queries are the last T of the S
    positions (S == T in a full forward, S > T when decoding), or, with `position` [1] (a static
    decode step over a full buffer), one query at that index of the S. `rel_bias` has 2L - 1
    entries, the one for offset t - j at index t - j + L - 1; it covers every offset when S <= L.
    `kernels` (or $TANGO_LM_KERNELS, else 'auto') names the implementation of a full forward.
    """
    check_devices("relu2_attention", q=q, k=k, v=v, rel_bias=rel_bias)
    check_installed("triton", relu2_attention_triton is not None, kernels)
    s, half = k.shape[-2], (rel_bias.shape[0] + 1) // 2
    if s > half:
        raise ValueError(f"{s} positions exceed the relative bias's range of {half}")
    if position is not None or q.shape[-2] != s:  # decoding
        return relu2_attention_reference(q, k, v, rel_bias, scale, position)
    name = choose(*_paths(q, k, v, rel_bias), kernels)
    if name == "triton":
        return relu2_attention_triton.relu2_attention_triton(q, k, v, rel_bias, scale)
    if name in ("blocked", "c"):  # asked for by name: that product; picked by auto: causal_matmul's choice
        return relu2_attention_blocked(q, k, v, rel_bias, scale, name if requested(kernels) == name else None)
    return relu2_attention_reference(q, k, v, rel_bias, scale)


def _paths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor) -> tuple[dict[str, bool], str]:
    """Which implementations can take this full forward, and the one 'auto' picks: on CPUs the
    product on causal_matmul (as before this door existed), on CUDA the Triton kernels where they
    take the inputs, else the composition."""
    cpu = v.device.type == "cpu"
    triton = relu2_attention_triton is not None and relu2_attention_triton.supported(q, k, v, rel_bias)
    usable = {"reference": True, "blocked": cpu, "c": cpu, "triton": triton}
    auto = "blocked" if cpu else "triton" if v.is_cuda and triton else "reference"
    return usable, auto
