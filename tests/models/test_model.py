"""The public model interface (docs/design.md §1, §7): `tango_lm.build_model(ModelConfig)` for each
architecture: normalized causal log-probs, the fused NLL, the loop structure, state-dict names,
and the user errors for bad inputs."""

from __future__ import annotations

import pytest
import torch

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.heads.registry import HEADS
from tango_lm.layers.rope import rope_tables
from tango_lm.models.registry import ARCHITECTURES
from tests import arch_cases

ARCHS = ("tango", "loop-transformer", "untied-transformer")
V, T, DEPTH = 97, 12, 3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def small_config(arch: str, **changes) -> ModelConfig:
    fields = dict(arch=arch, d_model=32, head_dim=16, width=48, depth=DEPTH, vocab_size=V, context_length=16)
    fields.update(changes)
    return ModelConfig(**fields)


def small_model(arch: str, seed: int = 0, **changes) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(small_config(arch, **changes))
    # Larger weights than the 0.02 init, so positions interact visibly in the outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and not name.startswith("head."):
                p.normal_(0, 0.2)
    return model.eval()


def ids(b: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_log_probs_are_normalized_fp32(arch):
    model = small_model(arch)
    x = ids()
    with torch.no_grad():
        lp = model(x)
    assert lp.shape == (2, T, V) and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, T), rtol=0, atol=1e-5)
    assert lp.std(-1).min() > 1e-3  # not a uniform distribution


@pytest.mark.parametrize("arch", arch_cases.names())
def test_bf16_weights_run_without_autocast(arch):
    # A model cast to bf16 (transformers' dtype=torch.bfloat16 on an export, a user's .bfloat16())
    # keeps bf16 between its layers: a layer that returns fp32 fails the next bf16 Linear.
    torch.manual_seed(0)
    model = build_model(arch_cases.tiny_config(arch)).eval()
    x = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x)
        got = model.to(torch.bfloat16)(x)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()  # log-probs in fp32 as ever
    assert (got - want).abs().max() < 0.1


