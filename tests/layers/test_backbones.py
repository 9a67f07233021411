"""The onóna-paper backbones (docs/design.md §4): Dense, GDN hybrid, MoE, AttnRes. Parameter formulas against
the modules and the paper's counts, the presets, causality, the pieces each one adds (GQA with
QK-norm, GDN layout and state, MoE dispatch/capacity/load balancing, depth attention), and the
user errors. Cached decoding is tested for every architecture in test_generate.py."""

from __future__ import annotations

import math

import pytest
import torch

import tango_lm.layers.moe
from tango_lm import ModelConfig, UserError, build_model
from tango_lm.layers import attnres as attnres_layers
from tango_lm.layers.attnres import AttnRes, attn_res_reference
from tango_lm.layers.gated_deltanet import GatedDeltaNet
from tango_lm.layers.gqa import GroupedQueryAttention
from tango_lm.layers.moe import MoEFeedForward, capacity_factor
from tango_lm.layers.rope import rope_tables
from tango_lm.models.archs.attnres import sources_per_mix
from tango_lm.models.flops import flops_per_token
from tango_lm.models.params import count_params
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.serve.cache import LayerState
from tango_lm.train.config import load_run_config
from tango_lm.train.trainer import Trainer, train
from tests import arch_cases, helpers
from tests.models.test_model import check_causal

ARCHS = ("dense", "gdn-hybrid", "moe", "attnres")
V, T = 61, 12


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the formulas, written out from docs/design.md §4 ----------------------------------------------------
def spec_non_embedding(cfg: ModelConfig, active: bool = False) -> int:
    d, h, hkv, dh, f, depth = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.width, cfg.depth
    attention = 2 * d * h * dh + 2 * d * hkv * dh + 2 * dh  # q, o; k, v; QK-norm
    dense_layer = attention + 3 * d * f + 2 * d
    if cfg.arch == "dense":
        return depth * dense_layer + d
    if cfg.arch == "attnres":
        return depth * dense_layer + d + (2 * depth + 1) * 2 * d
    if cfg.arch == "moe":
        fe = cfg.moe_expert_width or f // cfg.moe_top_k
        experts = cfg.moe_top_k if active else cfg.n_experts
        return depth * (attention + 2 * d + d * cfg.n_experts + experts * 3 * d * fe) + d
    if cfg.arch == "gdn-hybrid":
        n_attn = depth // cfg.attention_every if cfg.attention_every else 0
        heads = cfg.gdn_n_heads or d // cfg.gdn_head_dim
        dk, dv = cfg.gdn_head_dim, int(cfg.gdn_head_dim * cfg.gdn_expand_v)
        gdn = (
            2 * d * heads * dk
            + 3 * d * heads * dv
            + 2 * d * heads
            + 2 * heads
            + cfg.conv_size * heads * (2 * dk + dv)
            + dv
        )
        return n_attn * dense_layer + (depth - n_attn) * (gdn + 3 * d * f + 2 * d) + d
    raise AssertionError(cfg.arch)


def numel(model: torch.nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    return total, sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))


