"""Every architecture trains end to end from its preset (shrunk) through `tango-lm train`, and
every head trains on every onóna backbone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tango_lm.cli import main
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.train.config import PRESET_DIR, load_run_config
from tango_lm.train.trainer import train
from tests import arch_cases, helpers


def preset_of(arch: str) -> tuple[str, dict[str, Any]]:
    """A shipped preset of the architecture (the first named after it, else the first that uses
    it) and no overrides; for one that ships none (a new architecture, registered and nothing
    else), the first preset with the architecture swapped in."""
    names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    named = [n for n in names if n.startswith(f"{arch}-")]
    for name in named + [n for n in names if n not in named]:
        if load_run_config(name, []).model.arch == arch:
            return name, {}
    return names[0], {"model.arch": arch}


def _case_id(preset: str, overrides: dict[str, Any]) -> str:
    return f"{overrides['model.arch']}-from-{preset}" if "model.arch" in overrides else preset


# One preset per registered architecture, plus the paper's special geometries with what they need.
GEOMETRIES = {
    "conventional-untied-70m-d4": {},
    "tango-70m-d8-rotating": {"model.active_width": 1},
    "tango-windowed-70m-d8-rotating": {"model.active_width": 3},
}
CASES = {_case_id(*found): found for found in map(preset_of, arch_cases.names())}
CASES |= {preset: (preset, overrides) for preset, overrides in GEOMETRIES.items()}


def tiny_overrides(arch: str) -> dict[str, Any]:
    """Overrides that shrink a preset or config of `arch` to its tiny model (tests/arch_cases.py)
    on byte tokens."""
    fields = arch_cases.tiny_fields(arch, vocab_size=257, context_length=32)
    fields = {"n_heads": None, "n_kv_heads": None, **fields}  # heads follow head_dim unless tiny says
    return {f"model.{k}": v for k, v in fields.items()}


def case_overrides(case: str) -> tuple[str, dict[str, Any]]:
    """The case's preset and the overrides that shrink it."""
    preset, extra = CASES[case]
    arch = extra.get("model.arch") or load_run_config(preset, []).model.arch
    return preset, tiny_overrides(arch) | extra


pytestmark = pytest.mark.usefixtures("one_thread")


def check_trains_through_the_cli(
    config: str | Path, overrides: dict[str, Any], data_dir: Path, out: Path, capsys: pytest.CaptureFixture
) -> None:
    """`tango-lm train CONFIG key=value ...` runs two steps with dev and test NLL."""
    overrides = {
        **overrides,
        "data.dir": str(data_dir),
        "train.out_dir": str(out),
        "train.steps": 2,
        "train.tokens_per_param": None,
        "train.batch_size": 2,
        "train.grad_accum": 1,
        "train.eval_every": 2,
        "train.save_every": 2,
        "train.eval_windows": 2,
        "train.test_windows": 2,
        "train.warmup_steps": 1,
        "train.seq_len": 32,
        "train.progress": False,
    }
    argv = ["train", str(config), *(f"{k}={'null' if v is None else v}" for k, v in overrides.items()), "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["test_nll"] > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_trains_through_the_cli(case, data_dir, tmp_path, capsys):
    check_trains_through_the_cli(*case_overrides(case), data_dir, tmp_path / "run", capsys)


@pytest.mark.parametrize("arch", sorted(a for a, c in ARCHITECTURES.items() if c.family == "onona") + ["tango"])
def test_every_head_trains_on_the_backbone(arch, data_dir, tmp_path):
    for head in sorted(HEADS):
        model = {
            "arch": arch,
            "head": head,
            "d_model": 32,
            "head_dim": 8,
            "width": 32,
            "depth": 2,
            "vocab_size": 257,
            "context_length": 32,
            "gdn_head_dim": 8,
            "moe_expert_width": 16,
        }
        run = helpers.run_config(data_dir, tmp_path / head, model=model, steps=2, eval_every=2, save_every=2)
        result = train(run)
        assert result.summary["steps"] == 2 and result.summary["head"] == head
        assert all(loss == loss for loss in result.losses.values())  # no NaN


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_autocast_step_matches_fp32(case):
    preset, overrides = case_overrides(case)
    check_bf16_step(load_run_config(preset, [f"{k}={'null' if v is None else v}" for k, v in overrides.items()]).model)


def check_bf16_step(cfg) -> None:
    """What a GPU run does under train.precision=auto: the same step in bf16 autocast (here on the
    CPU) gives the fp32 loss and gradients to bf16 accuracy. The weights are moved off their
    initialization first, where near-uniform predictions hid whole blocks: zeroing TANGO's mixer
    under autocast changed the loss by 0.03%, inside the 2% this allowed; bf16 itself moves it by
    at most 1e-4 of the loss here, and the gradients by 1.3% (MoE 5%: a token's top-k flips)."""
    import torch

    from tango_lm import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    losses, grads = [], []
    for bf16 in (False, True):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model.nll(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[1] - losses[0]) < 1e-3 * losses[0], losses
    assert grads[1].keys() == grads[0].keys()
    assert all(torch.isfinite(g).all() for g in grads[1].values())
    error = sum(((grads[1][n] - g) ** 2).sum() for n, g in grads[0].items()) ** 0.5
    assert error < 0.1 * sum((g**2).sum() for g in grads[0].values()) ** 0.5
