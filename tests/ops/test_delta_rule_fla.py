"""fla's Triton kernel for the gated delta rule (`gdn_backend` fla / auto on CUDA) against the
chunked PyTorch form, which tests/ops/test_delta_rule.py holds to the step-by-step recurrence:
outputs, final state and the gradients of q, k, v, β, g and the initial state, in fp32 at odd
lengths (a padded last chunk). Needs a CUDA GPU and fla-core (`pip install 'tango-lm[gdn]'`)."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("t", [63, 200])
def test_fla_matches_the_chunked_form(t):
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    # fla's kernels take d_k, d_v of 16 and up; q carries its 1/sqrt(d_k) scale, as the GDN layer passes it.
    q, k, v, beta, g, s0 = (x.float().cuda() for x in inputs(2, 3, t, 32, 48, seed=t))
    args = [x.requires_grad_() for x in (q * 32**-0.5, k, v, beta, g, s0)]
    weights = None
    results = []
    for backend in ("fla", "torch"):
        o, s = gated_delta_rule(*args, chunk=64, backend=backend)
        if weights is None:
            weights = [torch.randn_like(o), torch.randn_like(s)]
        grads = torch.autograd.grad((o * weights[0]).sum() + (s * weights[1]).sum(), args)
        results.append((o, s, grads))
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert rel_err(o, o_ref) < 2e-3 and rel_err(s, s_ref) < 2e-3
    for name, grad, grad_ref in zip(("q", "k", "v", "beta", "g", "state"), grads, grads_ref, strict=True):
        assert rel_err(grad, grad_ref) < 5e-3, name


def test_auto_is_fla_on_cuda_in_eager_mode():
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed: pip install 'tango-lm[gdn]'")
    q, k, v, beta, g, s0 = (x.float().cuda() for x in inputs(1, 2, 40, 16, 16, seed=1))
    o_auto, _ = gated_delta_rule(q, k, v, beta, g, s0, backend="auto")
    o_fla, _ = gated_delta_rule(q, k, v, beta, g, s0, backend="fla")
    o_torch, _ = delta_rule_chunked(q, k, v, beta, g, s0)
    assert torch.equal(o_auto, o_fla) and not torch.equal(o_auto, o_torch)
