"""Sweeps (docs/design.md §6): grids of architectures x datasets x tiers x depths x seed pairs, each
combination an ordinary training run; `tango-lm sweep GRID.yaml` runs them and
`tango-lm report DIR` summarizes them."""

from tango_lm.sweep.grid import Grid, SweepRun, load_grid
from tango_lm.sweep.runner import plan_rows, run_state, run_sweep

__all__ = ["Grid", "SweepRun", "load_grid", "plan_rows", "run_state", "run_sweep"]
