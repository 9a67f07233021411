"""AdamW parameter groups and the learning-rate schedules (docs/design.md §6)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tango_lm.models.config import ModelConfig
from tango_lm.models.model import build_model
from tango_lm.train.config import TrainConfig
from tango_lm.train.optim import build_optimizer, lr_at, set_fused, use_fused_adamw

LR, FLOOR_RATIO = 2e-3, 0.1
FLOOR = LR * FLOOR_RATIO


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": LR, "min_lr_ratio": FLOOR_RATIO, "warmup_steps": 10, **kw})


def _curve(total: int, **kw) -> list[float]:
    cfg = _cfg(**kw)
    return [lr_at(s, total, cfg) for s in range(total)]


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_warmup_is_linear_and_reaches_peak(schedule):
    lrs = _curve(100, schedule=schedule)
    warm = lrs[:10]
    assert all(b > a for a, b in zip(warm, warm[1:], strict=False))
    assert warm[0] == pytest.approx(LR / 11)
    steps = [b - a for a, b in zip([0.0, *warm], warm, strict=False)]
    assert steps == pytest.approx([LR / 11] * 10)
    assert lrs[10] == pytest.approx(LR)
    assert max(lrs) == pytest.approx(LR)
    assert all(x > 0 for x in lrs)


def test_constant_schedule_stays_at_peak():
    lrs = _curve(50, schedule="constant")
    assert lrs[10:] == [LR] * 40


def test_wsd_plateau_then_linear_decay_to_floor():
    lrs = _curve(100, schedule="wsd", decay_fraction=0.2)
    assert lrs[10:80] == [LR] * 70  # stable until the last 20% of steps
    decay = lrs[80:]
    assert all(b < a for a, b in zip(decay, decay[1:], strict=False))
    diffs = [a - b for a, b in zip(decay, decay[1:], strict=False)]
    assert diffs == pytest.approx([diffs[0]] * len(diffs))  # linear
    assert lrs[-1] == pytest.approx(FLOOR)
    assert min(lrs[10:]) == pytest.approx(FLOOR)
    assert lrs[79] - decay[0] == pytest.approx(diffs[0])


def test_wsd_decay_length_rounds_to_the_nearest_step():
    # 0.2 of 14 steps is 2.8: three decay steps, not the two that truncating gives.
    lrs = _curve(14, schedule="wsd", decay_fraction=0.2, warmup_steps=0)
    assert lrs[:11] == [LR] * 11 and lrs[11] < LR
    assert lrs[11:] == pytest.approx([LR + (FLOOR - LR) * k / 3 for k in (1, 2, 3)])


def test_wsd_decay_starts_after_a_warmup_that_reaches_into_it():
    # Warmup 8 of 10 steps with half of them decaying: the decay runs from the peak at step 8 to the
    # floor at step 9, not from a start inside the warmup (a drop right after it).
    lrs = _curve(10, schedule="wsd", decay_fraction=0.5, warmup_steps=8)
    assert lrs[:8] == pytest.approx([LR * (s + 1) / 9 for s in range(8)])
    assert lrs[8:] == pytest.approx([LR + (FLOOR - LR) / 2, FLOOR])


def test_cosine_decays_monotonically_between_peak_and_floor():
    lrs = _curve(100, schedule="cosine")
    tail = lrs[10:]
    assert tail[0] == pytest.approx(LR)
    assert all(b < a for a, b in zip(tail, tail[1:], strict=False))
    assert all(FLOOR <= x <= LR for x in tail)
    # The decay spans steps 10 .. 99 (89 intervals), the last step landing on the floor.
    mid = 10 + 45
    assert lrs[mid] == pytest.approx(FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi * 45 / 89)))


def test_cosine_ends_at_floor_on_last_step():
    assert _curve(100, schedule="cosine")[-1] == pytest.approx(FLOOR)


@pytest.mark.parametrize("total", [1, 2, 5])
def test_short_runs_are_well_defined(total):
    for schedule in ("wsd", "cosine", "constant"):
        lrs = _curve(total, schedule=schedule, warmup_steps=100)
        assert all(0 < x <= LR for x in lrs)
        assert all(math.isfinite(x) for x in lrs)
    # Warmup longer than the run: both decays land on the floor at the last step (cosine stayed at the peak).
    for schedule in ("wsd", "cosine"):
        assert _curve(total, schedule=schedule, warmup_steps=100)[-1] == pytest.approx(FLOOR)


def test_wsd_without_a_decay_fraction_does_not_decay():
    # decay_fraction 0 still decayed the last step to the floor.
    assert _curve(20, schedule="wsd", decay_fraction=0.0)[10:] == [LR] * 10
    assert _curve(20, schedule="wsd", decay_fraction=0.01)[-1] == pytest.approx(FLOOR)  # rounds to one step


def test_schedule_past_the_end_stays_at_floor():
    cfg = _cfg(schedule="wsd")
    assert lr_at(150, 100, cfg) == pytest.approx(FLOOR)
    cfg = _cfg(schedule="cosine")
    assert lr_at(150, 100, cfg) == pytest.approx(FLOOR)


def _tiny_model() -> nn.Module:
    return build_model(
        ModelConfig(arch="tango", d_model=32, head_dim=16, width=64, depth=2, vocab_size=257, context_length=32)
    )


def test_optimizer_groups_decay_matrices_only():
    model = _tiny_model()
    opt = build_optimizer(model, _cfg(weight_decay=0.1, beta1=0.8, beta2=0.9))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {
        n for n, p in model.named_parameters() if n.endswith("norm.weight")
    }
    assert any(names[id(p)].endswith("embed_tokens.weight") for p in decay["params"])
    assert all(g["betas"] == (0.8, 0.9) and g["lr"] == LR for g in opt.param_groups)


@pytest.mark.parametrize("arch", ["gau", "flash"])
def test_offset_scales_are_not_decayed(arch):
    # gamma and beta are per-dimension scales and offsets stored as one [n_offsets, s] tensor each:
    # two dimensions, yet vectors (docs/design.md §6); the ndim rule decayed them.
    model = build_model(ModelConfig(arch=arch, d_model=32, width=64, depth=2, vocab_size=257, context_length=32))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = build_optimizer(model, _cfg(weight_decay=0.1)).param_groups
    undecayed = {names[id(p)].rsplit(".", 1)[-1] for p in no_decay["params"]}
    assert {"gamma", "beta", "rel_bias"} <= undecayed
    assert not any(names[id(p)].endswith((".gamma", ".beta")) for p in decay["params"])


def test_norm_weights_are_not_decayed():
    """With zero gradients AdamW only applies weight decay: matrices shrink, norms do not move."""
    model = _tiny_model()
    opt = build_optimizer(model, _cfg(weight_decay=0.5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, before[n]), n
        else:
            torch.testing.assert_close(p.detach(), before[n] * (1 - LR * 0.5))


def test_frozen_parameters_are_left_out():
    model = _tiny_model()
    model.norm.weight.requires_grad_(False)
    opt = build_optimizer(model, _cfg())
    assert all(p is not model.norm.weight for g in opt.param_groups for p in g["params"])


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return build_model(
        ModelConfig(arch="tango", d_model=16, head_dim=8, width=32, depth=2, vocab_size=19, context_length=8)
    )


def test_fused_adamw_on_plain_cpu_parameters_matches_the_foreach_path():
    fused_model, foreach_model = _tiny_model(), _tiny_model()
    fused = build_optimizer(fused_model, _cfg())
    assert all(g["fused"] for g in fused.param_groups)
    foreach = build_optimizer(foreach_model, _cfg())
    set_fused(foreach, False)
    assert not any(g["fused"] for g in foreach.param_groups)
    x = torch.randint(0, 19, (2, 9))
    for _ in range(3):
        for model, opt in ((fused_model, fused), (foreach_model, foreach)):
            model.nll(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for a, b in zip(fused_model.parameters(), foreach_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_flag_survives_a_state_dict_from_another_setup():
    # A checkpoint written without the fused kernel restores fused=None into the groups.
    model = _tiny_model()
    opt = build_optimizer(model, _cfg())
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        group["fused"] = None
    opt.load_state_dict(saved)
    assert not any(g["fused"] for g in opt.param_groups)
    set_fused(opt, use_fused_adamw(model))
    assert all(g["fused"] for g in opt.param_groups)


def test_fused_resume_moves_the_step_counts_to_the_parameters_device():
    # Loading moves AdamW's step counts to the parameters' device only when the saved groups were
    # fused; an FSDP run's (never fused) resumed on one GPU kept them on the CPU, which CUDA's fused
    # kernel refuses at the first step. The meta device stands in for the GPU here.
    model = _tiny_model()
    opt = build_optimizer(model, _cfg())
    set_fused(opt, False)
    model.nll(torch.randint(0, 19, (2, 8)), torch.randint(0, 19, (2, 8))).backward()
    opt.step()
    saved = opt.state_dict()
    params = [nn.Parameter(torch.empty_like(p, device="meta")) for p in model.parameters()]
    sizes = [len(g["params"]) for g in opt.param_groups]
    groups = [{"params": params[: sizes[0]]}, {"params": params[sizes[0] :]}]
    resumed = torch.optim.AdamW(groups, lr=LR)
    resumed.load_state_dict(saved)
    assert {state["step"].device.type for state in resumed.state.values()} == {"cpu"}  # what loading does
    set_fused(resumed, True)
    for param, state in resumed.state.items():
        assert state["step"].device == param.device and state["step"].dtype == torch.float32
    set_fused(opt, True)  # on its own device already: left as it is
    assert all(state["step"].device.type == "cpu" for state in opt.state.values())


def test_fused_kernel_only_where_it_runs():
    assert use_fused_adamw(nn.Linear(3, 2))
    counted = nn.Linear(3, 2)
    counted.register_parameter("steps", nn.Parameter(torch.zeros(2, dtype=torch.long), requires_grad=False))
    assert use_fused_adamw(counted)  # frozen parameters are not the optimizer's
    assert not use_fused_adamw(nn.Linear(3, 2, device="meta"))
