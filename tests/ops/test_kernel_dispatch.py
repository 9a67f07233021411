"""The one door to the ops' implementations (ops/dispatch.py): the override, the fallback where a
named implementation cannot run, the CPU choices (the C kernels only where preferred), one-line
errors, and the one cache root (cache_root.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tango_lm.cache_root import cache_root
from tango_lm.errors import UserError
from tango_lm.ops import cpu_kernels, dispatch
from tango_lm.ops import tango_mix as tango_mix_module
from tango_lm.ops.causal_matmul import causal_matmul
from tango_lm.ops.gate_average import gate_average, gate_average_reference, gate_average_sliced, slices
from tango_lm.ops.tango_mix import tango_mix, tango_mix_reference
from tests import helpers


def mix_inputs(dtype=torch.float32, b=1, h=2, t=5, d=4, w=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((b, h, t, d), (b, h, t, d), (b, t, h * w), (b, t, h * w))
    )


@pytest.fixture
def calls(monkeypatch):
    """Records which tango_mix implementation ran (each still computes its result)."""
    seen = []
    for name, attr in (("reference", "tango_mix_reference"), ("sdpa-sliced", "tango_mix_sliced")):
        real = getattr(tango_mix_module, attr)
        monkeypatch.setattr(tango_mix_module, attr, lambda *xs, _n=name, _f=real: seen.append(_n) or _f(*xs))
    if tango_mix_module.tango_mix_triton is not None:
        real_triton = tango_mix_module.tango_mix_triton.tango_mix_triton
        monkeypatch.setattr(
            tango_mix_module.tango_mix_triton, "tango_mix_triton", lambda *xs: seen.append("triton") or real_triton(*xs)
        )
    real_fused = tango_mix_module.tango_mix_fused
    monkeypatch.setattr(
        tango_mix_module,
        "tango_mix_fused",
        lambda *xs, kernels: seen.append("c" if kernels else "blocked") or real_fused(*xs, kernels=kernels),
    )
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return seen


def test_auto_on_cpu_picks_the_kernels_where_preferred_else_the_blocked_op(calls):
    tango_mix(*mix_inputs(torch.float32))
    tango_mix(*mix_inputs(torch.float64))
    q, k, a, _ = mix_inputs(torch.float32)
    tango_mix(q, k, a, None)  # the narrow average (tango-compact): the composition
    c = cpu_kernels.preferred() and cpu_kernels.available()
    assert calls == ["c" if c else "blocked", "blocked", "reference"]


@pytest.mark.parametrize(
    ("vendor", "mkl", "preferred"),
    [
        ("GenuineIntel", True, False),  # MKL's GEMMs beat the kernels on Intel's cores
        ("GenuineIntel", False, True),
        ("AuthenticAMD", True, True),
        ("Intel64 Family 6 Model 85 Stepping 7, GenuineIntel", True, False),  # Windows' platform.processor()
        ("", True, True),  # an ARM Mac: no vendor_id, platform.processor() "arm"
    ],
)
def test_the_kernels_are_preferred_except_on_intel_cpus_with_mkl(monkeypatch, vendor, mkl, preferred):
    monkeypatch.setattr(cpu_kernels, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert cpu_kernels.preferred() is preferred


def test_reports_say_what_the_cpu_products_run_on(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "preferred", lambda: False)
    assert cpu_kernels.describe() == "blocked (MKL, an Intel CPU)"
    monkeypatch.setenv(dispatch.ENV, "c")
    assert cpu_kernels.describe() == "C kernels"
    monkeypatch.setenv(dispatch.ENV, "reference")
    assert cpu_kernels.describe() == "TANGO_LM_KERNELS=reference"
    monkeypatch.setenv(dispatch.ENV, "auto")
    monkeypatch.setattr(cpu_kernels, "preferred", lambda: True)
    assert cpu_kernels.describe() == "C kernels"
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert cpu_kernels.describe() == "blocked (no C kernels built)"


def test_where_not_preferred_auto_runs_the_blocked_ops_without_building_the_kernels(calls, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "preferred", lambda: False)
    built = []
    real_available = cpu_kernels.available
    monkeypatch.setattr(cpu_kernels, "available", lambda: built.append(1) or real_available())
    real_kernel = cpu_kernels.gate_average  # both ops' forward on the kernels
    monkeypatch.setattr(cpu_kernels, "gate_average", lambda *a: built.append("ran") or real_kernel(*a))
    xs = mix_inputs(torch.float32)
    want = tango_mix_reference(*xs)
    p, v = torch.randn(2, 200, 200).tril(), torch.randn(2, 200, 3)  # longer than one block: blocked
    torch.testing.assert_close(tango_mix(*xs), want)
    torch.testing.assert_close(causal_matmul(p, v), p @ v)
    assert calls == ["blocked"] and built == []
    torch.testing.assert_close(tango_mix(*xs, kernels="c"), want)  # asked for by name: they run
    torch.testing.assert_close(causal_matmul(p, v, kernels="c"), p @ v)
    assert calls[-1] == ("c" if real_available() else "blocked")
    assert built.count("ran") == (2 if real_available() else 0)


@pytest.mark.parametrize("name", ["reference", "blocked", "sdpa-sliced"])
def test_the_environment_variable_and_the_argument_pick_the_implementation(calls, monkeypatch, name):
    xs = mix_inputs(torch.float64)
    want = tango_mix_reference(*xs)
    monkeypatch.setenv(dispatch.ENV, name)
    torch.testing.assert_close(tango_mix(*xs), want)
    monkeypatch.setenv(dispatch.ENV, "auto")
    torch.testing.assert_close(tango_mix(*xs, kernels=name), want)  # the argument wins over the variable
    assert calls == [name, name]


def test_an_implementation_that_cannot_take_the_inputs_falls_back_to_auto(calls):
    tango_mix(*mix_inputs(torch.float64), kernels="c")  # the C kernels take float32 only
    q, k, a, _ = mix_inputs(torch.float64)
    tango_mix(q, k, a, None, kernels="blocked")  # the fused CPU op needs u
    expected = ["blocked", "reference"]
    if tango_mix_module.tango_mix_triton is not None:
        tango_mix(*mix_inputs(torch.float64), kernels="triton")  # no float64 Triton kernels
        expected.append("blocked")
    assert calls == expected


def test_asking_for_triton_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(tango_mix_module, "tango_mix_triton", None)
    with pytest.raises(
        UserError,
        match=r"TANGO_LM_KERNELS=triton needs the triton package: "
        r"pip install 'tango-lm\[triton\]'",
    ):
        tango_mix(*mix_inputs(), kernels="triton")
    tango_mix(*mix_inputs())  # auto does not need it


def test_triton_runs_on_cpu_tensors_only_when_asked_and_interpreted(calls):
    if tango_mix_module.tango_mix_triton is None or not tango_mix_module.tango_mix_triton.INTERPRETED:
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    xs = mix_inputs(torch.float32)
    tango_mix(*xs)
    torch.testing.assert_close(tango_mix(*xs, kernels="triton"), tango_mix_reference(*xs))
    assert calls[1:] == ["triton"] and calls[0] != "triton"


def test_unknown_implementation_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(UserError, match=r"TANGO_LM_KERNELS='fast'; set it to one of: auto, reference, blocked"):
        tango_mix(*mix_inputs())
    with pytest.raises(ValueError, match=r"kernels='cuda'"):
        causal_matmul(torch.zeros(1, 3, 3), torch.zeros(1, 3, 2), kernels="cuda")


def test_inputs_on_two_devices_are_one_line_error():
    q, k, a, u = mix_inputs()
    with pytest.raises(
        ValueError,
        match=r"^tango_mix: inputs on different devices \(q on cpu, k on cpu, a on meta, "
        r"u on cpu\); move them to one device$",
    ):
        tango_mix(q, k, a.to("meta"), u)
    with pytest.raises(ValueError, match="gate_average: inputs on different devices"):
        gate_average(q, k.to("meta"), q)


@pytest.mark.parametrize(("width", "max_slice"), [(37, 16), (5, 128), (48, 16), (129, 128), (23, 8)])
def test_sliced_sdpa_matches_the_reference(width, max_slice):
    # The CUDA fallback's arithmetic, on the CPU: odd widths, zero-padded slices, several heads.
    n, s = slices(width, max_slice)
    assert s % 8 == 0 and s <= max(max_slice, 8) and (n - 1) * s < width <= n * s
    gen = torch.Generator().manual_seed(width)
    q, k = (torch.randn(2, 3, 11, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 3, 11, width, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 11, width, generator=gen, dtype=torch.float64)
    got = gate_average_sliced(q, k, g, max_slice)
    want = gate_average_reference(q, k, g)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for x, y in zip(torch.autograd.grad(got, (q, k, g), dy), torch.autograd.grad(want, (q, k, g), dy), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_sliced_fallback_takes_mixed_dtypes():
    # Whatever the Triton kernels refuse falls back to the sliced SDPA on CUDA, without an error.
    q, k, a, u = mix_inputs(torch.float64)
    got = tango_mix(q.float(), k.float(), a, u, kernels="sdpa-sliced")
    torch.testing.assert_close(got, tango_mix_reference(q, k, a, u), rtol=1e-5, atol=1e-6)


def test_cpu_kernels_refuse_mismatched_shapes_before_any_pointer_reaches_c():
    probs = torch.softmax(torch.randn(2, 3, 7, 7), -1)
    g = torch.randn(2, 7, 3 * 5)
    with pytest.raises(ValueError, match=r"\[B, T, F\] tensors with B = 2, T = 7.*got \[2, 9, 15\]"):
        cpu_kernels.gate_average(probs, torch.randn(2, 9, 15), None, torch.empty(2, 9, 15), None)
    with pytest.raises(ValueError, match="got \\[2, 7, 14\\]"):  # F not a multiple of H
        cpu_kernels.gate_average_grad_gates(probs, torch.randn(2, 7, 14), torch.empty(2, 7, 14))
    with pytest.raises(ValueError, match=r"probabilities \[B, H, T, T\], got \[2, 3, 7, 6\]"):
        cpu_kernels.gate_average_grad_probs(g, g, torch.empty(2, 3, 7, 6))
    with pytest.raises(ValueError, match="contiguous float32 CPU tensors, got torch.float64"):
        cpu_kernels.gate_average(probs, g.double(), None, torch.empty_like(g), None)
    with pytest.raises(ValueError, match="u and y together"):
        cpu_kernels.gate_average(probs, g, g, torch.empty_like(g), None)


def test_one_cache_root(monkeypatch, tmp_path):
    from tango_lm.data import dmmath

    monkeypatch.delenv("TANGO_LM_KERNEL_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TANGO_LM_CACHE", raising=False)
    assert cache_root() == Path.home() / ".cache" / "tango-lm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "tango-lm"
    monkeypatch.setenv("TANGO_LM_CACHE", str(tmp_path / "root"))
    assert cache_root() == tmp_path / "root"
    assert cpu_kernels._cache_dir() == tmp_path / "root" / "kernels"
    assert dmmath._generated_root() == tmp_path / "root" / "dmmath"
    monkeypatch.setenv("TANGO_LM_KERNEL_DIR", str(tmp_path / "k"))  # still moves the kernels alone
    assert cpu_kernels._cache_dir() == tmp_path / "k"


def test_a_bad_kernels_variable_stops_a_command_before_it_writes(monkeypatch, data_dir, tmp_path, capsys):
    monkeypatch.setenv(dispatch.ENV, "Triton")
    rc, out, err, _ = helpers.run_main(capsys, ["train", *helpers.cli_overrides(data_dir, tmp_path / "run", steps=2)])
    assert rc == 2 and "TANGO_LM_KERNELS='Triton'; set it to one of" in helpers.assert_one_error_line(err)
    assert not (tmp_path / "run").exists()


def test_triton_asked_for_without_triton_stops_a_command_before_it_writes(monkeypatch, data_dir, tmp_path, capsys):
    # The ops said so only at the first forward, after the run had written config.json and
    # config.yaml: the same command, once fixed, then found a run to --resume.
    monkeypatch.setenv(dispatch.ENV, "triton")
    monkeypatch.setattr(dispatch, "_installed", lambda package: package != "triton")
    argv = ["train", *helpers.cli_overrides(data_dir, tmp_path / "run", steps=2)]
    rc, out, err, _ = helpers.run_main(capsys, argv)
    assert rc == 2 and helpers.assert_one_error_line(err) == (
        "error: TANGO_LM_KERNELS=triton needs the triton package: pip install 'tango-lm[triton]'"
    )
    assert not (tmp_path / "run").exists()
    assert helpers.run_main(capsys, ["presets", "tango-70m"])[0] == 0  # a command that runs no kernel is not stopped
    monkeypatch.delenv(dispatch.ENV)
    assert helpers.run_main(capsys, argv)[0] == 0


def test_a_gdn_run_asking_for_missing_fla_kernels_stops_before_it_writes(monkeypatch, data_dir, tmp_path):
    from tango_lm.ops import delta_rule, delta_rule_fla
    from tango_lm.train.trainer import Trainer

    monkeypatch.setattr(delta_rule, "wants_fla", lambda backend, on_cuda: backend != "torch")  # as on CUDA
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: "fla-core does not import (No module 'fla')")
    model = {"arch": "gdn-hybrid", "gdn_backend": "fla", "gdn_head_dim": 16, "attention_every": 2}
    with pytest.raises(UserError, match=r"model.gdn_backend=fla needs fla's kernels: pip install 'tango-lm\[gdn\]'"):
        Trainer(helpers.run_config(data_dir, tmp_path / "run", model, steps=2))
    assert not (tmp_path / "run").exists()
    # attention_every=1: no GDN layer, so no fla kernel to need
    Trainer(helpers.run_config(data_dir, tmp_path / "run", {**model, "attention_every": 1}, steps=2))


IMPLEMENTATIONS = [None, "reference", "blocked", "c", "sdpa-sliced"]
if tango_mix_module.tango_mix_triton is not None:
    IMPLEMENTATIONS.append("triton")


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
def test_gates_of_another_dtype_fall_back_without_an_error(kernels):
    # What the fast paths do not take runs promoted (CPU's fallback, the reference, raised).
    q, k, a, u = mix_inputs(torch.float32)
    got = tango_mix(q, k, a.bfloat16(), u, kernels=kernels)
    want = tango_mix_reference(q.double(), k.double(), a.bfloat16().double(), u.double())
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)  # SiLU in bf16 or not


@pytest.mark.parametrize("kernels", IMPLEMENTATIONS)
@pytest.mark.parametrize(("b", "t", "w"), [(0, 5, 3), (2, 0, 3), (2, 5, 0)])
def test_empty_inputs_give_empty_outputs_and_gradients(kernels, b, t, w):
    from tango_lm.ops.windowed_mix import windowed_mix

    q, k, a, u = (x.requires_grad_(True) for x in mix_inputs(torch.float32, b=b, t=t, w=w))
    for y, xs in (
        (tango_mix(q, k, a, u, kernels=kernels), (q, k, a, u)),
        (windowed_mix(q, k, q, k, a, u, 3, kernels=kernels), (q, k, a, u)),
    ):
        assert y.shape == (b, t, 2 * w)
        grads = torch.autograd.grad(y.sum(), xs)
        assert [g.shape for g in grads] == [x.shape for x in xs]


@pytest.mark.parametrize("value", ["true", "yes", "1"])
def test_the_interpreter_is_on_whenever_triton_reads_triton_interpret_as_on(value):
    # Triton interprets under any of its true spellings; the kernels must then take CPU tensors and
    # upcast their bf16 dots (the interpreter multiplies bf16 operands as raw bit patterns).
    pytest.importorskip("triton")
    code = "from tango_lm.ops import triton_common; print(triton_common.INTERPRETED)"
    env = {**os.environ, "TRITON_INTERPRET": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
