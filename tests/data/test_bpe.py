"""BPE tokenizer training: round trips, the saved description, datasets and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.data.bpe import LONGEST_TRAINING_WORD, train_bpe, training_pieces, training_texts
from tango_lm.data.files import prepare_files
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.tokenizers import BPETokenizer, get_tokenizer, same_tokenizer, tokenizer_from_dict
from tango_lm.errors import UserError
from tests import helpers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def square(x):\n    return x * x\n\n\nprint(square(12))\n",
    "theorem add_zero (n : Nat) : n + 0 = n := by\n  simp\n",
    "Unicode: héllo wörld, 日本語, emoji 😀, math ∑ x² ≤ π",
] * 5
TEXTS = [
    "Hello world",
    "",
    "  tabs\tand\nnew lines\n\n",
    "never seen: zqxj ꙮ 🦜",
    "a <|endoftext|> b",
    "def square(x):\n    return x * x",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(CORPUS[:4]):
        (d / f"doc{i}.txt").write_text(text * 4, encoding="utf-8")
    (d / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> tuple[BPETokenizer, Path]:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe([corpus], 400, out, progress=False), out


def test_round_trip_and_eot(trained):
    tok, _ = trained
    assert 257 < tok.vocab_size <= 400 and tok.eot_id == 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eot_id not in ids  # "<|endoftext|>" in text is ordinary text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    # encode goes through encode_batch (which releases the GIL): the ids of the library's own encode
    assert [tok.encode(t) for t in TEXTS] == [tok._tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"


def test_description_restores_exactly(trained):
    tok, path = trained
    d = json.loads(json.dumps(tok.to_dict()))
    assert d["name"] == "bpe" and len(d["fingerprint"]) == 64 and isinstance(d["hf_tokenizer"], str)
    again = tokenizer_from_dict(d)
    assert same_tokenizer(d, again.to_dict())
    assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    from_file = get_tokenizer(f"bpe:{path}")
    assert from_file.fingerprint() == tok.fingerprint()
    # A re-indented file is the same tokenizer.
    pretty = path.with_name("pretty.json")
    pretty.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    assert get_tokenizer(f"bpe:{pretty}").fingerprint() == tok.fingerprint()
    changed = json.loads(d["hf_tokenizer"])
    changed["model"]["vocab"]["zzz"] = max(changed["model"]["vocab"].values()) + 1
    with pytest.raises(UserError, match="fingerprint"):
        tokenizer_from_dict({**d, "hf_tokenizer": json.dumps(changed)})
    with pytest.raises(UserError, match="lacks its `hf_tokenizer`"):
        tokenizer_from_dict({k: v for k, v in d.items() if k != "hf_tokenizer"})


def test_training_is_deterministic(corpus, trained, tmp_path):
    again = train_bpe([corpus], 400, tmp_path / "t.json", progress=False)
    assert again.fingerprint() == trained[0].fingerprint()
    smaller = train_bpe([corpus], 300, tmp_path / "s.json", progress=False)
    assert smaller.fingerprint() != again.fingerprint() and smaller.vocab_size == 300


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain words only",
        "x" * 257,
        "ab " + "x" * 600 + "  " + " " * 300 + "end",
        "é" * 1000 + "\n" * 513,
        "y" * 512,
        "https://example.com/" + "/".join(["path", "to", "some", "file"] * 30),  # long, but short words
        ",".join(str(i) for i in range(200)),
    ],
)
def test_training_pieces_join_back_and_cut_only_words_past_the_limit(text):
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pieces = list(training_pieces(text, pre))
    assert "".join(pieces) == text
    words = [b - a for _, (a, b) in pre.pre_tokenize_str(text)]
    assert max((b - a for p in pieces for _, (a, b) in pre.pre_tokenize_str(p)), default=0) <= LONGEST_TRAINING_WORD
    assert len(pieces) == 1 + sum(-(-n // LONGEST_TRAINING_WORD) - 1 for n in words)
    if max(words, default=0) <= LONGEST_TRAINING_WORD:  # the trainer reads exactly the words it read before
        assert pieces == [text]


def test_a_line_without_spaces_trains_as_pieces(tmp_path):
    # One 200 kB word took the trainer 27 s (the square of its length); its pieces take a second.
    (tmp_path / "min.txt").write_text("abcdefghij" * 20_000 + "\n" + "the end of it\n")
    tok = train_bpe([tmp_path / "min.txt"], 300, tmp_path / "tok.json", progress=False)
    assert tok.decode(tok.encode("abcdefghij" * 3)) == "abcdefghij" * 3
    assert len(tok.encode("abcdefghij" * 30)) < 30  # it learned the repeat's merges


def test_prepared_dataset_carries_the_tokenizer(corpus, trained, tmp_path):
    tok, path = trained
    out = prepare_files(
        "jsonl", [corpus / "more.jsonl"], tmp_path / "d", f"bpe:{path}", dev_fraction=0, test_fraction=0, progress=False
    )
    path.rename(path.with_name("moved.json"))  # the dataset must not need the file any more
    try:
        ds = PreparedDataset.open(out, verify=True)
        assert ds.tokenizer.fingerprint() == tok.fingerprint()
        expected = [i for t in CORPUS for i in tok.encode(t) + [tok.eot_id]]
        assert ds.tokens("train").tolist() == expected
        # The dataset's tokenizer.json is itself a valid --tokenizer bpe:PATH.
        assert get_tokenizer(f"bpe:{out / 'tokenizer.json'}").fingerprint() == tok.fingerprint()
    finally:
        path.with_name("moved.json").rename(path)


def test_bad_input(corpus, tmp_path):
    with pytest.raises(UserError, match="must be between 257"):
        train_bpe([corpus], 100, tmp_path / "t.json", progress=False)
    with pytest.raises(UserError, match="does not exist"):
        train_bpe([tmp_path / "missing"], 300, tmp_path / "t.json", progress=False)
    (tmp_path / "exists.json").write_text("{}")
    with pytest.raises(UserError, match="already exists"):
        train_bpe([corpus], 300, tmp_path / "exists.json", progress=False)
    with pytest.raises(UserError, match="no tokenizer file"):
        get_tokenizer(f"bpe:{tmp_path / 'none.json'}")
    with pytest.raises(UserError, match="not a valid Hugging Face tokenizer"):
        get_tokenizer(f"bpe:{tmp_path / 'exists.json'}")
    with pytest.raises(UserError, match="bpe:PATH"):
        get_tokenizer("bpe")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(UserError, match="bad.jsonl, line 2"):
        train_bpe([corpus, bad], 300, tmp_path / "t2.json", progress=False)  # fails mid-training
    assert not (tmp_path / "t2.json").exists()


def test_a_vocabulary_past_the_cap_and_an_output_that_is_an_input_are_refused(corpus, tmp_path):
    # 2**32 aborted in `tokenizers` (a 283 GB allocation, a Rust backtrace); past 2**64 OverflowError.
    for size in (2**24 + 1, 2**32, 10**20):
        with pytest.raises(UserError, match=r"between 257 \(256 bytes \+ end-of-text\) and 16,777,216"):
            train_bpe([corpus], size, tmp_path / "t.json", progress=False)
    # --overwrite replaced the corpus with the tokenizer's JSON
    text = corpus / "doc0.txt"
    before = text.read_bytes()
    with pytest.raises(UserError, match="is one of the inputs; save the tokenizer to another file"):
        train_bpe([corpus], 300, text, overwrite=True, progress=False)
    assert text.read_bytes() == before


def test_hand_edited_tokenizers_that_shards_cannot_hold_are_refused(trained, tmp_path):
    _, path = trained
    data = json.loads(path.read_text())
    sparse = json.loads(json.dumps(data))
    sparse["model"]["vocab"]["e"] = 70_000  # an id past the count: shards and models take 0 .. n - 1
    (tmp_path / "sparse.json").write_text(json.dumps(sparse))
    with pytest.raises(UserError, match="ids are not 0 to"):
        get_tokenizer(f"bpe:{tmp_path / 'sparse.json'}")
    plain = json.loads(json.dumps(data))
    plain["added_tokens"][0]["special"] = False  # "<|endoftext|>" in a document would then end it
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    with pytest.raises(UserError, match="is not a special token"):
        get_tokenizer(f"bpe:{tmp_path / 'plain.json'}")


def test_cli_train_tokenizer(corpus, tmp_path, capsys):
    out = tmp_path / "tok.json"
    rc = main(
        [
            "data",
            "train-tokenizer",
            "--input",
            str(corpus / "doc0.txt"),
            str(corpus / "more.jsonl"),
            "--vocab-size",
            "320",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert f"bpe:{out}" in capsys.readouterr().out
    tok = get_tokenizer(f"bpe:{out}")
    assert tok.vocab_size == 320
    ds = write_prepared(tmp_path / "ds", tok, {"train": TEXTS}, {}, progress=False)
    assert PreparedDataset.open(ds).tokenizer.encode("Hello world") == tok.encode("Hello world")


def test_train_tokenizer_off_a_terminal_writes_lines_and_trains_the_same_merges(corpus, trained, tmp_path, capsys):
    # A batch job's log (pytest's captured stderr is no terminal): the trainer's bars are off there,
    # and a corpus of hours was read and merged without a word until the last line.
    out = tmp_path / "tok.json"
    assert main(["data", "train-tokenizer", "--input", str(corpus), "--vocab-size", "400", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    docs = len(list(training_texts([corpus])))
    assert err[0].startswith("train-tokenizer: read: 1 doc, 0s elapsed")  # the first line comes at once
    assert err[-2].startswith(f"train-tokenizer: read: {docs} docs, ")  # the count it ended at
    assert err[-1] == "train-tokenizer: merging pairs into up to 400 ids"
    assert get_tokenizer(f"bpe:{out}").fingerprint() == trained[0].fingerprint()
    main(
        [
            "data",
            "train-tokenizer",
            "--input",
            str(corpus),
            "--vocab-size",
            "400",
            "--out",
            str(out),
            "--overwrite",
            "--no-progress",
        ]
    )
    assert capsys.readouterr().err == ""


def test_train_tokenizer_out_must_name_a_file_not_a_directory(corpus, tmp_path):
    for out in (f"{tmp_path / 'new'}/", str(tmp_path)):
        with pytest.raises(
            UserError, match=r"is a directory; name the tokenizer's JSON file, e\.g\. .*tokenizer\.json"
        ):
            train_bpe([str(corpus / "doc0.txt")], 300, out, progress=False)
    assert not (tmp_path / "new").exists()


def test_train_tokenizer_leaves_installed_packages_and_excluded_directories_out(tmp_path, capsys):
    """A source tree is walked as `data prepare code` walks it: an installed package's undecodable
    file stops nothing, and --exclude-dir leaves out what else the user names."""
    tree = tmp_path / "tree"
    for rel, data in {
        "a.py": b"x = 1\n",
        "lib/site-packages/pkg/bad.py": b"s = '\xe9'\n",
        "test/bad.py": b"s = '\xe9'\n",
    }.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(data)
    assert list(training_texts([tree], exts=[".py"], exclude_dirs=("test", "site-packages"))) == ["x = 1\n"]
    argv = ["data", "train-tokenizer", "--input", str(tree), "--ext", ".py", "--vocab-size", "300", "--no-progress"]
    rc, _, err, _ = helpers.run_main(capsys, [*argv, "--out", str(tmp_path / "a.json")])
    assert rc == 2 and f"{tree / 'test' / 'bad.py'} is not UTF-8 text" in err  # only the one not excluded
    rc, _, err, _ = helpers.run_main(capsys, [*argv, "--out", str(tmp_path / "b.json"), "--exclude-dir", "test"])
    assert rc == 0, err


def test_train_tokenizer_out_inside_a_dataset_or_a_run_is_refused(corpus, tmp_path):
    """Re-preparing the dataset (or replacing the run) would take the tokenizer with it."""
    ds = write_prepared(tmp_path / "ds", get_tokenizer("byte"), {"train": TEXTS}, {}, progress=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "data": {}, "train": {}}))
    for holder, what in ((ds, "prepared dataset"), (run, "run directory")):
        out = holder / "sub" / "bpe.json"
        with pytest.raises(
            UserError, match=f"^--out {out} is inside the {what} {holder}; save the tokenizer outside it$"
        ):
            train_bpe([str(corpus / "doc0.txt")], 300, out, progress=False)
        assert not out.parent.exists()


def test_a_prepared_datasets_description_of_another_tokenizer_names_it(tmp_path):
    ds = write_prepared(tmp_path / "ds", get_tokenizer("byte"), {"train": TEXTS}, {}, progress=False)
    with pytest.raises(UserError, match=r"describes tango-lm's 'byte' tokenizer, not a BPE; use --tokenizer byte"):
        get_tokenizer(f"bpe:{ds / 'tokenizer.json'}")


def test_a_tokenizer_json_that_truncates_or_pads_still_encodes_whole_documents(trained, tmp_path):
    # A hub tokenizer.json often enables truncation (at 512, say) or padding; data prepare would
    # then cut every document short, or write padding ids (here the end-of-text id) into shards.
    from tokenizers import Tokenizer as HFTokenizer

    tok, path = trained
    hf = HFTokenizer.from_file(str(path))
    hf.enable_truncation(max_length=3)
    hf.enable_padding(length=64, pad_id=tok.eot_id, pad_token="<|endoftext|>")
    hf.save(str(tmp_path / "hub.json"))
    hub = get_tokenizer(f"bpe:{tmp_path / 'hub.json'}")
    assert [hub.encode(t) for t in TEXTS] == hub.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert hub.fingerprint() == tok.fingerprint()  # the same ids for every text
    ds = write_prepared(tmp_path / "ds", hub, {"train": TEXTS}, {}, progress=False)
    assert PreparedDataset.open(ds, verify=True).num_documents("train") == len(TEXTS)
