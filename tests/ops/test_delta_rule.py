"""The chunkwise-parallel gated delta rule (ops/delta_rule.py) against its step-by-step reference:
outputs, final states and gradients in float64 at odd lengths and chunks that do not divide T;
compiled (AOTAutograd, one graph) against eager. The fla custom ops' plumbing: tests/ops/test_delta_rule_ops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tango_lm.ops import delta_rule, delta_rule_fla
from tango_lm.ops.delta_rule import delta_rule_chunked, delta_rule_recurrent, gated_delta_rule


def inputs(b: int, h: int, t: int, dk: int, dv: int, seed: int = 0, dtype=torch.float64, state: bool = True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dk, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(b, h, t, dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, h, t, dv, generator=g, dtype=dtype)
    beta = torch.rand(b, h, t, generator=g, dtype=dtype)
    log_alpha = -torch.rand(b, h, t, generator=g, dtype=dtype) * 0.5
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=dtype) if state else None
    return q, k, v, beta, log_alpha, s0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("t", [1, 7, 63, 130])
@pytest.mark.parametrize("chunk", [5, 16, 64])  # remainders 2, 3 (63 % 5), 15, 2: a padded last chunk
def test_chunked_matches_recurrent_outputs_and_gradients(t, chunk):
    args = [x.requires_grad_() for x in inputs(2, 3, t, 8, 6, seed=t)]
    o_ref, s_ref = delta_rule_recurrent(*args)
    o, s = delta_rule_chunked(*args, chunk=chunk)
    assert o.shape == o_ref.shape == (2, 3, t, 6) and s.shape == (2, 3, 8, 6)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10
    weights = [torch.randn_like(o_ref), torch.randn_like(s_ref)]
    grads_ref = torch.autograd.grad((o_ref * weights[0]).sum() + (s_ref * weights[1]).sum(), args)
    grads = torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), args)
    for name, g, g_ref in zip(("q", "k", "v", "beta", "g", "state"), grads, grads_ref, strict=True):
        assert rel_err(g, g_ref) < 1e-10, name


def test_zero_initial_state_is_the_default():
    q, k, v, beta, g, s0 = inputs(1, 2, 20, 4, 4, state=False)
    o, s = delta_rule_chunked(q, k, v, beta, g, chunk=8)
    o0, s_zero = delta_rule_chunked(q, k, v, beta, g, torch.zeros(1, 2, 4, 4, dtype=torch.float64), chunk=8)
    torch.testing.assert_close(o, o0)
    torch.testing.assert_close(s, s_zero)


def test_splitting_a_sequence_carries_the_state():
    q, k, v, beta, g, s0 = inputs(2, 2, 45, 8, 5)
    o_full, s_full = delta_rule_chunked(q, k, v, beta, g, s0, chunk=16)
    o1, s1 = delta_rule_chunked(q[:, :, :19], k[:, :, :19], v[:, :, :19], beta[:, :, :19], g[:, :, :19], s0, chunk=16)
    o2, s2 = delta_rule_chunked(q[:, :, 19:], k[:, :, 19:], v[:, :, 19:], beta[:, :, 19:], g[:, :, 19:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s2, s_full, rtol=1e-12, atol=1e-12)


def test_recurrence_is_the_spec_equation():
    """S_t = S_{t-1}(α(I - β k kᵀ)) + β v kᵀ, o = S q, with S = Mᵀ (one step, written out)."""
    q, k, v, beta, g, s0 = inputs(1, 1, 1, 3, 2)
    o, m = delta_rule_recurrent(q, k, v, beta, g, s0)
    s_prev, kk, vv, qq = s0[0, 0].T, k[0, 0, 0], v[0, 0, 0], q[0, 0, 0]
    a, b = g[0, 0, 0].exp(), beta[0, 0, 0]
    s = s_prev @ (a * (torch.eye(3, dtype=torch.float64) - b * torch.outer(kk, kk))) + b * torch.outer(vv, kk)
    torch.testing.assert_close(m[0, 0].T, s)
    torch.testing.assert_close(o[0, 0, 0], s @ qq)


def test_strong_decay_stays_finite_in_fp32():
    q, k, v, beta, g, s0 = inputs(1, 2, 100, 8, 8, dtype=torch.float32)
    o, s = delta_rule_chunked(q, k, v, beta, g * 200, s0)  # α down to e^-100 within a chunk
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g * 200, s0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < 1e-4


def test_state_stays_fp32_under_autocast():
    # bf16 products, fp32 sums: the state carried across chunks (and returned) is fp32, as fla keeps it.
    q, k, v, beta, g, s0 = (x.float() for x in inputs(2, 2, 50, 8, 8, seed=4))
    o_ref, s_ref = delta_rule_recurrent(*(x.double() for x in (q, k, v, beta, g, s0)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = delta_rule_chunked(q, k, v, beta, g, s0, chunk=8)
    assert o.dtype == s.dtype == torch.float32
    assert rel_err(o.double(), o_ref) < 2e-2 and rel_err(s.double(), s_ref) < 2e-2


def test_dispatch_never_sends_cpu_tensors_to_fla(monkeypatch):
    # fla's kernels need CUDA: on CPU tensors every backend runs the chunked form, installed or not.
    calls = []
    recording = delta_rule_fla.GdnKernel("recording", lambda *x: calls.append(x), lambda *x: calls.append(x))
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: recording)
    q, k, v, beta, g, s0 = inputs(1, 2, 10, 4, 4)
    for backend in ("auto", "torch", "fla"):
        o, s = gated_delta_rule(q, k, v, beta, g, s0, chunk=4, backend=backend)
        o_ref, s_ref = delta_rule_chunked(q, k, v, beta, g, s0, chunk=4)
        assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert not calls


def test_auto_and_fla_take_fla_on_cuda_eager_and_compiled():
    # fla's kernels are custom ops inside the graph (ops/delta_rule_fla.py), so `auto` needs no
    # compile-time exception; `torch` is the chunked form everywhere.
    assert [delta_rule.wants_fla(b, True) for b in ("auto", "torch", "fla")] == [True, False, True]
    assert not any(delta_rule.wants_fla(b, False) for b in ("auto", "torch", "fla"))
    torch._dynamo.reset()

    def choices(x):
        return x + torch.tensor([delta_rule.wants_fla(b, True) for b in ("auto", "torch", "fla")])

    compiled = torch.compile(choices, fullgraph=True, backend="eager")
    assert compiled(torch.zeros(3, dtype=torch.long)).tolist() == [1, 0, 1]
    torch._dynamo.reset()


def test_compiled_chunked_matches_eager_outputs_and_gradients():
    # The graph and its backward through AOTAutograd ("aot_eager": inductor's code generation is slow on
    # a 2-core CPU; tests/train/test_compile.py compiles the whole GDN model the same way).
    torch._dynamo.reset()
    args = [x.requires_grad_() for x in inputs(2, 3, 13, 8, 6, seed=3, dtype=torch.float32)]
    compiled = torch.compile(delta_rule_chunked, fullgraph=True, dynamic=False, backend="aot_eager")
    results = []
    for fn in (delta_rule_chunked, compiled):
        o, s = fn(*args, chunk=4)
        weights = torch.linspace(-1, 1, o.numel()).reshape(o.shape)
        grads = torch.autograd.grad((o * weights).sum() + s.square().sum(), args)
        results.append((o, s, grads))
    (o, s, grads), (o_c, s_c, grads_c) = results
    torch.testing.assert_close(o_c, o)
    torch.testing.assert_close(s_c, s)
    for name, g, g_c in zip(("q", "k", "v", "beta", "g", "state"), grads, grads_c, strict=True):
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(g_c, g, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("state", [True, False])
def test_no_position_returns_an_empty_output_and_the_state_unchanged(state):
    q, k, v, beta, g, s0 = inputs(2, 3, 0, 8, 6, state=state)
    o, s = gated_delta_rule(q, k, v, beta, g, s0, chunk=16)
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, g, s0)
    assert o.shape == o_ref.shape == (2, 3, 0, 6)
    torch.testing.assert_close(s, s_ref)
