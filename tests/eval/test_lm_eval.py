"""The lm-evaluation-harness adapter (eval/lm_eval_adapter.py): every request type against the
model's own log-probs computed directly, and lm-eval's command line on local tasks, offline.

Skipped when lm-eval is not installed (`pip install 'tango-lm[eval]'`)."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import helpers

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from tango_lm.data.tokenizers import get_tokenizer  # noqa: E402
from tango_lm.errors import UserError  # noqa: E402
from tango_lm.eval.lm_eval_adapter import TangoLM, truncate_at_stops  # noqa: E402
from tango_lm.layers.moe import capacity_factor  # noqa: E402
from tango_lm.serve.generate import generate  # noqa: E402
from tango_lm.train.checkpoint import save_checkpoint  # noqa: E402
from tango_lm.train.config import RunConfig  # noqa: E402
from tango_lm.train.trainer import train  # noqa: E402

TASKS = helpers.FIXTURES / "lm_eval_tasks"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A tiny byte-level TANGO trained for 30 steps (letters a-l and spaces): about 2 s."""
    data = helpers.synthetic_dataset(tmp_path_factory)
    out = tmp_path_factory.mktemp("lm-eval-run")
    train(helpers.run_config(data, out, steps=30, save_every=30, eval_every=30))
    return out


