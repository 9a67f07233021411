"""A new data source needs no other edit: registering it is enough for `tango-lm data prepare`.

The toy below writes sums (`3 + 4 = 7`), one document each. It lives only in this file and is
registered only while a test runs; the command line, the dataset lock, the manifest and
`data verify` pick it up from the registry as they do the shipped sources.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tango_lm.cli import main
from tango_lm.data.shards import PreparedDataset
from tango_lm.data.source import HeldOutSource
from tango_lm.data.sources import SOURCES, prepare_source
from tango_lm.errors import UserError


@dataclass(kw_only=True)
class SumsSource(HeldOutSource):
    name = "toy"
    help = "sums of two numbers, one document each"

    count: int = 50

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        cls.add_common_arguments(parser)
        parser.add_argument("--count", type=int, default=50, help="how many sums")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SumsSource:
        return cls(count=args.count, **cls.common_options(args))

    def check(self) -> None:
        super().check()
        if self.count < 1:
            raise UserError(f"--count must be at least 1, got {self.count}")

    def read(self, tokenizer: Any, out_dir: Path, progress: bool) -> dict[str, Iterable[str]]:
        return self.held_out_splits({"train": (f"{i} + {i + 1} = {2 * i + 1}" for i in range(self.count))}, out_dir)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "count": self.count,
            "dev_fraction": self.dev_fraction,
            "test_fraction": self.test_fraction,
            "seed": self.seed,
        }


@pytest.fixture
def toy(monkeypatch) -> str:
    monkeypatch.setitem(SOURCES, SumsSource.name, SumsSource)
    return SumsSource.name


def test_the_command_line_offers_it(toy, capsys):
    with pytest.raises(SystemExit):
        main(["data", "prepare", "--help"])
    assert "sums of two numbers, one document each" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["data", "prepare", toy, "--help"])
    usage = capsys.readouterr().out
    assert "--count COUNT" in usage and "--dev-fraction" in usage and "--out OUT" in usage


def test_data_prepare_toy_writes_a_dataset(toy, tmp_path, capsys):
    out = tmp_path / "sums"
    assert (
        main(
            [
                "data",
                "prepare",
                toy,
                "--out",
                str(out),
                "--tokenizer",
                "byte",
                "--count",
                "200",
                "--test-fraction",
                "0.1",
                "--no-progress",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    ds = PreparedDataset.open(out, verify=True)
    sizes = [f"{s} {ds.num_documents(s):,} documents ({ds.num_tokens(s):,} tokens)" for s in ("train", "dev", "test")]
    assert captured.out == f"prepared {out}: {', '.join(sizes)}\n" and captured.err == ""
    assert ds.splits == ["train", "dev", "test"]
    assert sum(ds.num_documents(s) for s in ds.splits) == 200
    assert json.loads((out / "manifest.json").read_text())["source"] == {
        "name": "toy",
        "count": 200,
        "dev_fraction": 0.02,
        "test_fraction": 0.1,
        "seed": 0,
    }
    assert main(["data", "verify", str(out)]) == 0
    # The same source from Python, by its registered name.
    again = prepare_source(toy, tmp_path / "again", tokenizer="byte", count=200, test_fraction=0.1, progress=False)
    assert (again / "manifest.json").read_text().split('"created"')[0] == (out / "manifest.json").read_text().split(
        '"created"'
    )[0]


def test_its_bad_options_are_one_line_and_write_nothing(toy, tmp_path, capsys):
    assert main(["data", "prepare", toy, "--out", str(tmp_path / "x"), "--count", "0"]) == 2
    assert capsys.readouterr().err == "error: --count must be at least 1, got 0\n"
    assert main(["data", "prepare", toy, "--out", str(tmp_path / "x"), "--dev-fraction", "2"]) == 2
    assert "dev_fraction (--dev-fraction) must be in [0, 1)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
