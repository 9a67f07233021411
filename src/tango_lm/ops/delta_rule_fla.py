"""fla's gated-delta-rule kernels as `torch.library` custom ops, so `torch.compile` keeps them in its graph.

fla's public entry point (`chunk_gated_delta_rule`) is `torch.compiler.disable`d: a graph break in
every GDN layer. Its forward and backward (`chunk_gated_delta_rule_fwd` / `_bwd` of
`fla/ops/gated_delta_rule/chunk.py`, fla-core 0.6) are wrapped here as two custom ops with fake
implementations and an autograd formula, as fla's own autograd Function composes them:

    tango_lm::gdn_chunk_fwd(q, k, v, g, beta, h0)  -> o, final state, g_cum, A
    tango_lm::gdn_chunk_bwd(q, k, v, g, beta, h0, g_cum, A, do, dht) -> dq, dk, dv, dg, dbeta, dh0

in fla's layout: q, k [B, T, H, d_k], v [B, T, H, d_v], g = log α and β [B, T, H], the state
[B, H, d_k, d_v] fp32 (h0 optional), q pre-scaled (scale 1). `g_cum` (the chunk-local cumulative
gates, fp32 [B, T, H]) and `A` (each chunk's (I + A)⁻¹, k's dtype [B, T, H, 64]) are what fla's
forward saves for its backward.

The ops run whatever `gdn_kernel()` returns: fla's internals where they import, else the chunked
PyTorch form (`CHUNKED`, which leaves g_cum and A unused and recomputes its backward through
autograd). That one lookup is how the CPU tests run the same ops, fakes and autograd with the
chunked form standing in for fla. With `fallback=True` (`gdn_backend=auto`) a failing fla kernel
logs one line and the chunked form runs instead, forward and backward, for every later call with
the same head sizes, dtype and device; the decision is taken at run time, so it holds inside a
compiled graph too.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch

from tango_lm.errors import UserError

log = logging.getLogger(__name__)

FLA_CHUNK = 64  # fla's default chunk size, the shape of the saved A
FLA_TESTED = "0.6"
# The parameters of fla's internals that the ops pass by name (fla-core 0.6).
_FWD_PARAMS = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"}
_BWD_PARAMS = {"q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht"}


class GdnKernel(NamedTuple):
    """A gated-delta-rule implementation in fla's layout. `forward(q, k, v, g, beta, h0)` returns
    (o, final state, g_cum, A); `backward(q, k, v, g, beta, h0, g_cum, A, do, dht)` returns
    (dq, dk, dv, dg, dbeta, dh0 or None)."""

    name: str
    forward: Callable[..., tuple]
    backward: Callable[..., tuple]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _chunked_forward(q, k, v, g, beta, h0):
    """The chunked PyTorch form behind the ops' interface; g_cum and A are fla's residuals, unused here."""
    from tango_lm.ops.delta_rule import delta_rule_chunked  # delta_rule imports this module

    o, final = delta_rule_chunked(*(_heads_first(x) for x in (q, k, v, beta, g)), h0, FLA_CHUNK)
    b, t, h, _ = k.shape
    g_cum = g.float().contiguous().clone()
    return _heads_first(o).to(q.dtype).contiguous(), final.float().contiguous(), g_cum, k.new_zeros(b, t, h, FLA_CHUNK)


def _autograd_inside_op():
    """Autograd back on inside a custom op's implementation, which runs with the autograd (and
    autocast) dispatch keys excluded. `torch.func.vjp` would also do, but not under the dispatch
    modes (`opcheck`'s, `FlopCounterMode`) that cannot see through its tensor wrappers."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _chunked_backward(q, k, v, g, beta, h0, g_cum, A, do, dht):
    """The chunked form's gradients, recomputed from the inputs through autograd."""
    with _autograd_inside_op(), torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in ((q, k, v, g, beta) if h0 is None else (q, k, v, g, beta, h0))]
        o, final, _, _ = _chunked_forward(*inputs[:5], inputs[5] if h0 is not None else None)
        outputs, seeds = ((o,), (do.to(o.dtype),)) if dht is None else ((o, final), (do.to(o.dtype), dht))
        grads = torch.autograd.grad(outputs, inputs, seeds)
    grads = [x.contiguous() for x in grads]
    return (*grads[:5], grads[5] if h0 is not None else None)


