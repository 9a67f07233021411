"""Data: tokenizers, prepared token shards, training/eval window loaders and data sources.

Modules: `tokenizers` (byte, GPT-2), `shards` (write/open prepared datasets), `loader`
(shuffled training windows, fixed eval batches), `dmmath` (DeepMind Mathematics source).
"""
