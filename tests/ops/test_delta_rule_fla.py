"""fla's Triton kernels for the gated delta rule (`gdn_backend` fla / auto on CUDA), through the custom
ops of ops/delta_rule_fla.py, eager and compiled, against the chunked PyTorch form, which
tests/ops/test_delta_rule.py holds to the step-by-step recurrence: outputs, final state and the
gradients of q, k, v, β, g and the initial state, in fp32 at odd lengths (a padded last chunk); a
GDN-hybrid model compiled with fla inside its one graph. Needs a CUDA GPU and fla-core
(`pip install 'tango-lm[gdn]'`)."""

from __future__ import annotations

import pytest
import torch

from tango_lm.ops import delta_rule_fla
from tango_lm.ops.delta_rule import delta_rule_chunked, gated_delta_rule
from tests.ops.test_delta_rule import inputs, rel_err

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def full_fp32():
    """No TF32 in the reference's matmuls: fp32 is compared with fp32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("t", [63, 200])
def test_fla_matches_the_chunked_form(t, compiled):
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    # fla's kernels take d_k, d_v of 16 and up; q carries its 1/sqrt(d_k) scale, as the GDN layer passes it.
    q, k, v, beta, g, s0 = (x.float().cuda() for x in inputs(2, 3, t, 32, 48, seed=t))
    args = [x.requires_grad_() for x in (q * 32**-0.5, k, v, beta, g, s0)]
    weights = None
    results = []
    torch._dynamo.reset()
    fla = torch.compile(gated_delta_rule, fullgraph=True, dynamic=False) if compiled else gated_delta_rule
    for fn, backend in ((fla, "fla"), (gated_delta_rule, "torch")):
        o, s = fn(*args, chunk=64, backend=backend)
        if weights is None:
            weights = [torch.randn_like(o), torch.randn_like(s)]
        grads = torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), args)
        results.append((o, s, grads))
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < 2e-3 and rel_err(s, s_ref) < 2e-3
    for name, grad, grad_ref in zip(("q", "k", "v", "beta", "g", "state"), grads, grads_ref, strict=True):
        assert rel_err(grad, grad_ref) < 5e-3, name


def test_opcheck_with_fla():
    # The fakes against fla's real kernels (shapes, dtypes, strides), bf16 as under autocast.
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    q, k, v, beta, g, s0 = (x.float().cuda() for x in inputs(2, 3, 100, 32, 48, seed=2))
    q, k, v = (x.transpose(1, 2).bfloat16().contiguous().requires_grad_() for x in (q * 32**-0.5, k, v))
    g, beta = (x.transpose(1, 2).contiguous().requires_grad_() for x in (g, beta))
    for h0 in (None, s0.requires_grad_()):
        torch.library.opcheck(delta_rule_fla._fwd, (q, k, v, g, beta, h0, False))
        o, final, g_cum, a = delta_rule_fla._fwd(q, k, v, g, beta, h0, False)
        saved = [None if x is None else x.detach() for x in (q, k, v, g, beta, h0, g_cum, a)]
        torch.library.opcheck(delta_rule_fla._bwd, (*saved, torch.randn_like(o), torch.randn_like(final), False))


def test_auto_is_fla_on_cuda():
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    q, k, v, beta, g, s0 = (x.float().cuda() for x in inputs(1, 2, 40, 16, 16, seed=1))
    o_auto, _ = gated_delta_rule(q, k, v, beta, g, s0, backend="auto")
    o_fla, _ = gated_delta_rule(q, k, v, beta, g, s0, backend="fla")
    o_torch, _ = delta_rule_chunked(q, k, v, beta, g, s0)
    assert torch.equal(o_auto, o_fla) and not torch.equal(o_auto, o_torch)


def test_compiled_gdn_model_runs_fla_in_one_graph():
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    from tango_lm import ModelConfig, build_model

    torch.manual_seed(0)
    config = ModelConfig(
        arch="gdn-hybrid", d_model=64, head_dim=16, width=128, depth=2, vocab_size=61, context_length=80,
        n_kv_heads=2, attention_every=2, gdn_head_dim=16,
    )  # fmt: skip
    model = build_model(config).cuda().train()
    x, y = (torch.randint(0, 61, (2, 80), device="cuda") for _ in range(2))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.nll)(x, y)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "tango_lm.gdn_chunk_fwd.default" in ops, sorted(ops)
    torch._dynamo.reset()
    losses, grads = [], []
    for fn in (model.nll, torch.compile(model.nll, fullgraph=True, dynamic=False)):
        model.zero_grad(set_to_none=True)
        loss = fn(x, y)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for name, grad in grads[0].items():
        assert rel_err(grads[1][name], grad) < 1e-3, name
