"""The one folder under which tango-lm keeps what it builds or generates.

`cache_root()` is `$TANGO_LM_CACHE`, else `$XDG_CACHE_HOME/tango-lm`, else `~/.cache/tango-lm`.
Under it: `kernels/` (the C kernels of `ops/cpu_kernels.py`, built per CPU kind; `$TANGO_LM_KERNEL_DIR`
still moves just these), `dmmath-env/` (DeepMind's generator's own virtual environment) and
`dmmath/` (what the generator produced, keyed by its parameters), `verified-shards/` (what each
prepared dataset's shards were verified to hold, data/verify.py). Deleting the folder is always
safe: everything in it is rebuilt or regenerated on next use.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "TANGO_LM_CACHE"


def cache_root() -> Path:
    """Root of tango-lm's caches (see the module docstring); not created here."""
    env = os.environ.get(ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "tango-lm"
