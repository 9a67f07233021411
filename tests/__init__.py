"""tango-lm's tests, one package per package of `src/tango_lm` (`from tests import helpers`)."""
