"""One owner per run directory: ``lnstab fit`` holds an exclusive lock on ``<run>/.lnstab.lock`` while it trains.

Two processes that train into one directory interleave their event files, configs and checkpoints, and one's atomic
save can delete the other's temporary file. :func:`hold` takes a ``flock`` on the directory's lock file for the life of
the process (rank zero only: the other ranks of the run write nothing there) and writes who holds it into the file; a
second :func:`hold` of the same directory, from any process on this machine but the holder's descendants (the ranks
a ``spawn`` launcher starts), fails in one line naming the holder.

A lock never goes stale: the kernel releases a ``flock`` when its holder ends, however it ends (``kill -9``
included), so the file a killed run leaves behind is simply taken over by the next run, which says so. A holder that
ends by returning or exiting (a completed run, one a signal stopped) empties its record first, so the run that resumes
it says nothing. Whether a second
host is caught depends on the filesystem (NFS carries ``flock`` between hosts, Lustre only with ``-o flock``):
docs/runs.md.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

from lnstab.errors import ConfigError, cannot_write, writing
from lnstab.safeload import DataFileError, decode, load_json_text

LOCK_FILE = ".lnstab.lock"
MAX_RECORD = 4096  # bytes of the lock file read for its holder's record (a record is about a hundred)

_held: dict[Path, tuple[int, int]] = {}  # resolved run directory -> (open descriptor holding its lock, holder's pid)


class RunDirInUse(ConfigError):
    """Another live process holds the run directory's lock."""


def holder(directory: str | os.PathLike) -> dict[str, Any]:
    """What the lock file of ``directory`` says about its last holder (``{}`` if nothing readable, or if the lock
    file is a symbolic link or not a regular file: it is never followed)."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _record(fd)
    finally:
        os.close(fd)


def _record(fd: int) -> dict[str, Any]:
    """The holder record in the lock file open as ``fd`` (read within :data:`MAX_RECORD` bytes and the bounded
    reader's limits), ``{}`` when it is not one."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = load_json_text(decode(os.pread(fd, MAX_RECORD, 0), LOCK_FILE), LOCK_FILE)
    except (OSError, DataFileError):
        return {}
    return data if isinstance(data, dict) else {}


def hold(directory: str | os.PathLike, what: str = "lnstab fit") -> str | None:
    """Lock ``directory`` for this process until it exits (creating the directory); idempotent in one process.

    Returns:
        A line to print when the lock file of an earlier, ended holder was taken over, else ``None``.

    Raises:
        RunDirInUse: Another live process holds the lock (the message names its pid, host and start).
        ConfigError: The lock file cannot be created.
    """
    path = Path(directory)
    key = path.resolve()
    if key in _held:
        return None
    lock = path / LOCK_FILE
    with writing(path):  # a full disk: one line naming the directory and the OS's reason
        path.mkdir(parents=True, exist_ok=True)
    try:  # never through a symbolic link (it would make this run overwrite the file it points to), never truncated
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"--run_dir {directory} is not allowed; its lock file {lock} is a symbolic link (to "
                              f"{os.readlink(lock)}); lnstab never writes through one: remove it") from None
        raise ConfigError(f"--run_dir {directory} is not allowed; cannot create {lock} ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"a file with {info.st_nlink} hard links"
        raise ConfigError(f"--run_dir {directory} is not allowed; its lock file {lock} is {what}; lnstab writes "
                          "only a lock file of its own: remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            os.close(fd)
            raise ConfigError(f"--run_dir {directory}: cannot lock {lock} ({exc.strerror})") from None
        who = _record(fd)
        os.close(fd)
        if who.get("host") == socket.gethostname() and who.get("pid") in _ancestors():
            return None  # the process that launched this one holds it for the run (ranks started by spawn)
        desc = (f"{who.get('what', 'another process')} (pid {who.get('pid', '?')} on {who.get('host', '?')} since "
                f"{who.get('since', '?')})") if who else "another process"
        raise RunDirInUse(
            f"--run_dir {directory} is in use by {desc}; two runs cannot train into one directory: wait for it to "
            f"end, or choose another --run_dir"
        ) from None
    before = _record(fd)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "what": what,
              "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise cannot_write(lock, exc) from None
    _held[key] = (fd, os.getpid())
    if before and (before.get("pid"), before.get("host")) != (record["pid"], record["host"]):
        return (f"lnstab: {lock} was left by {before.get('what', 'a run')} (pid {before.get('pid')} on "
                f"{before.get('host')}), which has ended; this run holds it now")
    return None


# Environment variables in which launchers give a process its rank: torchrun/torch.distributed (RANK), SLURM's srun
# (SLURM_PROCID), Lightning's own launcher for its child processes (LOCAL_RANK, NODE_RANK), MPI launchers.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def launched_as_rank_zero() -> bool:
    """Whether this process is global rank zero as far as its launcher's environment says (before any process group
    exists): no rank variable is a non-zero integer."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) != 0:
            return False
    return True


def claim_next_version(root: str | os.PathLike, prefix: str = "version_") -> Path:
    """Create and return ``root/<prefix>N`` for the first ``N`` past every existing one, atomically (``mkdir``), so
    two runs started at once never share a version directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name[len(prefix):]) for p in root.iterdir() if p.name.startswith(prefix)
             and p.name[len(prefix):].isdigit()]
    n = max(taken, default=-1) + 1
    while True:
        path = root / f"{prefix}{n}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def _ancestors() -> set[int]:
    """The pids of this process's parent, its parent, … (Linux ``/proc``; elsewhere the parent only)."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the command name, in parentheses
    return found


def release(directory: str | os.PathLike) -> None:
    """Give up this process's lock of ``directory`` (a no-op if it holds none), emptying its record: the next holder
    then has no ended run to report. Exiting does the same; being killed only releases the lock."""
    fd, pid = _held.pop(Path(directory).resolve(), (None, None))
    if fd is not None:
        with contextlib.suppress(OSError):
            if pid == os.getpid():  # not a forked child's copy of the descriptor: the holder's own
                os.ftruncate(fd, 0)
            os.close(fd)


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        release(key)


def abandoned(directory: str | os.PathLike) -> bool:
    """Whether the last holder of ``directory``'s lock was a process on this host that ended without releasing it
    (killed: a clean exit empties the record) and nothing holds it now. A holder on another host is never judged
    (a lock over a network filesystem may not show it), nor a directory without a record."""
    who = holder(directory)
    if not who or who.get("host") != socket.gethostname():
        return False
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released at once (close): nobody holds it
    except OSError:
        return False  # held: the run is live
    finally:
        os.close(fd)
    return True


def holds(directory: str | os.PathLike) -> bool:
    """Whether this process holds the lock of ``directory``."""
    return Path(directory).resolve() in _held


__all__ = ["LOCK_FILE", "RunDirInUse", "abandoned", "claim_next_version", "hold", "holder", "holds",
           "launched_as_rank_zero", "release"]
