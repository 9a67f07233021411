"""A tiny model beside its float64 twin with the same weights, and what the GPU test
(tests/models/test_cuda_models.py) and the interpreted-Triton test (tests/models/test_triton_models.py)
both check: log-probs, loss and every parameter's gradient of the fp32 model against the float64
one, and that the model's mixing reached the Triton kernels."""

from __future__ import annotations

import torch

from tango_lm import ModelConfig, build_model


def twin_models(cfg: ModelConfig, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the float64 model on the CPU, the fp32 one on `device`), in training mode, with weights moved
    off their zero/one initializations (so every path matters) and, for a rotating-width config,
    a middle segment active as at one training step."""
    torch.manual_seed(0)
    ref = build_model(cfg).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model = build_model(cfg).to(device)
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    if cfg.active_width:
        ref.set_active_segment(1)
        model.set_active_segment(1)
    return ref.train(), model.train()


def loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model.nll(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(grads: dict, grads64: dict, tolerance: float = 2e-3) -> None:
    """Every parameter's gradient within `tolerance` of the float64 one, relative to its largest entry."""
    assert grads.keys() == grads64.keys()
    for name, grad in grads64.items():
        err = (grads[name].double().cpu() - grad).abs().max() / grad.abs().max().clamp_min(1e-6)
        assert err < tolerance, f"{name}: normalized gradient error {err:.1e}"


def record_triton_calls(monkeypatch) -> list[str]:
    """A list that grows by the op's name (`Architecture.triton_ops`) at each call into a Triton
    op's entry point (TANGO's mixing, windowed TANGO's, GAU's and FLASH's relu² attention); empty
    for good where triton is not installed."""
    from tango_lm.ops import relu2_attention, tango_mix, windowed_mix

    calls: list[str] = []
    for op, module, name in (
        ("tango_mix", tango_mix.tango_mix_triton, "tango_mix_triton"),
        ("windowed_mix", windowed_mix.windowed_triton, "windowed_band_mix_triton"),
        ("relu2_attention", relu2_attention.relu2_attention_triton, "relu2_attention_triton"),
    ):
        if module is not None:
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *xs, _f=real, _op=op: calls.append(_op) or _f(*xs))
    return calls
