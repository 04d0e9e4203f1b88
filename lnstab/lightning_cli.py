"""``lnstab fit|validate|test|evaluate``: LightningCLI with lnstab's trainer, config groups and run
directories (the ``lnstab`` command itself and its other subcommands: :mod:`lnstab.cli`).

``lnstab fit --config experiments/gpt2_peri_dt1.yaml`` trains one paper experiment. An experiment YAML names the file
it builds on with ``extends: base.yaml`` (relative to itself); the CLI expands that chain into ordinary, composable
``--config`` arguments, so later ``--config`` files and ``--key value`` overrides still win. Beside ``model``,
``data`` and ``trainer`` a config has three groups: ``checkpoint`` (:class:`~lnstab.callbacks.RunCheckpoint`),
``evaluation`` (:class:`~lnstab.callbacks.FinalEvaluation`) and ``instruments``
(:class:`~lnstab.callbacks.Instruments`). Where a run lives and which checkpoint resumes it is :mod:`lnstab.runs`'
business (``--run_dir``, ``--ckpt_path last|auto``). The saved ``config.yaml`` is resolved (no ``extends``, the
precision and data source actually used) and describes the experiment, not the place it ran, so
``lnstab fit --config runs/<exp>/version_0/config.yaml`` reruns it as a new run anywhere. Any user mistake ends with
one line on stderr and exit status 2.
"""

from __future__ import annotations

import copy
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lnstab import runlock, runs
from lnstab.callbacks import FinalEvaluation, Instruments, RunCheckpoint, RunStatus
from lnstab.callbacks.run_status import RunInterrupted
from lnstab.checkpoint import load_checkpoint
from lnstab.configfiles import expand_extends, experiment_name
from lnstab.datamodules import OpenWebTextDataModule
from lnstab.distributed import end_gloo_group
from lnstab.errors import ConfigError, exit_for_user_error, one_line
from lnstab.module import GPTModule
from lnstab.moduleargs import MODULE_ARGS, checked_config
from lnstab.precision import precision_warning, resolve_precision
from lnstab.runconfig import CKPT_SUBCOMMANDS, NOT_GIVEN, UNNAMED, LNStabArgumentParser, SaveRunConfig, logger_args
from lnstab.rundir import CHECKPOINT_DIR, CONFIG_FILE, check_writable, short_path, writes_files
from lnstab.rundir import run_dir as trainer_run_dir
from lnstab.safeload import load_yaml
from lnstab.trainer import LNStabTrainer
from lnstab.validation import is_integer, is_number


def _check_run_numbers(c: Any, sub: str) -> None:
    """Refuse the values Lightning takes without a word and then divides by, ignores or trains 0 steps on."""
    seed = c.get("seed_everything")
    if is_integer(seed) and not 0 <= seed <= 2**32 - 1:
        raise ConfigError(f"seed_everything={seed} is not allowed; it must be an integer in [0, {2**32 - 1}], or "
                          "true/false")
    if sub != "fit":
        return
    t = c["trainer"]  # a parsed config (jsonargparse's Namespace) or the dict of a printed one
    for key, other in (
        ("max_steps", ", or -1 for no step limit"),
        ("max_epochs", ", or -1 or null"),
        ("accumulate_grad_batches", ""),
        ("check_val_every_n_epoch", ", or null"),
    ):
        value = t.get(key)
        if value is not None and value < 1 and not (value == -1 and other.startswith(", or -1")):
            raise ConfigError(f"trainer.{key}={value} is not allowed; it must be an integer >= 1{other}")
    interval = t.get("val_check_interval")
    if is_number(interval) and interval <= 0:
        raise ConfigError(f"trainer.val_check_interval={interval} is not allowed; it must be > 0 (a fraction of an "
                          "epoch, a number of batches or a duration), or null")
    clip = t.get("gradient_clip_val")
    if clip is not None and not clip >= 0:  # NaN too (from a YAML .nan): Lightning then failed at step 0
        raise ConfigError(f"trainer.gradient_clip_val={float(clip)} is not allowed; it must be > 0, or 0 or null "
                          "for no clipping")