@pytest.fixture(scope="module")
def cli_run(run_dir, tmp_path_factory):
    """lm-eval's own command line on the three local tasks, started here and awaited by the test
    that reads it (indexing lm-eval's built-in tasks takes most of its ~15 s; tests run meanwhile)."""
    out = tmp_path_factory.mktemp("lm-eval-out")
    env = {
        **os.environ,
        **OFFLINE,
        "HF_HOME": str(out / "hf"),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-c",
        "from tango_lm.eval.lm_eval_adapter import main; main()",
        "run",
        "--model",
        "tango-lm",
        "--model_args",
        f"checkpoint={run_dir}",
        "--include_path",
        str(TASKS),
        "--tasks",
        "tango_mc,tango_ppl,tango_gen",
        "--batch_size",
        "3",
        "--device",
        "cpu",
        "--output_path",
        str(out / "results"),
        "--log_samples",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc, out / "results"
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def lm(run_dir, cli_run) -> TangoLM:  # cli_run: start the subprocess before the in-process tests
    return TangoLM(checkpoint=str(run_dir), batch_size=3, device="cpu")


# -- direct references --------------------------------------------------------------------------
def target_logprobs(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(ids[t] | ids[:t]) for t >= 1 from one unpadded forward, and whether each is the argmax."""
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]]))[0].double()
    targets = torch.tensor(ids[1:])
    return logp.gather(-1, targets[:, None]).squeeze(-1), logp.argmax(-1) == targets


def direct_loglikelihood(model, context: list[int], continuation: list[int], window: int) -> tuple[float, bool]:
    ids = (context + continuation)[-(window + 1) :]
    logp, greedy = target_logprobs(model, ids)
    n = len(continuation)
    return float(logp[-n:].sum()), bool(greedy[-n:].all())


def direct_rolling(model, ids: list[int], eot: int, window: int) -> float:
    """Document log-prob with lm-eval's own rolling windows (lm_eval.utils)."""
    total = 0.0
    for context, pred in map(make_disjoint_window, get_rolling_token_windows(ids, eot, window, 1)):
        logp, _ = target_logprobs(model, context + pred)
        total += float(logp[-len(pred) :].sum())
    return total


def direct_generation(model, tok, context: str, max_new: int, stops: list[str], window: int) -> str:
    ids = (tok.encode(context) or [tok.eot_id])[-(window - max_new) :]
    out = generate(model, torch.tensor([ids]), max_new, temperature=0, eos_id=tok.eot_id)[0, len(ids) :].tolist()
    if tok.eot_id in out:
        out = out[: out.index(tok.eot_id)]
    return truncate_at_stops(tok.decode(out), stops)


def _request(kind: str, args: tuple, i: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


# -- in-process --------------------------------------------------------------------------------
def test_loglikelihood_sums_continuation_log_probs(lm):
    tok, model, window = lm.tok, lm.model, lm.max_length
    assert window == 32 and lm.eot_token_id == tok.eot_id
    prompt = "abc def gh"
    greedy = direct_generation(model, tok, prompt, 3, [], window)
    pairs = [
        ("abc def", " ghi"),
        ("a", "b"),
        ("", "abc"),
        ("k" * 50, " abc"),  # cut from the left
        ("hello", "  world"),
        (prompt, greedy),
        ("ab", "c" * 32),
    ]
    results = lm.loglikelihood([_request("loglikelihood", p, i) for i, p in enumerate(pairs)])
    assert len(results) == len(pairs)
    for (context, continuation), (ll, is_greedy) in zip(pairs, results, strict=True):
        ctx = tok.encode(context) or [tok.eot_id]  # lm-eval conditions an empty context on end-of-text
        want_ll, want_greedy = direct_loglikelihood(model, ctx, tok.encode(continuation), window)
        assert ll == pytest.approx(want_ll, rel=1e-5, abs=1e-4), (context, continuation)
        assert is_greedy == want_greedy
    assert results[5][1] is True  # the model's own greedy continuation


def test_a_whitespace_context_scores_as_an_empty_one(lm):
    # lm-eval moves a context's trailing spaces into the continuation, so " " reached the scorer as
    # no context at all: a traceback (a gather past the window) that took the batch down with it.
    requests = [_request("loglikelihood", p, i) for i, p in enumerate([(" ", "abc"), ("", " abc"), ("hello", " x")])]
    (blank, empty, other) = lm.loglikelihood(requests)
    assert blank == pytest.approx(empty)
    want = direct_loglikelihood(lm.model, lm.tok.encode("hello"), lm.tok.encode(" x"), lm.max_length)
    assert other[0] == pytest.approx(want[0], rel=1e-5, abs=1e-4)


def test_the_greedy_flag_ignores_the_tables_padding_rows(lm, monkeypatch):
    # A table padded past the tokenizer (50304 rows for GPT-2's 50257): generate_until never draws
    # a padding row, so the greedy flag is the argmax over the tokenizer's ids, not over every row.
    ctx = lm.tok.encode("abc def")
    with torch.no_grad():
        logp = lm.model(torch.tensor([ctx]))[0, -1]
    top = int(logp.argmax())
    assert top > 0
    monkeypatch.setattr(lm.tok, "vocab_size", top)  # the model's argmax is a padding row now
    best_real = int(logp[:top].argmax())
    (_, greedy), (_, not_greedy) = lm._loglikelihood_tokens([(("a", "b"), ctx, [best_real]), (("a", "c"), ctx, [top])])
    assert greedy and not not_greedy


def test_loglikelihood_rejects_a_continuation_longer_than_the_window(lm):
    with pytest.raises(UserError, match="max_length"):
        lm.loglikelihood([_request("loglikelihood", ("a", "b" * 40))])


def test_loglikelihood_rolling_predicts_every_token_once(lm):
    tok, model = lm.tok, lm.model
    docs = ["short", "a b c d e f g h i j k l " * 6, "x" * 32, "y" * 33, "Ünïcode ∑ bytes " * 3]
    results = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (d,), i) for i, d in enumerate(docs)])
    for doc, ll in zip(docs, results, strict=True):
        ids = tok.encode(doc)
        assert ll == pytest.approx(direct_rolling(model, ids, tok.eot_id, 32), rel=1e-5, abs=1e-4)
    # A document that fits one window is one forward pass after end-of-text.
    logp, _ = target_logprobs(model, [tok.eot_id, *tok.encode("short")])
    assert results[0] == pytest.approx(float(logp.sum()), rel=1e-6)


