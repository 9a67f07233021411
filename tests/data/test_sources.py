"""Document sources: split policy, text/JSONL/Parquet readers, code trees, Hugging Face datasets, CLI."""

from __future__ import annotations

import gzip
import json
import os
import sys
import types
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.data.code_trees import code_documents, prepare_code, stdlib_path
from tango_lm.data.files import jsonl_documents, parquet_documents, prepare_files, text_documents
from tango_lm.data.hf import prepare_hf
from tango_lm.data.inputs import expand_inputs, split_inputs
from tango_lm.data.shards import PreparedDataset
from tango_lm.data.sources import prepare_source
from tango_lm.data.splits import assemble_splits, hold_out, split_of
from tango_lm.data.tokenizers import ByteTokenizer
from tango_lm.errors import UserError
from tests import helpers

BYTE = ByteTokenizer()


def _docs(path: Path, split: str) -> list[str]:
    """Documents of a prepared byte-tokenized split."""
    ds = PreparedDataset.open(path, verify=True)
    out, cur = [], []
    for t in ds.tokens(split).tolist():
        if t == BYTE.eot_id:
            out.append(bytes(cur).decode())
            cur = []
        else:
            cur.append(t)
    return out


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- split policy ---------------------------------------------------------------------------
def test_split_of_is_deterministic_and_near_fractions():
    docs = [f"document {i}" for i in range(4000)]
    got = [split_of(d, 0.1, 0.05, seed=3) for d in docs]
    assert got == [split_of(d, 0.1, 0.05, seed=3) for d in docs]
    assert abs(got.count("dev") / len(docs) - 0.1) < 0.02
    assert abs(got.count("test") / len(docs) - 0.05) < 0.015
    assert got != [split_of(d, 0.1, 0.05, seed=4) for d in docs]  # the seed matters
    assert {split_of(d, 0.0, 0.0) for d in docs} == {"train"}


def test_hold_out_is_one_pass_and_keeps_duplicates_together():
    reads = []

    def stream():
        for i in range(300):
            reads.append(i)
            yield f"doc {i % 250}"  # 50 duplicates

    splits = hold_out(stream(), 0.2, 0.2, seed=1)
    got = {name: list(docs) for name, docs in splits.items()}
    assert len(reads) == 300  # a single pass over the source
    assert sum(len(v) for v in got.values()) == 300
    for name, docs in got.items():
        assert all(split_of(d, 0.2, 0.2, seed=1) == name for d in docs)
    assert not set(got["train"]) & (set(got["dev"]) | set(got["test"]))


def test_hold_out_any_read_order_and_text_with_newlines():
    docs = [f"line one {i}\nline two\n\n" for i in range(100)]
    splits = hold_out(iter(docs), 0.3, 0.3, seed=0)
    test, train, dev = list(splits["test"]), list(splits["train"]), list(splits["dev"])
    assert sorted(test + train + dev) == sorted(docs)


def test_hold_out_split_read_during_pass_is_an_error():
    splits = hold_out(iter(["a", "b", "c"] * 20), 0.3, 0.3)
    train = iter(splits["train"])
    next(train)
    with pytest.raises(RuntimeError, match="while another split"):
        next(iter(splits["dev"]))


def test_assemble_keeps_own_splits_and_holds_out_missing():
    own = {"train": iter([f"t{i}" for i in range(200)]), "test": iter(["x", "y"])}
    splits = assemble_splits(own, 0.25, 0.25, seed=0)
    assert list(splits) == ["train", "dev", "test"]
    got = {k: list(v) for k, v in splits.items()}
    assert got["test"] == ["x", "y"]  # the source's own test split, nothing held out into it
    assert 20 < len(got["dev"]) < 80 and len(got["train"]) + len(got["dev"]) == 200
    with pytest.raises(UserError, match="no train split"):
        assemble_splits({"dev": []}, 0.1, 0.1)
    with pytest.raises(UserError, match="dev_fraction"):
        assemble_splits({"train": []}, 1.5, 0.1)
    assert list(assemble_splits({"train": ["a"]}, 0.0, 0.1)) == ["train", "test"]


# -- inputs and readers ---------------------------------------------------------------------
def test_expand_inputs_dirs_globs_and_missing(tmp_path):
    (tmp_path / "b").mkdir()
    for name in ("a.txt", "b/c.txt", "b/d.md", ".hidden.txt"):
        (tmp_path / name).write_text(name)
    assert [p.name for p in expand_inputs([tmp_path], [".txt"])] == ["a.txt", "c.txt"]
    assert [p.name for p in expand_inputs([str(tmp_path / "**" / "*.md")], [".txt"])] == ["d.md"]
    with pytest.raises(UserError, match="does not exist"):
        expand_inputs([tmp_path / "nope.txt"], [".txt"])
    with pytest.raises(UserError, match="no .jsonl files"):
        expand_inputs([tmp_path], [".jsonl"])


def test_one_file_named_two_ways_is_read_once(tmp_path, monkeypatch):
    # data.jsonl and $PWD/data.jsonl were two inputs: every document went into train twice.
    (tmp_path / "data.jsonl").write_text('{"text": "one"}\n')
    monkeypatch.chdir(tmp_path)
    assert expand_inputs(["data.jsonl", str(tmp_path / "data.jsonl")], [".jsonl"]) == [Path("data.jsonl")]


@pytest.mark.parametrize("kind", ["jsonl", "lean"])
def test_a_file_named_in_two_splits_is_refused(tmp_path, kind):
    # train=x test=x would make the test split the training text; a directory and a file in it too.
    ext = ".jsonl" if kind == "jsonl" else ".lean"
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / f"a{ext}"
    path.write_text('{"text": "one"}\n' if kind == "jsonl" else "theorem t : True := trivial\n")
    for inputs in ([f"train={path}", f"test={path}"], [f"train={tmp_path / 'd'}", f"dev={path}"]):
        with pytest.raises(UserError, match="is an input of both the train and the (test|dev) split"):
            prepare_source(kind, tmp_path / "out", inputs=inputs, tokenizer=BYTE, progress=False)
        assert not (tmp_path / "out").exists()


