"""Cached decoding and sampling (serve/cache.py, serve/generate.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tango_lm import ModelConfig, UserError, build_model
from tango_lm.heads.registry import HEADS
from tango_lm.models.registry import ARCHITECTURES
from tango_lm.serve.generate import filter_logits, generate, sample_next
from tests import arch_cases

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def tiny_model(arch: str, **changes) -> torch.nn.Module:
    return model_for(arch_cases.tiny_config(arch, **changes))


def model_for(cfg: ModelConfig, scale: float = 0.05) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    with torch.no_grad():  # move off zero/one inits (gates, offsets, biases) so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def check_cached_decoding(cfg: ModelConfig) -> None:
    """A prefill, single steps and a chunk through the decode cache give the full forward's
    log-probs (float64), and the cache grows with the positions exactly when the architecture
    says its decode state does."""
    model = model_for(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    full = model(x)
    cache = model.new_cache()
    pieces = [model(x[:, :11], cache)]  # prefill
    sizes = []
    for i in range(11, 30):  # one token at a time
        pieces.append(model(x[:, i : i + 1], cache))
        sizes.append(cache.nbytes())
    pieces.append(model(x[:, 30:], cache))  # a chunk after single steps
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.position == 37 and cache.nbytes() > 0
    half = len(sizes) // 2
    grows = max(sizes[half:]) > max(sizes[:half])
    assert grows == ARCHITECTURES[cfg.arch].decode_state_grows(cfg), sizes


@pytest.mark.parametrize("arch", arch_cases.names())
def test_cached_decoding_reproduces_full_forward(arch):
    check_cached_decoding(arch_cases.tiny_config(arch))


@pytest.mark.parametrize("head", list(HEADS))
def test_every_head_decodes_as_its_full_forward(head):
    # From the registry: a new head is checked as the shipped ones are (this named two of them).
    from tests.serve.test_static_decode import check_static_decoding

    check_cached_decoding(arch_cases.tiny_config("tango", head=head))
    check_static_decoding(arch_cases.tiny_config("dense", head=head))


def test_cached_decoding_of_block_attnres():
    check_cached_decoding(arch_cases.tiny_config("attnres", attnres_block=1))


def test_cache_beyond_context_is_a_user_error():
    model = tiny_model("tango")
    cache = model.new_cache()
    model(torch.zeros(1, 40, dtype=torch.long), cache)
    with pytest.raises(UserError, match="context_length"):
        model(torch.zeros(1, 9, dtype=torch.long), cache)


def test_a_cache_keeps_its_history_or_refuses(monkeypatch):
    # Another batch than the cache began with is refused (a fresh zero buffer dropped the history);
    # another dtype (a bf16 prefill, fp32 steps) converts what is cached.
    model = tiny_model("loop-transformer")
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache()
    model(x[:, :6], cache)
    with pytest.raises(ValueError, match=r"a cache continues the batch it began with"):
        model(x[:1, 6:7], cache)
    model = tiny_model("loop-transformer").float()
    cache = model.new_cache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x[:, :6], cache)
    step = model(x[:, 6:7], cache)[:, -1]
    torch.testing.assert_close(step, model(x[:, :7])[:, -1], atol=0.1, rtol=0)  # bf16's rounding, not a lost prefix


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_a_cache_continues_across_autocast_in_either_order(arch):
    # FLASH kept its completed groups' sum in the prefill's dtype: a bf16 prefill, then an fp32
    # step, raised "expected scalar type Float but found BFloat16".
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    tolerance = 0.05  # bf16's rounding: measured at most 0.018 (GAU, weights moved by 0.2)
    for scale in (0.05, 0.2):  # GAU's and FLASH's last position hardly reads its prefix at 0.05
        model = model_for(arch_cases.tiny_config(arch), scale).float()
        with torch.no_grad():
            full = model(x)[:, -1]
            lost_prefix = (model(x[:, 11:12])[:, -1] - full).abs().max()
        if lost_prefix > 4 * tolerance:  # so a cache that drops what it held fails
            break
    assert lost_prefix > 4 * tolerance
    with torch.no_grad():
        for bf16_first in (True, False):
            cache = model.new_cache()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_first):
                model(x[:, :11], cache)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_first):
                step = model(x[:, 11:12], cache)[:, -1]
            torch.testing.assert_close(step, full, atol=tolerance, rtol=0)


def test_greedy_generation_matches_argmax_of_full_forward():
    model = tiny_model("tango")
    prompt = torch.tensor([[3, 14, 15, 9]])
    out = generate(model, prompt, 10, temperature=0)
    assert out.shape == (1, 14) and torch.equal(out[:, :4], prompt)
    for t in range(4, 14):
        assert out[0, t] == model(out[:, :t])[0, -1].argmax()


def test_sampling_is_reproducible_with_a_seed_and_varies_without():
    model = tiny_model("loop-transformer")
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, 12, temperature=1.5, seed=7)
    b = generate(model, prompt, 12, temperature=1.5, seed=7)
    c = generate(model, prompt, 12, temperature=1.5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_generation_stops_at_eos_for_every_row():
    model = tiny_model("tango")
    prompt = torch.tensor([[1, 2, 3]])
    first = generate(model, prompt, 1, temperature=0)[0, -1].item()
    out = generate(model, prompt, 20, temperature=0, eos_id=first)
    assert out.shape[1] == 4


@pytest.mark.parametrize("static", [None, "eager"])
def test_generation_stops_once_every_row_has_drawn_eos_on_its_own_step(static):
    # Rows that draw the end at different steps: decoding ends at the step the last one does
    # (a row's end forgotten meant decoding ran on until all drew it at once, or to the limit).
    model = tiny_model("tango")
    prompt = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(4))
    free = generate(model, prompt, 30, seed=0, static=static)[:, 3:].tolist()
    eos = next(t for t in free[1] if t in free[0] and free[0].index(t) != free[1].index(t))
    ends = [row.index(eos) for row in free]
    out = generate(model, prompt, 30, seed=0, eos_id=eos, static=static)
    assert ends[0] != ends[1] and out.shape[1] == 3 + max(ends) + 1


@pytest.mark.parametrize("head", ["standard", "onona"])
@pytest.mark.parametrize("static", [None, "eager"])
def test_generation_draws_only_the_tokenizers_ids(head, static):
    # A model's table padded past its tokenizer's vocabulary (GPT-2's 50257 ids in 50304 rows):
    # ids 9-11 here have no text, and a model that has not learned to avoid them draws them.
    torch.manual_seed(0)
    cfg = ModelConfig(arch="tango", head=head, d_model=32, head_dim=8, width=48, depth=2, vocab_size=12)
    model = build_model(cfg.replace(context_length=16)).eval()
    prompt = torch.tensor([[3, 5, 7]]).repeat(300, 1)
    for kwargs in ({}, {"temperature": 1.5, "top_k": 11}, {"top_p": 0.97}):  # {}: onóna's one projection
        anything = generate(model, prompt, 3, seed=0, static=static, **kwargs)[:, 3:]
        assert (anything >= 9).any(), kwargs
        drawable = generate(model, prompt, 3, seed=0, static=static, vocab_size=9, **kwargs)[:, 3:]
        assert (drawable < 9).all() and drawable.unique().numel() > 4, kwargs
    logits = model(prompt[:1])[0, -1]
    top = int(logits.argmax())
    assert top > 0
    greedy = generate(model, prompt[:1], 1, temperature=0, static=static, vocab_size=top)[0, -1]
    assert greedy == logits[:top].argmax()


@pytest.mark.parametrize("static", [None, "eager"])
def test_top_p_of_one_draws_as_no_top_p(static):
    # The server reads top_p 1 as none; generate took it for a truncation, and an onóna model then
    # drew through two projections: other samples for the same seed than the server's.
    cfg = ModelConfig(
        arch="dense", head="onona", d_model=32, head_dim=8, width=48, depth=2, vocab_size=30, context_length=16
    )
    model = model_for(cfg)
    prompt = torch.randint(0, 30, (2, 3), generator=torch.Generator().manual_seed(3))
    without = generate(model, prompt, 6, seed=11, static=static)
    assert torch.equal(generate(model, prompt, 6, seed=11, top_p=1.0, static=static), without)


@pytest.mark.parametrize("head", ["standard", "onona"])
@pytest.mark.parametrize("static", [None, "eager"])
def test_a_top_p_below_float32s_range_samples_the_top_token(static, head):
    """top_p = 1e-300 is in (0, 1] but is 0 in float32: the nucleus still holds the top token (it
    raised in multinomial, and the static step drew token 0 from all -inf). An onóna head at
    temperature 1 samples through one projection only without a top_p: with one, the mixture."""
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.4], [0.6, 0.1, 0.3]]))
    assert torch.isfinite(filter_logits(logits, top_p=1e-300)).tolist() == [[False, True, False], [True, False, False]]
    cfg = ModelConfig(
        arch="tango", head=head, d_model=32, head_dim=16, width=48, depth=2, vocab_size=30, context_length=16
    )
    model = model_for(cfg)
    prompt = torch.randint(0, 30, (2, 3), generator=torch.Generator().manual_seed(3))
    greedy = generate(model, prompt, 6, temperature=0, static=static)
    assert torch.equal(generate(model, prompt, 6, top_p=1e-300, seed=1, static=static), greedy)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    k2 = filter_logits(logits, top_k=2)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]]
    p = filter_logits(logits, top_p=0.7)  # 0.5 + 0.2 reaches 0.7: keep two
    assert torch.isfinite(p).tolist() == [[True, True, False, False, False]]
    p = filter_logits(logits, top_p=0.71)
    assert torch.isfinite(p).tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum() == 1


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sample_next_draws_from_the_softmax_at_its_temperature(temperature):
    # The CPU decode's sampler (generate, serve, lm-eval's do_sample): softmax(log_probs / T).
    log_probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(40000, 4)
    draws = sample_next(log_probs, temperature, generator=torch.Generator().manual_seed(5))
    freq = torch.bincount(draws, minlength=4) / 40000
    torch.testing.assert_close(freq, (log_probs[0] / temperature).softmax(-1), rtol=0, atol=0.01)


def test_sample_next_respects_top_k_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2000, 1)
    draws = sample_next(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {0, 1}
    frac0 = (draws == 0).float().mean().item()
    assert abs(frac0 - 4 / 7) < 0.04  # renormalized 0.4 / (0.4 + 0.3)


def test_bad_sampling_arguments():
    model = tiny_model("tango")
    with pytest.raises(UserError, match="temperature"):
        generate(model, torch.tensor([[1]]), 2, temperature=-1)
    with pytest.raises(UserError, match="top_p"):
        generate(model, torch.tensor([[1]]), 2, top_p=0)
    with pytest.raises(UserError, match="context"):
        generate(model, torch.tensor([[1] * 40]), 20)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"seed": 1.5}, "seed must be a whole number"),  # `in range(-2**63, 2**64)` walked the range: a hang
        ({"seed": 3.0}, "seed must be a whole number"),
        ({"top_k": 1.5}, "top_k must be a whole number"),  # a TypeError from torch.topk
        ({"max_new_tokens": 2.5}, "max_new_tokens (--max-new-tokens) must be a whole number"),
        ({"vocab_size": 0}, "vocab_size must be a whole number of at least 1"),  # a sampling error
        ({"vocab_size": -2}, "vocab_size must be a whole number of at least 1"),  # dropped the last two ids
        ({"static": "bogus"}, "static must be None, 'auto' or one of"),  # a ValueError
        # float32 holds the static step's temperature: 1e39 raised there ("cannot be converted")
        ({"temperature": 1e39, "static": "eager"}, "temperature must be 0 (greedy decoding) or a number from 0.0001"),
    ],
)
def test_generate_refuses_arguments_of_the_wrong_kind_in_one_line(kwargs, said):
    model = tiny_model("tango")
    args = {"max_new_tokens": 2, "temperature": 1.0, **kwargs}
    with pytest.raises(UserError, match=re.escape(said)):
        generate(model, torch.tensor([[1, 2]]), **args)


def test_a_prompt_past_the_context_is_said_so_even_for_no_new_tokens():
    # "a prompt of 53 tokens leaves room for 0 new tokens ... (asked for 0)"
    model = tiny_model("tango")
    context = model.config.context_length
    with pytest.raises(UserError, match=f"a prompt of {context + 5} tokens is longer than the model's context"):
        generate(model, torch.ones(1, context + 5, dtype=torch.long), 0)
    assert generate(model, torch.ones(1, context, dtype=torch.long), 0).shape == (1, context)


def test_the_room_error_counts_one_token_as_one_token():
    model = tiny_model("tango")
    context = model.config.context_length
    with pytest.raises(UserError, match=f"a prompt of 1 token leaves room for {context} new tokens in"):
        generate(model, torch.ones(1, 1, dtype=torch.long), context + 1)
    with pytest.raises(UserError, match=f"a prompt of {context} tokens leaves room for 1 new token in"):
        generate(model, torch.ones(1, context, dtype=torch.long), 2)


def test_a_numpy_integer_seed_is_a_seed():
    model = tiny_model("tango")
    prompt = torch.tensor([[1, 2]])
    same = [generate(model, prompt, 4, temperature=1.0, seed=s) for s in (np.int64(5), 5)]
    assert torch.equal(same[0], same[1])


@pytest.mark.parametrize("static", [None, "eager"])
def test_a_prompt_that_is_not_batch_by_length_is_a_user_error(static):
    model = tiny_model("tango")
    for prompt in (torch.zeros(1, 0, dtype=torch.long), torch.tensor([1, 2, 3])):
        with pytest.raises(UserError, match=r"shape \[batch, length\]"):
            generate(model, prompt, 2, temperature=0, static=static)


def test_generate_gives_the_model_back_in_the_mode_it_had():
    # Sampling mid-training must not switch the model to eval (MoE's load-balancing loss, dropout).
    model = tiny_model("moe").train()
    generate(model, torch.tensor([[1, 2]]), 2, temperature=0)
    assert model.training
    generate(model.eval(), torch.tensor([[1, 2]]), 2, temperature=0)
    assert not model.training


def test_onona_temperature_one_sampling_uses_one_projection_and_matches_the_mixture(monkeypatch):
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(
            arch="tango", head="onona", d_model=32, head_dim=8, width=48, depth=2, vocab_size=12, context_length=16
        )
    ).eval()
    calls = []
    original = type(model.head).sample
    monkeypatch.setattr(type(model.head), "sample", lambda self, *a: calls.append(1) or original(self, *a))
    n = 6000
    prompt = torch.tensor([[3, 5, 7]]).repeat(n, 1)
    first = generate(model, prompt, 1, seed=0)[:, -1]
    assert calls, "temperature-1 untruncated sampling must go through the head's one-projection sampler"
    want = model(prompt[:1])[0, -1].exp()
    got = torch.bincount(first, minlength=12).float() / n
    # Within 4 standard errors per token, for a fixed seed.
    se = (want * (1 - want) / n).sqrt()
    assert ((got - want).abs() <= 4 * se + 1e-3).all(), (got, want)
    calls.clear()
    generate(model, prompt[:2], 2, seed=0, top_k=5)
    assert not calls  # truncated sampling needs both projections


def test_onona_one_projection_sampling_below_the_tokenizers_ids_is_the_renormalized_mixture():
    # Table B puts almost all its mass on padding rows 9-11, and of the rest most on id 0:
    # renormalizing each component over ids 0-8 gave B's crumbs (id 0) B's whole gate weight;
    # the mixture renormalized over 0-8 hardly uses B.
    torch.manual_seed(0)
    cfg = ModelConfig(arch="tango", head="onona", d_model=32, head_dim=8, width=48, depth=2, vocab_size=12)
    model = build_model(cfg.replace(context_length=16)).eval()
    prompt = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        h = model.hidden(prompt)[0, -1]
        model.head.table_b.weight[9:] = 40 * h / h.norm() ** 2  # logits of 40 on B's padding rows
        model.head.table_b.weight[0] = 5 * h / h.norm() ** 2  # and 5 on id 0
    n = 6000
    first = generate(model, prompt.repeat(n, 1), 1, seed=0, vocab_size=9)[:, -1]
    mixture = model(prompt)[0, -1].exp()[:9]
    want = mixture / mixture.sum()
    got = torch.bincount(first, minlength=9).float() / n
    se = (want * (1 - want) / n).sqrt()
    assert ((got - want).abs() <= 4 * se + 1e-3).all(), (got, want)


def test_onona_serving_fold_gives_the_same_numbers():
    torch.manual_seed(1)
    model = build_model(
        ModelConfig(
            arch="dense", head="onona", d_model=32, head_dim=8, width=48, depth=2, vocab_size=30, context_length=16
        )
    ).eval()
    x = torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        plain = model(x)
        with model.head.serving():
            eager = model(x)  # rows of M and their gates for the tokens read
            assert model.head._folded is None
            assert len(model.head.serving_tensors()) == 3  # a static step's fold of every row
            folded = model(x)
    assert model.head._folded is None and model.head.serving_tensors() == ()
    torch.testing.assert_close(eager, plain, rtol=0, atol=0)
    torch.testing.assert_close(folded, plain, rtol=0, atol=1e-6)
    greedy = generate(model, x[:1, :3], 8, temperature=0)
    assert torch.equal(greedy[:, 3:4], model(x[:1, :3])[:, -1].argmax(-1, keepdim=True))


def test_onona_serving_reads_the_weights_as_they_are_and_folds_into_the_same_tensors():
    # The fold was kept while the parameters' version counters stood still: an edit through
    # `.data` (the paper's A = B = E construction, done the usual way) left generate() serving the
    # old M and gate, up to 18.8 nats off. Eager serving reads the rows it needs; a static step's
    # fold is made per request into the tensors kept (a CUDA graph reads them in place).
    torch.manual_seed(2)
    model = build_model(
        ModelConfig(
            arch="dense", head="onona", d_model=32, head_dim=8, width=48, depth=2, vocab_size=30, context_length=16
        )
    ).eval()
    x = torch.randint(0, 30, (2, 9))
    head = model.head
    with torch.no_grad(), head.serving():
        first = head.serving_tensors()
    table = torch.randn_like(head.table_a.weight)
    edits = (
        lambda: head.table_a.weight.data.copy_(table),
        lambda: head.table_b.weight.data.copy_(table),
        lambda: head.gate.weight.data.mul_(3),
        lambda: head.gate.weight.add_(0.1),  # as an optimizer step would (under no_grad)
    )
    for edit in edits:
        with torch.no_grad():
            edit()
            plain = model(x)
            with head.serving():
                torch.testing.assert_close(model(x), plain, rtol=0, atol=0)  # eager: the rows read
                fold = head.serving_tensors()
                assert all(a is b for a, b in zip(fold, first, strict=True))  # the same tensors
                torch.testing.assert_close(model(x), plain, rtol=0, atol=1e-6)  # a static step's fold
                torch.testing.assert_close(fold[2], torch.stack([head.table_a.weight, head.table_b.weight]))
    with torch.no_grad(), head.serving():  # nested (a generate() inside a caller's serving): the outer's stays
        fold = head.serving_tensors()
        with head.serving():
            pass
        assert head.serving_tensors() is fold
    assert head.serving_tensors() == ()


def test_the_prompt_flag_reads_newlines_and_backslashes():
    # `--prompt 'print("x\\n")'` reached the model as a backslash and a newline: no way to write \n itself.
    from tango_lm.cli.generate import _unescaped

    assert _unescaped("What is 12 + 35?\\n") == "What is 12 + 35?\n"
    assert _unescaped('print("x\\\\n")') == 'print("x\\n")'
    assert _unescaped("C:\\temp \\\\\\n") == "C:\\temp \\\n"  # other escapes stay as written
