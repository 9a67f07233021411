"""TANGO's wide-gate average (SPEC 2.2).

For each head h, `gbar^h_t = sum_{s<=t} softmax_s(q^h_t . k^h_s / sqrt(d_h)) g^h_s`, where the
values are the source gates g (width F/H per head, usually far wider than d_h). It is causal
attention with the gates as values, and the value width makes the probabilities-times-gates
matmuls the cost. Three implementations, all batched over heads (no per-head loop, no per-(t, s)
products):

- `gate_average_sdpa`: one `scaled_dot_product_attention` call (fused kernels on GPUs);
- `gate_average_blocked`: explicit probabilities, with the probabilities-times-gates products
  (forward and backward) done in query/key blocks that skip the all-zero upper triangle, so the
  wide products cost (n+1)/2n of the full square for n blocks instead of all of it. The math
  fallback of SDPA on a CPU computes the full square;
- `gate_average_reference`: the naive definition the others are tested against.

`gate_average` picks the blocked path on CPUs and SDPA elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_BLOCK = 64


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*w] -> [B, H, T, w]."""
    b, t, c = x.shape
    return x.view(b, t, n_heads, c // n_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, w] -> [B, T, H*w]."""
    b, h, t, w = x.shape
    return x.transpose(1, 2).reshape(b, t, h * w)


def gate_average_reference(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Naive reference: explicit score matrix, mask, softmax and weighted sum, in fp32."""
    qf, kf, gf = q.float(), k.float(), g.float()
    t = q.shape[-2]
    scores = qf @ kf.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (probs @ gf).to(g.dtype)


def gate_average_sdpa(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """q, k: [..., T, d_h]; g: [..., T, w] -> [..., T, w]."""
    return F.scaled_dot_product_attention(q, k, g, is_causal=True)


def _causal_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
    return torch.softmax(scores.masked_fill_(mask, float("-inf")), dim=-1, dtype=torch.float32).to(g_dtype(q))


def g_dtype(q: torch.Tensor) -> torch.dtype:
    return q.dtype


def _blocks(t: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, t)) for s in range(0, t, block)]


class _BlockedGateAverage(torch.autograd.Function):
    """out = P g with P the causal softmax of q k^T / sqrt(d_h); P is kept for the backward
    (B*H*T^2 values, small next to the B*T*F gates)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, block: int) -> torch.Tensor:
        probs = _causal_probs(q, k)
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        for s, e in _blocks(q.shape[-2], block):
            torch.matmul(probs[..., s:e, :e], g[..., :e, :], out=out[..., s:e, :])
        ctx.save_for_backward(q, k, g, probs)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, g, probs = ctx.saved_tensors
        t, block = q.shape[-2], ctx.block
        grad_out = grad_out.contiguous()
        grad_probs = torch.zeros_like(probs)
        grad_g = torch.empty_like(g)
        for s, e in _blocks(t, block):
            # Rows s:e see sources :e; sources s:e are seen by rows s: .
            torch.matmul(grad_out[..., s:e, :], g[..., :e, :].transpose(-1, -2), out=grad_probs[..., s:e, :e])
            torch.matmul(probs[..., s:, s:e].transpose(-1, -2), grad_out[..., s:, :], out=grad_g[..., s:e, :])
        # Softmax backward: dS = P * (dP - rowsum(dP * P)); the masked entries have P = 0.
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        grad_scores = grad_scores * q.shape[-1] ** -0.5
        return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, grad_g, None


def gate_average_blocked(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """q, k: [..., T, d_h]; g: [..., T, w] -> [..., T, w], computed block-causally."""
    return _BlockedGateAverage.apply(q.contiguous(), k.contiguous(), g.contiguous(), block)


def gate_average(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The causal average of the gates, by the fastest path for the device."""
    if g.device.type == "cpu":
        return gate_average_blocked(q, k, g)
    return gate_average_sdpa(q, k, g)
