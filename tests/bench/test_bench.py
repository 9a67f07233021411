"""Smoke tests of `tango-lm bench` (bench/suite.py and the suites it runs): tiny sizes, one or two
steps; they check the reports' structure and that every ratio is computed from the measured
numbers. No timing thresholds: the machine is shared."""

from __future__ import annotations

import argparse
import json
import re
import statistics

import pytest
import torch

from tango_lm.bench import child, decode, memory, training
from tango_lm.bench import windowed as windowed_bench
from tango_lm.cli import main
from tango_lm.models.config import ModelConfig
from tango_lm.ops import cpu_kernels
from tests import arch_cases, helpers

TINY = [
    "--d-model",
    "32",
    "--depth",
    "3",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--tango-width",
    "256",
    "--vocab-size",
    "40",
    "--peak-size",
    "128",
]


def _bench_json(capsys, *args: str) -> dict:
    assert main(["bench", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_suite_rows_and_ratios(capsys):
    report = _bench_json(
        capsys, "--suite", "train", "--archs", "tango,gau,flash", *TINY, "--steps", "2", "--warmup", "1", "--no-memory"
    )
    assert report["suites"] == ["train"] and "environment" in report and report["stopped"] is None
    train = report["train"]
    assert train["stopped"] is None and train["not_measured"] == []
    rows = {r["arch"]: r for r in train["models"]}
    assert list(rows) == ["tango", "gau", "flash", "loop-transformer"]  # the baseline is added
    base = rows["loop-transformer"]
    peak = train["matmul_peak_flop_per_s"]
    assert peak == max(train["matmul_peak_before"], train["matmul_peak_after"]) > 0
    for r in rows.values():
        cfg = ModelConfig(arch=r["arch"], d_model=32, depth=3, width=r["width"], vocab_size=40, context_length=16)
        assert r["params_total"] == cfg.num_params()["total"]
        assert r["flops_per_token"] == cfg.flops_per_token(16)
        assert len(r["step_s_all"]) == 2
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / r["step_s"])
        assert r["flop_per_s"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"])
        assert r["mfu"] == pytest.approx(r["flop_per_s"] / peak)
        assert r["tokens_per_s_vs_loop"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
        assert r["mfu_vs_loop"] == pytest.approx(r["mfu"] / base["mfu"])
        assert r["tokens_per_cpu_s_vs_loop"] == pytest.approx(base["cpu_s"] / r["cpu_s"])
        assert r["peak_bytes"] is None and r["memory_vs_loop"] is None
    assert rows["tango"]["note"].startswith("reference") and rows["gau"]["note"].startswith("matched")


def test_train_bench_on_the_callers_own_configs():
    cfgs = [
        ModelConfig(arch=arch, d_model=32, depth=2, width=width, vocab_size=40, context_length=16)
        for arch, width in (("gau", 48), ("loop-transformer", 64))
    ]
    report = training.run_training_bench(
        configs=cfgs, seq_len=16, batch_size=2, steps=1, warmup=0, memory=False, device="cpu", print_table=False
    )
    assert [(r["arch"], r["width"], r["note"]) for r in report["models"]] == [
        ("gau", 48, "given"),
        ("loop-transformer", 64, "given"),
    ]
    assert report["baseline"] == "loop-transformer" and report["skipped"] == []


def test_unmatched_and_unbuildable_archs_say_so():
    triples = training.matched_configs(["tango-3set", "tango"], 32, 1, 64, 40, 16)
    assert [a for a, _, _ in triples] == ["tango-3set", "tango", "loop-transformer"]
    arch, cfg, note = triples[0]
    assert cfg is None and note.startswith("skipped") and "depth" in note
    ((_, cfg, note),) = [t for t in training.matched_configs(["gau"], 32, 3, 64, 40, 16) if t[0] == "gau"]
    assert cfg.width == 4 * 32 and note.startswith("NOT matched")


def test_default_bench_is_the_original_pair(capsys):
    report = _bench_json(capsys, *TINY, "--steps", "1", "--warmup", "0", "--no-memory")
    assert [r["arch"] for r in report["models"]] == ["loop-transformer", "tango"]
    assert report["models"][0]["tokens_per_s_vs_loop"] == 1.0
    text = training.format_report(report)
    assert "train: device" in text and "tok/s = median of 1 timed steps" in text
    assert f"causal products: {cpu_kernels.describe()};" in text  # what TANGO's products ran on


def test_decode_suite_rows_and_ratios():
    report = decode.run_decode_bench(
        archs=("tango", "loop-transformer", "gau"),
        d_model=32,
        depth=2,
        tango_width=64,
        vocab_size=40,
        prompt_len=3,
        new_tokens=2,
        batches=(1, 2),
        repeats=1,
        head_vocab=50,
        device="cpu",
        print_table=False,
    )
    keys = ["b1 greedy", "b1 t=1", "b2 greedy", "b2 t=1"]
    base = next(r for r in report["archs"] if r["arch"] == "loop-transformer")
    for r in report["archs"]:
        assert list(r["tokens_per_s"]) == keys
        for k in keys:
            assert r["tokens_per_s_vs_loop"][k] == pytest.approx(r["tokens_per_s"][k] / base["tokens_per_s"][k])
        assert r["cache_bytes_per_token"] > 0
        assert r["cache_vs_loop"] == pytest.approx(r["cache_bytes_per_token"] / base["cache_bytes_per_token"])
        assert list(r["prefill_tokens_per_s"]) == ["b1", "b2"] and r["prefill_tokens_per_s"]["b2"] > 0
        assert r["prefill_vs_loop"]["b2"] == pytest.approx(
            r["prefill_tokens_per_s"]["b2"] / base["prefill_tokens_per_s"]["b2"]
        )
    heads = report["heads"]["variants"]
    assert [h["variant"] for h in heads] == ["standard", "onona-one", "onona-both"]
    for h in heads:
        assert h["tokens_per_s_vs_standard"]["b2"] == pytest.approx(
            h["tokens_per_s"]["b2"] / heads[0]["tokens_per_s"]["b2"]
        )
    text = decode.format_report(report)
    assert "decode: device" in text and "decode heads:" in text and "onona-both" in text and "prefill b2" in text


def test_decode_warmup_compiles_the_timed_rounds_capacity():
    # The warm-up's static decoder must be the timed rounds' (same capacity bucket), or the first
    # timed round compiles: prompt 32 + 128 new tokens read 159 positions (bucket 256), so the
    # warm-up needs 98 new tokens (129 positions); prompt 512 + 256 is in bucket 1024 from 8 on.
    assert decode.warmup_tokens(32, 128, 1024) == 98
    assert decode.warmup_tokens(512, 256, 1024) == 8 and decode.warmup_tokens(3, 2, 5) == 2


def test_cache_bytes_per_token_of_a_transformer():
    cfg = ModelConfig(arch="loop-transformer", d_model=32, depth=2, width=64, vocab_size=40, context_length=8)
    model = cfg.build().eval()
    # keys and values, d_model floats each, per application (the loop applies its block depth times)
    assert decode.cache_bytes_per_token(model, 8, torch.device("cpu")) == 2 * 32 * 4 * 2


def test_windowed_suite_ratio_and_target(capsys):
    args = argparse.Namespace(
        windowed_lens=(8, 16),
        window=4,
        d_model=32,
        windowed_width=16,
        windowed_tokens=32,
        repeats=1,
        no_full_tango=False,
        device="cpu",
        clock="wall",
    )
    report = windowed_bench.run_suite(args, print_table=True)
    rows = report["rows"]
    assert [r["seq_len"] for r in rows] == [8, 16]
    assert rows[1]["windowed_vs_first"] == pytest.approx(
        rows[1]["windowed_us_per_token"] / rows[0]["windowed_us_per_token"]
    )
    assert report["longest_vs_first"] == rows[-1]["windowed_vs_first"]
    assert report["target_met"] == (report["longest_vs_first"] <= windowed_bench.TARGET)
    assert report["precision"] == "fp32" and "fp32, bench/windowed.py" in capsys.readouterr().out


def test_windowed_suite_runs_under_the_autocast_training_uses(monkeypatch, capsys):
    # On CUDA training runs under bf16 autocast (train/device.autocast_dtype), so the suite does too;
    # here the choice is forced to bf16 on a CPU, whose autocast takes it.
    monkeypatch.setattr(windowed_bench, "autocast_dtype", lambda precision, dev: torch.bfloat16)
    seen = []
    real = windowed_bench._step
    monkeypatch.setattr(windowed_bench, "_step", lambda *a: seen.append(a[-1]) or real(*a))
    args = argparse.Namespace(
        windowed_lens=(8,), window=4, d_model=32, windowed_width=16, windowed_tokens=16, repeats=1,
        no_full_tango=True, device="cpu", clock="wall",
    )  # fmt: skip
    report = windowed_bench.run_suite(args, print_table=True)
    assert report["precision"] == "bf16 autocast" and set(seen) == {torch.bfloat16}
    out = capsys.readouterr().out
    assert "bf16 autocast, bench/windowed.py" in out
    # --no-full-tango: no full-TANGO columns; one length compares nothing, so no target is "met".
    assert "the windowed block alone" in out and "tango us/tok" not in out and "target" not in out
    assert report["target_met"] is None and report["longest_vs_first"] is None


def test_training_step_memory_in_process():
    cfg = ModelConfig(arch="dense", d_model=32, depth=1, width=64, vocab_size=50, context_length=8)
    row = memory.measure_training_step(cfg.to_dict(), batch_size=1, seq_len=8, device="cpu", steps=1)
    assert row["param_bytes"] == 4 * cfg.num_params()["total"] == row["grad_bytes"]
    assert row["optimizer_bytes"] >= 2 * row["param_bytes"]  # AdamW's two moments (and its step counters)
    assert row["state_bytes"] == row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
    assert row["other_bytes"] == row["peak_bytes"] - row["state_bytes"]


def test_compiled_training_step_memory(cheap_compile):
    cfg = ModelConfig(arch="dense", d_model=32, depth=1, width=64, vocab_size=50, context_length=8)
    row = memory.measure_training_step(cfg.to_dict(), batch_size=1, seq_len=8, device="cpu", steps=1, compile=True)
    assert row["mode"] == "compiled" and row["param_bytes"] == 4 * cfg.num_params()["total"]


def test_memory_suite_in_subprocesses(capsys):
    report = _bench_json(
        capsys,
        "--suite",
        "memory",
        "--memory-backbone",
        "dense",
        "--d-model",
        "32",
        "--depth",
        "1",
        "--head-vocab",
        "50",
        "--memory-batch-size",
        "1",
        "--memory-seq-len",
        "8",
        "--memory-steps",
        "3",
    )
    mem = report["memory"]
    heads = {r["head"]: r for r in mem["heads"]}
    assert list(heads) == ["standard", "onona"] and mem["vocab_size"] == 50
    assert heads["onona"]["params_total"] == heads["standard"]["params_total"] + 50 * 32 + 32
    for r in heads.values():
        assert r["peak_bytes"] > 0
        assert r["peak_vs_standard"] == pytest.approx(r["peak_bytes"] / heads["standard"]["peak_bytes"])
        assert r["state_vs_standard"] == pytest.approx(r["state_bytes"] / heads["standard"]["state_bytes"])
        # the first step allocates AdamW's moments (and compiles, compiled): not a step's time
        assert len(r["step_s"]) == 3 and r["step_s_median"] == statistics.median(r["step_s"][1:])
    text = memory.format_report(mem)
    assert "memory: whole training step" in text and "step s = median of the steps after the first" in text
    assert "(which allocates AdamW's moments, and compiles a compiled mode)" in text  # not "(which compiles)"


def test_memory_suite_measures_the_heads_it_is_given(monkeypatch, capsys):
    # It measured Standard and onóna only: a new head could not be measured from the command line.
    seen = {}
    monkeypatch.setattr(memory, "run_memory_bench", lambda **kw: seen.update(kw) or {"heads": []})
    monkeypatch.setattr(memory, "format_report", lambda report: "")
    assert main(["bench", "--suite", "memory", "--memory-backbone", "dense", "--memory-heads", "mos,onona"]) == 0
    assert seen["heads"] == ("standard", "mos", "onona")  # Standard first: the ratios are to it
    for bad, said in (("mss", "unknown head 'mss' (did you mean 'moss'?)"), ("mos,mos", "a head is listed twice")):
        assert main(["bench", "--suite", "memory", "--memory-heads", bad]) == 2
        assert said in helpers.assert_one_error_line(capsys.readouterr().err)


@pytest.fixture
def cheap_compile(monkeypatch):
    """torch.compile with Dynamo's "eager" backend: the bench's compiled paths run, without inductor."""
    real = torch.compile

    def compile_eagerly(fn, **kwargs):
        kwargs.pop("mode", None)
        return real(fn, **{**kwargs, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_train_suite_compiled_rows_beside_eager(monkeypatch, capsys, cheap_compile):
    measured = []  # on a CPU a subprocess measures an eager step's memory: not again per compiled row

    def measure(cfg, *args):
        measured.append(cfg.arch)
        return {"peak_bytes": 2**20}

    monkeypatch.setattr(training, "measure_in_subprocess", measure)
    report = _bench_json(
        capsys, "--suite", "train", "--archs", "tango", *TINY, "--steps", "1", "--warmup", "1", "--compile"
    )["train"]
    assert report["modes"] == ["eager", "compiled"]
    rows = {(r["arch"], r["mode"]): r for r in report["models"]}
    assert set(rows) == {(a, m) for a in ("tango", "loop-transformer") for m in ("eager", "compiled")}
    assert sorted(measured) == ["loop-transformer", "tango"]
    assert [r["peak_bytes"] for r in report["models"] if r["mode"] == "compiled"] == [None, None]
    for (arch, mode), r in rows.items():
        assert r["tokens_per_s_vs_eager"] == pytest.approx(r["tokens_per_s"] / rows[arch, "eager"]["tokens_per_s"])
        assert r["tokens_per_s_vs_loop"] == pytest.approx(
            r["tokens_per_s"] / rows["loop-transformer", mode]["tokens_per_s"]
        )
    assert "vs eager" in training.format_report(report)
    assert main(["bench", "--suite", "train", *TINY, "--warmup", "0", "--compile", "--no-memory"]) == 2
    assert "warmup" in capsys.readouterr().err


def test_train_suite_compiles_every_model_past_dynamos_recompile_limit(monkeypatch):
    # Every model's `nll` is one code object to Dynamo: at its default limit of 8 entries a ninth
    # model would run eagerly in the "compiled" rows. The steps run with the limit raised.
    limits = []

    def recording(fn, **kwargs):
        return lambda *args: limits.append(torch._dynamo.config.recompile_limit) or fn(*args)

    monkeypatch.setattr(torch, "compile", recording)
    configs = [arch_cases.tiny_config(a, context_length=16) for a in arch_cases.names()][:9]
    assert len(configs) == 9
    training.run_training_bench(
        seq_len=16, batch_size=1, configs=configs, steps=1, warmup=1, memory=False, compile=True, device="cpu",
        print_table=False, peak_size=64,
    )  # fmt: skip
    assert len(limits) == 2 * 9 and min(limits) >= 10


def _broken(graph, example_inputs):
    raise torch._inductor.exc.InductorError(RuntimeError("no kernel for this operator"), None)


def _bench_with_a_failing_compile(monkeypatch, arch: str, backend) -> dict:
    """The tiny train bench, eager and compiled, with `arch`'s compile going through `backend`."""
    real = torch.compile  # cheap_compile's: it sets Dynamo's eager backend

    def compile_fails_for_arch(fn, **kwargs):
        if fn.__self__.config.arch == arch:
            return torch._dynamo.optimize(backend)(fn)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_fails_for_arch)
    tiny = dict(d_model=32, depth=3, seq_len=16, batch_size=2, tango_width=256, vocab_size=40, peak_size=128)
    return training.run_training_bench(
        **tiny, archs=("tango",), steps=1, warmup=1, memory=False, compile=True, device="cpu", print_table=False
    )


@pytest.mark.parametrize("broken_graph", ["forward", "backward"])
def test_train_suite_reports_a_model_that_cannot_compile_and_times_the_rest(monkeypatch, cheap_compile, broken_graph):
    from torch._dynamo.backends.common import aot_autograd

    # A backward graph is compiled by AOTAutograd at the first backward call, outside the forward's.
    backend = _broken if broken_graph == "forward" else aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=_broken)
    report = _bench_with_a_failing_compile(monkeypatch, "tango", backend)
    assert {(r["arch"], r["mode"]) for r in report["models"]} == {
        ("tango", "eager"),
        ("loop-transformer", "eager"),
        ("loop-transformer", "compiled"),
    }
    assert report["compile_failed"] == [{"arch": "tango", "error": "RuntimeError: no kernel for this operator"}]
    assert "tango              compiled   no row: torch.compile failed (RuntimeError" in training.format_report(report)


def test_a_mode_whose_baseline_did_not_compile_has_no_ratios(monkeypatch, cheap_compile):
    # Dividing by another model under the baseline's name would print tango compiled at 1.00x.
    report = _bench_with_a_failing_compile(monkeypatch, "loop-transformer", _broken)
    rows = {(r["arch"], r["mode"]): r for r in report["models"]}
    assert set(rows) == {("tango", "eager"), ("loop-transformer", "eager"), ("tango", "compiled")}
    compiled = rows["tango", "compiled"]
    assert compiled["tokens_per_s_vs_loop"] is None and compiled["mfu_vs_loop"] is None
    assert compiled["tokens_per_s_vs_eager"] is not None and rows["tango", "eager"]["mfu_vs_loop"] is not None
    line = next(x for x in training.format_report(report).splitlines() if x.startswith("tango") and "compiled" in x)
    assert line.split("%")[-1].split()[:5] == ["-"] * 5  # after MFU: peak MiB (not measured) and the four x


def test_decode_suite_static_columns(cheap_compile):
    report = decode.run_decode_bench(
        archs=("tango",),
        d_model=32,
        depth=2,
        tango_width=64,
        vocab_size=40,
        prompt_len=3,
        new_tokens=2,
        batches=(1,),
        repeats=1,
        heads=False,
        device="cpu",
        print_table=False,
        static=True,
    )
    assert report["paths"] == ["eager", "static"] and report["static_mode"] == "compile"
    for r in report["archs"]:
        assert list(r["tokens_per_s"]) == ["b1 greedy", "b1 greedy static", "b1 t=1", "b1 t=1 static"]
        assert r["static_vs_eager"]["b1 t=1"] == pytest.approx(
            r["tokens_per_s"]["b1 t=1 static"] / r["tokens_per_s"]["b1 t=1"]
        )
    assert "static x eager" in decode.format_report(report)


def test_decode_suite_marks_static_rows_whose_compile_failed(monkeypatch):
    # A static decoder whose compiled step fails decodes eagerly from then on (one log line): its
    # "static" rows were reported as static (CUDA-graph) steps, the fall-back said nowhere in the table.
    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("no graph today")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    tiny = dict(archs=("tango",), d_model=32, depth=2, tango_width=64, vocab_size=40, prompt_len=3, new_tokens=2)
    tiny.update(batches=(1,), repeats=1, head_vocab=50, device="cpu", print_table=False)
    report = decode.run_decode_bench(**tiny, static=True)
    assert [r["static_failed"] for r in report["archs"]] == [True, True]
    assert [r["static_failed"] for r in report["heads"]["variants"]] == [True, True, True]
    assert decode.format_report(report).count("static steps ran eagerly (compile failed)") == 5
    eager_only = decode.run_decode_bench(**tiny, heads=False)
    assert "static_failed" not in eager_only["archs"][0] and "ran eagerly" not in decode.format_report(eager_only)


def test_decode_suite_on_presets_keeps_their_sizes():
    triples = decode.preset_configs(["tango", "gau"], "70m", 4, 768)
    assert [a for a, _, _ in triples] == ["tango", "gau", "loop-transformer"]
    tango = triples[0][1]
    assert (tango.d_model, tango.width, tango.vocab_size, tango.context_length) == (512, 28480, 50257, 1024)
    assert all(c is not None and note.startswith("preset") for _, c, note in triples)
    assert decode.preset_configs(["dense"], "70m", 4, 768)[0][1] is None  # no such preset: skipped


def test_a_childs_user_error_is_the_parents_one_line(monkeypatch):
    # A measuring child that stops on a UserError: its one line, not a RuntimeError around its traceback.
    import subprocess

    from tango_lm.errors import UserError

    failed = subprocess.CompletedProcess([], 1, "", "Traceback ...\ntango_lm.errors.UserError: device 'x' is absent\n")
    monkeypatch.setattr(child.subprocess, "run", lambda *a, **k: failed)
    cfg = memory.memory_config("dense", 32, 1, 64, 8)
    with pytest.raises(UserError, match="^device 'x' is absent$"):
        memory.measure_in_subprocess(cfg, 1, 8)


def test_the_head_bench_reads_its_children_as_the_memory_suite_does(monkeypatch):
    # One runner for both (bench/child.py): a head-bench variant the OOM killer took was a
    # RuntimeError with an empty message, and its UserError a traceback.
    import subprocess

    from tango_lm.bench import heads
    from tango_lm.errors import UserError

    for ended, raised in (
        (subprocess.CompletedProcess([], -9, "", ""), MemoryError),
        (subprocess.CompletedProcess([], 1, "", "tango_lm.errors.UserError: device 'x' is absent\n"), UserError),
    ):
        monkeypatch.setattr(child.subprocess, "run", lambda *a, ended=ended, **k: ended)
        with pytest.raises(raised, match="head bench variant standard was killed|^device 'x' is absent$"):
            heads.run_head_bench(variants=("standard",), print_table=False)


def test_sizes_past_the_machines_memory_are_one_error_line(capsys):
    # A 42-line allocator traceback and exit 1. A width whose weights pass any address space (10^13
    # gate columns of 32 rows, ~1.3 PB) fails at allocation even where the kernel overcommits.
    argv = ["bench", "--d-model", "32", "--seq-len", "16", "--depth", "1", "--batch-size", "1", "--steps", "1"]
    argv += ["--warmup", "0", "--no-memory", "--peak-size", "64", "--quiet", "--tango-width", str(10**13)]
    assert main(argv) == 2
    err = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "the train suite ran out of memory (" in err and "lower --tango-width, --vocab-size" in err


def test_a_measuring_child_out_of_memory_is_a_memory_error(monkeypatch):
    # A child killed by the OOM killer (returncode -9) was a RuntimeError with an empty message: a
    # traceback, exit 1, and the rows measured before it lost.
    import subprocess

    cfg = memory.memory_config("dense", 32, 1, 64, 8)
    for ended, said in (
        (subprocess.CompletedProcess([], -9, "", ""), "dense/standard was killed by SIGKILL (the out-of-memory killer"),
        (
            subprocess.CompletedProcess(
                [], 1, "", "Traceback ...\nRuntimeError: [enforce fail] can't allocate memory: 9 GB\n"
            ),
            "dense/standard: RuntimeError: [enforce fail] can't allocate memory: 9 GB",
        ),
    ):
        monkeypatch.setattr(child.subprocess, "run", lambda *a, ended=ended, **k: ended)
        with pytest.raises(MemoryError, match=re.escape(said)):
            memory.measure_in_subprocess(cfg, 1, 8)
    monkeypatch.setattr(child.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess([], 1, "", "KeyError: x"))
    with pytest.raises(RuntimeError, match="failed:\nKeyError: x"):  # a bug stays a bug, with its traceback
        memory.measure_in_subprocess(cfg, 1, 8)


def test_the_memory_suite_keeps_the_heads_measured_before_one_ran_out_of_memory(monkeypatch, capsys):
    def measure(cfg, *args, **kwargs):
        if cfg.head == "onona":
            raise MemoryError("the memory measurement of dense/onona was killed by SIGKILL (the out-of-memory killer)")
        row = {"head": cfg.head, "mode": "eager", "params_total": 1, "step_s": [1.0, 2.0], "device": "cpu"}
        row |= {"threads": 1, "precision": "fp32", "memory_method": "peak RSS"}
        return row | {f"{k}_bytes": 2**20 for k in ("peak", "state", "other")}

    monkeypatch.setattr(memory, "measure_in_subprocess", measure)
    argv = ["bench", "--suite", "memory", "--memory-backbone", "dense", "--d-model", "32", "--depth", "1", "--quiet"]
    rc, out, err, _ = helpers.run_main(capsys, [*argv, "--json"])
    assert rc == 2 and [r["head"] for r in json.loads(out)["memory"]["heads"]] == ["standard"]
    err = helpers.assert_one_error_line(err)
    assert err.startswith("error: the memory suite ran out of memory (the memory measurement of dense/onona was")
    assert "lower --memory-seq-len, --memory-batch-size, --head-vocab" in err
    rc, out, err, _ = helpers.run_main(capsys, argv)
    assert rc == 2 and "FAILED after 1 models: the memory measurement of dense/onona" in out
    # With --compile, a head past the memory in eager mode stops the suite there: the compiled
    # models (measured after every eager one) would not fit either
    calls = []
    monkeypatch.setattr(memory, "measure_in_subprocess", lambda cfg, *a, **kw: calls.append(kw) or measure(cfg))
    rc, out, err, _ = helpers.run_main(capsys, [*argv, "--compile"])
    assert rc == 2 and calls == [{"compile": False}] * 2, calls


def test_a_later_suite_out_of_memory_keeps_the_suites_before_it(monkeypatch, capsys):
    # The report of the suites that had finished was thrown away with the error.
    from tango_lm.bench import decode

    def too_large(**kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(decode, "run_decode_bench", too_large)
    argv = [
        "bench",
        "--suite",
        "all",
        "--archs",
        "tango",
        *TINY,
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-memory",
        "--quiet",
    ]
    rc, out, err, _ = helpers.run_main(capsys, [*argv, "--json"])
    report = json.loads(out)
    assert rc == 2 and report["train"]["models"] and "decode" not in report
    assert report["failed"]["suite"] == "decode"
    err = helpers.assert_one_error_line(err)
    assert "the decode suite ran out of memory ([enforce fail" in err and "lower --decode-batches, --prompt-len" in err
    assert err.endswith("; the report has the train suite before it")


def test_matmul_peak_divides_each_timing_by_its_products(monkeypatch):
    # Each timing covers `products` back-to-back matmuls (8 on a GPU, where a lone 1.4 ms product
    # left the launch and the clock read in the number): the FLOP/s are per product.
    from tango_lm.bench import peak

    ticks = iter(range(100))
    monkeypatch.setattr(peak.time, "perf_counter", lambda: float(next(ticks)))  # every timing: 1 s
    assert peak.measure_matmul_peak(torch.device("cpu"), size=16, repeats=2, products=4) == 2 * 16**3 * 4
    assert peak.measure_matmul_peak(torch.device("cpu"), size=16, repeats=2) == 2 * 16**3  # CPUs: one


def test_a_rows_memory_child_out_of_memory_keeps_the_rows_timings(monkeypatch, capsys):
    from tango_lm.bench import training

    def killed(cfg, *args, **kwargs):
        raise MemoryError(f"the memory measurement of {cfg.arch}/standard was killed by SIGKILL")

    monkeypatch.setattr(training, "measure_in_subprocess", killed)
    report = _bench_json(capsys, "--suite", "train", "--archs", "tango", *TINY, "--steps", "1", "--warmup", "0")
    rows = report["train"]["models"]
    assert [r["arch"] for r in rows] == ["tango", "loop-transformer"] and all(r["peak_bytes"] is None for r in rows)
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert report["train"]["memory_failed"][0] == "the memory measurement of tango/standard was killed by SIGKILL"
    assert "peak memory not measured: the memory measurement of tango" in training.format_report(report["train"])


def test_widths_the_models_heads_cannot_split_name_the_bench_flags(capsys):
    # The model's own errors named model.d_model / model.width and advised `match --head-dim`,
    # none of which bench has.
    for argv, said in (
        (["--d-model", "48"], "--d-model must be a multiple of 32, the models' head width (got 48)"),
        (["--tango-width", "3"], "--tango-width must be a multiple of the models' 8 heads (--d-model 256 / 32)"),
        (["--suite", "windowed", "--windowed-width", "100"], "the windowed suite uses heads of 32: --d-model must"),
    ):
        assert main(["bench", "--quiet", *argv]) == 2
        assert said in helpers.assert_one_error_line(capsys.readouterr().err)
    # suites that build presets, not models at --d-model, are not refused for it
    from tango_lm.bench.suite import check_arguments
    from tango_lm.cli import parse_args

    for argv in (
        ["--suite", "memory", "--memory-backbone", "dense-142m", "--d-model", "48"],
        ["--suite", "decode", "--decode-tier", "70m", "--head-backbone", "dense-142m", "--d-model", "48"],
        ["--suite", "decode", "--decode-tier", "70m", "--tango-width", "3"],
    ):
        check_arguments(parse_args(["bench", *argv]))


def test_the_matmul_peak_leaves_the_global_random_stream_alone():
    # The trainer measures it after a resume restored the RNG (and again when a step beats it): a
    # resumed run's saved RNG state differed from the uninterrupted run's.
    from tango_lm.bench import peak

    torch.manual_seed(3)
    peak.measure_matmul_peak(torch.device("cpu"), size=16, repeats=1)
    drawn = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(4))
