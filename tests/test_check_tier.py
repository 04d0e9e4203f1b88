"""``lnstab check --tier quick|proxy`` (issue 39, item 2): the proxy tier end to end on the OpenWebText sample at a
reduced ladder (2 rates, 1 seed, a few steps, given on the command line), its option handling and thresholds, and
the quick tier as before (its cards: tests/test_check.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lnstab.check.criteria import load_thresholds
from lnstab.check.options import build_parser, make_protocol, tier_model_args, tier_thresholds
from lnstab.check.protocol import TIERS, TIERS_FILE, Protocol, tiers
from lnstab.check.validation.run import DEFAULT_OUT, default_out
from lnstab.cli import main
from lnstab.safeload import load_yaml

OWT_900 = Path(os.environ.get("LNSTAB_OWT_SAMPLE", Path(__file__).resolve().parents[1] / ".."
                              / "shared/data/openwebtext/owt-sample-900.jsonl.gz"))
REDUCED = ["--lrs", "1e-3,1e-1", "--seeds", "0", "--steps", "6", "--warmup-steps", "2", "--measure-every", "3",
           "--batch-size", "4", "--workers", "1", "--threads", "1", "--no-progress"]


def test_a_proxy_tier_card_runs_end_to_end_and_says_its_tier(tmp_path, capsys) -> None:
    assert OWT_900.is_file(), f"the OpenWebText sample is needed (LNSTAB_OWT_SAMPLE): {OWT_900}"
    out = tmp_path / "card"
    try:
        main(["check", "--tier", "proxy", "--model.norm_placement", "pre", *REDUCED, "--data.path", str(OWT_900),
              "--out", str(out)])
        code = 0
    except SystemExit as exc:
        code = exc.code
    card = json.loads((out / "report.json").read_text())
    assert code == card["exit_code"]
    described = tiers()["proxy"]
    assert card["tier"] == {"name": "proxy", "sees": described["sees"], "cannot_see": described["cannot_see"],
                            "thresholds": "thresholds-proxy.yaml"}
    said = f"Tier: proxy (--tier proxy). It sees {described['sees']}. It cannot see {described['cannot_see']}."
    assert said in (out / "report.md").read_text() and said in capsys.readouterr().out
    # docs/proxy's shape for the model and its reference; the options given win over the tier's values
    shape = card["model"]["shape"]
    assert (shape["n_layer"], shape["n_embd"], shape["block_size"], shape["vocab_size"]) == (2, 128, 128, 4096)
    assert card["references"]["peri-ln"]["shape"]["vocab_size"] == 4096
    protocol = card["protocol"]
    assert (protocol["tier"], protocol["vocab_top_k"], protocol["val_documents"]) == ("proxy", 4095, 90)
    assert protocol["lrs"] == [1e-3, 1e-1] and protocol["seeds"] == [0] and protocol["batch_size"] == 4
    assert protocol["seq_len"] == 128
    opt = protocol["optimisation"]
    assert (opt["steps"], opt["min_lr_ratio"], opt["weight_decay"], opt["warmup_steps"]) == (6, 0.0, 0.0, 2)
    assert card["data"]["vocab"]["mode"] == "top_k" and card["data"]["vocab_size"] == 4096
    assert "4095 most frequent GPT-2 tokens" in card["data_text"] and "first 90 documents held out" in card[
        "data_text"]
    assert [(r["subject"], r["lr"]) for r in card["runs"]] == [("checked", 1e-3), ("checked", 0.1),
                                                               ("peri-ln", 1e-3), ("peri-ln", 0.1)]
    assert all(len(r["losses"]) == 7 for r in card["runs"])  # 6 updates, then the loss of the trained model
    # LR sensitivity and the loss fail at this tier, by thresholds-proxy.yaml merged over thresholds.yaml
    rows = {r["id"]: r for r in card["criteria"]}
    proxy = load_yaml(TIERS_FILE.with_name("thresholds-proxy.yaml"))
    for cid in ("lr_sensitivity", "loss"):
        assert rows[cid]["fail_rule"] == proxy[cid]["fail"] and rows[cid]["fail"] is not None
        assert rows[cid]["fail"] > rows[cid]["warn"]
    written = load_yaml(out / "thresholds.yaml")
    assert written["lr_sensitivity"]["fail"] == proxy["lr_sensitivity"]["fail"]
    assert written["growth_trained"] == load_thresholds(None)["growth_trained"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--tier", "slow"], "--tier='slow' is not allowed; choose one of: quick, proxy"),
        (["--tier", "proxy"], "--tier proxy needs the OpenWebText sample: give --data.path FILE"),
        (["--tier", "proxy", "--data.path", "no/such/owt.jsonl.gz"], "--data.path no/such/owt.jsonl.gz is not a file"),
        (["--tier", "proxy", "--data.source", "synthetic"], "--tier proxy needs the OpenWebText sample"),
        (["--tier", "proxy", "--validate", "--supplement", "depth16"],
         "--tier proxy is not allowed with --supplement: a supplement is its own protocol"),
    ],
)
def test_bad_tier_input_is_one_line_and_exit_2(tmp_path, capsys, args, expected) -> None:
    out = tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", "--model.norm_placement", "pre", *args, "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lnstab: error: ") and expected in err and "\n" not in err, err
    assert not out.exists()


def test_the_quick_tier_is_the_default_and_its_protocol_is_as_before() -> None:
    parse = build_parser().parse_args
    default, quick = make_protocol(parse([]), {}), make_protocol(parse(["--tier", "quick"]), {})
    assert default == quick == Protocol()  # the dataclass's defaults, as before there were tiers
    assert "tier" not in default.as_dict() and "vocab_top_k" not in default.as_dict()
    assert tier_model_args("quick", {"norm_placement": "peri"}) == {"norm_placement": "peri"}
    assert tier_thresholds("quick", None) == load_thresholds(None)


def test_the_proxy_tiers_values_come_from_tiers_yaml_and_given_options_win() -> None:
    values = tiers()["proxy"]["protocol"]
    protocol = make_protocol(build_parser().parse_args(["--tier", "proxy", "--seeds", "0,1,2", "--data.path",
                                                        str(OWT_900)]), {})
    assert protocol.lrs == tuple(values["lrs"]) and protocol.lrs[0] == 1e-4 and protocol.lrs[-1] == 0.3
    assert protocol.seeds == (0, 1, 2)  # given
    opt = protocol.optimisation
    assert (opt.steps, opt.warmup_steps, opt.min_lr_ratio, opt.weight_decay, protocol.batch_size,
            protocol.seq_len) == (values["steps"], values["warmup_steps"], 0.0, 0.0, 16, 128)
    assert set(TIERS) == set(tiers()) and all(tiers()[t]["sees"] and tiers()[t]["cannot_see"] for t in TIERS)


def test_the_proxy_tiers_model_shape_fills_only_what_is_not_given() -> None:
    assert tier_model_args("proxy", {"norm_placement": "peri"}) == {
        "preset": "mini", "n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 128, "bias": False,
        "norm_placement": "peri"}
    assert tier_model_args("proxy", {"n_layer": 4})["n_layer"] == 4
    with_preset = tier_model_args("proxy", {"preset": "small"})  # the preset's layers, width and heads
    assert with_preset == {"preset": "small", "block_size": 128, "bias": False}
    assert tier_model_args("proxy", {}) == {}  # --hf or --factory: the model's own shape


def test_a_thresholds_file_is_merged_over_the_proxy_tiers(tmp_path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("loss: {fail: null}\ngrowth_trained: {warn: pre + 3*sd}\n")
    merged = tier_thresholds("proxy", str(mine))
    proxy = load_yaml(TIERS_FILE.with_name("thresholds-proxy.yaml"))
    assert merged["loss"]["fail"] is None and merged["loss"]["warn"] == proxy["loss"]["warn"]
    assert merged["lr_sensitivity"]["fail"] == proxy["lr_sensitivity"]["fail"]
    assert merged["growth_trained"]["warn"] == "pre + 3*sd"
    assert load_thresholds(None)["lr_sensitivity"]["fail"] is None  # the quick tier's, unchanged


def test_a_proxy_tier_validation_grades_its_rows_at_the_tier_and_never_touches_the_quick_record(tmp_path) -> None:
    """``--validate --tier proxy`` (issue 39 item 3): every card at the tier's shape with its thresholds, the README
    saying so; without --out it goes to docs/check/validation/proxy, never over the quick tier's README."""
    assert OWT_900.is_file(), f"the OpenWebText sample is needed (LNSTAB_OWT_SAMPLE): {OWT_900}"
    out = tmp_path / "validation"
    try:  # exit 0 or 1: whether both rows agree at six steps is not what is tested
        main(["check", "--validate", "--tier", "proxy", "--rows", "no-ln,pre-ln-qknorm", *REDUCED,
              "--data.path", str(OWT_900), "--out", str(out)])
    except SystemExit as exc:
        assert exc.code == 1, exc.code
    proxy = tier_thresholds("proxy", None)
    for row in ("no-ln", "pre-ln-qknorm"):
        card = json.loads((out / row / "report.json").read_text())
        assert card["tier"]["name"] == "proxy" and card["model"]["shape"]["n_layer"] == 2
        assert card["model"]["shape"]["vocab_size"] == 4096
        assert load_yaml(out / row / "thresholds.yaml")["lr_sensitivity"]["fail"] == proxy["lr_sensitivity"]["fail"]
    summary = json.loads((out / "summary.json").read_text())
    assert "tier" not in summary  # six steps and two rates are not the tier's protocol: no headline
    text = (out / "README.md").read_text()
    assert "the proxy tier's shape" in text and "`lnstab/check/thresholds-proxy.yaml` merged over it" in text
    assert "none at the proxy tier since its thresholds were committed" in text
    assert default_out("proxy", "main", None) == DEFAULT_OUT / "proxy" != default_out("quick", "main", None)
    assert default_out("proxy", "heldout", None) == DEFAULT_OUT / "proxy" / "heldout"
    assert default_out("quick", "heldout", None) == DEFAULT_OUT / "heldout"
