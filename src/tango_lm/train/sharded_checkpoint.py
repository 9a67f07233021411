"""Sharded checkpoints: a step directory's weights and optimizer state as DCP shards.

A *sharded* checkpoint (`train.checkpoint_format=sharded`, docs/distributed.md) holds, instead of
`model.safetensors` and the optimizer tensors, a `shards/` directory written by every process with
torch.distributed.checkpoint (DCP): one `__R_0.distcp` file per rank plus DCP's `.metadata`.
`meta.json` says `"layout": "sharded"` and lists every shard file with its size and sha256; a
checkpoint with a listed file missing, cut short or altered is refused before anything is read. DCP's `.metadata` is a
pickle: it is read with an unpickler that admits only DCP's own metadata classes, torch sizes,
dtypes and layouts, and DCP's tensor files are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tango_lm.errors import UserError
from tango_lm.train.checkpoint import SHARDS, check_sum, write_failed

__all__ = ["METADATA", "save_shards", "shard_manifest", "check_shards", "load_shards", "load_sharded_model"]

# The file dcp.save writes beside the shards: which tensor chunk lies where in which shard file.
METADATA = ".metadata"


def save_shards(directory: Path, tensors: dict[str, Any], distributed: bool) -> None:
    """Write `tensors` (a nested dict of tensors/DTensors) with DCP; under torchrun every process
    calls this with its own shards and rank 0 writes `.metadata`."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=not distributed)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's (a BaseException) wraps every rank's failure
        if not distributed or dist.get_rank() == 0:
            shutil.rmtree(directory.parent, ignore_errors=True)
        raise write_failed(directory.parent.parent, int(directory.parent.name.split("-")[2]), _first(exc)) from None


