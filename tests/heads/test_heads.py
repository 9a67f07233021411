"""Output heads (docs/design.md §3, seed 001): every head on the model interface (normalized fp32 log-probs,
NLL through the fused path, parameter formulas), onóna's containment of Standard, the Appendix A
rank example, its gradient paths, the one-table ablations, one-projection sampling, and the
factorial cells and input-gate control."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.heads.onona import OnonaHead, twin_log_probs
from tango_lm.heads.registry import HEADS
from tango_lm.models.params import count_params

V, T = 97, 12
ARCHS = ("tango", "loop-transformer")
TABLES = {"embed_tokens", "lm_head", "table_a", "table_b"}


def small_config(arch: str, head: str, **changes) -> ModelConfig:
    fields = dict(arch=arch, head=head, d_model=32, head_dim=16, width=48, depth=2, vocab_size=V, context_length=16)
    fields.update(changes)
    return ModelConfig(**fields)


def small_model(arch: str, head: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(small_config(arch, head)).to(dtype)
    with torch.no_grad():  # larger weights than the 0.02 init, so the outputs are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if name.startswith("head.") else 0.2)
    return model.eval()


def ids(b: int = 2, t: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def spec_extra_over_standard(v: int, d: int, k: int = 2) -> dict[str, int]:
    """docs/design.md §3, written out: parameters each head of the papers adds to the Standard model."""
    return {
        "standard": 0,
        "untied": v * d,
        "onona": v * d + d,
        "mos": k * d * d + k * d,
        "sigsoftmax": 0,
        "moss": k * d * d + k * d,
        "input-gate": v * d + d,
        "factorial-a-a": 0,
        "factorial-a-mix": v * d + d,
        "factorial-m-a": v * d,
        "factorial-m-mix": v * d + d,
    }


PAPER_HEADS = sorted(spec_extra_over_standard(1, 1))


def test_every_head_of_the_papers_is_registered():
    assert set(PAPER_HEADS) <= set(HEADS)


# -- every head on the model interface ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_log_probs_normalized_and_nll_is_gathered_mean(arch, head):
    model = small_model(arch, head)
    x, y = ids(seed=3), ids(seed=4)
    lp = model(x)
    assert lp.shape == (2, T, V) and lp.dtype == torch.float32
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(2, T), rtol=0, atol=1e-5)
    manual = -lp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    nll = model.nll(x, y)
    assert nll.dim() == 0 and nll.dtype == torch.float32
    torch.testing.assert_close(nll, manual.mean(), rtol=1e-5, atol=1e-6)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(nll, params), torch.autograd.grad(manual.mean(), params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The chunk size is a speed/memory knob only.
    model.head.loss_chunk = 5
    torch.testing.assert_close(model.nll(x, y), nll, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", sorted(HEADS))
def test_counts_equal_numel(arch, head):
    """Every registered head: the counts equal the module's, vocabulary tables as 'embedding'."""
    cfg = small_config(arch, head)
    model = build_model(cfg)
    counts = count_params(cfg)
    named = dict(model.named_parameters())
    # A vocabulary table is any head matrix with a side of the vocabulary's size, whatever its name.
    table = sum(p.numel() for n, p in named.items() if n.startswith("head.") and p.dim() == 2 and V in p.shape)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == table
    assert counts["non_embedding"] == counts["total"] - table
    assert not any(n.endswith("bias") for n in named), "no biases (docs/design.md §1, seed 001 Appendix B)"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", PAPER_HEADS)
def test_param_formula_equals_numel(arch, head):
    cfg, std_cfg = small_config(arch, head), small_config(arch, "standard")
    assert count_params(cfg)["total"] - count_params(std_cfg)["total"] == spec_extra_over_standard(V, 32)[head]
    v, d = V, 32
    projections = 2 if head in ("onona", "mos", "moss", "factorial-a-mix", "factorial-m-mix") else 1
    gate = d if head in ("onona", "input-gate", "factorial-a-mix", "factorial-m-mix") else 0
    mos = 2 * d * d + 2 * d if head in ("mos", "moss") else 0
    assert HEADS[head].matmul_params_per_token(cfg) == projections * v * d + gate + mos
    assert HEADS[head].vocab_projections == projections


