"""tango-lm: train, compare, evaluate and serve TANGO and onóna language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["ModelConfig", "LanguageModel", "UserError", "build_model"]
__version__ = "0.1.0"

# Imported on first use (PEP 562): `import tango_lm.entry`, which the `tango-lm` command starts
# from, then costs no torch import, so a Ctrl-C during start-up reaches the command's handler.
_EXPORTS = {
    "ModelConfig": "tango_lm.models.config",
    "LanguageModel": "tango_lm.models.model",
    "UserError": "tango_lm.errors",
    "build_model": "tango_lm.models.model",
}

if TYPE_CHECKING:
    from tango_lm.errors import UserError
    from tango_lm.models.config import ModelConfig
    from tango_lm.models.model import LanguageModel, build_model


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tango_lm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
