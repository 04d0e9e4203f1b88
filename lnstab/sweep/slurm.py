"""A grid on a cluster: a SLURM job array (one element per run) and ``torchrun`` commands for bare machines.

The array script runs, in each element, ``lnstab sweep GRID --prepare RUN`` once (skip a finished run, move aside
one killed before its first checkpoint, say whether to resume), then ``srun`` starts one ``lnstab fit`` task per GPU
on every node. Lightning's own ``SLURMEnvironment`` reads the ranks, the master address and port from SLURM's
variables, so ``trainer.num_nodes``/``trainer.devices`` must equal ``--nodes``/``--ntasks-per-node`` (the script sets
both). ``--signal=SIGUSR1@180`` lets a run near its time limit save ``last.ckpt`` and requeue itself (lnstab's
``RunStatus`` then Lightning's requeue); the requeued element resumes it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from lnstab.sweep.grid import Grid, GridError, Run
from lnstab.sweep.runner import RESUME_ARGS, fit_command
from lnstab.sweep.state import sweep_dir
from lnstab.validation import is_integer

SLURM_DEFAULTS: dict[str, Any] = {
    "nodes": 1,
    "gpus_per_node": 8,
    "cpus_per_task": 12,
    "time": "48:00:00",
    "partition": None,
    "account": None,
    "mem": None,
    "max_concurrent": None,  # array throttle: at most this many elements at once
    "signal_s": 180,  # SIGUSR1 this many seconds before the time limit: save last.ckpt and requeue
    "sbatch": [],  # further "#SBATCH" options, e.g. ["--qos=high", "--exclusive"]
    "setup": [],  # shell lines run first in every element, e.g. ["source .venv/bin/activate"]
}


def slurm_settings(grid: Grid, **overrides: Any) -> dict[str, Any]:
    """The grid's ``slurm`` section over :data:`SLURM_DEFAULTS`, then ``overrides`` that are not ``None``.

    Raises:
        GridError: An unknown setting, or a node/GPU count that is not a positive integer.
    """
    unknown = sorted(set(grid.slurm) - set(SLURM_DEFAULTS))
    if unknown:
        raise GridError(f"grid {grid.path}: slurm field {unknown[0]!r} is not allowed; choose from: "
                        f"{', '.join(SLURM_DEFAULTS)}")
    settings = {**SLURM_DEFAULTS, **grid.slurm, **{k: v for k, v in overrides.items() if v is not None}}
    for key in ("nodes", "gpus_per_node", "cpus_per_task", "signal_s"):
        value, low = settings[key], 0 if key == "gpus_per_node" else 1
        if not is_integer(value) or value < low:
            raise GridError(f"grid {grid.path}: slurm {key}={value!r} is not allowed; it must be an integer >= {low}"
                            + (" (0: a CPU job, one task per node)" if low == 0 else ""))
    for key in ("sbatch", "setup"):
        if not isinstance(settings[key], list) or not all(isinstance(x, str) for x in settings[key]):
            raise GridError(f"grid {grid.path}: slurm {key}={settings[key]!r} is not allowed; give a list of strings")
    return settings


def tasks_per_node(settings: dict[str, Any]) -> int:
    """One task per GPU; a CPU job (``gpus_per_node: 0``) runs one task per node, on every CPU it is given."""
    return settings["gpus_per_node"] or 1


def _distributed(settings: dict[str, Any]) -> dict[str, Any]:
    return {"trainer.accelerator": "gpu" if settings["gpus_per_node"] else "cpu",
            "trainer.num_nodes": settings["nodes"], "trainer.devices": tasks_per_node(settings)}


def sbatch_script(grid: Grid, runs: list[Run], root: str | Path, settings: dict[str, Any],
                  grid_file: str | None = None, sweep_args: list[str] | tuple[str, ...] = ()) -> str:
    """The ``sbatch`` job-array script: element ``i`` trains ``runs[i]``.

    Args:
        grid: The grid (its runs carry any ``--set`` overrides already).
        runs: The runs, one array element each.
        root: Directory of the grids' run directories.
        settings: :func:`slurm_settings`.
        grid_file: The grid path as the user gave it (for the decision step).
        sweep_args: Options the decision step ``lnstab sweep … --prepare`` must repeat (``--set``, ``--skip-failed``).
    """
    root = Path(root)
    logs = sweep_dir(root, grid) / "slurm"
    array = f"0-{len(runs) - 1}" + (f"%{settings['max_concurrent']}" if settings["max_concurrent"] else "")
    lines = [
        "#!/bin/bash",
        f"# lnstab sweep {grid.name}: {len(runs)} run(s) of {grid.path}, one job-array element per run.",
        f"# Submit: lnstab sweep {grid_file or grid.path} --slurm | sbatch   (rerun the same to resume/skip)",
        f"#SBATCH --job-name=lnstab-{grid.name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --nodes={settings['nodes']}",
        f"#SBATCH --ntasks-per-node={tasks_per_node(settings)}",
        *([f"#SBATCH --gpus-per-node={settings['gpus_per_node']}"] if settings["gpus_per_node"] else []),
        f"#SBATCH --cpus-per-task={settings['cpus_per_task']}",
        f"#SBATCH --time={settings['time']}",
        f"#SBATCH --chdir={os.getcwd()}",
        f"#SBATCH --output={logs}/%A_%a.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=SIGUSR1@{settings['signal_s']}",
        "#SBATCH --requeue",
    ]
    lines += [f"#SBATCH --{k}={settings[k]}" for k in ("partition", "account", "mem") if settings[k]]
    lines += [f"#SBATCH {opt}" for opt in settings["sbatch"]]
    lines += ["set -euo pipefail", "export SRUN_CPUS_PER_TASK=\"$SLURM_CPUS_PER_TASK\"", *settings["setup"], "",
              'case "$SLURM_ARRAY_TASK_ID" in']
    for i, run in enumerate(runs):
        fit = fit_command(grid, run, root, extra=_distributed(settings))
        lines.append(f"  {i}) RUN={shlex.quote(run.name)}")
        lines.append(f"     FIT=({shlex.join(fit)}) ;;")
    lines += [
        '  *) echo "no run for array index $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;',
        "esac",
        "# Decided once per element, before the ranks start: skip / resume / start (moving aside a run killed",
        "# before its first checkpoint).",
        f"ACTION=$({_prepare(grid, root, grid_file, sweep_args)} \"$RUN\")",
        'case "$ACTION" in',
        '  skip) echo "$RUN: finished already, nothing to do"; exit 0 ;;',
        f"  resume) RESUME=({shlex.join(RESUME_ARGS)}) ;;",
        "  *) RESUME=() ;;",
        "esac",
        "# SIGUSR1 to the whole job (scancel -s USR1 --full, a pre-emption) reaches this shell too, whose default",
        "# action would end the job under the run; the run itself saves last.ckpt and requeues the element.",
        'trap \'echo "lnstab: $RUN: SIGUSR1 reached the batch shell; the run saves and requeues itself" >&2\' USR1',
        "# One task per GPU (CPU jobs: per node) on every node; Lightning takes ranks, master address and port from",
        "# SLURM.",
        'srun --kill-on-bad-exit=1 "${FIT[@]}" ${RESUME[@]+"${RESUME[@]}"}',  # bash < 4.4: empty array and set -u
        "",
    ]
    return "\n".join(lines)


def _prepare(grid: Grid, root: str | Path, grid_file: str | None, sweep_args: list[str] | tuple[str, ...]) -> str:
    """``lnstab sweep GRID --root ROOT [sweep_args] --prepare`` (the run name follows)."""
    return shlex.join(["lnstab", "sweep", str(grid_file or grid.path), "--root", str(root), *sweep_args, "--prepare"])


def torchrun_commands(grid: Grid, runs: list[Run], root: str | Path, settings: dict[str, Any],
                      grid_file: str | None = None, sweep_args: list[str] | tuple[str, ...] = (),
                      port: int = 29500) -> str:
    """Shell lines that run each run with ``torchrun`` on bare machines (the same command on every node)."""
    nodes, gpus = settings["nodes"], tasks_per_node(settings)
    lines = [
        f"# lnstab sweep {grid.name} with torchrun: run each command on all {nodes} node(s) at once, with NODE_RANK",
        "# = 0 … nodes-1 and MASTER_ADDR = node 0's address. First, on node 0, decide the run's fate:",
        f"#   {_prepare(grid, root, grid_file, sweep_args)} RUN   -> start | resume | skip",
        f"# and for 'resume' append: {' '.join(RESUME_ARGS)}",
    ]
    launcher = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus}", "--node-rank=$NODE_RANK",
                "--master-addr=$MASTER_ADDR", f"--master-port={port}", "--no-python"]
    for run in runs:
        fit = fit_command(grid, run, root, extra=_distributed(settings))
        lines.append(f"# {run.name}")
        lines.append(" ".join(launcher) + " " + shlex.join(fit))
    return "\n".join(lines) + "\n"
