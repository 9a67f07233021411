"""Code trees: one document per source file (default: Python's standard library, tests excluded)."""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tango_lm.data.files import _walk
from tango_lm.data.source import _spill_dir, _tokenizer
from tango_lm.data.splits import _check_fractions, assemble_splits
from tango_lm.errors import UserError

__all__ = ["CODE_ALWAYS_EXCLUDED", "CODE_TEST_DIRS", "stdlib_path", "code_documents", "prepare_code"]

# Always skipped in code trees (installed packages are not the tree's own code), and tests unless asked.
CODE_ALWAYS_EXCLUDED = ("site-packages", "dist-packages", "__pycache__", "node_modules")
CODE_TEST_DIRS = ("test", "tests")


_COMMENT = {".py": "#", ".sh": "#", ".rb": "#", ".pl": "#", ".r": "#", ".yaml": "#", ".yml": "#", ".toml": "#",
            ".lean": "--", ".hs": "--", ".sql": "--", ".lua": "--"}


def stdlib_path() -> Path:
    """Python's standard library directory, the default code tree (about 12 MB of `.py` without tests)."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(roots: Sequence[str | os.PathLike], exts: Sequence[str] = (".py",),
                   exclude_dirs: Sequence[str] = CODE_ALWAYS_EXCLUDED + CODE_TEST_DIRS, max_bytes: int = 1 << 20,
                   path_header: bool = False, stats: dict[str, int] | None = None) -> Iterator[str]:
    """One document per source file under `roots`, walked in sorted order.

    Skipped (and counted in `stats`): files over `max_bytes`, binary files (a NUL byte) and files
    that are not UTF-8. With `path_header` each document starts with a comment naming the file's
    path relative to its root (`# path: pkg/mod.py`; `//` or `--` where the language wants it).
    """
    stats = stats if stats is not None else {}
    for key in ("files", "skipped_large", "skipped_binary", "skipped_undecodable"):
        stats.setdefault(key, 0)
    for root in roots:
        root_path = Path(root).expanduser()
        if not root_path.exists():
            raise UserError(f"input {root} does not exist; check the path")
        files = [root_path] if root_path.is_file() else _walk(root_path, exts, exclude_dirs)
        for path in files:
            try:
                if path.stat().st_size > max_bytes:
                    stats["skipped_large"] += 1
                    continue
                data = path.read_bytes()
            except OSError:
                stats["skipped_undecodable"] += 1
                continue
            if b"\0" in data:
                stats["skipped_binary"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                stats["skipped_undecodable"] += 1
                continue
            if not text.strip():
                continue
            stats["files"] += 1
            if path_header:
                rel = path.name if path == root_path else path.relative_to(root_path).as_posix()
                comment = next((c for e, c in _COMMENT.items() if path.name.lower().endswith(e)), "//")
                text = f"{comment} path: {rel}\n{text}"
            yield text



def prepare_code(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Any = "gpt2",
    *,
    exts: Sequence[str] = (".py",),
    include_tests: bool = False,
    exclude_dirs: Sequence[str] = (),
    max_bytes: int = 1 << 20,
    path_header: bool = False,
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Prepare source trees (default: Python's standard library) as a dataset, one document per file.

    Directories named in `exclude_dirs`, in CODE_ALWAYS_EXCLUDED, and test/tests (unless
    `include_tests`) are skipped, as are hidden ones. Files are held out to dev/test by the hash
    of their text (module docstring).
    """
    from tango_lm.data.shards import check_writable, write_prepared

    _check_fractions(dev_fraction, test_fraction)
    roots = [str(i) for i in inputs] or [str(stdlib_path())]
    exclude_dirs = (*CODE_ALWAYS_EXCLUDED, *(() if include_tests else CODE_TEST_DIRS), *exclude_dirs)
    tok = _tokenizer(tokenizer)
    check_writable(out_dir, overwrite)
    for r in roots:
        root = Path(r).expanduser()
        if not root.exists():
            raise UserError(f"input {r} does not exist; check the path")
        if root.is_dir() and next(_walk(root, exts, exclude_dirs), None) is None:
            raise UserError(f"no {'/'.join(exts)} files under {r}; check the path or --ext")
    stats: dict[str, int] = {}
    docs = code_documents(roots, exts, exclude_dirs, max_bytes, path_header, stats)
    splits = assemble_splits({"train": docs}, dev_fraction, test_fraction, seed, _spill_dir(out_dir))
    # `stats` is filled while the documents stream and is serialized with the manifest at the end.
    source = {"name": "code", "roots": roots, "exts": list(exts), "exclude_dirs": list(exclude_dirs),
              "max_bytes": max_bytes, "path_header": path_header, "dev_fraction": dev_fraction,
              "test_fraction": test_fraction, "seed": seed, "stats": stats}
    return write_prepared(out_dir, tok, splits, source, progress=progress, overwrite=overwrite)