# -- onóna containment: A = B = E reproduces Standard for every gate value -------------------------
@pytest.mark.parametrize("head", ["onona", "factorial-a-mix", "factorial-m-a", "factorial-a-a", "input-gate", "untied"])
def test_equal_tables_reproduce_standard(head):
    std = small_model("tango", "standard", dtype=torch.float64)
    model = small_model("tango", head, seed=1, dtype=torch.float64)
    e = std.head.embed_tokens.weight
    with torch.no_grad():
        body = {n: p for n, p in std.named_parameters() if not n.startswith("head.")}
        for n, p in model.named_parameters():
            if n in body:
                p.copy_(body[n])
            elif n.split(".")[1] in TABLES:
                p.copy_(e)
    x, y = ids(seed=5), ids(seed=6)
    with torch.no_grad():
        want, want_nll = std(x), std.nll(x, y)
    gate = getattr(model.head, "gate", None)
    w = torch.randn(32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for scale in (0.0, 1.0, 4.0, 40.0):  # g = 1/2 everywhere, then spread, then saturated gates
        if gate is not None:
            with torch.no_grad():
                gate.weight.copy_(scale * w)
            z = gate(model.head.embed(x))
            if scale >= 1:
                assert z.min() < -1 and z.max() > 1  # the gates take several values
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=0, atol=1e-10)
            torch.testing.assert_close(model.nll(x, y), want_nll, rtol=1e-12, atol=1e-12)
        if gate is None:
            break


# -- Appendix A -------------------------------------------------------------------------------------
APPENDIX_P = torch.tensor([[10, 13, 19], [14, 14, 14], [19, 13, 10]], dtype=torch.float64) / 42


def appendix_a() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64)
    b = torch.zeros(3, 1, dtype=torch.float64)
    h = torch.tensor([[2.0], [1.0], [0.5]], dtype=torch.float64).log()
    return a, b, h


def test_appendix_a_function():
    a, b, h = appendix_a()
    lp = twin_log_probs(h, a, b, torch.zeros(3, dtype=torch.float64))  # z = 0: g = 1/2
    torch.testing.assert_close(lp.exp(), APPENDIX_P, rtol=0, atol=1e-14)
    assert torch.linalg.matrix_rank(lp).item() == 3  # > d + 1 = 2
    u, aa, bb, cc = (torch.tensor(v, dtype=torch.float64).log() for v in (1 / 3, 10 / 42, 13 / 42, 19 / 42))
    torch.testing.assert_close(torch.linalg.det(lp), u * (aa - cc) * (aa + cc - 2 * bb), rtol=1e-10, atol=0)
    # A single softmax over the same hidden states stays within the d + 1 bound.
    single = torch.log_softmax(h @ a.T, -1)
    assert torch.linalg.matrix_rank(single).item() <= 2


def test_appendix_a_module_with_zero_gate():
    cfg = SimpleNamespace(vocab_size=3, d_model=1, init_std=0.02, norm_eps=1e-6)
    head = OnonaHead(cfg).double()
    a, b, h = appendix_a()
    with torch.no_grad():
        head.table_a.weight.copy_(a)
        head.table_b.weight.copy_(b)
    head.gate.reset_parameters("zeros")  # w = 0 gives g = sigma(0) = 1/2 for every token
    x = torch.tensor([0, 1, 2])
    lp = head.log_probs(h, x)
    torch.testing.assert_close(lp.exp(), APPENDIX_P, rtol=0, atol=1e-14)
    assert torch.linalg.matrix_rank(lp).item() == 3
    y = torch.tensor([2, 0, 1])
    torch.testing.assert_close(head.nll(h, x, y), -APPENDIX_P[[0, 1, 2], y].log().sum(), rtol=1e-12, atol=0)