def test_generate_until_is_cached_greedy_decoding_cut_at_stop_strings(lm):
    tok, model = lm.tok, lm.model
    free = direct_generation(model, tok, "abc ", 12, [], 32)
    assert len(free) >= 4
    stop = free[2:4]  # a stop string the model will produce, so truncation is exercised
    cases = [
        ("abc ", {"until": [stop], "max_gen_toks": 12}),
        ("abc ", {"max_gen_toks": 12}),
        ("abc ", {"until": "zzz", "max_gen_toks": 5, "do_sample": False, "temperature": 0}),
        ("", {"until": [" "], "max_gen_toks": 8}),
        ("k" * 60, {"until": ["\n"], "max_gen_toks": 4}),
    ]  # prompt cut to the window
    outs = lm.generate_until([_request("generate_until", c, i) for i, c in enumerate(cases)])
    assert outs[0] == free[: free.index(stop)] and outs[1] == free
    for (context, kwargs), out in zip(cases, outs, strict=True):
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else until
        assert out == direct_generation(model, tok, context, kwargs["max_gen_toks"], until, 32)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"temperature": -1.0}, "temperature must be 0 (greedy decoding) or a number from"),
        ({"temperature": -0.01}, "temperature must be 0"),  # sampled the least likely tokens
        ({"top_k": -1}, "top_k must be a whole number of at least 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ],
)
def test_generate_until_refuses_sampling_settings_it_cannot_honour(lm, setting, said):
    request = _request("generate_until", ("abc ", {"do_sample": True, "max_gen_toks": 4, "seed": 0, **setting}))
    with pytest.raises(UserError, match=re.escape(said)):
        lm.generate_until([request])


def test_greedy_requests_ignore_sampling_settings_and_top_k_0_means_none(lm):
    # Hugging Face's convention: top_k=0 is no top-k; greedy decoding reads no sampling setting.
    plain = lm.generate_until([_request("generate_until", ("abc ", {"max_gen_toks": 4}))])
    for setting in ({"top_k": 0, "top_p": 0.0, "temperature": -1.0}, {"do_sample": False, "top_k": 0}):
        assert lm.generate_until([_request("generate_until", ("abc ", {"max_gen_toks": 4, **setting}))]) == plain
    sampled = {"do_sample": True, "seed": 3, "max_gen_toks": 4}
    assert lm.generate_until([_request("generate_until", ("abc ", {**sampled, "top_k": 0}))]) == lm.generate_until(
        [_request("generate_until", ("abc ", sampled))]
    )


def test_a_chat_template_is_refused_in_one_line(lm):
    # --apply_chat_template ended in lm-eval's NotImplementedError traceback.
    assert lm.chat_template(False) == ""
    for call in (lambda: lm.chat_template(True), lambda: lm.apply_chat_template([{"role": "user", "content": "x"}])):
        with pytest.raises(UserError, match="without a chat template; drop --apply_chat_template"):
            call()


def test_generate_until_keeps_half_the_window_for_the_prompt(lm, caplog):
    """lm-eval's default max_gen_toks (256) on a model of a shorter window left it one token of its
    prompt: the answer's budget is capped at half the window (16 of 32 here), with a warning."""
    tok, model = lm.tok, lm.model
    context = "abcdefghijkl " * 4
    with caplog.at_level("WARNING", logger="tango_lm.eval.lm_eval_adapter"):
        (out,) = lm.generate_until([_request("generate_until", (context, {"max_gen_toks": 256}))])
    assert out == direct_generation(model, tok, context, 16, [], 32)
    assert "max_gen_toks=256 is over half the 32-token window; generating at most 16 tokens" in caplog.text


def test_generate_until_stops_at_end_of_text(lm, monkeypatch):
    # A drawn end-of-text ends the answer (the next document's text leaked into it otherwise); the
    # decode steps are scripted: a, b, end-of-text, c, d, ...
    tok, vocab = lm.tok, lm.model.config.vocab_size
    script = [*tok.encode("ab"), tok.eot_id, *tok.encode("cdefgh")]

    def steps(prompt, capacity):
        for token in script:
            log_probs = torch.full((1, vocab), -30.0)
            log_probs[0, token] = 0.0
            yield log_probs

    monkeypatch.setattr(lm, "_decode_steps", steps)
    assert lm.generate_until([_request("generate_until", ("abc ", {"max_gen_toks": 8}), 0)]) == ["ab"]


