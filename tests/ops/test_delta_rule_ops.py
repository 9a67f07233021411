"""The custom ops that keep fla's gated-delta-rule kernels inside a compiled graph (ops/delta_rule_fla.py),
on CPU: fla's kernels cannot run here, so the chunked PyTorch form stands in for them behind the same
ops (`fla_kernel_or_reason`, the one lookup, returns `CHUNKED`). Checked: `torch.library.opcheck`
(schema, fakes, autograd, AOT dispatch), the wrapper against the chunked form (outputs and gradients),
a GDN-hybrid model compiled with `fullgraph=True` through the ops against eager (loss and every
gradient), no graph break, no recompiles over 3 steps, `auto`'s fallback from a failing kernel and
`fla`'s one-line errors. The real fla through the same ops: tests/ops/test_delta_rule_fla.py (cuda)."""

from __future__ import annotations

import pytest
import torch

from tango_lm import ModelConfig, build_model
from tango_lm.errors import UserError
from tango_lm.ops import delta_rule, delta_rule_fla
from tango_lm.ops.delta_rule import delta_rule_chunked, gated_delta_rule
from tests.ops.test_delta_rule import inputs, rel_err


@pytest.fixture
def stand_in(monkeypatch):
    """The chunked form behind the ops, and `auto` / `fla` routed to them on CPU as on CUDA."""
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: delta_rule_fla.CHUNKED)
    monkeypatch.setattr(delta_rule, "wants_fla", lambda backend, on_cuda: backend != "torch")
    torch._dynamo.reset()  # `fla_available` is a constant of any graph traced before
    yield
    torch._dynamo.reset()


def fla_layout(t: int, state: bool, seed: int = 0):
    q, k, v, beta, g, s0 = (x.float() for x in inputs(2, 3, t, 8, 6, seed=seed, state=True))
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    return q, k, v, g, beta, s0 if state else None


@pytest.mark.parametrize(("t", "state"), [(13, True), (70, False)])
def test_opcheck(stand_in, t, state):
    q, k, v, g, beta, h0 = fla_layout(t, state)
    grads = [x.requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    assert len(grads) == 5 + state
    torch.library.opcheck(delta_rule_fla._fwd, (q, k, v, g, beta, h0, True))
    o, final, g_cum, a = delta_rule_fla._fwd(q, k, v, g, beta, h0, False)
    do, dht = torch.randn_like(o), torch.randn_like(final)
    saved = [None if x is None else x.detach() for x in (q, k, v, g, beta, h0, g_cum, a, do, dht)]
    torch.library.opcheck(delta_rule_fla._bwd, (*saved, False))


def test_wrapper_matches_the_chunked_form(stand_in):
    args = [x.requires_grad_() for x in inputs(2, 3, 70, 8, 6, seed=2)]  # float64 in, fp32 ops
    results = []
    for fn in (delta_rule_fla.gdn_chunk, delta_rule_chunked):
        o, s = fn(*args)
        weights = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)
        grads = torch.autograd.grad((o * weights).sum() + s.square().sum(), args)
        results.append((o, s, grads))
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert o.dtype == torch.float64 and s.dtype == torch.float32  # o in v's dtype, the state fp32 (as fla)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    for name, grad, grad_ref in zip(("q", "k", "v", "beta", "g", "state"), grads, grads_ref, strict=True):
        assert grad.abs().sum() > 0 and rel_err(grad, grad_ref) < 1e-5, name


def tiny_gdn(backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(
        arch="gdn-hybrid", d_model=32, head_dim=8, width=64, depth=2, vocab_size=61, context_length=16,
        n_kv_heads=2, attention_every=2, gdn_head_dim=8, gdn_backend=backend,
    )  # fmt: skip
    return build_model(config).train()


def batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 61, (2, 16), generator=gen) for _ in range(2))


def loss_and_grads(fn, model, x, y):
    model.zero_grad(set_to_none=True)
    loss = fn(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_gdn_model_through_the_ops_is_one_graph_equal_to_eager(stand_in):
    from torch._dynamo.utils import counters

    model = tiny_gdn("auto")
    x, y = batch(1)
    reference = tiny_gdn("torch")
    loss_ref, grads_ref = loss_and_grads(reference.nll, reference, x, y)
    loss, grads = loss_and_grads(model.nll, model, x, y)
    torch.testing.assert_close(loss, loss_ref)  # the ops in eager mode are the chunked form
    torch.testing.assert_close(grads, grads_ref)
    explained = torch._dynamo.explain(model.nll)(x, y)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "tango_lm.gdn_chunk_fwd.default" in ops, sorted(ops)  # through the ops, not the chunked form

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.nll, dynamic=False, fullgraph=True, backend="aot_eager")
    loss_c, grads_c = loss_and_grads(compiled, model, x, y)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):  # fresh batches and updated weights, as in the trainer
        opt.zero_grad(set_to_none=True)
        compiled(*batch(10 + step)).backward()
        opt.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"], (counters["recompiles"], counters["graph_break"])


