"""metrics.jsonl read back and cut to a checkpoint's step (train/metrics_file.py)."""

from __future__ import annotations

import json

import pytest

from tango_lm.errors import UserError
from tango_lm.train import metrics_file


def test_truncation_keeps_the_records_up_to_the_step_without_the_summary_or_a_cut_line(tmp_path):
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "dev_nll": 2.5},
        {"step": 2, "event": "summary", "test_nll": 2.4},
        {"step": 3, "loss": 2.0},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo'  # a kill mid-line
    (tmp_path / metrics_file.NAME).write_text(text)
    metrics_file.truncate_records(tmp_path, 2)
    kept = metrics_file.read_records(tmp_path)
    assert kept == records[:2]
    assert metrics_file.dev_nll_at(kept, 2) == 2.5 and metrics_file.dev_nll_at(kept, 1) is None
    assert metrics_file.read_records(tmp_path / "none") == []


@pytest.mark.parametrize("bad", ['{"step": 2, "lo', "[1, 2]", "null", '{"step": null}', '{"step": "2"}'])
def test_a_corrupt_line_before_the_last_is_refused_and_the_log_is_left_as_it_was(tmp_path, bad):
    # Only a last line can be a kill mid-write; anywhere else the log is damaged and a resume that
    # dropped the line (or a list record it could not read) would rewrite it without a word.
    text = '{"step": 1, "loss": 3.0}\n' + bad + '\n{"step": 3, "loss": 2.0}\n'
    (tmp_path / metrics_file.NAME).write_text(text)
    with pytest.raises(UserError, match=r"metrics.jsonl line 2 is not a JSON record"):
        metrics_file.truncate_records(tmp_path, 2)
    with pytest.raises(UserError, match=r"line 2"):
        metrics_file.read_records(tmp_path)
    assert (tmp_path / metrics_file.NAME).read_text() == text


def test_a_partial_last_line_is_reported_by_parse(tmp_path):
    path = tmp_path / metrics_file.NAME
    path.write_text('{"step": 1}\n[1,')
    assert metrics_file.parse(path) == ([('{"step": 1}', {"step": 1})], True)
    path.write_text('{"step": 1}\n\n')
    assert metrics_file.parse(path) == ([('{"step": 1}', {"step": 1})], False)


@pytest.mark.parametrize("last", ['{"step": "2"}', "null", "[1, 2]"])
def test_a_complete_last_line_that_is_no_record_is_corruption_not_a_cut(tmp_path, last):
    # A line cut by a kill is never valid JSON (records are objects); a valid non-record was dropped as "partial".
    path = tmp_path / metrics_file.NAME
    path.write_text('{"step": 1}\n' + last + "\n")
    with pytest.raises(UserError, match="line 2 is not a JSON record"):
        metrics_file.parse(path)


def test_a_line_of_only_whitespace_is_skipped_not_corruption(tmp_path):
    # An editor's stray line of spaces (or a \r left by one) between records: a blank line, not a
    # damaged log that stops the resume.
    path = tmp_path / metrics_file.NAME
    path.write_text('{"step": 1, "loss": 3.0}\n   \n\r\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 1.0}\n')
    metrics_file.truncate_records(tmp_path, 2)
    assert metrics_file.read_records(tmp_path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]


@pytest.mark.parametrize("step", ["true", "false"])
def test_a_boolean_step_is_corruption(tmp_path, step):
    # json reads true as a bool, an int to Python: the resume cut the log at "step 1".
    path = tmp_path / metrics_file.NAME
    text = '{"step": 1}\n{"step": ' + step + ', "loss": 2.0}\n{"step": 3}\n'
    path.write_text(text)
    with pytest.raises(UserError, match="line 2 is not a JSON record"):
        metrics_file.truncate_records(tmp_path, 1)
    assert path.read_text() == text
