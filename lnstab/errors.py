"""User-facing errors. The CLI prints any :class:`LNStabError` as one line and exits non-zero, no traceback."""


class LNStabError(ValueError):
    """Bad input from the user; the message is one line naming the field, the value and what is allowed."""


class ConfigError(LNStabError):
    """A configuration value that is not allowed."""
