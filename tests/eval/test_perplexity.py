"""External perplexity (docs/design.md §6): rolling-window document NLL, WikiText word perplexity and
LAMBADA last-word perplexity/accuracy, each checked against a brute-force computation that runs
the model on every token's full prefix."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from tango_lm import build_model
from tango_lm.cli import main
from tango_lm.data.tokenizers import ByteTokenizer
from tango_lm.errors import UserError
from tango_lm.eval.perplexity import (
    document_logprobs,
    evaluate_file,
    lambada_metrics,
    read_lambada,
    read_text_file,
    rolling_windows,
    split_blank_lines,
    split_wikitext,
    whole_file,
    wikitext_detokenize,
)
from tango_lm.models.config import ModelConfig
from tests import helpers

CONTEXT = 16
TOK = ByteTokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # A large init makes the random model's predictions far from uniform, so errors show.
    cfg = ModelConfig(
        arch="tango", d_model=32, head_dim=16, width=64, depth=2, vocab_size=257, context_length=CONTEXT, init_std=0.3
    )
    return build_model(cfg).eval()


@torch.no_grad()
def brute_logprobs(model, ids: list[int], start_of) -> list[float]:
    """log p(ids[i]) from the model run on s[start_of(t) : t], s = [EOT] + ids, t = i + 1."""
    s = [TOK.eot_id, *ids]
    out = []
    for t in range(1, len(s)):
        prefix = torch.tensor([s[start_of(t) : t]])
        out.append(float(model(prefix)[0, -1, s[t]]))
    return out


def truncated_prefix(t: int) -> int:
    """The full prefix, truncated to the context: what stride 1 must reproduce."""
    return max(0, t - CONTEXT)


def rolling_start(n: int, stride: int):
    """Where the window that scores target t starts, written out independently of the library:
    window k covers [kS, kS + C) and scores targets up to kS + C; the final one is moved back
    to a full context."""

    def start(t: int) -> int:
        if t <= CONTEXT:
            return 0
        k = -(-(t - CONTEXT) // stride)
        end = min(k * stride + CONTEXT, n)
        return max(0, end - CONTEXT)

    return start


# -- windows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5, 16, 17, 40, 63])
@pytest.mark.parametrize("stride", [1, 3, 8, 16])
def test_rolling_windows_score_every_token_once(n, stride):
    windows = rolling_windows(n, CONTEXT, stride)
    scored = []
    for a, e, k in windows:
        assert 0 <= a < e <= n and e - a <= CONTEXT and 1 <= k <= e - a
        targets = list(range(e - k + 1, e + 1))
        scored += targets
        if a > 0:  # later windows condition every new token on at least C - S earlier ones
            assert min(targets) - a >= CONTEXT - stride
    assert scored == list(range(1, n + 1))


def test_stride_out_of_range_is_a_user_error():
    with pytest.raises(UserError, match="stride"):
        rolling_windows(10, CONTEXT, CONTEXT + 1)
    with pytest.raises(UserError, match="stride"):
        rolling_windows(10, CONTEXT, 0)


# -- document NLL against brute force ----------------------------------------------------------
DOCS = ["the cat sat on the mat and looked at the dog", "a", "short doc", "x" * 40 + " tail words here"]


@pytest.mark.parametrize("stride", [1, 5, CONTEXT])
def test_document_logprobs_match_brute_force(model, stride):
    ids = [TOK.encode(d) for d in DOCS]
    got = document_logprobs(model, ids, TOK.eot_id, CONTEXT, stride, batch_size=3)
    for doc, lp in zip(ids, got, strict=True):
        assert len(lp) == len(doc)
        want = brute_logprobs(model, doc, rolling_start(len(doc), stride))
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(want), rtol=0, atol=2e-5)
    if stride == 1:  # the exact case: every token sees its full prefix truncated to the context
        for doc, lp in zip(ids, got, strict=True):
            want = brute_logprobs(model, doc, truncated_prefix)
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(want), rtol=0, atol=2e-5)


def test_text_format_word_perplexity(model, tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("\n\n".join(DOCS[:3]) + "\n\n\n  \n" + DOCS[3] + "\n")
    res = evaluate_file(model, TOK, path, "text", CONTEXT, stride=4)
    total = -sum(sum(brute_logprobs(model, TOK.encode(d), rolling_start(len(TOK.encode(d)), 4))) for d in DOCS)
    words = sum(len(d.split()) for d in DOCS)
    assert res["documents"] == 4 and res["words"] == words
    assert res["tokens"] == sum(len(d.encode()) for d in DOCS)
    assert res["word_perplexity"] == pytest.approx(math.exp(total / words), rel=1e-5)
    assert res["nll"] == pytest.approx(total / res["tokens"], rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(total / res["bytes"] / math.log(2), rel=1e-5)
    assert res["bytes"] == sum(len(d.encode()) for d in DOCS)


def test_document_format_scores_the_whole_file_as_one_document(model, tmp_path):
    # --format text cut a source file or a book at every blank line, an end-of-text token each time
    path = tmp_path / "module.py"
    text = "\n\n".join(DOCS) + "\n\n\n    indented\n"
    path.write_text(text)
    res = evaluate_file(model, TOK, path, "document", CONTEXT, stride=4)
    ids = TOK.encode(text)
    total = -sum(brute_logprobs(model, ids, rolling_start(len(ids), 4)))
    assert res["documents"] == 1 and res["tokens"] == len(ids) == res["bytes"]
    assert res["nll"] == pytest.approx(total / len(ids), rel=1e-5)
    assert res["words"] == len(text.split())
    split = evaluate_file(model, TOK, path, "text", CONTEXT, stride=4)
    assert split["documents"] == len(DOCS) + 1 and split["nll"] != pytest.approx(res["nll"], rel=1e-5)


def test_document_format_reads_a_file_as_data_prepare_text_does(tmp_path):
    from tango_lm.data.files import text_documents

    path = tmp_path / "book.txt"
    path.write_bytes(b"\xef\xbb\xbf  Chapter 1\r\n\r\nIt was a dark night.\r\n\r\n")
    assert whole_file(read_text_file(path)) == list(text_documents([path]))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    assert whole_file(read_text_file(blank)) == [] == list(text_documents([blank]))


def test_bits_per_byte_counts_the_utf8_bytes_of_the_text(model, tmp_path):
    # Characters counted as bytes gave "naïve café über" 15 bytes, not 18: bits per byte 20% high.
    path = tmp_path / "doc.txt"
    path.write_text("naïve café über\n", encoding="utf-8")
    res = evaluate_file(model, TOK, path, "text", CONTEXT, stride=4)
    assert res["bytes"] == len("naïve café über".encode()) == 18


WIKI = "\n".join(
    [  # WikiText lines start and end with a space
        " ",
        " = Robert Boulter = ",
        " ",
        " Robert Boulter is an English film , television and theatre actor . ",
        " ",
        " = = Career = = ",
        " ",
        " In 2000 Boulter had a guest @-@ starring role ( in 1 @,@ 000 episodes ) . ",
        " = Du Fu = ",
        " ",
        " Du Fu was a Chinese poet .",
        "",
    ]
)


def test_wikitext_documents_and_detokenization(model, tmp_path):
    docs = split_wikitext(WIKI)
    assert len(docs) == 2  # a new article at each top-level heading, not at "= = Career = ="
    assert docs[0].lstrip("\n ").startswith("= Robert Boulter =") and "= = Career = =" in docs[0]
    assert docs[1].startswith(" = Du Fu = ")
    detok = wikitext_detokenize(docs[0])
    assert "guest-starring" in detok and "(in 1,000 episodes)" in detok and "film, television" in detok
    assert "actor." in detok and "== Career ==" in detok

    path = tmp_path / "wiki.test.raw"
    path.write_text(WIKI)
    res = evaluate_file(model, TOK, path, "wikitext", CONTEXT)
    total = 0.0
    for d in docs:
        ids = TOK.encode(wikitext_detokenize(d))
        total -= sum(brute_logprobs(model, ids, rolling_start(len(ids), CONTEXT)))
    words = sum(len(d.split()) for d in docs)  # counted in the original text
    assert res["documents"] == 2 and res["words"] == words
    assert res["word_perplexity"] == pytest.approx(math.exp(total / words), rel=1e-5)


def test_blank_line_documents():
    assert split_blank_lines("a b\nc\n\n\n d \n \t\nlast") == ["a b\nc", " d ", "last"]
    # a line of any whitespace separates, as data prepare reads it (a no-break space had joined them)
    assert split_blank_lines("aaa\n\u00a0\nbbb\n\f\nccc\u3000\n\u3000\n") == ["aaa", "bbb", "ccc\u3000"]


@pytest.mark.parametrize(
    "content",
    [
        b"    It was a dark night.\n    The rain fell.\n\n  Chapter 2  \n",  # indented paragraphs, trailing spaces
        b"\xef\xbb\xbf\r\n\r\nfirst\r\n \t \r\nsecond\rthird\n\n\n",  # BOM, CRLF, CR, a line of spaces
        b"def f():\n    return 1\n\n\ndef g():\n    pass",  # code, no newline at the end
    ],
)
def test_text_documents_are_those_data_prepare_makes_of_the_file(tmp_path, content):
    # --ppl stripped each paragraph: an indented one was scored without the indent the model trained on
    from tango_lm.data.files import text_documents

    path = tmp_path / "file.txt"
    path.write_bytes(content)
    assert split_blank_lines(read_text_file(path)) == list(text_documents([path], split_on_blank_lines=True))
    assert split_wikitext("one\n\ntwo") == ["one", "two"]  # no headings: blank-line documents


# -- LAMBADA -----------------------------------------------------------------------------------
class Bigram(nn.Module):
    """A hand-made model: log-probs depend on the previous token only (a lookup table)."""

    def __init__(self, table: dict[str, str], rows: int = 257) -> None:
        super().__init__()
        logits = torch.zeros(257, rows)  # rows past the tokenizer's 257 ids: a padded table
        logits[:, 0] = 1.0  # by default the most likely next token is byte 0
        for prev, nxt in table.items():
            logits[ord(prev), ord(nxt)] = 5.0
        self.logits = nn.Parameter(logits)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits[ids], dim=-1)


def test_lambada_matches_brute_force_and_counts_greedy_hits(tmp_path):
    bigram = Bigram({"x": " ", " ": "y", "y": "z"})
    path = tmp_path / "lambada.jsonl"
    lines = [{"text": "ax yz"}, {"text": "the cat ab cd"}, {"text": "long context " * 3 + "yz"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    examples = read_lambada(path)
    assert examples[1] == ("the cat ab", "cd")
    res = lambada_metrics(bigram, TOK, examples, CONTEXT)
    nlls = []
    hits = 0
    for context, target in examples:
        s = [TOK.eot_id, *TOK.encode(context), *TOK.encode(" " + target)][-(CONTEXT + 1) :]
        k = len(TOK.encode(" " + target))
        with torch.no_grad():
            logp = bigram(torch.tensor([s[:-1]]))[0]
        nlls.append(-sum(float(logp[t - 1, s[t]]) for t in range(len(s) - k, len(s))))
        hits += all(int(logp[t - 1].argmax()) == s[t] for t in range(len(s) - k, len(s)))
    assert hits == 1 and res["correct"] == 1 and res["accuracy"] == pytest.approx(1 / 3)
    assert res["last_word_perplexity"] == pytest.approx(math.exp(sum(nlls) / 3), rel=1e-6)


def test_lambada_accuracy_takes_the_argmax_over_the_tokenizers_ids_not_the_padding_rows():
    # Greedy decoding never draws a padding row (design.md §8.17), so a padding row above the
    # target does not make the word wrong: the same rule as the lm-eval adapter's greedy flags.
    bigram = Bigram({"x": " ", " ": "y", "y": "z"}, rows=300)
    with torch.no_grad():
        bigram.logits[ord("y"), 299] = 6.0  # above z's 5.0
    res = lambada_metrics(bigram, TOK, [("ax", "yz")], CONTEXT)
    assert res["correct"] == 1


def test_lambada_on_the_tango_model_and_plain_lines(model, tmp_path):
    path = tmp_path / "lambada.txt"
    path.write_text("she opened the door and saw her\nthe end of the long story was near\n\n")
    examples = read_lambada(path)
    assert examples == [("she opened the door and saw", "her"), ("the end of the long story was", "near")]
    res = lambada_metrics(model, TOK, examples, CONTEXT, batch_size=1)
    want = []
    for context, target in examples:
        s = [TOK.eot_id, *TOK.encode(context), *TOK.encode(" " + target)][-(CONTEXT + 1) :]
        k = len(TOK.encode(" " + target))
        with torch.no_grad():
            logp = model(torch.tensor([s[:-1]]))[0]
        want.append(-sum(float(logp[t - 1, s[t]]) for t in range(len(s) - k, len(s))))
    assert res["mean_nll"] == pytest.approx(sum(want) / 2, rel=1e-5)


# -- bad files ---------------------------------------------------------------------------------
BAD_FILES = {
    "no_last_word": ("lambada", "a fine passage with its word\nlonely\n", "no last word"),
    "empty_text_field": ("lambada", '{"text": "x y"}\n{"text": "   "}\n', "line 2"),
    "jsonl_does_not_parse": ("lambada", '{"text": "a b"}\n{"text": "c d"\n', "not valid JSON"),
    "no_text_field": ("lambada", '{"txt": "a b"}\n', 'no string "text" field'),
    "binary": ("text", b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary"),
    "not_utf8": ("wikitext", b"caf\xe9 au lait", "not UTF-8"),
    "empty": ("text", "\n\n  \n", "no text"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_are_user_errors(model, tmp_path, case):
    fmt, content, message = BAD_FILES[case]
    path = tmp_path / "file"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=message):
        evaluate_file(model, TOK, path, fmt, CONTEXT)


# -- the command line --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    data = helpers.synthetic_dataset(tmp_path_factory)
    out = tmp_path_factory.mktemp("ppl") / "run"
    with helpers.one_thread():
        from tango_lm.train.trainer import train

        train(helpers.run_config(data, out, steps=2, eval_every=2, save_every=2))
    return out


def test_ppl_of_a_checkpoint_whose_config_has_no_train_section(run_dir, tmp_path, capsys):
    # A checkpoint from before sums of config.json, hand-edited: eval --ppl was a KeyError traceback;
    # it reads only the window, precision and batch there, and scores with their defaults.
    import shutil

    step = tmp_path / "step"
    shutil.copytree(sorted((run_dir / "checkpoints").iterdir())[-1], step)
    config = json.loads((step / "config.json").read_text())
    del config["train"]
    (step / "config.json").write_text(json.dumps(config))
    meta = json.loads((step / "meta.json").read_text())
    del meta["sha256"]["config.json"]
    (step / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "t.txt").write_text("some text to score\n")
    assert main(["eval", str(step), "--ppl", str(tmp_path / "t.txt"), "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == helpers.TINY_MODEL["context_length"]


def test_cli_ppl_json_matches_library(run_dir, tmp_path, capsys):
    from tango_lm.train.checkpoint import load_checkpoint

    path = tmp_path / "wiki.raw"
    path.write_text(WIKI)
    assert (
        main(
            [
                "eval",
                str(run_dir),
                "--ppl",
                str(path),
                "--format",
                "wikitext",
                "--stride",
                "8",
                "--device",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    model = load_checkpoint(run_dir).build_model("cpu")
    want = evaluate_file(model, TOK, path, "wikitext", helpers.SEQ_LEN, stride=8)
    assert res["word_perplexity"] == pytest.approx(want["word_perplexity"], rel=1e-6)
    assert res["context"] == helpers.SEQ_LEN and res["stride"] == 8 and res["step"] == 2
    # The line gives what the README says --ppl reports: per-token NLL and perplexity, word perplexity.
    assert main(["eval", str(run_dir), "--ppl", str(path), "--format", "wikitext", "--stride", "8"]) == 0
    line = capsys.readouterr().out
    assert f"token perplexity {res['token_perplexity']:.3f}, word perplexity {res['word_perplexity']:.3e}" in line
    assert f"{res['nll']:.4f} nats/token" in line

    lam = tmp_path / "l.txt"
    lam.write_text("a b c\nd e f\n")
    assert main(["eval", str(run_dir), "--ppl", str(lam), "--format", "lambada", "--device", "cpu"]) == 0
    assert "last-word perplexity" in capsys.readouterr().out

    assert main(["eval", str(run_dir), "--ppl", str(path), "--format", "document", "--device", "cpu"]) == 0
    assert "over 1 document, " in capsys.readouterr().out  # the WikiText file as one document


def test_a_perplexity_past_a_million_prints_with_an_exponent():
    # An untrained model's word perplexity printed as 5256006514061996.000: sixteen digits of noise.
    from tango_lm.cli.train import perplexity_text

    assert perplexity_text(5256006514061996.0) == "5.256e+15"
    assert perplexity_text(999_999.0) == "999999.000" and perplexity_text(75.9164) == "75.916"
    assert perplexity_text(float("inf")) == "inf"


FLAGS = {  # --ppl with what only a split takes, or what --ppl takes without it; --ablate goes with both
    "split_with_ppl": (["--split", "dev"], "--split scores a dataset split and --ppl a file"),
    "windows_and_data_with_ppl": (["--windows", "3", "--data", "d"], "--data and --windows score a dataset split"),
    "ablate_with_ppl_on_one_table": (["--ablate", "A"], "--ablate needs a checkpoint of onóna's twin mixture"),
}


@pytest.mark.parametrize("case", ["no_last_word", "jsonl_does_not_parse", "binary", "missing", "stride", *FLAGS])
def test_cli_bad_ppl_input_exits_2(run_dir, tmp_path, capsys, case):
    path = tmp_path / "f"
    args = ["--format", "lambada"]
    if case in BAD_FILES:
        fmt, content, _ = BAD_FILES[case]
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        args = ["--format", fmt]
    elif case == "stride":
        path.write_text("some text")
        args = ["--format", "text", "--stride", "999"]
    elif case in FLAGS:
        path.write_text("some text")
        args = FLAGS[case][0]
    assert main(["eval", str(run_dir), "--ppl", str(path), "--device", "cpu", *args]) == 2
    line = helpers.assert_one_error_line(capsys.readouterr().err)
    if case in FLAGS:
        assert FLAGS[case][1] in line


def test_cli_ppl_scores_one_table_of_a_twin_head(tmp_path, capsys):
    from tango_lm.data.tokenizers import get_tokenizer
    from tango_lm.train.checkpoint import load_checkpoint, save_checkpoint
    from tango_lm.train.config import RunConfig

    run = RunConfig.from_dict(
        {
            "model": {**helpers.TINY_MODEL, "head": "onona"},
            "data": {"dir": str(tmp_path / "data")},
            "train": {**helpers.TINY_TRAIN, "out_dir": str(tmp_path)},
        }
    )
    torch.manual_seed(0)
    net = run.model.build()
    with torch.no_grad():  # tables A and B apart, so that each one alone scores differently
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    save_checkpoint(
        tmp_path / "checkpoints", 1, net.state_dict(), {}, run.to_dict(), get_tokenizer("byte").to_dict(), {}
    )
    path = tmp_path / "t.txt"
    path.write_text(WIKI)
    scores = {}
    for ablate in (None, "A", "B"):
        extra = ["--ablate", ablate] if ablate else []
        assert main(["eval", str(tmp_path), "--ppl", str(path), "--device", "cpu", "--json", *extra]) == 0
        res = json.loads(capsys.readouterr().out)
        model = load_checkpoint(tmp_path).build_model("cpu")
        model.head.ablation = ablate.lower() if ablate else None
        want = evaluate_file(model, TOK, path, "text", helpers.SEQ_LEN)
        assert res["nll"] == pytest.approx(want["nll"], rel=1e-6) and res.get("ablate") == ablate
        scores[ablate] = res["nll"]
    assert len(set(scores.values())) == 3


def test_cli_ppl_flags_without_ppl_exit_2(run_dir, capsys):
    for args, said in (
        (["--format", "lambada"], "--format goes with --ppl FILE (a file's perplexity); add --ppl or leave it out"),
        (["--stride", "4"], "--stride goes with --ppl FILE"),
        (
            ["--format", "text", "--stride", "4"],
            "--format and --stride go with --ppl FILE (a file's perplexity); add --ppl or leave them out",
        ),
    ):
        assert main(["eval", str(run_dir), "--device", "cpu", *args]) == 2
        assert said in helpers.assert_one_error_line(capsys.readouterr().err)


def test_a_byte_order_mark_is_not_text(tmp_path):
    # Windows editors start UTF-8 files with U+FEFF: LAMBADA's JSONL test reads the first character.
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text('{"text": "ab cd ef gh"}\n{"text": "ij kl mn"}\n', encoding="utf-8")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert read_lambada(marked) == read_lambada(plain) == [("ab cd ef", "gh"), ("ij kl", "mn")]
    assert read_text_file(marked) == read_text_file(plain)
    # a bad byte's offset is the file's, the BOM counted (it said 2 for byte 5)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xef\xbb\xbfab\xffcd")
    with pytest.raises(UserError, match=r"bad.txt is not UTF-8 text \(bad byte at offset 5\)"):
        read_text_file(bad)


def test_crlf_text_scores_as_the_same_text(tmp_path):
    # `data prepare` reads with universal newlines; --ppl kept each \r as a token to score.
    lf, crlf, cr = (tmp_path / f"{name}.txt" for name in ("lf", "crlf", "cr"))
    lf.write_bytes(b"the cat sat\non the mat\n\nsecond doc\n")
    crlf.write_bytes(lf.read_bytes().replace(b"\n", b"\r\n"))
    cr.write_bytes(lf.read_bytes().replace(b"\n", b"\r"))
    assert read_text_file(crlf) == read_text_file(cr) == read_text_file(lf) == lf.read_text()


def test_lambada_jsonl_lone_surrogate_becomes_the_replacement_character(tmp_path):
    # '\ud800' alone crashed tokenization with a UnicodeEncodeError traceback (data prepare already mapped it)
    path = tmp_path / "lambada.jsonl"
    path.write_text('{"text": "alpha beta \\ud800 gamma delta"}\n')
    ((context, target),) = read_lambada(path)
    assert (context, target) == ("alpha beta \ufffd gamma", "delta")
    assert TOK.encode(context)


def test_ablate_refusal_names_every_registered_head_that_takes_it(monkeypatch):
    """The heads named are the registry's, not a list kept by hand: a new twin head joins them."""
    from types import SimpleNamespace

    from tango_lm.eval.evaluate import model_variant
    from tango_lm.heads.onona import OnonaHead
    from tango_lm.heads.registry import HEADS
    from tango_lm.heads.standard import StandardHead

    monkeypatch.setitem(HEADS, "my-twin", type("MyTwin", (OnonaHead,), {}))
    standard = SimpleNamespace(
        head=StandardHead.__new__(StandardHead), set_active_segment=lambda segment: None, num_segments=None
    )
    ckpt = SimpleNamespace(path="runs/x", config={"model": {"head": "standard"}})
    with pytest.raises(UserError, match=r"\(head onona or factorial-m-mix or my-twin\); runs/x has head 'standard'"):
        model_variant(standard, ckpt, None, "A")