# -- gradient paths (Appendix B) --------------------------------------------------------------------
def test_gradients_reach_tables_through_input_gate_and_head():
    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=11, d_model=6, init_std=0.5, norm_eps=1e-6)
    head = OnonaHead(cfg).double()
    proj = torch.randn(6, 6, dtype=torch.float64)  # a toy body: h = tanh(x0 W)
    x = torch.randint(0, 11, (3, 5))
    y = torch.randint(0, 11, (3, 5))
    A, B = head.table_a.weight, head.table_b.weight

    def grads(loss):
        return torch.autograd.grad(loss, [A, B], allow_unused=True, retain_graph=True)

    x0 = head.embed(x)
    h = torch.tanh(x0 @ proj)
    z = head.gate_logit(x)
    total = grads(head.nll(h, x, y))

    def loss(hh, a, b, zz):
        return -twin_log_probs(hh, a, b, zz).gather(-1, y.unsqueeze(-1)).sum()

    via_input = grads(loss(h, A.detach(), B.detach(), z.detach()))
    via_gate = grads(loss(h.detach(), A.detach(), B.detach(), z))
    via_head = grads(loss(h.detach(), A, B, z.detach()))
    for path in (via_input, via_gate, via_head):
        assert all(g is not None and g.abs().max() > 1e-6 for g in path)
    # Input and gate read M = (A + B)/2: half of M's gradient each; the head's are the tables' own.
    torch.testing.assert_close(via_input[0], via_input[1], rtol=0, atol=0)
    torch.testing.assert_close(via_gate[0], via_gate[1], rtol=0, atol=0)
    assert (via_head[0] - via_head[1]).abs().max() > 1e-3
    x0_grad = torch.autograd.grad(loss(torch.tanh(x0 @ proj), A.detach(), B.detach(), z.detach()), x0)[0]
    by_row = torch.zeros_like(A).index_add_(0, x.reshape(-1), x0_grad.reshape(-1, 6))
    torch.testing.assert_close(via_input[0], 0.5 * by_row, rtol=1e-12, atol=1e-14)
    for i in range(2):
        torch.testing.assert_close(total[i], via_input[i] + via_gate[i] + via_head[i], rtol=1e-10, atol=1e-12)
    # The gate weight learns too.
    assert torch.autograd.grad(head.nll(h.detach(), x, y), head.gate.weight)[0].abs().max() > 1e-6


# -- onóna extras: ablations and one-projection sampling -------------------------------------------
@pytest.mark.parametrize("which", ["a", "b"])
def test_one_table_ablation(which):
    model = small_model("tango", "onona", dtype=torch.float64)
    table = getattr(model.head, f"table_{which}").weight
    x, y = ids(), ids(seed=2)
    model.head.ablation = which
    torch.testing.assert_close(model.head.embed(x), table[x], rtol=0, atol=0)
    lp = model(x)
    h = model.hidden(x)
    torch.testing.assert_close(lp, torch.log_softmax(h @ table.T, -1), rtol=0, atol=1e-12)
    torch.testing.assert_close(model.nll(x, y), -lp.gather(-1, y.unsqueeze(-1)).mean(), rtol=1e-12, atol=0)
    model.head.ablation = None
    assert (model(x) - lp).abs().max() > 1e-3


@pytest.mark.parametrize("head", sorted(HEADS))
def test_a_head_declares_what_it_offers_beyond_the_interface(head):
    """generate, serve, eval --ablate and bench ask the head's flags: a sampler or twin tables a
    head has but does not declare would be silently skipped, a flag without them would crash."""
    cls = HEADS[head]
    samplers = {name for name in ("sample", "sample_static") if hasattr(cls, name)}
    assert samplers == ({"sample", "sample_static"} if cls.one_projection_sampling else set())
    assert hasattr(cls, "ablation") == cls.twin_tables
    model = small_model("loop-transformer", head)
    with model.head.serving():  # every head can be served; outside it, no fold is kept
        assert isinstance(model.head.serving_tensors(), tuple)
    assert model.head.serving_tensors() == ()


def test_one_projection_sampling_matches_the_mixture():
    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=6, d_model=4, init_std=0.6, norm_eps=1e-6)
    head = OnonaHead(cfg)
    with torch.no_grad():
        head.gate.weight.mul_(3)
    n = 40_000
    for token in (0, 3):
        h = torch.randn(1, 4, generator=torch.Generator().manual_seed(token)).expand(n, 4)
        x = torch.full((n,), token)
        samples = head.sample(h, x, generator=torch.Generator().manual_seed(1))
        freq = torch.bincount(samples, minlength=6).double() / n
        p = twin_log_probs(h[:1], head.table_a.weight, head.table_b.weight, head.gate_logit(x[:1])).exp()[0].double()
        sigma = (p * (1 - p) / n).sqrt()
        assert ((freq - p).abs() < 5 * sigma).all(), (freq, p)
        chi2 = ((freq - p) ** 2 / p).sum() * n  # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
        assert chi2 < 20.5


