"""The bar an evaluation draws (`tango-lm eval`, `--ppl`, lm-eval's rolling log-likelihoods):
tokens fed to the model against their total, so it shows tokens/s and an ETA; off the terminal,
lines of the same count (progress_lines.py); under --no-progress, nothing."""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from tango_lm.progress_lines import CountLines, Progress


def token_bar(total_tokens: int, desc: str, progress: Progress) -> Any:
    if progress == "lines":
        return CountLines(total=total_tokens, desc=desc, unit="token")
    return tqdm(total=total_tokens, desc=desc, unit="tok", unit_scale=True, disable=not progress, leave=False)
