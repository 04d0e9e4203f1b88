"""The callbacks' arguments as a user of their own Lightning project meets them: one-line refusals for what cannot
work (two instances writing one file, no statistics), single values where lists are allowed, warnings that say how
to point an instrument at blocks it did not find, and state keys that let two differently set instances coexist
while a default one keeps the key older checkpoints were saved under."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from lightning.pytorch import Callback
from support.callbacks import VOCAB, LitLM, lit, loader, trainer
from torch import nn

from lnstab.callbacks import (
    DivergenceMonitor,
    GrowthBoundMonitor,
    HiddenStateStatistics,
    Instruments,
    RunStatus,
    StepProgressBar,
)
from lnstab.errors import ConfigError, LNStabError


class StackLM(nn.Module):
    """Blocks under a name no instrument looks for by default (``stack.N``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.stack = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                   for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.stack:
            h = block(h)
        return self.head(h)


def test_bad_arguments_are_one_line_and_single_values_are_lists_of_one() -> None:
    assert RunStatus(signals="SIGINT").signals == ("SIGINT",)  # before: 'S', 'I', 'G', … each refused
    with pytest.raises(ConfigError, match=r"^stats=\[\] is not allowed; give at least one of: mean_abs"):
        HiddenStateStatistics(stats=[])  # before: accepted, then a RuntimeError at the first measured step
    with pytest.raises(ConfigError) as info:
        HiddenStateStatistics(module_types=nn.Linear(2, 2))
    assert "\n" not in str(info.value) and "module_types=an instance of Linear is not allowed" in str(info.value)
    # a class that is no module (a dotted path to a function's class, a typo'd import): before, accepted, and at
    # setup only 'matched no module of the model'
    with pytest.raises(ConfigError, match=r"^module_types=\['torch.Tensor'\] is not allowed; 'torch.Tensor' is not a "
                                          r"torch.nn.Module class; give module classes or dotted class paths$"):
        GrowthBoundMonitor(module_types=["torch.Tensor"])
    with pytest.raises(ConfigError, match=r"^module_types=\[<class 'int'>\] is not allowed; int is not a"):
        HiddenStateStatistics(module_types=[int])
    with pytest.raises(ConfigError, match=r"^instruments\.fatal_kinds="):  # before: refused only by .callbacks()
        Instruments(fatal_kinds=["bogus"])
    with pytest.raises(ConfigError, match=r"^instruments\.loss_explosion_factor=0\.5 is not allowed"):
        Instruments(loss_explosion_factor=0.5)
    monitors = [c for c in Instruments(loss_explosion_factor=10).callbacks() if isinstance(c, DivergenceMonitor)]
    assert [m.loss_explosion_factor for m in monitors] == [10.0]  # the config's value reaches the monitor


@pytest.mark.parametrize("make", [
    lambda: RunStatus(save_on_interrupt="no"), lambda: Instruments(attention="no"), lambda: Instruments(enabled="off"),
    lambda: GrowthBoundMonitor(unroll_repeats="yes"), lambda: StepProgressBar(leave="no"),
    lambda: StepProgressBar(refresh_rate=-1),
])
def test_a_flag_given_as_a_word_and_a_negative_refresh_rate_are_refused(make) -> None:
    """bool("no") is True: these switched the opposite way on; a negative refresh rate was taken."""
    with pytest.raises(ConfigError, match=r"^[a-z_.]+=('\w+'|-1) is not allowed; (choose one of: True, False|it must "
                                          r"be an integer >= 0)$"):
        make()


def test_growth_bound_without_an_embedding_site_starts_at_the_first_layers_input(tmp_path) -> None:
    bound = GrowthBoundMonitor(every_n_steps=1, embed_pattern=None)  # before: "must be a regular expression"
    trainer(tmp_path, [bound], max_steps=1).fit(lit("gpt"), loader(8))
    assert bound.sites[0].tag == "embed" and bound.sites[0].use_input and bound.last["bound/violations"] == 0


def test_two_instances_that_would_overwrite_one_file_are_refused(tmp_path) -> None:
    for pair, said in (([DivergenceMonitor(), DivergenceMonitor(policy="skip")], "two DivergenceMonitors"),
                       ([HiddenStateStatistics(every_n_steps=1), HiddenStateStatistics(every_n_steps=2)],
                        "series_file='hidden_stats.json' is not allowed for two HiddenStateStatistics")):
        with pytest.raises(ConfigError, match=said):
            trainer(tmp_path, pair, max_steps=1).fit(lit("gpt"), loader(8))


def test_two_hidden_state_instruments_on_other_sites_coexist_and_a_default_keeps_its_key(tmp_path) -> None:
    default = HiddenStateStatistics(every_n_steps=1)
    norms = HiddenStateStatistics(every_n_steps=1, module_types=[nn.LayerNorm], series_file="norms.json",
                                  embed_pattern=None, final_pattern=None)
    assert default.state_key == "HiddenStateStatistics{'every_n_steps': 1, 'layer_pattern': 'None'}"  # as saved
    assert norms.state_key != default.state_key  # before: equal, and Lightning refused the pair
    t = trainer(tmp_path, [default, norms], max_steps=2)
    t.fit(lit("gpt"), loader(8))
    run = tmp_path / "csv" / "version_0"
    assert json.loads((run / "norms.json").read_text())["steps"] == [0, 1] == default.steps
    assert len(norms.tags) > len(default.tags)  # every LayerNorm of the model, not its blocks


def sublayer_pair(prefix: str | None) -> tuple[HiddenStateStatistics, HiddenStateStatistics]:
    """Attention outputs and MLP outputs of lnstab's GPT, watched apart: both tagged L00, L01 … by their patterns."""
    kw = dict(every_n_steps=1, embed_pattern=None, final_pattern=None)
    return (HiddenStateStatistics(layer_pattern=r"h\.(\d+)\.attn$", series_file="attn.json", **kw),
            HiddenStateStatistics(layer_pattern=r"h\.(\d+)\.mlp$", series_file="mlp.json", metric_prefix=prefix, **kw))


def test_two_instances_whose_sites_share_tags_are_told_and_a_metric_prefix_keeps_them_apart(tmp_path) -> None:
    import csv

    attn, mlp = sublayer_pair(None)
    with pytest.warns(UserWarning, match=r"both log 'hidden/mean_abs/L00' at step 0, with other values .* "
                                         r"metric_prefix='mlp'"):  # before: nothing said, one name for both
        trainer(tmp_path / "shared", [attn, mlp], max_steps=2).fit(lit("gpt"), loader(8))
    assert attn.tags == mlp.tags and attn.tags[0] == "L00"
    attn, mlp = sublayer_pair("mlp")
    assert "'metric_prefix': 'mlp'" in mlp.state_key and "metric_prefix" not in attn.state_key
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(tmp_path / "apart", [attn, mlp], max_steps=2).fit(lit("gpt"), loader(8))
    assert not [w for w in seen if "both log" in str(w.message)]
    rows = list(csv.DictReader((tmp_path / "apart" / "csv" / "version_0" / "metrics.csv").open()))
    last = {k: float(v) for r in rows if r["step"] == "1" for k, v in r.items() if v and k != "step"}
    assert last["hidden/mean_abs/L00"] == pytest.approx(attn.last["hidden/mean_abs/L00"], rel=1e-6)
    assert last["mlp/hidden/mean_abs/L00"] == pytest.approx(mlp.last["hidden/mean_abs/L00"], rel=1e-6)
    assert attn.last["hidden/mean_abs/L00"] != pytest.approx(mlp.last["hidden/mean_abs/L00"], rel=1e-3)


def test_the_same_site_logged_by_two_instances_alike_is_not_warned_of(tmp_path) -> None:
    one = HiddenStateStatistics(every_n_steps=1, stats="mean_abs", series_file="one.json")
    both = HiddenStateStatistics(every_n_steps=1, stats=["mean_abs", "max_abs"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer(tmp_path, [one, both], max_steps=2).fit(lit("gpt"), loader(8))
    assert set(one.last) < set(both.last) and not [w for w in seen if "both log" in str(w.message)]
    for bad in ("a b", "/x", "x/", 3):
        with pytest.raises(ConfigError, match=rf"^metric_prefix={bad!r} is not allowed; give None or a name"):
            HiddenStateStatistics(metric_prefix=bad)
    from lnstab.callbacks import GradientStatistics, JacobianSensitivity

    assert GradientStatistics(metric_prefix="probe/mlp").prefixed("grad/norm/L00") == "probe/mlp/grad/norm/L00"
    assert JacobianSensitivity().state_key == JacobianSensitivity(metric_prefix=None).state_key
    assert "'metric_prefix': 'b'" in JacobianSensitivity(metric_prefix="b").state_key


def test_a_finished_trainer_is_not_kept_alive_by_the_metric_names_it_logged(tmp_path) -> None:
    import gc
    import weakref

    from lnstab.callbacks import _sites

    t = trainer(tmp_path, [HiddenStateStatistics(every_n_steps=1)], max_steps=2)
    t.fit(lit("gpt"), loader(8))
    gone = weakref.ref(t)
    assert t in _sites._LOGGED  # its names were registered
    del t
    gc.collect()
    assert gone() is None  # before (the owner held strongly): the callback reached the trainer, which stayed alive


def test_instruments_that_find_no_block_say_how_to_name_them(tmp_path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callbacks = [HiddenStateStatistics(every_n_steps=1), GrowthBoundMonitor(every_n_steps=1), DivergenceMonitor()]
        trainer(tmp_path, callbacks, max_steps=1).fit(LitLM(StackLM()), loader(8))
    said = [str(w.message) for w in caught if "no blocks found" in str(w.message)]
    assert len(said) == 3 and all("give layer_pattern" in s for s in said), said
    assert "or module_types" in said[0] and "or module_types" not in said[2]  # DivergenceMonitor has none
    assert said[2].endswith("activations are not checked")  # before: DivergenceMonitor said nothing


def test_resuming_with_another_cadence_keeps_the_earlier_series_in_its_file(tmp_path) -> None:
    """Its state key holds every_n_steps, so the checkpoint has no state for the new instance: before, the resumed
    run rewrote hidden_stats.json with its own steps only."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    def fit(every: int, steps: int, ckpt_path: str | None = None) -> None:
        saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
        t = trainer(tmp_path, [HiddenStateStatistics(every_n_steps=every), saver], max_steps=steps,
                    enable_checkpointing=True, logger=CSVLogger(tmp_path, name="run", version=0))
        t.fit(lit("gpt"), loader(32), ckpt_path=ckpt_path)

    fit(1, 4)
    with pytest.warns(UserWarning, match="its 4 earlier steps are taken from the checkpoint"):
        fit(2, 8, str(tmp_path / "ckpt" / "last.ckpt"))
    series = json.loads((tmp_path / "run" / "version_0" / "hidden_stats.json").read_text())
    assert series["steps"] == [0, 1, 2, 3, 4, 6] and all(len(v) == 6 for v in series["stats"]["mean_abs"].values())


def test_a_resume_into_a_new_logger_version_reads_the_checkpoint_runs_series(tmp_path) -> None:
    """LightningCLI's default: a resumed fit logs into version_1, and the checkpoint lives in version_0."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    def fit(every: int, steps: int, ckpt_path: str | None = None) -> None:
        t = trainer(tmp_path, [HiddenStateStatistics(every_n_steps=every), ModelCheckpoint(save_last=True)],
                    max_steps=steps, enable_checkpointing=True, logger=CSVLogger(tmp_path, name="run"))
        t.fit(lit("gpt"), loader(32), ckpt_path=ckpt_path)

    fit(1, 4)
    with pytest.warns(UserWarning, match="its 4 earlier steps are taken from the checkpoint"):
        fit(2, 8, str(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"))
    series = json.loads((tmp_path / "run" / "version_1" / "hidden_stats.json").read_text())
    assert series["steps"] == [0, 1, 2, 3, 4, 6]  # before: [4, 6]


def test_a_fit_refused_in_setup_leaves_a_finished_runs_status(tmp_path) -> None:
    """A resume another callback refuses in its setup (LightningCLI's config saver finding config.yaml) changed
    nothing of the run: before, RunStatus marked the completed run failed at step 0."""
    from lightning.pytorch.loggers import CSVLogger

    from lnstab.rundir import read_summary

    class Refuses(Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            raise RuntimeError("config.yaml exists")

    def fit(*extra) -> None:
        trainer(tmp_path, [RunStatus(signals=[]), *extra], max_steps=2,
                logger=CSVLogger(tmp_path, name="run", version=0)).fit(lit("gpt"), loader(8))

    fit()
    done = read_summary(tmp_path / "run" / "version_0")
    with pytest.raises(RuntimeError, match="config.yaml exists"):
        fit(Refuses())
    after = read_summary(tmp_path / "run" / "version_0")
    assert after["status"] == "completed" and after["final_step"] == 2 and after["ended_at"] == done["ended_at"]


def test_single_names_exports_and_messages_a_config_user_meets() -> None:
    from lnstab.callbacks import StepProgressBar, __all__
    from lnstab.evaluation.callback import FinalEvaluation

    assert "StepProgressBar" in __all__ and StepProgressBar.__module__ == "lnstab.callbacks.progress"
    assert HiddenStateStatistics(stats="max_abs").stats == ("max_abs",)
    with pytest.raises(ConfigError, match=r"each must be one of: mean_abs, var_entry, var_data, max_abs$"):
        HiddenStateStatistics(stats=["attn_max_logit"])  # before: the unknown-name message offered it as allowed
    from lightning.pytorch.trainer.states import TrainerFn

    t = type("T", (), {"datamodule": object()})()
    with pytest.raises(LNStabError, match=r"\(or on_fit_end=False\)$"):  # before: on_TrainerFn.FITTING_end
        FinalEvaluation().setup(t, None, TrainerFn.FITTING)


CLI_MODULE = '''
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lnstab.errors
from lnstab.callbacks import RunStatus


class MyModule(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class MyData(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(16, 4, 8)), batch_size=4)
'''


@pytest.mark.system
def test_the_docs_lightningcli_entry_point_gives_one_line_and_the_signal_exit_status(tmp_path) -> None:
    """docs/library.md's snippet, run as a user's main.py: a bad callback argument is lnstab's one line (jsonargparse
    printed ~80 lines with a traceback), and a good config trains and exits 0."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "library.md").read_text(encoding="utf-8")
    snippet = re.search(r"In your own `LightningCLI` project.*?```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "main.py").write_text(CLI_MODULE + "\n" + snippet)
    base = ["--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu"]
    for every, code in ((-1, 2), (1, 0)):  # a user's error exits 2, as lnstab fit's
        config = tmp_path / f"cfg{code}.yaml"
        config.write_text("trainer:\n  callbacks:\n    - class_path: lnstab.callbacks.HiddenStateStatistics\n"
                          f"      init_args: {{every_n_steps: {every}, layer_pattern: 'blocks\\.(\\d+)$', "
                          "series_file: null}\n    - class_path: lnstab.callbacks.RunStatus\n"
                          "      init_args: {signals: SIGTERM}\n")
        done = subprocess.run([sys.executable, "main.py", "fit", "--config", str(config), *base], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == code, done.stderr[-2000:]
        if code:
            assert done.stderr.strip().splitlines()[-1] == ("error: every_n_steps=-1 is not allowed; it must be an "
                                                            "integer >= 1")


def test_an_unanchored_layer_pattern_is_told_to_anchor_naming_the_two_modules(tmp_path) -> None:
    """'h\\.(\\d+)' matches a block and its submodules, so two sites get one tag: before, 'add a capture group per
    layer' was said of a pattern that has one."""
    callback = HiddenStateStatistics(every_n_steps=1, layer_pattern=r"transformer\.h\.(\d+)")
    with pytest.raises(ConfigError, match=r"it gives tag L00 to 'model\.hf\.transformer\.h\.0' and "
                                          r"'model\.hf\.transformer\.h\.0\.ln_1': anchor it where a layer's name ends"):
        trainer(tmp_path, [callback], max_steps=1).fit(lit("hf"), loader(8))
