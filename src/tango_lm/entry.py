"""The console scripts. `tango-lm` imports the command line (and so torch, ~1.3 s) inside its
Ctrl-C handler: an interrupt during start-up ends as one during a command does, "interrupted" and
exit code 130, not a traceback from an import. `tango-lm-eval` says which extra it needs when
lm-evaluation-harness is missing (its module imports lm_eval at the top)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from tango_lm.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return run()


def lm_eval_main() -> int:
    """`tango-lm-eval`: lm-eval's command line with the `tango-lm` model registered."""
    try:
        from tango_lm.eval.lm_eval_adapter import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "lm_eval":
            raise
        print("error: tango-lm-eval needs lm-evaluation-harness; pip install 'tango-lm[eval]'", file=sys.stderr)
        return 2
    run()
    return 0
