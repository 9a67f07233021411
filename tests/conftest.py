"""Fixtures shared by the test files (helpers.py holds the plain functions)."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels' tests run them on CPU tensors in triton's interpreter, which
# reads this variable when triton is imported: set it before any test module imports tango_lm.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests import helpers  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` (the Triton kernels and whole models on the GPU) need a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one thread; a file opts in with `pytest.mark.usefixtures`."""
    with helpers.one_thread():
        yield


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The byte-tokenized synthetic dataset (helpers.synthetic_dataset), prepared once per session."""
    return helpers.synthetic_dataset(tmp_path_factory)
