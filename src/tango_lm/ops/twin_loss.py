"""Chunked NLL of softmax mixtures: the fused loss of the onóna head and its relatives (docs/design.md §3).

The heads score positions n = 1..N with K components, each a hidden state `h_k` [N, d] and a
vocabulary table `W_k` [V, d], and a per-position log-prior `log π` [N, K]:

    log p(y_n) = logsumexp_k( log π_nk + log_softmax(s(h_nk W_kᵀ))_{y_n} )

with `s` the identity, or `s(z) = z + logsigmoid(z)` for sigsoftmax (Kanai et al. 2018).

- Standard / untied: K = 1, no prior.
- onóna: K = 2 with one hidden state and tables A, B; `log π = (logsigmoid(z), logsigmoid(-z))`
  for the gate logit z (seed 001, Eq. 5 and Appendix B).
- MoS / MoSS: K hidden states `tanh(W_k h)` under one shared table and `log π = log_softmax(W_π h)`.

The plain path materializes K fp32 [N, V] log-prob tensors and their gradients. `mixture_nll`
instead runs a custom autograd Function over chunks of `chunk` positions: the forward keeps only
the per-row log-sum-exps [N, K] and the component posteriors r [N, K]; the backward recomputes
each chunk's logits and applies the logit gradient

    dL/ds_nkv = r_nk (softmax(s_nk)_v - [v = y_n]),   dL/dlog π_nk = -r_nk,

where `r_nk = π_nk q_k(y_n) / p(y_n)` is the posterior of component k given the target. For the
twin head this gives dL/dz = σ(z) - r_A through the logsigmoid prior. Every chunk of every
component is computed into one reused chunk x V buffer (plus a copy in the matmul dtype under
autocast), so the head never holds more than that instead of K x N x V; the price is recomputing
the K logit matmuls in the backward (8 instead of 6 vocabulary matmuls for the twin head).

Matmuls run in the autocast dtype when autocast is on (bf16 on GPUs), otherwise in the inputs'
dtype; softmax statistics and gradient accumulation are fp32 (fp64 for fp64 inputs). Targets equal
to `ignore_index` contribute neither loss nor gradient, as in `F.cross_entropy`.
`mixture_nll_reference` is the plain path the op is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_CHUNK = 1024  # positions per chunk of the fused losses (heads read it as `Head.loss_chunk`)
IGNORE_INDEX = -100


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype if wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _compute_dtype(device_type: str, tensors: list[torch.Tensor]) -> torch.dtype:
    """The matmul dtype: autocast's for fp32/fp16/bf16 inputs when it is on, as `F.linear` would."""
    low = (torch.float32, torch.float16, torch.bfloat16)
    if torch.is_autocast_enabled(device_type) and all(t.dtype in low for t in tensors):
        return torch.get_autocast_dtype(device_type)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sig_transform(z: torch.Tensor) -> torch.Tensor:
    """Sigsoftmax's logit transform `z + logsigmoid(z)`, in place."""
    return z.add_(F.logsigmoid(z))


