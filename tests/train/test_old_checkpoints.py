"""Checkpoints written by earlier code still load and compute the same log-probs.

`tests/fixtures/checkpoints/<arch>/` holds a tiny step directory of each pre-norm architecture
(d = 8, two layers, weights moved off their initialization) written by tango-lm before the
Transformer++, Dense, GDN-hybrid and MoE blocks became configurations of one pre-norm block, with
`expected.safetensors`: the input ids and the log-probs that code computed for them. Loading with
today's code must find every tensor under its old state-dict name and give those log-probs
(float32; equal on the machine that wrote them, within rounding elsewhere).

The fixtures were written as `torch.manual_seed(0)`, `build_model(config)`, then
`p.add_(0.3 * torch.randn_like(p))` for each parameter in order; building them the same way today
must give the same weights, so the initialization (its order of random draws included) is unchanged
and a seed still makes the same model.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tango_lm.models.config import ModelConfig
from tango_lm.models.model import build_model
from tango_lm.train.checkpoint import load_checkpoint
from tests import helpers

FIXTURES = helpers.FIXTURES / "checkpoints"
ARCHS = sorted(p.name for p in FIXTURES.iterdir())


def test_fixtures_are_there():
    assert ARCHS == ["dense", "gdn-hybrid", "loop-transformer", "moe", "untied-transformer"]


@pytest.mark.parametrize("arch", ARCHS)
def test_old_checkpoint_loads_and_gives_the_stored_log_probs(arch):
    ckpt = load_checkpoint(FIXTURES / arch / "checkpoints" / "step-00000001")
    assert ckpt.config["model"]["arch"] == arch
    model = ckpt.build_model().eval()
    stored = load_file(str(FIXTURES / arch / "expected.safetensors"))
    with torch.no_grad():
        log_probs = model(stored["input_ids"])
    torch.testing.assert_close(log_probs, stored["log_probs"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_same_seed_draws_the_same_weights(arch):
    ckpt = load_checkpoint(FIXTURES / arch / "checkpoints" / "step-00000001")
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(dict(ckpt.config["model"])))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    stored = ckpt.model_state()
    assert sorted(model.state_dict()) == sorted(stored)
    for name, tensor in model.state_dict().items():
        if name.endswith("conv1d.weight"):  # GDN's short convolutions: drawn N(0, init_std²) since
            # 2026-12-05 (fla's init), from a generator of their own so that no other draw moved
            assert not torch.equal(tensor, stored[name]), name
            continue
        assert torch.equal(tensor, stored[name]), name
