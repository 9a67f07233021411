"""Data sources by name: text, JSONL and Parquet files (files.py), code trees (code_trees.py), Lean
(lean.py), Hugging Face datasets (hf.py) and mixtures of prepared datasets (mixture.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tango_lm.data.code_trees import prepare_code
from tango_lm.data.files import prepare_files
from tango_lm.data.hf import prepare_hf
from tango_lm.errors import UserError

__all__ = ["SOURCE_NAMES", "prepare_source"]

# Sources `prepare_source` knows (mixtures and Lean live in their own modules).
SOURCE_NAMES = ("text", "jsonl", "parquet", "code", "lean", "hf", "mixture")


def prepare_source(name: str, *args: Any, **kwargs: Any) -> Path:
    """Prepare a dataset from the source called `name` (one of SOURCE_NAMES); arguments as that source's."""
    if name in ("text", "jsonl", "parquet"):
        return prepare_files(name, *args, **kwargs)
    if name == "code":
        return prepare_code(*args, **kwargs)
    if name == "lean":
        from tango_lm.data.lean import prepare_lean

        return prepare_lean(*args, **kwargs)
    if name == "hf":
        return prepare_hf(*args, **kwargs)
    if name == "mixture":
        from tango_lm.data.mixture import prepare_mixture

        return prepare_mixture(*args, **kwargs)
    raise UserError(f"unknown data source {name!r}; choose one of: {', '.join(SOURCE_NAMES)}, dmmath")