def test_split_inputs_detects_own_splits(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for name in (
        "train-00000-of-00002.jsonl",
        "train-00001-of-00002.jsonl",
        "validation.jsonl",
        "test.jsonl",
        "README.md",
    ):
        (d / name).write_text("")
    groups = split_inputs([d], [".jsonl"])
    assert {k: [Path(p).name for p in v] for k, v in groups.items()} == {
        "train": ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"],
        "dev": ["validation.jsonl"],
        "test": ["test.jsonl"],
    }
    # A dataset repository's layout: README.md beside data/ holding the split files (the Hub's).
    # Its test and validation files were pooled into the training text.
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("")
    for name in ("train-00000-of-00001.jsonl", "validation-00000-of-00001.jsonl", "test-00000-of-00001.jsonl"):
        (repo / "data" / name).write_text("")
    assert {k: [Path(p).name for p in v] for k, v in split_inputs([repo], [".jsonl"]).items()} == {
        "test": ["test-00000-of-00001.jsonl"],
        "train": ["train-00000-of-00001.jsonl"],
        "dev": ["validation-00000-of-00001.jsonl"],
    }
    assert split_inputs(["train=a.jsonl", "val=b.jsonl"], [".jsonl"]) == {"train": ["a.jsonl"], "dev": ["b.jsonl"]}
    assert split_inputs([d / "test.jsonl"], [".jsonl"]) == {"train": [str(d / "test.jsonl")]}
    with pytest.raises(UserError, match="has no split"):
        split_inputs(["train=a.jsonl", str(d)], [".jsonl"])
    # A mistyped split wrote a split no command reads, and its held-out text was trained on.
    with pytest.raises(UserError, match=r"tst=b.jsonl names the split 'tst'; the splits are train, dev"):
        split_inputs(["train=a.jsonl", "tst=b.jsonl"], [".jsonl"])
    assert split_inputs(["TRAIN=a.jsonl", "Test=b.jsonl"], [".jsonl"]) == {"train": ["a.jsonl"], "test": ["b.jsonl"]}
    (d / "extra.jsonl").write_text("")
    with pytest.raises(UserError, match="and also extra.jsonl"):
        split_inputs([d], [".jsonl"])
    # Dev and test files without train* ones were all trained on, and dev/test drawn from the rest.
    for name in ("train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"):
        (d / name).unlink()
    with pytest.raises(
        UserError, match=r"named after the test and dev split \(test.jsonl, validation.jsonl\) but none"
    ):
        split_inputs([d], [".jsonl"])


def test_split_folders_below_a_named_folder_are_never_trained_on(tmp_path, capsys):
    # corpus/en/test/part-0.jsonl beside corpus/en/train/ (Hugging Face's layout): naming corpus
    # trained on every test document, as the split-named files' check read the file names only.
    for lang in ("en", "de"):
        for split in ("train", "test"):
            (tmp_path / "corpus" / lang / split).mkdir(parents=True)
            rows = "".join(json.dumps({"text": f"{lang} {split} {i}"}) + "\n" for i in range(6))
            (tmp_path / "corpus" / lang / split / "part-0.jsonl").write_text(rows)
    argv = ["data", "prepare", "jsonl", "--out", str(tmp_path / "p"), str(tmp_path / "corpus"), "--tokenizer", "byte"]
    assert main(argv) == 2
    said = helpers.assert_one_error_line(capsys.readouterr().err)
    assert "part-0.jsonl is in " in said and "the test folder of a folder laid out in splits" in said
    assert not (tmp_path / "p").exists()
    # the split folders named on purpose, or a folder with such a layout, are read as given
    for inputs in ([tmp_path / "corpus" / "en" / "test"], [tmp_path / "corpus" / "en", tmp_path / "corpus" / "de"]):
        out = prepare_files("jsonl", inputs, tmp_path / "ok", BYTE, dev_fraction=0.0, progress=False, overwrite=True)
        assert _docs(out, "train")
    assert not [d for d in _docs(out, "train") if " test " in d]


def test_folders_laid_out_in_splits_merge_and_split_named_files_are_never_trained_on(tmp_path, capsys):
    # corpus/en and corpus/de each with train.jsonl and test.jsonl: every test document was trained
    # on, and the test split drawn from the training text (and so for corpus, and for test2.jsonl).
    for lang in ("en", "de"):
        (tmp_path / "corpus" / lang).mkdir(parents=True)
        for split in ("train", "test"):
            rows = "".join(json.dumps({"text": f"{lang} {split} {i}"}) + "\n" for i in range(6))
            (tmp_path / "corpus" / lang / f"{split}.jsonl").write_text(rows)
    langs = [tmp_path / "corpus" / "en", tmp_path / "corpus" / "de"]
    out = prepare_files("jsonl", langs, tmp_path / "both", BYTE, dev_fraction=0.0, progress=False)
    assert sorted(_docs(out, "test")) == sorted(f"{lang} test {i}" for lang in ("en", "de") for i in range(6))
    assert not [d for d in _docs(out, "train") if " test " in d]
    argv = ["data", "prepare", "jsonl", "--out", str(tmp_path / "p"), str(tmp_path / "corpus"), "--tokenizer", "byte"]
    assert main(argv) == 2
    assert "test.jsonl is the test file of a folder laid out in splits" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "docs.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match=r"en has train\*/test\* entries but .*plain does not; give every input"):
        split_inputs([langs[0], tmp_path / "plain"], [".jsonl"])
    # read as given: a split-named file without a train file beside it, one named on purpose, train=
    (tmp_path / "plain" / "test2.jsonl").write_text(json.dumps({"text": "y"}) + "\n")
    lone = tmp_path / "corpus" / "en" / "test.jsonl"
    for inputs in ([tmp_path / "plain"], [lone], [f"train={lone}"]):
        out = prepare_files("jsonl", inputs, tmp_path / "ok", BYTE, progress=False, overwrite=True)
        assert PreparedDataset.open(out).num_documents("train") > 0
    # several folders, one with a test/ entry and no train ones (a Lean project): training text, as before
    (tmp_path / "proj" / "test").mkdir(parents=True)
    (tmp_path / "proj" / "test" / "t.jsonl").write_text(json.dumps({"text": "z"}) + "\n")
    both = [str(tmp_path / "proj"), str(tmp_path / "plain")]
    assert split_inputs(both, [".jsonl"]) == {"train": both}
    with pytest.raises(UserError, match="but none named train, train-"):  # alone: refused, as before
        split_inputs([tmp_path / "proj"], [".jsonl"])


def test_text_documents(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("first para\nstill first\n\n\n  \nsecond\n")
    (tmp_path / "empty.txt").write_text("\n \n")
    assert list(text_documents([a, tmp_path / "empty.txt"])) == [a.read_text()]
    assert list(text_documents([a], split_on_blank_lines=True)) == ["first para\nstill first", "second"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    with pytest.raises(UserError, match="bad.txt is not UTF-8"):
        list(text_documents([bad]))
    # Read line by line, the decoder's offset counts from the chunk it was given, not the file.
    late = tmp_path / "late.txt"
    late.write_bytes(b"hello world\n" * 10_000 + b"bad \xff")
    for paragraphs in (False, True):
        with pytest.raises(UserError, match=r"late.txt is not UTF-8 text \(invalid start byte at byte 120004\)"):
            list(text_documents([late], split_on_blank_lines=paragraphs))


def test_text_and_lean_files_are_read_with_universal_newlines(tmp_path):
    # As the README says: CRLF and CR become LF (Python's text mode); code trees keep their bytes.
    from tango_lm.data.lean import read_lean

    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"first line\r\nsecond\r\n\r\nnext paragraph\rend\r\n")
    assert list(text_documents([crlf])) == ["first line\nsecond\n\nnext paragraph\nend\n"]
    assert list(text_documents([crlf], split_on_blank_lines=True)) == ["first line\nsecond", "next paragraph\nend"]
    lean = tmp_path / "a.lean"
    lean.write_bytes(b"theorem t : True := by\r\n  trivial\r\n")
    assert read_lean(lean) == "theorem t : True := by\n  trivial\n"


def test_a_byte_order_mark_is_not_text(tmp_path):
    # Windows editors start UTF-8 files with U+FEFF; JSON refuses it, and it is no document's text.
    from tango_lm.data.lean import read_lean

    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfhello\n")
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(b'\xef\xbb\xbf{"text": "one"}\n'))
    (tmp_path / "a.lean").write_bytes(b"\xef\xbb\xbftheorem t : True := trivial\n")
    assert list(text_documents([tmp_path / "a.txt"])) == ["hello\n"]
    assert list(jsonl_documents([tmp_path / "a.jsonl"])) == ["one", "two"]
    assert list(jsonl_documents([tmp_path / "a.jsonl.gz"])) == ["one"]
    assert read_lean(tmp_path / "a.lean") == "theorem t : True := trivial\n"


def test_half_a_surrogate_pair_in_jsonl_becomes_the_replacement_character(tmp_path):
    # json.loads takes "\ud800" alone (scraped text has it), but no UTF-8 encoder takes the result.
    (tmp_path / "a.jsonl").write_text('{"text": "bad \\ud800 x"}\n{"text": "pair \\ud83d\\ude00"}\n')
    assert list(jsonl_documents([tmp_path / "a.jsonl"])) == ["bad \ufffd x", "pair \U0001f600"]
    lines = "".join(json.dumps({"text": f"doc {i} \ud800"}) + "\n" for i in range(40))
    (tmp_path / "b.jsonl").write_text(lines, errors="surrogatepass")
    rc = main(
        ["data", "prepare", "jsonl", str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "out"), "--tokenizer", "byte"]
    )
    assert rc == 0  # every split (the held-out ones are spilled as JSON text) takes it


