"""Progress as lines for a log file (progress_lines.py): what `data prepare` writes without a
terminal (it said nothing while it tokenized, for hours on a large corpus in a batch job)."""

from __future__ import annotations

import io

import pytest

from tango_lm.progress_lines import CountLines, duration_text, progress_bar
from tests import helpers


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"), (90061, "1d01h"), (float("inf"), "?")],
)
def test_durations_read_as_two_units_at_most(seconds, text):
    assert duration_text(seconds) == text


def test_counts_are_said_first_then_each_interval_then_at_the_end():
    clock, out = Clock(), io.StringIO()
    with CountLines(desc="tokenize train", total=1000, unit="doc", every_s=30, clock=clock, stream=out) as bar:
        for seconds in (5, 10, 20, 10):  # lines at the first update and 35 s after it
            clock.now += seconds
            bar.update(100)
            bar.set_postfix(tokens=123456, tok_s="4.2e+06")
        said_while_counting = out.getvalue().count("\n")
    assert said_while_counting == 2
    assert out.getvalue().splitlines() == [
        "tokenize train: 100/1,000 docs (10%), 5s elapsed, ETA 45s",
        "tokenize train: 300/1,000 docs (30%), tokens 123,456, tok_s 4.2e+06, 35s elapsed, ETA 1m22s",
        "tokenize train: 400/1,000 docs (40%), tokens 123,456, tok_s 4.2e+06, 45s elapsed, ETA 1m08s",  # at close
    ]


def test_an_iterable_without_a_total_and_a_reset_total():
    clock, out = Clock(), io.StringIO()
    files = iter(["a.lean", "b.lean"])  # no length: counted without a total
    assert list(CountLines(iterable=files, desc="lean: files", unit="file", clock=clock, stream=out)) == [
        "a.lean",
        "b.lean",
    ]
    assert out.getvalue().splitlines() == ["lean: files: 1 file, 0s elapsed", "lean: files: 2 files, 0s elapsed"]
    out = io.StringIO()
    assert len(list(CountLines(iterable="abc", desc="lean: files", unit="file", clock=clock, stream=out))) == 3
    assert out.getvalue().splitlines()[-1] == "lean: files: 3/3 files (100%), 0s elapsed, ETA 0s"  # a list's length
    out = io.StringIO()
    bar = CountLines(desc="generate dmmath", unit="module", clock=clock, stream=out)
    bar.reset(total=4)  # the generator says its task count once it starts
    bar.update(1)
    bar.set_postfix_str("1/4")
    bar.update(1)  # within the interval: not said
    bar.close()
    bar.close()  # said once
    assert out.getvalue().splitlines() == [
        "generate dmmath: 1/4 modules (25%), 0s elapsed, ETA 0s",
        "generate dmmath: 2/4 modules (50%), 1/4, 0s elapsed, ETA 0s",
    ]


def test_progress_bar_is_tqdm_lines_or_nothing():
    from tqdm.auto import tqdm

    assert isinstance(progress_bar("lines", desc="x"), CountLines)
    assert isinstance(progress_bar(True, desc="x", total=3), tqdm) and not progress_bar(True, desc="x").disable
    assert progress_bar(False, desc="x").disable


def test_data_prepare_without_a_terminal_writes_lines(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"paragraph {i}" for i in range(300)))
    argv = ["data", "prepare", "text", str(corpus), "--split-on-blank-lines", "--tokenizer", "byte"]
    rc, _, err, _ = helpers.run_main(capsys, [*argv, "--out", str(tmp_path / "a")])
    assert rc == 0
    counts = [line for line in err.splitlines() if line.startswith("tokenize train: ")]
    assert counts and counts[-1].startswith("tokenize train: 29") and "\r" not in err  # the whole split, said last
    rc, _, err, _ = helpers.run_main(capsys, [*argv, "--out", str(tmp_path / "b"), "--no-progress"])
    assert rc == 0 and "tokenize" not in err


def test_the_readmes_example_line_is_what_tokenizing_says():
    clock, out = Clock(), io.StringIO()
    bar = CountLines(desc="tokenize train", total=4_000_000, unit="doc", clock=clock, stream=out)
    clock.now += 222
    bar.set_postfix(tokens=912_345_678, tok_s="4.1e+06")
    bar.update(1_200_000)
    readme = " ".join((helpers.ROOT / "README.md").read_text().split())
    assert f"`{out.getvalue().strip()}`, at most one every 30 s" in readme
