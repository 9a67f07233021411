"""The Triton kernels of TANGO's mixing and windowed TANGO compile for sm_90 (H100/H200) without
spilling registers at TANGO's shape (bf16, d_h = 32, width 1,780 per head): a kernel that spills
kilobytes per thread to local memory runs far below its arithmetic's speed, and nothing else
without a GPU would show a change that brings the spills back. Each kernel's first configuration
(every configuration: tools/triton_ptxas_report.py) is compiled with triton's own NVIDIA backend
and ptxas, in a subprocess without TRITON_INTERPRET (conftest sets it for the kernels' other tests);
so are GAU's and FLASH's relu² kernels at s = 128 in bf16 and fp32; and, in fp32 (full-fp32
products on FMAs: configurations of their own), the kernels reworked for that."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import helpers

KERNELS = ("forward_kernel", "scores_backward_kernel", "gates_backward_kernel", "_forward_kernel", "_backward_kernel")


def _first_configurations(ops: str, kernels: tuple[str, ...], dtype: str, head_dim: int, tf32: bool) -> dict:
    """ptxas's row (tools/triton_ptxas_report.py) of each kernel's first configuration, by name."""
    pytest.importorskip("triton", reason="triton is not installed")
    triton_ptxas_report = helpers.tool("triton_ptxas_report")
    ptxas = triton_ptxas_report.ptxas_path(90)
    if ptxas is None or not ptxas.is_file():
        pytest.skip("triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            str(helpers.ROOT / "tools" / "triton_ptxas_report.py"),
            *("--ops", ops, "--kernels", ",".join(kernels), "--first", "1"),
            *("--dtype", dtype, "--head-dim", str(head_dim), "--width", "1780"),
            *(["--tf32"] if tf32 else []),
        ],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(helpers.ROOT / "src")},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {row[0]: row for row in map(str.split, proc.stdout.splitlines()) if row and row[0] in kernels}
    assert sorted(rows) == sorted(kernels), proc.stdout
    for name, row in rows.items():
        assert row[-3] == "yes", f"{name} needs more shared memory than sm_90 has:\n{proc.stdout}"
    return rows


def _assert_first_configurations_do_not_spill(ops: str, kernels: tuple[str, ...], dtype: str, head_dim: int) -> None:
    for name, row in _first_configurations(ops, kernels, dtype, head_dim, tf32=False).items():
        assert row[-1] == "0", f"{name} spills {row[-1]} bytes per thread: {row}"


def test_triton_kernels_compile_for_sm90_without_register_spills_at_tangos_shape():
    _assert_first_configurations_do_not_spill("tango_mix,windowed", KERNELS, "bf16", 32)


def test_triton_fp32_kernels_compile_for_sm90_without_register_spills():
    # fp32 inputs (train.precision=fp32) multiply in full fp32 on FMAs from registers, in
    # configurations of their own that only they take: tango_mix's at d_h = 128 (where the smaller
    # d_h's spilled), windowed TANGO's narrow column blocks at d_h = 64 (pq S in two halves).
    _assert_first_configurations_do_not_spill("tango_mix", ("lse_kernel", "scores_backward_kernel"), "fp32", 128)
    windowed = ("_forward_kernel", "_band_backward_kernel", "_backward_kernel")
    _assert_first_configurations_do_not_spill("windowed", windowed, "fp32", 64)


def test_triton_fp32_kernels_under_tf32_fit_sm90_at_every_head_dim():
    # fp32 inputs with TF32 allowed (torch.set_float32_matmul_precision("high")) took the bf16-sized
    # tiles: at d_h 129-256 none of tango_mix's forward and backward ones fit sm_90's shared memory
    # (256-416 KiB of 227), and the op failed on the GPU instead of running.
    _first_configurations(
        "tango_mix", ("forward_kernel", "scores_backward_kernel", "gates_backward_kernel"), "fp32", 256, True
    )
    _first_configurations("relu2", ("forward_kernel", "dv_kernel", "dqk_kernel"), "fp32", 256, True)


def _loop_mixes(
    *flags: str, ops: str = "tango_mix", kernels: str = "forward_kernel,scores_backward_kernel,gates_backward_kernel"
) -> dict[str, list[dict]]:
    """`kernels` (first two configurations) at TANGO's shape, or where `flags` say (a later
    --head-dim or --width wins): each one's innermost loops' instruction mix
    (tools/triton_ptxas_report.py --mix)."""
    pytest.importorskip("triton", reason="triton is not installed")
    ptxas = helpers.tool("triton_ptxas_report").ptxas_path(90)
    if ptxas is None or not ptxas.is_file() or not ptxas.with_name("nvdisasm").is_file():
        pytest.skip("triton's NVIDIA backend (ptxas, nvdisasm) is not installed")
    proc = subprocess.run(
        [
            sys.executable,
            str(helpers.ROOT / "tools" / "triton_ptxas_report.py"),
            *("--ops", ops, "--kernels", kernels),
            *("--first", "2"),
            *("--dtype", "bf16", "--head-dim", "32", "--width", "1780", "--mix", "--json", *flags),
        ],
        capture_output=True,
        text=True,
        env={
            **{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
            "PYTHONPATH": str(helpers.ROOT / "src"),
        },
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows: dict[str, list] = {}
    for row in json.loads(proc.stdout):  # each kernel's first two configurations
        rows.setdefault(row["kernel"], []).append(row["loops"])
    return rows


def test_tango_mix_loops_read_written_gates_without_the_special_function_units():
    # The default reads gates written once; with the SiLU applied on load, every iteration spends
    # an exp and a division per gate on the MUFU units (16 lanes per clock per SM on sm_90), which
    # outlast the iteration's tensor-core work (the docstring of ops/tango_mix_triton.py).
    written, on_load = _loop_mixes(), _loop_mixes("--silu-on-load")
    (forward,), (forward_on_load,) = written["forward_kernel"][0], on_load["forward_kernel"][0]
    assert forward["instructions"] * 2 < forward_on_load["instructions"], (forward, forward_on_load)
    assert forward["mufu"] * 4 <= forward_on_load["mufu"], (forward, forward_on_load)  # P's exp only
    # the scores backward's loop over the width
    (scores,), (scores_on_load,) = written["scores_backward_kernel"][0], on_load["scores_backward_kernel"][0]
    assert scores["mufu"] == 0 < scores_on_load["mufu"], (scores, scores_on_load)
    # and with dgbar = dy * u written by the gates backward, two tiles loaded instead of three and no
    # product: under half (with the product in the loop, 144 against 244 under triton 3.9)
    assert scores["instructions"] * 2 < scores_on_load["instructions"], (scores, scores_on_load)
    assert forward["tensor"] > 0 and scores["tensor"] > 0
    # 128-row query blocks over 64-key blocks: the key blocks before the diagonal in a loop of their
    # own, without the causal mask and the row bounds (about half of the masked loop's instructions)
    unmasked, diagonal = written["forward_kernel"][1]
    assert unmasked["instructions"] * 3 < diagonal["instructions"] * 2, (unmasked, diagonal)
    # The gates backward's destination blocks: masked on the diagonal, unmasked after it, masked at T's end
    diagonal, unmasked, end = written["gates_backward_kernel"][0]
    assert unmasked["instructions"] * 3 < min(diagonal["instructions"], end["instructions"]) * 2


def test_windowed_loops_apply_one_cheap_silu_per_gate():
    # The forward carries the previous chunk's gates from one chunk to the next (bf16, fp16): read
    # again, their SiLU ran a second time, in two layouts (96 MUFU instructions per warp and
    # iteration, 1,312 instructions). The first configuration (64 columns, 8 warps) holds 64 x 64
    # gates per iteration, 16 per thread: one exp2 and one reciprocal each.
    rows = _loop_mixes(ops="windowed", kernels="_forward_kernel,_backward_kernel")
    (forward,) = rows["_forward_kernel"][0]
    assert forward["mufu"] <= 2 * 16, forward
    # The SiLU's exp2 and fast division (triton_common.silu_f32): five instructions per gate, where
    # `a / (1 + tl.exp(-a))` took about twelve (840 -> 744 instructions in this loop; 762 under
    # triton 3.6); and the small tensors read in bf16, as the op rounds them once
    # (windowed_triton._operands), not as fp32 tiles rounded on every load: 624 (637)
    assert forward["instructions"] < 700, forward
    # the backward's sweep back over the chunks: 859 -> 666 (870 -> 755 under triton 3.6)
    _, backward_sweep = rows["_backward_kernel"][0]
    assert backward_sweep["instructions"] < 800, backward_sweep


def test_relu2_loops_skip_the_masks_where_every_pair_is_visible():
    # GAU's shape (s = 128, e = 7,152): the key blocks wholly before a query block (forward), the
    # query blocks wholly after a key block (dV), in loops of their own without the causal mask and
    # the bounds, the bias read at a loop-invariant tile of offsets: 368 and 306 instructions per
    # warp and iteration where the masked loop issues 949 and 669-761 (bf16, triton 3.9).
    kernels = "forward_kernel,dv_kernel,dqk_kernel"
    rows = _loop_mixes("--head-dim", "128", "--width", "7152", ops="relu2", kernels=kernels)
    unmasked, diagonal = rows["forward_kernel"][0]
    assert unmasked["instructions"] * 2 < diagonal["instructions"], (unmasked, diagonal)
    diagonal, unmasked, end = rows["dv_kernel"][0]
    assert unmasked["instructions"] * 2 < min(diagonal["instructions"], end["instructions"])
    assert unmasked["tensor"] == diagonal["tensor"] > 0
    # dQK's dP = dO V^T over e in blocks of 64 on the warpgroup MMA: 79 instructions (69 under
    # triton 3.6) for 64 x 64 x 64, where blocks of 32 issued 240 (231) for 32 x 32 x 128
    (dp_loop,) = rows["dqk_kernel"][0]
    assert dp_loop["instructions"] < 120 and dp_loop["tensor"] > 0, dp_loop


def test_windowed_fp16_kernels_compile_for_sm90_without_register_spills():
    # fp16 gates multiply the growing prefix sums in fp32 (a branch of their own in the kernels).
    windowed = ("_forward_kernel", "_band_backward_kernel", "_backward_kernel")
    _assert_first_configurations_do_not_spill("windowed", windowed, "fp16", 64)


def test_relu2_kernels_compile_for_sm90_without_register_spills():
    # GAU's and FLASH's kernels at the presets' s = 128: bf16 (their gradient kernel sums the
    # bias's gradient per tile diagonal with tl.gather) and fp32 (narrow tiles of their own).
    relu2 = ("forward_kernel", "dv_kernel", "dqk_kernel")
    _assert_first_configurations_do_not_spill("relu2", relu2, "bf16", 128)
    _assert_first_configurations_do_not_spill("relu2", relu2, "fp32", 128)
    assert (
        helpers.tool("triton_ptxas_report").main(["--ops", "relu2"]) == 2
    )  # under TRITON_INTERPRET=1 (conftest): one error line


def test_column_alignment_is_what_every_gate_tensor_allows():
    # The kernels round W and the row strides down to ALIGN: it must divide each of them exactly.
    common = pytest.importorskip("tango_lm.ops.triton_common", exc_type=ImportError)
    bf16 = torch.zeros(2, 3, 16 * 1780, dtype=torch.bfloat16)
    assert common.column_alignment(1780, 2, bf16) == 4  # TANGO's width: 8-byte vectors
    assert common.column_alignment(1792, 2, torch.zeros(2, 3, 16 * 1792, dtype=torch.bfloat16)) == 8
    assert common.column_alignment(1780, 4, bf16.float()) == 4  # 16 bytes of fp32
    assert common.column_alignment(593, 2, bf16) == 1  # 3-set TANGO's: one element at a time
    offset_by_2 = torch.zeros(2 * 3 * 16 * 1780 + 2, dtype=torch.bfloat16)[2:].view(2, 3, 16 * 1780)
    assert common.column_alignment(1780, 2, offset_by_2) == 2  # a storage offset of 2 elements
    assert common.column_alignment(1780, 2, torch.ones(1, 1, 1).expand(2, 3, 16 * 1780)) == 4  # stride 0
    assert common.column_alignment(1780, 2, bf16[:, :, 1:]) == 1  # a view whose rows start off alignment


def test_for_launch_keeps_the_configurations_whose_limits_admit_the_launch():
    common = pytest.importorskip("tango_lm.ops.triton_common", exc_type=ImportError)
    import triton

    def config(**limits):
        c = triton.Config({})
        c.limits = limits
        return c

    every, small_d, aligned, unaligned = config(), config(max_d=32), config(min_align=2), config(max_align=1)
    choices = [every, small_d, aligned, unaligned]
    assert common.for_launch(choices, {}, BLOCK_D=32, ALIGN=4) == [every, small_d, aligned]
    assert common.for_launch(choices, {}, BLOCK_D=128, ALIGN=1) == [every, unaligned]
    large_d = config(min_d=128)
    assert common.for_launch([every, large_d], {}, BLOCK_D=64) == [every]
    assert common.for_launch([every, large_d], {}, BLOCK_D=128) == [every, large_d]
    assert common.for_launch([aligned], {}, BLOCK_D=32, ALIGN=1) == [aligned]  # never none left
    # fp32 inputs: only the configurations sized for them, and only there, whatever the products'
    # precision (TF32's bf16-sized tiles took 256-416 KiB of shared memory at d_h = 256: no launch)
    fp32 = config(fp32=True)
    q32, lse = torch.zeros(2, dtype=torch.float32), torch.zeros(2, dtype=torch.float32)
    for precision in ("ieee", "tf32"):
        launch = {"BLOCK_D": 32, "ALIGN": 4, "PRECISION": precision}
        assert common.for_launch([*choices, fp32], {"Q": q32, "LSE": lse, "T": 7}, **launch) == [fp32]
        assert common.for_launch(choices, {"Q": q32}, **launch) == choices[:3]  # none marked
    bf16 = {"Q": q32.bfloat16(), "LSE": lse, "T": 7}  # fp32 buffers beside 16-bit inputs: a bf16 launch
    assert common.for_launch([*choices, fp32], bf16, BLOCK_D=32, ALIGN=4, PRECISION="tf32") == choices[:3]
    assert common.for_launch([*choices, fp32], {"Q": q32.half()}, BLOCK_D=32, ALIGN=4) == choices[:3]


def test_without_autotuning_a_launch_takes_its_first_admitted_configuration(monkeypatch):
    # TANGO_LM_TRITON_AUTOTUNE=0 (the GPU check's tests): one configuration left, so triton times none.
    common = pytest.importorskip("tango_lm.ops.triton_common", exc_type=ImportError)
    import triton

    from tango_lm.errors import UserError

    small_d, every = triton.Config({"BLOCK_M": 1}), triton.Config({"BLOCK_M": 2})
    small_d.limits, every.limits = {"max_d": 32}, {}
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "0")
    assert common.for_launch([small_d, every], {}, BLOCK_D=64) == [every]
    assert common.for_launch([small_d, every], {}, BLOCK_D=32) == [small_d]
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "1")
    assert common.for_launch([small_d, every], {}, BLOCK_D=32) == [small_d, every]
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "off")
    with pytest.raises(UserError, match="TANGO_LM_TRITON_AUTOTUNE must be 0 .* or 1, not 'off'"):
        common.for_launch([small_d, every], {}, BLOCK_D=32)


def test_without_autotuning_no_launch_is_timed_on_any_triton(monkeypatch):
    # With one configuration left, triton 3.9 times nothing, but 3.6 (torch 2.11's) timed it anyway:
    # ~0.1 s of launches per launch shape on a GPU, and under the interpreter, which has no driver,
    # an error ("0 active drivers") in every test that forces a configuration. Every tuner times
    # through `time_configuration`, which runs nothing without autotuning.
    common = pytest.importorskip("tango_lm.ops.triton_common", exc_type=ImportError)
    from tango_lm.ops import relu2_attention_triton_kernels, tango_mix_triton_kernels, windowed_triton
    from tests.triton_configurations import tuners

    every = [
        t
        for m in (relu2_attention_triton_kernels, tango_mix_triton_kernels, windowed_triton)
        for t in tuners(m).values()
    ]
    assert len(every) >= 8 and all(t.do_bench is common.time_configuration for t in every)
    monkeypatch.setenv("TANGO_LM_TRITON_AUTOTUNE", "0")
    launches = []
    assert common.time_configuration(lambda: launches.append(1), (0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    assert launches == []


def test_autotuners_that_prune_by_launch_also_key_their_cache_by_it():
    # A configuration chosen at one ALIGN or PRECISION must not be reused, unpruned, at another.
    pytest.importorskip("triton", reason="triton is not installed")
    from triton.runtime.autotuner import Autotuner

    from tango_lm.ops import relu2_attention_triton_kernels, tango_mix_triton_kernels, windowed_triton

    tuners = [
        obj
        for module in (tango_mix_triton_kernels, windowed_triton, relu2_attention_triton_kernels)
        for obj in vars(module).values()
        if isinstance(obj, Autotuner)
    ]
    pruning = [t for t in tuners if t.early_config_prune is not None]
    assert len(tuners) == len(pruning) == 10  # every autotuned kernel prunes by its launch
    for tuner in pruning:
        pruned_by = {"ALIGN", "PRECISION"} & set(tuner.arg_names)
        assert pruned_by and pruned_by <= set(tuner.keys), (tuner.fn.__name__, tuner.keys)
