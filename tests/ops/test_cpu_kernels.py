"""The C kernels of TANGO's gate average (ops/cpu_kernels.c) against plain float64 products, at
sizes that leave partial row tiles, partial column vectors and partial source blocks; the op built
on them against the naive loop, forward and gradients; and how the library is built and refused."""

from __future__ import annotations

import os
import platform
import re
import shlex
import warnings

import pytest
import torch
import torch.nn.functional as F

from tango_lm.ops import cpu_kernels
from tango_lm.ops.tango_mix import tango_mix_fused, tango_mix_reference

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the PyTorch path runs")

# (B, H, T, W): T below one row tile (6), not a multiple of it, past one source block (64 with
# AVX-512) by one; W of 1 to 9 vectors of 16, so column tiles end part-way, and widths with a
# partial last vector (1, 5, 21, 37, 341 = three-set TANGO's 2728 / 8).
SIZES = [
    (1, 1, 1, 16),
    (2, 3, 7, 16),
    (1, 2, 37, 48),
    (2, 2, 70, 80),
    (1, 1, 65, 144),
    (1, 2, 130, 64),
    (2, 2, 9, 1),
    (1, 3, 13, 5),
    (2, 1, 67, 21),
    (1, 2, 40, 37),
    (1, 1, 70, 341),
]


# The instruction sets whose code paths the kernel tests build and check: the machine's own, and on
# x86-64 also AVX2 (8-float vectors, 6 x 2 tiles) and plain SSE (the generic 4-float path).
MARCHES = ["native", "x86-64-v3", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else ["native"]


@pytest.fixture(params=MARCHES)
def march(request, monkeypatch, tmp_path_factory):
    """The kernels built for one instruction set (the x86-64 ones run on any x86-64 machine)."""
    if request.param != "native":
        monkeypatch.setenv("TANGO_LM_KERNEL_MARCH", request.param)
        monkeypatch.setenv("TANGO_LM_KERNEL_DIR", str(tmp_path_factory.getbasetemp() / "kernels"))
        cpu_kernels.library.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if not cpu_kernels.available():  # a compiler older than -march=x86-64-v3 (GCC 11, clang 12)
                cpu_kernels.library.cache_clear()
                pytest.skip(f"the C compiler cannot build -march={request.param}")
    assert cpu_kernels.available()
    yield request.param
    cpu_kernels.library.cache_clear()


def causal_probs(b, h, t, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, h, t, t, generator=gen) * 2
    return torch.softmax(scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1)


def wide(b, t, f, seed):
    return torch.randn(b, t, f, generator=torch.Generator().manual_seed(seed))


def heads(x, h):
    b, t, f = x.shape
    return x.double().view(b, t, h, f // h).transpose(1, 2)


def merge(x):
    b, h, t, w = x.shape
    return x.transpose(1, 2).reshape(b, t, h * w)


def nan_like(x):
    return torch.full_like(x, float("nan"))


@needs_kernels
@pytest.mark.parametrize(("b", "h", "t", "w"), SIZES)
def test_average_and_its_product_with_u(march, b, h, t, w):
    probs, g, u = causal_probs(b, h, t, 0), wide(b, t, h * w, 1), wide(b, t, h * w, 2)
    avg, y = nan_like(g), nan_like(g)  # NaN-filled: every element must be written
    cpu_kernels.gate_average(probs, g, u, avg, y)
    want = merge(probs.double() @ heads(g, h))
    torch.testing.assert_close(avg.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), want * u.double(), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("b", "h", "t", "w"), SIZES[:4] + SIZES[-2:])
def test_average_alone(march, b, h, t, w):
    # Without u and y (GAU's and FLASH's causal product): only the average is written.
    probs, g = causal_probs(b, h, t, 10), wide(b, t, h * w, 11)
    avg = nan_like(g)
    cpu_kernels.gate_average(probs, g, None, avg, None)
    torch.testing.assert_close(avg.double(), merge(probs.double() @ heads(g, h)), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("b", "h", "t", "w"), SIZES)
def test_gate_gradient(march, b, h, t, w):
    probs, grad_avg = causal_probs(b, h, t, 3), wide(b, t, h * w, 4)
    out = nan_like(grad_avg)
    cpu_kernels.gate_average_grad_gates(probs, grad_avg, out)
    want = merge(probs.double().transpose(-1, -2) @ heads(grad_avg, h))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("b", "h", "t", "w"), SIZES)
