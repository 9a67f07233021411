"""The numbers the train and memory suites print, each from its own measurement: a row's step time
is the median of its timed steps, its CPU time the median of its steps' CPU seconds, its peak
memory a ratio to the baseline's, each in its own column of the table; the matmul peak is the
best of its timings. Tiny CPU sizes; the memory children and the clocks are stand-ins where a
number must be known."""

from __future__ import annotations

import statistics

import pytest
import torch

from tango_lm.bench import memory, peak, training

MIB = 2**20
TINY = dict(d_model=32, depth=2, seq_len=16, batch_size=2, tango_width=64, vocab_size=61, peak_size=128)


def _cpu_clock(monkeypatch, seconds: list[float]) -> None:
    """time.process_time as the train suite reads it (before and after each step): step k takes seconds[k]."""
    clock, calls, steps = [0.0], [0], iter(seconds)

    def process_time() -> float:
        if calls[0] % 2:  # a step's end
            clock[0] += next(steps)
        calls[0] += 1
        return clock[0]

    monkeypatch.setattr(training.time, "process_time", process_time)


def test_train_rows_are_medians_and_their_memory_a_ratio_to_the_baseline(monkeypatch):
    peaks = {"tango": 300 * MIB, "loop-transformer": 200 * MIB}
    monkeypatch.setattr(training, "measure_in_subprocess", lambda cfg, *a, **k: {"peak_bytes": peaks[cfg.arch]})
    # rounds alternate tango, loop-transformer: tango's CPU seconds 2, 2, 20 (median 2, mean 8), Loop's 1, 1, 1
    _cpu_clock(monkeypatch, [2.0, 1.0, 2.0, 1.0, 20.0, 1.0])
    report = training.run_training_bench(
        **TINY, steps=3, warmup=0, device="cpu", archs=("tango", "loop-transformer"), print_table=False
    )
    rows = {r["arch"]: r for r in report["models"]}
    for r in rows.values():
        assert len(r["step_s_all"]) == 3 and r["step_s"] == statistics.median(r["step_s_all"])
    assert rows["tango"]["cpu_s"] == 2.0 and rows["loop-transformer"]["cpu_s"] == 1.0
    assert rows["tango"]["tokens_per_cpu_s_vs_loop"] == pytest.approx(0.5)
    assert rows["tango"]["peak_bytes"] == 300 * MIB
    assert rows["tango"]["memory_vs_loop"] == pytest.approx(1.5)  # tango's peak over Loop's
    assert rows["loop-transformer"]["memory_vs_loop"] == pytest.approx(1.0)


def test_train_table_puts_each_number_in_its_column():
    report = training.run_training_bench(
        **TINY, steps=1, warmup=0, device="cpu", archs=("tango",), memory=False, print_table=False
    )
    row = next(r for r in report["models"] if r["arch"] == "tango")
    row.update(
        flop_per_s=5.0e9,
        mfu=0.123,
        peak_bytes=300 * MIB,
        tokens_per_s_vs_loop=1.11,
        tokens_per_cpu_s_vs_loop=2.22,
        mfu_vs_loop=3.33,
        memory_vs_loop=4.44,
    )
    lines = training.format_report(report).splitlines()
    header = lines[2]
    assert header.split()[:8] == ["arch", "width", "params", "tok/s", "MFLOP/tok", "GFLOP/s", "MFU", "peak"]
    assert "tok/s x tok/cpu-s x  MFU x  mem x  note" in header
    fields = next(line for line in lines[3:] if line.startswith("tango ")).split()
    # arch, width, params, tok/s, MFLOP/tok, GFLOP/s, MFU, peak MiB, tok/s x, tok/cpu-s x, MFU x, mem x
    assert fields[5:12] == ["5.0", "12.3%", "300", "1.11", "2.22", "3.33", "4.44"]


def _memory_child(rows: dict) -> object:
    def measure(cfg, batch_size, seq_len, device, steps, threads, compile=False):
        peak_bytes, state_bytes = rows[cfg.head, compile]
        mode = "compiled" if compile else "eager"
        return {
            "head": cfg.head,
            "mode": mode,
            "params_total": 1000,
            "peak_bytes": peak_bytes,
            "state_bytes": state_bytes,
            "other_bytes": peak_bytes - state_bytes,
            "step_s": [1.0, 0.5],
            "device": "cpu",
            "threads": 1,
            "precision": "fp32",
            "memory_method": "stand-in",
        }

    return measure


def test_memory_suite_compares_each_mode_with_the_standard_head_of_that_mode(monkeypatch):
    rows = {
        ("standard", False): (100 * MIB, 40 * MIB),
        ("onona", False): (80 * MIB, 40 * MIB),
        ("standard", True): (50 * MIB, 40 * MIB),
        ("onona", True): (60 * MIB, 40 * MIB),
    }
    monkeypatch.setattr(memory, "measure_in_subprocess", _memory_child(rows))
    report = memory.run_memory_bench(
        backbone="dense", d_model=32, depth=1, vocab_size=50, seq_len=8, compile=True, print_table=False
    )
    got = {(r["head"], r["mode"]): r for r in report["heads"]}
    assert got["onona", "eager"]["peak_vs_standard"] == pytest.approx(0.8)
    assert got["onona", "compiled"]["peak_vs_standard"] == pytest.approx(1.2)  # 60 / 50, not 60 / 100
    assert got["onona", "compiled"]["other_vs_standard"] == pytest.approx(2.0)  # 20 / 10
    line = next(x for x in memory.format_report(report).splitlines() if x.startswith("onona") and "compiled" in x)
    # head, mode, params, peak MiB, state MiB, other MiB, step s, peak vs std, state vs std, other vs std
    assert line.split()[3:] == ["60", "40", "20", "0.5", "1.20", "1.00", "2.00"]


def test_memory_of_a_training_step_is_growth_not_the_whole_process():
    # The process (torch itself) holds hundreds of MiB before the model is built; a 32-wide model's
    # steps add a few, or none in a process whose high-water mark an earlier test already raised
    # (the bench measures each model in a fresh process; this test runs in pytest's).
    from tango_lm.train.utilization import peak_rss_bytes

    cfg = memory.ModelConfig(arch="dense", d_model=32, depth=1, width=64, vocab_size=50, context_length=8)
    row = memory.measure_training_step(cfg.to_dict(), batch_size=1, seq_len=8, device="cpu", steps=2)
    assert 0 <= row["peak_bytes"] < peak_rss_bytes() / 2


def test_matmul_peak_is_the_best_of_its_timings(monkeypatch):
    # timings of 1, 3 and 2 s: the peak is the fastest one's FLOP/s (a slower one is noise)
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])
    monkeypatch.setattr(peak.time, "perf_counter", lambda: next(ticks))
    assert peak.measure_matmul_peak(torch.device("cpu"), size=16, repeats=3) == 2 * 16**3 / 1.0


def test_mfu_divides_by_the_larger_of_the_peaks_before_and_after_the_steps(monkeypatch):
    for before, after in ((1e9, 2e9), (3e9, 1e9)):
        peaks = iter([before, after])
        monkeypatch.setattr(training, "measure_matmul_peak", lambda *args, peaks=peaks: next(peaks))
        report = training.run_training_bench(
            **TINY, steps=1, warmup=0, device="cpu", archs=("loop-transformer",), memory=False, print_table=False
        )
        assert report["matmul_peak_flop_per_s"] == max(before, after)
        (row,) = report["models"]
        assert row["mfu"] == pytest.approx(row["flop_per_s"] / max(before, after))
