"""How ``lnstab``'s LightningCLI parses and saves a run's config: one-line parse errors, and a ``config.yaml`` that
describes the experiment rather than the place it ran (no ``extends``, run directory or checkpoint path; the logger
named after the experiment), written once per run directory and never overwritten."""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, SaveConfigCallback

CKPT_SUBCOMMANDS = ("validate", "test", "evaluate")
NOT_GIVEN = object()  # LNStabArgumentParser.given_logger when no --run_dir moved the loggers
# A logger name that means "not chosen": the experiment file's name is used instead.
UNNAMED = (None, "", "lightning_logs")
# Keys that say where a run ran, not what it is: left out of saved and printed configs; and the one lnstab sets on a
# resume (the run logged its hyperparameters when it started), which made every resumed leg write config-fit-1.yaml.
RUN_LOCATION = ("extends", "run_dir", "ckpt_path", "trainer.default_root_dir", "trainer.enable_autolog_hparams")


def choices_message(message: str) -> str | None:
    """jsonargparse's error for a value outside a union of literals (``trainer.precision``: 14 lines, every subtype
    and why it failed, folded into one of ~1,000 characters) as lnstab says it: ``KEY='VALUE' is not allowed;
    choose one of: …``. ``None`` for any other error, or a union that also takes a type of value (an int, a path)."""
    key = re.search(r'^Parser key "([^"]+)":\s*Does not validate against any of the Union subtypes', message)
    subtypes = re.search(r"^\s*Subtypes: \[(.*)\]\s*$", message, re.MULTILINE)
    given = re.search(r"^\s*Given value: (.*?)\s*$", message, re.MULTILINE)
    if not (key and subtypes and given):
        return None
    nested = re.fullmatch(r"NestedArg\(key='([^']*)', val=.*\)", given.group(1))
    if nested:  # --data.nonsense 3: an argument the chosen class does not take, not a choice of class
        return f"unrecognized arguments: --{key.group(1)}.{nested.group(1)} (not an argument of {key.group(1)}'s class)"
    choices: list[str] = []
    for literal, other in re.findall(r"typing\.Literal\[([^\]]*)\]|<class '(\w+)'>", subtypes.group(1)):
        if other == "NoneType":
            choices.append("null")
        elif other:
            return None  # a type of value, not a choice: jsonargparse's own account says more
        else:
            choices += [c.strip().strip("'\"") for c in literal.split(",")]
    return (f"{key.group(1)}={given.group(1)!r} is not allowed; choose one of: "
            f"{', '.join(dict.fromkeys(choices))}")


class LNStabArgumentParser(LightningArgumentParser):
    """One-line parse errors (exit 2); dumps without ``extends`` and the run's location, so they rerun anywhere,
    and with the logger named after the experiment file where the config leaves the name empty."""

    experiment: str | None = None
    given_logger: Any = NOT_GIVEN  # trainer.logger as given, before --run_dir placed it (NOT_GIVEN: dumped as it is)

    def error(self, message: str, ex: Exception | None = None):  # noqa: ANN201 - NoReturn in the parent
        if not self.exit_on_error or os.environ.get("LNSTAB_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        folded = choices_message(message) or " ".join(part.strip() for part in message.splitlines() if part.strip())
        sys.stderr.write(f"lnstab: error: {folded} (see: {parser.prog.replace(' [options]', '')} --help)\n")
        self.exit(2)

    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        cfg = cfg.clone()
        for sub in ("", *[f"{s}." for s in ("fit", *CKPT_SUBCOMMANDS)]):
            for key in RUN_LOCATION:
                if f"{sub}{key}" in cfg:
                    del cfg[f"{sub}{key}"]
            if self.given_logger is not NOT_GIVEN and f"{sub}trainer.logger" in cfg:
                cfg[f"{sub}trainer.logger"] = copy.deepcopy(self.given_logger)
            for logger in logger_args(cfg.get(f"{sub}trainer.logger")):
                logger["version"] = None
                if logger.get("name") in UNNAMED and self.experiment:
                    logger["name"] = self.experiment
        return super().dump(cfg, *args, **kwargs)


class SaveRunConfig(SaveConfigCallback):
    """Saves ``config.yaml`` once per run directory (by ``fit``); a resumed fit, or a validate/test/evaluate of the
    run's checkpoint, whose config differs writes ``config-<stage>-<k>.yaml`` beside it, an identical one writes
    nothing: nothing is overwritten, and ``config.yaml`` is always the config the run was trained with."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        log_dir = Path(trainer.log_dir)  # broadcasts: every rank calls setup
        if trainer.is_global_zero:
            text = self.parser.dump(self.config, skip_none=False)
            path = config_target(log_dir, self.config_filename, str(getattr(stage, "value", stage)), text)
            if path is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
        self.already_saved = True


def config_target(log_dir: Path, filename: str, stage: str, text: str) -> Path | None:
    """Where to save ``text``: ``config.yaml`` for a new fit, else the first free ``config-<stage>-<k>.yaml``;
    ``None`` when an identical config is already there."""
    main = log_dir / filename
    if main.exists() and main.read_text(encoding="utf-8") == text:
        return None
    if stage == "fit" and not main.exists():
        return main
    k = 1
    while (path := log_dir / f"config-{stage}-{k}.yaml").exists():
        if path.read_text(encoding="utf-8") == text:
            return None
        k += 1
    return path


def logger_args(logger: Any) -> list[Any]:
    """The ``init_args`` of every configured logger that has a ``save_dir`` (TensorBoard, CSV)."""
    items = logger if isinstance(logger, list) else [logger]
    return [x.init_args for x in items if hasattr(x, "init_args") and "save_dir" in x.init_args]
