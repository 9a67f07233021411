"""Every architecture trains end to end from its preset (shrunk) through `tango-lm train`, and
every head trains on every onóna backbone."""

from __future__ import annotations

import json

import helpers
import pytest

from tango_lm.cli import main
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.train.config import load_run_config
from tango_lm.train.trainer import train

# One preset per architecture (and the paper's special geometries), shrunk to a few thousand parameters.
PRESETS = {
    "tango-70m-d4": {}, "tango-windowed-70m-d4": {"model.window": 4}, "tango-3set-70m-d4": {"model.depth": 3},
    "tango-compact-70m-d4": {"model.controller_width": 32}, "loop-transformer-70m-d4": {},
    "untied-transformer-70m-d4": {}, "conventional-untied-70m-d4": {"model.n_heads": 4},
    "tango-70m-d8-rotating": {"model.active_width": 1, "model.depth": 2},
    "tango-windowed-70m-d8-rotating": {"model.active_width": 3, "model.depth": 2, "model.window": 4},
    "gau-70m-d4": {"model.qk_dim": 8}, "flash-70m-d4": {"model.qk_dim": 8, "model.group_size": 8},
    "dense-142m": {}, "gdn-hybrid-142m": {"model.gdn_head_dim": 16, "model.depth": 4},
    "moe-142m": {"model.moe_expert_width": 16}, "attnres-142m": {},
}
TINY = {"model.d_model": 48, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 12, "model.width": 32,
        "model.depth": 2, "model.vocab_size": 257, "model.context_length": 32}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_architecture_has_a_preset_here():
    archs = {load_run_config(name, []).model.arch for name in PRESETS}
    assert archs == set(ARCHITECTURES)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_through_the_cli(preset, data_dir, tmp_path, capsys):
    overrides = {**TINY, **PRESETS[preset], "data.dir": str(data_dir), "train.out_dir": str(tmp_path / "run"),
                 "train.steps": 2, "train.tokens_per_param": None, "train.batch_size": 2, "train.grad_accum": 1,
                 "train.eval_every": 2, "train.save_every": 2, "train.eval_windows": 2, "train.test_windows": 2,
                 "train.warmup_steps": 1, "train.seq_len": 32, "train.progress": False}
    argv = ["train", preset, *(f"{k}={'null' if v is None else v}" for k, v in overrides.items()), "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["test_nll"] > 0


@pytest.mark.parametrize("arch", ["dense", "gdn-hybrid", "moe", "attnres", "tango"])
def test_every_head_trains_on_the_backbone(arch, data_dir, tmp_path):
    for head in sorted(HEADS):
        model = {"arch": arch, "head": head, "d_model": 32, "head_dim": 8, "width": 32, "depth": 2,
                 "vocab_size": 257, "context_length": 32, "gdn_head_dim": 8, "moe_expert_width": 16}
        run = helpers.run_config(data_dir, tmp_path / head, model=model, steps=2, eval_every=2, save_every=2)
        result = train(run)
        assert result.summary["steps"] == 2 and result.summary["head"] == head
        assert all(loss == loss for loss in result.losses.values())  # no NaN


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_bf16_autocast_step_matches_fp32(preset):
    # What a GPU run does under train.precision=auto: the same step in bf16 autocast (here on the
    # CPU) gives the fp32 loss to bf16 accuracy and finite gradients for the same parameters.
    import torch

    from tango_lm import build_model

    cfg = load_run_config(preset, [f"{k}={v}" for k, v in {**TINY, **PRESETS[preset]}.items()]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    losses, grads = [], []
    for bf16 in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.nll(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[1] - losses[0]) < 0.02 * losses[0], losses
    assert grads[1].keys() == grads[0].keys()
    assert all(torch.isfinite(g).all() for g in grads[1].values())