def test_generate_until_on_static_steps_is_the_same(lm, monkeypatch):
    # What runs on CUDA (CUDA graphs there): the static decode steps, here run eagerly.
    import tango_lm.serve.static_decode as static_decode

    cases = [("abc ", {"max_gen_toks": 10}), ("k" * 60, {"until": ["\n"], "max_gen_toks": 4})]
    requests = [_request("generate_until", c, i) for i, c in enumerate(cases)]
    want = lm.generate_until(requests)
    monkeypatch.setattr(static_decode, "default_mode", lambda device: "eager")
    assert lm.generate_until(requests) == want
    assert lm.model._static_decoders  # the static decoder ran


def test_model_args(run_dir):
    lm = TangoLM(checkpoint=str(run_dir), batch_size="auto", max_length="16", device="cpu")
    assert (lm.batch_size, lm.max_length, lm.device.type) == (16, 16, "cpu")
    if not torch.cuda.is_available():  # lm-eval's default --device is cuda:0 on any machine
        assert TangoLM(checkpoint=str(run_dir), device="cuda:0").device.type != "cuda"
    with pytest.raises(UserError, match="checkpoint"):
        TangoLM()
    with pytest.raises(UserError, match="does not exist"):
        TangoLM(checkpoint=str(run_dir / "nope"))
    with pytest.raises(UserError, match="max_length"):
        TangoLM(checkpoint=str(run_dir), max_length=33)
    with pytest.raises(UserError, match="precision"):
        TangoLM(checkpoint=str(run_dir), precision="fp16")
    for name in ("max_length", "max_gen_toks"):
        with pytest.raises(UserError, match=f"{name} must be an integer \\(got 'abc'\\)"):
            TangoLM(checkpoint=str(run_dir), **{name: "abc"})
    for value in ("0", "-5"):  # every generate_until answer was '' (exit 0)
        with pytest.raises(UserError, match=f"max_gen_toks must be at least 1 \\(got {value}\\)"):
            TangoLM(checkpoint=str(run_dir), max_gen_toks=value)
    with pytest.raises(UserError, match="max_batch_size must be at least 1"):
        TangoLM(checkpoint=str(run_dir), batch_size="auto", max_batch_size="0")
    assert TangoLM(pretrained=str(run_dir), device="cpu").checkpoint.path.name == "step-00000030"


def test_tango_lm_eval_prints_the_adapters_errors_as_one_line(run_dir, capsys, monkeypatch):
    """`tango-lm-eval run --model tango-lm --model_args checkpoint=/nope ...`: lm-eval builds the
    model inside its command line, whose UserError was a traceback and exit code 1."""
    import lm_eval.__main__

    from tango_lm.eval import lm_eval_adapter

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: TangoLM(checkpoint=str(run_dir / "nope")))
    with pytest.raises(SystemExit) as info:
        lm_eval_adapter.main()
    assert info.value.code == 2
    assert "does not exist" in helpers.assert_one_error_line(capsys.readouterr().err)


def test_moe_is_scored_at_its_evaluation_capacity(tmp_path):
    """Training capacity 0.5 drops tokens; external evaluation runs at capacity_factor_eval."""
    run = RunConfig.from_dict(
        {
            "model": {
                **helpers.TINY_MODEL,
                "arch": "moe",
                "n_kv_heads": 2,
                "n_experts": 4,
                "moe_top_k": 2,
                "capacity_factor_train": 0.5,
                "capacity_factor_eval": 4.0,
            },
            "data": {"dir": str(tmp_path / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(tmp_path)},
        }
    )
    torch.manual_seed(0)
    model = run.model.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    tok = get_tokenizer("byte")
    path = save_checkpoint(tmp_path / "checkpoints", 1, model.state_dict(), {}, run.to_dict(), tok.to_dict(), {})
    lm = TangoLM(checkpoint=str(path), device="cpu")
    context, continuation = tok.encode("abcdefghij klmnop"), tok.encode(" qrstuvw")
    ((ll, _),) = lm.loglikelihood([_request("loglikelihood", ("abcdefghij klmnop", " qrstuvw"))])
    model = lm.model
    with capacity_factor(model, 4.0):
        at_eval, _ = direct_loglikelihood(model, context, continuation, 32)
    at_train, _ = direct_loglikelihood(model, context, continuation, 32)
    assert ll == pytest.approx(at_eval, rel=1e-5) and abs(at_eval - at_train) > 1e-3
    [rolled] = lm.loglikelihood_rolling([_request("loglikelihood_rolling", ("abcdefghij klmnop",))])
    with capacity_factor(model, 4.0):
        assert rolled == pytest.approx(direct_rolling(model, context, tok.eot_id, 32), rel=1e-5)


def test_unknown_task_is_lm_eval_s_own_error(lm):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(TASKS), include_defaults=False)
    with pytest.raises(KeyError, match="no_such_task"):
        lm_eval.simple_evaluate(model=lm, tasks=["no_such_task"], task_manager=manager)


