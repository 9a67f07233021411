"""`python -m tango_lm.cli`: the `tango-lm` command."""

import sys

from tango_lm.cli import main

sys.exit(main())