def _damaged_gzips(tmp_path: Path, text: str) -> list[Path]:
    """A .gz cut short (EOFError from gzip) and one whose deflate stream is damaged (zlib.error)."""
    data = gzip.compress(text.encode() * 200)
    cut, damaged = tmp_path / "cut.txt.gz", tmp_path / "damaged.txt.gz"
    cut.write_bytes(data[: len(data) // 2])
    damaged.write_bytes(data[:12] + bytes(b ^ 0xFF for b in data[12:40]) + data[40:])
    return [cut, damaged]


def test_damaged_gzip_inputs_are_one_line_errors(tmp_path):
    for path in _damaged_gzips(tmp_path, "some text\n\n"):
        with pytest.raises(UserError, match=f"cannot read .*{path.name}"):
            list(text_documents([path]))
    for path in _damaged_gzips(tmp_path, json.dumps({"text": "x"}) + "\n"):
        with pytest.raises(UserError, match=f"cannot read .*{path.name}"):
            list(jsonl_documents([path]))


def test_jsonl_documents_and_errors(tmp_path):
    f = _write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two", "id": 2}, {"text": "  "}])
    g = tmp_path / "b.jsonl.gz"
    with gzip.open(g, "wt", encoding="utf-8") as fh:
        fh.write(json.dumps({"body": "zipped"}) + "\n\n")
    assert list(jsonl_documents([f])) == ["one", "two"]
    assert list(jsonl_documents([g], field="body")) == ["zipped"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": oops}\n')
    # The line and column of the file (json's own "line 2 column 1" counted the line's newline).
    with pytest.raises(UserError, match=r"broken.jsonl, line 2, column 10: not valid JSON \(Expecting value\); fix"):
        list(jsonl_documents([broken]))
    unclosed = tmp_path / "unclosed.jsonl"
    unclosed.write_text('{"text": "a"}\n{"text": "b"\n{"text": "c"}\n')
    with pytest.raises(UserError, match=r"line 2, column 13: not valid JSON \(Expecting ',' delimiter\); fix"):
        list(jsonl_documents([unclosed]))
    with pytest.raises(
        UserError,
        match=r"a.jsonl, line 1: the object has no field 'content'; choose the text field with --field \(fields: text\)$",
    ):
        list(jsonl_documents([f], field="content"))
    (tmp_path / "empty.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match=r"empty.jsonl, line 1: the object has no field 'text'; .*\(fields: none\)$"):
        list(jsonl_documents([tmp_path / "empty.jsonl"]))
    (tmp_path / "list.jsonl").write_text('{"text": "one"}\n["a"]\n')  # --field cannot fix a list
    with pytest.raises(
        UserError, match=r'list.jsonl, line 2: a JSON list, not an object such as \{"text": "..."\}; fix'
    ):
        list(jsonl_documents([tmp_path / "list.jsonl"]))
    _write_jsonl(tmp_path / "num.jsonl", [{"text": 3}])
    with pytest.raises(UserError, match="non-string 'text'"):
        list(jsonl_documents([tmp_path / "num.jsonl"]))
    # A null text is no document (as Parquet's nulls); a row without the field after rows with it
    # is that line's fault, not the field name's.
    _write_jsonl(tmp_path / "gaps.jsonl", [{"text": "one"}, {"text": None}, {"text": "three"}, {"id": 4}])
    with pytest.raises(UserError, match=r"gaps.jsonl, line 4: the object has no field 'text'; fix or remove that line"):
        list(jsonl_documents([tmp_path / "gaps.jsonl"]))
    _write_jsonl(tmp_path / "nulls.jsonl", [{"text": "one"}, {"text": None}, {"text": "three"}])
    assert list(jsonl_documents([tmp_path / "nulls.jsonl"])) == ["one", "three"]
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "\n")  # json's parser recurses per level
    with pytest.raises(UserError, match=r"deep.jsonl, line 1: not valid JSON"):
        list(jsonl_documents([deep]))


def test_parquet_documents_batches_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(25)] + [None, ""]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts, "n": list(range(27))}), path, row_group_size=10)
    assert list(parquet_documents([path], batch_rows=4)) == texts[:25]
    with pytest.raises(UserError, match=r"t.parquet has no column 'body' \(columns: text, n\)"):
        list(parquet_documents([path], field="body"))
    with pytest.raises(UserError, match="column 'n' .* not text"):
        list(parquet_documents([path], field="n"))
    categorical = tmp_path / "cat.parquet"  # pandas writes a Categorical column as a dictionary
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), categorical)
    assert list(parquet_documents([categorical])) == texts[:25]
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(UserError, match="cannot read the Parquet file"):
        list(parquet_documents([junk]))
    latin = tmp_path / "latin.parquet"  # a string column holding bytes that are not UTF-8: a traceback before
    pq.write_table(pa.table({"text": pa.array([b"ok", b"caf\xe9"], type=pa.binary()).view(pa.string())}), latin)
    with pytest.raises(UserError, match=r"latin.parquet is not UTF-8 text \(.* in column 'text'\)"):
        list(parquet_documents([latin]))