class LNStabCLI(LightningCLI):
    """LightningCLI with lnstab's trainer, config groups, run directories and strict resumption (module docstring)."""

    experiment: str | None = None
    argv: list[str] = []
    run_status: RunStatus | None = None  # the RunStatus of the trainer being run
    created_run_dir: Path | None = None  # the fit's run directory, when this fit created it
    created_root: Path | None = None  # the outermost directory this fit created on the way to it
    scored_run_dir: Path | None = None  # the run directory a validate, test or evaluate writes into
    checkpoint_step: int | None = None  # the global step of the --ckpt_path file, read once (not a sharded directory)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # no predict: GPTModule has no predict step and lnstab's data no predict set (it could only fail); scoring a
        # checkpoint is evaluate's
        commands = {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}
        return {**commands, "evaluate": {"model", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--extends", type=str | None, default=None, help="Base YAML this config builds on.")
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="Directory of this run (default: <logger save_dir>/<experiment>/version_N).")
        parser.link_arguments("model.block_size", "data.init_args.block_size")
        parser.add_lightning_class_args(RunCheckpoint, "checkpoint")
        parser.add_lightning_class_args(FinalEvaluation, "evaluation")
        parser.add_class_arguments(Instruments, "instruments")

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # args is the expanded command line; sys.argv stays the command as run (not LightningCLI's parse_arguments,
        # which warns when it sees both): Lightning's subprocess launcher starts a DDP run's other ranks with it
        self.config = parser.parse_args(args)
        if self.config.get("subcommand"):
            self._resolve_run(self.config.subcommand)

    def _resolve_run(self, sub: str) -> None:
        """Name, directory and checkpoint of the run; refuse what would overwrite or silently ignore input."""
        c = self.config[sub]
        loggers = logger_args(c.trainer.logger)
        for logger in loggers:
            if logger.get("name") in UNNAMED and not c.run_dir:
                logger["name"] = self.experiment or "lnstab"
        _check_run_numbers(c, sub)
        run_dir, ckpt = c.run_dir, c.get("ckpt_path")
        if ckpt in runs.RESUME_KEYWORDS:
            root = None
            if loggers:
                first = loggers[0]
                root = str(Path(first["save_dir"]) / (first.get("name") or ""))
                if first.get("version") not in (None, ""):
                    run_dir = run_dir or str(Path(root) / str(first["version"]))
            found = runs.resolve_resume(ckpt, run_dir, root)
            ckpt = str(found) if found is not None else None
            run_dir = run_dir or (str(runs.run_of_checkpoint(found)) if found is not None else None)
        elif ckpt:
            _refuse_run_dir_as_checkpoint(ckpt)
            owner = runs.run_of_checkpoint(ckpt)
            run_dir = run_dir or (str(owner) if owner is not None else None)
        loaded = None  # the checkpoint file, read once (memory-mapped) for every check below
        if ckpt and not Path(ckpt).is_dir():
            loaded = load_checkpoint(ckpt, field="--ckpt_path", mmap=True)  # missing, truncated or unsafe: one line
            runs.check_checkpoint_kind(loaded, ckpt, sub)  # a user's own project's, or weights only for a fit
            self.checkpoint_step = loaded.get("global_step")
        if sub == "fit" and ckpt is None and run_dir:
            if c.get("ckpt_path") == "auto" and (moved := runs.set_aside_unresumable(run_dir)) is not None:
                print(f"lnstab: {run_dir} held a run (status {moved[1]}) with no checkpoint to resume; its files are "
                      f"in {moved[0]}, and this run starts afresh", file=sys.stderr)
            runs.check_fresh_run_dir(run_dir)
        if sub == "fit" and not run_dir and loggers:  # Lightning will make save_dir/name/version_N: can it?
            check_writable(Path(loggers[0]["save_dir"]) / (loggers[0].get("name") or ""))
        if sub == "evaluate" and ckpt is None:
            raise ConfigError("ckpt_path=None is not allowed; lnstab evaluate needs --ckpt_path CHECKPOINT (or last)")
        if run_dir:
            try:
                check_writable(run_dir)
            except ConfigError as exc:
                if c.run_dir is not None or sub not in CKPT_SUBCOMMANDS:
                    raise
                why = str(exc).split("; ", 1)[-1]  # the checkpoint's run, not a --run_dir the user gave
                raise ConfigError(f"the run directory of --ckpt_path {ckpt} cannot take lnstab {sub}'s results "
                                  f"({why}); give --run_dir DIR for them") from None
            save_dir, name, version = runs.split_run_dir(run_dir)
            # the config as given, not its place: a saved config.yaml reruns anywhere (a sweep run's, whose logger
            # would else name the grid's directory, reran into it and broke every later report of the grid)
            LNStabArgumentParser.given_logger = copy.deepcopy(c.trainer.logger)
            if c.trainer.logger in (None, True):  # Lightning's default logger, placed in the run directory
                tensorboard = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": save_dir, "name": name, "version": version,
                                             "default_hp_metric": False}}  # no placeholder hp_metric = -1
                self.config = self.parser.parse_object({sub: {"trainer": {"logger": tensorboard}}}, self.config)
                c = self.config[sub]
                loggers = logger_args(c.trainer.logger)
            for logger in loggers:
                if Path(logger["save_dir"]) / (logger.get("name") or "") == Path(save_dir):
                    logger["version"] = version  # a version of this experiment: keep its save_dir and name
                else:
                    logger["save_dir"], logger["name"], logger["version"] = save_dir, name, version
            c.trainer.default_root_dir = run_dir
            if ckpt is not None:  # the run logged its hyperparameters when it started: don't rewrite hparams.yaml
                c.trainer.enable_autolog_hparams = False
        c.run_dir, c.ckpt_path = run_dir, ckpt
        if loaded is not None:
            # The checkpoint's hyperparameters win over the parsed model settings (LightningCLI reads them from
            # ckpt_path): refused where they differ. A resumed fit compares every source (--config files, a
            # grid's overrides, flags); validate/test/evaluate, which score the checkpoint's model under any
            # config, compare the explicit --model.* flags.
            explicit = runs.explicit_keys(self.argv, "model")
            model = c.model.as_dict() if sub == "fit" else {k: c.model[k] for k in explicit if k in c.model}
            runs.check_against_checkpoint(loaded, model, ckpt, explicit)
            if sub == "fit" and _named_class((c.get("data") or {}).get("class_path")) is OpenWebTextDataModule:
                runs.check_data_against_checkpoint(loaded, _plain(c.data.get("init_args") or {}))
        if sub == "fit" and ckpt is not None and run_dir:
            runs.check_resumable(run_dir)
        if sub in CKPT_SUBCOMMANDS and run_dir:
            LNStabCLI.scored_run_dir = Path(run_dir)
        if sub in CKPT_SUBCOMMANDS and run_dir and not runs.explicit_keys(self.argv, "data"):
            self._data_from_run(sub, Path(run_dir))

    def _data_from_run(self, sub: str, run_dir: Path) -> None:
        """Evaluate a checkpoint on the data its run trained on (its saved config), unless ``--data.*`` is given."""
        saved = run_dir / CONFIG_FILE
        if not saved.is_file():
            return
        data = (load_yaml(saved) or {}).get("data")  # bounded: a run directory is data from outside
        if not isinstance(data, dict):
            return
        data.get("init_args", {}).pop("block_size", None)  # linked from the model
        self.config = self.parser.parse_object({sub: {"data": data}}, self.config)
        args = data.get("init_args") or {}
        shown = ", ".join(f"{k}={args[k]}" for k in ("source", "path", "dataset") if args.get(k) is not None)
        rank_zero_info(f"lnstab: data of the checkpoint's run ({saved}): {data.get('class_path')} {shown}; pass "
                       f"--data.* to use other data")

    def _check_evaluation(self) -> None:
        """Fail in one line before anything is written: an evaluation that cannot run on this model."""
        from lnstab.evaluation import metrics

        for cb in self.trainer.callbacks:
            if isinstance(cb, FinalEvaluation) and cb.run_on["test"]:
                cb.settings.check_model(self.model.config)
                metrics.load_bertscore(cb.settings.bertscore_model, cb.settings.bertscore_layers)

    def before_test(self) -> None:
        self._check_evaluation()

    def before_evaluate(self) -> None:
        self._check_evaluation()

    def before_fit(self) -> None:
        if ckpt := self.config[self.subcommand].get("ckpt_path"):
            for cb in self.trainer.callbacks:
                if isinstance(cb, RunCheckpoint):
                    cb.resuming = str(ckpt)
        self._evaluate_if_owed()

    def after_fit(self) -> None:
        end_gloo_group()  # now, before the interpreter's exit begins (lnstab.distributed)

    def _evaluate_if_owed(self) -> None:
        """A run whose final evaluation did not finish (a signal, a kill, a failure) resumes at its last step; with
        nothing left to train Lightning skips the whole training loop, the end-of-fit evaluation included, so evaluate
        it here (through ``test``, like ``lnstab evaluate``, recorded as the fit's evaluation). A signal meanwhile
        leaves the run ``interrupted``: the next resume tries again."""
        c = self.config[self.subcommand]
        evaluators = [cb for cb in self.trainer.callbacks if isinstance(cb, FinalEvaluation) and cb.run_on["fit"]]
        ckpt, run = c.get("ckpt_path"), c.get("run_dir")
        owed = runs.final_evaluation_owed(self.checkpoint_step, run, self.trainer.max_steps)
        if not evaluators or not owed:
            return
        rank_zero_info(f"lnstab: {run} trained all its steps; its final evaluation did not finish: evaluating")
        saved = [(cb, dict(cb.run_on), cb.test_stage) for cb in evaluators]
        for cb in evaluators:
            cb.run_on["test"], cb.test_stage = True, "fit"
        try:
            self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=ckpt, weights_only=True)
        finally:
            for cb, run_on, stage in saved:
                cb.run_on, cb.test_stage = run_on, stage

    def before_instantiate_classes(self) -> None:
        c = self.config[self.subcommand] if self.subcommand else self.config
        _check_model_and_data(c)  # a bad --model.* or --data.* fails before the trainer says anything
        if c.trainer.precision == "auto":
            value, reason = resolve_precision("auto", str(c.trainer.accelerator))
            c.trainer.precision = value
            rank_zero_info(f"lnstab: precision auto -> {value} ({reason}); recorded in the run's config.yaml")
        elif warning := precision_warning(c.trainer.precision, str(c.trainer.accelerator)):
            rank_zero_warn(f"lnstab: {warning}")
        if self.subcommand and "weights_only" in c and c.weights_only is None:
            c.weights_only = True  # checkpoints are data, never code

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        c = self.config_init[self.subcommand] if self.subcommand else self.config_init
        callbacks = list(c["trainer"].get("callbacks") or [])
        suite = c.get("instruments")
        callbacks += suite.callbacks() if suite is not None else []
        LNStabCLI.run_status = RunStatus()
        callbacks.append(LNStabCLI.run_status)
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)

    def after_instantiate_classes(self) -> None:
        c = self.config[self.subcommand] if self.subcommand else self.config
        hp = getattr(self.datamodule, "hparams", {})
        if hp.get("resolved_source") and c.get("data.init_args.source") == "auto":
            c.data.init_args.source = hp["resolved_source"]  # the saved config names the data actually used
            for key in ("dataset", "dataset_config", "revision"):
                if key in hp and key in c.data.init_args:
                    c.data.init_args[key] = hp[key]
        needed = getattr(self.datamodule, "token_id_limit", None)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if callable(needed) and vocab is not None and needed() > vocab:
            raise ConfigError(
                f"model.vocab_size={vocab} is not allowed with this data: its token ids go up to {needed() - 1}; "
                f"it must be >= {needed()}"
            )
        if self.subcommand == "fit":  # a BERTScore model that cannot load failed only after all the training
            from lnstab.evaluation import metrics

            for cb in self.trainer.callbacks:
                if isinstance(cb, FinalEvaluation) and cb.run_on["fit"]:
                    metrics.check_bertscore_model(cb.settings.bertscore_model)
        if self.subcommand == "fit" and runlock.launched_as_rank_zero() and writes_files(self.trainer):
            # fast_dev_run writes nothing (its run directory is the current one): no lock file left there
            # one owner per run directory, taken once every class is built and checked (a bad setting has failed
            # by now, leaving nothing behind) and before the trainer's setup, where the logger creates its event
            # file (RunStatus.setup takes it too, for Trainers used without this CLI)
            directory = Path(trainer_run_dir(self.trainer))
            LNStabCLI.created_run_dir = LNStabCLI.created_root = None
            if not directory.exists():
                root = directory
                while not root.parent.exists():
                    root = root.parent
                LNStabCLI.created_run_dir, LNStabCLI.created_root = directory, root
            note = runlock.hold(directory)
            if note:
                rank_zero_info(note)