class _Buffers:
    """One reusable [chunk, V] logits buffer in the accumulation dtype, plus one in the matmul dtype
    when that is narrower: every chunk of every component is computed into the same memory (on a
    CPU this also avoids a fresh mmap and its page faults per chunk)."""

    def __init__(self, rows: int, vocab: int, acc: torch.dtype, cdtype: torch.dtype, device: torch.device):
        self.acc = torch.empty(rows, vocab, dtype=acc, device=device)
        self.low = torch.empty(rows, vocab, dtype=cdtype, device=device) if cdtype != acc else None

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h [c, d] @ wᵀ into the buffer, as [c, V] in the accumulation dtype."""
        c = h.shape[0]
        if self.low is None:
            return torch.mm(h, w.T, out=self.acc[:c])
        return self.acc[:c].copy_(torch.mm(h, w.T, out=self.low[:c]))

    def low_copy(self, x: torch.Tensor) -> torch.Tensor:
        """x in the matmul dtype (no copy when that is the accumulation dtype)."""
        return x if self.low is None else self.low[: x.shape[0]].copy_(x)


class _MixtureNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, targets, log_prior, chunk, sigsoftmax, ignore_index, h_slots, w_slots, *inputs):
        # inputs: each distinct tensor once; component i uses inputs[h_slots[i]] and inputs[w_slots[i]].
        k = len(h_slots)
        hs, tables = [inputs[j] for j in h_slots], [inputs[j] for j in w_slots]
        n = targets.shape[0]
        device_type = targets.device.type
        cdtype = _compute_dtype(device_type, list(inputs))
        acc = _wide(torch.promote_types(cdtype, hs[0].dtype))
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        lse = torch.empty(n, k, dtype=acc, device=targets.device)
        comp = torch.empty(n, k, dtype=acc, device=targets.device)  # log q_k(y_n)
        with torch.autocast(device_type, enabled=False):
            cast = [t.to(cdtype) for t in inputs]  # each distinct input once (a shared table is cast once)
            hc, wc = [cast[j] for j in h_slots], [cast[j] for j in w_slots]
            buf = _Buffers(min(chunk, n), tables[0].shape[0], acc, cdtype, targets.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                for i in range(k):
                    z = buf.logits(hc[i][s:e], wc[i])
                    if sigsoftmax:
                        z = _sig_transform(z)
                    tgt = z.gather(1, safe[s:e, None]).squeeze(1)
                    m = z.amax(1)
                    row_lse = m + z.sub_(m[:, None]).exp_().sum(1).log()
                    lse[s:e, i] = row_lse
                    comp[s:e, i] = tgt - row_lse
            del buf
        if log_prior is not None:
            comp = comp + log_prior.to(acc)
        log_p = torch.logsumexp(comp, dim=1)
        resp = (comp - log_p[:, None]).exp() * valid[:, None]
        ctx.save_for_backward(safe, lse, resp, *inputs)
        ctx.h_slots, ctx.w_slots = h_slots, w_slots
        ctx.chunk, ctx.sigsoftmax, ctx.cdtype = chunk, sigsoftmax, cdtype
        ctx.prior_dtype = log_prior.dtype if log_prior is not None else acc
        return -(log_p * valid).sum()

    @staticmethod
    def backward(ctx, grad_out):
        # Per chunk and component, with q = softmax(s) and r the row weights r_nk * grad_out:
        #   dL/ds = diag(r) (q - onehot(y))   [times s'(z) for sigsoftmax],
        # with r applied to the [c, d] sides: dh = r * ((q - onehot) W), dW += (q - onehot)ᵀ (r * h).
        # A tensor several components share (the twin head's h, MoS's table) accumulates one gradient.
        safe, lse, resp, *inputs = ctx.saved_tensors
        h_slots, w_slots, chunk = ctx.h_slots, ctx.w_slots, ctx.chunk
        k = len(h_slots)
        need = ctx.needs_input_grad
        need_in = need[7:]
        need_h, need_w = [need_in[j] for j in h_slots], [need_in[j] for j in w_slots]
        acc = lse.dtype
        scale = resp * grad_out.to(acc)  # [N, K]
        d_prior = -scale if need[1] else None
        n = safe.shape[0]
        device_type = safe.device.type
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) if need_in[j] else None for j, t in enumerate(inputs)]
        d_h, d_w = [grads[j] for j in h_slots], [grads[j] for j in w_slots]
        with torch.autocast(device_type, enabled=False):
            cast = [t.to(ctx.cdtype) for t in inputs]
            hc, wc = [cast[j] for j in h_slots], [cast[j] for j in w_slots]
            buf = _Buffers(min(chunk, n), wc[0].shape[0], acc, ctx.cdtype, safe.device)
            rows = torch.arange(min(chunk, n), device=safe.device)
            for s in range(0, n, chunk):
                e = min(s + chunk, n)
                y = safe[s:e]
                for i in range(k):
                    if not (need_h[i] or need_w[i]):
                        continue
                    r = scale[s:e, i, None]
                    q = buf.logits(hc[i][s:e], wc[i])
                    slope = None
                    if ctx.sigsoftmax:
                        slope = 2.0 - torch.sigmoid(q)  # d(z + logsigmoid z)/dz = 1 + σ(-z)
                        q = _sig_transform(q)
                    q = q.sub_(lse[s:e, i, None]).exp_()
                    if slope is None:
                        q[rows[: e - s], y] -= 1.0
                    else:
                        q.mul_(slope)
                        q[rows[: e - s], y] -= slope[rows[: e - s], y]
                        del slope
                    qc = buf.low_copy(q)
                    if need_h[i]:
                        d_h[i][s:e] += (qc @ wc[i]).to(acc).mul_(r)
                    if need_w[i]:
                        rh = (r * hc[i][s:e].to(acc)).to(ctx.cdtype)
                        if ctx.cdtype == acc:
                            d_w[i].addmm_(qc.T, rh)
                        else:
                            d_w[i] += (qc.T @ rh).to(acc)
            del buf
        grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, inputs, strict=True)]
        if d_prior is not None:
            d_prior = d_prior.to(ctx.prior_dtype)
        return (None, d_prior, None, None, None, None, None, *grads)


def mixture_nll(
    hs: list[torch.Tensor],
    tables: list[torch.Tensor],
    targets: torch.Tensor,
    log_prior: torch.Tensor | None = None,
    *,
    components: tuple[tuple[int, int], ...] | None = None,
    sigsoftmax: bool = False,
    chunk: int = LOSS_CHUNK,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Summed NLL of a K-component softmax mixture, in chunks of positions.

    hs: hidden states [N, d]; tables: tables [V, d]; components: K pairs (index into hs, index into
    tables), one per mixture component (default: hs[i] with tables[i]); targets: [N] ids;
    log_prior: [N, K] log mixture weights (None for K = 1).

    A tensor several components share (the twin head's h, MoS's table) is passed once and named by
    its index in `components`: an autograd Function that receives one tensor twice cannot be traced
    by Dynamo (torch.compile would break the graph around the loss), and a shared tensor then gets
    one gradient buffer instead of one per component. Which tensors are shared is said by the
    caller, never found by comparing tensors (an identity test becomes a guard on the tensors'
    identity under torch.compile, which then recompiles for every new batch).
    """
    if components is None:
        if len(hs) != len(tables):
            raise ValueError(f"need one table per hidden state, got {len(hs)} and {len(tables)}")
        components = tuple((i, i) for i in range(len(hs)))
    if not components:
        raise ValueError("a mixture needs at least one component")
    for h_index, w_index in components:
        if not (0 <= h_index < len(hs) and 0 <= w_index < len(tables)):
            raise ValueError(
                f"component ({h_index}, {w_index}) is outside {len(hs)} hidden states and {len(tables)} tables"
            )
    if log_prior is None and len(components) > 1:
        raise ValueError("a mixture of several components needs log_prior [N, K]")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 (got {chunk})")
    h_slots = tuple(int(h_index) for h_index, _ in components)
    w_slots = tuple(len(hs) + int(w_index) for _, w_index in components)
    return _MixtureNLL.apply(
        targets.reshape(-1), log_prior, int(chunk), sigsoftmax, ignore_index, h_slots, w_slots, *hs, *tables
    )


