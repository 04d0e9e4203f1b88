"""``lnstab``: LightningCLI for fit/validate/test, plus lnstab's own subcommands.

``lnstab fit --config experiments/gpt2_peri_dt1.yaml`` trains one paper experiment. An experiment YAML names the file
it builds on with ``extends: base.yaml`` (relative to itself); the CLI expands that chain into ordinary, composable
``--config`` arguments, so later ``--config`` files and ``--key value`` overrides still win. The resolved config is
saved in each run directory. Any user mistake ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import yaml
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lnstab.errors import LNStabError
from lnstab.module import GPTModule

# Subcommands that are not Trainer methods: name -> "module:function" taking argv (imported only when used).
EXTRA_COMMANDS: dict[str, str] = {
    "prepare": "lnstab.datamodules.prepare:main",
    "evaluate": "lnstab.evaluate:main",
}


class LNStabArgumentParser(LightningArgumentParser):
    """Parse errors as one line naming the key and the problem (instead of a page of usage), exit status 2."""

    def error(self, message: str, ex: Exception | None = None):  # noqa: ANN201 - NoReturn in the parent
        if not self.exit_on_error or os.environ.get("LNSTAB_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        folded = " ".join(part.strip() for part in message.splitlines() if part.strip())
        sys.stderr.write(f"lnstab: error: {folded} (see: {parser.prog.replace(' [options]', '')} --help)\n")
        self.exit(2)


class LNStabCLI(LightningCLI):
    """LightningCLI with the data's ``block_size`` linked to the model's and an ``extends`` key for YAML chains."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        parser.add_argument("--extends", type=str | None, default=None, help="Base YAML this config builds on.")
        parser.link_arguments("model.block_size", "data.init_args.block_size")


def expand_extends(argv: list[str]) -> list[str]:
    """Put each ``--config`` file's ``extends`` chain (base first) in front of it as further ``--config`` args."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif arg.startswith("--config="):
            path, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        for p in _extends_chain(Path(path)):
            out += ["--config", str(p)]
    return out


def _extends_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[Path]:
    if not path.is_file():
        raise LNStabError(f"--config {path} is not a file")
    resolved = path.resolve()
    if resolved in seen:
        raise LNStabError(f"--config {path}: 'extends' forms a cycle through {', '.join(map(str, seen))}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise LNStabError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    base = data.get("extends") if isinstance(data, dict) else None
    if base is None:
        return [path]
    return _extends_chain(path.parent / base, (*seen, resolved)) + [path]


def cli_main(args: list[str] | None = None, run: bool = True) -> LNStabCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line, without the program name."""
    args = expand_extends(list(sys.argv[1:] if args is None else args))
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when it sees both sys.argv and args
    try:
        return LNStabCLI(
            GPTModule,
            LightningDataModule,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": False},
            parser_class=LNStabArgumentParser,
        )
    finally:
        sys.argv = argv


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``lnstab``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in EXTRA_COMMANDS:
            module, func = EXTRA_COMMANDS[argv[0]].split(":")
            getattr(importlib.import_module(module), func)(argv[1:])
        else:
            cli_main(argv)
    except Exception as exc:
        user_error = find_user_error(exc)
        if user_error is None or os.environ.get("LNSTAB_DEBUG"):
            raise
        print(f"lnstab: error: {user_error}", file=sys.stderr)
        raise SystemExit(2) from None


def find_user_error(exc: BaseException) -> LNStabError | None:
    """The :class:`LNStabError` behind ``exc``: itself, or one that jsonargparse wrapped while instantiating."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, LNStabError):
            return e
        stack += [e.__cause__, e.__context__]
    return None


if __name__ == "__main__":
    main()
