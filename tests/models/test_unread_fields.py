"""Model fields an architecture does not read (`Architecture.reads` of the others): a run that sets
one is warned, and reports, a sweep's finished runs and `--resume` compare runs without them
(`models/registry.py:fields_not_read_by`). That is only sound if the model really is the same:
here every architecture is built with each such field changed, and its weights and outputs are
compared with the unchanged model's."""

from __future__ import annotations

import pytest
import torch

from tango_lm import build_model
from tango_lm.models.registry import fields_not_read_by
from tests.arch_cases import names, tiny_config

# A value other than the default and the readers' tiny ones for each field some architecture reads.
CHANGED = {
    "window": 5,
    "feature_map": "relu",
    "controller_width": 8,
    "qk_dim": 16,
    "gau_norm": "layernorm",
    "group_size": 8,
    "n_kv_heads": 1,
    "attention_every": 2,
    "gdn_head_dim": 4,
    "gdn_n_heads": 2,
    "gdn_expand_v": 1.5,
    "conv_size": 2,
    "gdn_chunk": 16,
    "gdn_backend": "torch",
    "n_experts": 3,
    "moe_top_k": 1,
    "moe_expert_width": 8,
    "moe_renormalize": False,
    "capacity_factor_train": 0.5,
    "capacity_factor_eval": 0.5,
    "aux_loss_weight": 0.5,
    "attnres_block": 2,
}


def _outputs(cfg) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The weights, and what the model computes: the full forward, the cached forward (MoE's
    decoding capacity) and the training loss (MoE's load-balancing term)."""
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = model(ids, model.new_cache(ids.shape[1]))
        full = model(ids)
        loss = model.train().nll(ids[:, :-1], ids[:, 1:])
    return model.state_dict(), torch.cat([full.flatten(), cached.flatten(), loss.reshape(1)])


@pytest.mark.parametrize("arch", names())
def test_a_field_the_architecture_does_not_read_changes_nothing_it_builds_or_computes(arch):
    base = tiny_config(arch)
    weights, out = _outputs(base)
    for name in fields_not_read_by([arch]):
        assert name in CHANGED, f"give model.{name} a changed value in CHANGED above"
        cfg = base.replace(**{name: CHANGED[name]})
        assert getattr(cfg, name) != getattr(base, name)
        changed_weights, changed_out = _outputs(cfg)
        assert changed_weights.keys() == weights.keys(), name
        assert all(torch.equal(changed_weights[k], weights[k]) for k in weights), name
        assert torch.equal(changed_out, out), name


def test_the_changed_values_change_their_readers():
    # Otherwise the test above could pass with values no architecture notices.
    from tango_lm.models.registry import ARCHITECTURES

    for name, value in CHANGED.items():
        readers = [a for a, cls in ARCHITECTURES.items() if name in cls.reads]
        assert readers, name
        if name in ("gdn_chunk", "gdn_backend"):  # a kernel choice: the same numbers by design
            continue
        base = tiny_config(readers[0])
        weights, out = _outputs(base)
        changed_weights, changed_out = _outputs(base.replace(**{name: value}))
        same_weights = changed_weights.keys() == weights.keys() and all(
            changed_weights[k].shape == weights[k].shape and torch.equal(changed_weights[k], weights[k])
            for k in weights
        )
        assert not (same_weights and torch.allclose(changed_out, out)), name
