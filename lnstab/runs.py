"""Where a run lives and which checkpoint resumes it: the CLI's ``--run_dir`` and ``--ckpt_path last|auto``.

A run directory is ``<save_dir>/<name>/<version>`` of the first logger (``runs/<experiment>/version_N`` by default,
``--run_dir DIR`` to choose it). ``--ckpt_path last`` resumes the newest complete checkpoint of the run named by
``--run_dir``, else of the newest run of the experiment that has one, and fails in one line naming where it looked;
``--ckpt_path auto`` does the same but starts afresh when there is nothing to resume (what sweeps and requeued jobs
use).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from lnstab import runlock
from lnstab.checkpoint import CheckpointError, checkpoints_of, is_complete, newest_checkpoint
from lnstab.errors import ConfigError
from lnstab.rundir import CHECKPOINT_DIR, CONFIG_FILE, SUMMARY_FILE, RunFileError, latest_eval, read_summary
from lnstab.validation import is_number

RESUME_KEYWORDS = ("last", "auto")


def split_run_dir(run_dir: str | os.PathLike) -> tuple[str, str, str]:
    """``(save_dir, name, version)`` such that a logger's ``save_dir/name/version`` is ``run_dir``."""
    path = Path(run_dir)
    if not path.name or path.name in (".", ".."):
        raise ConfigError(f"run_dir={str(run_dir)!r} is not allowed; give a directory path such as runs/my_run")
    return str(path.parent), "", path.name


