"""Bytes autograd keeps for the backward of one TANGO forward, with the attention probabilities
kept and recomputed (ops/tango_mix.py `recompute_probs`). Usage: python tools/saved_for_backward.py [T]"""

from __future__ import annotations

import sys

import torch

import tango_lm.ops.tango_mix as tango_mix
from tango_lm import ModelConfig, build_model


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.nll(x[:, :-1], x[:, 1:])
    return total


def main() -> None:
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    cfg = ModelConfig(arch="tango", d_model=256, depth=4, width=8192, vocab_size=257, context_length=t)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (1, t + 1))
    policy = tango_mix.recompute_probs
    for name, rule in (("kept", lambda t, w: False), ("recomputed", lambda t, w: True), ("default", policy)):
        tango_mix.recompute_probs = rule
        print(
            f"T={t}, F={cfg.width}, depth {cfg.depth}, probabilities {name}: "
            f"{saved_bytes(model, x) / 2**20:,.0f} MiB saved for the backward"
        )
    tango_mix.recompute_probs = policy


if __name__ == "__main__":
    main()
