"""The measurement scripts under tools/ run end to end at tiny sizes, so the docs' commands keep
working (their timings are not checked)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.ops import cpu_kernels
from tango_lm.ops.dispatch import ENV
from tests import helpers

TOOLS = helpers.TOOLS


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _run_here(monkeypatch, capsys, script: str, *args: str) -> str:
    """`script` with these arguments in this process (for the scripts' other cases: seconds of imports saved)."""
    monkeypatch.setattr(sys, "argv", [script, *args])
    helpers.tool(script.removesuffix(".py")).main()
    return capsys.readouterr().out


def test_op_speed_pair():
    out = _run("op_speed.py", "windowed", "1", "40", "64")
    assert out.startswith("fused") and "composition" in out


def test_op_speed_variants(monkeypatch, capsys):
    # "tango" sets the op's block size in its module: in a process of its own.
    for out in (
        _run("op_speed.py", "tango", "1", "40", "128", "16"),
        _run_here(monkeypatch, capsys, "op_speed.py", "causal", "2", "40", "8"),
    ):
        assert out.startswith("blocked") and "composition" in out
        assert ("C kernels" in out) == cpu_kernels.available()


def test_op_speed_pieces(monkeypatch, capsys):
    out = _run_here(monkeypatch, capsys, "op_speed.py", "pieces", "80", "64")
    assert "blocks of 32" in out and "blocks of 64" in out and "full square" in out
    assert "blocks of 128" not in out  # no block as long as the sequence


def test_step_profile():
    out = _run(
        "step_profile.py",
        "tango:64",
        "loop-transformer:64",
        "--seq-len",
        "16",
        "--batch-size",
        "1",
        "--steps",
        "1",
        "--top",
        "3",
    )
    assert "tango:64:" in out and "loop-transformer:64:" in out and "GFLOP/s" in out


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the tool has nothing to compare")
def test_tango_kernels_tool(monkeypatch, capsys):
    out = _run("tango_kernels.py", "products", "40", "128", "--rounds", "1")
    assert out.count("C kernel ") == 3 and out.count("MKL blocks of 64") == 3
    # The C arm runs the kernels and only it, wherever `auto` would not (an Intel CPU with MKL).
    arms, real = [], cpu_kernels.gate_average
    monkeypatch.setattr(cpu_kernels, "gate_average", lambda *a: arms.append(os.environ.get(ENV)) or real(*a))
    monkeypatch.delenv(ENV, raising=False)
    out = _run_here(monkeypatch, capsys, "tango_kernels.py", "steps", "16", "--steps", "1")
    assert "tango, C kernels" in out and "tango, blocked" in out and "x 1.000" in out
    assert arms and set(arms) == {"c"} and ENV not in os.environ


def test_logging_overhead_tool(monkeypatch, capsys):
    # Its LogContext call kept an argument the class had dropped: a TypeError before its first step.
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    args = ["--steps", "2", "--d-model", "32", "--width", "64", "--depth", "1", "--seq-len", "16", "--batch-size", "2"]
    out = _run_here(monkeypatch, capsys, "logging_overhead.py", *args, "--threads", "1")
    assert "loggers jsonl+tensorboard+wandb" in out and "ratio of medians (all loggers / jsonl)" in out


def test_gpu_suites_script_and_table(tmp_path, capsys):
    # The GPU script parses; its table reads what the suites wrote (a tiny CPU decode report here,
    # plus a suite that timed out), one status line per suite, then each suite's own table.
    assert subprocess.run(["bash", "-n", str(TOOLS / "gpu_suites.sh")]).returncode == 0
    tiny = ("--archs", "tango", "--d-model", "32", "--depth", "2", "--tango-width", "64", "--vocab-size", "40")
    decode = ("--prompt-len", "3", "--new-tokens", "2", "--decode-batches", "1", "--repeats", "1", "--head-vocab", "50")
    assert main(["bench", "--suite", "decode", *tiny, *decode, "--device", "cpu", "--json"]) == 0
    (tmp_path / "decode-small.json").write_text(capsys.readouterr().out)
    (tmp_path / "decode-small.rc").write_text("0\n")
    (tmp_path / "decode-small.log").write_text("== decode-small\ndecode-small rc=0 3s\n")
    (tmp_path / "train-70m.rc").write_text("124\n")
    (tmp_path / "train-70m.log").write_text("== train-70m\ntrain-70m rc=124 900s\n")
    helpers.tool("gpu_suites_table").main(tmp_path)
    out = capsys.readouterr().out
    assert "decode-small  ok" in out and "train-70m     TIMEOUT" in out and "900s" in out
    assert "[decode-small]" in out and "decode: device cpu" in out and "[train-70m]" not in out


def test_gpu_versions_script_pins_the_floors_pyproject_promises():
    # pyproject's floors are the versions the tests ran on; the script runs them at those floors.
    script = (TOOLS / "test_gpu_versions.sh").read_text()
    assert subprocess.run(["bash", "-n", str(TOOLS / "test_gpu_versions.sh")]).returncode == 0
    pyproject = (helpers.ROOT / "pyproject.toml").read_text()
    floors = dict(re.findall(r'^\s*(?:triton = \[)?"(torch|triton)>=([0-9.]+)', pyproject, flags=re.M))
    assert set(floors) == {"torch", "triton"}
    for package, floor in floors.items():  # the pins' default: an exact release at the floor
        assert f"{package.upper()}_VERSION=${{{package.upper()}_VERSION:-{floor}.0}}\n" in script


# A stand-in for `python3 -m venv DIR`: DIR/bin/python records each call's arguments, and the pins
# file (-c FILE) of pip's, then exits 0 (the import check and pytest included).
_FAKE_PYTHON = r"""#!/usr/bin/env bash
mkdir -p "$3/bin"
cat > "$3/bin/python" <<'STUB'
#!/usr/bin/env bash
here=$(dirname "$0")/..
echo "$*" >> "$here/calls"
if [ "$1 $2 $3" = "-m pip install" ]; then cat "$5" >> "$here/pins"; echo -- >> "$here/pins"; fi
STUB
chmod +x "$3/bin/python"
"""


@pytest.mark.parametrize(
    "env, venv, pins",
    [
        ({}, ".venv-gpu-versions", "torch==2.11.0\nnumpy<2.4\ntriton==3.6.0\n"),
        ({"TORCH_VERSION": "2.15.0"}, ".venv-torch-2.15.0", "torch==2.15.0\nnumpy<2.4\n"),
        (
            {"TORCH_VERSION": "2.14.1", "TRITON_VERSION": "3.8.0"},
            ".venv-torch-2.14.1-triton-3.8.0",
            "torch==2.14.1\nnumpy<2.4\ntriton==3.8.0\n",
        ),
    ],
)
def test_gpu_versions_script_installs_the_releases_asked_for_in_a_venv_of_their_own(tmp_path, env, venv, pins):
    # TORCH_VERSION alone pins no triton: its CUDA build requires its own (torch 2.14.1's 3.8).
    (tmp_path / "tools").mkdir()
    script = tmp_path / "tools" / "test_gpu_versions.sh"
    script.write_text((TOOLS / "test_gpu_versions.sh").read_text())
    fake = tmp_path / "python"
    fake.write_text(_FAKE_PYTHON)
    fake.chmod(0o755)
    run_env = {k: v for k, v in os.environ.items() if k not in ("VENV", "TORCH_VERSION", "TRITON_VERSION")}
    proc = subprocess.run(
        ["bash", str(script), "-k", "x"], env={**run_env, **env, "PYTHON": str(fake)}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.glob(".venv*")] == [venv]
    assert (tmp_path / venv / "pins").read_text() == f"{pins}--\n" * 2  # both pip installs under the pins
    assert (tmp_path / venv / "calls").read_text().splitlines()[-1].endswith(" -k x")  # then pytest, as asked


def test_delta_rule_bench():
    args = ("--batch", "1", "--heads", "2", "--seq-len", "9", "--head-dim", "4", "--chunk", "4", "--rounds", "2")
    # --no-compile: inductor's compile alone takes 10-30 s on a 2-core CPU (tests/ops/test_delta_rule.py compiles the op).
    out = _run("delta_rule_bench.py", *args, "--threads", "1", "--no-compile")
    assert "chunked" in out and "x 1.00" in out and "compiled" not in out and "fla" not in out  # no CUDA here


def _gpu_suites(out: Path, **env: str) -> Path:
    proc = helpers.gpu_suites_process(out, **env)
    assert proc.returncode == 0, proc.stderr
    return out


def test_gpu_suites_runs_only_the_suites_named(tmp_path):
    # One command on a lent GPU machine runs at most 10 minutes, all suites far longer: SUITES picks.
    out = _gpu_suites(tmp_path / "out", SUITES="decode-small memory")
    assert sorted(p.name for p in out.glob("*.json")) == ["decode-small.json", "memory.json"]
    assert "--suite decode --compile" in (out / "decode-small.json").read_text()


def test_gpu_suites_budget_cuts_the_timeouts_and_skips_what_does_not_fit(tmp_path):
    # BUDGET_S: the script ends, table and all, before a lent machine's per-command limit.
    out = _gpu_suites(tmp_path / "out", SUITES="decode-small memory", BUDGET_S="150")
    # 150 - 45 - the seconds the script has run (bash's SECONDS ticks whole seconds), not 600
    assert re.match(r"== decode-small \(timeout 10[345]s\)", (out / "decode-small.log").read_text())
    assert re.match(r"== memory \(timeout 10[345]s\)", (out / "memory.log").read_text())
    out = _gpu_suites(tmp_path / "out2", SUITES="decode-small memory", BUDGET_S="100")  # 55 s left: nothing runs
    assert (out / "memory.rc").read_text().strip() == "skipped" and not (out / "memory.json").exists()
    assert "memory        SKIPPED (budget)" in _run("gpu_suites_table.py", str(out))


def test_gpu_suites_refuses_an_unknown_suite_and_exits_1_when_one_fails(tmp_path):
    # A misspelt name ran nothing and printed an empty table, exit 0: a lent machine's call wasted.
    proc = helpers.gpu_suites_process(tmp_path / "out", SUITES="train-70m-4096")
    assert proc.returncode == 2 and proc.stderr.startswith("error: unknown suite 'train-70m-4096' in SUITES")
    assert not (tmp_path / "out").exists()
    # a suite that fails: the script's exit code says so (it was the table's, always 0)
    proc = helpers.gpu_suites_process(tmp_path / "out", PYTHON="false", SUITES="windowed")
    assert proc.returncode == 1 and (tmp_path / "out" / "windowed.rc").read_text().strip() == "1"
    out = _gpu_suites(tmp_path / "archs", SUITES="train-70m decode-70m windowed", ARCHS="tango,loop-transformer")
    for name in ("train-70m", "decode-70m"):
        assert "--archs tango,loop-transformer" in (out / f"{name}.json").read_text()
    assert "--archs" not in (out / "windowed.json").read_text()


def test_gpu_session_suites_default_to_a_budget_that_fits_one_call(tmp_path):
    # Without BUDGET_S each suite took its own 10-15 minute timeout: the device tool killed the call
    # before its table and its packing.
    env = {**os.environ, "PYTHON": "echo", "SUITES": "memory", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(TOOLS / "gpu_session.sh"), "suites"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tmp_path / "suites.tar.gz") as archive:
        log = archive.extractfile("./suites/memory.log").read().decode()
    assert re.match(r"== memory \(timeout 49[345]s\)", log)  # 540 - 45 - the seconds it has run
    for budget in ("900", "60", "soon"):
        proc = subprocess.run(
            ["bash", str(TOOLS / "gpu_session.sh"), "suites"],
            capture_output=True,
            text=True,
            env={**env, "BUDGET_S": budget},
        )
        assert proc.returncode == 2 and proc.stderr.startswith("error: BUDGET_S must be 120-540 seconds")


def test_gpu_session_packs_a_part_into_one_file_and_ends_with_its_table(tmp_path):
    # A lent machine returns at most 8 files and the output's tail: one archive, the table last.
    session = [str(TOOLS / "gpu_session.sh")]
    scratch = tmp_path / "scratch"  # its working folder's parent: left empty once the part is packed
    scratch.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": "echo", "SUITES": "decode-small memory", "OUT": str(out), "TMPDIR": str(scratch)}
    proc = subprocess.run(["bash", *session, "suites"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list(scratch.iterdir()) == []
    *_, table, packed = proc.stdout.strip().splitlines()
    assert table.startswith("tools/gpu_suites_table.py") and packed.startswith("packed 8 files into")
    assert [p.name for p in out.iterdir()] == ["suites.tar.gz"]
    with tarfile.open(out / "suites.tar.gz") as archive:
        names = set(archive.getnames())
    assert {"./suites/decode-small.json", "./suites/memory.log", "./suites.out", "./session.txt"} <= names
    for argv, env_out, message in (
        (["other"], str(out), "usage:"),
        (["suites"], str(tmp_path / "missing"), "error: set OUT"),
    ):
        proc = subprocess.run(
            ["bash", *session, *argv], capture_output=True, text=True, env={**env, "OUT": env_out}, timeout=60
        )
        assert proc.returncode == 2 and proc.stderr.startswith(message) and proc.stderr.count("\n") == 1


def test_gpu_step_profile_smoke_and_its_categories(tmp_path):
    # On a CPU it profiles ops (self time) at tiny sizes; the categories are for CUDA kernels' names.
    gpu_step_profile = helpers.tool("gpu_step_profile")
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, cutlass::bfloat16_t>>(Flash_fwd_params)": (
            "attention"
        ),
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>)": (
            "attention"
        ),
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)": "matmul",
        "triton_poi_fused__to_copy_add_mul_0": "inductor",
        "gates_backward_kernel": "project triton",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>(...)": "optimizer",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int, ...)": "elementwise",
        "void (anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)": "other",
    }
    assert {n: gpu_step_profile.category(n) for n in names} == names
    out = _run(
        "gpu_step_profile.py",
        *("--device", "cpu", "--d-model", "32", "--seq-len", "16", "--depth", "2", "--batch-size", "2"),
        *(
            "--tango-width",
            "64",
            "--vocab-size",
            "61",
            "--steps",
            "2",
            "--top",
            "4",
            "--json",
            str(tmp_path / "p.json"),
        ),
    )
    report = json.loads((tmp_path / "p.json").read_text())
    assert [r["arch"] for r in report["models"]] == ["tango", "loop-transformer"]
    for r in report["models"]:
        assert r["wall_ms"] > 0 and r["idle_share"] is None  # no device timeline on a CPU
        assert sum(r["categories_ms"].values()) == pytest.approx(r["kernel_ms"])
        assert len(r["top"]) == 4 and [t["ms"] for t in r["top"]] == sorted((t["ms"] for t in r["top"]), reverse=True)
        assert r["categories_ms"]["matmul"] > 0
    assert out.startswith("step profile: cpu") and "by category (ms): " in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--archs", "nope"], "error: unknown architecture 'nope'"),
        (["--d-model", "0"], "error: --steps, --top, --batch-size, --seq-len, --d-model"),
        (["--device", "mps"], "error: --device 'mps': cuda (cuda:N) or cpu"),
        (["--json", "/nonexistent-dir/p.json"], "error: --json /nonexistent-dir/p.json: no directory"),
    ],
)
def test_gpu_step_profile_refuses_bad_arguments_in_one_line(args, message, capsys):
    tiny = ["--device", "cpu", "--d-model", "32", "--depth", "1", "--seq-len", "16", "--tango-width", "64"]
    assert helpers.tool("gpu_step_profile").main([*tiny, *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err


def test_serve_bench_counts_generate_s_tokens_as_the_server_does():
    # generate's rows were counted with their end-of-text, the server's usage without: every row
    # that ended counted one token more for generate (the server/generate ratio about 5% low).
    import torch

    from tango_lm.data.tokenizers import get_tokenizer
    from tango_lm.serve.batcher import RowText

    serve_bench, tok = helpers.tool("serve_bench"), get_tokenizer("byte")
    rows = [[65, 66, tok.eot_id, tok.eot_id], [67, 68, 69, 70]]  # one ended, one ran to max_tokens

    def generate(model, prompt, max_tokens, **kwargs):
        return torch.cat([prompt, torch.tensor(rows)], 1)

    served = 0
    for row in rows:
        text = RowText(tok, [], 4)
        for token in row:
            text.push(token)
            if text.finish:
                break
        served += len(text.ids)
    old = serve_bench.generate
    serve_bench.generate = generate
    try:
        assert serve_bench.generate_round(None, tok, 2, 4)[1] == served == 6
    finally:
        serve_bench.generate = old


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("gate_average_bench", ["--device", "cpu", "--rounds", "0"]),
        ("gate_average_bench", ["--device", "cpu", "--width", "0"]),
        ("relu2_attention_bench", ["--device", "cpu", "--seq-len", "0"]),
        ("delta_rule_bench", ["--rounds", "0"]),
        ("step_profile", ["--steps", "0"]),
        ("step_profile", ["loop-transformer"]),
        ("tango_kernels", ["products", "64", "256", "--rounds", "0"]),
        ("tango_kernels", ["steps", "32", "--steps", "0"]),
        ("tango_kernels", ["products", "0", "256"]),  # a table of 0 GFLOP/s
    ],
)
def test_bench_tools_refuse_sizes_they_cannot_time(tool, args, monkeypatch, capsys):
    # A traceback each (no median of 0 rounds, a division by 0 steps, an unpacking error).
    monkeypatch.setattr(sys, "argv", [f"{tool}.py", *args])
    module = helpers.tool(tool)
    with pytest.raises(SystemExit) as stop:
        module.main(args) if tool in ("gate_average_bench", "relu2_attention_bench") else module.main()
    assert stop.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("op_speed.py", [], "error: usage: python tools/op_speed.py causal N T E"),
        ("op_speed.py", ["causal", "x", "64", "32"], "causal takes 3 sizes of 1 or more"),
        ("op_speed.py", ["tango", "1", "64", "250"], "give a multiple of 8 (got 250)"),
        ("op_speed.py", ["pieces", "64", "12"], "give a multiple of 8 (got 12)"),
        ("tango_kernels.py", ["products", "64"], "error: products takes T F (got 1 sizes)"),
        ("tango_kernels.py", ["products", "64", "250"], "give a multiple of 8 (got 250)"),  # a reshape traceback
        ("step_profile.py", ["nope:12"], "error: unknown architecture 'nope'"),
        ("saved_for_backward.py", ["heads", "--heads", "nope"], "error: unknown head 'nope'"),
        ("triton_ptxas_report.py", ["--ops", "relu2", "--kernels", "nope"], "error: unknown --kernels nope"),
        ("triton_ptxas_report.py", ["--arch", "5"], "error: --arch 5: triton compiles for compute capability 7.5"),
        ("compare_dmmath_generators.py", [sys.executable], "error: give at least two interpreters to compare"),
        ("compare_dmmath_generators.py", ["/no/python", "/no/python"], "error: cannot run /no/python: No such file"),
    ],
)
def test_tools_refuse_bad_arguments_in_one_line_as_scripts(script, args, message):
    # Each was a traceback (exit 1) or, for unknown kernels, an empty table with exit 0.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_head_bench_refuses_unknown_variants_and_empty_sizes():
    from tango_lm.bench import heads
    from tango_lm.errors import UserError

    with pytest.raises(UserError, match="unknown --variants 'nope'; choose from standard"):
        heads.main(["--variants", "nope"])
    with pytest.raises(UserError, match="--positions must be at least 1"):
        heads.main(["--positions", "0"])