def check_fit_config(config: Any) -> None:
    """What ``lnstab fit`` refuses in a whole config before it builds anything, for a config it has only printed
    (``--print_config``, as ``lnstab sweep`` validates a grid's runs): the trainer's numbers, the model's arguments
    and lnstab's data module's. The run's directory and checkpoint are not looked at.

    Raises:
        LNStabError: One line naming the key, as ``lnstab fit`` says it (``ConfigError``; ``DataError`` for data).
    """
    _check_run_numbers(config, "fit")
    _check_model_and_data(config)


def _check_model_and_data(c: Any) -> None:
    _check_model_args(_plain(c["model"]))
    data = c.get("data")
    if data is not None and _named_class(data.get("class_path")) is OpenWebTextDataModule:
        OpenWebTextDataModule.check_args(**_plain(data.get("init_args") or {}))


def _plain(group: Any) -> dict[str, Any]:
    return group.as_dict() if hasattr(group, "as_dict") else dict(group)


def _named_class(class_path: Any) -> Any:
    """The class a parsed ``class_path`` names (jsonargparse has imported it already), else ``None``."""
    module, _, name = str(class_path).rpartition(".")
    return getattr(sys.modules.get(module), name, None)


def _check_model_args(model: dict[str, Any]) -> None:
    """What ``GPTModule(**model)`` would refuse, refused now, named as the config key (``model.n_layer=0 …``)."""
    try:
        checked_config(model)
    except ConfigError as exc:
        message = str(exc)
        if message.split("=", 1)[0] in MODULE_ARGS:
            raise ConfigError(f"model.{message}") from None
        raise


