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

from lnstab.errors import folded

CKPT_SUBCOMMANDS = ("validate", "test", "evaluate")
NOT_GIVEN = object()  # LNStabArgumentParser.given_logger when no --run_dir moved the loggers
# A logger name that means "not chosen": the experiment file's name is used instead.
UNNAMED = (None, "", "lightning_logs")
# Keys that say where a run ran, not what it is: left out of saved and printed configs; and the one lnstab sets on a
# resume (the run logged its hyperparameters when it started), which made every resumed leg write config-fit-1.yaml.
RUN_LOCATION = ("extends", "run_dir", "ckpt_path", "trainer.default_root_dir", "trainer.enable_autolog_hparams")


# jsonargparse's names of the value types of lnstab's config fields, as lnstab says them: (one, several).
TYPE_WORDS = {"str": ("a string", "strings"), "int": ("an integer", "integers"), "float": ("a number", "numbers"),
              "bool": ("true or false", "true/false values"), "NoneType": ("null", "nulls"),
              "Any": ("a value", "values")}
SEQUENCES = ("list", "List", "tuple", "Tuple", "Sequence")


def choices_message(message: str) -> str | None:
    """jsonargparse's error for a value of the wrong type (``trainer.precision``'s union of literals: 14 lines, every
    subtype and why it failed, folded into one of ~1,000 characters; a data module's argument: its class's whole
    account under ``data``) as lnstab says it: ``KEY='VALUE' is not allowed; choose one of: …`` for a union of
    literals, ``…; it must be a string or null`` for one that takes types of value (``list[str] | None``: ``a list
    of strings or null``). KEY is the field itself, inside a class's arguments too (``data.path``, or
    ``data.init_args.path`` where the config wrote ``init_args``). ``None`` for any other error, or a type lnstab
    has no words for (jsonargparse's own account says more)."""
    failure = _failure(message.splitlines())
    if failure is not None:
        field, value, allowed = failure
        return f"{field}={value!r} is not allowed; {allowed}"
    key = re.match(r'Parser key "([^"]+)":', message)
    given = re.search(r"^  Given value: (.*?)\s*$", message, re.MULTILINE)
    nested = given and re.fullmatch(r"NestedArg\(key='([^']*)', val=.*\)", given.group(1))
    if key and nested:  # --data.nonsense 3: an argument the chosen class does not take, not a choice of class
        return f"unrecognized arguments: --{key.group(1)}.{nested.group(1)} (not an argument of {key.group(1)}'s class)"
    return None


def missing_value_message(message: str, argv: list[str]) -> str | None:
    """argparse's 'expected one argument' for a class's argument given without a value (``--data.path`` at the end,
    or before the next option, as an unset ``$LNSTAB_OWT_SAMPLE`` leaves it) names the argument, not its group: it
    said ``argument --data: expected one argument``. ``None`` for any other error."""
    group = re.fullmatch(r"argument (--[\w.]+): expected one argument", message.strip())
    if group is None:
        return None
    for i, arg in enumerate(argv):
        if arg.startswith(f"{group.group(1)}.") and "=" not in arg and (i + 1 == len(argv) or
                                                                         argv[i + 1].startswith("--")):
            return f"argument {arg}: expected one argument"
    return None


def _failure(lines: list[str]) -> tuple[str, str, str] | None:
    """(field, value as given, what is allowed) of one ``Parser key "…":`` block of jsonargparse's error, from the
    innermost key that failed: a class's argument (``Problem with given class_path …``) rather than the class."""
    head = re.fullmatch(r'Parser key "([^"]+)":\s*(.*)', lines[0].strip()) if lines else None
    if head is None:
        return None
    key = head.group(1)
    body = [line[2:] for line in lines[1:]]  # one level in
    single = re.fullmatch(r"Expected a (.+?)\. Got value: (.*)", (head.group(2) or (body[0] if body else "")).strip())
    if single:  # one type: "Expected a <class 'int'>. Got value: abc"
        words = _type_words(single.group(1))
        return None if words is None else (key, single.group(2), f"it must be {words}")
    if not body or body[0].strip() != "Does not validate against any of the Union subtypes":
        return None
    subtypes = next((m.group(1) for line in body if (m := re.fullmatch(r"Subtypes: \[(.*)\]", line.strip()))), None)
    given = next((line.removeprefix("Given value: ") for line in reversed(body) if line.startswith("Given value: ")),
                 None)
    if subtypes is None or given is None:
        return None
    for i, line in enumerate(body):  # a class's account of its own argument: that argument is the field
        if re.fullmatch(r"\s*- Problem with given class_path '[^']*':", line):
            indent = len(line) - len(line.lstrip())
            block = []
            for inner in body[i + 1:]:
                if len(inner) - len(inner.lstrip()) <= indent:
                    break
                block.append(inner)
            depth = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            found = _failure([b[depth:] for b in block])
            if found is None:
                return None
            inner_key = f"init_args.{found[0]}" if re.search(r"\binit_args\b", given) else found[0]
            return f"{key}.{inner_key}", found[1], found[2]
    return _union(key, given, _split(subtypes))


