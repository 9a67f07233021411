"""The axes of a sweep grid (sweep/grid.py): their names, what each value may be, and each value's
label in a run directory name. `parse_axes` reads a grid's `axes:` mapping into lists of checked
values, so a malformed grid fails with one line before any run is built."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from tango_lm.errors import UserError, did_you_mean
from tango_lm.models.config import ModelConfig
from tango_lm.models.matching import TIERS, parse_tier
from tango_lm.train.config import DataConfig, TrainConfig

NAMED_AXES = ("dataset", "tier", "target_params", "d_model", "depth", "arch", "head", "seed")
# A value's label in its run's directory name `axis=label` (a leading '-' is safe after `axis=`:
# a negative number then gets the field's own error, not this one's).
SAFE_LABEL = re.compile(r"^[A-Za-z0-9-][A-Za-z0-9._+-]*$")
SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}

# Config fields a named axis sets: an axis of the field too would be overwritten, or overwrite it
# behind the run's name and labels (and report under the wrong architecture or seed).
FIELDS_OF_NAMED_AXES = {
    "model.arch": ("arch",),
    "model.head": ("head",),
    "model.depth": ("depth",),
    "model.d_model": ("d_model", "tier"),
    "model.width": ("tier", "target_params"),  # the matcher sets the width
    "train.seed": ("seed",),
    "train.data_seed": ("seed",),
    "data.dir": ("dataset",),
}


def _check_field_axes(axes: dict[str, list[Any]], path: Path) -> None:
    for config_field, named in FIELDS_OF_NAMED_AXES.items():
        clash = next((a for a in named if a in axes), None)
        if config_field in axes and clash is not None:
            why = "the matcher sets the width" if config_field == "model.width" else f"list its values under {clash}"
            raise UserError(
                f"sweep grid {path} has axes {config_field} and {clash}, which sets {config_field} too; "
                f"drop the {config_field} axis ({why})"
            )


def parse_axes(raw: Any, path: Path) -> dict[str, list[Any]]:
    if not isinstance(raw, dict):
        raise UserError(f"axes in sweep grid {path} must be a mapping of axis name: list of values")
    axes: dict[str, list[Any]] = {}
    for name, values in raw.items():
        where = f"axis {name!r} of sweep grid {path}"
        if not isinstance(name, str) or (name not in NAMED_AXES and "." not in name):
            hint = did_you_mean(name, NAMED_AXES) if isinstance(name, str) else ""
            raise UserError(
                f"unknown {where}{hint}; axes are {', '.join(NAMED_AXES)} or a config field such as train.lr"
            )
        if values is None or (isinstance(values, (list, dict)) and not values):
            raise UserError(f"{where} is empty; give at least one value or remove the axis")
        if name == "dataset":
            axes[name] = _dataset_axis(values, where)
            continue
        if not isinstance(values, list):
            raise UserError(f"{where} must be a list of values (got {type(values).__name__})")
        if name == "seed":
            parsed = [_seed(v, where) for v in values]
        elif name in ("depth", "d_model"):
            parsed = [_positive_int(v, where) for v in values]
        elif name == "target_params":
            parsed = [_target(v, where) for v in values]
        elif name == "tier":
            parsed = [_tier(v, where) for v in values]
        elif name in ("arch", "head"):
            parsed = [_choice(v, name, where) for v in values]
        else:
            parsed = [_field_value(name, v, where) for v in values]
        # as values, not labels: 1 and 1.0 are one learning rate (two runs of one setting)
        same = {float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else label_of(v) for v in parsed}
        if len(same) != len(parsed):
            raise UserError(f"{where} repeats a value; list each value once")
        axes[name] = parsed
    from tango_lm.models.registry import fixed_geometries

    if "tier" in axes and "target_params" in axes:
        raise UserError(f"sweep grid {path} has both tier and target_params axes; use one of them")
    _check_field_axes(axes, path)
    fixed = fixed_geometries()
    needs_tier = [fixed[a][1] for a in axes.get("arch", []) if a in fixed]
    if needs_tier and "tier" not in axes:
        geometry = needs_tier[0]
        tiers = " or ".join(dict.fromkeys(tier for tier, _ in geometry.shapes))
        raise UserError(
            f"arch {geometry.label!r} in sweep grid {path} needs a tier axis ({tiers}) to take its geometry "
            f"({geometry.source})"
        )
    return axes


def _dataset_axis(values: Any, where: str) -> list[tuple[str, str]]:
    if isinstance(values, dict):
        items = list(values.items())
    elif isinstance(values, list):
        items = [(Path(str(v)).name, v) for v in values]
    else:
        raise UserError(f"{where} must map dataset names to prepared data directories")
    out = []
    for name, directory in items:
        if not isinstance(directory, str) or not directory:
            raise UserError(f"{where}: dataset {name!r} must name a prepared data directory (got {directory!r})")
        if not isinstance(name, str) or not SAFE_LABEL.match(name):
            raise UserError(f"{where}: dataset name {name!r} must be letters, digits, '.', '_', '+' or '-'")
        out.append((name, directory))
    if len({n for n, _ in out}) != len(out):
        raise UserError(f"{where} names two datasets alike; give them distinct names")
    return out


def _positive_int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"{where} takes positive integers (got {v!r})")
    return v


def _count_text(v: Any) -> str | None:
    """A tier or parameter count as parse_tier reads it: YAML gives `1e9` (and `1.5e9`) as a
    float, whole ones of which are counts; None for what is no count at all."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        return None
    return str(v).strip()


