"""metrics.jsonl read back and cut to a checkpoint's step (train/metrics_file.py)."""

from __future__ import annotations

import json

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