CHUNKED = GdnKernel("chunked", _chunked_forward, _chunked_backward)


class FlaUnavailable(Exception):
    """fla-core is missing, or its internals are not the ones these ops were written against."""


def _fla_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return "(version unknown)"


@functools.cache
def fla_kernel_or_reason() -> GdnKernel | str:
    """fla's forward and backward as a `GdnKernel`, or why not (a one-line reason)."""
    try:
        import fla.ops.gated_delta_rule.chunk as chunk
    except Exception as exc:  # ImportError, or a Triton/CUDA mismatch raised at import
        return f"fla-core does not import ({type(exc).__name__}: {str(exc).strip()[:120]})"
    fwd = getattr(chunk, "chunk_gated_delta_rule_fwd", None)
    bwd = getattr(chunk, "chunk_gated_delta_rule_bwd", None)
    if (
        fwd is None
        or bwd is None
        or not (
            _FWD_PARAMS <= set(inspect.signature(fwd).parameters)
            and _BWD_PARAMS <= set(inspect.signature(bwd).parameters)
        )
    ):
        return (
            f"fla-core {_fla_version()}'s chunk_gated_delta_rule_fwd/_bwd are not the ones tango-lm "
            f"wraps (tested with fla-core {FLA_TESTED}): install fla-core=={FLA_TESTED}.* or use gdn_backend=torch"
        )

    def forward(q, k, v, g, beta, h0):
        with torch.cuda.device(q.device):
            out = fwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
                scale=1.0, initial_state=h0, output_final_state=True,
            )  # fmt: skip
        if len(out) != 6:
            raise RuntimeError(
                f"fla-core {_fla_version()}'s chunk_gated_delta_rule_fwd returned {len(out)} values, not 6"
            )
        g_cum, o, A, final = out[:4]  # (g, o, A, final_state, initial_state, g_input) in 0.6
        return o.to(q.dtype), final, g_cum, A

    def backward(q, k, v, g, beta, h0, g_cum, A, do, dht):
        with torch.cuda.device(q.device):
            dq, dk, dv, db, dg, dh0 = bwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g_cum, beta=beta.contiguous(), A=A,
                scale=1.0, initial_state=h0, do=do.contiguous(), dht=dht,
            )[:6]  # fmt: skip
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), dh0

    return GdnKernel("fla", forward, backward)


@torch.compiler.assume_constant_result  # a constant of the graph (Dynamo does not trace the import)
def fla_unavailable_reason() -> str:
    """Why fla cannot run the ops (fla-core missing, or its internals moved), or "" where it can."""
    reason = fla_kernel_or_reason()
    return "" if isinstance(reason, GdnKernel) else reason


def fla_available() -> bool:
    """Whether fla-core imports and has the internals the ops wrap."""
    return not fla_unavailable_reason()


def gdn_kernel() -> GdnKernel:
    """The implementation the custom ops run: `fla_kernel_or_reason()`'s, the one lookup (the CPU
    tests replace that function with one returning `CHUNKED`)."""
    kernel = fla_kernel_or_reason()
    if isinstance(kernel, str):
        raise FlaUnavailable(kernel)
    return kernel


_FELL_BACK: set[tuple] = set()  # (d_k, d_v, dtype, device) where fla failed under `auto`


@functools.cache
def _log_fallback_once(reason: str) -> None:
    log.warning("gdn_backend=auto: fla's kernel failed (%s); running the chunked PyTorch form", reason)


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _signature(q: torch.Tensor, v: torch.Tensor) -> tuple:
    return (q.shape[-1], v.shape[-1], q.dtype, str(q.device))


