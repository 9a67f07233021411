"""The bar an evaluation draws (`tango-lm eval`, `--ppl`, lm-eval's rolling log-likelihoods):
tokens fed to the model against their total, so it shows tokens/s and an ETA; off the terminal,
or under --no-progress, none."""

from __future__ import annotations

from tqdm.auto import tqdm


def token_bar(total_tokens: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total_tokens, desc=desc, unit="tok", unit_scale=True, disable=not enabled, leave=False)
