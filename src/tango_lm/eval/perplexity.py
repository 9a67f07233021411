"""External perplexity on local files (docs/design.md §6): `tango-lm eval CHECKPOINT --ppl FILE --format F`.

Rolling-window document NLL. A document's tokens are scored after the end-of-text token (so its
first token is predicted from end-of-text, as after the previous document in training), and
every token is predicted exactly once. With context C (the run's training sequence length) and
stride S (default C, lm-evaluation-harness's disjoint rolling windows), window k feeds tokens
[kS, kS + C) and scores only the predictions not scored before, so every later window conditions
its new tokens on at least C - S earlier ones; the last window is moved back to a full C tokens
when the document allows. S = 1 gives every token its full C-token history (the slow exact case).
The end-of-text token after a document is not scored.

Formats and their conventions:

- `text`: documents are separated by blank lines. Reports NLL per token, token, word and byte
  perplexity and bits per byte.
- `document`: the whole file is one document, as `data prepare text` reads a file without
  `--split-on-blank-lines` (universal newlines; `data prepare code` keeps a file's `\r\n`): a
  source file, a book or an article whose blank lines do not end it. Reports what `text` does.
- `wikitext`: the raw WikiText files (`wiki.test.raw`). Documents are the articles: a new one
  starts at each top-level heading line ` = Title = ` (not at ` = = Section = = `); a file without
  such headings falls back to blank-line documents. Each article is scored after the usual
  WikiText detokenization (` @-@ ` -> `-`, ` , ` -> `, `, ...; as in lm-evaluation-harness), and
  word perplexity is exp(total NLL / words), words being the whitespace-separated tokens of the
  *original* article text (lm-evaluation-harness counts `re.split(r"\\s+")` pieces, which adds
  up to two empty pieces per article).
- `lambada`: one example per line, JSONL with a "text" field or plain lines. The target is the
  text after the last space, the context everything before it; the context and " " + target are
  tokenized separately (lm-evaluation-harness 0.4 encodes the whole text and splits it at the
  context's length: for GPT-2's pre-tokenizer, which starts a piece at " " + word, the same ids
  but in edge cases at the boundary). The context starts after the end-of-text token,
  as every document does here (lm-evaluation-harness's `lambada_openai` through the adapter has no
  such token, so its numbers differ slightly). Reports last-word perplexity exp(mean over
  examples of the target's total NLL) and accuracy (greedy decoding reproduces every target
  token, i.e. each is the argmax over the tokenizer's ids given the true prefix; padding rows of
  the table are never drawn). Blank lines are skipped.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tango_lm.data.files import without_lone_surrogates
from tango_lm.errors import UserError
from tango_lm.progress_lines import Progress


# -- the scoring engine -------------------------------------------------------------------------
@dataclass
class _Item:
    """A model input plus its next token (`ids` = s[a : e + 1]); the last `scored` targets count."""

    ids: list[int]
    scored: int


@torch.no_grad()
def _score(
    model: torch.nn.Module,
    items: Sequence[_Item],
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype | None,
    vocab: int | None = None,
    progress: Progress = False,
    desc: str = "eval",
) -> list[tuple[list[float], bool]]:
    """Per item: the log-probs of its scored targets and whether each target is the argmax over the
    tokenizer's `vocab` ids (greedy decoding never picks the table's padding rows, design.md §8.17)."""
    from tango_lm.layers.moe import capacity_factor, moe_layers
    from tango_lm.progress_lines import token_bar
    from tango_lm.train.device import autocast

    results: list[tuple[list[float], bool] | None] = [None] * len(items)
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_length.setdefault(len(item.ids), []).append(i)
    was_training = model.training
    model.eval()
    bar = token_bar(sum(len(item.ids) - 1 for item in items), desc, progress)
    try:
        # MoE layers serve with their inference capacity: no dropped tokens at the default E / k (the
        # paper's 4.0 for its 8 experts, top-2); a lower capacity_factor_eval makes scores batch-dependent.
        with capacity_factor(model, "eval") if moe_layers(model) else contextlib.nullcontext():
            for length, indices in sorted(by_length.items()):
                for start in range(0, len(indices), batch_size):
                    chunk = indices[start : start + batch_size]
                    ids = torch.tensor([items[i].ids for i in chunk], dtype=torch.long, device=device)
                    with autocast(device, dtype):
                        logp = model(ids[:, :-1]).float()
                    targets = ids[:, 1:]
                    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
                    greedy = logp[..., :vocab].argmax(-1) == targets
                    for row, i in enumerate(chunk):
                        k = items[i].scored
                        results[i] = (
                            picked[row, length - 1 - k :].double().tolist(),
                            bool(greedy[row, length - 1 - k :].all()),
                        )
                    bar.update(len(chunk) * (length - 1))
    finally:
        bar.close()
        model.train(was_training)
    return results  # type: ignore[return-value]


def rolling_windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over s = [EOT] + doc (n_tokens + 1 ids) that score targets s[1:] exactly once:
    (a, e, k) = feed s[a:e], score its last k predictions (targets s[e-k+1 .. e])."""
    if not 1 <= stride <= context:
        # the window is the run's train.seq_len, which may be shorter than model.context_length
        raise UserError(f"--stride must be between 1 and the window length {context} (got {stride})")
    last = n_tokens  # index of the last target in s
    windows, done, a = [], 0, 0
    while done < last:
        e = min(a + context, last)
        if e > done:
            windows.append((max(0, e - context), e, e - done))  # the final window keeps a full context
            done = e
        a += stride
    return windows