class RecordedBar:
    """Stands in for tqdm: what a bar was told."""

    made: list[RecordedBar] = []

    def __init__(self, total, desc, disable, **kwargs):
        self.total, self.desc, self.disable, self.n, self.closed = total, desc, disable, 0, False
        RecordedBar.made.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.mark.parametrize("what", ["split", "text", "lambada"])
def test_eval_draws_a_token_bar_that_ends_at_its_total(run_dir, tmp_path, monkeypatch, what):
    """`tango-lm eval` was silent for however long a split or a --ppl file took."""
    import tqdm.auto

    from tango_lm.eval.evaluate import evaluate_checkpoint
    from tango_lm.eval.perplexity import evaluate_checkpoint_file

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordedBar)
    RecordedBar.made = []
    path = tmp_path / "f.txt"
    path.write_text("abc def ghi " * 9 + "\n\nkl jk\n" if what == "text" else "a b c\nd e f\n")
    score = {
        "split": lambda progress: evaluate_checkpoint(str(run_dir), "dev", progress=progress),
        "text": lambda progress: evaluate_checkpoint_file(str(run_dir), path, "text", stride=5, progress=progress),
        "lambada": lambda progress: evaluate_checkpoint_file(str(run_dir), path, "lambada", progress=progress),
    }[what]
    assert score(True) == score(False)  # the bar changes no number
    drawn, hidden = RecordedBar.made
    assert not drawn.disable and hidden.disable and drawn.closed
    assert drawn.n == drawn.total > 0
    if what == "split":
        assert drawn.desc == "eval dev" and drawn.total == score(False)["tokens"]


def test_eval_without_a_terminal_writes_its_token_count_as_lines(run_dir, tmp_path, capsys):
    # A long eval in a batch job said nothing until its result (the bar is off there).
    rc, out, err, _ = helpers.run_main(capsys, ["eval", str(run_dir), "--json"])
    assert rc == 0
    tokens = json.loads(out)["tokens"]
    assert err.splitlines()[-1].startswith(f"eval test: {tokens:,}/{tokens:,} tokens (100%), ")
    path = tmp_path / "doc.txt"
    path.write_text("abc def ghi " * 9)
    rc, out, err, _ = helpers.run_main(capsys, ["eval", str(run_dir), "--ppl", str(path), "--format", "document"])
    assert rc == 0 and re.fullmatch(r"eval: ([\d,]+)/\1 tokens \(100%\), .*", err.strip())  # the tokens fed
    rc, _, err, _ = helpers.run_main(capsys, ["eval", str(run_dir), "--no-progress"])
    assert rc == 0 and "tokens" not in err


def test_eval_takes_no_progress(run_dir, capsys):
    assert main(["eval", str(run_dir), "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["split"] == "test"
