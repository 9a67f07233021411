"""onóna: twin embeddings with tied unembeddings (seed 001, docs/design.md §3).

Two tables A, B ∈ R^{V×d}, drawn independently N(0, init_std²). The body reads the average
M = (A + B)/2 of the input token (Eq. 4); the head mixes the two tied softmaxes with a gate that
reads only the input token (Eqs. 5, 6):

    z_t = wᵀ rmsnorm(M[x_t]),   log p = logaddexp(log_softmax(h Aᵀ) + logsigmoid(z),
                                                  log_softmax(h Bᵀ) + logsigmoid(-z)).

The gate input is not detached, so A and B receive gradients through the input (half each of
M's), through the gate (half each again) and each through its own output projection (Appendix B).

Gate initialisation: the paper's code (Figure 2) uses `nn.Linear(d, 1, bias=False)` with no
re-initialisation, i.e. PyTorch's default U(-1/√d, 1/√d); since rmsnorm(M[x]) has unit RMS the
initial gate logits have std ≈ 1/√3 and the gates start spread around ½. That is the default here
(`TokenGate(init="uniform")`); `gate.reset_parameters("zeros")` starts every gate at exactly ½,
the constant gate of Appendix A. The weightless RMSNorm uses the model's `norm_eps` (docs/design.md §1's
1e-6) where the paper's `F.rms_norm` took the dtype's machine epsilon.

Serving (Appendix B): `sample()` draws the component c ~ Bernoulli(g[x_t]), g[x_t] =
σ(wᵀ rmsnorm(M[x_t])), and computes only that component's projection, an exact sample from the
mixture at temperature 1 without truncation; a static decode step reads M and every token's gate
logit folded once per serving context (`serving_tensors`).

`ablation = "a"` or `"b"` turns a trained twin model into its one-table ablation: that table at
the input and the output, without the gate (seed 001, Table 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tango_lm.heads.base import Head, float_logits, vocab_table
from tango_lm.layers.norm import rms_norm
from tango_lm.models.config import ModelConfig
from tango_lm.ops.twin_loss import softmax_nll, twin_nll


def twin_log_probs(h: torch.Tensor, A: torch.Tensor, B: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """onóna's head as a function: h [..., d], tables [V, d], gate logit z [...] (one per position,
    or broadcastable with a trailing 1) -> normalized log-probs [..., V] in fp32 (or wider):
    `logaddexp(log_softmax(h Aᵀ) + logsigmoid(z), log_softmax(h Bᵀ) + logsigmoid(-z))`."""
    la = F.log_softmax(float_logits(h, A), dim=-1)
    lb = F.log_softmax(float_logits(h, B), dim=-1)
    z = gate_logit.to(la.dtype)
    if z.dim() == h.dim() - 1:
        z = z.unsqueeze(-1)
    return torch.logaddexp(la + F.logsigmoid(z), lb + F.logsigmoid(-z))


class TokenGate(nn.Module):
    """`z = wᵀ rmsnorm(x)` with a weightless RMSNorm and `weight` w ∈ R^d; fp32 (or wider) out."""

    def __init__(self, d_model: int, eps: float = 1e-6, init: str = "uniform") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d_model))
        self.reset_parameters(init)

    def reset_parameters(self, init: str = "uniform") -> None:
        """'uniform': U(-1/√d, 1/√d), nn.Linear's default as in the paper's code; 'zeros': g = ½."""
        if init == "uniform":
            bound = self.weight.shape[0] ** -0.5
            nn.init.uniform_(self.weight, -bound, bound)
        elif init == "zeros":
            nn.init.zeros_(self.weight)
        else:
            raise ValueError(f"gate init must be 'uniform' or 'zeros', got {init!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Input rows [..., d] -> gate logits [...]."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (rms_norm(xf, self.eps) * self.weight.to(xf.dtype)).sum(-1)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


class OnonaHead(Head):
    """Twin tables `table_a`, `table_b` and the token gate `gate` (docs/design.md §3)."""

    display_name = "onóna"
    vocab_projections = 2
    one_projection_sampling = True
    twin_tables = True
    ablation: str | None = None  # None, "a" or "b" (`eval --ablate`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Drawn in the order A, B, gate; the factorial cells and the input-gate control draw the
        # same, so A matches across them under one seed (the body is drawn before any head).
        self.table_a = vocab_table(cfg)
        self.table_b = vocab_table(cfg)
        self.gate = TokenGate(cfg.d_model, cfg.norm_eps)
        self._serving = 0  # serving() contexts entered and not left
        self._folded: tuple[torch.Tensor, ...] | None = None  # the fold a static step reads, while serving
        self._fold_cache: tuple[torch.Tensor, ...] | None = None  # its tensors, kept across requests

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Serving (seed 001 Appendix B). Eager decoding reads M's rows, M = (A + B) / 2, and their
        gate logits for the tokens it reads, from the weights as they are: the numbers of the
        forward outside serving, at O(tokens x d) per step. A static decode step
        (`serve/static_decode.py`) reads the fold of every row instead (M, rmsnorm(M) w and the
        stacked tables its one-row sample picks from), made when the step begins
        (`serving_tensors`, once per request) into tensors kept across requests, whose addresses
        a CUDA graph holds. Nothing is kept on the weights' version counters: an edit through
        `.data`, which moves none, served stale numbers that way (up to 18.8 nats off)."""
        self._serving += 1  # a depth: a generate() inside a caller's own serving() keeps the outer's
        try:
            yield
        finally:
            self._serving -= 1
            if not self._serving:
                self._folded = None

    def serving_tensors(self) -> tuple[torch.Tensor, ...]:
        """While serving, the fold a static step reads (M, its gate logits, the stacked tables),
        folded from the weights as they are on the first call of this serving context."""
        if not self._serving:
            return ()
        if self._folded is None:
            with torch.no_grad():
                merged = 0.5 * (self.table_a.weight + self.table_b.weight)
                # Both tables stacked [2, V, d]: a static decode step picks its row's table by index.
                fold = (merged, self.gate(merged), torch.stack([self.table_a.weight, self.table_b.weight]))
                kept = self._fold_cache
                if kept is not None and all(map(_same_layout, kept, fold)):
                    for k, f in zip(kept, fold, strict=True):
                        k.copy_(f)
                else:
                    self._fold_cache = fold
            self._folded = self._fold_cache
        return self._folded

    def merged_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """M[x] = (A[x] + B[x]) / 2."""
        if self._folded is not None:
            return F.embedding(input_ids, self._folded[0])
        return 0.5 * (self.table_a(input_ids) + self.table_b(input_ids))

    def _one_table(self) -> nn.Embedding:
        if self.ablation not in ("a", "b"):
            raise ValueError(f"ablation must be None, 'a' or 'b', got {self.ablation!r}")
        return self.table_a if self.ablation == "a" else self.table_b

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ablation is not None:
            return self._one_table()(input_ids)
        return self.merged_rows(input_ids)

    def gate_logit(self, input_ids: torch.Tensor) -> torch.Tensor:
        """z_t = wᵀ rmsnorm(M[x_t]) [B, T], fp32."""
        if self._folded is not None:
            return self._folded[1][input_ids]
        return self.gate(self.merged_rows(input_ids))

    def log_probs(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ablation is not None:
            return F.log_softmax(float_logits(h, self._one_table().weight), dim=-1)
        return twin_log_probs(h, self.table_a.weight, self.table_b.weight, self.gate_logit(input_ids))

    def nll(self, h: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.ablation is not None:
            return softmax_nll(h, self._one_table().weight, targets, chunk=self.loss_chunk)
        return twin_nll(
            h, self.table_a.weight, self.table_b.weight, self.gate_logit(input_ids), targets, chunk=self.loss_chunk
        )

    # -- serving (Appendix B) ----------------------------------------------------------------
    def _chance_of_a(self, input_ids: torch.Tensor) -> torch.Tensor:
        """P(component A) per position: the gate g[x_t], or 1 / 0 under a one-table ablation, whose
        samples come from that table alone (as its log_probs say)."""
        if self.ablation is not None:
            a = float(self._one_table() is self.table_a)
            return torch.full(input_ids.shape, a, dtype=torch.float32, device=input_ids.device)
        return torch.sigmoid(self.gate_logit(input_ids))

    @torch.no_grad()
    def sample(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        generator: torch.Generator | None = None,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        """Exact temperature-1 samples [...] from the mixture with one projection per position:
        c ~ Bernoulli(g[x_t]), then a draw from softmax(h Aᵀ) or softmax(h Bᵀ) as c says. With
        `vocab_size` (the tokenizer's ids, below the table's padded rows), what is drawn is the
        mixture renormalized over those ids (renormalizing each component instead weighs them by
        their mass below `vocab_size`): a row that drew a padding id draws again from it, with both
        projections. That keeps the cost bounded (rows redrawn one projection at a time until none
        drew padding took a round per rejection: a hundred a token where the padding holds 99% of
        the mass, as in an untrained model or one trained on a smaller vocabulary)."""
        g = self._chance_of_a(input_ids).reshape(-1)
        flat = h.reshape(-1, h.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        use_a = torch.rand(g.shape, generator=generator, device=g.device, dtype=g.dtype) < g
        for mask, table in ((use_a, self.table_a.weight), (~use_a, self.table_b.weight)):
            if mask.any():
                probs = F.softmax(float_logits(flat[mask], table), dim=-1)
                out[mask] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        redo = (out >= vocab_size).nonzero().squeeze(1) if vocab_size is not None else out[:0]
        if redo.numel():  # rare once trained (about 1e-4 of the draws): g pA + (1 - g) pB over the ids
            pa = F.softmax(float_logits(flat[redo], self.table_a.weight), dim=-1)[:, :vocab_size]
            pb = F.softmax(float_logits(flat[redo], self.table_b.weight), dim=-1)[:, :vocab_size]
            chance = g[redo, None].to(pa.dtype)
            out[redo] = torch.multinomial(chance * pa + (1 - chance) * pb, 1, generator=generator).squeeze(1)
        return out.view(h.shape[:-1])

    @torch.no_grad()
    def sample_static(
        self, h: torch.Tensor, input_ids: torch.Tensor, noise: torch.Tensor, vocab_size: int | None = None
    ) -> torch.Tensor:
        """`sample` without host syncs or data-dependent shapes (static decode steps), from uniform
        noise [B, V + 1]: component A where noise[:, 0] < g[x_t], then the Gumbel-max argmax of that
        table's logits with noise[:, 1:]. h [B, d], input_ids [B] -> tokens [B]. With one row the
        table is picked by index inside the product, which a compiled step fuses into one pass over
        that table only (one projection; run eagerly, the row's table is picked on the host); with
        several rows both products run and each row keeps its own (rows may pick different tables).
        Only ids below `vocab_size` (None: any) are drawn: here the chosen table is renormalized
        over them (a redraw has no place in a static step), which differs from the mixture `sample`
        draws by at most the probability the tables give their padding rows. Serving context only."""
        if not self._serving:
            raise RuntimeError("sample_static runs inside `with head.serving():`")
        use_a = noise[:, 0] < self._chance_of_a(input_ids)
        wide = torch.promote_types(h.dtype, torch.float32)
        if h.shape[0] == 1 and not torch.compiler.is_compiling():
            logits = float_logits(h, (self.table_a.weight if bool(use_a) else self.table_b.weight)[:vocab_size])
        elif h.shape[0] == 1:
            table = self.serving_tensors()[2][(~use_a).long(), :vocab_size]  # [1, V, d]: A or B
            logits = (table.to(wide) * h.to(wide)[:, None, :]).sum(-1)
        else:
            a, b = self.table_a.weight[:vocab_size], self.table_b.weight[:vocab_size]
            logits = torch.where(use_a[:, None], float_logits(h, a), float_logits(h, b))
        noise = noise[:, 1:][:, : logits.shape[-1]]
        gumbel = -torch.log(-torch.log(noise.clamp_min(torch.finfo(noise.dtype).tiny)))
        return (logits + gumbel.to(logits.dtype)).argmax(-1)

    # -- accounting ----------------------------------------------------------------------------
    @staticmethod
    def embedding_params(cfg: ModelConfig) -> int:
        return 2 * cfg.vocab_size * cfg.d_model

    @staticmethod
    def extra_params(cfg: ModelConfig) -> int:
        return cfg.d_model

    @staticmethod
    def matmul_params_per_token(cfg: ModelConfig) -> int:
        return 2 * cfg.vocab_size * cfg.d_model + cfg.d_model
