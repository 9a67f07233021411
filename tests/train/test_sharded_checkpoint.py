"""Sharded (DCP) checkpoints read through our restricted reader: what DCP pickles into `.metadata`
is exactly what the reader admits, and values round-trip in one process.

The multi-process paths (FSDP shards written by two ranks, read by one or two) are in
test_distributed.py; this file pins the torch internals the reader depends on.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import pytest
import torch

from tango_lm.errors import UserError
from tango_lm.train.checkpoint import SHARDS
from tango_lm.train.sharded_checkpoint import (
    ALLOWED_GLOBALS,
    METADATA,
    MODULE_ALIASES,
    _dcp_classes,
    _metadata_unpickler,
    load_shards,
    save_shards,
    shard_manifest,
)

# The private torch names `.metadata` holds (sharded_checkpoint.py says why each is admitted).
PRIVATE = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


def _tensors() -> dict:
    """What the trainer saves, in small: fp32 and bf16 weights, AdamW state with a 0-dim step."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g).bfloat16()},
        "optimizer": {"state": {"w": {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, 3, generator=g)}}},
    }


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    step = tmp_path_factory.mktemp("ckpt") / "step-00000004"
    (step / SHARDS).mkdir(parents=True)
    save_shards(step / SHARDS, _tensors(), distributed=False)
    return step


def test_dcp_pickles_only_the_globals_the_reader_admits(step_dir):
    assert sorted(p.name for p in (step_dir / SHARDS).iterdir()) == [METADATA, "__0_0.distcp"]
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # our own file, written just now: safe to unpickle
        def find_class(self, module, name):
            seen.add((MODULE_ALIASES.get(module, module), name))  # Python 3.13's pathlib._local
            return super().find_class(module, name)

    with open(step_dir / SHARDS / METADATA, "rb") as f:
        Recording(f).load()
    dcp_classes = {g for g in seen if g[0] == "torch.distributed.checkpoint.metadata"}
    dtypes = {g for g in seen if g[0] == "torch" and isinstance(getattr(torch, g[1]), torch.dtype)}
    assert seen - dcp_classes - dtypes <= ALLOWED_GLOBALS
    # A change in what DCP pickles privately (a rename, a new private class) fails here first.
    assert {g for g in seen if g[1].startswith("_")} == PRIVATE
    assert PRIVATE - dcp_classes <= ALLOWED_GLOBALS


def test_pathlib_classes_pickled_by_python_3_13_are_read_as_pathlib_s_on_any_python():
    # Python 3.13 pickles a Path as pathlib._local.PosixPath (DCP's metadata holds one), which the
    # reader refused: a sharded checkpoint written on 3.13 could not be resumed, there or anywhere.
    pickled = pickle.dumps(Path("/runs/x"), protocol=2)  # the module by name, in one line of text
    written_by_3_11 = pickled.replace(b"cpathlib._local\n", b"cpathlib\n")
    written_by_3_13 = written_by_3_11.replace(b"cpathlib\n", b"cpathlib._local\n")
    assert b"cpathlib._local\nPosixPath\n" in written_by_3_13
    for data in (written_by_3_11, written_by_3_13):
        assert _metadata_unpickler()(io.BytesIO(data)).load() == Path("/runs/x")
    with pytest.raises(pickle.UnpicklingError, match="pathlib._local.open is not allowed"):
        _metadata_unpickler()(
            io.BytesIO(written_by_3_11.replace(b"cpathlib\nPosixPath", b"cpathlib._local\nopen"))
        ).load()


def test_the_reader_reads_what_dcp_wrote(step_dir):
    reader = _dcp_classes()[0](str(step_dir / SHARDS))
    metadata = reader.read_metadata()
    assert metadata.storage_meta.load_id == reader.load_id
    assert {"model.w", "model.b", "optimizer.state.w.step"} <= set(metadata.state_dict_metadata)
    template = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in _tensors().items() if k == "model"}
    load_shards(step_dir, {"shards": shard_manifest(step_dir / SHARDS)}, template, distributed=False)
    for name, value in _tensors()["model"].items():
        assert torch.equal(template["model"][name], value)


def test_a_foreign_global_is_refused(step_dir, tmp_path):
    shards = tmp_path / "step-00000004" / SHARDS
    shards.mkdir(parents=True)
    (shards / METADATA).write_bytes(pickle.dumps({"not": print}))
    with pytest.raises(UserError, match="unreadable shard metadata.*builtins.print is not allowed"):
        _dcp_classes()[0](str(shards)).read_metadata()
