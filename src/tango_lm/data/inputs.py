"""The inputs of a file source: files, directories (walked recursively for the source's
extensions), glob patterns or `SPLIT=PATH` items, and the split each belongs to. A directory whose
top-level entries are named after splits keeps those splits (several such directories merge); the
test file of such a folder below an input, which would be trained on, is refused.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from tango_lm.data.splits import SPLIT_ALIASES
from tango_lm.errors import UserError

__all__ = ["INPUTS_HELP", "expand_inputs", "files_per_split", "refuse_split_named_training", "split_inputs"]

INPUTS_HELP = (
    "files, directories, glob patterns, or SPLIT=PATH (train=a dev=b); a directory with "
    "train*/validation*/test* entries keeps its splits"
)
_GLOB_CHARS = re.compile(r"[*?\[]")
_SPLIT_ENTRY = re.compile(r"^(train|dev|validation|valid|val|test)(?:[-_.].*)?$", re.IGNORECASE)
_SPLIT_NAMED_FILE = re.compile(r"^(dev|validation|valid|val|test)(?:[-_.0-9].*)?$", re.IGNORECASE)
_SPLIT_ARG = re.compile(r"^([A-Za-z][A-Za-z0-9_.-]*)=(.+)$")


def _has_ext(path: Path, exts: Sequence[str]) -> bool:
    name = path.name.lower()
    return any(name.endswith(e.lower()) for e in exts)


def _walk(root: Path, exts: Sequence[str], exclude_dirs: Sequence[str] = ()) -> Iterator[Path]:
    """Files under `root` with one of `exts`, in sorted order; hidden entries and the directories
    `exclude_dirs` names (names or patterns: `*_test`) skipped."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not any(fnmatch.fnmatchcase(d, x) for x in exclude_dirs)
        )
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if not f.startswith(".") and _has_ext(p, exts) and p.is_file():
                yield p


def expand_inputs(
    inputs: Sequence[str | os.PathLike], exts: Sequence[str], exclude_dirs: Sequence[str] = ()
) -> list[Path]:
    """Files named by `inputs` (files, directories walked recursively for `exts`, glob patterns), in order.

    Raises UserError for an input that does not exist, or when nothing matches.
    """
    if not inputs:
        raise UserError("no input files given; name files, directories or glob patterns")
    files: list[Path] = []
    for item in inputs:
        text = str(item)
        p = Path(text).expanduser()
        if p.is_dir():
            found = list(_walk(p, exts, exclude_dirs))
        elif p.is_file():
            found = [p]
        elif _GLOB_CHARS.search(text):
            found = []
            for m in sorted(glob.glob(str(p), recursive=True)):
                mp = Path(m)
                found.extend(_walk(mp, exts, exclude_dirs) if mp.is_dir() else [mp] if mp.is_file() else [])
        else:
            raise UserError(f"input {text} does not exist; check the path")
        if not found:
            raise UserError(f"no {'/'.join(exts)} files at {text}; check the path or pass --ext")
        files.extend(found)
    unique: dict[Path, Path] = {}  # one file named twice (data.jsonl and $PWD/data.jsonl) is read once
    for f in files:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def split_inputs(inputs: Sequence[str | os.PathLike], exts: Sequence[str]) -> dict[str, list[str]]:
    """Group inputs by the split they belong to (module docstring); `{"train": inputs}` when unsplit.

    `SPLIT=PATH` inputs name their split (validation/valid/val mean dev); otherwise input
    directories whose top-level entries are named after splits provide them (several such
    directories merge), or whose one folder (beside files of other kinds, such as a README) does.
    """
    items = [str(i) for i in inputs]
    explicit = [_SPLIT_ARG.match(i) for i in items]
    if any(m and not Path(i).exists() for m, i in zip(explicit, items, strict=True)):
        out: dict[str, list[str]] = {}
        for m, i in zip(explicit, items, strict=True):
            if m is None or Path(i).exists():
                raise UserError(f"input {i} has no split; when one input is SPLIT=PATH, write all of them so")
            split = SPLIT_ALIASES.get(m.group(1).lower())
            if split is None:
                raise UserError(
                    f"input {i} names the split {m.group(1)!r}; the splits are train, dev "
                    "(or validation, valid, val) and test"
                )
            out.setdefault(split, []).append(m.group(2))
        return out
    if items and all(Path(i).is_dir() for i in items):
        # one folder: split entries without train ones are refused; among several (Lean projects
        # with a test/ folder, say) such a folder is training text, as it always was
        layouts = [_directory_splits(i, exts, strict=len(items) == 1) for i in items]
        split = [i for i, layout in zip(items, layouts, strict=True) if set(layout) != {"train"}]
        if split and len(split) < len(items):  # some inputs' own train files would be mixed with the others'
            plain = next(i for i in items if i not in split)
            raise UserError(
                f"{split[0]} has train*/test* entries but {plain} does not; give every input as SPLIT=PATH "
                "(train=... test=...) or only folders laid out in splits"
            )
        if split:  # folders of one corpus each laid out in splits (corpus/en, corpus/de): merged
            out: dict[str, list[str]] = {}
            for layout in layouts:
                for name, paths in layout.items():
                    out.setdefault(name, []).extend(paths)
            return out
    return {"train": items}