def test_gpu_op_benches_on_a_cpu_run_small_sizes_unless_given(monkeypatch):
    # `--device cpu` is documented as a smoke test, but ran the GPU's sizes (killed at ~23 GB).
    for script, sizes in (
        ("gate_average_bench", {"batch": 1, "heads": 2, "seq_len": 64, "width": 20, "head_dim": 8, "rounds": 2}),
        ("relu2_attention_bench", {"batch": 1, "seq_len": 64, "qk_dim": 16, "width": 24, "rounds": 2}),
    ):
        module = helpers.tool(script)
        seen = {}
        monkeypatch.setattr(module, "run", lambda args, _seen=seen: _seen.update(vars(args)) or {})
        monkeypatch.setattr(module, "format_report", lambda report: "")
        for given in (["--seq-len=32"], ["--seq", "32"]):  # argparse takes abbreviations too
            module.main(["--device", "cpu", *given])
            assert {k: seen[k] for k in sizes} == {**sizes, "seq_len": 32}, script  # what is given stays


class _Parsed(Exception):
    """Raised in place of parsing, carrying the parser a tool built."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _parser_of(main: Callable[..., object], monkeypatch) -> argparse.ArgumentParser:
    def capture(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", ["tool"])
    with pytest.raises(_Parsed) as parsed:
        main()
    return parsed.value.parser


@pytest.mark.parametrize(
    "script", sorted(p.stem for p in TOOLS.glob("*.py") if "ArgumentParser(" in p.read_text(encoding="utf-8"))
)
def test_every_argument_of_every_tool_says_what_it_does_in_help(script, monkeypatch):
    # docs/benchmarks.md sends users to these scripts; 69 of their arguments once showed a bare name.
    parser = _parser_of(helpers.tool(script).main, monkeypatch)
    assert helpers.arguments_without_help(parser, script) == []
    assert "usage:" in parser.format_help()  # a stray '%' in a help line breaks only here


def test_every_argument_of_the_head_bench_says_what_it_does_in_help(monkeypatch):
    from tango_lm.bench import heads

    assert helpers.arguments_without_help(_parser_of(heads.main, monkeypatch), "bench.heads") == []


def test_saved_for_backward_gpu_path_says_what_it_skips_and_refuses_a_t_it_cannot_tell_apart(capsys):
    # T = d read every [B, T, d] tensor as a [T, T] one ("yes" in every row); a model it could not
    # build at these sizes left the table without a word.
    tool = helpers.tool("saved_for_backward")
    tiny = ["gpu-path", "--d-model", "64", "--depth", "2", "--tango-width", "512", "--vocab-size", "300"]
    tiny += ["--batch-size", "2", "--archs", "loop-transformer,tango-3set"]
    from tango_lm.errors import UserError

    with pytest.raises(UserError, match="--seq-len 64 is loop-transformer's d too"):
        tool.main([*tiny, "--seq-len", "64"])
    with pytest.raises(UserError, match="--seq-len 128 is gau's qk_dim too"):  # GAU's [B, T, s], s = 128
        tool.main([*tiny[:-1], "gau", "--seq-len", "128"])
    tool.main([*tiny, "--seq-len", "48"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1].startswith("skipped: a 3-set model needs depth >= 3")
    assert rows[-2].startswith("loop-transformer") and " no " in rows[-2]


def test_make_presets_check_writes_nothing_and_names_what_is_out_of_date(monkeypatch, capsys):
    # `--check` was ignored: the tool rewrote every preset.
    tool = helpers.tool("make_presets")
    assert tool.main(["--check"]) == 0 and "up to date" in capsys.readouterr().out
    real = tool.tango_presets()
    monkeypatch.setattr(tool, "tango_presets", lambda: {**real, "tango-70m-d4": "# changed\n", "new-one": "# new\n"})
    before = {p.name: p.stat().st_mtime_ns for p in tool.PRESET_DIR.glob("*.yaml")}
    assert tool.main(["--check"]) == 1
    assert "2 presets out of date (new-one, tango-70m-d4); run python tools/make_presets.py" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in tool.PRESET_DIR.glob("*.yaml")} == before
