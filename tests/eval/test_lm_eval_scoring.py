"""The lm-evaluation-harness adapter (eval/lm_eval_adapter.py): the numbers a task reports from
it. `is_greedy` needs every continuation token greedy, generation draws no padding row, honours
the model's `max_gen_toks` and do_sample's default temperature, and cuts at the earliest stop.

Destination: tests/eval/test_lm_eval_scoring.py. Skipped without lm-eval."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import helpers

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from tango_lm.data.tokenizers import get_tokenizer  # noqa: E402
from tango_lm.eval.lm_eval_adapter import TangoLM, truncate_at_stops  # noqa: E402
from tango_lm.train.checkpoint import save_checkpoint  # noqa: E402
from tango_lm.train.config import RunConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny byte-level TANGO, randomly initialized far from uniform (no training needed)."""
    root = tmp_path_factory.mktemp("lm-eval-scoring")
    run = RunConfig.from_dict(
        {
            "model": {**helpers.TINY_MODEL, "init_std": 0.3},
            "data": {"dir": str(root / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(root)},
        }
    )
    torch.manual_seed(0)
    net = run.model.build()
    tok = get_tokenizer("byte")
    return save_checkpoint(root / "checkpoints", 1, net.state_dict(), {}, run.to_dict(), tok.to_dict(), {})


@pytest.fixture(scope="module")
def lm(checkpoint) -> TangoLM:
    return TangoLM(checkpoint=str(checkpoint), batch_size=2, device="cpu")


def _request(kind: str, args: tuple, i: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def _scripted(vocab: int, tokens: list[int], runner_up: int | None = None):
    """Decode steps that put `tokens[i]` first at step i (and `runner_up` second, where given)."""

    def steps(prompt, capacity):
        for token in tokens:
            log_probs = torch.full((1, vocab), -30.0)
            if runner_up is not None:
                log_probs[0, runner_up] = -1.0
            log_probs[0, token] = 0.0
            yield log_probs

    return steps


def test_is_greedy_needs_every_continuation_token_to_be_the_argmax(lm):
    ctx = lm.tok.encode("abc def")
    with torch.no_grad():
        first = int(lm.model(torch.tensor([ctx]))[0, -1, : lm.tok.vocab_size].argmax())
        after = lm.model(torch.tensor([[*ctx, first]]))[0, -1, : lm.tok.vocab_size]
    second_best = int(after.topk(2).indices[1])  # not greedy after `first`
    results = lm._loglikelihood_tokens(
        [
            (("a", "b"), ctx, [first]),  # greedy
            (("a", "c"), ctx, [first, second_best]),  # greedy, then not
            (("a", "d"), ctx, [first, int(after.argmax())]),  # greedy twice
        ]
    )
    assert [greedy for _, greedy in results] == [True, False, True]


def test_an_empty_continuation_is_certain_and_greedy(lm):
    assert lm._loglikelihood_tokens([(("abc", ""), lm.tok.encode("abc"), [])]) == [(0.0, True)]


def test_the_earliest_of_several_stop_strings_cuts_the_answer():
    assert truncate_at_stops("a b\nc", [" ", "\n"]) == "a"
    assert truncate_at_stops("a b\nc", ["\n", " "]) == "a"
    assert truncate_at_stops("abc", ["x", "y"]) == "abc"


def test_generate_until_with_several_stops_cuts_at_the_earliest(lm, monkeypatch):
    text = lm.tok.encode("xy zw\nq")
    monkeypatch.setattr(lm, "_decode_steps", _scripted(lm.model.config.vocab_size, text + [lm.tok.eot_id]))
    (out,) = lm.generate_until([_request("generate_until", ("abc", {"until": ["\n", " "], "max_gen_toks": 10}))])
    assert out == "xy"


def test_generate_until_never_draws_the_tables_padding_rows(lm, monkeypatch):
    # A table padded past the tokenizer (50304 rows for GPT-2's 50257): a padding row is no token.
    pad, real = ord("x"), ord("a")  # with vocab_size 100, "x" (120) is a padding row here
    monkeypatch.setattr(lm.tok, "vocab_size", 100)
    monkeypatch.setattr(lm, "_decode_steps", _scripted(lm.model.config.vocab_size, [pad] * 4, runner_up=real))
    (out,) = lm.generate_until([_request("generate_until", ("abc", {"max_gen_toks": 4}))])
    assert out == "aaaa"


def test_generate_until_defaults_to_the_models_max_gen_toks(checkpoint, monkeypatch):
    lm = TangoLM(checkpoint=str(checkpoint), device="cpu", max_gen_toks="3")
    monkeypatch.setattr(lm, "_decode_steps", _scripted(lm.model.config.vocab_size, [ord("z")] * 20))
    (out,) = lm.generate_until([_request("generate_until", ("abc", {"until": ["\n"]}))])
    assert out == "zzz"


def test_do_sample_without_a_temperature_samples_at_1(lm, monkeypatch):
    import tango_lm.serve.generate as generate

    temperatures, real = [], generate.sample_next
    monkeypatch.setattr(generate, "sample_next", lambda lp, t, *a, **k: temperatures.append(t) or real(lp, t, *a, **k))
    lm.generate_until([_request("generate_until", ("abc", {"do_sample": True, "seed": 1, "max_gen_toks": 2}))])
    lm.generate_until([_request("generate_until", ("abc", {"max_gen_toks": 2, "temperature": 0.7}))])
    assert set(temperatures[:1]) == {1.0} and temperatures[-1] == 0.0  # greedy unless do_sample


def test_a_long_prompt_is_cut_to_the_window_less_max_gen_toks(lm, monkeypatch):
    # As lm-eval's Hugging Face model cuts it: the prompt keeps max_length - max_gen_toks tokens.
    prompts, steps = [], _scripted(lm.model.config.vocab_size, [lm.tok.eot_id])
    monkeypatch.setattr(
        lm, "_decode_steps", lambda prompt, capacity: prompts.append(prompt[0].tolist()) or steps(prompt, capacity)
    )
    context = "".join(chr(ord("a") + i % 12) for i in range(60))
    lm.generate_until([_request("generate_until", (context, {"max_gen_toks": 5}))])
    assert prompts == [lm.tok.encode(context)[-(32 - 5) :]]


def test_an_empty_stop_string_stops_nothing(lm, monkeypatch):
    # lm-eval's default `until` is the decoded end-of-text token, "" for the byte tokenizer.
    monkeypatch.setattr(lm, "_decode_steps", _scripted(lm.model.config.vocab_size, lm.tok.encode("wxyz")))
    (out,) = lm.generate_until([_request("generate_until", ("abc", {"until": [""], "max_gen_toks": 4}))])
    assert out == "wxyz"


def test_the_default_window_is_the_trained_sequence_length(tmp_path):
    run = RunConfig.from_dict(
        {
            "model": dict(helpers.TINY_MODEL),  # context 32
            "data": {"dir": str(tmp_path / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(tmp_path), "seq_len": 16},
        }
    )
    net, tok = run.model.build(), get_tokenizer("byte")
    path = save_checkpoint(tmp_path / "checkpoints", 1, net.state_dict(), {}, run.to_dict(), tok.to_dict(), {})
    assert TangoLM(checkpoint=str(path), device="cpu").max_length == 16
    assert TangoLM(checkpoint=str(path), device="cpu", max_length="32").max_length == 32