def test_a_failing_kernel_falls_back_under_auto_with_one_logged_line(stand_in, monkeypatch, caplog):
    calls = []

    def broken(*args):
        calls.append(len(args))
        raise RuntimeError("no kernel for this head size\nsecond line")

    delta_rule_fla._log_fallback_once.cache_clear()  # once per process and reason
    monkeypatch.setattr(delta_rule_fla, "_FELL_BACK", set())
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: delta_rule_fla.GdnKernel("b", broken, broken))
    args = [x.float().requires_grad_() for x in inputs(1, 2, 10, 4, 4)]
    o_ref, s_ref = delta_rule_chunked(*args)
    grads_ref = torch.autograd.grad(o_ref.sum() + s_ref.sum(), args)
    with caplog.at_level("WARNING", logger=delta_rule_fla.__name__):
        for _ in range(2):
            o, s = gated_delta_rule(*args, chunk=4, backend="auto")
            grads = torch.autograd.grad(o.sum() + s.sum(), args)
            torch.testing.assert_close((o, s, grads), (o_ref, s_ref, grads_ref))
    assert calls == [6]  # tried once; later calls, backward included, go to the chunked form
    assert [r.getMessage() for r in caplog.records] == [
        "gdn_backend=auto: fla's kernel failed (RuntimeError: no kernel for this head size); "
        "running the chunked PyTorch form"
    ]
    with pytest.raises(RuntimeError, match="head size"):
        gated_delta_rule(*args, chunk=4, backend="fla")


def test_out_of_memory_in_the_kernel_is_not_a_fallback(stand_in, monkeypatch):
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(delta_rule_fla, "_FELL_BACK", set())
    kernel = delta_rule_fla.GdnKernel("oom", out_of_memory, out_of_memory)
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: kernel)
    args = [x.float() for x in inputs(1, 2, 10, 4, 4)]
    with pytest.raises(torch.OutOfMemoryError):  # the chunked form would need more memory, not less
        gated_delta_rule(*args, chunk=4, backend="auto")
    assert not delta_rule_fla._FELL_BACK


def test_a_backward_that_fails_falls_back_to_the_chunked_gradients(stand_in, monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("out of shared memory")

    delta_rule_fla._log_fallback_once.cache_clear()
    monkeypatch.setattr(delta_rule_fla, "_FELL_BACK", set())
    kernel = delta_rule_fla.GdnKernel("half", delta_rule_fla.CHUNKED.forward, broken)
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: kernel)
    args = [x.float().requires_grad_() for x in inputs(1, 2, 10, 4, 4, seed=5)]
    o_ref, s_ref = delta_rule_chunked(*args)
    grads_ref = torch.autograd.grad((o_ref * o_ref).sum() + s_ref.sum(), args)
    with caplog.at_level("WARNING", logger=delta_rule_fla.__name__):
        o, s = gated_delta_rule(*args, backend="auto")
        grads = torch.autograd.grad((o * o).sum() + s.sum(), args)
    torch.testing.assert_close(grads, grads_ref)
    assert len(caplog.records) == 1 and "out of shared memory" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("fla-core does not import (ModuleNotFoundError: No module named 'fla')", r"pip install 'tango-lm\[gdn\]'"),
        ("fla-core 0.9's chunk_gated_delta_rule_fwd/_bwd are not the ones tango-lm wraps", "fla-core 0.9"),
    ],
)
def test_fla_backend_names_the_extra_or_the_version(monkeypatch, reason, message):
    monkeypatch.setattr(delta_rule_fla, "fla_kernel_or_reason", lambda: reason)
    monkeypatch.setattr(delta_rule, "wants_fla", lambda backend, on_cuda: backend != "torch")
    q, k, v, beta, g, s0 = inputs(1, 2, 10, 4, 4)
    torch._dynamo.reset()
    # Compiled as the trainer compiles (not fullgraph): the raise is where Dynamo stops, and the line surfaces.
    for fn in (gated_delta_rule, torch.compile(gated_delta_rule, backend="eager")):
        with pytest.raises(UserError, match=message):
            fn(q, k, v, beta, g, s0, backend="fla")
    torch._dynamo.reset()
    o, _ = gated_delta_rule(q, k, v, beta, g, s0, chunk=4, backend="auto")  # auto: the chunked form
    assert torch.equal(o, delta_rule_chunked(q, k, v, beta, g, s0, chunk=4)[0])


def test_fla_internals_are_the_pinned_ones():
    # Where fla-core imports (CPU builds too), its internals have the parameters the ops pass by name.
    pytest.importorskip("fla.ops.gated_delta_rule.chunk", reason="fla-core is not installed")
    kernel = delta_rule_fla.fla_kernel_or_reason()
    assert isinstance(kernel, delta_rule_fla.GdnKernel) and kernel.name == "fla", kernel
