"""Weighted mixtures of prepared datasets that share a tokenizer.

Documents (the token runs between end-of-text ids) are copied, not re-tokenized. Each component
walks its documents in a seeded permutation (a new one per epoch), and the next document always
comes from the component that is furthest below its share: the one with the smallest
tokens_so_far / weight (ties to the earlier component). Realized token proportions therefore match
the weights to within one document per component, deterministically for a given seed; `data
prepare` prints them and warns of a split more than SHARE_TOLERANCE off (documents long against it).

Length: by default no document is repeated, so the mixture stops when the component chosen next
has no documents left (about min_i tokens_i / weight_i tokens). With `tokens` the train split
stops once it has that many tokens, and components start new epochs (fresh permutations) as
needed; the manifest records each component's epochs. Every split present in all components is
mixed the same way (dev/test never repeat); a split that is missing or empty in some component
is mixed from the others with their weights renormalized, and train must be present in all.

Held out: a document (the same tokens) that any component's test split holds is left out of the
mixture's train and dev, and one any component's dev split holds is left out of its train, so
components that share documents (a corpus and a filtered copy of it) keep no test text in training.
The manifest's `realized` counts each component's documents left out (`held_out`). A component
whose every dev document is held out is left out of the dev mix, as an empty split; one whose
every train document is, is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tango_lm.data.dataset_dir import check_writable
from tango_lm.data.shards import PreparedDataset, write_prepared
from tango_lm.data.source import DataSource
from tango_lm.data.tokenizers import Tokenizer, same_tokenizer
from tango_lm.errors import UserError, option, path_arg
from tango_lm.progress_lines import Progress

__all__ = ["MixtureSource", "parse_component", "prepare_mixture", "mix_documents"]

_CHUNK = 1 << 24  # tokens scanned at a time when locating end-of-text ids
SHARE_TOLERANCE = 0.05  # a split's realized token share this far from its weight's is warned of


def parse_component(text: str) -> tuple[str, float]:
    """`DIR:WEIGHT` -> (DIR, WEIGHT); the weight must be a positive number."""
    path, sep, weight = str(text).rpartition(":")
    try:
        w = float(weight) if sep and path else float("nan")
    except ValueError:
        w = float("nan")
    if not (w > 0 and math.isfinite(w)):
        raise UserError(f"bad mixture component {text!r}; write DIR:WEIGHT with a positive weight, e.g. data/web:0.7")
    return path, w


class _Documents:
    """The documents of one split of a prepared dataset, located by their end-of-text ids.

    Shards stay memory-mapped; only the document end offsets (8 bytes per document) are in memory.
    """

    def __init__(self, ds: PreparedDataset, split: str) -> None:
        self.maps: list[np.ndarray] = []
        starts = [0]
        for sh in ds.manifest["splits"][split]["shards"]:
            n = int(sh["tokens"])
            if n:
                self.maps.append(np.memmap(ds.path / sh["file"], dtype=ds.dtype, mode="r", shape=(n,)))
                starts.append(starts[-1] + n)
        self.shard_starts = np.asarray(starts, dtype=np.int64)
        eot = ds.tokenizer.eot_id
        ends = []
        for base, m in zip(starts, self.maps, strict=False):
            for lo in range(0, len(m), _CHUNK):
                ends.append(np.flatnonzero(np.asarray(m[lo : lo + _CHUNK]) == eot) + (base + lo))
        self.ends = np.concatenate(ends) if ends else np.empty(0, dtype=np.int64)  # EOT positions
        documents = ds.num_documents(split)
        if len(self.ends) != documents or (documents and int(self.ends[-1]) != starts[-1] - 1):
            raise UserError(
                f"split {split!r} of {ds.path} holds {len(self.ends)} end-of-text ids for "
                f"{documents} documents (or does not end with one); it was altered while being read, "
                "check it with `tango-lm data verify`"
            )

    def __len__(self) -> int:
        return len(self.ends)

    def get(self, i: int) -> np.ndarray:
        """Tokens of document i, without its end-of-text id."""
        start = int(self.ends[i - 1]) + 1 if i else 0
        end = int(self.ends[i])
        s = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        off = start - int(self.shard_starts[s])
        if end <= int(self.shard_starts[s + 1]):
            return np.asarray(self.maps[s][off : off + end - start])
        parts, pos = [], start
        while pos < end:  # a document that crosses shard borders
            s = int(np.searchsorted(self.shard_starts, pos, side="right")) - 1
            take = min(end, int(self.shard_starts[s + 1])) - pos
            parts.append(np.asarray(self.maps[s][pos - int(self.shard_starts[s]) :][:take]))
            pos += take
        return np.concatenate(parts)


def document_key(ids: np.ndarray) -> bytes:
    """A document's identity across components (they share a tokenizer, hence token dtype)."""
    return hashlib.blake2b(ids.tobytes(), digest_size=16).digest()


