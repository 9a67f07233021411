"""Data: tokenizers, prepared token shards, training/eval window loaders and data sources.

Modules: `tokenizers` (byte, GPT-2, trained BPE) and `bpe`; `shards` (write/open prepared
datasets) and `verify`; `loader` (shuffled training windows, fixed eval batches). Sources, each a
`DataSource` (`source`) registered in `sources`: `files` (text, JSONL, Parquet), `code_trees`,
`lean`, `hf` (Hugging Face), `mixture`, `dmmath` (DeepMind Mathematics); `splits` is the
hold-out policy they share.
"""
