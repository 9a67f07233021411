"""Whole models on the GPU (`cuda` marker; skipped without one, run by `tools/gpu_check.sh`).

Every architecture (with the Standard head) and every head (on TANGO), plus TANGO's rotating narrow
width, each as a tiny model with the same weights on both devices:

- CUDA fp32 (the default kernels: Triton for the TANGO family, GAU and FLASH where triton is installed, else the
  sliced SDPA or the composition) against the CPU float64 model: log-probs, loss and every parameter's gradient;
- bf16 autocast on CUDA: loss within 3% of the float64 loss;
- cached decoding on CUDA reproduces the full forward's log-probs.
"""

from __future__ import annotations

import pytest
import torch

from tango_lm import ModelConfig
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.ops import tango_mix as tango_mix_module
from tests import arch_cases
from tests.float64_twin import assert_gradients_close, loss_and_grads, record_triton_calls, twin_models

pytestmark = pytest.mark.cuda
CASES = (
    [(arch, "standard", None) for arch in sorted(ARCHITECTURES)]
    + [("tango", head, None) for head in sorted(HEADS) if head != "standard"]
    + [(arch, "standard", 8) for arch, a in sorted(ARCHITECTURES.items()) if a.rotating_width and a.triton_ops]
)  # rotating width: 8 of 12 per head


def tiny_config(arch: str, head: str, active_width: int | None) -> ModelConfig:
    return arch_cases.tiny_config(arch, head=head, vocab_size=97, context_length=64, active_width=active_width)


@pytest.fixture(autouse=True)
def full_fp32():
    """No TF32 anywhere (cuDNN convolutions use it by default): fp32 is compared with float64."""
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def models(cfg: ModelConfig) -> tuple[torch.nn.Module, torch.nn.Module]:
    return twin_models(cfg, "cuda")


@pytest.mark.parametrize(("arch", "head", "active_width"), CASES)
def test_cuda_model_matches_cpu_float64(monkeypatch, arch, head, active_width):
    cfg = tiny_config(arch, head, active_width)
    cpu, gpu = models(cfg)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (2, 45), generator=gen) for _ in range(2))  # odd T

    triton = tango_mix_module.tango_mix_triton is not None
    triton_calls = record_triton_calls(monkeypatch)
    with torch.no_grad():
        torch.testing.assert_close(gpu(x.cuda()).double().cpu(), cpu(x), rtol=1e-4, atol=2e-4)
    loss64, grads64 = loss_and_grads(cpu, x, y)
    loss32, grads32 = loss_and_grads(gpu, x.cuda(), y.cuda())
    torch.testing.assert_close(loss32.double().cpu(), loss64, rtol=1e-5, atol=1e-5)
    assert_gradients_close(grads32, grads64)
    if triton:  # the ops Architecture.triton_ops names, and no other
        assert set(triton_calls) == set(ARCHITECTURES[arch].triton_ops), "the mixing did not run on its Triton kernels"

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_bf16 = gpu.nll(x.cuda(), y.cuda()).float().cpu()
    # bf16 moves it by at most 1e-4 of the loss here; zeroing TANGO's mixer moves it by 0.27%
    assert abs(loss_bf16.double() / loss64 - 1) < 2e-3, (loss_bf16.item(), loss64.item())


@pytest.mark.parametrize(("arch", "head", "active_width"), [c for c in CASES if c[1] in ("standard", "onona")])
def test_cuda_cached_decoding_reproduces_the_full_forward(arch, head, active_width):
    _, gpu = models(tiny_config(arch, head, active_width))
    gpu.eval()
    x = torch.randint(0, 97, (2, 41), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        full = gpu(x)
        cache = gpu.new_cache()
        pieces = [gpu(x[:, :13], cache)]  # prefill
        pieces += [gpu(x[:, i : i + 1], cache) for i in range(13, 30)]  # one token at a time
        pieces.append(gpu(x[:, 30:], cache))  # a chunk after single steps
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)
