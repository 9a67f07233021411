"""A benchmark stopped from outside (SIGTERM from `timeout` or a cluster, Ctrl-C) still reports what
it measured (bench/stopping.py), and a running one says on stderr how far it is (bench/progress.py).
Stops are planted at known points (a patched call raises what the signal handler raises), and one
test sends a real SIGTERM to a real `tango-lm bench`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tango_lm import stop_signals
from tango_lm.bench import decode, memory, progress, suite, training, windowed
from tango_lm.cli import main, parse_args
from tests import helpers

TINY = dict(d_model=32, depth=3, seq_len=16, batch_size=2, tango_width=256, vocab_size=40, peak_size=128)
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _stop_at_call(monkeypatch, target: object, name: str, n: int, stop: BaseException) -> list[int]:
    """Make `target.name` raise `stop` at its n-th call (1-based); the calls made are counted."""
    real, calls = getattr(target, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise stop
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)
    return calls


@pytest.mark.parametrize("stop", [stop_signals.Stopped(signal.SIGTERM), KeyboardInterrupt()])
def test_train_suite_stopped_in_its_steps_reports_the_steps_it_finished(monkeypatch, stop):
    # Two models (Loop, then TANGO) x 1 warm-up + 5 timed rounds; the stop lands in the 4th round's
    # second run (run 8 of 12): Loop has 3 timed steps then, TANGO 2; each row is the median of its own.
    _stop_at_call(monkeypatch, training.Progress, "run_start", 8, stop)
    report = training.run_training_bench(**TINY, steps=5, warmup=1, memory=True, device="cpu", print_table=False)
    name = "SIGTERM" if isinstance(stop, stop_signals.Stopped) else "SIGINT"
    assert report["stopped"] == {"signal": name, "timed_rounds_done": 2, "timed_rounds": 5}
    rows = {r["arch"]: r for r in report["models"]}
    assert (rows["loop-transformer"]["timed_steps"], rows["tango"]["timed_steps"]) == (3, 2)
    for r in rows.values():
        assert len(r["step_s_all"]) == r["timed_steps"]
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / r["step_s"])
        assert r["peak_bytes"] is None  # no memory subprocess after a stop
    assert report["matmul_peak_after"] is None and report["matmul_peak_flop_per_s"] == report["matmul_peak_before"]
    assert report["not_measured"] == []
    assert f"STOPPED by {name} after 2 of 5 timed rounds" in training.format_report(report)


def test_a_stop_in_the_warm_up_leaves_rows_only_for_models_that_were_timed(monkeypatch):
    _stop_at_call(monkeypatch, training.Progress, "run_start", 2, stop_signals.Stopped(signal.SIGTERM))
    report = training.run_training_bench(**TINY, steps=2, warmup=1, memory=False, device="cpu", print_table=False)
    assert report["models"] == [] and report["baseline"] is None
    assert report["not_measured"] == [{"arch": "loop-transformer", "mode": "eager"}, {"arch": "tango", "mode": "eager"}]
    text = training.format_report(report)
    assert "tango              eager      no row: stopped before its first timed step" in text
    assert "after 0 of 2 timed rounds" in text


def test_a_stop_while_memory_is_measured_keeps_the_timed_rows(monkeypatch):
    # After every step was timed, the CPU memory subprocesses run; a stop in the first one ends them.
    _stop_at_call(monkeypatch, training, "measure_in_subprocess", 1, stop_signals.Stopped(signal.SIGTERM))
    report = training.run_training_bench(**TINY, steps=2, warmup=0, memory=True, device="cpu", print_table=False)
    assert report["stopped"] == {"signal": "SIGTERM", "timed_rounds_done": 2, "timed_rounds": 2}
    assert [r["timed_steps"] for r in report["models"]] == [2, 2]
    assert all(r["peak_bytes"] is None for r in report["models"])
    assert report["matmul_peak_after"] is not None  # measured before the stop


DECODE = dict(archs=("tango",), d_model=32, depth=2, tango_width=64, vocab_size=40, prompt_len=3, new_tokens=2)
DECODE.update(batches=(1,), head_vocab=50, device="cpu", print_table=False)


def test_decode_suite_stopped_in_its_rounds_reports_the_cases_it_timed(monkeypatch):
    # Two models x two cases (b1 greedy, b1 t=1) = 4 runs a round, 1 warm-up + 3 timed rounds. The
    # stop lands in the first timed round's 3rd run: both models have "b1 greedy" once, no "b1 t=1".
    _stop_at_call(monkeypatch, decode, "_timed_generate", 4 + 3, stop_signals.Stopped(signal.SIGTERM))
    report = decode.run_decode_bench(**DECODE, repeats=3)
    assert report["stopped"] == {
        "signal": "SIGTERM",
        "timed_rounds_done": 0,
        "timed_rounds": 3,
        "part": "architectures",
    }
    rows = {r["arch"]: r for r in report["archs"]}
    assert set(rows) == {"tango", "loop-transformer"} and "heads" not in report  # no heads after a stop
    for r in rows.values():
        assert list(r["tokens_per_s"]) == ["b1 greedy"] and r["tokens_per_s"]["b1 greedy"] > 0
        assert r["tokens_per_s_vs_loop"]["b1 greedy"] == pytest.approx(
            r["tokens_per_s"]["b1 greedy"] / rows["loop-transformer"]["tokens_per_s"]["b1 greedy"]
        )
        assert r["prefill_tokens_per_s"] == {} and r["cache_bytes_per_token"] is None and r["cache_vs_loop"] is None
    text = decode.format_report(report)
    tango = next(line for line in text.splitlines() if line.startswith("tango "))
    assert tango.split()[1:5] == [tango.split()[1], "-", tango.split()[3], "-"]  # b1 t=1 and its ratio: "-"
    assert "STOPPED by SIGTERM after 0 of 3 timed rounds of the architectures" in text


def test_decode_suite_stopped_in_the_heads_keeps_every_architecture(monkeypatch):
    # 2 models x 2 cases x (1 warm-up + 2 timed) = 12 runs of the architectures, then the heads'
    # (3 variants x 1 case): the stop is their 2nd timed round's 2nd run (12 + 3 + 3 + 2).
    _stop_at_call(monkeypatch, decode, "_timed_generate", 12 + 3 + 3 + 2, KeyboardInterrupt())
    report = decode.run_decode_bench(**DECODE, repeats=2)
    assert report["stopped"] == {"signal": "SIGINT", "timed_rounds_done": 1, "timed_rounds": 2, "part": "heads"}
    for r in report["archs"]:
        assert list(r["tokens_per_s"]) == ["b1 greedy", "b1 t=1"] and r["cache_bytes_per_token"] > 0
        assert list(r["prefill_tokens_per_s"]) == ["b1"]
    variants = report["heads"]["variants"]
    assert [list(v["tokens_per_s"]) for v in variants] == [["b1"], ["b1"], ["b1"]]  # every variant timed once
    text = decode.format_report(report)
    assert "decode heads:" in text and "of the heads: each number is the median" in text


def test_decode_suite_stopped_while_the_heads_are_built(monkeypatch):
    _stop_at_call(monkeypatch, decode, "run_head_decode", 1, stop_signals.Stopped(signal.SIGTERM))
    report = decode.run_decode_bench(**DECODE, repeats=1)
    assert report["heads"] is None and report["stopped"]["part"] == "heads"
    assert report["stopped"]["timed_rounds_done"] == 0  # none of the heads' rounds
    assert "decode heads:" not in decode.format_report(report)


def test_bench_cli_prints_the_report_of_a_stopped_suite_and_exits_as_the_signal(monkeypatch, capsys):
    # A stop in the decode suite's warm-up round: its report has rows with no case measured.
    _stop_at_call(monkeypatch, decode, "_timed_generate", 3, KeyboardInterrupt())
    argv = ["bench", "--suite", "decode", "--archs", "tango", "--d-model", "32", "--depth", "2"]
    argv += ["--tango-width", "64", "--vocab-size", "40", "--prompt-len", "3", "--new-tokens", "2"]
    assert main([*argv, "--decode-batches", "1", "--repeats", "1", "--device", "cpu", "--json"]) == 130
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["stopped"] == {"signal": "SIGINT", "suite": "decode"}
    assert report["decode"]["stopped"]["timed_rounds_done"] == 0
    assert all(r["tokens_per_s"] == {} for r in report["decode"]["archs"])
    assert "stopped by SIGINT in the decode suite" in captured.err
    assert "decode: stopped by SIGINT after" in captured.err  # its progress lines (stderr is no terminal)
    _stop_at_call(monkeypatch, decode, "_timed_generate", 3, KeyboardInterrupt())  # again, printing the table
    assert main([*argv, "--decode-batches", "1", "--repeats", "1", "--device", "cpu"]) == 130
    assert "STOPPED by SIGINT after 0 of 1 timed rounds" in capsys.readouterr().out  # the table, all "-"


def test_a_real_sigterm_to_tango_lm_bench(tmp_path):
    # `timeout` sends SIGTERM: the bench prints its JSON report with the rounds it timed, exit 143.
    argv = [sys.executable, "-m", "tango_lm.cli", "bench", "--suite", "train", "--archs", "tango"]
    argv += ["--d-model", "32", "--depth", "1", "--seq-len", "16", "--batch-size", "2", "--tango-width", "64"]
    argv += ["--vocab-size", "40", "--peak-size", "64", "--steps", "1000000", "--warmup", "1", "--device", "cpu"]
    err = tmp_path / "stderr"
    with err.open("w") as err_file:
        proc = subprocess.Popen([*argv, "--json"], stdout=subprocess.PIPE, stderr=err_file, text=True)
        deadline = time.monotonic() + 120
        while "timed round 1/" not in err.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, err.read_text()
    report = json.loads(out)
    assert report["stopped"] == {"signal": "SIGTERM", "suite": "train"}
    train = report["train"]
    assert train["stopped"]["signal"] == "SIGTERM" and train["stopped"]["timed_rounds_done"] >= 1
    assert {r["arch"] for r in train["models"]} == {"tango", "loop-transformer"}
    assert "train: stopped by SIGTERM after" in err.read_text()


def test_stop_on_sigterm_restores_the_previous_handler_and_catches_one_signal():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(stop_signals.Stopped) as caught, stop_signals.stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode boundary
    assert caught.value.signal == "SIGTERM" and signal.getsignal(signal.SIGTERM) == before
    assert stop_signals.exit_code("SIGTERM") == 143 and stop_signals.exit_code("SIGINT") == 130


def test_timeouts_second_sigterm_does_not_kill_a_stopping_bench():
    # `timeout` signals the process, then its group: the second SIGTERM came while the stopped
    # suite cleaned up (waiting on a child) and killed it before it printed its report.
    code = (
        "import os, signal, time\n"
        "from tango_lm import stop_signals\n"
        "try:\n"
        "    with stop_signals.stop_on_sigterm():\n"
        "        try:\n"
        "            os.kill(os.getpid(), signal.SIGTERM); time.sleep(1)\n"
        "        finally:\n"
        "            os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.5)\n"
        "except stop_signals.Stopped:\n"
        "    print('report printed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "report printed"), proc.stderr


def test_a_later_sigterm_reaches_the_previous_handler(monkeypatch):
    # A bench that does not stop still ends on a second SIGTERM (past the echo window).
    calls = []
    monkeypatch.setattr(stop_signals, "ECHO_S", 0.0)
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with pytest.raises(stop_signals.Stopped), stop_signals.stop_on_sigterm():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_progress_lines_in_a_log(capsys, monkeypatch):
    bar = progress.Progress("train", rounds=4, runs_per_round=2, warmup_rounds=1, mode="lines")
    for i in range(4):
        for label in ("tango eager", "loop-transformer eager"):
            bar.run_start(label)
            bar.run_done(i, label, 1.25)
        bar.round_done(i)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    # One line per warm-up run, the first timed round, then at most one per LINE_EVERY_S (10 s).
    assert lines[:3] == [
        "train: warm-up 1/1: tango eager 1.2 s",
        "train: warm-up 1/1: loop-transformer eager 1.2 s",
        lines[2],
    ]
    assert lines[2].startswith("train: timed round 1/3: ") and lines[2].endswith(" s left)")
    assert len(lines) == 4 and lines[3].startswith("train: done in ")
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    bar = progress.Progress("decode", rounds=3, runs_per_round=1, warmup_rounds=1, mode="lines")
    for i in range(3):
        bar.round_done(i)
    bar.close("SIGTERM")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].strip() for line in lines[:2]] == ["timed round 1/2", "timed round 2/2"]
    assert lines[2].startswith("decode: stopped by SIGTERM after ")


def test_progress_a_line_per_run_where_each_run_is_a_measurement(capsys):
    bar = progress.Progress("memory", rounds=1, runs_per_round=2, warmup_rounds=0, mode="lines", every_run=True)
    for label in ("standard eager", "onona eager"):
        bar.run_start(label)
        bar.run_done(0, label, 2.25)
    bar.round_done(0)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["memory: 1/2: standard eager 2.2 s", "memory: 2/2: onona eager 2.2 s"]
    assert lines[-1].startswith("memory: done in ")


def test_every_suite_reports_progress_in_a_log(capsys):
    # stderr is no terminal here: lines. Windowed and memory suites at tiny sizes.
    tiny = ["--d-model", "32", "--depth", "1", "--repeats", "1", "--device", "cpu", "--json"]
    windowed = ["--windowed-lens", "32,64", "--windowed-width", "64", "--windowed-tokens", "128"]
    assert main(["bench", "--suite", "windowed", *tiny, *windowed]) == 0
    assert "windowed: warm-up 1/1: tango T=64 " in capsys.readouterr().err
    memory = ["--memory-backbone", "dense", "--head-vocab", "50", "--memory-seq-len", "16"]
    assert main(["bench", "--suite", "memory", *tiny, *memory]) == 0
    assert "memory: 2/2: onona eager " in capsys.readouterr().err


def test_progress_none_prints_nothing_a_bar_counts_runs_and_a_bad_mode_is_refused(capsys):
    bar = progress.Progress("train", rounds=2, runs_per_round=1, warmup_rounds=1)
    bar.run_start("tango eager")
    bar.run_done(0, "tango eager", 1.0)
    bar.round_done(0)
    bar.close()
    assert capsys.readouterr().err == ""
    bar = progress.Progress("train", rounds=2, runs_per_round=1, warmup_rounds=1, mode="bar")  # a terminal's
    for i in range(2):
        bar.run_start("tango eager")
        bar.run_done(i, "tango eager", 1.0)
        bar.round_done(i)
    assert bar.bar.n == 2 and bar.bar.desc.startswith("train tango eager")
    bar.close()
    assert capsys.readouterr().err.splitlines()[-1].startswith("train: done in ")
    with pytest.raises(ValueError, match="progress mode 'loud'"):
        progress.Progress("train", 1, 1, 0, mode="loud")


def test_gpu_tables_show_a_suite_its_timeout_stopped(tmp_path):
    # What `timeout` leaves: exit 124 and the JSON report the stopped bench printed.
    rows = [
        {"arch": a, "mfu_vs_loop": x, "memory_vs_loop": None} for a, x in (("tango", 0.9), ("loop-transformer", 1.0))
    ]
    stopped = {"signal": "SIGTERM", "timed_rounds_done": 3, "timed_rounds": 8}
    report = {
        "suites": ["train"],
        "stopped": {"signal": "SIGTERM", "suite": "train"},
        "train": {"models": rows, "stopped": stopped},
    }
    (tmp_path / "train-bench.json").write_text(json.dumps(report))
    gpu_check_summary, gpu_suites_table = helpers.tool("gpu_check_summary"), helpers.tool("gpu_suites_table")
    assert gpu_check_summary.train_result(tmp_path, "train-bench") == "3/8 timed rounds; MFU x Loop: tango 0.90"
    (tmp_path / "train-bench.rc").write_text("124\n")
    assert gpu_suites_table.load(tmp_path, "train-bench") == ("TIMEOUT (partial: train)", report)
    (tmp_path / "decode.rc").write_text("124\n")  # killed before it printed anything
    assert gpu_suites_table.load(tmp_path, "decode") == ("TIMEOUT", None)
    report["train"]["models"] = []  # stopped in the warm-up: not "MFU x Loop: ; peak memory x Loop:"
    (tmp_path / "train-bench.json").write_text(json.dumps(report))
    assert gpu_check_summary.train_result(tmp_path, "train-bench") == "3/8 timed rounds; no model timed"


def test_gpu_suites_table_columns_fit_the_longest_name_and_status(tmp_path, capsys):
    # Names and statuses longer than the old fixed widths ran into the next column.
    gpu_suites_table = helpers.tool("gpu_suites_table")
    for name in ("train-70m", "train-70m-t4096"):
        (tmp_path / f"{name}.rc").write_text("124\n")
        (tmp_path / f"{name}.log").write_text(f"{name} rc=124 905s\n")
        (tmp_path / f"{name}.json").write_text(json.dumps({"stopped": {"signal": "SIGTERM"}}))
    gpu_suites_table.main(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert "train-70m-t4096  TIMEOUT (partial: nothing measured)  905s" in lines


def test_a_stop_before_anything_was_measured_still_prints_a_json_report(monkeypatch, capsys):
    # The default bench (no --suite) stopped while it measures the matmul peak, before any step.
    _stop_at_call(monkeypatch, training, "measure_matmul_peak", 1, stop_signals.Stopped(signal.SIGTERM))
    argv = ["bench", "--d-model", "32", "--depth", "1", "--seq-len", "16", "--batch-size", "2"]
    assert main([*argv, "--tango-width", "64", "--vocab-size", "40", "--device", "cpu", "--json"]) == 143
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"stopped": {"signal": "SIGTERM"}}
    assert captured.err.splitlines()[-1] == "stopped by SIGTERM before anything was measured"


def test_a_suite_stopped_before_anything_was_measured_says_so(monkeypatch, capsys):
    # With --suite, a stop in the first suite's matmul peak printed no table but said "the report
    # has what was measured before".
    _stop_at_call(monkeypatch, training, "measure_matmul_peak", 1, stop_signals.Stopped(signal.SIGTERM))
    argv = ["bench", "--suite", "train", "--archs", "tango", "--d-model", "32", "--depth", "1", "--seq-len", "16"]
    assert main([*argv, "--batch-size", "2", "--tango-width", "64", "--vocab-size", "40", "--device", "cpu"]) == 143
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1] == "stopped by SIGTERM in the train suite before anything was measured"


@pytest.mark.parametrize("suite", [[], ["--suite", "train"]])
def test_a_stop_in_the_warm_up_says_nothing_was_measured(monkeypatch, capsys, suite):
    # Stopped in the first model's warm-up steps: the rows were empty, but the line said "the report
    # has what was measured before".
    _stop_at_call(monkeypatch, training.Progress, "run_start", 2, stop_signals.Stopped(signal.SIGTERM))
    argv = ["bench", *suite, "--archs", "tango", "--d-model", "32", "--depth", "1", "--seq-len", "16", "--warmup", "3"]
    assert main([*argv, "--batch-size", "2", "--tango-width", "64", "--vocab-size", "40", "--device", "cpu"]) == 143
    where = " in the train suite" if suite else ""
    assert capsys.readouterr().err.splitlines()[-1] == f"stopped by SIGTERM{where} before anything was measured"


def test_gpu_suites_table_prints_a_decode_suite_its_timeout_stopped(monkeypatch, tmp_path, capsys):
    _stop_at_call(monkeypatch, decode, "_timed_generate", 4 + 3, stop_signals.Stopped(signal.SIGTERM))
    partial = decode.run_decode_bench(**DECODE, repeats=2)
    report = {"suites": ["decode"], "stopped": {"signal": "SIGTERM", "suite": "decode"}, "decode": partial}
    (tmp_path / "decode-70m.json").write_text(json.dumps(report))
    (tmp_path / "decode-70m.rc").write_text("124\n")
    (tmp_path / "train-70m.json").write_text(json.dumps({"stopped": {"signal": "SIGTERM"}}))  # before any suite
    (tmp_path / "train-70m.rc").write_text("143\n")
    gpu_suites_table = helpers.tool("gpu_suites_table")
    gpu_suites_table.main(tmp_path)
    out = capsys.readouterr().out
    assert re.search(r"^decode-70m +TIMEOUT \(partial: decode\) ", out, re.M)
    assert re.search(r"^train-70m +FAILED \(exit 143\) \(partial: nothing measured\) ", out, re.M)
    assert "STOPPED by SIGTERM after 0 of 2 timed rounds of the architectures" in out


def test_memory_suite_stopped_keeps_the_models_it_measured(monkeypatch):
    # Eager heads first, then the compiled ones: a stop in the compiled pair keeps the eager comparison.
    def fake_subprocess(cfg, batch_size, seq_len, device, steps, threads, compile=False):
        peak = {"standard": 100, "onona": 103}[cfg.head] * 2**20
        row = dict(head=cfg.head, mode="compiled" if compile else "eager", params_total=1, step_s=[0.5])
        row.update(peak_bytes=peak, state_bytes=2**20, other_bytes=peak - 2**20, device="cpu", threads=1)
        return row | {"precision": "fp32", "memory_method": "fake"}

    monkeypatch.setattr(memory, "measure_in_subprocess", fake_subprocess)
    _stop_at_call(monkeypatch, memory, "measure_in_subprocess", 4, stop_signals.Stopped(signal.SIGTERM))
    report = memory.run_memory_bench(
        backbone="dense", d_model=32, depth=1, vocab_size=50, compile=True, print_table=False
    )
    assert [(r["head"], r["mode"]) for r in report["heads"]] == [
        ("standard", "eager"),
        ("onona", "eager"),
        ("standard", "compiled"),
    ]
    assert report["heads"][1]["peak_vs_standard"] == pytest.approx(1.03)
    assert report["stopped"] == {"signal": "SIGTERM", "timed_rounds_done": 3, "timed_rounds": 4}
    assert memory.format_report(report).endswith("STOPPED by SIGTERM after 3 of 4 models")
    _stop_at_call(monkeypatch, memory, "measure_in_subprocess", 1, KeyboardInterrupt())  # before the first
    report = memory.run_memory_bench(backbone="dense", d_model=32, depth=1, vocab_size=50, print_table=False)
    assert report["heads"] == [] and report["device"] is None and report["stopped"]["timed_rounds_done"] == 0
    assert "after 0 of 2 models" in memory.format_report(report)


def test_windowed_suite_stopped_keeps_the_lengths_it_timed(monkeypatch, capsys):
    # Two lengths x two blocks = 4 runs a round; the stop is the first timed round's 3rd run (T = 64,
    # windowed): T = 32 has a row, T = 64 none, and the target (read at T = 64) is not measured.
    _stop_at_call(monkeypatch, windowed, "_step", 4 + 3, stop_signals.Stopped(signal.SIGTERM))
    argv = ["bench", "--suite", "windowed", "--d-model", "32", "--repeats", "2", "--device", "cpu"]
    argv += ["--windowed-lens", "32,64", "--windowed-width", "64", "--windowed-tokens", "128", "--json"]
    assert main(argv) == 143
    report = json.loads(capsys.readouterr().out)
    assert report["stopped"] == {"signal": "SIGTERM", "suite": "windowed"}
    win = report["windowed"]
    assert [r["seq_len"] for r in win["rows"]] == [32] and win["rows"][0]["tango_vs_windowed"] > 0
    assert win["longest_vs_first"] is None and win["target_met"] is None
    assert win["stopped"] == {"signal": "SIGTERM", "timed_rounds_done": 0, "timed_rounds": 2}
    text = windowed.format_report(win)
    assert "target:" not in text and text.endswith("the lengths not reached have no row")
    win["rows"] = []  # stopped in the warm-up
    assert "vs T=-" in windowed.format_report(win)


def test_a_suite_stopped_in_its_rounds_ends_suite_all(monkeypatch):
    # The next suite ran on after timeout's SIGTERM, to be SIGKILLed 30 s later with no report printed.
    args = parse_args(["bench", "--suite", "all", "--json"])  # before the suites are stand-ins
    names, ran = list(suite.BENCH_SUITES), []

    def fake_run(name):
        def run(args, show, progress):
            ran.append(name)
            return {"stopped": {"signal": "SIGTERM", "timed_rounds_done": 1, "timed_rounds": 3}}

        return run

    for name in names:
        monkeypatch.setitem(suite.BENCH_SUITES, name, SimpleNamespace(check=lambda args: None, run=fake_run(name)))
    out = suite.run(args)
    assert ran == names[:1]
    assert out["stopped"] == {"signal": "SIGTERM", "suite": names[0]} and names[1] not in out
