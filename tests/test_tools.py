"""The measurement scripts under tools/ run end to end at tiny sizes, so the docs' commands keep
working (their timings are not checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tango_lm.ops import cpu_kernels

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_op_speed_pair():
    out = _run("op_speed.py", "windowed", "1", "40", "64")
    assert out.startswith("fused") and "composition" in out


@pytest.mark.parametrize("args", [("tango", "1", "40", "128", "16"), ("causal", "2", "40", "8")])
def test_op_speed_variants(args):
    out = _run("op_speed.py", *args)
    assert out.startswith("blocked") and "composition" in out
    assert ("C kernels" in out) == cpu_kernels.available()


def test_op_speed_pieces():
    out = _run("op_speed.py", "pieces", "80", "64")
    assert "blocks of 32" in out and "blocks of 64" in out and "full square" in out
    assert "blocks of 128" not in out  # no block as long as the sequence


def test_step_profile():
    out = _run("step_profile.py", "tango:64", "loop-transformer:64", "--seq-len", "16", "--batch-size", "1",
               "--steps", "1", "--top", "3")
    assert "tango:64:" in out and "loop-transformer:64:" in out and "GFLOP/s" in out


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the tool has nothing to compare")
def test_tango_kernels_tool():
    out = _run("tango_kernels.py", "products", "40", "128", "--rounds", "1")
    assert out.count("C kernel ") == 3 and out.count("MKL blocks of 64") == 3
    out = _run("tango_kernels.py", "steps", "16", "--steps", "1")
    assert "tango, C kernels" in out and "tango, blocked" in out and "x 1.000" in out