def _run(fallback: bool, q: torch.Tensor, v: torch.Tensor, method: str, *args):
    """`gdn_kernel()`'s forward or backward, or with `fallback` the chunked form's once fla has failed."""
    if fallback and _signature(q, v) in _FELL_BACK:
        return getattr(CHUNKED, method)(*args)
    try:
        return getattr(gdn_kernel(), method)(*args)
    except torch.OutOfMemoryError:
        raise  # the chunked form needs more memory, not less: never a fallback for this
    except Exception as exc:  # e.g. a head size or GPU fla's kernels do not take
        if not fallback:
            raise
        _FELL_BACK.add(_signature(q, v))
        _log_fallback_once(_first_line(exc))
        return getattr(CHUNKED, method)(*args)


@torch.library.custom_op("tango_lm::gdn_chunk_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    fallback: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _run(fallback, q, v, "forward", q, k, v, g, beta, h0)


@_fwd.register_fake
def _fwd_fake(q, k, v, g, beta, h0, fallback):
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    return (
        v.new_empty(b, t, h, dv, dtype=q.dtype),
        q.new_empty(b, h, dk, dv, dtype=torch.float32),
        g.new_empty(b, t, h, dtype=torch.float32),
        k.new_empty(b, t, h, FLA_CHUNK),
    )


@torch.library.custom_op("tango_lm::gdn_chunk_bwd", mutates_args=())
def _bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor | None,
    g_cum: torch.Tensor,
    A: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    fallback: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv, dg, dbeta, dh0 = _run(fallback, q, v, "backward", q, k, v, g, beta, h0, g_cum, A, do, dht)
    return dq, dk, dv, dg, dbeta, q.new_empty(0) if dh0 is None else dh0.float()  # a schema has no optional outputs


@_bwd.register_fake
def _bwd_fake(q, k, v, g, beta, h0, g_cum, A, do, dht, fallback):
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        g.new_empty(g.shape),
        beta.new_empty(beta.shape),
        q.new_empty(0) if h0 is None else h0.new_empty(h0.shape, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, h0, fallback = inputs
    _, _, g_cum, A = output
    ctx.fallback = fallback
    ctx.has_h0 = h0 is not None
    ctx.save_for_backward(q, k, v, g, beta, h0, g_cum, A)


def _backward(ctx, do, dht, _dg_cum, _dA):
    q, k, v, g, beta, h0, g_cum, A = ctx.saved_tensors
    dq, dk, dv, dg, dbeta, dh0 = _bwd(q, k, v, g, beta, h0, g_cum, A, do, dht, ctx.fallback)
    return dq, dk, dv, dg, dbeta, dh0 if ctx.has_h0 else None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


def gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor | None = None,
    fallback: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule through the custom ops, in `delta_rule_recurrent`'s layout and argument
    order (q, k [B, H, T, d_k], ..., q pre-scaled) -> (o [B, H, T, d_v] in v's dtype, final state fp32).
    Raises `UserError` where fla is not usable and `gdn_kernel()` is fla's."""
    o, final, _, _ = _fwd(
        *(_heads_first(x).contiguous() for x in (q, k, v)),
        _heads_first(g).float().contiguous(),
        _heads_first(beta).contiguous(),
        None if state is None else state.float(),
        fallback,
    )
    return _heads_first(o).to(v.dtype), final


def require_fla() -> None:
    """One line naming the extra (or the tested version) where fla cannot run the ops."""
    reason = fla_unavailable_reason()
    if "does not import" in reason:
        raise UserError("model.gdn_backend=fla needs fla's kernels: pip install 'tango-lm[gdn]' (or use auto)")
    if reason:
        raise UserError(f"model.gdn_backend=fla: {reason}")
