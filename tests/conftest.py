"""Fixtures shared by the test files (helpers.py holds the plain functions)."""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels' tests run them on CPU tensors in triton's interpreter, which
# reads this variable when triton is imported: set it before any test module imports tango_lm.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist (`make test` runs one worker per core, up to 4) the workers share the cores:
# each takes its share of threads rather than every core (tests that need more set their own).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

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