def softmax_nll(
    h: torch.Tensor, table: torch.Tensor, targets: torch.Tensor, *, sigsoftmax: bool = False, chunk: int = LOSS_CHUNK
) -> torch.Tensor:
    """Summed NLL of `log_softmax(h tableᵀ)` (Standard) or its sigsoftmax; h [..., d], targets [...]."""
    return mixture_nll([h.reshape(-1, h.shape[-1])], [table], targets, sigsoftmax=sigsoftmax, chunk=chunk)


def twin_log_prior(gate_logit: torch.Tensor) -> torch.Tensor:
    """(log g, log(1 - g)) = (logsigmoid(z), logsigmoid(-z)) [..., 2], finite when the gate saturates."""
    z = gate_logit.to(_wide(gate_logit.dtype))
    return torch.stack([F.logsigmoid(z), F.logsigmoid(-z)], dim=-1)


def twin_nll(
    h: torch.Tensor,
    table_a: torch.Tensor,
    table_b: torch.Tensor,
    gate_logit: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int = LOSS_CHUNK,
) -> torch.Tensor:
    """Summed onóna NLL: -log(g softmax(h Aᵀ) + (1 - g) softmax(h Bᵀ))_y with g = σ(gate_logit).

    h [..., d]; gate_logit and targets [...] (one gate logit per position).
    """
    flat = h.reshape(-1, h.shape[-1])
    prior = twin_log_prior(gate_logit.reshape(-1))
    return mixture_nll([flat], [table_a, table_b], targets, prior, components=((0, 0), (0, 1)), chunk=chunk)


def _component_pairs(
    hs: list[torch.Tensor], tables: list[torch.Tensor], components: tuple[tuple[int, int], ...] | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if components is None:
        return list(zip(hs, tables, strict=True))
    return [(hs[i], tables[j]) for i, j in components]


def mixture_log_probs_reference(
    hs: list[torch.Tensor],
    tables: list[torch.Tensor],
    log_prior: torch.Tensor | None = None,
    sigsoftmax: bool = False,
    components: tuple[tuple[int, int], ...] | None = None,
) -> torch.Tensor:
    """Plain path: the mixture's normalized log-probs [N, V], materializing every component."""
    parts = []
    for i, (h, w) in enumerate(_component_pairs(hs, tables, components)):
        z = h @ w.T
        z = z.to(_wide(z.dtype))
        if sigsoftmax:
            z = z + F.logsigmoid(z)
        lp = F.log_softmax(z, dim=-1)
        if log_prior is not None:
            lp = lp + log_prior[:, i, None].to(lp.dtype)
        parts.append(lp)
    return torch.logsumexp(torch.stack(parts), dim=0) if len(parts) > 1 else parts[0]


def mixture_nll_reference(
    hs: list[torch.Tensor],
    tables: list[torch.Tensor],
    targets: torch.Tensor,
    log_prior: torch.Tensor | None = None,
    sigsoftmax: bool = False,
    ignore_index: int = IGNORE_INDEX,
    components: tuple[tuple[int, int], ...] | None = None,
) -> torch.Tensor:
    """Plain path of `mixture_nll`: gather from the materialized log-probs."""
    lp = mixture_log_probs_reference(hs, tables, log_prior, sigsoftmax, components)
    return F.nll_loss(lp, targets.reshape(-1), reduction="sum", ignore_index=ignore_index)
