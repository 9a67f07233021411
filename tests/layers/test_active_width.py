"""Rotating narrow-width training (docs/design.md §2.6, layers/active_width.py): the segment schedule,
validation, all-segment and one-segment evaluation against plain models, zero gradients, and the
real trainer leaving inactive columns (and their AdamW state) exactly unchanged."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.cli import main
from tango_lm.eval.evaluate import evaluate_checkpoint
from tango_lm.layers.active_width import ActiveColumns, num_segments, segment_for_step
from tango_lm.models.archs.base import Architecture
from tango_lm.models.backbone import Backbone
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.train import trainer as trainer_module
from tango_lm.train.config import load_run_config
from tango_lm.train.trainer import Trainer, train
from tests import arch_cases, helpers

# 4 heads of F/H = 12 gate columns (TANGO family); FFN / compact width 48 as one part.
BASE = dict(d_model=32, head_dim=8, width=48, depth=3, vocab_size=61, context_length=24)
ARCHS = {  # arch -> (extra fields, parts the width is cut into, K)
    "tango": ({}, 4, 5),  # segments [0,5) [5,10) [10,12) of each head's 12 columns
    "tango-windowed": ({"window": 5}, 4, 5),  # T = 19 > W: exact and feature-map weights
    "tango-3set": ({}, 4, 5),
    "tango-compact": ({"controller_width": 8}, 1, 20),  # [0,20) [20,40) [40,48)
    "loop-transformer": ({}, 1, 20),
    "untied-transformer": ({}, 1, 20),
}
ROWS = ("gate_proj.weight", "up_proj.weight", "expand_proj.weight")  # weights whose rows are the width


def config(arch: str, active: bool = True) -> ModelConfig:
    extra, _, k = ARCHS[arch]
    return ModelConfig(arch=arch, **BASE, **extra, active_width=k if active else None)


def pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A float64 model with active_width and a plain one with the same weights."""
    torch.manual_seed(0)
    narrow = build_model(config(arch)).double().eval()
    plain = build_model(config(arch, active=False)).double().eval()
    plain.load_state_dict(narrow.state_dict())
    return narrow, plain


def inactive_mask(arch: str, segment: int) -> torch.Tensor:
    """Bool [width], True for columns outside `segment`, from docs/design.md §2.6 directly."""
    _, units, k = ARCHS[arch]
    per_unit = BASE["width"] // units
    col = torch.arange(BASE["width"]) % per_unit
    return ~((col >= segment * k) & (col < (segment + 1) * k))


def gated(model: torch.nn.Module):
    """(name, weight, dim of the width) of every weight the segments narrow."""
    for name, p in model.named_parameters():
        if name.endswith(ROWS):
            yield name, p, 0
        elif name.endswith("down_proj.weight"):
            yield name, p, 1


def entries(mask: torch.Tensor, dim: int) -> torch.Tensor:
    return mask[:, None] if dim == 0 else mask[None, :]


IDS = torch.randint(0, 61, (2, 19), generator=torch.Generator().manual_seed(1))


# -- schedule and validation -------------------------------------------------------------------
def test_segment_schedule():
    assert num_segments(12, 5) == 3 and num_segments(12, 4) == 3 and num_segments(12, 12) == 1
    assert num_segments(12, 1) == 12
    assert [segment_for_step(n, 3) for n in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]
    cols = ActiveColumns(24, 2, 5, rows=(), cols=())
    spans = []
    for s in range(cols.num_segments):
        cols.select(s)
        spans.append(cols.bounds())
    assert spans == [(0, 5), (5, 10), (10, 12)]  # per head; the last segment is shorter
    assert cols.inactive_mask().nonzero().flatten().tolist() == list(range(10)) + list(range(12, 22))
    cols.select(None)
    assert cols.bounds() is None and cols.inactive_mask() is None


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_model_segments_and_bad_segment(arch):
    model = build_model(config(arch))
    assert model.num_segments == 3
    assert build_model(config(arch, active=False)).num_segments is None
    with pytest.raises(UserError, match=r"segment 3 does not exist: this model has 3 segments \(0 to 2\)"):
        model.set_active_segment(3)
    with pytest.raises(UserError, match="segment -1 does not exist"):
        model.set_active_segment(-1)