def _refuse_run_dir_as_checkpoint(ckpt: str) -> None:
    """A run directory given as ``--ckpt_path`` (a sharded checkpoint is a directory too, but holds no run config)."""
    if Path(ckpt).is_dir() and (Path(ckpt) / CONFIG_FILE).is_file():
        raise ConfigError(f"--ckpt_path {ckpt} is a run directory, not a checkpoint; give --run_dir {ckpt} --ckpt_path "
                          "last, or one of its checkpoints/*.ckpt")
    run = Path(ckpt).absolute().parent
    if Path(ckpt).is_dir() and Path(ckpt).absolute().name == CHECKPOINT_DIR and (run / CONFIG_FILE).is_file():
        raise ConfigError(f"--ckpt_path {ckpt} is a run's checkpoint directory, not a checkpoint; give one of its "
                          f"*.ckpt files, or --run_dir {run} --ckpt_path last")


PATHLESS_SOURCES = ("sample", "synthetic")  # --data.source values that refuse a --data.path


def _default_config(argv: list[str]) -> list[str]:
    """``validate|test|evaluate --ckpt_path FILE`` without ``--config``: the checkpoint's run config."""
    given = any(a in ("--config", "-c") or a.startswith("--config=") for a in argv)
    if not argv or argv[0] not in CKPT_SUBCOMMANDS or given:
        return argv
    if "--help" in argv or "-h" in argv:  # the options, as for every other command (it needs no run)
        return argv
    values = dict(zip(argv, argv[1:], strict=False))
    values.update(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)  # --ckpt_path=FILE too
    run_dir = values.get("--run_dir")
    ckpt = values.get("--ckpt_path")
    if ckpt and ckpt not in runs.RESUME_KEYWORDS:
        _refuse_run_dir_as_checkpoint(ckpt)
        if run_dir is None or not (Path(run_dir) / CONFIG_FILE).is_file():  # a --run_dir of its own for results
            run_dir = runs.run_of_checkpoint(ckpt) or run_dir
    if run_dir is None or not (Path(run_dir) / CONFIG_FILE).is_file():
        raise ConfigError(f"lnstab {argv[0]} needs --config, or a --ckpt_path/--run_dir inside a run directory that "
                          f"holds {CONFIG_FILE}")
    # A source that reads no path, given here, replaces the run's: the run's --data.path is not the user's to drop
    source = next((values[k] for k in ("--data.source", "--data.init_args.source") if k in values), None)
    path_given = any(a.split("=", 1)[0] in ("--data.path", "--data.init_args.path") for a in argv)
    no_path = ["--data.path", "null"] if source in PATHLESS_SOURCES and not path_given else []
    return [argv[0], "--config", str(Path(run_dir) / CONFIG_FILE), *argv[1:], *no_path]