def _union(key: str, given: str, subtypes: list[str]) -> tuple[str, str, str] | None:
    """What a union allows: ``choose one of: …`` for literals (and null), else ``it must be …`` in words."""
    choices: list[str] = []
    words: list[str] = []
    for subtype in subtypes:
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", subtype)
        if literal:
            choices += [c.strip().strip("'\"") for c in _split(literal.group(1))]
        elif subtype == "<class 'NoneType'>":
            choices.append("null")
        elif (word := _type_words(subtype)) is not None:
            words.append(word)
        else:
            return None  # a class or a type lnstab has no words for: jsonargparse's own account says more
    choices = list(dict.fromkeys(choices))
    if not words:
        return key, given, f"choose one of: {', '.join(choices)}"
    if "a number" in words:  # an int is a number too
        words = [w for w in words if w != "an integer"]
    named = [*(repr(c) for c in choices if c != "null"), *dict.fromkeys(words)]
    named += ["null"] if "null" in choices else []
    return key, given, "it must be " + (" or ".join(named) if len(named) < 3 else
                                        f"{', '.join(named[:-1])} or {named[-1]}")


def _type_words(subtype: str) -> str | None:
    """One of jsonargparse's type names (``<class 'str'>``, ``list[str]``, ``dict[str, int]``) in words, or
    ``None``."""
    plain = re.fullmatch(r"<class '([\w.]+)'>|(?:typing\.)?(\w+)", subtype.strip())
    if plain:
        name = (plain.group(1) or plain.group(2)).rsplit(".", 1)[-1]
        return TYPE_WORDS[name][0] if name in TYPE_WORDS else None
    generic = re.fullmatch(r"(?:typing\.|collections\.abc\.)?(\w+)\[(.*)\]", subtype.strip())
    if generic is None:
        return None
    outer, args = generic.group(1), [a.strip() for a in _split(generic.group(2)) if a.strip() != "..."]
    many = [_plural(a) for a in args]
    if None in many:
        return None
    if outer in SEQUENCES and len(many) == 1:
        return f"a list of {many[0]}"
    if outer in ("dict", "Dict", "Mapping") and len(many) == 2:
        return f"a mapping of {many[0]} to {many[1]}"
    return None


def _plural(name: str) -> str | None:
    name = name.removeprefix("typing.").removeprefix("<class '").removesuffix("'>").rsplit(".", 1)[-1]
    return TYPE_WORDS[name][1] if name in TYPE_WORDS else None


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas (not those inside brackets or quotes)."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()] if text.strip() else parts


class LNStabArgumentParser(LightningArgumentParser):
    """One-line parse errors (exit 2); dumps without ``extends`` and the run's location, so they rerun anywhere,
    and with the logger named after the experiment file where the config leaves the name empty."""

    experiment: str | None = None
    given_logger: Any = NOT_GIVEN  # trainer.logger as given, before --run_dir placed it (NOT_GIVEN: dumped as it is)
    argv: list[str] = []  # the command line parsed, to name a class's argument given without its value

    def error(self, message: str, ex: Exception | None = None):  # noqa: ANN201 - NoReturn in the parent
        if not self.exit_on_error or os.environ.get("LNSTAB_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        line = choices_message(message) or missing_value_message(message, self.argv) or folded(message)
        sys.stderr.write(f"lnstab: error: {line} (see: {parser.prog.replace(' [options]', '')} --help)\n")
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