def test_sampling_below_a_padded_vocabulary_is_the_renormalized_mixture_at_a_bounded_cost(monkeypatch):
    # Rows that drew a padding id redrew until none did: a round per rejection, so a model that gives
    # the padding 99% of its mass (untrained, or trained on a smaller vocabulary) took 100 rounds a token.
    import tango_lm.heads.onona as onona

    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=6, d_model=4, init_std=0.6, norm_eps=1e-6)
    head = OnonaHead(cfg)
    n, tokenizer_ids = 40_000, 3
    h = torch.randn(1, 4, generator=torch.Generator().manual_seed(5)).expand(n, 4)
    with torch.no_grad():  # the padding rows (3, 4, 5) take about 90% of both components
        for table in (head.table_a.weight, head.table_b.weight):
            table[tokenizer_ids:] = h[0] / h[0].norm() * 4
    x = torch.full((n,), 2)
    p = twin_log_probs(h[:1], head.table_a.weight, head.table_b.weight, head.gate_logit(x[:1])).exp()[0].double()
    assert p[tokenizer_ids:].sum() > 0.85
    p = p[:tokenizer_ids] / p[:tokenizer_ids].sum()
    projections = []
    real = onona.float_logits
    monkeypatch.setattr(onona, "float_logits", lambda h, w: projections.append(h.shape[0]) or real(h, w))
    samples = head.sample(h, x, generator=torch.Generator().manual_seed(1), vocab_size=tokenizer_ids)
    assert len(projections) == 4  # A's rows and B's rows, then both tables for the rows that drew padding
    freq = torch.bincount(samples, minlength=6).double() / n
    assert (freq[tokenizer_ids:] == 0).all()
    assert ((freq[:tokenizer_ids] - p).abs() < 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)


@pytest.mark.parametrize("table", ["a", "b"])
def test_one_projection_sampling_under_a_one_table_ablation_draws_from_that_table(table):
    # The ablation is that table at input and output, without the gate: its samples too.
    torch.manual_seed(0)
    cfg = SimpleNamespace(vocab_size=6, d_model=4, init_std=0.6, norm_eps=1e-6)
    head = OnonaHead(cfg)
    head.ablation = table
    n = 40_000
    h = torch.randn(1, 4, generator=torch.Generator().manual_seed(2)).expand(n, 4)
    x = torch.full((n,), 3)
    samples = head.sample(h, x, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(samples, minlength=6).double() / n
    p = head.log_probs(h[:1], x[:1]).exp()[0].double()
    assert ((freq - p).abs() < 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)
    noise = torch.rand(n, 7, generator=torch.Generator().manual_seed(3))
    with head.serving():
        static = head.sample_static(h, x, noise)
    freq = torch.bincount(static, minlength=6).double() / n
    assert ((freq - p).abs() < 5 * (p * (1 - p) / n).sqrt()).all(), (freq, p)


def test_cached_decoding_reproduces_full_forward():
    model = small_model("tango", "onona", dtype=torch.float64)
    x = ids(t=14)
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :5], cache)] + [model(x[:, i : i + 1], cache) for i in range(5, 14)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)


# -- factorial cells and the input-gate control ----------------------------------------------------
FACTORIAL = {
    "factorial-a-a": ({"table_a"}, "a"),
    "factorial-a-mix": ({"table_a", "table_b", "gate"}, "a"),
    "factorial-m-a": ({"table_a", "table_b"}, "m"),
    "factorial-m-mix": ({"table_a", "table_b", "gate"}, "m"),
}


def test_factorial_cells_share_table_a_and_drop_unused_parameters():
    cfg = small_config("tango", "onona")
    torch.manual_seed(3)
    onona = HEADS["onona"](cfg)
    torch.manual_seed(3)
    standard = HEADS["standard"](cfg)
    torch.testing.assert_close(onona.table_a.weight, standard.embed_tokens.weight, rtol=0, atol=0)
    x = ids()
    for name, (modules, input_rows) in FACTORIAL.items():
        torch.manual_seed(3)
        cell = HEADS[name](cfg)
        assert {n.split(".")[0] for n, _ in cell.named_parameters()} == modules, name
        torch.testing.assert_close(cell.table_a.weight, onona.table_a.weight, rtol=0, atol=0)
        a = cell.table_a.weight
        x0 = a[x] if input_rows == "a" else 0.5 * (a[x] + onona.table_b.weight[x])
        torch.testing.assert_close(cell.embed(x), x0, rtol=0, atol=0)
        if "gate" in modules:  # a mixture cell gates on rmsnorm of its own input vector
            torch.testing.assert_close(cell.gate_logit(x), cell.gate(x0), rtol=0, atol=0)
            torch.testing.assert_close(cell.gate.weight, onona.gate.weight, rtol=0, atol=0)