def test_plain_model_has_no_segments():
    model = build_model(config("tango", active=False))
    model.set_active_segment(None)
    with pytest.raises(UserError, match="built without model.active_width"):
        model.set_active_segment(0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(arch="tango", active_width=0), r"active_width=0 must be between 1 and the per-head gate width .*\(12\)"),
        (dict(arch="tango", active_width=13), r"active_width=13 must be between 1 and the per-head gate width"),
        (dict(arch="tango-3set", active_width=13), "per-head gate width"),
        (dict(arch="tango-windowed", active_width=13), "per-head gate width"),
        (dict(arch="tango-compact", active_width=49), r"between 1 and the gate width width \(48\)"),
        (dict(arch="loop-transformer", active_width=49), r"between 1 and the FFN width \(48\); lower active_width"),
        (dict(arch="untied-transformer", active_width=0), "FFN width"),
    ],
)
def test_bad_active_width_is_a_user_error(fields, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**{**BASE, **fields})
    ModelConfig(**{**BASE, **fields, "active_width": 12})  # the largest K that fits every arch here


def test_arch_without_support_rejects_active_width(monkeypatch):
    class Plain(Architecture):  # an architecture whose blocks know nothing of segments
        rotating_width = True  # ... registered as if they did: the built model is checked too

        @staticmethod
        def build(cfg):
            return Backbone([torch.nn.Identity()], [0], cfg.head_dim, cfg.rope_theta)

    monkeypatch.setitem(ARCHITECTURES, "plain", Plain)
    cfg = ModelConfig(**{**BASE, "arch": "plain", "active_width": 4})
    with pytest.raises(UserError, match="active_width .* is not supported by arch=plain; remove active_width"):
        build_model(cfg)


@pytest.mark.parametrize("arch", arch_cases.names())
def test_architectures_say_whether_they_rotate(arch):
    """`rotating_width` on the architecture class is true exactly when its blocks can run segments."""
    if ARCHITECTURES[arch].rotating_width:
        assert build_model(arch_cases.tiny_config(arch, active_width=2)).num_segments > 1
    else:  # refused with the config, before anything is built (params, match and sweeps read configs)
        with pytest.raises(UserError, match=f"not supported by arch={arch}; .* use one of: tango, "):
            arch_cases.tiny_config(arch, active_width=2)


def test_every_rotating_architecture_has_its_segment_cases():
    """The segment, gradient and training tests below need each rotating architecture's cut of the
    width (ARCHS, TRAIN_ARCHS): a newly registered one fails here, not silently untested."""
    rotating = {name for name, arch in ARCHITECTURES.items() if arch.rotating_width}
    assert rotating == set(ARCHS) and set(TRAIN_ARCHS) <= rotating


# Seed 000 Table 8: the packed active width of each rotating preset (per head for the TANGO
# variants, of the whole FFN for Transformer++) and the segments it cuts the matched width into.
TABLE8 = {"tango": (368, 5), "tango-windowed": (368, 5), "loop-transformer": (5632, 5), "untied-transformer": (640, 5)}


@pytest.mark.parametrize("arch", sorted(TABLE8))
def test_table8_rotating_presets(arch):
    cfg = load_run_config(f"{arch}-70m-d8-rotating", []).model
    assert (cfg.arch, cfg.d_model, cfg.depth) == (arch, 512, 8)
    with torch.device("meta"):
        model = build_model(cfg)
    assert (cfg.active_width, model.num_segments) == TABLE8[arch]


# -- evaluation modes --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_all_segments_equal_the_plain_model(arch):
    narrow, plain = pair(arch)
    assert narrow.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(narrow(IDS), plain(IDS))  # the default: every column active
    narrow.set_active_segment(1)
    narrow.set_active_segment(None)
    assert torch.equal(narrow(IDS), plain(IDS))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_one_segment_equals_the_model_with_other_columns_zeroed(arch):
    narrow, plain = pair(arch)
    full = plain(IDS)
    for segment in range(3):
        zeroed = build_model(config(arch, active=False)).double().eval()
        zeroed.load_state_dict(plain.state_dict())
        mask = inactive_mask(arch, segment)
        with torch.no_grad():
            for _, p, dim in gated(zeroed):
                p.masked_fill_(entries(mask, dim), 0.0)
        narrow.set_active_segment(segment)
        got = narrow(IDS)
        torch.testing.assert_close(got, zeroed(IDS), rtol=1e-12, atol=1e-12)
        assert (got - full).abs().max() > 1e-4  # a segment alone is a different model


