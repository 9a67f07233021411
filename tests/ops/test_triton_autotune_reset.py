"""The autotuner's timing runs launch a kernel again and again on the real buffers: a buffer the
kernel adds into atomically (dQ, dK, the bias's and the prefix factors' gradients, the row sums D)
must be in its `reset_to_zero`, or the result carries every timing run's share too, on the first
launch of each shape and on a GPU only (the tests' interpreter has one configuration and times
nothing). Here every tuner times its admitted hardware configurations under the interpreter, each
"timing" running the kernel twice, and the op's outputs and gradients must equal those of an
untimed launch of the configuration the timing picks (all time alike: the first)."""

from __future__ import annotations

import pytest
import torch

triton_common = pytest.importorskip(
    "tango_lm.ops.triton_common",
    exc_type=ImportError,
    reason="triton is not installed (pip install 'tango-lm[triton]')",
)

from tango_lm.ops import (  # noqa: E402
    relu2_attention_triton,
    relu2_attention_triton_kernels,
    tango_mix_triton,
    tango_mix_triton_kernels,
    windowed_triton,
)
from tango_lm.ops.windowed import band_weights  # noqa: E402
from tests.triton_configurations import tuners  # noqa: E402

pytestmark = pytest.mark.skipif(not triton_common.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")


def _draw(gen, *shape, dtype=torch.bfloat16, std=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dtype).requires_grad_(True)


def _tango_mix(gen):
    q, k = _draw(gen, 1, 2, 70, 24, std=0.5), _draw(gen, 1, 2, 70, 24, std=0.5)
    a, u = _draw(gen, 1, 70, 2 * 68), _draw(gen, 1, 70, 2 * 68)
    return (q, k, a, u), lambda *xs: tango_mix_triton.tango_mix_triton(*xs)


def _windowed(gen):
    qk = [_draw(gen, 1, 2, 70, 24, std=0.5) for _ in range(4)]
    a, u = _draw(gen, 1, 70, 2 * 68), _draw(gen, 1, 70, 2 * 68)

    def op(q_rot, k_rot, q_raw, k_raw, a, u):
        weights, prefix_q, pk = band_weights(q_rot, k_rot, q_raw, k_raw, 5, "elu+1", 8)
        return windowed_triton.windowed_band_mix_triton(weights, prefix_q, pk, a, u)

    return (*qk, a, u), op


def _relu2(gen):
    q, k = _draw(gen, 2, 70, 40, std=40**-0.25), _draw(gen, 2, 70, 40, std=40**-0.25)
    v, bias = _draw(gen, 2, 70, 68), _draw(gen, 2 * 70 - 1, dtype=torch.float32, std=0.5)
    return (q, k, v, bias), lambda *xs: relu2_attention_triton.relu2_attention_triton(*xs, 0.7)


OPS = {
    "tango_mix": (tango_mix_triton_kernels, _tango_mix),
    "windowed": (windowed_triton, _windowed),
    "relu2": (relu2_attention_triton_kernels, _relu2),
}


def _run(op, xs):
    y = op(*xs)
    dy = torch.linspace(-1.0, 1.0, y.numel(), dtype=torch.float64).view_as(y).to(y.dtype)
    return (y, *torch.autograd.grad(y, xs, dy))


@pytest.mark.parametrize("name", sorted(OPS))
def test_timing_runs_leave_no_trace_in_atomically_accumulated_buffers(monkeypatch, name):
    module, make = OPS[name]
    xs, op = make(torch.Generator().manual_seed(0))
    every = tuners(module)
    for tuner in every.values():
        monkeypatch.setattr(tuner, "configs", tuner.hardware_configs)
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "configs_timings", {}, raising=False)
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "0")
    want = _run(op, xs)  # each kernel's first admitted configuration, untimed

    timed = []

    def time_twice(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        timed.append(1)
        return [1.0] * len(quantiles)

    for tuner in every.values():
        monkeypatch.setattr(tuner, "cache", {})
        monkeypatch.setattr(tuner, "do_bench", time_twice)
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "1")
    got = _run(op, xs)
    assert len(timed) >= 2 * len(every)  # several configurations timed per kernel
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
