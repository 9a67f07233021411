"""One set of gated projections (W_g, W_u, W_o) of width F, as TANGO's blocks and the SwiGLU FFN
hold them, with rotating narrow-width training's active columns over them (docs/design.md §2.6).

The projections are attributes of the module that holds them (`gate_proj`, `up_proj`,
`down_proj`, `active`), so a TANGO block's and an FFN's parameter names stay those of the papers'
code; three-set TANGO holds three such sets.
"""

from __future__ import annotations

import torch
from torch import nn

from tango_lm.layers.active_width import ActiveColumns


def add_gated_projections(module: nn.Module, d_model: int, n_heads: int, width: int, active_width: int | None) -> None:
    """Give `module` one set of gated projections of width F: `gate_proj` (W_g: TANGO's source gate,
    the FFN's gate), `up_proj` (W_u: the destination projection), `down_proj` (W_o), and `active`:
    under rotating narrow-width training the K active columns of each head's F/H (an FFN: one head)."""
    module.gate_proj = nn.Linear(d_model, width, bias=False)
    module.up_proj = nn.Linear(d_model, width, bias=False)
    module.down_proj = nn.Linear(width, d_model, bias=False)
    module.active = (
        None
        if active_width is None
        else ActiveColumns(
            width, n_heads, active_width, rows=(module.gate_proj, module.up_proj), cols=(module.down_proj,)
        )
    )


def gated_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_g, W_u, W_o of a module given them by `add_gated_projections`; under rotating narrow-width
    training only the active segment's columns (head by head, so the narrowed gates still split
    into H heads)."""
    if module.active is None:
        return module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    w_g, w_u, w_o = module.active.weights()
    return w_g, w_u, w_o


__all__ = ["add_gated_projections", "gated_weights"]
