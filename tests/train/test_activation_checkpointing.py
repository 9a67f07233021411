"""Activation checkpointing (`train.activation_checkpointing`, models/backbone.py): every block
application of every architecture is recomputed in the backward with the same loss and gradients;
autograd keeps fewer bytes; decoding and evaluation never recompute; a real run trains the same."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import tango_lm.models.archs.attnres
import tango_lm.models.archs.moe
import tango_lm.models.backbone
from tango_lm import ModelConfig, build_model
from tango_lm.cli import main
from tango_lm.layers.attnres import DepthSources
from tests import arch_cases, helpers

# Each architecture's tiny model (4 heads of 8, width 48), plus variants worth their own case.
VARIANTS = {
    "tango-rotating": ("tango", {"active_width": 5}),  # segment 1 of [0,5) [5,10) [10,12) per head
    "moe-dropping": ("moe", {"capacity_factor_train": 1.25}),  # some tokens dropped, deterministically
    "attnres-block": ("attnres", {"depth": 4, "attnres_block": 1}),
}
CASES = {**{arch: (arch, {}) for arch in arch_cases.names()}, **VARIANTS}
T = 19
GEN = torch.Generator().manual_seed(3)
X, Y = (torch.randint(0, arch_cases.BASE["vocab_size"], (2, T), generator=GEN) for _ in range(2))


pytestmark = pytest.mark.usefixtures("one_thread")


def model_for(case: str) -> torch.nn.Module:
    arch, changes = CASES[case]
    model = train_model(arch_cases.tiny_config(arch, **changes))
    if case == "tango-rotating":
        model.set_active_segment(1)
    return model


def train_model(cfg: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(cfg).double().train()


def record_checkpoints(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The arguments of every `checkpoint` call the backbones make (the real one still runs)."""
    calls: list[tuple] = []
    real = tango_lm.models.backbone.checkpoint

    def recording(fn, *args, **kwargs):
        assert kwargs == {"use_reentrant": False}
        calls.append(args)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(tango_lm.models.backbone, "checkpoint", recording)
    monkeypatch.setattr(tango_lm.models.archs.attnres, "checkpoint", recording)
    monkeypatch.setattr(tango_lm.models.archs.moe, "checkpoint", recording)
    return calls


@pytest.fixture
def checkpoint_calls(monkeypatch) -> Iterator[list[tuple]]:
    yield record_checkpoints(monkeypatch)


def loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    loss = model.nll(X, Y)
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def check_same_loss_and_gradients(model: torch.nn.Module, checkpoint_calls: list[tuple]) -> dict:
    """float64: the recomputed backward gives the plain model's loss and every parameter gradient;
    each of the `depth` applications (a looped block's too) is one checkpoint. Returns the
    gradients under checkpointing."""
    model.set_activation_checkpointing(False)
    loss, grads = loss_and_grads(model)
    assert not checkpoint_calls
    model.set_activation_checkpointing(True)
    loss_ckpt, grads_ckpt = loss_and_grads(model)
    assert len(checkpoint_calls) == model.config.depth
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-12, atol=0)
    assert grads_ckpt.keys() == grads.keys()
    for name, grad in grads.items():
        if grad is None:  # a parameter this forward does not use has no gradient either way
            assert grads_ckpt[name] is None, name
            continue
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-10, atol=1e-14, msg=name)
    return grads_ckpt


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_loss_and_gradients(case, checkpoint_calls):
    check_same_loss_and_gradients(model_for(case), checkpoint_calls)


def test_load_balancing_reaches_the_router_through_recomputation(checkpoint_calls):
    model = model_for("moe-dropping")
    grads = check_same_loss_and_gradients(model, checkpoint_calls)
    assert model.backbone.aux_loss() is not None
    routers = [n for n in grads if n.endswith("router.weight")]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers)


def retained_bytes(model: torch.nn.Module, calls: list[tuple]) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `model.nll`: the tensors
    saved by its ops plus, under checkpointing, the inputs each checkpoint holds for its
    recomputation. Parameters are left out (kept either way)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(t) -> None:
        if isinstance(t, DepthSources):
            for x in t.values + t.normed + [t.partial, t.partial_normed]:
                keep(x)
        elif isinstance(t, (tuple, list)):
            for x in t:
                keep(x)
        elif isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model.nll(X, Y)
    for args in calls:
        keep(args)
    loss.backward()  # the graph is complete and usable
    return sum(kept.values())


def check_fewer_bytes(model: torch.nn.Module, checkpoint_calls: list[tuple]) -> tuple[int, int]:
    """Checkpointing keeps less than 30% of the bytes autograd keeps without it; returns both."""
    model.set_activation_checkpointing(False)
    plain = retained_bytes(model, checkpoint_calls)
    model.set_activation_checkpointing(True)
    ckpt = retained_bytes(model, checkpoint_calls)
    assert 0 < ckpt < 0.3 * plain, (ckpt, plain)
    return plain, ckpt


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpointing_keeps_fewer_bytes(case, checkpoint_calls):
    """Here checkpointing keeps a few percent (windowed TANGO) to about a fifth (full AttnRes, whose
    checkpoints hold every depth source) of the plain model's bytes; the test asks for less than 30%."""
    model = model_for(case)
    plain, ckpt = check_fewer_bytes(model, checkpoint_calls)
    if case == "tango":
        # At the least, each application no longer keeps its gate pre-activations and
        # destination projections ([B, T, F] each, float64).
        assert plain - ckpt >= model.config.depth * 2 * (2 * T * model.config.width * 8)


def test_decoding_and_evaluation_do_not_recompute(checkpoint_calls):
    model = model_for("tango")
    plain = model(X)
    model.set_activation_checkpointing(True)
    cache = model.new_cache()
    cached = torch.cat([model(X[:, :10], cache), model(X[:, 10:], cache)], dim=1)  # training mode, with a cache
    torch.testing.assert_close(cached, plain, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        model.nll(X, Y)
    model.eval()
    model.nll(X, Y)
    assert not checkpoint_calls
    model.train()
    model.nll(X, Y)
    assert len(checkpoint_calls) == model.config.depth


def test_train_run_with_activation_checkpointing_has_the_same_losses(data_dir, tmp_path, checkpoint_calls, capsys):
    """`tango-lm train ... train.activation_checkpointing=true` trains the same run (float32)."""
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"ckpt-{flag}"
        argv = [
            "train",
            *helpers.cli_overrides(data_dir, out, steps=4, eval_every=2, save_every=2, activation_checkpointing=flag),
            "--json",
        ]
        assert main(argv) == 0
        runs[flag] = (helpers.loss_records(out), json.loads(capsys.readouterr().out))
        assert json.loads((out / "config.json").read_text())["train"]["activation_checkpointing"] is flag
    # 4 steps x 1 micro-batch x depth 2 applications, only in the run that asked for it
    assert len(checkpoint_calls) == 4 * helpers.TINY_MODEL["depth"]
    (plain, plain_summary), (ckpt, ckpt_summary) = runs[False], runs[True]
    assert [r["step"] for r in ckpt] == [r["step"] for r in plain] == [1, 2, 3, 4]
    for a, b in zip(ckpt, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert ckpt_summary["test_nll"] == pytest.approx(plain_summary["test_nll"], rel=1e-5)
