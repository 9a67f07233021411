"""tools/gate_average_bench.py's own arithmetic at tiny CPU sizes: the causal FLOPs its TFLOP/s
divide, the bytes its floor moves, and the sliced SDPA (128) its time ratio is to."""

from __future__ import annotations

import argparse

import pytest

from tests import helpers

gate_average_bench = helpers.tool("gate_average_bench")


def test_kernel_bench_counts_causal_flops_bytes_and_its_baseline(monkeypatch):
    # the ceilings as numbers (measuring them is most of a CPU run's time): 1 TFLOP/s, 10 GB/s
    monkeypatch.setattr(gate_average_bench.op_timing, "matmul_peak", lambda device: 1e12)
    monkeypatch.setattr(gate_average_bench.op_timing, "copy_bandwidth", lambda device: 1e10)
    b, h, t, w, d = 1, 2, 9, 11, 4
    tiny = argparse.Namespace(
        device="cpu", dtype="fp32", batch=b, heads=h, seq_len=t, width=w, head_dim=d, rounds=1, math=False
    )  # the tool's defaults are the GPU sizes
    report = gate_average_bench.run(tiny)
    # 3 x 2 (d_h + W) per visible (destination, source) pair and head: t (t + 1) / 2 pairs (models/flops.py)
    assert report["causal_flops"] == 3 * 2 * h * (d + w) * (9 * 10 / 2) == 8100
    # forward: q, k, a, u in, y out; backward: q, k, a, u, dy in, dq, dk, da, du out (fp32: 4 bytes)
    q_numel, a_numel = b * h * t * d, b * t * h * w
    assert report["min_bytes"] == (6 * q_numel + 8 * a_numel) * 4 == 8064
    assert report["floor_ms"] == pytest.approx(max(8100 / 1e12, 8064 / 1e10) * 1e3)
    rows = {r["impl"]: r for r in report["rows"]}
    assert rows["sdpa-sliced-128"]["time_vs_sliced"] == 1.0
    for r in rows.values():
        assert r["tflop_per_s"] == pytest.approx(8100 / (r["fwd_bwd_ms"] / 1e3) / 1e12)
        assert r["of_peak"] == pytest.approx(8100 / (r["fwd_bwd_ms"] / 1e3) / 1e12)
        assert r["time_vs_sliced"] == pytest.approx(r["fwd_bwd_ms"] / rows["sdpa-sliced-128"]["fwd_bwd_ms"])