def test_probability_gradient_is_causal(march, b, h, t, w):
    grad_avg, g = wide(b, t, h * w, 5), wide(b, t, h * w, 6)
    out = torch.full((b, h, t, t), float("nan"))
    cpu_kernels.gate_average_grad_probs(grad_avg, g, out)
    want = (heads(grad_avg, h) @ heads(g, h).transpose(-1, -2)).tril()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    assert (out.triu(1) == 0).all()


@needs_kernels
@pytest.mark.parametrize("openmp", [True, False])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_results_do_not_depend_on_threads(monkeypatch, openmp, threads):
    # Each (batch element, head) item is computed whole by one thread, so results are bitwise equal.
    b, h, t, w = 2, 3, 37, 48
    probs, g, u = causal_probs(b, h, t, 7), wide(b, t, h * w, 8), wide(b, t, h * w, 9)
    serial = [torch.empty_like(g), torch.empty_like(g), torch.empty_like(g), torch.empty_like(probs)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu_kernels.gate_average(probs, g, u, serial[0], serial[1])
        cpu_kernels.gate_average_grad_gates(probs, u, serial[2])
        cpu_kernels.gate_average_grad_probs(u, g, serial[3])
        if not openmp:
            monkeypatch.setattr(cpu_kernels, "uses_openmp", lambda: False)
        torch.set_num_threads(threads)
        got = [nan_like(x) for x in serial]
        cpu_kernels.gate_average(probs, g, u, got[0], got[1])
        cpu_kernels.gate_average_grad_gates(probs, u, got[2])
        cpu_kernels.gate_average_grad_probs(u, g, got[3])
    finally:
        torch.set_num_threads(old)
    for x, y in zip(got, serial, strict=True):
        assert torch.equal(x, y)


@needs_kernels
def test_openmp_calls_get_every_thread_even_with_fewer_items(monkeypatch):
    # The library splits items by column blocks, so 2 items on 4 threads must still ask for 4.
    calls = []
    monkeypatch.setattr(cpu_kernels, "uses_openmp", lambda: True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        cpu_kernels._parallel(lambda *args: calls.append(args[-3:]), 2)
    finally:
        torch.set_num_threads(old)
    assert calls == [(0, 2, 4)]


def naive_mix(q, k, a, u):
    b, h, t, d_h = q.shape
    scores = (q @ k.transpose(-1, -2)) / d_h**0.5
    probs = torch.softmax(scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")), -1)
    return merge(probs @ heads(F.silu(a), h).to(a.dtype)) * u


@needs_kernels
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(("b", "h", "t", "w"), [(2, 3, 37, 48), (1, 2, 70, 16), (3, 1, 5, 32), (2, 2, 19, 13)])
def test_op_on_kernels_matches_naive_forward_and_gradients(monkeypatch, recompute, b, h, t, w):
    monkeypatch.setattr("tango_lm.ops.tango_mix.recompute_probs", lambda t, w: recompute)
    gen = torch.Generator().manual_seed(t)
    xs64 = [
        torch.randn(*s, generator=gen, dtype=torch.float64) * sc
        for s, sc in (((b, h, t, 8), 1.5), ((b, h, t, 8), 1.5), ((b, t, h * w), 1.0), ((b, t, h * w), 1.0))
    ]
    xs64 = [x.requires_grad_(True) for x in xs64]
    xs32 = [x.detach().float().requires_grad_(True) for x in xs64]
    dy = torch.randn(b, t, h * w, dtype=torch.float64, generator=gen)
    got_y = tango_mix_fused(*xs32, kernels=True)
    got = (got_y, *torch.autograd.grad(got_y, xs32, dy.float()))
    want_y = naive_mix(*xs64)
    want = (want_y, *torch.autograd.grad(want_y, xs64, dy))
    for x, y, name in zip(got, want, ("y", "dq", "dk", "da", "du"), strict=True):
        torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-5, msg=name)


@needs_kernels
def test_fused_op_picks_the_kernels_where_they_apply(monkeypatch):
    calls = []
    real = cpu_kernels.gate_average
    monkeypatch.setattr(cpu_kernels, "gate_average", lambda *xs: calls.append(1) or real(*xs))
    gen = torch.Generator().manual_seed(0)
    for dtype, w, expected in ((torch.float32, 16, 1), (torch.float32, 11, 1), (torch.float64, 16, 0)):
        q, k = torch.randn(1, 2, 5, 4, generator=gen, dtype=dtype), torch.randn(1, 2, 5, 4, generator=gen, dtype=dtype)
        a, u = (
            torch.randn(1, 5, 2 * w, generator=gen, dtype=dtype),
            torch.randn(1, 5, 2 * w, generator=gen, dtype=dtype),
        )
        calls.clear()
        torch.testing.assert_close(tango_mix_fused(q, k, a, u), tango_mix_reference(q, k, a, u))
        assert len(calls) == expected, (dtype, w)


def test_not_under_dispatch_modes():
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.zeros(1, 2, 32)
    with FlopCounterMode(display=False):
        assert not cpu_kernels.usable(a)  # the counter sees the PyTorch path's matmuls instead


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """library() rebuilt under the test's settings, into an empty cache; the real one afterwards."""
    monkeypatch.setenv("TANGO_LM_KERNEL_DIR", str(tmp_path / "kernels"))
    cpu_kernels.library.cache_clear()
    yield tmp_path / "kernels"
    cpu_kernels.library.cache_clear()


def test_disabled_by_environment(monkeypatch, fresh_library):
    monkeypatch.setenv("TANGO_LM_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    assert not cpu_kernels.usable(torch.zeros(1, 2, 32))
    assert not fresh_library.exists()


def test_failed_build_warns_once_and_falls_back(monkeypatch, fresh_library, tmp_path):
    fake = tmp_path / "broken-cc"
    fake.write_text("#!/bin/sh\necho 'broken-cc: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.warns(RuntimeWarning, match="CPU kernels not built.*broken-cc: cannot compile"):
        assert cpu_kernels.library() is None
    assert cpu_kernels.library() is None  # cached: no second warning, no second build
    assert list(fresh_library.iterdir()) == []  # no partial library left behind


@needs_kernels
def test_build_is_cached_by_source_compiler_and_cpu(fresh_library):
    assert cpu_kernels.available()
    built = list(fresh_library.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.available()
    assert [p.stat().st_mtime_ns for p in fresh_library.iterdir()] == [stamp]  # loaded, not rebuilt


@needs_kernels
def test_cc_may_carry_arguments_and_the_library_is_readable_by_all(monkeypatch, fresh_library, tmp_path):
    # CC="gcc -m64" (or "ccache gcc") had been looked up as one program name: no library, no word,
    # TANGO's mixing 1.7x slower. The library was 0711 whatever the umask: no other user of a
    # shared kernel cache could load it.
    monkeypatch.setenv("CC", f"{shlex.join(cpu_kernels._compiler())} -DTANGO_LM_TEST_FLAG=1")  # $CC's own words kept
    old = os.umask(0o022)
    try:
        assert cpu_kernels.available()
    finally:
        os.umask(old)
    (built,) = fresh_library.iterdir()
    assert built.stat().st_mode & 0o777 == 0o755


def test_a_cc_that_is_not_a_program_is_warned(monkeypatch, fresh_library):
    for cc in ("no-such-compiler-xyz -O2", 'gcc "'):  # no such program; an unbalanced quote (a ValueError)
        monkeypatch.setenv("CC", cc)
        cpu_kernels.library.cache_clear()
        with pytest.warns(
            RuntimeWarning, match=rf"CPU kernels not built \(\$CC={re.escape(repr(cc))} names no program"
        ):
            assert cpu_kernels.library() is None
    monkeypatch.delenv("CC")
    cpu_kernels.library.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no $CC and no cc: the PyTorch path, nothing to warn of
        monkeypatch.setenv("PATH", str(fresh_library))
        assert cpu_kernels.library() is None
