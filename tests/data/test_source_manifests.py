"""Prepared datasets stay valid: every `data prepare` source writes, for the same inputs and flags,
the manifest that the code before the data-source registry wrote (tests/fixtures/manifests/, kept
as that code wrote them).

Each case runs the command line, so the flags, the source's options and its manifest record (its
fingerprint) are checked together. Two things vary by time and place and are masked: the
`created` time and the temporary directory (in a mixture's absolute component paths). The
manifest holds every shard's sha256, so equal manifests also mean equal token shards.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import types
from pathlib import Path

import pytest

from tango_lm.cli import main
from tango_lm.data import dmmath
from tests import helpers

FIXTURES = helpers.FIXTURES / "manifests"
LEAN = helpers.FIXTURES / "lean"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _sentence(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 5))


def _write_inputs(root: Path) -> None:
    (root / "txt").mkdir()
    for f in range(4):
        (root / "txt" / f"f{f}.txt").write_text("\n\n".join(_sentence(f * 10 + i) for i in range(12)) + "\n")
    rows = [json.dumps({"body": _sentence(i), "id": i}) for i in range(60)]
    (root / "train.jsonl").write_text("\n".join(rows[:50]) + "\n")
    with gzip.open(root / "dev.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(rows[50:]) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [_sentence(i) for i in range(80)] + [None]}), root / "docs.parquet")
    tree = root / "tree"
    for rel, text in {
        "pkg/a.py": "import os\n",
        "pkg/b.py": "x = 1\n" * 30,
        "pkg/tests/t.py": "assert 1\n",
        "pkg/skip/s.py": "y = 2\n",
        "lib/c.sh": "echo hi\n",
        "lib/big.py": "z = 3\n" * 400,
    }.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    (tree / "pkg" / "bin.py").write_bytes(b"\0\1\2")
    (tree / "pkg" / "latin.py").write_bytes(b"caf\xe9\n")
    (root / "lean").mkdir()
    for f in sorted(LEAN.glob("*.lean")):
        (root / "lean" / f.name).write_text(f.read_text())


def _fake_generator(root: Path, monkeypatch) -> None:
    """DM Math without DeepMind's generator: a few modules of fixed question/answer pairs."""
    gen = root / "generated" / "0123456789abcdef0123"
    gen.mkdir(parents=True)
    for split in ("train-easy", "train-medium", "train-hard", "interpolate", "extrapolate"):
        for m, module in enumerate(("algebra__linear_1d", "arithmetic__add_or_sub", "numbers__gcd")):
            rows = [
                {"question": f"{split} {module} q{i} {_sentence(i + m)}?", "answer": str(i * (m + 2))} for i in range(6)
            ]
            (gen / f"{split}__{module}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(dmmath, "generate_examples", lambda seed, counts, workers=None, progress=True: gen)
    # The manifest records the generator's pins, which depend on the Python (numpy 2.5.5 from 3.13);
    # the fixture holds those of the Python it was written on.
    monkeypatch.setattr(dmmath, "REQUIREMENTS", dmmath.generator_requirements((3, 11)))


def _fake_datasets(monkeypatch) -> None:
    """A `datasets` module whose streamed splits are plain row generators (no network, no cache)."""
    fake = types.ModuleType("datasets")

    def load_dataset(name, config=None, revision=None, streaming=False):
        rows = lambda n, tag: ({"text": f"{tag} {_sentence(i)}", "n": i} for i in range(n))  # noqa: E731
        return {"train": rows(70, "t"), "validation": rows(9, "v"), "holdout": rows(8, "h")}

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)