def test_input_gate_rows_and_merged_head():
    model = small_model("tango", "input-gate", dtype=torch.float64)
    head = model.head
    A, B = head.table_a.weight, head.table_b.weight
    x = ids()
    g = torch.sigmoid(head.gate(0.5 * (A + B)))  # per vocabulary entry
    want = g[x].unsqueeze(-1) * A[x] + (1 - g[x]).unsqueeze(-1) * B[x]
    torch.testing.assert_close(head.embed(x), want, rtol=0, atol=1e-14)
    h = model.hidden(x)
    torch.testing.assert_close(model(x), torch.log_softmax(h @ (0.5 * (A + B)).T, -1), rtol=0, atol=1e-12)


def test_mos_components_and_prior():
    model = small_model("tango", "mos", dtype=torch.float64)
    head = model.head
    assert tuple(head.latent_proj.weight.shape) == (64, 32) and tuple(head.prior_proj.weight.shape) == (2, 32)
    x = ids()
    h = model.hidden(x)
    e = head.embed_tokens.weight
    pi = torch.softmax(h @ head.prior_proj.weight.T, -1)
    w1, w2 = head.latent_proj.weight[:32], head.latent_proj.weight[32:]
    p = pi[..., :1] * torch.softmax(torch.tanh(h @ w1.T) @ e.T, -1) + pi[..., 1:] * torch.softmax(
        torch.tanh(h @ w2.T) @ e.T, -1
    )
    torch.testing.assert_close(model(x), p.log(), rtol=0, atol=1e-12)


def test_sigsoftmax_definition():
    model = small_model("tango", "sigsoftmax", dtype=torch.float64)
    x = ids()
    z = model.hidden(x) @ model.head.embed_tokens.weight.T
    p = z.exp() * torch.sigmoid(z)
    torch.testing.assert_close(model(x), (p / p.sum(-1, keepdim=True)).log(), rtol=0, atol=1e-12)


def test_eval_ablate_cli(tmp_path, capsys):
    """`tango-lm eval --ablate A|B` scores one table of a trained twin checkpoint; other heads refuse."""
    import json

    from tango_lm.cli import main
    from tango_lm.data.shards import write_prepared
    from tango_lm.data.tokenizers import get_tokenizer
    from tango_lm.eval.evaluate import evaluate_checkpoint
    from tango_lm.train.config import load_run_config
    from tango_lm.train.trainer import train

    docs = [f"{i} + {i} = {2 * i}" for i in range(300)]
    data = write_prepared(
        tmp_path / "d",
        get_tokenizer("byte"),
        {"train": docs, "dev": docs[:40], "test": docs[40:80]},
        {"name": "t"},
        progress=False,
    )
    runs = {}
    for head in ("onona", "standard"):
        run = load_run_config(
            None,
            [
                f"model.head={head}",
                "model.arch=tango",
                "model.d_model=32",
                "model.head_dim=16",
                "model.width=32",
                "model.depth=2",
                "model.vocab_size=257",
                "model.context_length=32",
                f"data.dir={data}",
                f"train.out_dir={tmp_path / head}",
                "train.steps=3",
                "train.eval_every=3",
                "train.save_every=3",
                "train.batch_size=2",
                "train.progress=false",
                "train.warmup_steps=0",
            ],
        )
        train(run)
        runs[head] = tmp_path / head
    full = evaluate_checkpoint(str(runs["onona"]), "dev")["nll"]
    a = evaluate_checkpoint(str(runs["onona"]), "dev", ablate="A")["nll"]
    b = evaluate_checkpoint(str(runs["onona"]), "dev", ablate="B")["nll"]
    assert len({round(full, 9), round(a, 9), round(b, 9)}) == 3
    assert main(["eval", str(runs["onona"]), "--split", "dev", "--ablate", "B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nll"] == pytest.approx(b)
    assert main(["eval", str(runs["standard"]), "--split", "dev", "--ablate", "A"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "onóna's twin mixture" in err[0]
