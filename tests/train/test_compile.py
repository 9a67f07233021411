"""`torch.compile` (inductor, CPU) of `model.nll`: the same loss and gradients as eager, in one
graph (`fullgraph=True`, so a graph break, e.g. around the fused loss's autograd Function, fails).
Every architecture (each with one of the heads, so every head is covered) traces into one graph
(`torch._dynamo.explain`), and training steps with fresh batches never recompile (Dynamo's
counters): `train.compile=true` compiles once.

TANGO and windowed TANGO run their plain compositions under compile (`tango_mix`, `windowed_mix`):
inductor fuses them itself and cannot compile the eager fused CPU ops. The twin head passes its hidden state to the fused loss as
two components; the loss takes each distinct tensor once, which Dynamo needs to trace it."""

from __future__ import annotations

import shutil

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tests import arch_cases

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="torch.compile's inductor backend needs a C++ compiler on CPU (no c++ or g++ found)",
)

BASE = dict(d_model=32, head_dim=8, width=64, depth=2, vocab_size=61, context_length=16)
CASES = {
    # Inductor's code generation itself, on TANGO's looped block (two applications) with the twin
    # head, and on windowed TANGO (one application; its looped block runs under aot_eager below).
    "tango-onona": {"arch": "tango", "head": "onona"},
    "tango-windowed": {"arch": "tango-windowed", "window": 3, "depth": 1},
    # The rest through AOTAutograd without inductor's code generation ("aot_eager"): the graph and
    # its backward are what is ours to test, and inductor takes ~20 s per case on a 2-core CPU
    # (the GDN layer ~90 s). The baseline; paths whose eager GPU form is poor: GAU's and FLASH's
    # relu² attention, MoE's capacity dispatch, AttnRes and the delta rule (one to three layers each).
    "loop-transformer": {"arch": "loop-transformer"},
    # Windowed TANGO's looped block with both feature maps (ELU's backward once failed here).
    "tango-windowed-looped": {"arch": "tango-windowed", "window": 3},
    "tango-windowed-relu": {"arch": "tango-windowed", "window": 3, "feature_map": "relu"},
    "gau": {"arch": "gau", "qk_dim": 8, "depth": 1},
    "flash": {"arch": "flash", "qk_dim": 8, "group_size": 4, "depth": 1},
    "moe": {"arch": "moe", "n_experts": 4, "moe_expert_width": 16, "depth": 1},
    # Attention over depth: full AttnRes, and Block AttnRes with blocks of one layer.
    "attnres": {"arch": "attnres", "n_kv_heads": 2},
    "attnres-block": {"arch": "attnres", "n_kv_heads": 2, "depth": 3, "attnres_block": 1},
    # The delta rule: one GDN layer and one attention layer, 16 positions in chunks of 5 (a remainder of 1).
    "gdn-hybrid": {
        "arch": "gdn-hybrid",
        "n_kv_heads": 2,
        "depth": 2,
        "attention_every": 2,
        "gdn_head_dim": 8,
        "gdn_chunk": 5,
    },
}
INDUCTOR = ("tango-onona", "tango-windowed")
# AttnRes starts as a uniform average (zero queries), where the queries' and key norms' gradients
# vanish: random queries make every one count, except those of the first mix, which has one source.
RANDOM_QUERIES = ("attnres", "attnres-block")
ONE_SOURCE = "backbone.layers.0.attn_res."


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def loss_and_grads(fn, model, x, y):
    model.zero_grad(set_to_none=True)
    loss = fn(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_nll_matches_eager(case):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**{**BASE, **CASES[case]})).train()
    if case in RANDOM_QUERIES:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".query"):
                    p.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 61, (2, 16), generator=gen) for _ in range(2))
    loss, grads = loss_and_grads(model.nll, model, x, y)
    compiled = torch.compile(
        model.nll, dynamic=False, fullgraph=True, backend="inductor" if case in INDUCTOR else "aot_eager"
    )
    loss_c, grads_c = loss_and_grads(compiled, model, x, y)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        if not (case in RANDOM_QUERIES and name.startswith(ONE_SOURCE)):
            assert grad.abs().sum() > 0, name  # every parameter (both tables, the gate) is trained
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _pairs(archs: list[str], heads: list[str]) -> list[tuple[str, str]]:
    """Every architecture and every head at least once, in as few (arch, head) models as that takes."""
    return [(archs[i % len(archs)], heads[i % len(heads)]) for i in range(max(len(archs), len(heads)))]


# Every architecture at its tiny size (tests/arch_cases.py) with a head, so that every head is traced too.
ARCH_HEAD = _pairs(arch_cases.names(), sorted(HEADS))


def tiny(arch: str, head: str = "standard") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(arch_cases.tiny_config(arch, head=head)).train()


def test_every_architecture_and_head_is_traced():
    assert {a for a, _ in ARCH_HEAD} == set(ARCHITECTURES) and {h for _, h in ARCH_HEAD} == set(HEADS)
    more_heads = _pairs(["a", "b"], ["x", "y", "z"])  # more heads than architectures: none left out
    assert {a for a, _ in more_heads} == {"a", "b"} and {h for _, h in more_heads} == {"x", "y", "z"}


@pytest.mark.parametrize(("arch", "head"), ARCH_HEAD)
def test_training_forward_is_one_graph(arch, head):
    model = tiny(arch, head)
    x, y = (torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    explained = torch._dynamo.explain(model.nll)(x, y)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.parametrize("arch", arch_cases.names())
def test_training_forward_with_activation_checkpointing_is_one_graph(arch):
    # A side effect inside the recomputed region (MoE stored its load-balancing loss on the module)
    # breaks the graph at every block.
    model = tiny(arch)
    model.set_activation_checkpointing(True)
    x, y = (torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    explained = torch._dynamo.explain(model.nll)(x, y)
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


@pytest.mark.parametrize(
    ("arch", "head"),
    [("loop-transformer", "onona"), ("moe", "mos"), ("gdn-hybrid", "standard"), ("attnres", "standard")],
)
def test_training_steps_do_not_recompile(arch, head):
    # Fresh batches and updated weights every step, as in the trainer; the backend does not matter
    # to Dynamo's guards, so the cheap one runs. (torch 2.11 recompiled the loss every step when
    # it compared tensors by identity.)
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny(arch, head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(model.nll, backend="eager")
    graphs = []
    for i in range(4):
        x, y = (torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(10 * i + s)) for s in (1, 2))
        step(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 1], graphs
    assert not counters["recompiles"] and not counters["graph_break"], (counters["recompiles"], counters["graph_break"])


def test_rotating_width_compiles_one_graph_per_segment_past_dynamos_limit():
    # 12 columns a head in segments of 1: 12 graphs, each segment's columns constants of its own.
    # Dynamo's recompile limit (8) would run the segments past the eighth eagerly.
    from torch._dynamo.utils import counters

    from tango_lm.train.compiled_forward import CompiledForward

    counters.clear()
    torch.manual_seed(0)
    model = build_model(arch_cases.tiny_config("tango", active_width=1, depth=1)).train()
    segments = model.num_segments
    assert segments == 12 > torch._dynamo.config.recompile_limit
    step = CompiledForward(model.nll, backend="eager", graphs=segments)
    x, y = (torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    for segment in range(segments):
        model.set_active_segment(segment)
        eager = model.nll(x, y)
        torch.testing.assert_close(step(x, y), eager)
    assert counters["stats"]["unique_graphs"] == segments and not step.failed