# -- lm-eval's command line ----------------------------------------------------------------------
def _samples(results_dir: Path, task: str) -> list[dict]:
    [path] = glob.glob(str(results_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return sorted(rows, key=lambda r: r["doc_id"])


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def test_lm_eval_command_line_scores_equal_direct_log_probs(cli_run, lm):
    proc, results_dir = cli_run
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    [results_file] = glob.glob(str(results_dir / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(results_file).read_text())["results"]
    tok, model = lm.tok, lm.model

    # Multiple choice: acc = argmax over the choices' summed log-probs of " " + choice.
    correct = correct_norm = 0
    mc_docs = _docs("mc.jsonl")
    for doc, sample in zip(mc_docs, _samples(results_dir, "tango_mc"), strict=True):
        lls = [
            direct_loglikelihood(model, tok.encode(doc["question"]), tok.encode(" " + c), 32)[0] for c in doc["choices"]
        ]
        reported = [float(r[0]) for r in sample["filtered_resps"]]
        assert reported == pytest.approx(lls, rel=1e-5, abs=1e-4)
        correct += max(range(len(lls)), key=lls.__getitem__) == doc["label"]
        normed = [ll / len(c) for ll, c in zip(lls, doc["choices"], strict=True)]
        correct_norm += max(range(len(lls)), key=normed.__getitem__) == doc["label"]
    assert results["tango_mc"]["acc,none"] == pytest.approx(correct / len(mc_docs))
    assert results["tango_mc"]["acc_norm,none"] == pytest.approx(correct_norm / len(mc_docs))

    # Rolling perplexity: word_perplexity = exp(-total log-prob / words), words as lm-eval counts them.
    ppl_docs = [d["text"] for d in _docs("ppl.jsonl")]
    lls = [direct_rolling(model, tok.encode(text), tok.eot_id, 32) for text in ppl_docs]
    assert any(len(tok.encode(text)) > 64 for text in ppl_docs)  # several windows
    reported = [float(s["filtered_resps"][0]) for s in _samples(results_dir, "tango_ppl")]
    assert reported == pytest.approx(lls, rel=1e-5)
    words = sum(len(text.split()) for text in ppl_docs)
    n_bytes = sum(len(text.encode("utf-8")) for text in ppl_docs)
    ppl = results["tango_ppl"]
    assert ppl["word_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / words), rel=1e-5)
    assert ppl["byte_perplexity,none"] == pytest.approx(math.exp(-sum(lls) / n_bytes), rel=1e-5)
    assert ppl["bits_per_byte,none"] == pytest.approx(-sum(lls) / n_bytes / math.log(2), rel=1e-5)

    # Generation: greedy with the decode cache, cut at the task's stop strings.
    gen_docs = _docs("gen.jsonl")
    outs = [direct_generation(model, tok, d["prompt"], 6, [" ", "\n"], 32) for d in gen_docs]
    assert [s["filtered_resps"][0] for s in _samples(results_dir, "tango_gen")] == outs
    matches = sum(o == d["answer"] for o, d in zip(outs, gen_docs, strict=True))
    assert results["tango_gen"]["exact_match,none"] == pytest.approx(matches / len(gen_docs))