def run_of_checkpoint(ckpt: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint belongs to (``<run>/checkpoints/x.ckpt`` or ``<run>/hpc_ckpt_1.ckpt``)."""
    path = Path(os.path.normpath(Path(ckpt).absolute()))  # relative to here, '..' collapsed
    if path.parent.name == CHECKPOINT_DIR:
        return path.parent.parent
    if path.name.startswith("hpc_ckpt_"):
        return path.parent
    return None


def newest_run_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint over every run directory directly under ``root`` (``runs/<experiment>``)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [c for d in root.iterdir() if d.is_dir() and (c := newest_checkpoint(d)) is not None]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None


def resolve_resume(keyword: str, run_dir: str | None, experiment_root: str | None) -> Path | None:
    """The checkpoint ``--ckpt_path last|auto`` means (``None``: ``auto`` with nothing to resume).

    Raises:
        CheckpointError: ``last`` with no complete checkpoint where it looked.
    """
    if run_dir:
        where, found = f"{Path(run_dir) / CHECKPOINT_DIR}", newest_checkpoint(run_dir)
    elif experiment_root:
        where, found = f"{Path(experiment_root)}/*/{CHECKPOINT_DIR}", newest_run_checkpoint(experiment_root)
    else:
        raise ConfigError(
            f"ckpt_path={keyword!r} is not allowed without a run to look in; give --run_dir or a logger save_dir/name"
        )
    if found is None and keyword == "last":
        partial = [p for p in checkpoints_of(run_dir) if not is_complete(p)] if run_dir else []
        note = f" ({len(partial)} incomplete file(s) skipped)" if partial else ""
        raise CheckpointError(
            f"--ckpt_path last: no complete checkpoint under {where}{note}; train first, pass a checkpoint file, or "
            f"use --ckpt_path auto to start afresh when there is none"
        )
    return found


def check_fresh_run_dir(run_dir: str | os.PathLike) -> None:
    """Refuse to start a new run in a directory that already holds one (nothing is overwritten).

    Raises:
        ConfigError: ``run_dir`` holds a config, a summary or a checkpoint (a damaged summary says so).
    """
    path = Path(run_dir)
    held = [n for n in (CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR) if os.path.lexists(path / n)]
    if held:
        try:
            status = read_summary(path).get("status", "unknown")
        except RunFileError as exc:
            status = f"unknown: {exc.path.name} is damaged: {exc.problem}"
        live = status == "running" and runlock.holder(path) and not runlock.abandoned(path)
        resumable = live or status not in UNFINISHED or newest_checkpoint(path) is not None
        raise ConfigError(
            f"--run_dir {path} already holds a run (status {status}); resume it with --ckpt_path last, or choose "
            f"another --run_dir" if resumable else
            f"--run_dir {path} already holds a run (status {status}) with no checkpoint to resume; start it afresh "
            f"with --ckpt_path auto (its files move to {path / ATTEMPTS_DIR}/), or choose another --run_dir"
            if launched_alone() else
            f"--run_dir {path} already holds a run (status {status}) with no checkpoint to resume; move it away, or "
            "choose another --run_dir (its ranks were launched at once, so --ckpt_path auto does not move it)"
        )


UNFINISHED = ("running", "interrupted", "failed")  # statuses of a run that holds no result
ATTEMPTS_DIR = "attempts"  # <run>/attempts/<k>: earlier attempts --ckpt_path auto moved aside, nothing resumable


def launched_alone() -> bool:
    """Whether this process is the only one its launcher started (or rank zero of Lightning's own launcher, which
    starts the other ranks after it has parsed the command line): ``torchrun``/``srun`` start every rank at once."""
    many = any(os.environ.get(v, "1").strip() not in ("", "0", "1") for v in ("WORLD_SIZE", "SLURM_NTASKS"))
    return runlock.launched_as_rank_zero() and not many


def set_aside_unresumable(run_dir: str | os.PathLike) -> tuple[Path, str] | None:
    """``--ckpt_path auto`` in a run directory whose run has no checkpoint and no result (killed before its first
    checkpoint, stopped by a second Ctrl-C, failed early): its files move to ``<run_dir>/attempts/<k>`` so that the
    fit starts afresh there, as a sweep moves such a run aside; ``(where they went, the old status)``, or ``None``
    when there is nothing to move or it may not be moved (a live run, a result, a damaged summary, several ranks
    launched at once: :func:`check_fresh_run_dir` then says why)."""
    path = Path(run_dir)
    if not any(os.path.lexists(path / n) for n in (CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR)) or not launched_alone():
        return None
    try:
        status = read_summary(path).get("status", "unknown") if (path / SUMMARY_FILE).is_file() else "unknown"
    except RunFileError:
        return None
    live = runlock.holder(path) and not runlock.abandoned(path)
    if status not in UNFINISHED or (status == "running" and live) or newest_checkpoint(path) is not None:
        return None
    attempts = path / ATTEMPTS_DIR
    attempts.mkdir(exist_ok=True)
    k = 1 + max((int(p.name) for p in attempts.iterdir() if p.name.isdigit()), default=0)
    target = attempts / str(k)
    target.mkdir()
    for entry in path.iterdir():
        if entry.name not in (ATTEMPTS_DIR, runlock.LOCK_FILE):
            os.replace(entry, target / entry.name)
    return target, status


# What a fit writes into its run directory before it begins: the lock, the TensorBoard logger's event file (made
# before the data module's setup) and the hyperparameters the logger saves as it closes.
UNBEGUN = (runlock.LOCK_FILE, "hparams.yaml")
EVENT_FILE_PREFIX = "events.out.tfevents."


def discard_unwritten_events(run_dir: str | os.PathLike) -> None:
    """Remove the event files this process began in ``run_dir`` that hold nothing but their header (the file
    version, one record): a validate, test or evaluate refused at its data's setup, after the logger opened its
    file, left one in the run's directory each time."""
    for path in Path(run_dir).glob(f"{EVENT_FILE_PREFIX}*.{os.getpid()}.*"):
        try:
            data = path.read_bytes() if path.stat().st_size <= 1024 else b""
            if len(data) >= 12 and len(data) == 12 + int.from_bytes(data[:8], "little") + 4:
                path.unlink()
        except OSError:  # gone already, or not ours to remove: leave it
            pass


def discard_unbegun(run_dir: str | os.PathLike, created: str | os.PathLike | None = None) -> bool:
    """Remove a run directory that this fit created and that was refused before the run began (``--data.path``
    missing, a vocabulary the data module refuses): left, it would take a version number and be refused by
    ``lnstab report`` as not a run. Only a directory holding nothing but :data:`UNBEGUN` files and event files is
    removed; True if it was. ``created``: the outermost directory the fit made on the way (``runs/`` of
    ``runs/<experiment>/version_0``), removed too, with those between, where nothing else has appeared in them."""
    path = Path(run_dir)
    try:
        entries = list(path.iterdir())
        if any(not (e.name in UNBEGUN or e.name.startswith(EVENT_FILE_PREFIX))
               or not stat.S_ISREG(e.lstat().st_mode) for e in entries):
            return False
        runlock.release(path)
        for entry in entries:
            entry.unlink()
        path.rmdir()
    except OSError:  # gone already, or not ours to remove: leave what is left
        return False
    if created is not None and path.is_relative_to(created):
        for parent in path.parents:
            if not parent.is_relative_to(created):
                break
            try:
                parent.rmdir()  # only an empty one
            except OSError:
                break
    return True


def explicit_keys(argv: list[str], prefix: str) -> list[str]:
    """The ``--<prefix>.<key>`` options given on a command line (``--model.n_layer 3``, ``--model.n_layer=3``)."""
    keys = []
    for arg in argv:
        if arg.startswith(f"--{prefix}."):
            key = arg[len(prefix) + 3 :].split("=", 1)[0]
            keys.append(key.removeprefix("init_args."))
    return keys


# GPTModule settings that leave the trained function and its optimisation unchanged: a resume may change them.
NOT_COMPARED = ("compile",)


def check_against_checkpoint(ckpt: dict[str, Any], model: dict[str, Any], ckpt_path: str,
                             explicit: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse model settings, from any source, that contradict the checkpoint's hyperparameters.

    ``model`` is the model section as parsed from every source (``--config`` files, a grid's overrides, ``--model.*``
    flags); the checkpoint's own values would silently win over it, so a difference is an error. Architecture fields
    are compared as the shape they build (a preset expanded), the rest as values; a setting the checkpoint does not
    record (added to lnstab after it was written) must be at its default.

    Args:
        ckpt: The loaded checkpoint (``hyper_parameters`` is read).
        model: Parsed model settings (``GPTModule`` arguments).
        ckpt_path: For the message.
        explicit: Keys given as ``--model.*`` flags (the message then names the flag).

    Raises:
        ConfigError: One line naming the first contradicting key, both values and where it was set.
    """
    from lnstab.moduleargs import MODEL_ARGS, MODEL_DEFAULTS, TRAINING_DEFAULTS, gpt_config

    hparams = dict(ckpt.get("hyper_parameters") or {})
    if "preset" not in hparams:
        return  # not a GPTModule checkpoint: nothing to compare with
    defaults = {**MODEL_DEFAULTS, **TRAINING_DEFAULTS}  # GPTModule's signature (tests/test_model_options.py)
    mine, theirs = dict(model), {**defaults, **hparams}
    arch_mine, arch_theirs = gpt_config({**defaults, **mine}), gpt_config(theirs)
    for key in defaults:
        if key in NOT_COMPARED or key not in mine:
            continue
        if key in MODEL_ARGS or key == "preset":
            if key == "preset":
                continue  # compared through the shape it builds
            a, b = getattr(arch_mine, key), getattr(arch_theirs, key)
        else:
            a, b = mine[key], theirs[key]
        if _normal(a) != _normal(b):
            where = f"--model.{key} {a!r}" if key in explicit else f"model.{key}={a!r} (from the --config files)"
            raise ConfigError(
                f"{where} contradicts the checkpoint's {key}={b!r} ({ckpt_path}); a resumed model keeps its "
                f"checkpoint's settings: resume with the run's own config (its config.yaml), or start a new run "
                f"without --ckpt_path"
            )


def check_data_against_checkpoint(ckpt: dict[str, Any], data: dict[str, Any]) -> None:
    """Refuse a resumed fit's data settings that decide the batches' order and differ from the checkpoint's, before
    anything is written (the data module refuses them too, but only once the run's config and logger files exist).

    Raises:
        DataError: One line naming the first differing ``--data.*`` key, as the data module says it.
    """
    from lnstab.datamodules.text import DataError  # the data module's own error (a light import)

    state = ckpt.get("OpenWebTextDataModule")
    if not isinstance(state, dict):
        return
    for key in ("batch_size", "num_workers", "seed"):
        if key in state and key in data and data[key] != state[key]:
            raise DataError(f"--data.{key} {data[key]!r} differs from the checkpoint's {state[key]!r}; exact "
                            "resumption needs the same value")


def check_checkpoint_kind(loaded: dict[str, Any], ckpt: str, subcommand: str) -> None:
    """Refuse a checkpoint file (``loaded``, read from ``ckpt``) that lnstab's command cannot use, before anything is
    written: one whose weights are not lnstab's GPT (``GPTModule``: every key under ``model.transformer``/
    ``model.lm_head``), e.g. a user's own Lightning project's, and, for ``fit``, one saved with the weights only (no
    optimizer state to resume).

    Raises:
        ConfigError: One line naming the checkpoint and what it holds.
    """
    keys = list((loaded.get("state_dict") or {}).keys())
    if not keys or not all(k.startswith(("model.transformer.", "model.lm_head.")) for k in keys):
        others = [k for k in keys if not k.startswith(("model.transformer.", "model.lm_head."))]
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(f"--ckpt_path {ckpt} is not a checkpoint of lnstab's GPT (its weights "
                          f"{'are ' + shown if shown else 'are missing'}); lnstab {subcommand} reads the checkpoints "
                          "lnstab fit writes (model.transformer.*, model.lm_head.*)")
    if subcommand == "fit" and not loaded.get("optimizer_states"):
        raise ConfigError(f"--ckpt_path {ckpt} holds the weights only (checkpoint.save_weights_only), not the "
                          "optimizer state a fit resumes from; score it with lnstab evaluate, or train afresh in a new "
                          "--run_dir")


def check_resumable(run_dir: str | os.PathLike) -> None:
    """Refuse to resume a run that ended ``diverged``: a divergence is a result (training on would record its events
    again and overwrite what diverged); a run whose summary is unreadable may resume.

    Raises:
        ConfigError: The run's ``summary.json`` says ``diverged``.
    """
    try:
        summary = read_summary(run_dir)
    except Exception:  # noqa: BLE001 - a damaged summary: resuming is how the run repairs it
        return
    if summary.get("status") == "diverged":
        raise ConfigError(
            f"--ckpt_path with --run_dir {run_dir} is not allowed; that run ended diverged at step "
            f"{summary.get('diverged_step')}, a result to keep: start a new run in another --run_dir"
        )


UNFINISHED_EVALUATION = ("interrupted", "failed", "running")  # the statuses a run left in its final evaluation may have


def final_evaluation_owed(step: int | None, run_dir: str | None, max_steps: int | None) -> bool:
    """Whether resuming a checkpoint of ``step`` into ``run_dir`` owes the run its final evaluation: the checkpoint is
    at the last step (nothing left to train), the run did not finish it (``interrupted`` by a signal, ``failed`` in
    it, or ``running`` with its process gone: killed; a live one is refused before this) and its latest evaluation is
    not of that step. A damaged record owes nothing (the fit repairs what it can)."""
    if step is None or not run_dir or max_steps is None or max_steps < 1 or step < max_steps:
        return False
    try:
        status, done = read_summary(run_dir).get("status"), latest_eval(run_dir)
    except (RunFileError, OSError):  # a damaged or unreadable record
        return False
    return status in UNFINISHED_EVALUATION and (done or {}).get("global_step") != step


def _normal(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_normal(v) for v in value)
    if is_number(value):
        return float(value)
    return value


__all__ = [
    "RESUME_KEYWORDS",
    "CheckpointError",
    "check_against_checkpoint",
    "check_checkpoint_kind",
    "check_fresh_run_dir",
    "check_resumable",
    "final_evaluation_owed",
    "explicit_keys",
    "newest_run_checkpoint",
    "resolve_resume",
    "run_of_checkpoint",
    "split_run_dir",
]