# -- code trees -------------------------------------------------------------------------------
@pytest.fixture
def code_tree(tmp_path) -> Path:
    root = tmp_path / "pkg"
    for rel, data in {
        "b.py": b"print('b')\n",
        "a.py": b"import os\n",
        "sub/c.py": b"x = 1\n",
        "tests/test_a.py": b"assert True\n",
        "sub/test/t.py": b"assert 1\n",
        "idle_test/t.py": b"assert 2\n",  # as the stdlib's idlelib/idle_test
        "sub/unit_tests/t.py": b"assert 3\n",
        "latest/l.py": b"y = 2\n",  # a name that contains "test" is no test directory
        "big.py": b"# " + b"x" * 5000 + b"\n",
        "blob.py": b"\x00\x01binary",
        "latin.py": b"s = '\xe9'\n",
        "notes.txt": b"not code\n",
        ".git/hook.py": b"hidden\n",
        "__pycache__/a.py": b"cached\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_code_documents_order_filters_and_header(code_tree):
    stats: dict[str, int] = {}
    docs = list(code_documents([code_tree], max_bytes=1000, stats=stats))
    assert docs == ["import os\n", "print('b')\n", "y = 2\n", "x = 1\n"]  # sorted walk: a, b, latest/l, sub/c
    assert stats == {"files": 4, "skipped_large": 1, "skipped_binary": 1, "skipped_undecodable": 1}
    with_tests = list(code_documents([code_tree], exclude_dirs=(), max_bytes=1000))
    assert {"assert True\n", "assert 1\n", "assert 2\n", "assert 3\n"} <= set(with_tests)
    headed = list(code_documents([code_tree], max_bytes=1000, path_header=True))
    assert headed[3] == "# path: sub/c.py\nx = 1\n"


def test_prepare_code(code_tree, tmp_path):
    out = prepare_code(
        [code_tree], tmp_path / "code", BYTE, max_bytes=1000, dev_fraction=0, test_fraction=0, progress=False
    )
    ds = PreparedDataset.open(out, verify=True)
    assert ds.splits == ["train"]
    assert _docs(out, "train") == ["import os\n", "print('b')\n", "y = 2\n", "x = 1\n"]
    assert ds.source["stats"]["skipped_binary"] == 1  # filled in while streaming
    with pytest.raises(UserError, match="no .rs files"):
        prepare_code([code_tree], tmp_path / "rs", BYTE, exts=[".rs"], progress=False)
    # Every file skipped: the error says why, not that the input holds no documents.
    skipped = [code_tree / name for name in ("big.py", "blob.py", "latin.py")]
    with pytest.raises(
        UserError,
        match=r"^every file of the input was skipped \(1 binary, 1 not UTF-8 or unreadable, 1 over --max-file-bytes "
        r"1,000\), so no dataset was written to .*none; check the inputs$",
    ):
        prepare_code(skipped, tmp_path / "none", BYTE, max_bytes=1000, progress=False)
    assert not (tmp_path / "none").exists()


def test_stdlib_is_the_default_tree():
    first = next(code_documents([stdlib_path()]))
    assert first.strip()
    assert (stdlib_path() / "os.py").is_file()


# -- prepare ----------------------------------------------------------------------------------
def test_prepare_jsonl_holds_out_by_hash(tmp_path):
    rows = [{"text": f"document number {i}"} for i in range(200)]
    data = _write_jsonl(tmp_path / "a.jsonl", rows)
    out = prepare_files(
        "jsonl", [data], tmp_path / "out", BYTE, dev_fraction=0.1, test_fraction=0.1, seed=5, progress=False
    )
    got = {s: _docs(out, s) for s in ("train", "dev", "test")}
    assert sorted(sum(got.values(), [])) == sorted(r["text"] for r in rows)
    for split, docs in got.items():
        assert docs and all(split_of(d, 0.1, 0.1, 5) == split for d in docs)
    src = PreparedDataset.open(out).source
    assert src["name"] == "jsonl" and src["own_splits"] == ["train"] and src["seed"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]  # the spill is cleaned up


def test_a_killed_prepares_spill_is_removed_by_the_next_prepare_of_that_output(tmp_path, monkeypatch):
    # The held-out documents wait in a folder beside the output, named after it; a SIGKILL leaves
    # it (it can hold all of dev and test). The next prepare of that output, under its lock, removes it.
    from tango_lm.data import splits

    made = []
    real = splits.tempfile.TemporaryDirectory
    monkeypatch.setattr(splits.tempfile, "TemporaryDirectory", lambda **kw: made.append(kw["prefix"]) or real(**kw))
    data = _write_jsonl(tmp_path / "a.jsonl", [{"text": f"document number {i}"} for i in range(50)])
    for name in (".out.spill-12345-k1ll3d_x", ".other.spill-12345-k1ll3d_x", ".out.spill-notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "dev.jsonl").write_text('"a held-out document"\n')
    prepare_files("jsonl", [data], tmp_path / "out", BYTE, dev_fraction=0.1, test_fraction=0.1, progress=False)
    assert made and all(p.startswith(".out.spill-") for p in made)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".other.spill-12345-k1ll3d_x", ".out.spill-notes", "a.jsonl", "out"]  # another output's stays


def test_prepare_parquet_own_splits_and_max_docs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"text": [f"train {i}" for i in range(30)]}), d / "train.parquet")
    pq.write_table(pa.table({"text": ["v1", "v2"]}), d / "validation.parquet")
    out = prepare_files("parquet", [d], tmp_path / "out", BYTE, test_fraction=0.3, max_docs=20, progress=False)
    ds = PreparedDataset.open(out)
    assert ds.splits == ["train", "dev", "test"]
    assert _docs(out, "dev") == ["v1", "v2"]
    assert ds.num_documents("train") + ds.num_documents("test") == 20


