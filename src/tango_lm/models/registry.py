"""Architecture registry: a new architecture is one file in `models/archs/` plus one line here."""

from __future__ import annotations

from tango_lm.models.archs.tango import Tango
from tango_lm.models.archs.transformer import LoopTransformer, UntiedTransformer

ARCHITECTURES = {
    "tango": Tango,
    "loop-transformer": LoopTransformer,
    "untied-transformer": UntiedTransformer,
}
