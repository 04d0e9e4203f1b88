"""Config files on the command line: each ``--config``'s ``extends`` chain, and the experiment's name.

An experiment YAML names the file it builds on with ``extends: base.yaml`` (relative to itself).
:func:`expand_extends` turns that chain into ordinary ``--config`` arguments, base first, so later files and
``--key value`` overrides still win; a missing file, a cycle or a file that is not a YAML mapping is one line
(:class:`~lnstab.errors.LNStabError`). Every file is read within :mod:`lnstab.safeload`'s bounds (size, UTF-8,
nesting, alias expansion) before jsonargparse sees it, and jsonargparse's own YAML loader gets the same bounds
(:func:`~lnstab.safeload.bound_jsonargparse`) for the values and files it reads by itself.
"""

from __future__ import annotations

from pathlib import Path

from lnstab.errors import LNStabError
from lnstab.rundir import CONFIG_FILE
from lnstab.safeload import bound_jsonargparse, load_yaml


def expand_extends(argv: list[str]) -> list[str]:
    """Put each ``--config`` file's ``extends`` chain (base first) in front of it as further ``--config`` args; a
    file already in front of an earlier one (the ``base.yaml`` two experiment files extend) is not repeated.

    Raises:
        LNStabError: A file that is missing, not a YAML mapping, past a bound of :mod:`lnstab.safeload`, or an
            ``extends`` that is not one file name or forms a cycle.
    """
    bound_jsonargparse()
    out: list[str] = []
    applied: set[Path] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config", "-c") and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif arg.startswith("--config="):
            path, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        for p in _extends_chain(Path(path)):
            if p.resolve() not in applied:  # a base two experiment files share is read once, first: replayed
                applied.add(p.resolve())  # before the second file, it would undo what the first one set
                out += ["--config", str(p)]
    return out


def _extends_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[Path]:
    if not path.is_file():
        raise LNStabError(f"--config {path} is not a file")
    resolved = path.resolve()
    if resolved in seen:
        raise LNStabError(f"--config {path}: 'extends' forms a cycle through {', '.join(map(str, seen))}")
    data = load_yaml(path, f"--config {path}") or {}
    if not isinstance(data, dict):
        raise LNStabError(f"--config {path} is not allowed; it must hold a YAML mapping (key: value)")
    base = data.get("extends")
    if base is None:
        return [path]
    if not isinstance(base, str) or not base.strip():
        raise LNStabError(f"--config {path}: extends={base!r} is not allowed; it must be one file name (a string)")
    return _extends_chain(path.parent / base, (*seen, resolved)) + [path]


def experiment_name(argv: list[str]) -> str | None:
    """The stem of the last ``--config`` file on the command line: the run's default name."""
    name = None
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            name = Path(argv[i + 1]).stem
        elif arg.startswith("--config="):
            name = Path(arg.split("=", 1)[1]).stem
    return None if name == Path(CONFIG_FILE).stem else name
