"""Standard JSON for other tools (strict_json.py) and the one cache folder (cache_root.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tango_lm import strict_json
from tango_lm.cache_root import cache_root


def test_every_non_finite_number_is_null_however_deep(capsys):
    # A tuple (a pair of NLLs), a dict in a list, an infinity of either sign: each was refused by
    # allow_nan=False, a ValueError traceback, where it was to be null.
    value = {"pair": (float("nan"), 1.5), "rows": [{"ppl": float("inf")}, {"low": float("-inf")}], "n": 3}
    text = strict_json.dumps(value, sort_keys=True)
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON")) == {
        "n": 3,
        "pair": [None, 1.5],
        "rows": [{"ppl": None}, {"low": None}],
    }


def test_an_empty_cache_variable_is_unset_not_the_current_directory(monkeypatch, tmp_path):
    # `TANGO_LM_CACHE= tango-lm ...` (an unset shell variable) put kernels and data in the current directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TANGO_LM_CACHE", "")
    assert cache_root() == tmp_path / "xdg" / "tango-lm"
    monkeypatch.setenv("TANGO_LM_CACHE", "~/tl-cache")
    assert cache_root() == Path.home() / "tl-cache"