# name -> the `tango-lm` arguments that prepare it (inputs relative to the temporary directory).
BYTE = ["--tokenizer", "byte", "--no-progress"]
CASES = {
    "text": [
        "data",
        "prepare",
        "text",
        "txt",
        "--out",
        "out/text",
        "--split-on-blank-lines",
        "--seed",
        "3",
        "--dev-fraction",
        "0.1",
        "--test-fraction",
        "0.05",
        *BYTE,
    ],
    "jsonl": [
        "data",
        "prepare",
        "jsonl",
        "train=train.jsonl",
        "dev=dev.jsonl.gz",
        "--out",
        "out/jsonl",
        "--field",
        "body",
        "--max-docs",
        "40",
        "--test-fraction",
        "0.2",
        *BYTE,
    ],
    "parquet": ["data", "prepare", "parquet", "docs.parquet", "--out", "out/parquet", "--dev-fraction", "0.2", *BYTE],
    "code": [
        "data",
        "prepare",
        "code",
        "tree",
        "--out",
        "out/code",
        "--ext",
        ".py",
        "--ext",
        ".sh",
        "--include-tests",
        "--exclude-dir",
        "skip",
        "--max-file-bytes",
        "1000",
        "--path-header",
        "--dev-fraction",
        "0.3",
        "--test-fraction",
        "0.2",
        *BYTE,
    ],
    "lean": [
        "data",
        "prepare",
        "lean",
        "lean",
        "--out",
        "out/lean",
        "--proof-weight",
        "0.4",
        "--dev-fraction",
        "0.25",
        "--test-fraction",
        "0.25",
        "--seed",
        "1",
        *BYTE,
    ],
    "hf": [
        "data",
        "prepare",
        "hf",
        "org/web",
        "--out",
        "out/hf",
        "--config",
        "sample",
        "--max-docs",
        "50",
        "--split-map",
        "train=train,dev=validation,test=holdout",
        "--revision",
        "main",
        *BYTE,
    ],
    "mixture": [
        "data",
        "prepare",
        "mixture",
        "--out",
        "out/mixture",
        "--source",
        "out/text:0.7",
        "--source",
        "out/jsonl:0.3",
        "--tokens",
        "1500",
        "--seed",
        "2",
        "--no-progress",
    ],
    "dmmath": [
        "data",
        "prepare",
        "dmmath",
        "--out",
        "out/dmmath",
        "--train-per-module",
        "6",
        "--test-per-module",
        "6",
        "--dev-fraction",
        "0.2",
        "--seed",
        "4",
        "--extrapolate",
        "--tokenizer",
        "byte",
    ],
}


def prepared_manifests(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """Prepare every case in `tmp_path` and return its manifest text with the varying parts masked."""
    monkeypatch.chdir(tmp_path)
    _write_inputs(tmp_path)
    _fake_generator(tmp_path, monkeypatch)
    _fake_datasets(monkeypatch)
    out = {}
    for name, argv in CASES.items():
        assert main(argv) == 0, name
        text = (tmp_path / "out" / name / "manifest.json").read_text(encoding="utf-8")
        text = re.sub(r'"created": "[^"]*"', '"created": "<time>"', text)
        for root in sorted({str(tmp_path), str(tmp_path.resolve())}, key=len, reverse=True):
            text = text.replace(root, "<tmp>")
        out[name] = text
    return out


def test_manifests_are_byte_identical_to_the_fixtures(tmp_path, monkeypatch, capsys):
    manifests = prepared_manifests(tmp_path, monkeypatch)
    assert sorted(manifests) == sorted(p.stem for p in FIXTURES.glob("*.json"))
    for name, text in manifests.items():
        assert text == (FIXTURES / f"{name}.json").read_text(encoding="utf-8"), name


if __name__ == "__main__":  # `python tests/data/test_source_manifests.py DIR`: write the fixtures (once)
    with pytest.MonkeyPatch.context() as mp:
        work = Path(sys.argv[1]).absolute()
        work.mkdir(parents=True)
        FIXTURES.mkdir(parents=True, exist_ok=True)
        for name, text in prepared_manifests(work, mp).items():
            (FIXTURES / f"{name}.json").write_text(text, encoding="utf-8")
