"""Whole models on the Triton kernels without a GPU: the architectures whose mixing has Triton
kernels (the TANGO family, GAU, FLASH), TANGO's rotating narrow width and onóna's head, as tiny
models in fp32 with every op on `triton` (CPU tensors in Triton's interpreter, conftest.py) against
the same model in float64 on the CPU's own ops: log-probs, loss and every parameter's gradient; and
bf16 autocast's loss within 3%. The model-level half of what `tests/models/test_cuda_models.py`
checks on a GPU, so the layers' calls into the kernels (shapes, strides, the narrow segment, the
compact controller's average without u) are proven before a GPU sees them."""

from __future__ import annotations

import pytest
import torch

from tango_lm.models.registry import ARCHITECTURES
from tango_lm.ops import dispatch
from tests import arch_cases
from tests.float64_twin import assert_gradients_close, loss_and_grads, record_triton_calls, twin_models

triton_common = pytest.importorskip(
    "tango_lm.ops.triton_common", exc_type=ImportError, reason="triton is not installed"
)
if not triton_common.INTERPRETED:
    pytest.skip("CPU tensors reach the Triton kernels only with TRITON_INTERPRET=1", allow_module_level=True)


# Every architecture whose mixing runs on Triton (`Architecture.triton_ops`), a twin-table head,
# and rotating width (8 of 12 columns per head, a middle segment) on the distinct ops that take it.
TRITON = [arch for arch in arch_cases.names() if ARCHITECTURES[arch].triton_ops]
ROTATING = {ARCHITECTURES[a].triton_ops: a for a in reversed(TRITON) if ARCHITECTURES[a].rotating_width}
CASES = [
    *((arch, "standard", None) for arch in TRITON),
    ("tango", "onona", None),
    *((arch, "standard", 8) for arch in sorted(ROTATING.values())),
]


@pytest.mark.parametrize(("arch", "head", "active_width"), CASES)
def test_triton_model_matches_float64(monkeypatch, arch, head, active_width):
    cfg = arch_cases.tiny_config(arch, head=head, vocab_size=97, context_length=64, active_width=active_width)
    ref, model = twin_models(cfg, "cpu")
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (1, 29), generator=gen) for _ in range(2))  # odd T, two query blocks

    calls = record_triton_calls(monkeypatch)
    monkeypatch.setenv(dispatch.ENV, "reference")
    loss64, grads64 = loss_and_grads(ref, x, y)
    with torch.no_grad():
        want = ref(x)
    assert not calls  # float64: no Triton kernel takes it
    monkeypatch.setenv(dispatch.ENV, "triton")
    with torch.no_grad():
        torch.testing.assert_close(model(x).double(), want, rtol=1e-4, atol=2e-4)
    loss32, grads32 = loss_and_grads(model, x, y)
    assert set(calls) == set(ARCHITECTURES[arch].triton_ops), "the mixing did not run on its Triton kernels"
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-5)
    assert_gradients_close(grads32, grads64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = model.nll(x, y).float()
    # bf16 moves it by at most 1e-4 of the loss here; zeroing TANGO's mixer moves it by 0.27%
    assert abs(loss_bf16.double() / loss64 - 1) < 2e-3, (loss_bf16.item(), loss64.item())