def _directory_splits(directory: str, exts: Sequence[str], strict: bool = True) -> dict[str, list[str]]:
    """A directory's splits: its top-level entries named after splits, or those of its one folder
    (a dataset repository's README.md beside data/); `{"train": [directory]}` when it has none
    (or, not `strict`, when they are not a whole layout)."""
    out: dict[str, list[str]] = {}
    others = []
    entries = [
        e for e in sorted(Path(directory).iterdir()) if not e.name.startswith(".") and (e.is_dir() or _has_ext(e, exts))
    ]
    if len(entries) == 1 and entries[0].is_dir() and not _SPLIT_ENTRY.match(entries[0].name):
        inner = _directory_splits(str(entries[0]), exts, strict)
        if set(inner) != {"train"}:
            return inner
    for entry in entries:
        m = _SPLIT_ENTRY.match(entry.name)
        if m:
            out.setdefault(SPLIT_ALIASES[m.group(1).lower()], []).append(str(entry))
        else:
            others.append(entry.name)
    if not strict and ("train" not in out or len(out) == 1 or others):
        return {"train": [directory]}
    if "train" in out and len(out) > 1:
        if others:
            raise UserError(
                f"{directory} has split entries ({', '.join(out)}) and also {', '.join(others)}; "
                "move those away or name each input as SPLIT=PATH"
            )
        return out
    if out and "train" not in out:  # the user's dev or test files would be trained on
        named = ", ".join(Path(p).name for paths in out.values() for p in paths)
        raise UserError(
            f"{directory} has entries named after the {' and '.join(out)} split ({named}) but none named "
            "train, train-*, train_* or train.*; name the training files so to keep those splits, or give "
            "every input as SPLIT=PATH"
        )
    return {"train": [directory]}


def refuse_split_named_training(inputs: Sequence[str | os.PathLike], files: dict[str, list[Path]]) -> None:
    """A dev or test file or folder of a folder laid out in splits (`corpus/en/test.jsonl` beside
    `train.jsonl`, or `corpus/en/test/part-0.jsonl` beside `train/`) that inputs naming a folder
    above it would train on, the held-out splits then drawn from training text: refused, not
    guessed. Files and folders named on purpose, `SPLIT=PATH` inputs and a lone `Test_cricket.txt`
    (no train entry beside it) are read as given."""
    named = [str(i) for i in inputs]
    if set(files) != {"train"} or any(_SPLIT_ARG.match(i) and not Path(i).exists() for i in named):
        return
    given = {Path(i).resolve() for i in named if Path(i).is_file()}
    roots = [Path(i).resolve() for i in named if Path(i).is_dir()]
    has_train_entry: dict[Path, bool] = {}  # per folder: many files share their ancestors

    def beside_train(folder: Path) -> bool:
        if folder not in has_train_entry:
            has_train_entry[folder] = any(
                _SPLIT_ENTRY.match(e.name) and e.name.lower().startswith("train") for e in folder.iterdir()
            )
        return has_train_entry[folder]

    for path in files["train"]:
        resolved = path.resolve()
        if resolved in given:
            continue
        root = next((r for r in roots if resolved.is_relative_to(r)), None)
        # the file, and the folders between it and the input that names a folder above it
        nodes = [resolved, *(p for p in resolved.parents if root is not None and p.is_relative_to(root) and p != root)]
        for node in nodes:
            m = _SPLIT_NAMED_FILE.match(node.name)
            if m is None or not beside_train(node.parent):
                continue
            split = SPLIT_ALIASES[m.group(1).lower()]
            what = f"the {split} file" if node == resolved else f"in {node}, the {split} folder"
            raise UserError(
                f"{path} is {what} of a folder laid out in splits ({node.parent}), which these inputs would "
                "train on; give that folder as an input (its splits are kept) or every input as SPLIT=PATH"
            )


def files_per_split(groups: dict[str, list[str]], exts: Sequence[str]) -> dict[str, list[Path]]:
    """`expand_inputs` of each split's inputs; a file named in two splits is refused (a test split
    that is the train split would report the NLL of training text)."""
    files = {s: expand_inputs(paths, exts) for s, paths in groups.items()}
    owner: dict[Path, str] = {}
    for split, paths in files.items():
        for path in paths:
            other = owner.setdefault(path.resolve(), split)
            if other != split:
                raise UserError(
                    f"{path} is an input of both the {other} and the {split} split; give each split its own files"
                )
    return files
