"""The layout of a run directory, in one place: what each file is called, how it is written and read.

A run directory is what ``lnstab fit`` writes (``runs/<experiment>/version_N/``, or ``--run_dir DIR``; sweeps use
``runs/<grid>/<run>/``)::

    config.yaml                 the resolved config (no ``extends``): ``lnstab fit --config config.yaml`` reruns it
    summary.json                the run's state (schema below), rewritten atomically as the run goes
    divergence_events.jsonl     one JSON object per divergence event (DivergenceMonitor)
    hidden_stats.json           the hidden-state series (HiddenStateStatistics): {"tags", "steps", "stats"}
    eval.json, eval-1.json, …   final evaluations (FinalEvaluation, ``lnstab evaluate``); never overwritten
    events.out.tfevents.*       TensorBoard scalars (every tag in docs/runs.md's tag guide)
    checkpoints/*.ckpt          Lightning checkpoints (files; directories for sharded FSDP checkpoints)

``summary.json`` (one object; every key optional, readers must tolerate missing ones)::

    status            "running" | "completed" | "diverged" | "interrupted" | "failed"
    final_step        optimizer steps done when the run ended
    diverged_step     step of the first fatal divergence event (null if none)
    divergence_events number of events recorded
    interrupted_step, signal        set when a signal stopped the run (status "interrupted")
    error             "<ExceptionType>: message" (status "failed")
    val               {"loss", "ppl", "step"}: the latest validation result
    eval              the latest final evaluation's metrics + {"protocol", "file"}
    started_at, ended_at (ISO 8601, UTC), wall_s (seconds of this process, summed over resumptions)

Writers: :func:`update_summary` (inside a run, rank zero) and :func:`merge_summary` (anywhere). Every file is
written through :func:`atomic_write_text`, so a reader never sees half a file. A run under Lightning's
``fast_dev_run`` writes none of these files (:func:`writes_files`).

Non-finite numbers (a diverged run has them; strict JSON has none) are written as the tagged object
``{"$float": "nan"}`` (``"inf"``, ``"-inf"``) and only that object is read back as a float: a string is always a
string (a run named ``nan``, a grid value ``"inf"``). Readers read within :mod:`lnstab.safeload`'s bounds and
raise :class:`RunFileError` for a damaged file (truncated, not JSON, the wrong shape, a value of a kind the
schema does not give it), naming it and the problem in one line; callers count such a run as damaged and go on with
the others.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lnstab.errors import ConfigError, cannot_write
from lnstab.safeload import MAX_JSON_BYTES, DataFileError, check_json_depth, json_loads, load_json, read_text
from lnstab.validation import is_integer, is_number

if TYPE_CHECKING:
    import lightning.pytorch as pl

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
EVENTS_FILE = "divergence_events.jsonl"
HIDDEN_SERIES_FILE = "hidden_stats.json"
EVAL_FILE = "eval.json"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
STATUSES = ("running", "completed", "diverged", "interrupted", "failed")
# summary.json's keys that hold one kind of value (or null); another kind is not what lnstab writes: damaged.
SUMMARY_STEPS = ("final_step", "diverged_step", "interrupted_step", "divergence_events")
SUMMARY_TEXTS = ("started_at", "ended_at", "error", "signal")
FLOAT_TAG = "$float"  # {"$float": "nan" | "inf" | "-inf"}: a non-finite number in lnstab's JSON files
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class RunFileError(DataFileError):
    """A damaged run-directory file (truncated, not JSON, not the shape lnstab writes); one line naming it.

    Attributes:
        path: The file.
        problem: What is wrong with it (the message without the file's name).
    """

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path} is damaged: {problem}")

    @classmethod
    def of(cls, path: Path, exc: DataFileError) -> RunFileError:
        """The :class:`~lnstab.safeload.DataFileError` of reading ``path`` as a damaged run file."""
        problem = str(exc).removeprefix(str(path)).lstrip(": ").removeprefix("is ")
        return cls(path, problem.removesuffix(" (truncated or damaged)").removesuffix("; save it as UTF-8"))


def short_path(path: str | Path) -> Path:
    """``path`` normalised, relative to the working directory when it lies below it (else absolute)."""
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(Path.cwd().resolve())
    except ValueError:
        return resolved


def run_dir(trainer: pl.Trainer) -> Path:
    """The run's directory: the first logger's ``log_dir`` where there is one, else ``trainer.default_root_dir``.

    Same rule as ``trainer.log_dir`` but without its ``strategy.broadcast``: this is called from rank-zero-only
    code, where a collective would hang (or crash) the other ranks.
    """
    if trainer.loggers:
        logger = trainer.loggers[0]
        directory = getattr(logger, "log_dir", None) or logger.save_dir
        if directory:
            return Path(directory)
    return Path(trainer.default_root_dir)


def writes_files(trainer: pl.Trainer) -> bool:
    """Whether ``trainer``'s run writes files in its run directory: not under ``fast_dev_run``, where Lightning
    suppresses logging and checkpointing. Its logger is then a ``DummyLogger``, so :func:`run_dir` would be the
    trainer's ``default_root_dir`` (the current directory by default), where a real run's files may be; the callbacks
    still measure, so a smoke test exercises them, and write nothing."""
    return not getattr(trainer, "fast_dev_run", False)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary file *in the same directory*, fsync, ``os.replace``.

    Readers see the old file or the new one, never half of one, on any filesystem (the temporary file never
    crosses a filesystem boundary); on failure the temporary file is removed.

    Raises:
        MachineError: The OS refused the write (a full disk, a file-size limit, a read-only filesystem): one line
            naming ``path`` and the OS's reason (``lnstab`` exits 1); the file is as it was.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise cannot_write(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600; results are meant to be read by others
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise cannot_write(path, exc) from None
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (the rename) to disk where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` for UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by ``{"$float": "nan"}`` (``"inf"``, ``"-inf"``): strict JSON
    has no such numbers and a diverged run has them. :func:`read_json` gives them back as floats; strings stay
    strings. Tuples become lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {FLOAT_TAG: "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as indented strict JSON (non-finite numbers tagged, see :func:`json_safe`), atomically."""
    text = json.dumps(json_safe(obj), indent=2, sort_keys=True, default=str, allow_nan=False)
    atomic_write_text(path, text + "\n")


def decode_float(obj: dict[str, Any]) -> Any:
    """``json.loads``' ``object_hook``: the tagged object of :func:`json_safe` as its float, any other unchanged."""
    if len(obj) == 1 and FLOAT_TAG in obj and obj[FLOAT_TAG] in NONFINITE:
        return NONFINITE[obj[FLOAT_TAG]]
    return obj


def read_json(path: str | os.PathLike, numbers: bool = True) -> Any:
    """The JSON in ``path`` (``None`` when the file does not exist); with ``numbers`` the tagged non-finite floats
    of :func:`json_safe` come back as floats.

    Raises:
        RunFileError: The file is damaged (truncated, not JSON, not UTF-8, past a bound).
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return load_json(path, object_hook=decode_float if numbers else None)
    except DataFileError as exc:
        raise RunFileError.of(path, exc) from None


def read_object(path: str | os.PathLike, what: str = "a JSON object") -> dict[str, Any] | None:
    """:func:`read_json` of a file that must hold a JSON object (``None`` when the file does not exist).

    Raises:
        RunFileError: Damaged, or not an object.
    """
    data = read_json(path)
    if data is not None and not isinstance(data, dict):
        raise RunFileError(path, f"it holds a JSON {type(data).__name__}, not {what}")
    return data


def read_summary(directory: str | os.PathLike) -> dict[str, Any]:
    """The run summary in ``directory`` (``{}`` when there is none yet).

    Raises:
        RunFileError: ``summary.json`` is damaged (not JSON, not an object, ``val``/``eval`` not objects, a
            ``status`` not one of :data:`STATUSES`, a step or ``wall_s`` not a number, a time or message not text).
    """
    path = Path(directory) / SUMMARY_FILE
    summary = read_object(path, "a run summary (an object)") or {}
    for key in ("val", "eval"):
        if summary.get(key) is not None and not isinstance(summary[key], dict):
            raise RunFileError(path, f"'{key}' holds a JSON {type(summary[key]).__name__}, not an object")
    kinds = {"status": (lambda v: v in STATUSES, f"a run status ({', '.join(STATUSES[:-1])} or {STATUSES[-1]})"),
             "wall_s": (is_number, "a number of seconds"),
             **dict.fromkeys(SUMMARY_STEPS, (is_integer, "a step (an integer)")),
             **dict.fromkeys(SUMMARY_TEXTS, (lambda v: isinstance(v, str), "text (a string)"))}
    for key, (fits, what) in kinds.items():
        if summary.get(key) is not None and not fits(summary[key]):
            raise RunFileError(path, f"'{key}' holds {shown(summary[key])}, not {what} or null")
    return summary


def shown(value: Any, limit: int = 40) -> str:
    """A value read from a run file as its JSON, cut to ``limit`` characters: how a damaged file's wrong value is
    quoted."""
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def merge_summary(directory: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``directory/summary.json`` (nested dicts merged one level); returns the new summary."""
    summary = read_summary(directory)
    for key, value in fields.items():
        if isinstance(value, dict) and isinstance(summary.get(key), dict):
            summary[key] = {**summary[key], **value}
        else:
            summary[key] = value
    write_json(Path(directory) / SUMMARY_FILE, summary)
    return summary


def update_summary(trainer: pl.Trainer, **fields: Any) -> None:
    """:func:`merge_summary` into the run directory of ``trainer``, on global rank zero only, and only where the run
    writes files (:func:`writes_files`)."""
    if trainer.is_global_zero and writes_files(trainer):
        merge_summary(run_dir(trainer), **fields)


def read_events(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The divergence events of a run (``[]`` when none were recorded).

    Raises:
        RunFileError: A line that is not a JSON object (e.g. half-written), named by its number.
    """
    path = Path(directory) / EVENTS_FILE
    if not path.is_file():
        return []
    try:
        text = read_text(path, str(path), MAX_JSON_BYTES)
    except DataFileError as exc:
        raise RunFileError.of(path, exc) from None
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            check_json_depth(line, f"line {number}")
            event = json_loads(line, f"line {number}", object_hook=decode_float)
        except DataFileError as exc:
            raise RunFileError(path, str(exc)) from None
        except (json.JSONDecodeError, RecursionError) as exc:
            why = f" (column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
            raise RunFileError(path, f"line {number} is not valid JSON{why}; half-written?") from None
        if not isinstance(event, dict):
            raise RunFileError(path, f"line {number} holds a JSON {type(event).__name__}, not an event (an object)")
        events.append(event)
    return events


def read_hidden_series(directory: str | os.PathLike, name: str = HIDDEN_SERIES_FILE) -> dict[str, Any] | None:
    """The hidden-state series ``{"tags", "steps", "stats": {stat: {tag: [values]}}}`` (file ``name``) or ``None``.

    Raises:
        RunFileError: Damaged, or not of that shape (the values themselves may be anything).
    """
    path = Path(directory) / name
    series = read_object(path, "a hidden-state series (an object)")
    if series is None:
        return None
    tags, steps, stats = series.get("tags", []), series.get("steps", []), series.get("stats", {})
    if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)) or not isinstance(steps, list):
        raise RunFileError(path, "'tags' must be a list of strings and 'steps' a list")
    if not isinstance(stats, dict) or not all(
        isinstance(by_tag, dict) and all(isinstance(v, list) for v in by_tag.values()) for by_tag in stats.values()
    ):
        raise RunFileError(path, "'stats' must map each statistic to {tag: [values]}")
    return series


def eval_files(directory: str | os.PathLike) -> list[Path]:
    """``eval.json``, ``eval-1.json``, … of a run, oldest first."""
    directory = Path(directory)
    found = [p for p in directory.glob("eval*.json") if p.name == EVAL_FILE or p.stem.removeprefix("eval-").isdigit()]
    return sorted(found, key=lambda p: 0 if p.name == EVAL_FILE else int(p.stem.removeprefix("eval-")))


def latest_eval(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The newest final evaluation record of a run, or ``None``.

    Raises:
        RunFileError: The newest ``eval*.json`` is damaged (:func:`read_eval`).
    """
    files = eval_files(directory)
    return read_eval(files[-1]) if files else None


def read_eval(path: str | os.PathLike) -> dict[str, Any] | None:
    """One ``eval*.json`` record (``None`` when the file does not exist).

    Raises:
        RunFileError: Damaged: not JSON, not an object, or its ``metrics``/``copying`` not objects.
    """
    record = read_object(path, "an evaluation record (an object)")
    for key in ("metrics", "copying"):
        if record is not None and record.get(key) is not None and not isinstance(record[key], dict):
            raise RunFileError(path, f"'{key}' holds a JSON {type(record[key]).__name__}, not an object")
    return record


def fit_eval(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The newest evaluation the run's fit wrote (``stage`` ``fit``, or none recorded), else the newest of any stage
    (a run whose fit did not evaluate), or ``None``: what the run's training reached, not a later ``lnstab
    evaluate`` of it on other data or settings.

    Raises:
        RunFileError: An ``eval*.json`` read on the way is damaged (:func:`read_eval`).
    """
    files = eval_files(directory)
    newest = None
    for path in reversed(files):
        record = read_eval(path)
        newest = newest or record
        if record.get("stage", "fit") == "fit":
            return record
    return newest


def checkpoint_dir(directory: str | os.PathLike) -> Path:
    """Where a run's checkpoints live."""
    return Path(directory) / CHECKPOINT_DIR


def is_run_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` looks like an lnstab run (a config, a summary or a checkpoint directory)."""
    directory = Path(directory)
    return any((directory / name).exists() for name in (CONFIG_FILE, SUMMARY_FILE, CHECKPOINT_DIR))


def check_name_lengths(path: str | os.PathLike, option: str = "--run_dir") -> None:
    """Refuse a path with a name longer than its filesystem takes (``NAME_MAX``, 255 on Linux's), or longer in all
    than ``PATH_MAX``: every later call on it raised ``OSError: File name too long``.

    Raises:
        ConfigError: Naming the option, the first too-long name (shortened) and the limit.
    """
    path = Path(path).absolute()
    existing = next((p for p in (path, *path.parents) if os.path.isdir(p)), Path("/"))
    try:
        name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):  # a filesystem or platform that does not say
        name_max, path_max = 255, 4096
    for name in path.parts:
        if len(os.fsencode(name)) > name_max:
            raise ConfigError(f"{option} is not allowed with a name of {len(os.fsencode(name))} bytes "
                              f"({name[:20]}…); this filesystem takes names of at most {name_max}")
    if len(os.fsencode(str(path))) >= path_max:
        raise ConfigError(f"{option} is not allowed: its path has {len(os.fsencode(str(path)))} bytes; this system "
                          f"takes paths of fewer than {path_max}")


def check_writable(run_dir: str | os.PathLike, option: str = "--run_dir") -> None:
    """Refuse, before anything runs, a run (or output) directory ``option`` that cannot be created or written.

    Raises:
        ConfigError: The directory (or its nearest existing parent) is not writable, a file is in the way, or a
            symbolic link on the way points nowhere or into a loop.
    """
    path = Path(run_dir).absolute()
    check_name_lengths(path, option)
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:  # a dangling link "lexists" and stops here
        probe = probe.parent
    try:
        os.stat(probe)
    except OSError as exc:
        target = os.readlink(probe) if probe.is_symlink() else "?"
        what = "a loop of symbolic links" if exc.errno == errno.ELOOP else (
            f"a symbolic link to {target}, which does not exist" if exc.errno == errno.ENOENT else exc.strerror)
        raise ConfigError(f"{option} {run_dir} is not allowed; {probe} is {what}") from None
    if not probe.is_dir():
        raise ConfigError(f"{option} {run_dir} is not allowed; {probe} is a file, not a directory")
    try:  # a real probe (access() says yes to root on read-only and pseudo filesystems); leaves nothing behind
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ConfigError(f"{option} {run_dir} is not allowed; {probe} is not writable ({exc.strerror})") from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