def test_prepare_text_split_on_blank_lines(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("p1\n\np2\n\np3\n")
    out = prepare_source(
        "text",
        tmp_path / "out",
        inputs=[tmp_path / "t"],
        tokenizer=BYTE,
        split_on_blank_lines=True,
        dev_fraction=0,
        test_fraction=0,
        progress=False,
    )
    assert _docs(out, "train") == ["p1", "p2", "p3"]


def test_bad_inputs(tmp_path):
    with pytest.raises(
        UserError, match="unknown data source 'no-such-source'; choose one of: "
    ):  # a new one may be csv
        prepare_source("no-such-source", tmp_path / "x")
    with pytest.raises(UserError, match="does not exist"):
        prepare_files("jsonl", [tmp_path / "missing.jsonl"], tmp_path / "x", BYTE, progress=False)
    # a misspelt option had been a TypeError from the source's constructor
    with pytest.raises(UserError, match="data source 'jsonl' has no option fild; its options: tokenizer, "):
        prepare_source("jsonl", tmp_path / "x", inputs=["a.jsonl"], fild="text")
    assert not (tmp_path / "x").exists()


def test_one_input_path_given_as_a_string_is_one_input(tmp_path):
    # inputs="a.jsonl" had been read character by character: "input a does not exist"
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    for one in (str(tmp_path / "a.jsonl"), tmp_path / "a.jsonl"):
        out = prepare_source(
            "jsonl", tmp_path / "out", inputs=one, tokenizer=BYTE, dev_fraction=0, test_fraction=0, overwrite=True
        )
        assert _docs(out, "train") == ["one", "two"]


@pytest.mark.parametrize(
    ("kind", "name", "other"),
    [
        ("text", "rows.jsonl", "jsonl"),
        ("text", "rows.jsonl.gz", "jsonl"),
        ("jsonl", "t.parquet", "parquet"),
        ("parquet", "a.txt", "text"),
    ],
)
def test_a_named_file_of_another_kind_is_refused_unless_ext_names_it(tmp_path, kind, name, other):
    # `data prepare text rows.jsonl` trained the JSON syntax as text, with no word.
    path = tmp_path / name
    path.write_bytes(b'{"text": "a"}\n')
    with pytest.raises(
        UserError,
        match=rf"{name} is a {other} file by its name; prepare it with `tango-lm data "
        rf"prepare {other}` \(or pass --ext \.{name.split('.', 1)[1]} to read it as {kind}\)",
    ):
        prepare_files(kind, [path], tmp_path / "x", BYTE, progress=False)
    assert not (tmp_path / "x").exists()
    if kind == "text" and not name.endswith(".gz"):
        out = prepare_files(
            kind, [path], tmp_path / "y", BYTE, exts=[".jsonl"], progress=False, test_fraction=0, dev_fraction=0
        )
        assert _docs(out, "train") == ['{"text": "a"}\n']
    # a name no kind claims is read as the kind asked for
    (tmp_path / "corpus").write_text("plain words")
    out = prepare_files(
        "text", [tmp_path / "corpus"], tmp_path / "z", BYTE, progress=False, test_fraction=0, dev_fraction=0
    )
    assert _docs(out, "train") == ["plain words"]


# -- Hugging Face -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_datasets(tmp_path_factory):
    """The real `datasets` package, offline, with its cache in a temp dir."""
    home = tmp_path_factory.mktemp("hf-home")
    saved = {k: os.environ.get(k) for k in ("HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    try:
        yield pytest.importorskip("datasets")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf") / "local_ds"
    d.mkdir()
    _write_jsonl(d / "train.jsonl", [{"text": f"train doc {i}", "id": i} for i in range(40)])
    _write_jsonl(d / "test.jsonl", [{"text": f"test doc {i}", "id": i} for i in range(5)])
    return d


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_local_dataset(hf_datasets, hf_dir, tmp_path, streaming):
    out = prepare_hf(str(hf_dir), tmp_path / "out", BYTE, streaming=streaming, dev_fraction=0.2, progress=False)
    ds = PreparedDataset.open(out)
    assert ds.splits == ["train", "dev", "test"]
    assert _docs(out, "test") == [f"test doc {i}" for i in range(5)]  # the dataset's own test split
    assert ds.num_documents("train") + ds.num_documents("dev") == 40
    assert ds.source["own_splits"] == ["test", "train"] and ds.source["streaming"] is streaming


def test_hf_save_to_disk_split_map_and_max_docs(hf_datasets, tmp_path):
    saved = tmp_path / "saved"
    dd = hf_datasets.DatasetDict(
        {
            "train": hf_datasets.Dataset.from_dict({"content": [f"a{i}" for i in range(50)]}),
            "holdout": hf_datasets.Dataset.from_dict({"content": ["h1", "h2", "h3"]}),
        }
    )
    dd.save_to_disk(str(saved))
    out = prepare_hf(
        str(saved),
        tmp_path / "out",
        BYTE,
        split_map="train=train,test=holdout",
        field="content",
        max_docs=10,
        dev_fraction=0.3,
        progress=False,
    )
    ds = PreparedDataset.open(out)
    assert _docs(out, "test") == ["h1", "h2", "h3"]
    assert ds.num_documents("train") + ds.num_documents("dev") == 10
    with pytest.raises(UserError, match="no split 'validation'.*fix --split-map"):
        prepare_hf(str(saved), tmp_path / "o2", BYTE, split_map="dev=validation,train=train", progress=False)
    with pytest.raises(UserError, match="has no field 'text' \\(fields: content\\)"):
        prepare_hf(str(saved), tmp_path / "o3", BYTE, progress=False)
    assert not (tmp_path / "o3").exists()
    with pytest.raises(UserError, match="two of our splits to the dataset's split 'train'"):
        prepare_hf(str(saved), tmp_path / "o4", BYTE, split_map="train=train,test=train", progress=False)
    assert not (tmp_path / "o4").exists()
    # Two of our names for one split: the later replaced the earlier, its documents dropped unsaid.
    three = tmp_path / "three"
    hf_datasets.DatasetDict(
        {name: hf_datasets.Dataset.from_dict({"text": [f"{name}{i}" for i in range(30)]}) for name in ("a", "b", "c")}
    ).save_to_disk(str(three))
    with pytest.raises(UserError, match="to our split 'dev' twice; give each of ours one split"):
        prepare_hf(str(three), tmp_path / "o5", BYTE, split_map="train=a,dev=b,VAL=c", progress=False)
    with pytest.raises(UserError, match="names our split 'foo'; the splits are train, dev"):  # was prepared as 'foo'
        prepare_hf(str(saved), tmp_path / "o6", BYTE, split_map="train=train,foo=holdout", progress=False)
    assert not (tmp_path / "o5").exists() and not (tmp_path / "o6").exists()
    out = prepare_hf(
        str(saved), tmp_path / "o7", BYTE, split_map="Train=train,Valid=holdout", field="content", progress=False
    )
    assert _docs(out, "dev") == ["h1", "h2", "h3"]


def test_hf_save_to_disk_refuses_what_it_cannot_apply_and_names_its_splits(hf_datasets, tmp_path):
    # load_from_disk has no configuration or revision: the manifest recorded ones never applied.
    saved = tmp_path / "saved"
    hf_datasets.DatasetDict(
        {
            "foo": hf_datasets.Dataset.from_dict({"text": ["a", "b"]}),
            "bar": hf_datasets.Dataset.from_dict({"text": ["c"]}),
        }
    ).save_to_disk(str(saved))
    for kwargs, flag in (({"config": "x"}, "--config x"), ({"revision": "v9"}, "--revision v9")):
        with pytest.raises(UserError, match=f"{flag} does not apply to .*save_to_disk directory.*drop"):
            prepare_hf(str(saved), tmp_path / "out", BYTE, split_map="train=foo", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=r"has splits foo, bar .* e\.g\. train=foo$"):
        prepare_hf(str(saved), tmp_path / "out", BYTE, progress=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_local_dataset_with_a_bad_file_is_one_line_naming_it(hf_datasets, tmp_path, capfd, streaming):
    # A corrupt Parquet file: streamed, ArrowInvalid escaped as a traceback; loaded, the error
    # line said "An error occurred while generating the dataset" after datasets' own log line.
    local = tmp_path / "corpus" / "data"
    local.mkdir(parents=True)
    hf_datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(20)]}).to_parquet(str(local / "train-0.parquet"))
    (local / "train-1.parquet").write_text("not parquet\n")
    argv = ["data", "prepare", "hf", str(tmp_path / "corpus"), "--out", str(tmp_path / "out"), "--tokenizer", "byte"]
    flag = ["--streaming" if streaming else "--no-streaming"]
    capfd.readouterr()
    assert main([*argv, *flag, "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "train-1.parquet" in err, err
    assert not (tmp_path / "out").exists()


def test_hf_documents_leave_datasets_logging_as_they_found_it():
    # The handlers were swapped while a generator was suspended: two closed out of order left
    # datasets' errors swallowed for the rest of the process.
    import logging

    from tango_lm.data.hf import hf_documents

    logger = logging.getLogger("datasets")
    before = (list(logger.handlers), logger.propagate)
    a = hf_documents([{"text": "x"}] * 3, "text", "A")
    b = hf_documents([{"text": "y"}] * 3, "text", "B")
    assert (next(a), next(b)) == ("x", "y")
    a.close()
    b.close()
    assert (list(logger.handlers), logger.propagate) == before


def test_hf_loading_draws_no_bars_off_a_terminal_and_logs_nothing(hf_datasets, tmp_path, capfd):
    # A local JSONL directory goes through load_dataset, whose "Generating train split" bar ignored
    # --no-progress; the README promises bars only on a terminal and nothing but the error line.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_jsonl(corpus / "train.jsonl", [{"text": f"doc {i}"} for i in range(40)])
    verbosity = hf_datasets.utils.logging.get_verbosity()
    argv = ["data", "prepare", "hf", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", "byte"]
    assert main([*argv, "--no-progress", "--test-fraction", "0.3"]) == 0
    captured = capfd.readouterr()
    assert "Generating" not in captured.err and "%" not in captured.err, captured.err
    assert hf_datasets.utils.logging.get_verbosity() == verbosity and hf_datasets.is_progress_bar_enabled()


def test_hf_loading_a_whole_dataset_off_a_terminal_says_when_it_starts_and_ends(hf_datasets, tmp_path, capfd):
    # A batch job's log: a whole dataset's download and conversion (hours for a large one) said
    # nothing, then the tokenizer's lines; the library's bars stay off there.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _write_jsonl(corpus / "train.jsonl", [{"text": f"doc {i}"} for i in range(40)])
    argv = ["data", "prepare", "hf", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", "byte"]
    assert main([*argv, "--test-fraction", "0.3"]) == 0
    err = capfd.readouterr().err.splitlines()
    assert err[:2] == [
        f"hf: downloading and converting {corpus}, whole (--streaming reads it as it tokenizes)",
        f"hf: loaded {corpus} in 0s",
    ], err
    assert err[2].startswith("tokenize train: ") and not any("Generating" in line or "%|" in line for line in err)
    assert main([*argv, "--test-fraction", "0.3", "--streaming", "--overwrite"]) == 0
    assert not any(line.startswith("hf: ") for line in capfd.readouterr().err.splitlines())


def test_hf_missing_package(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(UserError, match=r"pip install 'tango-lm\[hf\]'"):
        prepare_hf("HuggingFaceFW/fineweb-edu", tmp_path / "out", BYTE, progress=False)
    rc = main(
        [
            "data",
            "prepare",
            "hf",
            "HuggingFaceFW/fineweb-edu",
            "--max-docs",
            "5",
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            "byte",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "tango-lm[hf]" in err


def test_hf_hub_unreachable(monkeypatch, tmp_path):
    fake = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(UserError, match="cannot reach the Hugging Face Hub for dataset 'HuggingFaceFW/fineweb-edu'"):
        prepare_hf("HuggingFaceFW/fineweb-edu", tmp_path / "out", BYTE, max_docs=5, progress=False)


def test_hf_streaming_rows_through_fake_module(monkeypatch, tmp_path):
    """The streaming code path without the real package: splits, field, max_docs, connection drops."""
    fake = types.ModuleType("datasets")
    calls = []

    def rows(n, prefix):
        for i in range(n):
            yield {"text": f"{prefix} {i}"}
        raise AssertionError("read past max_docs")

    def load_dataset(name, config=None, revision=None, streaming=False):
        calls.append((name, config, streaming))
        return {"train": rows(1000, "t"), "validation": rows(1000, "v"), "test": rows(1000, "x")}

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    out = prepare_hf("org/web", tmp_path / "out", BYTE, config="sample", max_docs=7, progress=False)
    assert calls == [("org/web", "sample", True)]  # max_docs -> streaming by default
    ds = PreparedDataset.open(out)
    assert [ds.num_documents(s) for s in ds.splits] == [7, 7, 7]

    def broken(name, config=None, revision=None, streaming=False):
        def gen():
            yield {"text": "ok"}
            raise ConnectionError("connection reset")

        return {"train": gen()}

    fake.load_dataset = broken
    with pytest.raises(UserError, match="lost the connection while reading"):
        prepare_hf("org/web", tmp_path / "out2", BYTE, progress=False)


# -- command line -----------------------------------------------------------------------------
def test_cli_prepare_jsonl_and_errors(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}"} for i in range(20)])
    rc = main(
        ["data", "prepare", "jsonl", str(data), "--out", str(tmp_path / "out"), "--tokenizer", "byte", "--no-progress"]
    )
    assert rc == 0 and "prepared" in capsys.readouterr().out
    assert PreparedDataset.open(tmp_path / "out").num_tokens("train") > 0
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    rc = main(
        [
            "data",
            "prepare",
            "jsonl",
            str(tmp_path / "bad.jsonl"),
            "--out",
            str(tmp_path / "o2"),
            "--tokenizer",
            "byte",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "bad.jsonl, line 2" in err
    rc = main(["data", "prepare", "parquet", str(tmp_path / "none.parquet"), "--out", str(tmp_path / "o3")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_code_reads_a_file_under_two_roots_once(code_tree):
    # Overlapping roots (a tree and a file in it, the tree twice by two paths) repeated files in
    # train and in the counts; the first root's path names it.
    stats: dict[str, int] = {}
    once = list(code_documents([code_tree], stats=stats))
    stats_again: dict[str, int] = {}
    roots = [code_tree, next(code_tree.glob("*.py")), Path(os.path.relpath(code_tree))]
    assert list(code_documents(roots, stats=stats_again)) == once
    assert stats_again == stats


def test_cli_prepare_code(code_tree, tmp_path, capsys):
    rc = main(
        [
            "data",
            "prepare",
            "code",
            str(code_tree),
            "--out",
            str(tmp_path / "c"),
            "--tokenizer",
            "byte",
            "--include-tests",
            "--exclude-dir",
            "sub",
            "--max-file-bytes",
            "1000",
            "--path-header",
            "--dev-fraction",
            "0",
            "--test-fraction",
            "0",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    docs = _docs(tmp_path / "c", "train")
    assert docs[0] == "# path: a.py\nimport os\n"
    assert "# path: tests/test_a.py\nassert True\n" in docs and not any("sub/" in d for d in docs)


def test_copies_of_a_file_at_other_paths_stay_in_one_split_with_path_headers(tmp_path):
    # The path line made each copy's text different, so its hash sent copies to train, dev and test.
    for i in range(60):
        (tmp_path / "tree" / f"pkg{i}").mkdir(parents=True)
        (tmp_path / "tree" / f"pkg{i}" / "util.py").write_text("def same():\n    return 1\n")
        (tmp_path / "tree" / f"pkg{i}" / f"own{i}.py").write_text(f"x = {i}\n")
    out = tmp_path / "c"
    prepare_source(
        "code",
        out,
        inputs=[str(tmp_path / "tree")],
        tokenizer="byte",
        path_header=True,
        dev_fraction=0.2,
        test_fraction=0.2,
    )
    body = "def same():\n    return 1\n"
    holding = [s for s in ("train", "dev", "test") if any(d.endswith(body) for d in _docs(out, s))]
    assert len(holding) == 1, holding
    assert sum(len(_docs(out, s)) for s in ("train", "dev", "test")) == 120  # every file, headed


def test_documents_all_held_out_say_so(tmp_path):
    # Not "the input holds no train documents (empty or whitespace-only)": the input was not empty.
    text = tmp_path / "one.txt"
    for i in range(50):  # a document the hash sends to dev or test at these fractions
        text.write_text(f"document {i}\n")
        if split_of(text.read_text(), 0.45, 0.45) != "train":
            break
    with pytest.raises(
        UserError, match=r"all 1 documents went to (dev|test) .* and none to train.* lower --dev-fraction"
    ):
        prepare_source(
            "text", tmp_path / "d", inputs=[str(text)], tokenizer="byte", dev_fraction=0.45, test_fraction=0.45
        )
    assert not (tmp_path / "d").exists()


def test_prepare_counts_one_document_as_one_document(capsys):
    # "dev 1 documents (9 tokens)"
    from types import SimpleNamespace

    from tango_lm.cli.data import print_prepared

    sizes = {"train": (1_200, 98_765), "dev": (1, 9), "test": (0, 0)}
    ds = SimpleNamespace(
        path="data/x", splits=list(sizes), num_documents=lambda s: sizes[s][0], num_tokens=lambda s: sizes[s][1]
    )
    print_prepared(ds)
    assert capsys.readouterr().out == (
        "prepared data/x: train 1,200 documents (98,765 tokens), dev 1 document (9 tokens), test 0 documents (0 tokens)\n"
    )


def test_prepare_says_how_large_each_split_is_and_warns_of_an_empty_one_that_train_then_names(tmp_path, capsys):
    from tests import helpers

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"{i}.txt").write_text(f"document number {i} " * 8)
    out = tmp_path / "data"
    argv = ["data", "prepare", "text", str(docs), "--out", str(out), "--tokenizer", "byte", "--no-progress"]
    assert main([*argv, "--dev-fraction", "0.5", "--test-fraction", "0.001"]) == 0  # 30 documents: no test one
    captured = capsys.readouterr()
    ds = PreparedDataset.open(out)
    assert captured.out.startswith(f"prepared {out}: train {ds.num_documents('train'):,} documents (")
    assert "warning: the test split has no documents" in captured.err and "--test-fraction" in captured.err
    assert "dev split" not in captured.err
    # A mixture has no --test-fraction to give.
    assert (
        main(["data", "prepare", "mixture", "--out", str(tmp_path / "mix"), "--source", f"{out}:1", "--no-progress"])
        == 0
    )
    err = capsys.readouterr().err
    assert "warning: the test split has no documents" in err and "fraction" not in err, err
    run = helpers.cli_overrides(out, tmp_path / "run", steps=2)
    assert main(["train", *run, "--no-progress"]) == 2
    assert "the test ('test') split" in capsys.readouterr().err


def test_each_file_kind_takes_only_the_options_it_reads(tmp_path, capsys):
    # text --field and jsonl --split-on-blank-lines were shown in --help and silently ignored.
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    _write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}])
    for kind, path, flag in (("text", "a.txt", ["--field", "body"]), ("jsonl", "a.jsonl", ["--split-on-blank-lines"])):
        argv = ["data", "prepare", kind, str(tmp_path / path), "--out", str(tmp_path / "out"), *flag]
        assert main(argv) == 2
        assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(UserError, match="text files have no fields"):
        prepare_source("text", tmp_path / "out", inputs=[tmp_path / "a.txt"], tokenizer=BYTE, field="body")
    with pytest.raises(UserError, match="split_on_blank_lines reads text files, not jsonl"):
        prepare_source(
            "jsonl", tmp_path / "out", inputs=[tmp_path / "a.jsonl"], tokenizer=BYTE, split_on_blank_lines=True
        )
    assert not (tmp_path / "out").exists()
