"""Data source registry: a new source is one file with its `DataSource` (source.py) plus one line here.

`tango-lm data prepare NAME` offers these sources in this order, each with the arguments its class
adds; `prepare_source` prepares one from Python.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from tango_lm.data.code_trees import CodeSource
from tango_lm.data.dmmath import DMMathSource
from tango_lm.data.files import JsonlSource, ParquetSource, TextSource
from tango_lm.data.hf import HFSource
from tango_lm.data.lean import LeanSource
from tango_lm.data.mixture import MixtureSource
from tango_lm.data.source import DataSource
from tango_lm.errors import UserError
from tango_lm.progress_lines import Progress

__all__ = ["SOURCES", "prepare_source"]

SOURCES: dict[str, type[DataSource]] = {
    "dmmath": DMMathSource,
    "text": TextSource,
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
    "code": CodeSource,
    "lean": LeanSource,
    "hf": HFSource,
    "mixture": MixtureSource,
}


def prepare_source(
    name: str, out_dir: str | os.PathLike, *, overwrite: bool = False, progress: Progress = True, **options: Any
) -> Path:
    """Prepare a dataset at `out_dir` from the source registered as `name`, with that source's
    options (the fields of its class): `prepare_source("jsonl", "data/web", inputs=["a.jsonl"])`."""
    if name not in SOURCES:
        raise UserError(f"unknown data source {name!r}; choose one of: {', '.join(SOURCES)}")
    source = SOURCES[name]
    fields = [f.name for f in dataclasses.fields(source) if f.init]
    if unknown := sorted(set(options) - set(fields)):
        raise UserError(f"data source {name!r} has no option {', '.join(unknown)}; its options: {', '.join(fields)}")
    if isinstance(options.get("inputs"), (str, os.PathLike)):  # one path, not its characters one by one
        options["inputs"] = [options["inputs"]]
    return source(**options).prepare(out_dir, overwrite=overwrite, progress=progress)
