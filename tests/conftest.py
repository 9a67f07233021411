"""Fixtures shared by the test files (helpers.py holds the plain functions)."""

from __future__ import annotations

import helpers
import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread; a file opts in with `pytest.mark.usefixtures`."""
    with helpers.one_thread():
        yield


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The byte-tokenized synthetic dataset (helpers.synthetic_dataset), prepared once per session."""
    return helpers.synthetic_dataset(tmp_path_factory)
