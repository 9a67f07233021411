"""The CPU allocator setting: applied once on glibc, opt-out by environment, tensors unaffected."""

import os
import platform
import subprocess
import sys

import pytest

CHILD = """
import torch
from tango_lm.train.cpu_allocator import keep_freed_memory
first, second = keep_freed_memory(), keep_freed_memory()
x = torch.ones(3000, 3000)  # 36 MB: mmapped by default, from the heap once applied
x.mul_(2)
print(first, second, float(x.sum()))
"""


def _run(env_value: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("TANGO_LM_CPU_ALLOCATOR", None)
    if env_value is not None:
        env["TANGO_LM_CPU_ALLOCATOR"] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applied_once_on_glibc():
    assert _run(None) == ["True", "True", "18000000.0"]


def test_opt_out_leaves_the_allocator_alone():
    assert _run("system") == ["False", "False", "18000000.0"]
