"""User-facing errors. The CLI prints any :class:`LNStabError` as one line and exits non-zero, no traceback."""


class LNStabError(ValueError):
    """Bad input from the user; the message is one line naming the field, the value and what is allowed."""


class ConfigError(LNStabError):
    """A configuration value that is not allowed."""


class MachineError(LNStabError):
    """The machine, not the input, refused (a full disk, a file-size limit): still one line, but ``lnstab`` exits 1,
    the status of a failed run, not 2, the status of a usage error."""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` folded onto one line."""
    return " ".join(part.strip() for part in str(exc).splitlines() if part.strip())


def find_user_error(exc: BaseException) -> BaseException | None:
    """The user's mistake behind ``exc``: an :class:`LNStabError` or Lightning's ``MisconfigurationException``,
    itself or one that jsonargparse wrapped while instantiating."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, LNStabError | MisconfigurationException):
            return e
        stack += [e.__cause__, e.__context__]
    return None