def document_logprobs(
    model: torch.nn.Module,
    docs: Sequence[list[int]],
    eot_id: int,
    context: int,
    stride: int | None = None,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = False,
    desc: str = "eval",
) -> list[list[float]]:
    """Log-prob of every token of every document (rolling windows, see the module docstring)."""
    stride = context if stride is None else stride
    items, owners = [], []
    for d, ids in enumerate(docs):
        s = [eot_id, *ids]
        for a, e, k in rolling_windows(len(ids), context, stride):
            items.append(_Item(s[a : e + 1], k))
            owners.append(d)
    scores = _score(model, items, batch_size, torch.device(device), dtype, progress=progress, desc=desc)
    out: list[list[float]] = [[] for _ in docs]
    for d, (logps, _) in zip(owners, scores, strict=True):
        out[d].extend(logps)
    return out


# -- files --------------------------------------------------------------------------------------
def read_text_file(path: str | Path) -> str:
    """The file as UTF-8 text without a leading byte-order mark (Windows editors write one; it is
    no text to score, and LAMBADA's JSONL test reads the first character) and with universal
    newlines, as `data prepare` reads text (a CRLF file's \r are no text the model trained on);
    UserError for a missing, binary or undecodable file."""
    path = Path(path)
    if not path.is_file():  # (/dev/null and pipes exist, but are no file to read twice)
        what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise UserError(f"{path} {what}; give a text file to --ppl")
    data = path.read_bytes()
    if b"\x00" in data:
        raise UserError(f"{path} is a binary file (it holds NUL bytes); --ppl takes UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:  # counted from after a BOM, which the file's offset includes
        offset = exc.start + (len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0)
        raise UserError(f"{path} is not UTF-8 text (bad byte at offset {offset}); convert it to UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def split_blank_lines(text: str) -> list[str]:
    """Documents separated by one or more blank lines (a line of whitespace of any kind: a no-break
    space, a form feed), exactly those `data prepare text --split-on-blank-lines` makes of the file:
    lines as written, a paragraph's indent kept (the model trained on it)."""
    docs, para = [], []
    for line in text.split("\n"):
        if line.strip():
            para.append(line)
        elif para:
            docs.append("\n".join(para))
            para = []
    return [*docs, "\n".join(para)] if para else docs


def _is_article_heading(line: str) -> bool:
    s = line.strip()
    return len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= =")


def split_wikitext(text: str) -> list[str]:
    """WikiText articles: each starts at a top-level ` = Title = ` line (blank-line documents when
    the file has no such heading)."""
    lines = text.split("\n")
    if not any(_is_article_heading(line) for line in lines):
        return split_blank_lines(text)
    docs, current = [], []
    for line in lines:
        if _is_article_heading(line) and current:
            docs.append("\n".join(current))
            current = []
        current.append(line)
    docs.append("\n".join(current))
    return [d for d in docs if d.strip()]


def whole_file(text: str) -> list[str]:
    """The file as one document, kept as written (no text: none), as `data prepare text` reads it."""
    return [text] if text.strip() else []


# How each format of documents cuts a file into them; `lambada` is examples, not documents.
DOCUMENT_FORMATS = {"text": split_blank_lines, "document": whole_file, "wikitext": split_wikitext}
FORMATS = (*DOCUMENT_FORMATS, "lambada")

_DETOKENIZE = [
    ("s '", "s'"),
    (" @-@ ", "-"),
    (" @,@ ", ","),
    (" @.@ ", "."),
    (" : ", ": "),
    (" ; ", "; "),
    (" . ", ". "),
    (" ! ", "! "),
    (" ? ", "? "),
    (" , ", ", "),
]
_BRACKETS = [
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)"),
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    (r"{\s*([^}]*?)\s*}", r"{\1}"),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    (r"'\s*([^']*?)\s*'", r"'\1'"),
]
_TAIL = [
    ("= = = =", "===="),
    ("= = =", "==="),
    ("= =", "=="),
    (" \u00b0 ", "\u00b0"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
    (" 's", "'s"),
]


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization spaces (the rules lm-evaluation-harness applies)."""
    for old, new in _DETOKENIZE:
        text = text.replace(old, new)
    for pattern, repl in _BRACKETS:
        text = re.sub(pattern, repl, text)
    for old, new in _TAIL:
        text = text.replace(old, new)
    return text


def read_lambada(path: str | Path) -> list[tuple[str, str]]:
    """(context, target word) per example of a LAMBADA-style file (JSONL or plain lines)."""
    text = read_text_file(path)
    lines = text.split("\n")
    nonblank = [line for line in lines if line.strip()]
    if not nonblank:
        raise UserError(f'{path} holds no examples; give one passage per line (JSONL with "text" or plain text)')
    jsonl = nonblank[0].lstrip().startswith("{")
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except ValueError:
                raise UserError(
                    f"line {n} of {path} is not valid JSON; a JSONL file needs one object per line"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f'line {n} of {path} has no string "text" field; write {{"text": "..."}} per line')
            passage = without_lone_surrogates(record["text"])  # "\ud800" alone, as scraped text has
        else:
            passage = line
        passage = passage.strip()
        if " " not in passage:
            raise UserError(
                f"line {n} of {path} has no last word after a context; each example must be a passage "
                "followed by its target word"
            )
        context, target = passage.rsplit(" ", 1)
        if not context.strip() or not target:
            raise UserError(
                f"line {n} of {path} has no last word after a context; each example must be a passage "
                "followed by its target word"
            )
        examples.append((context, target))
    return examples


# -- metrics ------------------------------------------------------------------------------------
def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def document_perplexity(
    model: torch.nn.Module,
    tokenizer: Any,
    docs: Sequence[str],
    context: int,
    stride: int | None = None,
    originals: Sequence[str] | None = None,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = False,
) -> dict[str, Any]:
    """Rolling NLL of documents: per-token NLL, token/word/byte perplexity and bits per byte.
    Words and bytes are counted in `originals` (the texts before any detokenization; default docs)."""
    if not docs:
        raise UserError("the file holds no documents; give non-empty text")
    ids = [tokenizer.encode(d) for d in docs]
    logps = document_logprobs(model, ids, tokenizer.eot_id, context, stride, batch_size, device, dtype, progress)
    originals = list(originals) if originals is not None else list(docs)
    nll = -sum(sum(lp) for lp in logps)
    tokens = sum(len(lp) for lp in logps)
    words = sum(len(t.split()) for t in originals)
    n_bytes = sum(len(t.encode("utf-8")) for t in originals)
    if tokens == 0:
        raise UserError("the documents have no tokens; give non-empty text")
    return {
        "documents": len(docs),
        "tokens": tokens,
        "words": words,
        "bytes": n_bytes,
        "total_nll": nll,
        "nll": nll / tokens,
        "token_perplexity": _exp(nll / tokens),
        "word_perplexity": _exp(nll / words) if words else None,
        "byte_perplexity": _exp(nll / n_bytes) if n_bytes else None,
        "bits_per_byte": nll / n_bytes / math.log(2) if n_bytes else None,
        "context": context,
        "stride": stride or context,
    }


def lambada_metrics(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[tuple[str, str]],
    context: int,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    progress: Progress = False,
) -> dict[str, Any]:
    """Last-word perplexity and accuracy; the passage is cut from the left to fit the context."""
    items = []
    for context_text, target in examples:
        ctx, word = tokenizer.encode(context_text), tokenizer.encode(" " + target)
        if not word or len(word) > context:
            raise UserError(f"the target word {target!r} has {len(word)} tokens, more than the context of {context}")
        s = [tokenizer.eot_id, *ctx, *word][-(context + 1) :]
        items.append(_Item(s, len(word)))
    scores = _score(model, items, batch_size, torch.device(device), dtype, tokenizer.vocab_size, progress)
    nlls = [-sum(lp) for lp, _ in scores]
    correct = sum(ok for _, ok in scores)
    mean = sum(nlls) / len(nlls)
    return {
        "examples": len(examples),
        "last_word_perplexity": _exp(mean),
        "accuracy": correct / len(examples),
        "correct": correct,
        "mean_nll": mean,
        "target_tokens": sum(len(lp) for lp, _ in scores),
        "context": context,
    }


def evaluate_file(
    model: torch.nn.Module,
    tokenizer: Any,
    path: str | Path,
    fmt: str,
    context: int,
    stride: int | None = None,
    batch_size: int = 8,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    detokenize: bool = True,
    progress: Progress = False,
) -> dict[str, Any]:
    """Perplexity of a model on a local file in one of FORMATS."""
    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if fmt == "lambada":
        if stride is not None:
            raise UserError("--stride applies to text and wikitext files; LAMBADA examples are scored whole")
        res = lambada_metrics(model, tokenizer, read_lambada(path), context, batch_size, device, dtype, progress)
    else:
        text = read_text_file(path)
        originals = DOCUMENT_FORMATS[fmt](text)
        if not originals:
            raise UserError(f"{path} holds no text; give a non-empty {fmt} file")
        docs = [wikitext_detokenize(d) for d in originals] if fmt == "wikitext" and detokenize else originals
        res = document_perplexity(
            model, tokenizer, docs, context, stride, originals, batch_size, device, dtype, progress
        )
    return {"file": str(path), "format": fmt, **res}


def evaluate_checkpoint_file(
    checkpoint: str,
    path: str | Path,
    fmt: str,
    stride: int | None = None,
    device: str = "auto",
    batch_size: int | None = None,
    segment: int | None = None,
    ablate: str | None = None,
    progress: Progress = False,
) -> dict[str, Any]:
    """`tango-lm eval CHECKPOINT --ppl FILE --format F`: the checkpoint's model and tokenizer,
    windows of the run's training sequence length; `segment` and `ablate` as in `eval --split`
    (`evaluate.model_variant`)."""
    from tango_lm.data.tokenizers import tokenizer_from_dict
    from tango_lm.eval.evaluate import model_variant
    from tango_lm.train.checkpoint import load_checkpoint
    from tango_lm.train.device import autocast_dtype, pick_device

    if fmt not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    read_text_file(path)  # fail on a bad file before loading the model
    ckpt = load_checkpoint(checkpoint)
    run = ckpt.config
    dev = pick_device(device)
    model = ckpt.build_model(dev)
    variant = model_variant(model, ckpt, segment, ablate)
    tokenizer = tokenizer_from_dict(ckpt.tokenizer)
    context = ckpt.trained_length
    train = run["train"] if isinstance(run.get("train"), dict) else {}  # a damaged config.json: the defaults
    dtype = autocast_dtype(train.get("precision", "auto"), dev)
    # Each window materializes [batch, context, vocab] fp32 log-probs, so batches stay small.
    bs = batch_size or min(8, train.get("eval_batch_size") or train.get("batch_size") or 8)
    res = evaluate_file(model, tokenizer, path, fmt, context, stride, bs, dev, dtype, progress=progress)
    return {"checkpoint": str(ckpt.path), "step": ckpt.meta.get("step"), **res, **variant}
