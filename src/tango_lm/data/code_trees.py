"""Code trees: one document per source file (default: Python's standard library, tests excluded)."""

from __future__ import annotations

import argparse
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm.data.inputs import _walk
from tango_lm.data.source import HeldOutSource
from tango_lm.errors import UserError
from tango_lm.progress_lines import Progress

__all__ = ["CodeSource", "CODE_ALWAYS_EXCLUDED", "CODE_TEST_DIRS", "stdlib_path", "code_documents", "prepare_code"]

# Always skipped in code trees (installed packages are not the tree's own code), and tests unless asked.
CODE_ALWAYS_EXCLUDED = ("site-packages", "dist-packages", "__pycache__", "node_modules")
CODE_TEST_DIRS = ("test", "tests", "*_test", "*_tests")  # the stdlib's idlelib/idle_test too


_COMMENT = {
    ".py": "#",
    ".sh": "#",
    ".rb": "#",
    ".pl": "#",
    ".r": "#",
    ".yaml": "#",
    ".yml": "#",
    ".toml": "#",
    ".lean": "--",
    ".hs": "--",
    ".sql": "--",
    ".lua": "--",
}


def stdlib_path() -> Path:
    """Python's standard library directory, the default code tree (about 12 MB of `.py` without tests)."""
    return Path(sysconfig.get_paths()["stdlib"])


def code_documents(
    roots: Sequence[str | os.PathLike],
    exts: Sequence[str] = (".py",),
    exclude_dirs: Sequence[str] = CODE_ALWAYS_EXCLUDED + CODE_TEST_DIRS,
    max_bytes: int = 1 << 20,
    path_header: bool = False,
    stats: dict[str, int] | None = None,
) -> Iterator[str]:
    """One document per source file under `roots`, walked in sorted order.

    Skipped (and counted in `stats`): files over `max_bytes`, binary files (a NUL byte) and files
    that are not UTF-8. With `path_header` each document starts with a comment naming the file's
    path relative to its root (`# path: pkg/mod.py`; `//` or `--` where the language wants it).
    """
    stats = stats if stats is not None else {}
    for key in ("files", "skipped_large", "skipped_binary", "skipped_undecodable"):
        stats.setdefault(key, 0)
    seen: set[Path] = set()  # a file under two roots (src and src/pkg, a file named again) is read once
    for root in roots:
        root_path = Path(root).expanduser()
        if not root_path.exists():
            raise UserError(f"input {root} does not exist; check the path")
        files = [root_path] if root_path.is_file() else _walk(root_path, exts, exclude_dirs)
        for path in files:
            if (resolved := path.resolve()) in seen:
                continue
            seen.add(resolved)
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


@dataclass(kw_only=True)
class CodeSource(HeldOutSource):
    """Source trees (default: Python's standard library) as a dataset, one document per file.

    Directories named in `exclude_dirs`, in CODE_ALWAYS_EXCLUDED, and test/tests/*_test/*_tests (unless
    `include_tests`) are skipped, as are hidden ones. Files are held out to dev/test by the hash
    of their text (splits.py).
    """

    name = "code"
    help = "source trees, one document per file (default: Python's stdlib)"

    inputs: Sequence[str | os.PathLike] = ()
    exts: Sequence[str] = (".py",)
    include_tests: bool = False
    exclude_dirs: Sequence[str] = ()
    max_bytes: int = 1 << 20
    path_header: bool = False

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="*", help="directories or files (none: Python's standard library)")
        cls.add_common_arguments(parser)
        parser.add_argument("--stdlib", action="store_true", help="add Python's standard library (sysconfig stdlib)")
        parser.add_argument("--ext", action="append", help="file extension (repeatable; default .py)")
        parser.add_argument(
            "--include-tests", action="store_true", help="keep test, tests, *_test and *_tests directories"
        )
        parser.add_argument(
            "--exclude-dir",
            action="append",
            default=[],
            help="directory name or pattern (*_bench) to skip (repeatable)",
        )
        parser.add_argument("--max-file-bytes", type=int, default=1 << 20, help="skip files larger than this")
        parser.add_argument("--path-header", action="store_true", help="start each document with a path comment")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CodeSource:
        inputs = [*args.inputs, *([str(stdlib_path())] if args.stdlib else [])]
        return cls(
            inputs=inputs,
            exts=args.ext or [".py"],
            max_bytes=args.max_file_bytes,
            include_tests=args.include_tests,
            exclude_dirs=args.exclude_dir,
            path_header=args.path_header,
            **cls.common_options(args),
        )

    @property
    def roots(self) -> list[str]:
        return [str(i) for i in self.inputs] or [str(stdlib_path())]

    @property
    def skipped_dirs(self) -> tuple[str, ...]:
        return (*CODE_ALWAYS_EXCLUDED, *(() if self.include_tests else CODE_TEST_DIRS), *self.exclude_dirs)

    def check(self) -> None:
        super().check()
        if self.max_bytes < 1:
            raise UserError(f"--max-file-bytes must be at least 1 (got {self.max_bytes})")

    def prepare(self, out_dir: str | os.PathLike, *, overwrite: bool = False, progress: Progress = True) -> Path:
        self._stats = {}
        try:
            return super().prepare(out_dir, overwrite=overwrite, progress=progress)
        except UserError:
            skipped = {k: self._stats.get(k, 0) for k in ("skipped_binary", "skipped_undecodable", "skipped_large")}
            if self._stats.get("files", 0) or not any(skipped.values()):
                raise
        # Nothing was read because every file was skipped: say that, not "the input holds no documents".
        raise UserError(
            f"every file of the input was skipped ({skipped['skipped_binary']} binary, "
            f"{skipped['skipped_undecodable']} not UTF-8 or unreadable, {skipped['skipped_large']} over "
            f"--max-file-bytes {self.max_bytes:,}), so no dataset was written to {out_dir}; check the inputs"
        ) from None

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[str]]:
        exts, exclude_dirs = self.exts, self.skipped_dirs
        for r in self.roots:
            root = Path(r).expanduser()
            if not root.exists():
                raise UserError(f"input {r} does not exist; check the path")
            if root.is_dir() and next(_walk(root, exts, exclude_dirs), None) is None:
                raise UserError(f"no {'/'.join(exts)} files under {r}; check the path or --ext")
        self._stats: dict[str, int] = {}  # (filled as the documents stream; the manifest records it)
        docs = code_documents(self.roots, exts, exclude_dirs, self.max_bytes, self.path_header, self._stats)
        # hashed without the path line: copies of one file at other paths stay in one split
        key = (lambda doc: doc.split("\n", 1)[1]) if self.path_header else None
        return self.held_out_splits({"train": docs}, out_dir, key)

    def fingerprint(self) -> dict[str, Any]:
        # `stats` is filled while the documents stream and is serialized with the manifest at the end.
        return {
            "name": "code",
            "roots": self.roots,
            "exts": list(self.exts),
            "exclude_dirs": list(self.skipped_dirs),
            "max_bytes": self.max_bytes,
            "path_header": self.path_header,
            **self.held_out_record(),
            "stats": self._stats,
        }


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
    progress: Progress = True,
) -> Path:
    """Prepare source trees (default: Python's standard library) as a dataset (CodeSource)."""
    source = CodeSource(
        inputs=inputs,
        tokenizer=tokenizer,
        exts=exts,
        include_tests=include_tests,
        exclude_dirs=exclude_dirs,
        max_bytes=max_bytes,
        path_header=path_header,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        seed=seed,
    )
    return source.prepare(out_dir, overwrite=overwrite, progress=progress)
