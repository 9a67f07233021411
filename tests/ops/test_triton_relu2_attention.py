"""The Triton kernels of GAU's and FLASH's squared-ReLU attention (ops/relu2_attention_triton.py)
against the float64 reference: the output and every gradient (q, k, v, the relative bias) at odd
sizes (T, s and e that end blocks part-way, T = 1), in fp32, bf16 and fp16, with strided inputs and
NaN-filled buffers; the custom op's registration (fake tensors, autograd, torch.compile); the door
(ops/relu2_attention.py); a GAU and a FLASH model on the kernels against the reference path.
Without a GPU they run on CPU tensors in triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py; blocks of 16, so these sizes cross several blocks in every direction); with one, the
op tests run on CUDA too (`cuda` marker)."""

from __future__ import annotations

import pytest
import torch

from tango_lm.errors import UserError
from tests import arch_cases, helpers

triton_ops = pytest.importorskip(
    "tango_lm.ops.relu2_attention_triton",
    exc_type=ImportError,
    reason="triton is not installed (pip install 'tango-lm[triton]')",
)

from tango_lm import build_model  # noqa: E402
from tango_lm.ops import dispatch, relu2_attention_triton_kernels  # noqa: E402
from tango_lm.ops import relu2_attention as door  # noqa: E402
from tango_lm.ops.relu2_attention import relu2_attention, relu2_attention_reference  # noqa: E402
from tests import triton_configurations  # noqa: E402

INTERPRETED_CPU = pytest.param(
    "cpu", marks=pytest.mark.skipif(not triton_ops.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
)
DEVICES = [INTERPRETED_CPU, pytest.param("cuda", marks=pytest.mark.cuda)]
# Normalized max error (max |got - want| / max |want|) allowed per input dtype: bf16 and fp16 round
# the scores' operands and P to 8 and 11 bits before the tensor-core products, as flash attention does.
# Measured interpreted (2026-11-30): at most 1.8e-7 (fp32), 3.8e-4 (fp16), 7.5e-3 (bf16).
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 3e-2}
NAMES = ("out", "dq", "dk", "dv", "d rel_bias")


