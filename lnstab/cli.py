"""The ``lnstab`` command: fit/validate/test/evaluate through LightningCLI (:mod:`lnstab.lightning_cli`) and lnstab's
own subcommands (``prepare``, ``sweep``, ``report``, ``check``), each imported only when it is run.

Lightning is imported by the trainer subcommands only: ``lnstab check`` (whose parent process never trains),
``lnstab report``, ``lnstab --help`` and every usage error of those start without it, seconds sooner on a slow CPU.
The names of :mod:`lnstab.lightning_cli` (``cli_main``, ``LNStabCLI``) are reachable from here, as before.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lnstab.errors import exit_for_user_error

# Subcommands that are not Trainer methods: name -> "module:function" taking argv (imported only when used).
EXTRA_COMMANDS: dict[str, str] = {
    "prepare": "lnstab.datamodules.prepare:main",
    "sweep": "lnstab.sweep.cli:main",
    "report": "lnstab.report.cli:main",
    "check": "lnstab.check.cli:main",
}
COMMAND_HELP = {
    "fit": "Train an experiment (resume with --ckpt_path last)",
    "validate": "Validation loss of a checkpoint",
    "test": "Test loss and the final evaluation of a checkpoint",
    "evaluate": "Final evaluation of a checkpoint: loss, perplexities, ROUGE, BERTScore into eval.json",
    "prepare": "Tokenize OpenWebText (hub or files) once into uint16 bins with nanoGPT's split",
}


def print_help() -> None:
    """``lnstab --help``: every subcommand, one line each."""
    lines = ["usage: lnstab <command> [options]   (lnstab <command> --help lists a command's options)", "",
             "Stability of Transformers under Layer Normalization: experiments, instruments, evaluation, reports.", "",
             "Training and evaluation (LightningCLI: --config FILE, --key value):"]
    lines += [f"  {name:<10} {COMMAND_HELP[name]}" for name in ("fit", "validate", "test", "evaluate")]
    lines += ["", "Data, grids, reports and checks:"]
    for name, target in EXTRA_COMMANDS.items():
        lines.append(f"  {name:<10} {COMMAND_HELP.get(name) or _doc_line(target)}")
    print("\n".join(lines))


def _doc_line(target: str) -> str:
    module = importlib.import_module(target.split(":")[0])
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``lnstab``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print_help()
        return
    if argv[0] not in EXTRA_COMMANDS:
        from lnstab.lightning_cli import run

        run(argv)
        return
    module, func = EXTRA_COMMANDS[argv[0]].split(":")
    try:
        getattr(importlib.import_module(module), func)(argv[1:])
    except KeyboardInterrupt:  # a Ctrl-C outside the check's own handling: while it imports torch, or prints the card
        if argv[0] != "check":
            raise
        sys.stderr.write("lnstab: lnstab check stopped by SIGINT\n")
        raise SystemExit(130) from None  # 128 + SIGINT, as the check's own handler exits
    except Exception as exc:
        exit_for_user_error(exc)
        raise


def __getattr__(name: str) -> Any:
    # cli_main, LNStabCLI and the rest of the LightningCLI side, from their own module (imported on first use);
    # never for a dunder such as __path__, which every ``from lnstab.cli import main`` asks for
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from lnstab import lightning_cli

    try:
        return getattr(lightning_cli, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    main()