def tiny(arch: str, **changes) -> ModelConfig:
    fields = dict(
        arch=arch,
        d_model=32,
        head_dim=8,
        n_kv_heads=2,
        width=48,
        depth=3,
        vocab_size=V,
        context_length=16,
        gdn_head_dim=8,
        attention_every=2,
        n_experts=4,
        moe_top_k=2,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def tiny_model(arch: str, seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(tiny(arch, **changes))
    with torch.no_grad():  # larger weights than the 0.02 init, so positions interact visibly
        for name, p in model.named_parameters():
            if p.dim() == 2 and not name.startswith("head."):
                p.normal_(0, 0.2)
    return model.double().eval()


def ids(b: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


VARIANTS = [
    ("dense", {}),
    ("dense", dict(n_kv_heads=None)),
    ("dense", dict(d_model=48, n_heads=6, n_kv_heads=3, width=40)),
    ("gdn-hybrid", {}),
    ("gdn-hybrid", dict(attention_every=0)),
    ("gdn-hybrid", dict(attention_every=1)),
    ("gdn-hybrid", dict(depth=5, attention_every=4, gdn_head_dim=16, gdn_expand_v=2.0, conv_size=3)),
    ("gdn-hybrid", dict(gdn_n_heads=3, gdn_expand_v=0.5)),
    ("moe", {}),
    ("moe", dict(moe_top_k=1, moe_renormalize=False)),
    ("moe", dict(n_experts=3, moe_expert_width=20)),
    ("attnres", {}),
    ("attnres", dict(attnres_block=1)),
    ("attnres", dict(attnres_block=2, depth=5)),
]


@pytest.mark.parametrize(("arch", "changes"), VARIANTS)
def test_formula_equals_numel(arch, changes):
    cfg = tiny(arch, **changes)
    total, non_emb = numel(build_model(cfg))
    counts = count_params(cfg)
    assert counts["non_embedding"] == non_emb == spec_non_embedding(cfg)
    assert counts["total"] == total == non_emb + V * cfg.d_model


# -- the paper's presets ------------------------------------------------------------------------
PRESET_TOTALS = {  # total, non-embedding (V = 50304, tied Standard head)
    "dense-142m": (142_469_888, 103_836_416),  # the paper's exact Dense counts (Appendix C)
    "dense-330m": (329_961_472, 278_450_176),
    "dense-1b": (1_031_098_880, 928_076_288),  # paper: 928M non-embedding (Appendix C)
    "gdn-hybrid-142m": (156_846_992, 118_213_520),  # paper: 118.2M non-embedding
    "gdn-hybrid-330m": (368_226_592, 316_715_296),
    "moe-142m": (369_060_608, 330_427_136),  # paper: 330.4M total, 103.9M active non-embedding
    "moe-330m": (938_856_448, 887_345_152),
    "attnres-142m": (142_520_576, 103_887_104),  # paper: 103.9M non-embedding
    "attnres-330m": (330_061_824, 278_550_528),
}


@pytest.mark.parametrize("name", sorted(PRESET_TOTALS))
def test_preset_counts(name):
    from tango_lm.train.config import PRESET_DIR

    cfg = load_run_config(name, []).model
    with torch.device("meta"):
        model = build_model(cfg)
    total, non_emb = numel(model)
    counts = count_params(cfg)
    assert (counts["total"], counts["non_embedding"]) == (total, non_emb) == PRESET_TOTALS[name]
    assert non_emb == spec_non_embedding(cfg)
    assert (cfg.vocab_size, cfg.context_length, cfg.head_dim) == (50304, 1024, 64)
    text = (PRESET_DIR / f"{name}.yaml").read_text()
    assert f"Total {total:,} parameters" in text


def test_presets_share_the_dense_shape_and_moe_matches_active_params():
    for size in ("142m", "330m"):
        dense = load_run_config(f"dense-{size}", []).model
        for arch in ARCHS:
            cfg = load_run_config(f"{arch}-{size}", []).model
            assert (cfg.d_model, cfg.depth, cfg.n_heads, cfg.n_kv_heads, cfg.width) == (
                dense.d_model,
                dense.depth,
                dense.n_heads,
                dense.n_kv_heads,
                dense.width,
            )
        moe = load_run_config(f"moe-{size}", []).model
        active = ARCHITECTURES["moe"].active_non_embedding_params(moe)
        assert active == spec_non_embedding(moe, active=True)
        assert active - count_params(dense)["non_embedding"] == dense.depth * dense.d_model * moe.n_experts  # router
    assert load_run_config("moe-142m", []).model.num_params()["total"] - 330_427_136 == 50304 * 768


def test_dense_1b_against_the_paper():
    # Seed 001: 928M non-embedding Dense parameters, a second table of 103M for onóna (Appendix C,
    # "Training overhead"), 78,800 steps of 524,288 tokens = 41,313,894,400 tokens.
    run = load_run_config("dense-1b", [])
    counts = count_params(run.model)
    assert round(counts["non_embedding"] / 1e6) == 928 and counts["embedding"] == 50304 * 2048
    onona = count_params(run.model.replace(head="onona"))
    assert onona["total"] - counts["total"] == 50304 * 2048 + 2048 and round(50304 * 2048 / 1e6) == 103
    moss = count_params(run.model.replace(head="moss"))  # MoSS (K = 2): K d^2 + K d more than Standard
    assert moss["total"] - counts["total"] == 2 * 2048 * 2048 + 2 * 2048
    for head, counts_of_arm in (("onona", onona), ("moss", moss)):  # the formulas against the modules
        with torch.device("meta"):
            assert numel(build_model(run.model.replace(head=head)))[0] == counts_of_arm["total"]
    assert run.total_steps() == 78_800
    assert run.train.batch_size * run.train.grad_accum * run.seq_len() == 524_288
    assert run.total_steps() * 524_288 == 41_313_894_400
    # The smaller sizes' shape rules: heads of 64, two query heads per KV head, F = 8d/3 rounded up to 64.
    cfg = run.model
    assert (cfg.d_model // cfg.head_dim, cfg.n_heads // cfg.n_kv_heads) == (cfg.n_heads, 2)
    assert cfg.width == math.ceil(8 * cfg.d_model / 3 / 64) * 64
    for size, width in (("142m", 2048), ("330m", 2752)):
        small = load_run_config(f"dense-{size}", []).model
        assert small.width == math.ceil(8 * small.d_model / 3 / 64) * 64 == width


@pytest.mark.parametrize(("size", "width"), [("142m", 1658), ("330m", 2233)])
def test_gdn_hybrid_width_override_matches_dense(size, width):
    dense = load_run_config(f"dense-{size}", []).model.num_params()["total"]
    matched = load_run_config(f"gdn-hybrid-{size}", [f"model.width={width}"]).model.num_params()["total"]
    assert abs(matched - dense) / dense < 0.005


# -- every backbone -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_normalized_and_nll_consistent(arch):
    model = tiny_model(arch)
    x, y = ids(), ids(seed=3)
    with torch.no_grad():
        lp = model(x)
        nll = model.nll(x, y)
    assert lp.shape == (2, T, V) and torch.isfinite(lp).all()
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, T, dtype=lp.dtype), rtol=0, atol=1e-9)
    torch.testing.assert_close(nll, -lp.gather(-1, y[..., None]).mean())


def test_moe_dropping_tokens_stays_causal():
    """Every architecture is checked for causality in test_model.py at a capacity that drops
    nothing; here a capacity that drops tokens (a position is dropped only for earlier ones)."""
    model = check_causal(arch_cases.tiny_config("moe", capacity_factor_train=1.25))
    assert any(m.last_dropped > 0 for m in model.modules() if isinstance(m, MoEFeedForward))


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_names_and_no_biases(arch):
    names = [n for n, _ in build_model(tiny(arch)).named_parameters()]
    for part in (
        "attn_norm",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_norm",
        "k_norm",
        "gate_proj",
        "up_proj",
        "down_proj",
        "mlp_norm",
    ):
        assert any(f".{part}." in n for n in names), part
    assert not [n for n in names if n.endswith(".bias")]


@pytest.mark.parametrize("arch", ARCHS)
def test_flops_per_token(arch):
    cfg = tiny(arch, d_model=64, width=96, depth=4, attention_every=4)
    d, t = cfg.d_model, 16
    attention_mix = 4 * d * (t + 1) / 2  # q·k and p·v over H·d_h = d
    dense_matmul = cfg.depth * (2 * d * d + 2 * d * 2 * 8 + 3 * d * cfg.width)  # 8 heads, 2 KV heads of 8
    dense = 3 * (2 * (dense_matmul + V * d) + int(cfg.depth * attention_mix))
    flops = flops_per_token(cfg, t)
    if arch == "dense":
        assert flops == dense
    elif arch == "moe":  # k experts of F/k: Dense's FFN, plus the router
        assert flops == dense + 3 * 2 * cfg.depth * d * cfg.n_experts
    elif arch == "attnres":
        assert flops == dense + 3 * 4 * d * sum(sources_per_mix(cfg))
    else:  # 3 GDN layers (8 heads of 8: q, k, v, g, o, a, b, convs, recurrence 6 d_k d_v) + 1 attention
        gdn = 5 * d * d + 2 * d * 8 + 4 * 3 * d
        expected = 3 * (
            2 * (dense_matmul - 3 * (2 * d * d + 2 * d * 2 * 8) + 3 * gdn + V * d)
            + int(attention_mix + 3 * 6 * 8 * 8 * 8)
        )
        assert flops == expected


TRAIN_MODELS = {
    "dense": {},
    "gdn-hybrid": {"gdn_head_dim": 16, "attention_every": 2},
    "moe": {"n_experts": 4},
    "attnres": {},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_trains_and_resumes_exactly(arch, tmp_path_factory, tmp_path):
    """The Trainer drives every backbone (the MoE loss includes its load-balancing term), and a run
    cut at a checkpoint and resumed repeats the uninterrupted run's losses."""
    data = helpers.synthetic_dataset(tmp_path_factory)
    model = {"arch": arch, "n_kv_heads": 1, **TRAIN_MODELS[arch]}
    full = train(helpers.run_config(data, tmp_path / "full", model=model, steps=8, progress=False))
    cut = helpers.run_config(data, tmp_path / "cut", model=model, steps=8, progress=False)
    trainer = Trainer(cut)
    (tmp_path / "cut").mkdir()
    manual = [trainer.train_step() for _ in range(4)]
    trainer.save()
    resumed = train(cut, resume=True)
    assert all(math.isfinite(x) for x in full.losses.values()) and full.losses[8] < full.losses[1]
    assert manual == [full.losses[s] for s in range(1, 5)]
    assert resumed.losses == {s: full.losses[s] for s in range(5, 9)}


# -- Dense: GQA with QK-norm ----------------------------------------------------------------------
def gqa_and_its_multi_head_twin() -> tuple[GroupedQueryAttention, GroupedQueryAttention]:
    """GQA with 4 query heads on 2 KV heads, and 4-head attention whose KV heads repeat its KV heads."""
    torch.manual_seed(0)
    gqa = GroupedQueryAttention(32, 4, 2, 8, 1e-6).double()
    mha = GroupedQueryAttention(32, 4, 4, 8, 1e-6).double()
    with torch.no_grad():
        for name in ("q_proj", "o_proj", "q_norm", "k_norm"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        gqa.k_norm.weight.normal_()
        mha.k_norm.weight.copy_(gqa.k_norm.weight)
        for name in ("k_proj", "v_proj"):  # query head i reads KV head i // 2
            w = getattr(gqa, name).weight.view(2, 8, 32)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(32, 32))
    return gqa, mha


def test_gqa_equals_multi_head_attention_with_shared_kv_heads():
    gqa, mha = gqa_and_its_multi_head_twin()
    h = torch.randn(2, 7, 32, dtype=torch.float64)
    rope = rope_tables(7, 8, 10000.0, h.device, dtype=h.dtype)
    torch.testing.assert_close(gqa(h, rope), mha(h, rope))


@pytest.mark.parametrize("static", [False, True])
def test_gqa_decode_step_reads_the_cache_in_place(static):
    """Decode steps (eager, and static over a full-capacity buffer) equal multi-head attention over
    the repeated KV heads, and no op of a step makes a tensor the size of the repeated cache."""
    gqa, mha = gqa_and_its_multi_head_twin()
    b, t, prefill, capacity = 2, 40, 33, 48
    h = torch.randn(b, t, 32, dtype=torch.float64)
    cos, sin = rope_tables(t, 8, 10000.0, h.device, dtype=h.dtype)
    want = mha(h, (cos, sin))
    state = LayerState(capacity)
    gqa(h[:, :prefill], (cos[:prefill], sin[:prefill]), state)
    position = torch.tensor([prefill])
    if static:
        state.position = position
    largest = 0
    for i in range(prefill, t):
        with helpers.LargestTensor() as step:
            out = gqa(h[:, i : i + 1], (cos[i : i + 1], sin[i : i + 1]), state)
        largest = max(largest, step.largest)
        torch.testing.assert_close(out, want[:, i : i + 1])
        position += 1
    repeated_cache = b * 4 * (capacity if static else t) * 8
    assert largest < repeated_cache


def test_qk_norm_makes_attention_invariant_to_query_and_key_scale():
    torch.manual_seed(0)
    attn = GroupedQueryAttention(32, 4, 2, 8, 1e-12).double()
    h = torch.randn(1, 6, 32, dtype=torch.float64)
    rope = rope_tables(6, 8, 10000.0, h.device, dtype=h.dtype)
    before = attn(h, rope)
    with torch.no_grad():
        attn.q_proj.weight.mul_(7.0)
        attn.k_proj.weight.mul_(0.1)
    torch.testing.assert_close(attn(h, rope), before)


# -- GDN hybrid -----------------------------------------------------------------------------------
def test_gdn_hybrid_layout_three_to_one():
    model = build_model(tiny("gdn-hybrid", depth=8, attention_every=4))
    mixers = [type(layer.mixer) for layer in model.backbone.layers]
    assert mixers == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, GroupedQueryAttention] * 2


def test_gdn_chunk_length_does_not_change_the_model():
    x = ids(2, 15)
    with torch.no_grad():
        a = tiny_model("gdn-hybrid", gdn_chunk=4)(x)
        b = tiny_model("gdn-hybrid", gdn_chunk=64)(x)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gdn_decode_state_is_fixed_size():
    model = tiny_model("gdn-hybrid", attention_every=0)
    cache = model.new_cache()
    x = ids(1, 16)
    with torch.no_grad():
        model(x[:, :3], cache)
        size = cache.nbytes()
        for i in range(3, 16):
            model(x[:, i : i + 1], cache)
    assert cache.nbytes() == size > 0
    assert set(cache.states[0].extra) == {"S", "conv_q", "conv_k", "conv_v"}
    assert cache.states[0].extra["S"].shape == (1, 4, 8, 8) and cache.states[0].extra["conv_q"].shape == (1, 3, 32)


# -- MoE ------------------------------------------------------------------------------------------
def moe_reference(layer: MoEFeedForward, h: torch.Tensor, factor: float) -> torch.Tensor:
    """Token by token, in order: each takes its top-k experts while they have room."""
    x = h.reshape(-1, h.shape[-1])
    n, k, e = x.shape[0], layer.top_k, layer.n_experts
    cap = max(1, math.ceil(factor * n * k / e))
    used = [0] * e
    out = torch.zeros_like(x)
    for i in range(n):
        p = layer.router(x[i]).softmax(-1)
        w, idx = p.topk(k)
        if layer.renormalize:
            w = w / w.sum()
        for weight, j in zip(w, idx.tolist(), strict=True):
            if used[j] < cap:
                used[j] += 1
                out[i] += weight * layer.experts[j](x[i])
    return out.view(h.shape)


@pytest.mark.parametrize(("factor", "renormalize"), [(0.5, True), (1.25, False), (2.0, True)])
@pytest.mark.parametrize("capacity_path", [False, True])
def test_moe_dispatch_matches_token_by_token_reference(factor, renormalize, capacity_path, monkeypatch):
    # Both dispatch paths (ops/moe_dispatch.py): sorted (eager CPU) and fixed capacity buffers
    # (torch.compile, GPUs), outputs and gradients.
    monkeypatch.setattr(tango_lm.layers.moe, "use_capacity_dispatch", lambda x: capacity_path)
    torch.manual_seed(0)
    layer = MoEFeedForward(16, 4, 2, 8, renormalize, factor).double().eval()
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    h = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    out, ref = layer(h), moe_reference(layer, h, factor)
    torch.testing.assert_close(out, ref)
    assert (layer.last_dropped > 0) == (factor == 0.5)
    grad = torch.randn_like(out)
    params = [h, *layer.parameters()]
    for a, b in zip(
        torch.autograd.grad(out, params, grad, allow_unused=True),
        torch.autograd.grad(ref, params, grad, allow_unused=True),
        strict=True,
    ):
        torch.testing.assert_close(a, b, msg=lambda m: f"gradient: {m}")


def test_moe_dropped_tokens_pass_through_the_residual():
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 2, 1, 4, renormalize=False, capacity_factor=0.25).double()
    with torch.no_grad():
        layer.router.weight.zero_()  # ties: every token picks expert 0
        out = layer(torch.randn(1, 8, 8, dtype=torch.float64))
    # capacity ceil(0.25 * 8 / 2) = 1: only the first token is served.
    assert out[0, 0].abs().sum() > 0 and out[0, 1:].abs().sum() == 0


def test_moe_aux_loss_is_alpha_for_a_uniform_router_and_reaches_the_training_loss():
    model = tiny_model("moe", aux_loss_weight=0.05)
    x, y = ids(), ids(seed=3)
    with torch.no_grad():
        for block in model.backbone.layers:
            block.mlp.router.weight.zero_()
        eval_nll = model.nll(x, y)
        model.train()
        train_loss = model.nll(x, y)
    aux = model.backbone.aux_loss()
    torch.testing.assert_close(aux, torch.tensor(0.05, dtype=aux.dtype))
    torch.testing.assert_close(train_loss - eval_nll, aux)
    model.eval()
    model(x)
    assert model.backbone.aux_loss() is None


def test_moe_sum_of_the_training_loss_over_scored_targets_is_its_mean():
    # The load-balancing term is per scored target in both reductions: ignored (-100) targets add none.
    model = tiny_model("moe", aux_loss_weight=0.5).train()
    x, y = ids(), ids(seed=3)
    y[:, ::3] = -100
    total, mean = model.nll(x, y, reduction="sum"), model.nll(x, y)
    torch.testing.assert_close(total / (y != -100).sum(), mean)


def test_moe_routes_in_fp32_under_bf16_autocast():
    # Expert choice is discrete: with the router's matmul in bf16 (only its softmax in fp32), 0.3% of
    # tokens of a 768-wide model chose other experts. Here expert 1's logit is 1.001 and expert 0's 1.0,
    # the same number in bf16.
    layer = MoEFeedForward(4, n_experts=2, top_k=1, expert_width=4, renormalize=False).train()
    layer.router.weight.data = torch.tensor([[0.25] * 4, [0.25] * 3 + [0.251]])
    x = torch.ones(6, 4)
    _, aux, _ = layer.route(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, aux_bf16, _ = layer.route(x)
    p1 = torch.tensor([1.0, 1.001]).softmax(-1)[1]  # every token takes expert 1: f = (0, 1)
    torch.testing.assert_close(aux, layer.aux_loss_weight * 2 * p1)
    torch.testing.assert_close(aux_bf16, aux, rtol=1e-6, atol=0)


def test_moe_aux_loss_gives_the_router_a_gradient():
    grads = []
    for weight in (0.0, 0.5):
        model = tiny_model("moe", aux_loss_weight=weight).train()
        model.nll(ids(), ids(seed=3)).backward()
        grads.append(model.backbone.layers[0].mlp.router.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_capacity_factor_context_and_cached_decoding_use_the_eval_factor():
    model = tiny_model("moe", capacity_factor_train=0.5, capacity_factor_eval=2.0)
    layers = [block.mlp for block in model.backbone.layers]
    x = ids(1, 12)
    with torch.no_grad():
        dropped = model(x)
        assert layers[0].last_dropped > 0
        with capacity_factor(model, "eval"):
            assert {m.capacity_factor for m in layers} == {2.0}
            full = model(x)
        assert {m.capacity_factor for m in layers} == {0.5}
        cache = model.new_cache()
        cached = torch.cat([model(x[:, :5], cache)] + [model(x[:, i : i + 1], cache) for i in range(5, 12)], 1)
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(dropped, full)


@pytest.mark.parametrize("experts, top_k", [(4, 2), (16, 2), (8, 1)])
def test_default_eval_capacity_drops_nothing_so_scores_and_decoding_ignore_batch_mates(experts, top_k):
    # capacity_factor_eval defaults to E / k: with a peaked router (as after training) the full forward
    # at the evaluation capacity equals cached decoding, and a row's scores do not depend on its batch.
    model = tiny_model("moe", n_experts=experts, moe_top_k=top_k, moe_renormalize=top_k > 1)
    assert model.config.capacity_factor_eval == experts / top_k
    with torch.no_grad():
        for block in model.backbone.layers:
            block.mlp.router.weight.mul_(30)
        x = ids(4, 12)
        with capacity_factor(model, "eval"):
            full = model(x)
            alone = model(x[:1])
        cache = model.new_cache()
        cached = torch.cat([model(x[:, :5], cache)] + [model(x[:, i : i + 1], cache) for i in range(5, 12)], 1)
    torch.testing.assert_close(alone, full[:1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cached, full, rtol=1e-10, atol=1e-10)


def test_eval_capacity_default_follows_the_experts_and_an_explicit_value_is_kept():
    assert tiny("moe", n_experts=16, moe_top_k=2).capacity_factor_eval == 8.0
    assert tiny("moe").replace(n_experts=6).capacity_factor_eval == 3.0
    assert tiny("moe", capacity_factor_eval=1.5).replace(width=40).capacity_factor_eval == 1.5
    # the presets' 8 experts, top-2: the paper's 4.0, and other archs' config.json as before
    assert ModelConfig(arch="tango", d_model=32, vocab_size=V).to_dict()["capacity_factor_eval"] == 4.0
    # the MoE presets leave it to the default: a preset wrote 4.0, which n_experts=16 kept (dropping at eval)
    for preset in ("moe-142m", "moe-330m"):
        assert load_run_config(preset, []).model.capacity_factor_eval == 4.0
        assert load_run_config(preset, ["model.n_experts=16"]).model.capacity_factor_eval == 8.0
        assert load_run_config(preset, ["model.moe_top_k=1"]).model.capacity_factor_eval == 8.0


def test_expert_width_default_follows_the_ffn_width_and_top_k():
    # The presets wrote moe_expert_width = F/k: a width or moe_top_k override changed nothing in the
    # model (its parameters, FLOPs) while params and config.json reported the new width.
    for preset, width in (("moe-142m", 2048), ("moe-330m", 2752)):
        base = load_run_config(preset, []).model
        assert base.moe_expert_width is None and base.width == width and base.moe_top_k == 2
        for override, expert in (("width=4096", 2048), ("moe_top_k=1", width)):
            cfg = load_run_config(preset, [override]).model
            grown = cfg.depth * 8 * 3 * cfg.d_model * (expert - width // 2)  # 8 SwiGLU experts a layer
            assert cfg.num_params()["total"] == base.num_params()["total"] + grown, (preset, override)
    # A config that writes its derived default (a run's config.yaml) follows too; another value is kept.
    written = {"arch": "moe", "width": 64, "moe_top_k": 2, "moe_expert_width": 32}
    assert ModelConfig.overridden(written, {"width": 128}).get("moe_expert_width") is None
    assert ModelConfig.overridden({**written, "moe_expert_width": 20}, {"width": 128})["moe_expert_width"] == 20


# -- AttnRes --------------------------------------------------------------------------------------
def test_attnres_mix_matches_definition_and_starts_uniform():
    torch.manual_seed(0)
    mix = AttnRes(16, 1e-6).double()
    values = [torch.randn(2, 5, 16, dtype=torch.float64) * s for s in (1.0, 3.0, 0.2, 7.0)]
    normed = [attnres_layers.unit_rms(v, 1e-6) for v in values]
    torch.testing.assert_close(mix(values, normed), torch.stack(values).mean(0))  # w_l = 0: uniform
    with torch.no_grad():
        mix.query.normal_()
        mix.norm.weight.normal_()
    torch.testing.assert_close(mix(values, normed), attn_res_reference(values, mix.query, mix.norm))


@pytest.mark.parametrize("block", [None, 1, 2, 5])
def test_attnres_sources_per_mix(block, monkeypatch):
    seen = []
    forward = AttnRes.forward
    monkeypatch.setattr(AttnRes, "forward", lambda self, v, n: seen.append(len(v)) or forward(self, v, n))
    cfg = tiny("attnres", depth=4, attnres_block=block)
    with torch.no_grad():
        build_model(cfg)(ids(1, 4))
    assert seen == sources_per_mix(cfg)
    expected = {None: list(range(1, 10)), 1: [1, 2, 2, 3, 3, 4, 4, 5, 5], 2: [1, 2, 2, 2, 2, 3, 3, 3, 3]}
    if block in expected:
        assert seen == expected[block]
    if block == 5:  # one block holds every layer: the embedding and the running sum
        assert seen == [1] + [2] * 8


@pytest.mark.parametrize("block", [None, 1, 2])
def test_every_attnres_mix_in_the_model_is_the_definition_over_its_sources(block, monkeypatch):
    # The sources' unit-RMS copies are made as the model adds them (embedding, completed blocks,
    # the running partial sum); each mix must weigh them as RMSNorm of the source itself would.
    # At zero queries every weight is uniform and a missed norm changed nothing the tests saw.
    errors = []
    forward = AttnRes.forward

    def checked(self, values, normed):
        out = forward(self, values, normed)
        errors.append((out - attn_res_reference(values, self.query, self.norm)).abs().max().item())
        return out

    model = tiny_model("attnres", depth=4, attnres_block=block)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("query", "norm.weight")):
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(len(name)))
    monkeypatch.setattr(AttnRes, "forward", checked)
    with torch.no_grad():
        model(ids(2, 7))
    assert len(errors) == len(sources_per_mix(model.config)) and max(errors) < 1e-10, errors


def test_attnres_starts_as_a_prenorm_residual_stream():
    """With w_l = 0 every mix is the mean of its sources, proportional to the residual sum; the
    next sublayer's pre-norm and the final norm remove the scale, so full AttnRes, Block AttnRes
    and Dense compute the same function at initialization, and differ once w_l moves."""
    x = ids()
    eps = dict(norm_eps=1e-30)  # so that the norms are exactly scale-invariant
    full, block = tiny_model("attnres", **eps), tiny_model("attnres", attnres_block=1, **eps)
    dense = tiny_model("dense", **eps)
    with torch.no_grad():
        torch.testing.assert_close(full(x), dense(x))
        torch.testing.assert_close(block(x), dense(x))
        for model in (full, block):
            for name, p in model.named_parameters():
                if name.endswith("query"):
                    p.normal_(0, 1.0, generator=torch.Generator().manual_seed(len(name)))
        assert not torch.allclose(full(x), block(x))


# -- user errors ----------------------------------------------------------------------------------
def test_a_hybrid_of_attention_alone_reads_no_gdn_field():
    # attention_every=1 makes every layer attention; a d_model below the default gdn_head_dim had been
    # refused over that unused field. The model is then Dense's.
    hybrid = tiny("gdn-hybrid", attention_every=1, gdn_head_dim=64)
    assert count_params(hybrid)["non_embedding"] == count_params(tiny("dense"))["non_embedding"]
    assert sum(p.numel() for p in build_model(hybrid).parameters()) == count_params(hybrid)["total"]


@pytest.mark.parametrize(
    ("arch", "changes", "words"),
    [
        ("moe", dict(n_experts=4, moe_top_k=5), ["moe_top_k=5 exceeds n_experts=4; lower moe_top_k"]),
        ("moe", dict(capacity_factor_train=0), ["capacity_factor_train"]),
        ("moe", dict(n_experts=0), ["n_experts"]),
        # an explicit width of 0 had been blamed on width // moe_top_k
        ("moe", dict(moe_expert_width=0), ["model.moe_expert_width=0 is below 1; give at least 1"]),
        ("moe", dict(width=1, moe_top_k=2), ["expert width 0 (width // moe_top_k) is below 1"]),
        ("dense", dict(n_kv_heads=3), ["n_heads=4", "n_kv_heads=3"]),
        ("attnres", dict(n_kv_heads=3), ["n_kv_heads=3"]),
        ("gdn-hybrid", dict(gdn_head_dim=64), ["gdn_head_dim=64", "d_model=32"]),
        ("gdn-hybrid", dict(gdn_expand_v=0.3), ["gdn_expand_v"]),
        ("gdn-hybrid", dict(gdn_backend="cuda"), ["gdn_backend"]),
        ("gdn-hybrid", dict(attention_every=-1), ["attention_every"]),
        ("gdn-hybrid", dict(attention_every=2, gdn_head_dim=64), ["gdn_head_dim=64 exceeds d_model=32"]),
        ("attnres", dict(attnres_block=-2), ["attnres_block"]),
    ],
)
def test_user_errors(arch, changes, words):
    with pytest.raises(UserError) as err:
        tiny(arch, **changes)
    for word in words:
        assert word in str(err.value)


def test_gdn_short_convolutions_are_drawn_as_the_models_linears():
    # fla's models draw every Linear and Conv1d N(0, initializer_range²); these kept PyTorch's
    # U(±0.5) at kernel 4 (std 0.29, 14x), whatever model.init_std said.
    from tango_lm.layers.gated_deltanet import ShortConvolution

    for init_std in (0.02, 0.005):
        torch.manual_seed(0)
        model = build_model(
            ModelConfig(
                arch="gdn-hybrid", d_model=64, depth=4, width=128, vocab_size=97, init_std=init_std, gdn_head_dim=16
            )
        )
        convs = [m.weight for m in model.modules() if isinstance(m, ShortConvolution)]
        assert convs
        weights = torch.cat([w.flatten() for w in convs])
        assert weights.std().item() == pytest.approx(init_std, rel=0.1)