def check_causal(cfg: ModelConfig) -> torch.nn.Module:
    """float64, one row (an MoE's expert capacity is shared by the rows of a batch): changing the
    tokens from position t on changes no log-prob before t and does change position t; changing
    token 0 changes the last position (information flows forward)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init, so positions interact visibly
        for name, p in model.named_parameters():
            if p.dim() == 2 and not name.startswith("head."):
                p.normal_(0, 0.2)
    model = model.double().eval()
    v, t_len = cfg.vocab_size, 12
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, v, (1, t_len), generator=gen)
    with torch.no_grad():
        base = model(x)
        for t in (1, 5, t_len - 1):
            x2 = x.clone()
            x2[:, t:] = (x2[:, t:] + 1 + torch.randint(0, v - 1, x2[:, t:].shape, generator=gen)) % v
            lp = model(x2)
            torch.testing.assert_close(lp[:, :t], base[:, :t], rtol=0, atol=1e-12, msg=f"t={t}")
            assert (lp[:, t] - base[:, t]).abs().max() > 1e-6, f"t={t}: the changed token does not matter"
        x2 = x.clone()
        x2[:, 0] = (x2[:, 0] + 1) % v
        assert (model(x2)[:, -1] - base[:, -1]).abs().max() > 1e-6
    return model


@pytest.mark.parametrize("arch", arch_cases.names())
def test_an_architecture_with_routed_experts_says_its_scores_depend_on_the_batch(arch):
    """Expert capacity is per forward: reports and resumes keep eval batch sizes apart only for
    architectures that declare it (models/archs/base.py)."""
    from tango_lm.layers.moe import moe_layers

    routed = bool(moe_layers(build_model(arch_cases.tiny_config(arch))))
    assert not routed or ARCHITECTURES[arch].scores_depend_on_batch


@pytest.mark.parametrize("arch", arch_cases.names())
def test_causal(arch):
    check_causal(arch_cases.tiny_config(arch))


@pytest.mark.parametrize("arch", ARCHS)
def test_nll_is_mean_of_gathered_log_probs(arch):
    model = small_model(arch)
    x, y = ids(seed=3), ids(seed=4)
    lp = model(x)
    manual = -lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    nll = model.nll(x, y)
    assert nll.dim() == 0 and nll.dtype == torch.float32
    torch.testing.assert_close(nll, manual.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.nll(x, y, reduction="sum"), manual.sum(), rtol=1e-5, atol=1e-5)
    # Gradients of the fused path equal those of the explicit one.
    params = [p for p in model.parameters()]
    g_fused = torch.autograd.grad(nll, params)
    g_manual = torch.autograd.grad(manual.mean(), params)
    for a, b in zip(g_fused, g_manual, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_block_applications(arch):
    model = small_model(arch)
    layers = model.backbone.layers
    calls: list[int] = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda *_, i=i: calls.append(i))
    with torch.no_grad():
        model(ids())
    if arch == "untied-transformer":
        assert len(layers) == DEPTH and calls == list(range(DEPTH))
    else:
        assert len(layers) == 1 and calls == [0] * DEPTH


@pytest.mark.parametrize("arch", ["tango", "loop-transformer"])
def test_loop_depth_is_applications_of_one_block(arch):
    # Same weights, different depth: same state dict keys, different outputs; depth 3 equals
    # applying the depth-1 model's block three times by hand.
    deep, shallow = small_model(arch), small_model(arch, depth=1)
    shallow.load_state_dict(deep.state_dict())
    x = ids()
    with torch.no_grad():
        out_deep, out_shallow = deep(x), shallow(x)
        assert (out_deep - out_shallow).abs().max() > 1e-4
        h = shallow.head.embed(x)
        block = shallow.backbone.layers[0]
        rope = rope_tables(T, 16, 10000.0, h.device)
        for app in range(DEPTH):
            h = block(h, rope, app)
        manual = shallow.head.log_probs(shallow.norm(h), x)
    torch.testing.assert_close(out_deep, manual, rtol=0, atol=1e-6)


def test_rope_tables_are_exact_angles_in_at_least_fp32():
    # bf16 tables (a model cast with .to(torch.bfloat16)) rotate by angles off by up to 1%.
    for dtype, want in [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float64, torch.float64),
    ]:
        assert rope_tables(3, 8, 10000.0, torch.device("cpu"), dtype=dtype)[0].dtype == want
    cos, sin = rope_tables(1, 8, 10000.0, torch.device("cpu"), start=50_000_001)  # a float32 position rounds here
    angle = torch.tensor(50_000_001.0, dtype=torch.float64)
    assert abs(cos[0, 0].item() - angle.cos().item()) < 1e-6 and abs(sin[0, 0].item() - angle.sin().item()) < 1e-6


PROJ = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_names(arch):
    cfg = small_config(arch)
    sd = build_model(cfg).state_dict()
    assert all(k.endswith(".weight") for k in sd), "no biases anywhere (docs/design.md §1)"
    modules = {k.rsplit(".", 2)[-2] for k in sd}
    for name in modules:
        assert name in PROJ or name.endswith("norm") or "embed" in name, name
    layer_ids = {k.split("layers.")[1].split(".")[0] for k in sd if "layers." in k}
    if arch == "untied-transformer":
        assert layer_ids == {str(i) for i in range(DEPTH)}
    else:
        assert layer_ids == {"0"}
    d, f = cfg.d_model, cfg.width
    shapes = {k.rsplit(".", 2)[-2]: tuple(v.shape) for k, v in sd.items() if "layers.0." in k}
    if arch == "tango":
        assert modules & PROJ == {"q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"}  # no value projection
        assert sum(1 for n in modules if n.endswith("norm")) >= 1
        assert shapes["gate_proj"] == shapes["up_proj"] == (f, d) and shapes["down_proj"] == (d, f)
    else:
        assert modules & PROJ == PROJ
        assert shapes["v_proj"] == shapes["o_proj"] == (d, d) and shapes["down_proj"] == (d, f)
        # Two norms per block (attention and MLP), with distinct names ending in `norm`.
        norms = [k for k in sd if "layers.0." in k and k.rsplit(".", 2)[-2].endswith("norm")]
        assert len(norms) == 2
    assert shapes["q_proj"] == shapes["k_proj"] == (d, d)
    # Exactly one vocabulary table (tied input/output embedding, docs/design.md §1).
    assert [tuple(v.shape) for v in sd.values() if v.shape[0] == V] == [(V, d)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bad", [V, V + 50])
def test_token_id_outside_vocab_is_user_error(arch, bad):
    model = small_model(arch)
    x = ids()
    x[1, 4] = bad
    with pytest.raises(UserError, match="vocabulary"):
        model(x)
    with pytest.raises(UserError, match="vocabulary"):
        model.nll(x, ids())


@pytest.mark.parametrize("arch", ARCHS)
def test_ignored_targets_are_not_scored_nor_counted_in_the_mean(arch):
    # -100 marks a position not scored, as F.cross_entropy's ignore_index; the mean divided by all.
    model = small_model(arch)
    x, y = ids(seed=3), ids(seed=4)
    y[0, :5] = y[1, 7:] = -100
    manual = torch.nn.functional.nll_loss(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(model.nll(x, y), manual, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (ids(t=T - 1), r"targets of shape \(2, 11\) for input_ids of shape \(2, 12\)"),  # read misaligned
        (ids().flatten(), r"targets of shape \(24,\)"),
        (ids().clamp(max=V - 2).index_fill(1, torch.tensor([3]), V), f"target id {V} is outside"),
        (ids().index_fill(1, torch.tensor([3]), -1), "target id -1 is outside"),
    ],
)
@pytest.mark.parametrize("head", ["standard", "onona"])
def test_bad_targets_are_user_errors(head, targets, message):
    model = small_model("tango", head=head)
    with pytest.raises(UserError, match=message):
        model.nll(ids(), targets)


@pytest.mark.parametrize("arch", arch_cases.names())
def test_input_of_no_position_gives_no_log_probs_and_1d_input_is_refused(arch):
    model = build_model(arch_cases.tiny_config(arch)).eval()
    with torch.no_grad():
        assert model(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, model.config.vocab_size)
    with pytest.raises(UserError, match=r"input_ids of shape \(5,\); give a \[batch, positions\] tensor"):
        model(torch.zeros(5, dtype=torch.long))


def test_build_model_checks_a_config_changed_after_it_was_made():
    cfg = small_config("tango")
    cfg.width = 47  # not a multiple of the heads: the CPU kernels raised a ValueError deep inside
    with pytest.raises(UserError, match="model.width=47 is not a multiple of n_heads"):
        build_model(cfg)
    cfg.width, cfg.arch = 48, "nope"
    with pytest.raises(UserError, match="unknown architecture 'nope'"):
        build_model(cfg)


def test_negative_token_id_is_user_error():
    x = ids()
    x[0, 0] = -1
    with pytest.raises(UserError, match="vocabulary"):
        small_model("tango")(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_sequence_longer_than_context_is_user_error(arch):
    model = small_model(arch)
    with torch.no_grad():
        assert model(ids(t=16)).shape == (2, 16, V)  # exactly context_length is fine
    with pytest.raises(UserError, match="context_length"):
        model(ids(t=17))


def test_same_seed_same_model_and_embedding_init():
    def make():
        torch.manual_seed(5)
        return build_model(small_config("tango", d_model=64, vocab_size=300))

    a, b = make(), make()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(va, vb)
    # docs/design.md §1: the tied embedding starts as N(0, 0.02^2) (19,200 draws: std within ~2%).
    table = [v for v in a.state_dict().values() if v.shape == (300, 64)]
    assert len(table) == 1
    assert abs(table[0].std().item() - 0.02) < 0.0005 and abs(table[0].mean().item()) < 0.0005


@pytest.mark.parametrize("head", list(HEADS))
def test_every_head_starts_from_its_documented_initialization(head):
    # Tables and projections N(0, init_std^2); a token gate's w U(-1/sqrt(d), 1/sqrt(d)) (seed 001's
    # code, gate logits of std ~ 1/sqrt(3)). A 10x std on MoS's or the untied table, or a gate 16x
    # narrower (every gate ~1/2 from the start), had changed every run's start with no test failing.
    d, init_std = 256, 0.02
    torch.manual_seed(0)
    model = build_model(small_config("tango", head=head, d_model=d, vocab_size=300, init_std=init_std))
    for name, p in model.head.named_parameters():
        if p.dim() == 2:
            assert abs(p.std().item() / init_std - 1) < 0.1 and abs(p.mean().item()) < 0.1 * init_std, name
        else:
            bound = d**-0.5
            assert p.abs().max().item() <= bound and abs(p.std().item() / (bound / 3**0.5) - 1) < 0.15, name


@pytest.mark.parametrize("arch", ["gau", "flash"])
def test_gau_offsets_and_relative_bias_start_as_documented(arch):
    # design.md §2.7: gamma ~ N(0, init_std^2), beta = 0, the relative position bias 0.
    torch.manual_seed(0)
    model = build_model(small_config(arch, d_model=64, init_std=0.02, qk_dim=64, context_length=64))
    for name, p in model.named_parameters():
        if name.endswith((".beta", ".rel_bias")):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith(".gamma"):
            assert abs(p.std().item() / 0.02 - 1) < 0.25, (name, p.std().item())


def test_sequence_longer_than_context_checked_off_cpu():
    with torch.device("meta"):
        model = build_model(small_config("tango"))
        too_long = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(UserError, match="context_length"):
        model(too_long)


def test_every_head_gets_the_same_initial_body_under_one_seed():
    """The onóna protocol compares heads on identical bodies: the body is drawn before the head."""
    bodies = []
    for head in ("standard", "onona", "mos", "untied"):
        torch.manual_seed(3)
        model = build_model(
            ModelConfig(
                arch="tango", head=head, d_model=32, head_dim=8, width=48, depth=2, vocab_size=40, context_length=16
            )
        )
        bodies.append({k: v for k, v in model.state_dict().items() if not k.startswith("head.")})
    for other in bodies[1:]:
        assert all(torch.equal(bodies[0][k], other[k]) for k in bodies[0])


def test_build_model_holds_its_own_checked_copy_of_the_config():
    # A field set after the config was checked kept its derived head count (1 head of 64 for 2 of
    # 32), and a change to the caller's object changed the built model's config too.
    cfg = ModelConfig(arch="loop-transformer", d_model=32, width=64, depth=1, vocab_size=50, context_length=16)
    model = build_model(cfg)
    assert model.config == cfg and model.config is not cfg
    cfg.d_model = 64
    assert model.config.d_model == 32
    with pytest.raises(UserError, match="model.n_heads=1 heads of head_dim=32 are 32 channels, not d_model=64"):
        build_model(cfg)
    assert build_model(cfg.replace(d_model=64)).config.n_heads == 2
    with pytest.raises(UserError, match="build_model takes a ModelConfig"):
        build_model({"arch": "tango"})


def test_token_ids_that_are_not_an_integer_tensor_are_user_errors():
    # a list raised AttributeError ('list' object has no attribute 'dim'); floats and bools a deep
    # embedding or gather error
    model = build_model(
        ModelConfig(arch="loop-transformer", d_model=32, width=64, depth=1, vocab_size=50, context_length=16)
    )
    ids = torch.randint(0, 50, (2, 5))
    with pytest.raises(UserError, match="input_ids must be a torch tensor of token ids \\(got a list\\)"):
        model([[1, 2, 3]])
    # uint8 and int16 ids raised deep in nn.Embedding, which takes int64 and int32 only
    for bad in (ids.float(), ids.bool(), ids.to(torch.uint8), ids.to(torch.int16)):
        with pytest.raises(UserError, match="input_ids must hold int64 or int32 token ids"):
            model(bad)
    with pytest.raises(UserError, match="targets must hold int64 or int32 token ids \\(got torch.float32\\)"):
        model.nll(ids, ids.float())
    assert torch.isfinite(model.nll(ids, ids))
    assert torch.equal(model.nll(ids.int(), ids.int()), model.nll(ids, ids))


def test_a_decode_cache_capacity_is_a_positive_number_of_positions():
    # 0 had silently meant the context length and -1 failed at the first forward with a
    # negative-dimension error
    model = build_model(ModelConfig(arch="tango", d_model=32, depth=1, vocab_size=50, context_length=16))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(UserError, match="a decode cache's capacity is a number of positions >= 1"):
            model.new_cache(bad)
    assert model.new_cache().capacity == 16 and model.new_cache(3).capacity == 3


def test_an_moe_model_in_eval_mode_routes_at_its_training_capacity_unless_asked():
    # What the README says of scoring an MoE model from Python: eval mode alone keeps the training
    # capacity (the protocol's dev and test NLL); capacity_factor(model, "eval") drops no token.
    from tango_lm.layers.moe import capacity_factor

    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="moe", d_model=32, width=64, depth=1, vocab_size=50, context_length=16,
        n_experts=4, moe_top_k=2, capacity_factor_train=0.5,
    )  # fmt: skip
    model = build_model(cfg).eval()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = model(ids[:1])[0]
        beside = model(ids)[0]  # row 0 with a batch mate: the capacity is per forward
        with capacity_factor(model, "eval"):
            dropless = [model(ids[:1])[0], model(ids)[0]]
    assert not torch.allclose(alone, beside)
    torch.testing.assert_close(dropless[0], dropless[1])
