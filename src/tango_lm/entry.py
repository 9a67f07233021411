"""The `tango-lm` console script. It imports the command line (and so torch, ~1.3 s) inside its
Ctrl-C handler: an interrupt during start-up ends as one during a command does, "interrupted" and
exit code 130, not a traceback from an import."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from tango_lm.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return run()