def mix_documents(
    docs: Sequence[_Documents],
    weights: Sequence[float],
    seed: int,
    tokens: int | None,
    stats: list[dict[str, int]],
    held_out: frozenset[bytes] = frozenset(),
    split: str = "train",
) -> Iterator[np.ndarray]:
    """Token arrays (documents without EOT) of the mixture's `split`, recording per-component counts
    in `stats`; documents whose `document_key` is in `held_out` are passed over (counted as
    held_out). A component whose every dev (or test) document is held out leaves that split's mix,
    the others' weights renormalized, as an empty split would; for train it is an error."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    emitted = np.zeros(len(docs))
    mixed = np.ones(len(docs), dtype=bool)  # components still in this split's mix
    orders: list[np.ndarray | None] = [None] * len(docs)
    cursors = [0] * len(docs)
    for st in stats:
        st.update(tokens=0, documents=0, epochs=0, held_out=0)
    total = 0
    while (tokens is None or total < tokens) and mixed.any():
        i = int(np.argmin(np.where(mixed, emitted / w, np.inf)))
        if orders[i] is None or cursors[i] == len(orders[i]):
            # (first: the default mixture would end at once, nearly empty; one with --tokens would choose it forever)
            if stats[i]["epochs"] and not stats[i]["documents"]:
                if split != "train":
                    mixed[i] = False
                    continue
                raise UserError(
                    f"every train document of mixture component {stats[i].get('component', i) + 1} is held out "
                    "(another component's dev or test split holds it); leave that component out"
                )
            if stats[i]["epochs"] and tokens is None:
                return  # the default mixture never repeats a document
            orders[i] = np.random.default_rng([seed, i, stats[i]["epochs"]]).permutation(len(docs[i]))
            cursors[i] = 0
            stats[i]["epochs"] += 1
        ids = docs[i].get(int(orders[i][cursors[i]]))
        cursors[i] += 1
        if held_out and document_key(ids) in held_out:
            if stats[i]["epochs"] == 1:  # counted once, not again on each later pass
                stats[i]["held_out"] += 1
            continue
        n = len(ids) + 1
        emitted[i] += n
        total += n
        stats[i]["tokens"] += n
        stats[i]["documents"] += 1
        yield ids
    if not any(st["documents"] for st in stats) and any(st["held_out"] for st in stats):
        raise UserError(  # left out of every component: the split would be written empty
            f"every {split} document of every mixture component is held out (another component's test split "
            f"holds it); give a component whose {split} documents no other component's test split holds"
        )


class _PreTokenized(Tokenizer):
    """Hands token arrays through `write_prepared` unchanged, describing itself as `base`."""

    def __init__(self, base: Tokenizer) -> None:
        self.base, self.name = base, base.name
        self.vocab_size, self.eot_id = base.vocab_size, base.eot_id

    def encode_batch(self, texts):  # the "texts" are token arrays
        return texts

    def fingerprint(self) -> str:
        return self.base.fingerprint()

    def to_dict(self) -> dict[str, Any]:
        return self.base.to_dict()


@dataclass(kw_only=True)
class MixtureSource(DataSource):
    """Prepared datasets mixed by token weight (module docstring) into a new prepared dataset.

    `components` are `(path, weight)` pairs or `"DIR:WEIGHT"` strings; weights need not sum to 1.
    A mixture's tokenizer is its components' (checked to be one), so it opens them in `read`,
    after the output is known to be writable, and writes their token runs as they are.
    """

    name = "mixture"
    help = "weighted mixture of prepared datasets that share a tokenizer"

    components: Sequence[str | tuple[str, float]]
    tokens: int | None = None
    seed: int = 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True, type=path_arg, help="output directory")
        parser.add_argument(
            "--source",
            dest="source_dirs",
            action="append",
            required=True,
            metavar="DIR:WEIGHT",
            help="a prepared dataset and its token weight (repeatable)",
        )
        parser.add_argument(
            "--tokens", type=int, default=None, help="train tokens (default: each document at most once)"
        )
        parser.add_argument("--seed", type=int, default=0, help="seed of the document orders (default %(default)s)")
        cls.add_overwrite_argument(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MixtureSource:
        return cls(components=args.source_dirs, tokens=args.tokens, seed=args.seed)

    def check(self) -> None:
        comps = [parse_component(s) if isinstance(s, str) else (str(s[0]), float(s[1])) for s in self.components]
        if not comps:
            raise UserError("a mixture needs at least one --source DIR:WEIGHT")
        seen: dict[Path, str] = {}
        for path, w in comps:
            if not (w > 0 and math.isfinite(w)):
                raise UserError(f"mixture weight of {path} must be positive, got {w}")
            resolved = Path(path).resolve()
            if resolved in seen:  # its documents would be repeated, which a mixture promises not to do
                also = "" if seen[resolved] == path else f" (also as {seen[resolved]})"
                raise UserError(f"mixture names dataset {path} twice{also}; give it once, with the sum of the weights")
            seen[resolved] = path
        if not math.isfinite(sum(w for _, w in comps)):  # each one finite, their sum not: shares of inf
            raise UserError("the mixture weights sum past what a float holds; give them as shares such as 0.7 and 0.3")
        if self.seed < 0:
            raise UserError(f"--seed must be 0 or more (got {self.seed})")
        tokens = self.tokens
        if tokens is not None and tokens < 1:
            raise UserError(
                f"{option('tokens')} must be at least 1, got {tokens}; omit it to use each document at most once"
            )
        self._comps = comps

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[np.ndarray]]:
        comps, seed, tokens = self._comps, self.seed, self.tokens
        datasets = [PreparedDataset.open(p) for p, _ in comps]
        first = datasets[0]
        for (path, _), ds in zip(comps, datasets, strict=True):
            a, b = first.tokenizer.to_dict(), ds.tokenizer.to_dict()
            if not same_tokenizer(a, b):
                raise UserError(
                    f"{path} uses tokenizer {b['name']!r} ({b['fingerprint'][:12]}) but {comps[0][0]} "
                    f"uses {a['name']!r} ({a['fingerprint'][:12]}); prepare all components with one "
                    "tokenizer"
                )
            if "train" not in ds.splits or ds.num_documents("train") == 0:
                raise UserError(f"{path} has no train documents; every mixture component needs them")
        names = [s for s in first.splits if s == "train"] + [
            s for s in dict.fromkeys(s for ds in datasets for s in ds.splits) if s != "train"
        ]
        self._stats: dict[str, list[dict[str, int]]] = {}
        splits: dict[str, Iterator[np.ndarray]] = {}
        docs = {
            split: [
                (k, _Documents(ds, split))
                for k, ds in enumerate(datasets)
                if split in ds.splits and ds.num_documents(split) > 0
            ]
            for split in names
        }
        keys = {
            s: frozenset(document_key(d.get(i)) for _, d in docs.get(s, []) for i in range(len(d)))
            for s in ("dev", "test")
        }
        held_out = {"train": keys["dev"] | keys["test"], "dev": keys["test"]}
        for split in names:
            if not docs[split]:
                continue
            self._stats[split] = [{"component": k} for k, _ in docs[split]]
            splits[split] = mix_documents(
                [d for _, d in docs[split]],
                [comps[k][1] for k, _ in docs[split]],
                seed,
                tokens if split == "train" else None,
                self._stats[split],
                held_out.get(split, frozenset()),
                split,
            )
        self._datasets = datasets
        return splits

    def fingerprint(self) -> dict[str, Any]:
        comps = self._comps
        total_w = sum(w for _, w in comps)
        return {
            "name": "mixture",
            "seed": self.seed,
            "tokens": self.tokens,
            "components": [
                {
                    "path": str(Path(p).absolute()),
                    "weight": w,
                    "share": w / total_w,
                    "source": ds.source.get("name") if isinstance(ds.source, dict) else None,
                }
                for (p, w), ds in zip(comps, self._datasets, strict=True)
            ],
            "realized": self._stats,
        }  # filled while the splits stream, serialized with the manifest at the end

    def _split_shares(self) -> Iterator[tuple[str, list[tuple[str, float, float]]]]:
        """Each split mixed from two components or more, with (path, realized token share, the
        share its weight asked among that split's components) per component."""
        for split, stats in self._stats.items():
            stats = [st for st in stats if st["documents"] or not st["held_out"]]  # not those left out of the split
            total = sum(st["tokens"] for st in stats)
            weight = sum(self._comps[st["component"]][1] for st in stats)
            if len(stats) > 1 and total:
                comps = [self._comps[st["component"]] for st in stats]
                yield (
                    split,
                    [(path, st["tokens"] / total, w / weight) for (path, w), st in zip(comps, stats, strict=True)],
                )

    def summary(self) -> list[str]:
        return [
            f"{split} mix: " + ", ".join(f"{path} {got:.1%} (weight {asked:.1%})" for path, got, asked in shares)
            for split, shares in self._split_shares()
        ]

    def warnings(self) -> list[str]:
        # Within one document per component (module docstring): off by more only where documents
        # are long against the split, which the user fixes with more tokens or shorter documents.
        out = []
        for split, shares in self._split_shares():
            if max(abs(got - asked) for _, got, asked in shares) > SHARE_TOLERANCE:
                fix = (
                    "mix more tokens (--tokens N) or prepare the components in shorter documents"
                    if split == "train"
                    else f"give the components more {split} documents"
                )
                out.append(
                    f"the mixture's {split} split is "
                    + ", ".join(f"{got:.1%} {path}" for path, got, _ in shares)
                    + " for weights of "
                    + ", ".join(f"{asked:.1%}" for _, _, asked in shares)
                    + f": a mixture adds whole documents, and some are long against the split; {fix}"
                )
        return out

    def prepare(self, out_dir: str | os.PathLike, *, overwrite: bool = False, progress: Progress = True) -> Path:
        self.check()
        for path, _ in self._comps:
            if Path(path).resolve() == Path(out_dir).resolve():  # --overwrite would replace it as it is read
                raise UserError(f"--out {out_dir} is the component {path}; write the mixture to another folder")
        check_writable(out_dir, overwrite)
        splits = self.read(None, Path(out_dir), progress)
        return write_prepared(
            out_dir,
            _PreTokenized(self._datasets[0].tokenizer),
            splits,
            self.fingerprint(),
            progress=progress,
            overwrite=overwrite,
        )


def prepare_mixture(
    out_dir: str | os.PathLike,
    sources: Sequence[str | tuple[str, float]],
    tokens: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
    progress: Progress = True,
) -> Path:
    """Mix prepared datasets by token weight into a new prepared dataset (MixtureSource)."""
    return MixtureSource(components=sources, tokens=tokens, seed=seed).prepare(
        out_dir, overwrite=overwrite, progress=progress
    )
