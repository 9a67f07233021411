"""What the data sources share.

Every source is a stream of documents (strings) that `write_prepared` tokenizes into shards;
nothing here holds a corpus in memory (one file, one Parquet row batch, or one spilled line at a
time).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def _tokenizer(tokenizer: Any):
    from tango_lm.data.tokenizers import Tokenizer, get_tokenizer

    return tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(tokenizer)


def _spill_dir(out_dir: str | os.PathLike) -> Path:
    """Held-out documents wait beside the output (same disk), not in a possibly small /tmp."""
    return Path(out_dir).absolute().parent


def _limit(docs: Iterable[str], max_docs: int | None) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if max_docs is not None and i >= max_docs:
            return
        yield doc

