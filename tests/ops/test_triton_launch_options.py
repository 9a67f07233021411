"""Every Triton kernel launch asks for FMA contraction itself (`triton_common.FP_FUSION`) instead of
taking triton's default: 3.9 warns on every first compile that 3.10 turns the default off, which
would change the kernels' instructions and rounding from what their tests and the register report
(tools/triton_ptxas_report.py) checked."""

from __future__ import annotations

import pytest

triton_common = pytest.importorskip(
    "tango_lm.ops.triton_common", exc_type=ImportError, reason="triton is not installed"
)

from tango_lm.ops import relu2_attention_triton_kernels, tango_mix_triton_kernels, windowed_triton  # noqa: E402
from tests.triton_configurations import tuners  # noqa: E402

KERNEL_MODULES = (tango_mix_triton_kernels, windowed_triton, relu2_attention_triton_kernels)


class _RecordingKernel:
    """Stands in for the compiled function under an autotuner: records what a launch passes it."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def run(self, *args, **kwargs) -> None:
        self.launches.append(kwargs)


@pytest.mark.parametrize("module", KERNEL_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_kernel_launch_asks_for_fp_fusion(module, monkeypatch):
    kernels = tuners(module)
    assert len(kernels) >= 3  # forward and backward kernels of each op
    for name, tuner in kernels.items():
        recorder = _RecordingKernel()
        monkeypatch.setattr(tuner, "fn", recorder)
        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])  # one configuration: launched, not timed
        tuner[(1,)]()
        assert [launch.get("enable_fp_fusion") for launch in recorder.launches] == [True], name
        tuner[(1,)](enable_fp_fusion=False)  # a launch that asks otherwise is not overridden
        assert recorder.launches[-1]["enable_fp_fusion"] is False, name
