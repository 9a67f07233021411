"""The gated delta rule (Yang, Kautz, Hatamizadeh, ICLR 2025), chunkwise-parallel, in plain PyTorch.

The recurrence, with the state kept as M = Sᵀ [d_k, d_v] (fla's layout):

    M_t = α_t (I − β_t k_t k_tᵀ) M_{t−1} + β_t k_t v_tᵀ        o_t = M_tᵀ q_t

(docs/design.md §4.2 writes the same thing as S_t = S_{t−1}(α_t(I − β_t k_t k_tᵀ)) + β_t v_t k_tᵀ, o_t = S_t q_t.)
`g = log α ≤ 0` is passed instead of α so products of many gates stay in log space.

Chunkwise form (the WY / UT-transform algorithm of Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", with the gate of Gated DeltaNet). Inside a
chunk of C positions with state M_0 on entry and cumulative gates Γ_t = exp(Σ_{s≤t} g_s), the
state is M_t = Γ_t M_0 + Σ_{s≤t} (Γ_t/Γ_s) k_s u_sᵀ for "pseudo-values" u_s that solve

    (I + A) U = diag(β) V − diag(βΓ) K M_0,    A_ts = β_t (Γ_t/Γ_s) k_t·k_s  (s < t, else 0),

a unit lower-triangular system (the UT transform). Writing U = Ũ − W M_0 with
Ũ = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(βΓ) K, which need no state, all chunks are solved
at once (one batched triangular solve). Only the pass over chunks that carries the state is
sequential, two batched matmuls (and adds) per chunk:

    U   = Ũ − W M_0,      M_C = Γ_C M_0 + (K ⊙ Γ_C/Γ)ᵀ U,

and with every chunk's entry state M_0 and U kept, the outputs of all chunks come at once:

    O   = diag(Γ) Q M_0 + (Q Kᵀ ⊙ D) U,      D_ts = Γ_t/Γ_s for s ≤ t, else 0.

The loop walks chunk-major views (`unbind`), so its backward stacks the per-chunk gradients once
rather than adding a full-size zero-padded gradient per chunk (indexing `x[:, :, i]` in a loop
makes the backward quadratic in the number of chunks).

`delta_rule_recurrent` is the step-by-step reference the chunked form is tested against (outputs
and gradients, float64, odd lengths). `gated_delta_rule` dispatches to fla's Triton kernels
(`chunk_gated_delta_rule_fwd` / `_bwd` of the fla-core package, `pip install 'tango-lm[gdn]'`) on
CUDA, in eager mode and under `torch.compile` alike, through the custom ops of
ops/delta_rule_fla.py (fla's own entry point is `torch.compiler.disable`d, a graph break in every
GDN layer), and to the chunked PyTorch form otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tango_lm.ops import delta_rule_fla


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step reference. q, k [B, H, T, d_k], v [B, H, T, d_v], beta and g = log α [B, H, T],
    state M [B, H, d_k, d_v] (zeros if None) -> (o [B, H, T, d_v], final state)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    m = state if state is not None else q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(t):
        k_i, v_i, b_i = k[:, :, i], v[:, :, i], beta[:, :, i, None]
        alpha = g[:, :, i].exp()[..., None, None]
        # α (I − β k kᵀ) M + β k vᵀ
        m = alpha * (m - b_i[..., None] * k_i[..., :, None] * (k_i[..., None, :] @ m))
        m = m + b_i[..., None] * k_i[..., :, None] * v_i[..., None, :]
        outs.append((q[:, :, i, None, :] @ m).squeeze(-2))
    return (torch.stack(outs, dim=2) if outs else v.new_zeros(b, h, 0, dv)), m


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise-parallel gated delta rule; same arguments and results as `delta_rule_recurrent`.
    Computed in fp32 (or float64 for float64 inputs); o is returned in v's dtype, the state in fp32+."""
    out_dtype = v.dtype
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, beta, g = (x.to(dtype) for x in (q, k, v, beta, g))
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    if t == 0:  # no position: no chunk to stack, the state passes unchanged
        m = state.to(dtype) if state is not None else q.new_zeros(b, h, dk, dv)
        return v.to(out_dtype), m
    c = max(1, min(chunk, t))
    pad = (-t) % c
    if pad:  # padded positions: k = v = 0, β = 0, g = 0 (α = 1) leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(b, h, n, c), g.reshape(b, h, n, c)

    gamma = g.cumsum(-1)  # log Γ_t within each chunk
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # D_ts = Γ_t / Γ_s on and below the diagonal; masked before exp so it never overflows.
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a = (beta[..., :, None] * kk * decay).tril(-1)  # strictly lower
    eye = torch.eye(c, dtype=dtype, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * gamma.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u_tilde, w = solved[..., :dv], solved[..., dv:]
    k_to_end = (gamma[..., -1:] - gamma).exp()[..., None] * k  # (Γ_C / Γ_s) k_s

    def by_chunk(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[B, H, n, ...] -> n tensors [B·H, ...]."""
        return x.movedim(2, 0).reshape(n, b * h, *x.shape[3:]).unbind(0)

    m = state.to(dtype) if state is not None else q.new_zeros(b, h, dk, dv)
    m = m.reshape(b * h, dk, dv)
    gate_to_end = gamma[..., -1:, None].exp()  # Γ_C per chunk, [B, H, n, 1, 1]
    starts, us = [], []
    for u_tilde_i, w_i, k_to_end_i, gate_i in zip(
        by_chunk(u_tilde), by_chunk(w), by_chunk(k_to_end.transpose(-1, -2)), by_chunk(gate_to_end), strict=True
    ):
        # Matmul then add, not baddbmm: under autocast the products run in bf16 but the sums, and
        # so the state carried from chunk to chunk, stay in fp32 (baddbmm's result would be bf16).
        starts.append(m)
        u = u_tilde_i - w_i @ m  # Ũ − W M_0
        us.append(u)
        m = gate_i * m + k_to_end_i @ u  # Γ_C M_0 + (K ⊙ Γ_C/Γ)ᵀ U
    m_start = torch.stack(starts, dim=1).reshape(b, h, n, dk, dv)
    u = torch.stack(us, dim=1).reshape(b, h, n, c, dv)
    qk = (q @ k.transpose(-1, -2)) * decay  # zero above the diagonal
    o = (gamma.exp()[..., None] * q) @ m_start + qk @ u
    o = o.reshape(b, h, n * c, dv)[:, :, :t]
    return o.to(out_dtype), m.reshape(b, h, dk, dv)


def wants_fla(backend: str, on_cuda: bool) -> bool:
    """Whether `backend` sends CUDA inputs to fla: 'fla' and 'auto', eager or compiled (the custom
    ops of ops/delta_rule_fla.py keep fla's kernels inside a compiled graph). Never on CPUs."""
    return on_cuda and backend in ("fla", "auto")


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule through the chosen backend: 'torch' (chunked PyTorch), 'fla' (fla's
    Triton kernels on CUDA; the chunked form on CPUs) or 'auto' (fla on CUDA when it imports, else
    torch; a failing fla kernel logs one line and the chunked form runs). Eager and under
    `torch.compile` alike. Shapes as in `delta_rule_recurrent`; q is expected to carry its
    1/sqrt(d_k) scale already. fla chunks by 64 whatever `chunk` says."""
    if wants_fla(backend, q.is_cuda):
        if backend == "fla":
            delta_rule_fla.require_fla()
        if delta_rule_fla.fla_available():
            return delta_rule_fla.gdn_chunk(q, k, v, beta, g, state, fallback=backend == "auto")
    return delta_rule_chunked(q, k, v, beta, g, state, chunk)
