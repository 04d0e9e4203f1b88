"""User-facing errors. The CLI prints any :class:`LNStabError` as one line and exits non-zero, no traceback."""

import contextlib
import errno
import os
import sys
from collections.abc import Iterator


class LNStabError(ValueError):
    """Bad input from the user; the message is one line naming the field, the value and what is allowed."""


class ConfigError(LNStabError):
    """A configuration value that is not allowed."""


class MachineError(LNStabError):
    """The machine, not the input, refused (a full disk, a file-size limit): still one line, but ``lnstab`` exits 1,
    the status of a failed run, not 2, the status of a usage error."""


# What the machine answers to a write it refuses: no space, quota, file-size limit, an I/O error, a read-only mount.
REFUSED_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def cannot_write(path: str | os.PathLike, exc: OSError) -> MachineError:
    """The :class:`MachineError` for a write of ``path`` the operating system refused: one line naming the file and
    the OS's reason (``No space left on device (errno 28 ENOSPC)``)."""
    code = f"errno {exc.errno} {errno.errorcode.get(exc.errno, '')}".strip() if exc.errno else type(exc).__name__
    return MachineError(f"{path} cannot be written: {exc.strerror or exc} ({code})")


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn an ``OSError`` raised while writing ``path`` (or a file under it: the error's own file name wins) into
    :func:`cannot_write`'s one line, so that a full disk is exit status 1 and one line, never a traceback."""
    try:
        yield
    except OSError as exc:
        raise cannot_write(exc.filename or path, exc) from None


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` folded onto one line (of an error a DataLoader worker raised, its own message: torch
    re-raises it with the worker's whole traceback as the message)."""
    text = str(exc)
    if text.startswith("Caught ") and "Original Traceback" in text:
        name = type(exc).__name__ + ": "
        text = text[text.rindex(name) + len(name):] if name in text else text.strip().splitlines()[-1]
    return folded(text)


def folded(text: str) -> str:
    """``text``'s non-blank lines, stripped, joined by one space."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def first_line(exc: BaseException | str, default: str = "") -> str:
    """The first non-blank line of ``exc``'s message (or of a message), stripped (``default`` where it has none)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), default)


def find_user_error(exc: BaseException) -> BaseException | None:
    """The user's mistake behind ``exc``: an :class:`LNStabError` or Lightning's ``MisconfigurationException``,
    itself or one that jsonargparse wrapped while instantiating."""
    # Lightning's class only if Lightning is imported (nothing else raises it), so that the commands that never import
    # it (lnstab check, report, --help) do not for their errors either
    lightning = sys.modules.get("lightning.fabric.utilities.exceptions")
    user = (LNStabError, lightning.MisconfigurationException) if lightning else (LNStabError,)
    return next((e for e in _chain(exc) if isinstance(e, user)), None)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (causes and contexts), each once."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]


def refused_write(exc: BaseException, where: str = "a file") -> MachineError | None:
    """:func:`cannot_write`'s one line for an ``OSError`` of :data:`REFUSED_WRITES` behind ``exc`` (itself, or its
    cause or context), naming its file where the error names one (else ``where``); ``None`` if there is none."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in REFUSED_WRITES:
            return cannot_write(e.filename or where, e)
    return None


def exit_for_user_error(exc: BaseException) -> None:
    """The CLI's ending for ``exc``: one line on stderr and exit status 2 (1 for a :class:`MachineError`) when a user's
    mistake is behind it (:func:`find_user_error`), exit status 1 when a write the machine refused is (a full disk,
    :func:`refused_write`); otherwise, or with ``LNSTAB_DEBUG`` set, nothing (re-raise it)."""
    user_error = find_user_error(exc) or refused_write(exc)
    if user_error is None or os.environ.get("LNSTAB_DEBUG"):
        return
    print(f"lnstab: error: {one_line(user_error)}", file=sys.stderr)
    raise SystemExit(1 if isinstance(user_error, MachineError) else 2) from None
