"""Training a byte-level BPE tokenizer on the user's corpus with Hugging Face `tokenizers`.

The tokenizer is GPT-2 style: text is split with GPT-2's pre-tokenization regex over a byte-level
alphabet (all 256 bytes are in the initial vocabulary, so any text encodes and decodes exactly),
merges are learned up to `vocab_size`, and `<|endoftext|>` is a special token (id 0). Load the
result with `get_tokenizer("bpe:PATH")` (or `--tokenizer bpe:PATH` on `data prepare`); prepared
datasets and checkpoints then carry it inside their tokenizer description.

The trainer reads a text cut inside every pre-tokenized word of more than `LONGEST_TRAINING_WORD`
characters (a 2 MB line of letters, base64, is one word to GPT-2's regex): its time grows with the
square of a word's length (a 400 kB word took 96 s, 2 MB would take most of an hour). Words that long
teach no merges worth a vocabulary slot; every other word is read whole, and encoding is unaffected.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tango_lm.atomic_files import write_text_atomic
from tango_lm.data.code_trees import CODE_ALWAYS_EXCLUDED
from tango_lm.data.files import jsonl_documents, parquet_documents, text_documents
from tango_lm.data.inputs import expand_inputs
from tango_lm.data.tokenizers import BPE_EOT, BPETokenizer
from tango_lm.errors import UserError, option
from tango_lm.progress_lines import CountLines, Progress

__all__ = ["LONGEST_TRAINING_WORD", "TRAIN_EXTS", "training_pieces", "training_texts", "train_bpe"]

# What a directory input contributes: JSONL/Parquet by `field`, everything else one document per file.
TRAIN_EXTS = (".txt", ".md", ".jsonl", ".jsonl.gz", ".parquet", ".lean", ".py")
MIN_VOCAB = 257  # 256 bytes + end-of-text
# 16.8M ids, 65 times GPT-4's: `tokenizers` sizes its tables by vocab_size up front (2**32 asked
# for 283 GB and aborted with a Rust backtrace; past 2**64 it raised OverflowError).
MAX_VOCAB = 2**24
LONGEST_TRAINING_WORD = 256
# a word that long lies inside such a run: texts without one (nearly all) are not pre-tokenized here
_LONG_RUN = re.compile(rf"\S{{{LONGEST_TRAINING_WORD + 1},}}|\s{{{LONGEST_TRAINING_WORD + 1},}}")


def training_pieces(text: str, pre_tokenizer: Any) -> Iterator[str]:
    """`text` in pieces that join back to it, cut every `LONGEST_TRAINING_WORD` characters inside
    each longer word of `pre_tokenizer` (the trainer's); a text without one is its own single piece."""
    start = 0
    for run in _LONG_RUN.finditer(text):  # only the run is pre-tokenized: a 500 MB file is one text
        at = max(start, run.start() - 1)  # with the space a word may take before it
        for _, (begin, end) in pre_tokenizer.pre_tokenize_str(text[at : run.end()]):
            for cut in range(at + begin + LONGEST_TRAINING_WORD, at + end, LONGEST_TRAINING_WORD):
                yield text[start:cut]
                start = cut
    yield text[start:]


def training_texts(
    inputs: Sequence[str | os.PathLike],
    field: str = "text",
    exts: Sequence[str] = TRAIN_EXTS,
    max_docs: int | None = None,
    exclude_dirs: Sequence[str] = CODE_ALWAYS_EXCLUDED,
) -> Iterator[str]:
    """Documents of the input files, read by extension (`.jsonl[.gz]`, `.parquet` by `field`; else
    text); directories named in `exclude_dirs` are not walked (installed packages and caches, by
    default, as `data prepare code` leaves them out)."""
    n = 0
    for path in expand_inputs(inputs, exts, exclude_dirs):
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz")):
            docs = jsonl_documents([path], field)
        elif name.endswith(".parquet"):
            docs = parquet_documents([path], field)
        else:
            docs = text_documents([path])
        for doc in docs:
            if max_docs is not None and n >= max_docs:
                return
            n += 1
            yield doc


def train_bpe(
    inputs: Sequence[str | os.PathLike],
    vocab_size: int,
    out: str | os.PathLike,
    *,
    field: str = "text",
    exts: Sequence[str] = TRAIN_EXTS,
    min_frequency: int = 2,
    max_docs: int | None = None,
    exclude_dirs: Sequence[str] = CODE_ALWAYS_EXCLUDED,
    overwrite: bool = False,
    progress: Progress = True,
) -> BPETokenizer:
    """Train a byte-level BPE with `vocab_size` ids (end-of-text included) and save its JSON to `out`.

    The vocabulary can come out smaller than `vocab_size` when the corpus has too few distinct merges.
    `progress`: True, the trainer's own bars; "lines", the documents read and the start of the merges
    as lines (the trainer's bars are for a terminal); False, nothing.
    """
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ModuleNotFoundError:
        raise UserError(
            "training a BPE needs the package `tokenizers`; install it with `pip install tokenizers`"
        ) from None
    if max_docs is not None and max_docs < 1:
        raise UserError(f"{option('max_docs')} must be at least 1, got {max_docs}; omit it to read everything")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(
            f"{option('vocab_size')} must be between {MIN_VOCAB} (256 bytes + end-of-text) and {MAX_VOCAB:,}, "
            f"got {vocab_size}"
        )
    if min_frequency < 1:
        raise UserError(f"min_frequency must be at least 1, got {min_frequency}")
    out_path = Path(out)
    if str(out).endswith(("/", os.sep)) or out_path.is_dir():
        raise UserError(
            f"--out {out} is a directory; name the tokenizer's JSON file, e.g. {out_path / 'tokenizer.json'}"
        )
    from tango_lm.train.run_dir import enclosing_dataset_or_run

    inside = enclosing_dataset_or_run(out_path.parent)
    if inside is not None:
        raise UserError(f"--out {out} is inside the {inside[1]} {inside[0]}; save the tokenizer outside it")
    if out_path.exists() and not overwrite:
        raise UserError(f"{out_path} already exists; pass --overwrite to replace it or choose another path")
    if out_path.exists() and any(out_path.resolve() == p.resolve() for p in expand_inputs(inputs, exts, exclude_dirs)):
        # --overwrite replaced the corpus it was to read with the tokenizer's JSON
        raise UserError(f"--out {out} is one of the inputs; save the tokenizer to another file")
    texts = training_texts(inputs, field, exts, max_docs, exclude_dirs)
    first = next(texts, None)  # fail on bad inputs before starting the trainer
    if first is None:
        raise UserError("the inputs hold no text to train on; check the paths, --ext or --field")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # its own copy: the trainer holds `tok` while it reads the stream (tok.pre_tokenizer would deadlock)
    words = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)

    def stream() -> Iterator[str]:
        docs = itertools.chain([first], texts)
        count = CountLines(docs, desc="train-tokenizer: read", unit="doc") if progress == "lines" else None
        for text in count or docs:
            yield from training_pieces(text, words)
        if count is not None:  # the merges follow, with no count to report until they end
            count.lines.say(f"train-tokenizer: merging pairs into up to {vocab_size:,} ids")

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BPE_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress is True,
    )
    tok.train_from_iterator(stream(), trainer)
    result = BPETokenizer(tok.to_str())
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_path, result.to_json() + "\n")
    return result