def cli_main(args: list[str] | None = None, run: bool = True) -> LNStabCLI:
    """Build (and by default run) the CLI; ``args`` as on the command line, without the program name."""
    raw = list(sys.argv[1:] if args is None else args)
    raw = _default_config(raw)
    expanded = expand_extends(raw)
    LNStabCLI.experiment, LNStabCLI.argv = experiment_name(raw), raw
    LNStabArgumentParser.experiment = LNStabCLI.experiment
    LNStabArgumentParser.given_logger, LNStabArgumentParser.argv = NOT_GIVEN, expanded
    LNStabCLI.run_status = LNStabCLI.created_run_dir = LNStabCLI.created_root = LNStabCLI.scored_run_dir = None
    return LNStabCLI(
        GPTModule,
        LightningDataModule,
        subclass_mode_data=True,
        trainer_class=LNStabTrainer,
        args=expanded,
        run=run,
        save_config_callback=SaveRunConfig,
        parser_class=LNStabArgumentParser,
    )



def run(argv: list[str]) -> None:
    """``lnstab fit|validate|test|evaluate ...`` (``argv`` without the program name): one line on stderr and
    exit status 2 for a user's mistake (1 for the machine's), ``128 + signal`` for an interrupted run, and the run's
    own exit status (:class:`~lnstab.callbacks.RunStatus`) otherwise."""
    if argv[0] == "fit":
        from lnstab.parentdeath import follow_parent

        follow_parent()  # a sweep's child ends with its sweep
    try:
        try:
            cli = cli_main(argv)
        except BaseException:  # refused or stopped before the run began: the directory it made goes with it
            if LNStabCLI.created_run_dir is not None:
                # never one holding a summary: the run began
                runs.discard_unbegun(LNStabCLI.created_run_dir, LNStabCLI.created_root)
            if LNStabCLI.scored_run_dir is not None:  # an evaluate refused at its data: no empty event file left
                runs.discard_unwritten_events(LNStabCLI.scored_run_dir)
            raise
    except RunInterrupted as exc:  # a signal during the final evaluation, a validate or test, or a second Ctrl-C
        if argv[0] != "fit":
            status = LNStabCLI.run_status
            own_line = "\n" if status is not None and status.bar_drawing else ""  # not after a progress bar's text
            print(f"{own_line}lnstab: lnstab {argv[0]} stopped by {signal.Signals(exc.signum).name} before it wrote "
                  "its result", file=sys.stderr)
        elif exc.at_once:  # the line before said it would stop after this step with a checkpoint: it did not
            print(f"\nlnstab: stopped at once by a second {signal.Signals(exc.signum).name}, without a checkpoint of "
                  "this step; --ckpt_path auto resumes the run's last checkpoint, or starts it afresh if it has none",
                  file=sys.stderr)
        raise SystemExit(128 + exc.signum) from None
    except Exception as exc:
        status = LNStabCLI.run_status
        if status is not None and status.signal is not None:  # an error after a signal: the run is interrupted
            print(f"lnstab: the run was stopping on {signal.Signals(status.signal).name} when "
                  f"{type(exc).__name__}: {one_line(exc)[:300]}; recorded as interrupted", file=sys.stderr)
            raise SystemExit(128 + int(status.signal)) from None
        exit_for_user_error(exc)
        raise
    if argv[0] == "fit" and cli.trainer.is_global_zero and not writes_files(cli.trainer):
        rank_zero_info("lnstab: fast_dev_run: nothing was written (no run directory, checkpoint or event file)")
    elif argv[0] == "fit" and cli.trainer.is_global_zero:  # the last line: where the run is and how to look at it
        where = short_path(trainer_run_dir(cli.trainer))  # one form on a fresh fit and a resume
        rank_zero_info(f"lnstab: run directory {where}; to view it: tensorboard --logdir {shlex.quote(str(where))}")
    status = next((cb for cb in getattr(cli.trainer, "callbacks", []) if isinstance(cb, RunStatus)), None)
    if status is not None and status.exit_code:
        raise SystemExit(status.exit_code)
