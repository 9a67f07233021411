"""Adding a logger (train/loggers/): one file with its `MetricLogger`, one line in `LOGGERS`."""

from __future__ import annotations

import os
import subprocess
import sys

from tango_lm.train.trainer import train
from tests import helpers

CSV_LOGGER = """
import csv
from tango_lm.train.loggers.base import MetricLogger, scalars


class CsvLogger(MetricLogger):
    name = "csv"

    def __init__(self, ctx):
        self.path = ctx.out_dir / "metrics.csv"

    def log(self, record):
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerows([step, tag, value] for tag, value in scalars(record).items() for step in [record.get("step", 0)])
"""


def test_a_new_logger_is_one_file_and_one_registry_line(data_dir, tmp_path, monkeypatch):
    # What the package docstring promises. A logger in a file of its own had to import MetricLogger
    # from train/loggers.py, whose registry imports it: a circular import, whichever loaded first.
    (tmp_path / "csv_logger.py").write_text(CSV_LOGGER)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = "import csv_logger, tango_lm.train.loggers as l; print(csv_logger.CsvLogger.__mro__[1] is l.MetricLogger)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(helpers.ROOT / "src")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout == "True\n", proc.stderr  # the new file imported first: no circular import
    import csv_logger

    from tango_lm.train import loggers

    monkeypatch.setitem(loggers.LOGGERS, "csv", csv_logger.CsvLogger)
    out = tmp_path / "run"
    train(helpers.run_config(data_dir, out, steps=2, save_every=2, eval_every=2, loggers="jsonl,csv"))
    rows = (out / "metrics.csv").read_text().splitlines()
    assert "1,train/loss," + repr(helpers.loss_records(out)[0]["loss"]) in rows
