"""Sweeps: a grid of ``lnstab fit`` runs, expanded, validated, run here or on a cluster, and rerun safely.

``lnstab sweep GRID.yaml`` (:mod:`lnstab.sweep.cli`); the grid format is in :mod:`lnstab.sweep.grid`, the run
directory bookkeeping in :mod:`lnstab.sweep.state`, local execution in :mod:`lnstab.sweep.runner` and the SLURM /
torchrun launch in :mod:`lnstab.sweep.slurm`.
"""

from lnstab.sweep.grid import Grid, GridError, Run, load_grid
from lnstab.sweep.runner import fit_command

__all__ = ["Grid", "GridError", "Run", "fit_command", "load_grid"]