def _parsed_count(text: str, where: str) -> int:
    try:
        return parse_tier(text, 1)[0]
    except UserError as exc:  # its words, under this axis's name
        raise UserError(f"{where}: {exc}") from None


def _target(v: Any, where: str) -> int:
    text = _count_text(v)
    if text is None:
        raise UserError(f"{where} takes parameter counts such as 2000000 or 2M (got {v!r})")
    return _positive_int(_parsed_count(text, where), where)


def _seed(v: Any, where: str) -> tuple[int, int | None]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, None)
    if isinstance(v, list) and len(v) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        return (v[0], v[1])
    raise UserError(f"{where} takes [model_seed, data_seed] pairs or single model seeds (got {v!r})")


def _tier(v: Any, where: str) -> str:
    text = _count_text(v)
    if text is None:
        raise UserError(f"{where} takes tiers such as 70M, 160M or 2M (got {v!r})")
    _parsed_count(text, where)  # raises for malformed tiers
    return text.upper() if text.upper() in TIERS else text


def _choice(v: Any, name: str, where: str) -> str:
    from tango_lm.heads.registry import HEADS
    from tango_lm.models.registry import ARCHITECTURES, fixed_geometries

    known = [*ARCHITECTURES, *fixed_geometries()] if name == "arch" else list(HEADS)
    if v not in known:
        hint = did_you_mean(v, known) if isinstance(v, str) else ""
        raise UserError(f"{where}: unknown {name} {v!r}{hint}; choose from {', '.join(sorted(known))}")
    return v


def _field_value(name: str, v: Any, where: str) -> Any:
    section, _, key = name.partition(".")
    cls = SECTIONS.get(section)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    if key not in fields or key == "out_dir":
        hint = did_you_mean(key, [k for k in fields if k != "out_dir"]) if cls else did_you_mean(section, SECTIONS)
        raise UserError(f"unknown {where}: {name!r} is not a config field{hint} (write section.field, e.g. train.lr)")
    if isinstance(v, (list, dict)):
        raise UserError(f"{where} takes single values, not {type(v).__name__}s")
    return v


def label_of(v: Any) -> str:
    """The text a value takes in a run directory name."""
    if isinstance(v, tuple):  # seed pair
        return str(v[0]) if v[1] is None else f"{v[0]}-{v[1]}"
    if isinstance(v, float):
        return repr(v)
    return str(v).lower() if isinstance(v, bool) else str(v)
