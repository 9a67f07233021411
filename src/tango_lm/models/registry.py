"""Architecture registry: a new architecture is one file in `models/archs/` plus one line here.

The order is the TANGO paper's column order, then the onóna paper's backbones: `tango-lm match`,
the generated presets, the benchmark suite and the reports list architectures in this order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tango_lm.models.archs.attnres import AttnResArch
from tango_lm.models.archs.base import Architecture
from tango_lm.models.archs.dense import Dense
from tango_lm.models.archs.flash import Flash
from tango_lm.models.archs.gau import Gau
from tango_lm.models.archs.gdn_hybrid import GdnHybrid
from tango_lm.models.archs.moe import MoE
from tango_lm.models.archs.tango import Tango
from tango_lm.models.archs.tango_3set import Tango3Set
from tango_lm.models.archs.tango_compact import TangoCompact
from tango_lm.models.archs.tango_windowed import TangoWindowed
from tango_lm.models.archs.transformer import LoopTransformer, UntiedTransformer
from tango_lm.models.fixed_geometry import FixedGeometry

ARCHITECTURES = {
    "tango": Tango,
    "tango-windowed": TangoWindowed,
    "tango-3set": Tango3Set,
    "tango-compact": TangoCompact,
    "loop-transformer": LoopTransformer,
    "untied-transformer": UntiedTransformer,
    "gau": Gau,
    "flash": Flash,
    "dense": Dense,
    "gdn-hybrid": GdnHybrid,
    "moe": MoE,
    "attnres": AttnResArch,
}


def fields_not_read_by(archs: Iterable[str]) -> list[str]:
    """The model fields some architecture reads (`Architecture.reads`) and none of `archs` does, in
    declaration order: a model of those builds and computes the same whatever they hold, so they
    are warned when set, and left out where runs are compared (reports, a sweep's finished runs,
    resuming). A test builds every architecture with each such field changed."""
    read_here = {f for name in archs if name in ARCHITECTURES for f in ARCHITECTURES[name].reads}
    return [f for f in dict.fromkeys(f for a in ARCHITECTURES.values() for f in a.reads) if f not in read_here]


def without_unread_fields(model: Mapping[str, Any], arch_name: str | None = None) -> dict[str, Any]:
    """A model config (a dict, as config.json holds it) less the fields its architecture (or
    `arch_name`'s, when two configs are compared as one run's) does not read (`fields_not_read_by`):
    what runs are compared on. An architecture this version does not register keeps every field."""
    arch = architecture_of(str(arch_name or model.get("arch")))
    unread = set(fields_not_read_by([arch.name])) if arch is not None else set()
    return {k: v for k, v in model.items() if k not in unread}


def fixed_geometries() -> dict[str, tuple[str, FixedGeometry]]:
    """Every registered fixed geometry's label -> (its architecture's name, the geometry), in
    registry order."""
    return {g.label: (name, g) for name, arch in ARCHITECTURES.items() for g in arch.fixed_geometries}


def architecture_of(label: str) -> type[Architecture] | None:
    """The architecture a run's `arch` label builds (a fixed geometry's label builds its
    architecture's), or None for a name this version does not register."""
    fixed = fixed_geometries().get(label)
    return ARCHITECTURES.get(fixed[0] if fixed else label)