def inputs(lead, t, s, e, bias_range, dtype, device, bias_dtype=torch.float32, seed=0):
    """q, k, v [*lead, T, s|e] in `dtype` (scores of both signs and of order 1, so relu cuts some),
    a relative bias of 2 bias_range - 1 entries, and the output's gradient."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, std=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(dt).to(device)

    q, k = draw(*lead, t, s, std=s**-0.25), draw(*lead, t, s, std=s**-0.25)
    v, bias = draw(*lead, t, e), draw(2 * bias_range - 1, std=0.5, dt=bias_dtype)
    return [x.requires_grad_(True) for x in (q, k, v, bias)], draw(*lead, t, e)


def value_and_grads(fn, xs, dy, scale=0.7):
    y = fn(*xs, scale)
    return (y, *torch.autograd.grad(y, xs, dy))


def check_against_float64(got, xs, dy, scale=0.7):
    xs64 = [x.detach().cpu().double().requires_grad_(True) for x in xs]
    want = value_and_grads(relu2_attention_reference, xs64, dy.cpu().double(), scale)
    tol = TOLERANCE[xs[0].dtype]
    for g, w, x, name in zip(got, want, (xs[2], *xs), NAMES, strict=True):
        assert g.dtype == x.dtype and g.shape == w.shape, name  # each in its input's dtype
        err = (g.detach().cpu().double() - w).abs().max() / w.abs().max().clamp_min(1e-3)  # dq = 0 at T = 1
        assert err <= tol, f"{name}: normalized error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("lead", "t", "s", "e", "bias_range", "dtype"),
    [
        ((2,), 37, 7, 21, 40, torch.float32),  # odd T, s and e; several query, key and column blocks
        ((1, 2), 33, 16, 19, 33, torch.bfloat16),  # T = L: the bias's last offset; FLASH's [B, G] lead
        ((3,), 17, 9, 45, 20, torch.float16),  # e over three column blocks
        ((1,), 1, 4, 3, 1, torch.float32),  # one position, a one-entry bias
    ],
)
def test_triton_forward_and_every_gradient_match_float64(monkeypatch, device, lead, t, s, e, bias_range, dtype):
    nan_torch = helpers.NanEmptyTorch()
    monkeypatch.setattr(triton_ops, "torch", nan_torch)
    xs, dy = inputs(lead, t, s, e, bias_range, dtype, device, seed=t)
    check_against_float64(value_and_grads(triton_ops.relu2_attention_triton, xs, dy), xs, dy)
    assert nan_torch.calls >= 2  # out, dv: every buffer the kernels fill (dq, dk and d rel_bias start at 0)


@pytest.mark.parametrize(
    ("device", "kernel", "index"), triton_configurations.configuration_params(relu2_attention_triton_kernels, DEVICES)
)
def test_triton_every_configuration_matches_float64(monkeypatch, device, kernel, index):
    # Each kernel's every autotune configuration, alone, at a launch its limits admit and past its
    # blocks (unequal query and key blocks included); the other kernels' first admitted ones.
    launch = triton_configurations.force(monkeypatch, relu2_attention_triton_kernels, kernel, index)
    t = launch.seq_len
    if kernel != "dqk_kernel" and launch.dtype != torch.float32:
        t = 2 * t  # past two blocks: the forward's and dV's unmasked loops run (bf16 and fp16 only)
    xs, dy = inputs((2,), t, launch.head_dim, launch.width, t, launch.dtype, device, seed=index)
    check_against_float64(value_and_grads(triton_ops.relu2_attention_triton, xs, dy), xs, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_takes_strided_inputs_and_a_bias_of_another_dtype(device):
    # q, k as GAU's views of one [B, 2, T, s] base, v a column slice, a gradient with stride 0, and
    # a bf16 model's fp32 bias (autocast leaves the parameter in fp32).
    b, t, s, e = 2, 19, 6, 11
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(b, 2, t, s, generator=gen).to(device, torch.bfloat16)
    uv = torch.randn(b, t, 2 * e, generator=gen).to(device, torch.bfloat16)
    q, k = (x.requires_grad_(True) for x in base.unbind(1))
    v = uv[..., e:].requires_grad_(True)
    assert not (q.is_contiguous() or v.is_contiguous())
    bias = torch.randn(2 * t - 1, generator=gen).to(device).requires_grad_(True)
    dy = torch.ones(1, 1, 1, device=device, dtype=torch.bfloat16).expand(b, t, e)
    xs = [q, k, v, bias]
    assert triton_ops.supported(*xs) or device == "cpu" and not triton_ops.INTERPRETED
    got = value_and_grads(triton_ops.relu2_attention_triton, xs, dy)
    assert got[-1].dtype == torch.float32  # the bias's gradient in the bias's dtype
    check_against_float64(got, xs, dy)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_output_may_be_changed_in_place(device):
    # A custom op's output that is a view of its own buffer may not be changed in place.
    xs, dy = inputs((2,), 9, 4, 5, 9, torch.float32, device, seed=8)
    out = triton_ops.relu2_attention_triton(*xs, 0.7)
    out.mul_(2.0)
    got = torch.autograd.grad(out, xs, dy)
    want = torch.autograd.grad(relu2_attention_reference(*xs, 0.7) * 2.0, xs, dy)
    for g, w, name in zip(got, want, NAMES[1:], strict=True):
        torch.testing.assert_close(g, w, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_custom_op_registration(device):
    # Fake (meta) implementations, the autograd formula and schema, as torch.compile relies on them.
    (q, k, v, bias), dy = inputs((2,), 9, 4, 5, 12, torch.float32, device, seed=3)
    torch.library.opcheck(
        torch.ops.tango_lm.relu2_attention_triton_forward,
        (q, k, v, bias, 0.5),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    torch.library.opcheck(
        torch.ops.tango_lm.relu2_attention_triton_backward,
        (dy, q, k, v, bias, 0.5),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_triton_inside_a_compiled_graph(device):
    # The custom op keeps the graph whole (fullgraph) and gives the eager kernels' values and gradients.
    xs, _ = inputs((1,), 11, 4, 5, 16, torch.float32, device, seed=4)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, bias: relu2_attention(q, k, v, bias, 0.5, kernels="triton").sum(-1),
        fullgraph=True,
        dynamic=False,
        backend="aot_eager",
    )
    got = compiled(*xs)
    want = triton_ops.relu2_attention_triton(*xs, 0.5).sum(-1)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, xs, torch.ones_like(got))
    for x, y in zip(grads, torch.autograd.grad(want, xs, torch.ones_like(want)), strict=True):
        torch.testing.assert_close(x, y)
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["q", "k", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_propagates_a_nan_score_as_relu_does(device, where, dtype):
    # tl.maximum(nan, 0) is 0 by default: a NaN in q, k or the bias came out as finite outputs. At
    # T = 40 (blocks of 16 interpreted) rows 16-31 see key block 0 in the bf16 kernels' unmasked
    # loop: key 7 and offset 20 (bias entry 39 + 20) reach those rows through it alone.
    (q, k, v, bias), _ = inputs((1,), 40, 8, 5, 40, dtype, device, seed=7)
    with torch.no_grad():
        {"q": q, "k": k}.get(where, bias)[(0, 20 if where == "q" else 7, 3) if where != "bias" else 59] = float("nan")
    got = triton_ops.relu2_attention_triton(q, k, v, bias, 0.5)
    want = relu2_attention_reference(*(x.detach().cpu().double() for x in (q, k, v, bias)), 0.5)
    assert got.isnan().any() and torch.equal(got.isnan().cpu(), want.isnan())


def test_triton_takes_only_what_it_supports():
    q, v, bias = torch.zeros(2, 5, 4), torch.zeros(2, 5, 3), torch.zeros(9)
    assert triton_ops.supported(q, q, v, bias) == triton_ops.INTERPRETED  # CPU tensors only when interpreted
    assert not triton_ops.supported(q.double(), q.double(), v.double(), bias)  # no float64 kernels
    assert not triton_ops.supported(q, q, v.half(), bias)  # one dtype for q, k and v
    assert not triton_ops.supported(torch.zeros(2, 5, 300), torch.zeros(2, 5, 300), v, bias)  # s <= 256
    assert not triton_ops.supported(q, q, v, torch.zeros(7))  # a bias too short for T = 5
    assert not triton_ops.supported(q, q[:1], v, bias)  # q and k of one shape


@pytest.fixture
def calls(monkeypatch):
    """Records which implementation of relu2_attention ran (each still computes its result)."""
    seen = []
    for name, attr in (("reference", "relu2_attention_reference"), ("blocked", "relu2_attention_blocked")):
        real = getattr(door, attr)
        monkeypatch.setattr(door, attr, lambda *xs, _n=name, _f=real, **kw: seen.append(_n) or _f(*xs, **kw))
    real_triton = triton_ops.relu2_attention_triton
    monkeypatch.setattr(triton_ops, "relu2_attention_triton", lambda *xs: seen.append("triton") or real_triton(*xs))
    monkeypatch.delenv(dispatch.ENV, raising=False)
    return seen


def test_triton_through_the_door_and_its_fallbacks(calls):
    (q, k, v, bias), _ = inputs((2,), 7, 4, 5, 8, torch.float32, "cpu")
    want = relu2_attention_reference(q, k, v, bias, 0.5)
    torch.testing.assert_close(relu2_attention(q, k, v, bias, 0.5), want)  # auto on CPUs: as before
    if triton_ops.INTERPRETED:
        torch.testing.assert_close(relu2_attention(q, k, v, bias, 0.5, kernels="triton"), want)
    relu2_attention(q.double(), k.double(), v.double(), bias, 0.5, kernels="triton")  # float64: falls back
    relu2_attention(q[:, -1:], k, v, bias, 0.5, kernels="triton")  # a decode step: the reference
    expected = ["blocked", "triton"] if triton_ops.INTERPRETED else ["blocked", "blocked"]
    assert calls == [*expected, "blocked", "reference"]
    with pytest.raises(
        ValueError, match=r"^relu2_attention: inputs on different devices \(q on cpu, k on cpu, v on meta"
    ):
        relu2_attention(q, k, v.to("meta"), bias, 0.5)
    with pytest.raises(ValueError, match="7 positions exceed the relative bias's range of 4"):
        relu2_attention(q, k, v, bias[:7], 0.5, kernels="triton")


def test_asking_for_triton_without_triton_names_the_extra(monkeypatch):
    monkeypatch.setattr(door, "relu2_attention_triton", None)
    (q, k, v, bias), _ = inputs((1,), 5, 4, 3, 8, torch.float32, "cpu")
    with pytest.raises(UserError, match=r"TANGO_LM_KERNELS=triton needs the triton package"):
        relu2_attention(q, k, v, bias, 0.5, kernels="triton")
    relu2_attention(q, k, v, bias, 0.5)  # auto does not need it


@pytest.mark.skipif(not triton_ops.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("arch", ["gau", "flash"])
def test_triton_model_loss_and_gradients_equal_the_reference_path(monkeypatch, calls, arch):
    # FLASH at T = 21 with groups of 4: five full groups and a padded one, folded into the batch.
    cfg = arch_cases.tiny_config(arch, depth=2)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # move off zero/one inits (the relative bias starts at 0) so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    x, y = (torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(1)) for _ in range(2))
    results = {}
    for name in ("reference", "triton"):
        monkeypatch.setenv(dispatch.ENV, name)
        model.zero_grad(set_to_none=True)
        loss = model.nll(x, y)
        loss.backward()
        results[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert calls == ["reference"] * cfg.depth + ["triton"] * cfg.depth
    (loss_ref, grads_ref), (loss_tri, grads_tri) = results["reference"], results["triton"]
    torch.testing.assert_close(loss_tri, loss_ref, rtol=1e-6, atol=1e-6)
    assert grads_tri.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        err = (grads_tri[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-6)
        assert err < 1e-4, f"{name}: normalized gradient error {err:.1e}"
    assert all(g.abs().max() > 0 for n, g in grads_ref.items() if n.endswith("rel_bias"))  # exercised


@pytest.mark.skipif(not triton_ops.INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_triton_gau_layer_compiles_whole(monkeypatch):
    # On CUDA the layer's attention is the custom op inside the compiled graph; here the same,
    # interpreted: one graph (fullgraph) that calls the op, with the eager layer's output and gradients.
    from torch._dynamo.backends.debugging import aot_eager

    from tango_lm.layers.rope import rope_tables

    monkeypatch.setenv(dispatch.ENV, "triton")
    layer = build_model(arch_cases.tiny_config("gau", depth=1)).backbone.layers[0]
    x = torch.randn(2, 13, layer.norm.weight.shape[0], requires_grad=True)
    rope = rope_tables(13, layer.z_proj.out_features, 10000.0, x.device, dtype=x.dtype)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True, dynamic=False, backend=backend)(x, rope)
    want = layer(x, rope)
    assert len(graphs) == 1 and "relu2_attention_triton_forward" in graphs[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    torch._dynamo.reset()
