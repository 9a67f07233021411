"""Lean: `.lean` source files plus proof-completion examples cut from them, weighted equally.

Proof-completion examples. Every top-level `theorem` or `lemma` (a line at column 0 outside
comments and strings, optionally with attributes and modifiers such as `@[simp] private theorem`)
gives one example: the *statement* runs from the keyword through the first `:=` outside brackets,
comments and strings that no `let`/`have` of the statement itself (`: let x := 1; x = 1 :=`)
binds, and the *proof* is everything after it up to the next top-level line (a
declaration, command, attribute or comment at column 0; `|`, `where`, `termination_by`,
`decreasing_by` and `deriving` lines continue the proof), with trailing whitespace removed. The
example's document is statement + proof, i.e. valid Lean with the statement as context and the
proof as the target. Declarations without a top-level `:=` (pattern-matching alternatives) are
not cut.

Equal weight (the TANGO paper: "Lean gives equal weight to source files and proof completion")
means equal *tokens*: in every split, the proof-completion examples contribute as many tokens
(end-of-text ids included) as the source files do. Examples are repeated whole k times, and a
deterministic subset chosen by hash fills the remainder (or, when the examples alone outweigh the
sources, is all that is kept), so the two parts differ by less than one example's tokens.
`proof_weight` generalizes this: the examples' share of a split's tokens (0.5 = equal weight).
Copies of an example are emitted in separate rounds over the split's files, so they are spread
over the token stream: two copies touch only where a round holds a single example (a split that
keeps one example, or one copy past the others' whole repeats that also ended the round before).

Splits: files, not examples, are held out (by the hash of the file's text, see `sources`), and
every example goes to the split of the file it was cut from; an example whose text a train file's
examples also give (a lemma copied between files) is left out of dev and test, and one a dev
file's examples give out of test, so no test example is one seen in training (a lemma copied
between files still appears in each file's source text, whatever split the file went to).
Counting tokens needs a first pass that tokenizes the corpus; the second pass writes it.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tango_lm.data.inputs import INPUTS_HELP, files_per_split, refuse_split_named_training, split_inputs
from tango_lm.data.source import HeldOutSource, KnownCount
from tango_lm.data.splits import _unit, split_of
from tango_lm.errors import UserError, option
from tango_lm.progress_lines import Progress, progress_bar

__all__ = [
    "LeanSource",
    "ProofExample",
    "proof_examples",
    "read_lean",
    "plan_lean",
    "lean_documents",
    "prepare_lean",
    "PROOF_KEYWORDS",
]

PROOF_KEYWORDS = ("theorem", "lemma")
_CONTINUATION = ("|", "where", "termination_by", "decreasing_by", "deriving")
_DECL = re.compile(
    r"(?:@\[[^\n]*?\]\s*)*(?:(?:private|protected|noncomputable|nonrec|partial|unsafe|scoped)\s+)*"
    r"(theorem|lemma)\s+([^\s:({\[⦃⟨]+)"
)
_OPEN, _CLOSE = "([{⟨⦃⟦", ")]}⟩⦄⟧"
_LEXEME = re.compile(r":=|[()\[\]{}⟨⟩⦃⦄⟦⟧]|\b(?:let|have|letI|haveI)\b")
_BINDERS = ("let", "have", "letI", "haveI")  # a statement's own `let x := v; ...` is not where its proof starts
_OPENER = re.compile(r"--|/-|\"|'")
_BLOCK = re.compile(r"/-|-/")
_CHAR = re.compile(r"'(?:\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)|[^\\'\n])'")


@dataclass(frozen=True)
class ProofExample:
    """One proof-completion example: `statement` (through `:=`) is the context, `proof` the target."""

    name: str
    statement: str
    proof: str
    path: str
    line: int

    @property
    def text(self) -> str:
        return self.statement + self.proof


def _comment_and_string_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) spans of comments (nested `/- -/`, `--`) and string/char literals, in order."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(text)
    while i < n:
        m = _OPENER.search(text, i)
        if m is None:
            break
        start, tok = m.start(), m.group()
        if tok == "--":
            end = text.find("\n", start)
            end = n if end < 0 else end
        elif tok == "/-":
            depth, j = 1, start + 2
            while depth and j < n:
                k = _BLOCK.search(text, j)
                if k is None:
                    j = n
                    break
                depth += 1 if k.group() == "/-" else -1
                j = k.end()
            end = j
        elif tok == '"':
            j = start + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            end = min(n, j + 1)
        else:  # `'`: a char literal unless it ends an identifier (h', f'')
            prev = text[start - 1] if start else " "
            c = _CHAR.match(text, start)
            if prev.isalnum() or prev in "_'!?" or c is None:
                i = start + 1
                continue
            end = c.end()
        spans.append((start, end))
        i = end
    return spans


def proof_examples(text: str, path: str = "<string>") -> list[ProofExample]:
    """The proof-completion examples of one Lean file (module docstring)."""
    spans = _comment_and_string_spans(text)
    starts = [s for s, _ in spans]

    def inside(pos: int) -> bool:  # strictly inside a comment/string that began earlier
        k = bisect.bisect_left(starts, pos) - 1
        return k >= 0 and spans[k][0] < pos < spans[k][1]

    def in_span(pos: int) -> bool:
        k = bisect.bisect_right(starts, pos) - 1
        return k >= 0 and spans[k][0] <= pos < spans[k][1]

    line_starts = [0] + [m.end() for m in re.finditer(r"\n", text)]
    top = [ls for ls in line_starts if ls < len(text) and not text[ls].isspace() and not inside(ls)]
    ends = [ls for ls in top if not text.startswith(_CONTINUATION, ls)]
    examples = []
    for ls in top:
        m = _DECL.match(text, ls)
        if m is None:
            continue
        k = bisect.bisect_right(ends, ls)
        end = ends[k] if k < len(ends) else len(text)
        depth, binders, assign = 0, 0, None
        for lex in _LEXEME.finditer(text, m.end(), end):
            if in_span(lex.start()):
                continue
            t = lex.group()
            if t in _OPEN:
                depth += 1
            elif t in _CLOSE:
                depth = max(0, depth - 1)
            elif t in _BINDERS and depth == 0:
                binders += 1
            elif t == ":=" and depth == 0 and binders:
                binders -= 1  # that binding's value, not the proof
            elif t == ":=" and depth == 0:
                assign = lex.end()
                break
        if assign is None:
            continue
        proof = text[assign:end].rstrip()
        if proof.strip():
            line = text.count("\n", 0, ls) + 1
            examples.append(ProofExample(m.group(2), text[ls:assign], proof, path, line))
    return examples


def read_lean(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason}); convert it or leave it out") from None
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e}); check the file") from None


def _assign_files(
    inputs: Sequence[str | os.PathLike],
    exts: Sequence[str],
    dev_fraction: float,
    test_fraction: float,
    seed: int,
    read_bar: Any = lambda files, what: files,
) -> dict[str, list[Path]]:
    """Files of each split: the inputs' own splits, dev/test held out of train by file-text hash
    (`read_bar` wraps the files read for it in a progress bar)."""
    groups = files_per_split(split_inputs(inputs, exts), exts)
    refuse_split_named_training(inputs, groups)
    if "train" not in groups:
        raise UserError(f"the inputs have splits {', '.join(groups)} but no train split; give one (train=PATH)")
    dev = 0.0 if "dev" in groups else dev_fraction
    test = 0.0 if "test" in groups else test_fraction
    out: dict[str, list[Path]] = {"train": []}
    out.update({s: [] for s in ("dev", "test") if (s in groups) or (dev if s == "dev" else test) > 0})
    for path in read_bar(groups["train"], "split files"):
        out[split_of(read_lean(path), dev, test, seed)].append(path)
    for s, files in groups.items():
        if s != "train":
            out.setdefault(s, []).extend(files)
    return out


def _kept(examples: list[ProofExample], seen: frozenset[str]) -> list[tuple[int, ProofExample]]:
    """(index, example) of a file's examples whose text is not in `seen` (an earlier split's)."""
    return [(ei, e) for ei, e in enumerate(examples) if e.text not in seen]


def example_texts(files: Sequence[Path]) -> frozenset[str]:
    """The texts of every proof-completion example of `files`."""
    return frozenset(e.text for path in files for e in proof_examples(read_lean(path), str(path)))


def plan_lean(
    files: Sequence[Path], tokenizer: Any, proof_weight: float = 0.5, seed: int = 0, seen: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Copies of each example so that examples hold `proof_weight` of the split's tokens; examples
    whose text is in `seen` (a train file's, for dev and test) are left out.

    Returns `{"repeats": k, "extra": {(file_index, example_index), ...}, ...token counts}`: every
    example is written k times, those in `extra` once more.
    """
    source_tokens, source_documents, examples, left_out = 0, 0, [], 0  # examples: (hash, tokens, key)
    for fi, path in enumerate(files):
        text = read_lean(path)
        examples_of_file = proof_examples(text, str(path))
        kept = _kept(examples_of_file, seen)
        left_out += len(examples_of_file) - len(kept)
        ids = tokenizer.encode_batch([text] + [e.text for _, e in kept])
        if text.strip():  # a blank file is not written (lean_documents)
            source_tokens += len(ids[0]) + 1
            source_documents += 1
        for (ei, e), e_ids in zip(kept, ids[1:], strict=True):
            examples.append((_unit(f"{fi}/{ei}/{e.text}", seed), len(e_ids) + 1, (fi, ei)))
    total = sum(n for _, n, _ in examples)
    target = source_tokens * proof_weight / (1 - proof_weight)
    repeats = int(target // total) if total else 0
    remainder = target - repeats * total
    extra, filled = set(), 0
    for _, n, key in sorted(examples):
        if filled + n <= remainder:
            extra.add(key)
            filled += n
    return {
        "repeats": repeats,
        "extra": extra,
        "source_tokens": source_tokens,
        "example_tokens_once": total,
        "examples": len(examples),
        "examples_seen_in_an_earlier_split": left_out,
        "example_tokens": repeats * total + filled,
        "target_example_tokens": target,
        "documents": source_documents + repeats * len(examples) + len(extra),  # what lean_documents yields
    }


def lean_documents(
    files: Sequence[Path], plan: dict[str, Any], seen: frozenset[str] = frozenset()
) -> Iterator[tuple[str, str]]:
    """(kind, text) with kind "source" or "proof": round 0 writes each file and its examples' first
    copies, round r the examples that have more than r copies (`seen`: as given to `plan_lean`)."""
    rounds = plan["repeats"] + (1 if plan["extra"] else 0)
    for r in range(max(1, rounds)):
        for fi, path in enumerate(files):
            text = read_lean(path)
            if r == 0 and text.strip():  # an empty file is no document (splits.py skips them everywhere)
                yield "source", text
            for ei, e in _kept(proof_examples(text, str(path)), seen):
                if r < plan["repeats"] + ((fi, ei) in plan["extra"]):
                    yield "proof", e.text


@dataclass(kw_only=True)
class LeanSource(HeldOutSource):
    """Lean files plus their proof-completion examples, weighted by `proof_weight` of tokens."""

    name = "lean"
    help = "Lean files plus proof-completion examples, weighted equally"

    inputs: Sequence[str | os.PathLike]
    proof_weight: float = 0.5
    exts: Sequence[str] = (".lean",)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("inputs", nargs="+", help=INPUTS_HELP)
        cls.add_common_arguments(parser)
        parser.add_argument(
            "--proof-weight",
            type=float,
            default=0.5,
            help="share of each split's tokens from proof-completion examples (0.5 = equal weight)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LeanSource:
        return cls(inputs=args.inputs, proof_weight=args.proof_weight, **cls.common_options(args))

    def check(self) -> None:
        if not 0 <= self.proof_weight < 1 or math.isnan(self.proof_weight):
            raise UserError(
                f"{option('proof_weight')} must be in [0, 1), got {self.proof_weight}; 0.5 gives equal weight"
            )
        super().check()

    def read(self, tokenizer: Any, out_dir: Path, progress: Progress) -> dict[str, Iterable[str]]:
        def read_bar(files: Sequence[Path], what: str) -> Sequence[Path]:
            # The passes before tokenizing read every file (a first pass counts tokens): a bar each.
            return progress_bar(progress, iterable=files, desc=f"lean: {what}", unit="file", leave=False)

        files = _assign_files(self.inputs, self.exts, self.dev_fraction, self.test_fraction, self.seed, read_bar)
        texts = {
            s: example_texts(read_bar(files[s], f"examples of {s}"))
            for s in ("train", "dev")
            if s in files and len(files) > 1
        }
        # Whose examples each split leaves out: test train's and dev's, any other split train's.
        earlier = {"train": (), "test": ("train", "dev")}
        seen = {s: frozenset().union(*(texts.get(e, ()) for e in earlier.get(s, ("train",)))) for s in files}
        self._plans = {
            s: plan_lean(read_bar(f, f"count {s} tokens"), tokenizer, self.proof_weight, self.seed, seen[s])
            for s, f in files.items()
        }
        self._files = files
        return {
            s: KnownCount((text for _, text in lean_documents(files[s], self._plans[s], seen[s])), plan["documents"])
            for s, plan in self._plans.items()
        }

    def fingerprint(self) -> dict[str, Any]:
        return {
            "name": "lean",
            "inputs": [str(i) for i in self.inputs],
            "proof_weight": self.proof_weight,
            "weighting": "equal tokens: proof-completion examples hold proof_weight of each split's tokens",
            **self.held_out_record(),
            "splits": {
                s: {
                    "files": len(self._files[s]),
                    **{k: v for k, v in p.items() if k not in ("extra", "documents")},
                    "extra_copies": len(p["extra"]),
                }
                for s, p in self._plans.items()
            },
        }


def prepare_lean(
    inputs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Any = "gpt2",
    *,
    proof_weight: float = 0.5,
    exts: Sequence[str] = (".lean",),
    dev_fraction: float = 0.02,
    test_fraction: float = 0.02,
    seed: int = 0,
    overwrite: bool = False,
    progress: Progress = True,
) -> Path:
    """Prepare Lean files plus their proof-completion examples (LeanSource)."""
    source = LeanSource(
        inputs=inputs,
        tokenizer=tokenizer,
        proof_weight=proof_weight,
        exts=exts,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        seed=seed,
    )
    return source.prepare(out_dir, overwrite=overwrite, progress=progress)
