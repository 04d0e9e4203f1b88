"""User-facing errors. The CLI prints any :class:`LNStabError` as one line and exits non-zero, no traceback."""


class LNStabError(ValueError):
    """Bad input from the user; the message is one line naming the field, the value and what is allowed."""


class ConfigError(LNStabError):
    """A configuration value that is not allowed."""


class MachineError(LNStabError):
    """The machine, not the input, refused (a full disk, a file-size limit): still one line, but ``lnstab`` exits 1,
    the status of a failed run, not 2, the status of a usage error."""
