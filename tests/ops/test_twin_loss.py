"""The chunked mixture NLL (ops/twin_loss.py) against the plain path: loss and gradients for the
twin head, Standard, sigsoftmax and MoS-style mixtures, at odd sizes and chunks that do not divide
N, in float64 and fp32; ignored targets, saturated gates, bf16 autocast, and the size of the
largest tensor the op creates."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tango_lm.heads.onona import twin_log_probs
from tango_lm.ops.twin_loss import (
    mixture_nll,
    mixture_nll_reference,
    softmax_nll,
    twin_log_prior,
    twin_nll,
)
from tests import helpers

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}


def leaf(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()


def grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, retain_graph=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("n", "v", "d"), [(37, 53, 7), (63, 101, 16), (1, 5, 3)])
@pytest.mark.parametrize("chunk", [1, 5, 16, 1024])
def test_twin_fused_equals_plain(dtype, n, v, d, chunk):
    h, A, B = leaf(n, d, dtype=dtype, seed=0), leaf(v, d, dtype=dtype, seed=1), leaf(v, d, dtype=dtype, seed=2)
    z = leaf(n, dtype=dtype, seed=3, scale=3.0)
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    fused = twin_nll(h, A, B, z, y, chunk=chunk)
    plain = -twin_log_probs(h, A, B, z).gather(-1, y[:, None]).sum()
    assert fused.dtype == plain.dtype
    torch.testing.assert_close(fused, plain, **TOL[dtype])
    for a, b in zip(grads(fused, [h, A, B, z]), grads(plain, [h, A, B, z]), strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_twin_batched_shapes():
    # h [B, T, d], gate logits and targets [B, T], as the heads call it.
    h, A, B = (
        leaf(3, 7, 5, dtype=torch.float64, seed=0),
        leaf(11, 5, dtype=torch.float64, seed=1),
        leaf(11, 5, dtype=torch.float64, seed=2),
    )
    z = leaf(3, 7, dtype=torch.float64, seed=3)
    y = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(4))
    fused = twin_nll(h, A, B, z, y, chunk=4)
    plain = -twin_log_probs(h, A, B, z).gather(-1, y[..., None]).sum()
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=0)
    for a, b in zip(grads(fused, [h, A, B, z]), grads(plain, [h, A, B, z]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sigsoftmax", [False, True])
def test_single_softmax_equals_plain(dtype, sigsoftmax):
    h, E = leaf(45, 9, dtype=dtype, seed=0), leaf(67, 9, dtype=dtype, seed=1)
    y = torch.randint(0, 67, (45,), generator=torch.Generator().manual_seed(2))
    fused = softmax_nll(h, E, y, sigsoftmax=sigsoftmax, chunk=7)
    z = h @ E.T
    plain = F.cross_entropy(z + F.logsigmoid(z) if sigsoftmax else z, y, reduction="sum")
    torch.testing.assert_close(fused, plain, **TOL[dtype])
    for a, b in zip(grads(fused, [h, E]), grads(plain, [h, E]), strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("sigsoftmax", [False, True])
def test_mos_style_mixture_equals_plain(sigsoftmax):
    # Two hidden states (strided views of one tensor) under one shared table, a learned prior.
    dt = torch.float64
    latent = leaf(29, 2, 6, dtype=dt, seed=0)
    E, prior_logits = leaf(41, 6, dtype=dt, seed=1), leaf(29, 2, dtype=dt, seed=2)
    y = torch.randint(0, 41, (29,), generator=torch.Generator().manual_seed(3))
    hs = [latent[:, 0], latent[:, 1]]
    log_prior = F.log_softmax(prior_logits, -1)
    plain = mixture_nll_reference(hs, [E, E], y, log_prior, sigsoftmax=sigsoftmax)
    inputs = [latent, E, prior_logits]
    # The table passed once and shared by index (as the MoS head does), and passed twice.
    shared = mixture_nll(hs, [E], y, log_prior, components=((0, 0), (1, 0)), sigsoftmax=sigsoftmax, chunk=6)
    twice = mixture_nll(hs, [E, E], y, log_prior, sigsoftmax=sigsoftmax, chunk=6)
    for fused in (shared, twice):
        torch.testing.assert_close(fused, plain, rtol=1e-12, atol=0)
        for a, b in zip(grads(fused, inputs), grads(plain, inputs), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_components_name_shared_tensors_by_index():
    # One hidden state under two tables (the twin head's layout), components in a mixed order.
    dt = torch.float64
    h, A, B = leaf(17, 5, dtype=dt, seed=0), leaf(23, 5, dtype=dt, seed=1), leaf(23, 5, dtype=dt, seed=2)
    prior = F.log_softmax(leaf(17, 2, dtype=dt, seed=3), -1)
    y = torch.randint(0, 23, (17,), generator=torch.Generator().manual_seed(4))
    fused = mixture_nll([h], [A, B], y, prior, components=((0, 1), (0, 0)), chunk=4)
    plain = mixture_nll_reference([h, h], [B, A], y, prior)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=0)
    for a, b in zip(grads(fused, [h, A, B, prior]), grads(plain, [h, A, B, prior]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="outside"):
        mixture_nll([h], [A], y, prior, components=((0, 0), (0, 1)))


def test_ignored_targets_contribute_nothing():
    dt = torch.float64
    h, A, B, z = (
        leaf(20, 4, dtype=dt, seed=0),
        leaf(13, 4, dtype=dt, seed=1),
        leaf(13, 4, dtype=dt, seed=2),
        leaf(20, dtype=dt, seed=3),
    )
    y = torch.randint(0, 13, (20,), generator=torch.Generator().manual_seed(4))
    keep = torch.arange(20) % 3 != 0
    masked = y.masked_fill(~keep, -100)
    fused = twin_nll(h, A, B, z, masked, chunk=6)
    kept = twin_nll(h[keep], A, B, z[keep], y[keep])
    torch.testing.assert_close(fused, kept, rtol=1e-12, atol=0)
    g_all, g_kept = grads(fused, [h, A, B, z]), grads(kept, [h, A, B, z])
    for a, b in zip(g_all[1:3], g_kept[1:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert g_all[0][~keep].abs().max() == 0 and g_all[3][~keep].abs().max() == 0


def test_saturated_gate_stays_finite():
    dt = torch.float32
    h, A, B = leaf(16, 4, dtype=dt, seed=0), leaf(9, 4, dtype=dt, seed=1), leaf(9, 4, dtype=dt, seed=2)
    z = torch.tensor([120.0, -120.0] * 8).requires_grad_()
    y = torch.randint(0, 9, (16,), generator=torch.Generator().manual_seed(3))
    fused = twin_nll(h, A, B, z, y, chunk=5)
    plain = -twin_log_probs(h, A, B, z).gather(-1, y[:, None]).sum()
    assert torch.isfinite(fused)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads(fused, [h, A, B, z]), grads(plain, [h, A, B, z]), strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_autocast_matches_plain_path_under_autocast():
    h, A, B = (
        leaf(40, 16, dtype=torch.float32, seed=0),
        leaf(50, 16, dtype=torch.float32, seed=1),
        leaf(50, 16, dtype=torch.float32, seed=2),
    )
    z = leaf(40, dtype=torch.float32, seed=3)
    y = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = twin_nll(h, A, B, z, y, chunk=9)
        plain = -twin_log_probs(h, A, B, z).gather(-1, y[:, None]).sum()
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, rtol=2e-3, atol=1e-3)
    fused_grads, plain_grads = grads(fused, [h, A, B, z]), grads(plain, [h, A, B, z])
    for a, b in zip(fused_grads, plain_grads, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05 * b.abs().max().item())
    # Against float64, the fused gradients are as close as the plain path's (its tables' gradients
    # are accumulated in fp32 from bf16 products: a 1% bias there passed the 5% above).
    leaves64 = [x.detach().double().requires_grad_() for x in (h, A, B, z)]
    exact = grads(-twin_log_probs(*leaves64).gather(-1, y[:, None]).sum(), leaves64)
    for fused_grad, plain_grad, want in zip(fused_grads, plain_grads, exact, strict=True):
        error = (fused_grad.double() - want).norm() / want.norm()
        assert error <= max(1.5 * (plain_grad.double() - want).norm() / want.norm(), 2e-3), error


def test_twin_log_prior_is_log_gate():
    z = torch.tensor([-30.0, -1.0, 0.0, 2.0, 30.0], dtype=torch.float64)
    prior = twin_log_prior(z)
    torch.testing.assert_close(prior.exp().sum(-1), torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(prior[:, 0].exp(), torch.sigmoid(z))


def test_fused_holds_one_chunk_of_logits_at_a_time():
    n, v, d, chunk = 90, 120, 8, 32
    h, A, B = (
        leaf(n, d, dtype=torch.float32, seed=0),
        leaf(v, d, dtype=torch.float32, seed=1),
        leaf(v, d, dtype=torch.float32, seed=2),
    )
    z = leaf(n, dtype=torch.float32, seed=3)
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    with helpers.LargestTensor() as fused_mode:
        twin_nll(h, A, B, z, y, chunk=chunk).backward()
    with helpers.LargestTensor() as plain_mode:
        (-twin_log_probs(h, A, B, z).gather(-1, y[:, None]).sum()).backward()
    assert fused_mode.largest <= chunk * v < n * v <= plain_mode.largest


def test_head_bench_variants_run():
    from tango_lm.bench.heads import VARIANTS, format_report, measure_variant

    rows = [measure_variant(v, positions=9, vocab=13, d=4, chunk=4, device="cpu", steps=1) for v in VARIANTS]
    assert all(r["step_s"] > 0 and r["peak_bytes"] >= 0 for r in rows)
    for r in rows:
        r.update(time_vs_standard=1.0, cpu_vs_standard=1.0, memory_vs_standard=1.0)
    report = {
        "positions": 9,
        "vocab": 13,
        "d": 4,
        "chunk": 4,
        "steps": 1,
        "bf16": False,
        "device": "cpu",
        "threads": 1,
        "memory_method": rows[0]["memory_method"],
        "variants": rows,
    }
    assert "twin-fused" in format_report(report)


def test_head_bench_command_runs_each_variant_in_its_own_process_and_takes_ratios_to_standard(capsys):
    from tango_lm.bench import heads

    sizes = ["--positions", "9", "--vocab", "13", "--d", "4", "--chunk", "4", "--steps", "1", "--device", "cpu"]
    heads.main([*sizes, "--variants", "twin-fused,standard", "--threads", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    rows = {r["variant"]: r for r in report["variants"]}
    assert list(rows) == ["twin-fused", "standard"] and report["threads"] == 1
    assert rows["standard"]["time_vs_standard"] == rows["standard"]["cpu_vs_standard"] == 1.0
    twin = rows["twin-fused"]
    assert twin["time_vs_standard"] == twin["step_s"] / rows["standard"]["step_s"]