def _first(exc: BaseException) -> BaseException:
    """The first rank's own failure inside DCP's CheckpointException (which lists every rank's
    with its traceback), else `exc`."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return exc


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process save/load, even when asked for one explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def shard_manifest(directory: Path) -> dict[str, int]:
    """Every file of a shard directory and its size in bytes."""
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()}


def check_shards(path: Path, meta: dict[str, Any]) -> None:
    """UserError unless every shard file `meta.json` lists is present with its recorded size (and
    sha256, recorded since checkpoints carry them)."""
    listed = meta.get("shards")
    if not isinstance(listed, dict) or METADATA not in listed:
        raise UserError(
            f"checkpoint {path} is sharded but its meta.json lists no shards; it is corrupt, use another one"
        )
    for name, size in sorted(listed.items()):
        if Path(name).name != name or name in (".", ".."):
            raise UserError(
                f"checkpoint {path} lists a shard outside its {SHARDS}/ directory ({name!r}); "
                "it is corrupt, use another one"
            )
        file = path / SHARDS / name
        if not file.is_file():
            raise UserError(
                f"checkpoint {path} is missing shard {SHARDS}/{name} ({len(listed) - 1} shard files expected); "
                "copy the whole step directory from where it was written or resume from another checkpoint"
            )
        if file.stat().st_size != size:
            raise UserError(
                f"checkpoint {path} has a truncated or altered shard {SHARDS}/{name} ({file.stat().st_size} bytes, "
                f"{size} written); copy it again or resume from another checkpoint"
            )
        check_sum(path, meta, f"{SHARDS}/{name}")


def load_shards(path: Path, meta: dict[str, Any], template: dict[str, Any], distributed: bool) -> None:
    """Fill `template` (tensors/DTensors of this process's shapes and placements) in place from
    the DCP shards of step directory `path`; DCP reshards to this run's number of processes."""
    check_shards(path, meta)
    _load_checked_shards(path, meta, template, distributed)


def _load_checked_shards(path: Path, meta: dict[str, Any], template: dict[str, Any], distributed: bool) -> None:
    """`load_shards` once `check_shards` has passed (it hashes every file: once is enough)."""
    import torch.distributed.checkpoint as dcp

    reader_cls, planner_cls = _dcp_classes()
    reader = reader_cls(str(path / SHARDS))
    files = {getattr(info, "relative_path", None) for info in reader.read_metadata().storage_data.values()}
    missing = sorted(map(str, files - set(meta["shards"])))
    if missing:
        raise UserError(
            f"checkpoint {path} refers to shard {SHARDS}/{missing[0]} that meta.json does not list; "
            "it is corrupt, resume from another checkpoint"
        )
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.load(template, storage_reader=reader, planner=planner_cls(), no_dist=not distributed)
    except UserError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's (a BaseException) wraps every read failure
        cause = _first(exc)
        if isinstance(cause, UserError):  # our planner's refusal, on some rank
            raise UserError(str(cause)) from None
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise UserError(
            f"checkpoint {path} has unreadable shards ({first[:200]}); resume from another checkpoint"
        ) from None


def load_sharded_model(path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full weights of a sharded checkpoint, read in this process (for eval and generate)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    check_shards(path, meta)
    metadata = _dcp_classes()[0](str(path / SHARDS)).read_metadata()
    model = {
        key[len("model.") :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    template = {"model": model}
    _load_checked_shards(path, meta, template, distributed=False)
    return template["model"]


# The globals a `.metadata` pickle may name besides DCP's metadata classes (the public module
# torch.distributed.checkpoint.metadata) and torch dtypes. Three of them are private to torch, and
# there is no public way to read the file without them, because DCP pickles them: the filesystem
# layer's _StorageInfo (where an item lies in which shard file), torch.serialization._get_layout
# (how a torch.layout pickles), and the metadata module's _MEM_FORMAT_ENCODING (a tensor's memory
# format; admitted as a class of that module). tests/train/test_sharded_checkpoint.py fails if a DCP
# save pickles a global outside this set or stops pickling one of them.
ALLOWED_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib", "Path"),
    }
)
# Python 3.13 moved pathlib's classes into pathlib._local, and pickles them under that name. They are
# read as pathlib's, so a checkpoint written on 3.13 also resumes on 3.11 and 3.12 (no such module).
MODULE_ALIASES = {"pathlib._local": "pathlib"}


def _metadata_unpickler() -> type:
    """A pickle.Unpickler for DCP's `.metadata` that resolves only the globals it needs."""
    import pickle

    import torch.distributed.checkpoint.metadata as dcp_metadata

    class Unpickler(pickle.Unpickler):
        """Admits DCP's metadata classes, torch.Size, dtypes and layouts, and nothing else."""

        def find_class(self, module: str, name: str) -> Any:
            found = getattr(dcp_metadata, name, None)
            if module == dcp_metadata.__name__ and isinstance(found, type) and found.__module__ == module:
                return found  # a class DCP defines for its metadata (not one it merely imports)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            resolved = MODULE_ALIASES.get(module, module)
            if (resolved, name) in ALLOWED_GLOBALS:
                return super().find_class(resolved, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    return Unpickler


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """(reader, planner) classes, built on first use: importing DCP costs about a second, which
    every `tango-lm` command would otherwise pay. Both use DCP's public API only (a
    FileSystemReader given a path, its `load_id`, the planner's `load_bytes` hook)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    unpickler = _metadata_unpickler()

    class TrustedMetadataReader(FileSystemReader):
        """DCP's reader with `.metadata` read by the restricted unpickler above. It reads the
        global metadata only (we never save per-rank metadata), so it takes no `rank`."""

        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.metadata_file = Path(path) / METADATA

        def read_metadata(self) -> Any:
            where = self.metadata_file.parent.parent
            try:
                with open(self.metadata_file, "rb") as f:
                    metadata = unpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, OSError) as exc:
                raise UserError(
                    f"checkpoint {where} has unreadable shard metadata ({type(exc).__name__}: "
                    f"{str(exc)[:120]}); resume from another checkpoint"
                ) from None
            if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
                raise UserError(
                    f"checkpoint {where} has shard metadata of the wrong kind; resume from another checkpoint"
                )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        """We store only tensors with DCP; DCP would read any other item with a full unpickle."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise UserError(
                f"checkpoint shards hold a non-tensor item {read_item.dest_index.fqn!r} where a tensor "
                "belongs; the checkpoint is corrupt or foreign, resume from another one"
            )

    return TrustedMetadataReader, TensorsOnlyPlanner
