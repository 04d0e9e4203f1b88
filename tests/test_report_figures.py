"""``lnstab report``'s figures, read as matplotlib artists: one colour per design in every figure, a marker on a
line of one point, no panel without data and no legend entry for a line that was not drawn."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from lnstab.report.collect import RunRecord
from lnstab.report.figures import (
    FIGURES,
    attention_max_logit,
    draw_all,
    log_z_over_steps,
    loss_curves,
    lr_sensitivity,
    theorem4,
)
from lnstab.report.tables import group

STEPS = [0, 50, 100]


def record(placement: str, lr: float, seed: int = 0, *, status: str = "completed", scalars: dict | None = None,
           hidden: dict | None = None, val_loss: float | None = None) -> RunRecord:
    """A run as :func:`lnstab.report.collect.collect` reads it, its scalars given instead of read from disk."""
    config = {"model.norm_placement": placement, "model.learning_rate": lr, "seed_everything": seed}
    run = RunRecord(f"{placement}-{lr}-{seed}", Path("/nonexistent") / placement, status, config=config,
                    summary={"status": status}, metrics={} if val_loss is None else {"val_loss": val_loss},
                    hidden=hidden)
    run._scalars = scalars or {}
    return run


def curve(scale: float, steps=STEPS) -> list[tuple[int, float]]:
    return [(s, scale * (1 + s / 100)) for s in steps]


def ladder_grid() -> list[RunRecord]:
    """Three designs over three learning rates; at lr 10 every run diverged before it measured anything, the designs
    come in another order at each learning rate (as a sweep's finishing order gives them), and one run has no
    attention logits."""
    runs = []
    for lr, order in ((1e-3, ("pre", "peri", "post")), (1e-2, ("post", "pre", "peri")), (10.0, ("peri", "post",
                                                                                                "pre"))):
        for placement in order:
            scale = {"pre": 1.0, "peri": 2.0, "post": 4.0}[placement]
            if lr == 10.0:
                runs.append(record(placement, lr, status="diverged", scalars={"train/loss": [(0, 7.0)]}))
                continue
            scalars = {"train/loss": curve(6.0 / scale), "attn/max_logit/L00": curve(scale * lr * 1e3),
                       "output/log_z_mean": curve(scale)}
            if (placement, lr) == ("pre", 1e-3):
                del scalars["attn/max_logit/L00"]  # its attention was not measured: its first line is at lr 0.01
            runs.append(record(placement, lr, scalars=scalars, val_loss=3.0 + scale))
    return runs


def line_colours(fig) -> dict[str, str]:
    """Every labelled line's colour by label, checking that one label has one colour within the figure."""
    out: dict[str, str] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if label.startswith("_"):
                continue
            colour = to_hex(line.get_color())
            assert out.setdefault(label, colour) == colour, label
    return out


def legend_labels(fig) -> list[str]:
    return [text.get_text() for ax in fig.axes if ax.get_legend() for text in ax.get_legend().get_texts()]


def test_a_design_has_one_colour_in_every_figure():
    configs = group(ladder_grid())[1]
    figures = {"attention": attention_max_logit(configs), "log_z": log_z_over_steps(configs),
               "lr": lr_sensitivity(configs)}
    colours = {name: line_colours(fig) for name, fig in figures.items()}
    assert set(colours["attention"]) == set(colours["log_z"]) == set(colours["lr"]) == {
        "pre", "peri", "post"}
    assert colours["attention"] == colours["log_z"] == colours["lr"]
    assert len(set(colours["lr"].values())) == 3  # three designs, three colours


def test_no_panel_for_a_learning_rate_without_data_and_the_title_says_so():
    configs = group(ladder_grid())[1]
    fig = attention_max_logit(configs)
    assert [ax.get_title() for ax in fig.axes if ax.get_lines()] == ["lr=0.001", "lr=0.01"]
    assert all(ax.get_lines() for ax in fig.axes)  # no empty panel
    assert "no data at lr=10" in fig._suptitle.get_text()


def test_a_line_of_one_point_has_a_marker():
    once = record("pre", 1e-3, scalars={"train/loss": [(100, 5.0)], "val/loss": [(50, 5.5), (100, 5.2)]})
    fig = loss_curves(group([once])[1])
    train = next(ax for ax in fig.axes if ax.get_title().startswith("train/loss"))
    (line,) = train.get_lines()
    assert list(line.get_xdata()) == [100] and line.get_marker() not in (None, "None", "", " ")
    val = next(ax for ax in fig.axes if ax.get_title().startswith("val/loss"))
    assert val.get_lines()[0].get_marker() in (None, "None", "")  # a line of two points needs none


def test_no_empty_panel_and_no_legend_entry_for_a_line_not_drawn():
    # train loss only: no validation panel; a bound without a measured MA: no legend entry for the measured line
    fig = loss_curves(group([record("pre", 1e-3, scalars={"train/loss": curve(5.0)})])[1])
    assert [ax.get_title() for ax in fig.axes] == ["train/loss (× = divergence)"]
    bound_only = record("peri", 1e-3, scalars={"bound/ma_bound": curve(50.0)})
    fig = theorem4(group([bound_only])[1])
    assert legend_labels(fig) == ["all runs: bound"]
    assert all(len(line.get_xdata()) > 0 for ax in fig.axes for line in ax.get_lines())


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_every_figure_draws_no_empty_axes_or_unplotted_legend_entries(name, tmp_path):
    hidden = {"tags": ["embed", "L00_attn", "L00_mlp", "final"], "steps": [100],  # measured once
              "stats": {s: {t: [1.0 + i] for i, t in enumerate(["embed", "L00_attn", "L00_mlp", "final"])}
                        for s in ("mean_abs", "var_entry")}}  # no var_data: its panel must not be drawn
    runs = [*ladder_grid(), record("pre", 1e-3, seed=1, hidden=hidden,
                                   scalars={"jacobian/act_scale/L00": [(0, 2.0)],
                                            "jacobian/sensitivity/L00": [(0, 3.0)],
                                            "bound/ma_bound": [(100, 50.0)], "bound/ma_final": [(100, 40.0)]})]
    fig = FIGURES[name][1](group(runs)[1])
    assert fig is not None, name
    for ax in fig.axes:
        drawn = [a for a in (*ax.get_lines(), *ax.collections)
                 if len(a.get_xdata() if hasattr(a, "get_xdata") else a.get_offsets())]
        assert drawn, (name, ax.get_title())
        for line in ax.get_lines():
            if len(line.get_xdata()) == 1:
                assert line.get_marker() not in (None, "None", "", " "), (name, line.get_label())
    if name in ("depth_profile.png", "last_layer_steps.png"):
        assert len(fig.axes) == 2  # mean |x| and entry-wise variance; no data-wise variance
    plotted = {a.get_label() for ax in fig.axes for a in (*ax.get_lines(), *ax.collections)
               if len(a.get_xdata() if hasattr(a, "get_xdata") else a.get_offsets())}
    assert set(legend_labels(fig)) <= plotted, name
    paths = draw_all(group(runs)[1], tmp_path)
    assert paths[name] is not None and paths[name].stat().st_size > 0


def test_a_legend_of_long_labels_draws_without_a_warning(tmp_path):
    """Two runs that differ in many settings (`lnstab report` over two experiments) label each line with all of them:
    matplotlib's tight_layout found no room beside such a legend and printed 'UserWarning: Tight layout not applied'
    on every report; the saved figure takes the legend in anyway (``bbox_inches="tight"``)."""
    import warnings

    runs = [record("pre", 1e-3, scalars={"train/loss": curve(5.0)}),
            record("peri", 1e-2, seed=1, scalars={"train/loss": curve(4.0)})]
    for i, run in enumerate(runs):
        run.config.update({f"data.init_args.setting_{k}": f"/a/long/path/value/{i}/{k}" for k in range(6)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = draw_all(group(runs)[1], tmp_path)
    assert paths["loss_curves.png"] is not None and paths["loss_curves.png"].is_file()
    assert [str(w.message) for w in caught if "tight" in str(w.message).lower()] == []
