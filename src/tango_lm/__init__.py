"""tango-lm: train, compare, evaluate and serve TANGO and onóna language models."""

from tango_lm.errors import UserError
from tango_lm.models.config import ModelConfig
from tango_lm.models.model import LanguageModel, build_model

__all__ = ["ModelConfig", "LanguageModel", "UserError", "build_model"]
__version__ = "0.1.0"