@pytest.mark.parametrize("arch", ["tango", "tango-windowed", "tango-3set", "tango-compact"])
def test_cached_decoding_with_one_segment(arch):
    narrow, _ = pair(arch)
    narrow.set_active_segment(2)  # the short last segment
    full = narrow(IDS)
    cache = narrow.new_cache()
    pieces = [narrow(IDS[:, :7], cache)] + [narrow(IDS[:, i : i + 1], cache) for i in range(7, 19)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_inactive_columns_get_exactly_zero_gradient(arch):
    narrow, _ = pair(arch)
    narrow.train()
    for segment in range(3):
        narrow.zero_grad(set_to_none=True)
        narrow.set_active_segment(segment)
        narrow.nll(IDS[:, :-1], IDS[:, 1:]).backward()
        mask = inactive_mask(arch, segment)
        for name, p, dim in gated(narrow):
            grad = p.grad
            assert grad is not None, name
            assert not grad.masked_select(entries(mask, dim)).any(), (name, segment)
            assert grad.masked_select(entries(~mask, dim)).abs().max() > 0, (name, segment)


# -- the real trainer --------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_thread")


# helpers.TINY_MODEL: 2 heads of F/H = 32 gate columns; K = 12 -> segments [0,12) [12,24) [24,32).
TRAIN_ARCHS = {
    "tango": ({}, 2),
    "tango-windowed": ({"window": 7}, 2),
    "tango-3set": ({"depth": 3}, 2),
    "loop-transformer": ({}, 1),
}
K = 12


def trainer_mask(units: int, segment: int) -> torch.Tensor:
    col = torch.arange(64) % (64 // units)
    return ~((col >= segment * K) & (col < (segment + 1) * K))


@pytest.mark.parametrize("arch", sorted(TRAIN_ARCHS))
def test_trainer_rotates_segments_and_leaves_inactive_columns_unchanged(data_dir, tmp_path, arch):
    extra, units = TRAIN_ARCHS[arch]
    run = helpers.run_config(
        data_dir, tmp_path / "run", {"arch": arch, "active_width": K, **extra}, weight_decay=0.5, lr=1e-2
    )
    trainer = Trainer(run)
    model, opt = trainer.model, trainer.optimizer
    segments = 3 if units == 2 else 6
    assert model.num_segments == segments
    seen: dict[str, object] = {}
    step = opt.step

    def recording_step(*args, **kwargs):  # what the optimizer sees, inside the real train_step
        seen["segment"] = _segment(model)
        seen["grads"] = {n: p.grad.clone() for n, p, _ in gated(model)}
        return step(*args, **kwargs)

    opt.step = recording_step
    for n in range(7):
        before = {n_: p.detach().clone() for n_, p, _ in gated(model)}
        state_before = {n_: {k: v.clone() for k, v in opt.state.get(p, {}).items()} for n_, p, _ in gated(model)}
        trainer.train_step()
        segment = n % segments
        assert seen["segment"] == segment and _segment(model) is None  # all columns again after the step
        mask = trainer_mask(units, segment)
        for name, p, dim in gated(model):
            off = entries(mask, dim).expand_as(p)
            grad = seen["grads"][name]
            assert not grad[off].any(), (n, name)  # no gradient ...
            assert torch.equal(p.detach()[off], before[name][off]), (n, name)  # ... and no movement
            assert not torch.equal(p.detach()[~off], before[name][~off]), (n, name)  # the segment trained
            for key in ("exp_avg", "exp_avg_sq"):
                now = opt.state[p][key]
                if key in state_before[name]:
                    assert torch.equal(now[off], state_before[name][key][off]), (n, name, key)
                else:  # created by this (first) step: zero where no gradient came
                    assert not now[off].any(), (n, name, key)


def _segment(model: torch.nn.Module) -> int | None:
    segments = {m.segment for m in model.modules() if isinstance(m, ActiveColumns)}
    assert len(segments) == 1
    return segments.pop()


def test_without_the_guard_adamw_moves_inactive_columns(data_dir, tmp_path, monkeypatch):
    # Why the trainer wraps optimizer.step: zero gradient alone does not keep AdamW (weight decay,
    # momentum) from moving the inactive columns.
    monkeypatch.setattr(trainer_module, "keep_inactive_columns", lambda model, opt: contextlib.nullcontext())
    run = helpers.run_config(data_dir, tmp_path / "run", {"active_width": K}, weight_decay=0.5)
    trainer = Trainer(run)
    weight = trainer.model.backbone.layers[0].gate_proj.weight
    off = entries(trainer_mask(2, 1), 0).expand_as(weight)
    trainer.train_step()  # segment 0
    before = weight.detach().clone()
    trainer.train_step()  # segment 1: segment 0's columns are inactive but keep moving
    assert not torch.equal(weight.detach()[off], before[off])


def test_eval_segment_option(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, {"active_width": K}, steps=3, eval_every=3, save_every=3))
    all_cols = evaluate_checkpoint(str(out), "dev")
    assert all_cols["segment"] == "all"
    results = []
    for segment in range(3):
        res = evaluate_checkpoint(str(out), "dev", segment=segment)
        assert res["segment"] == segment
        results.append(res["nll"])
    assert len(set(results + [all_cols["nll"]])) == 4  # each segment is a different model

    assert main(["eval", str(out), "--split", "dev", "--segment", "1", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["segment"] == 1 and printed["nll"] == results[1]
    assert main(["eval", str(out), "--split", "dev", "--segment", "all"]) == 0
    assert "segment all" in capsys.readouterr().out
    assert main(["eval", str(out), "--split", "dev", "--segment", "2"]) == 0
    assert "segment 2" in capsys.readouterr().out
    for bad, message in (("7", "segment 7 does not exist"), ("x", "--segment must be 'all' or a segment number")):
        assert main(["eval", str(out), "--segment", bad]) == 2
        assert message in helpers.assert_one_error_line(capsys.readouterr().err)


def test_eval_segment_of_a_plain_run_is_a_user_error(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=1, eval_every=1, save_every=1))
    assert "segment" not in evaluate_checkpoint(str(out), "dev")
    capsys.readouterr()  # what training said (a one-step run warns of its warmup)
    assert main(["eval", str(out), "--segment", "0"]) == 2
    assert "without model.active_width" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_resume_continues_the_rotation_exactly(data_dir, tmp_path):
    # The segment follows the optimizer step, so a resumed run trains the same segments and ends
    # with the same weights as an uninterrupted one.
    model = {"active_width": K}
    full = train(helpers.run_config(data_dir, tmp_path / "full", model, steps=8))
    cut = tmp_path / "cut"
    trainer = Trainer(helpers.run_config(data_dir, cut, model, steps=8))
    cut.mkdir()
    assert [trainer.train_step() for _ in range(5)] == [full.losses[s] for s in range(1, 6)]
    trainer.save()
    resumed = train(helpers.run_config(data_dir, cut, model, steps=8), resume=True)
    assert resumed.losses == {s: full.losses[s] for s in range(6, 9)}
    helpers.assert_same_weights(
        helpers.weights(helpers.step_dir(tmp_path / "full", 8)), helpers.weights(helpers.step_dir(cut, 8))
    )


def test_a_segments_adam_updates_follow_the_global_step_counter():
    # What the module docstring says of AdamW's bias correction under rotation (S = 5, betas 0.9,
    # 0.95, a constant gradient): a segment's update is 0.52 of the lr at step 5, 0.79 at 25, 1.09
    # at 100, and within 1% of it from step ~400 (it said "~1 after a few dozen steps").
    from tango_lm.layers.active_width import keep_inactive_columns
    from tango_lm.layers.transformer import SwiGLU

    torch.manual_seed(0)
    ffn = SwiGLU(4, 10, active_width=2)
    opt = torch.optim.AdamW(ffn.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ratios = {}
    for step in range(1, 401):
        segment = (step - 1) % 5
        ffn.active.select(segment)
        before = ffn.gate_proj.weight.detach().clone()
        rows = torch.zeros(10, dtype=torch.bool)
        rows[2 * segment : 2 * segment + 2] = True
        for p in ffn.parameters():
            p.grad = torch.zeros_like(p)
        ffn.gate_proj.weight.grad = rows[:, None].float().expand_as(before).clone()
        with keep_inactive_columns(ffn, opt):
            opt.step()
        ratios[step] = (ffn.gate_proj.weight.detach() - before)[rows].abs().mean().item() / 1e-3
    assert [round(ratios[s], 2) for s in (5, 25, 100)] == [0.52, 0.79, 1.09]
    assert abs(ratios[400] - 1) < 0.01
