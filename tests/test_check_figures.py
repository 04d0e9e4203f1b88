"""The card's growth figure draws, after training, the learning rate the growth criterion's reason names (issue 39,
item 6): the reason grades each subject at its worst rate, and the figure drew the largest rate every subject
completed, so a reader compared the reason's numbers with another rate's profile."""

from __future__ import annotations

import math
import warnings

from lnstab.check import figures
from lnstab.check.criteria import CRITERIA
from lnstab.check.runspec import RunResult

DEPTHS = [1.0, 2.0, 3.0, 4.0]


def profile(scale: float) -> dict[str, list[list[float]]]:
    return {stat: [DEPTHS, [scale * 2.0 ** d for d in DEPTHS]] for stat in figures.STATS}


def summary(worst: float) -> dict:
    """A subject that completed 1e-3 and 1e-1 and grows most after training at ``worst``."""
    return {
        "profiles": {"init": profile(1.0), "trained": {"0.001": profile(3.0), "0.1": profile(2.0)}},
        "growth_trained": {"mean": 1.5, "sd": 0.0, "lr": worst, "law": "exponential", "exp_r2": 0.99,
                           "exp_rate": math.log(2.0), "lin_r2": 0.9, "unmeasured": 0},
    }


def test_the_trained_row_is_the_rate_the_growth_reason_names(tmp_path, monkeypatch) -> None:
    summaries = {"pre-ln": summary(0.1), "checked": summary(0.001)}
    labels = {"pre-ln": "Pre-LN reference", "checked": "checked"}
    drawn: list[str] = []
    save = figures._save

    def keep(fig, path):  # the legends as drawn, then the figure saved as the card saves it
        drawn.extend(t.get_text() for ax in fig.axes[3:] if ax.get_legend() for t in ax.get_legend().get_texts())
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    assert figures.growth_figure(summaries, labels, tmp_path / "growth.png") == "growth.png"
    growth = next(c for c in CRITERIA if c.id == "growth_trained")
    for key, lr in (("checked", 0.001), ("pre-ln", 0.1)):
        reason = growth.explain(summaries[key], 1.5, 0.0, {})
        assert f" at lr {lr:g} " in reason  # what the card's reason names ...
        assert drawn.count(f"{labels[key]} (lr {lr:g})") == 3, drawn  # ... is what each after-training panel draws


def test_without_a_graded_rate_the_largest_common_rate_is_drawn() -> None:
    summaries = {"pre-ln": summary(0.1), "checked": {**summary(0.1), "growth_trained": {"lr": None}}}
    assert figures.graded_lr(summaries) == {"pre-ln": "0.1", "checked": "0.1"}


def stress_run(subject: str, losses: list[float], diverged: bool) -> RunResult:
    return RunResult(subject=subject, lr=0.1, seed=0, log_dir="tb", losses=losses, diverged=diverged,
                     diverged_step=len(losses) - 1 if diverged else None, events=[], hidden_tags=[], hidden_steps=[],
                     hidden={})


def test_a_panel_of_runs_with_no_finite_loss_names_them_and_warns_nothing(tmp_path, monkeypatch) -> None:
    """A model NaN from its first step draws only divergence marks: the loss figure drew them unnamed and matplotlib
    warned 'No artists with labels found to put in legend' on the user's terminal. Each subject is named once per
    panel, by its line or, where it drew none, by its mark."""
    nan = float("nan")
    runs = {"checked": [stress_run("checked", [nan, nan], True), stress_run("checked", [nan, nan, nan], True)],
            "pre-ln": [stress_run("pre-ln", [nan], True), stress_run("pre-ln", [5.0, 4.0], False)]}
    labels = {"checked": "checked", "pre-ln": "Pre-LN reference"}
    drawn: list[str] = []
    save = figures._save

    def keep(fig, path):
        drawn.extend(t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts())
        return save(fig, path)

    monkeypatch.setattr(figures, "_save", keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert figures.loss_figure(runs, labels, [0.1], tmp_path / "loss.png") == "loss.png"
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert sorted(drawn) == ["Pre-LN reference", "checked"], drawn  # once each, the mark standing for the line
