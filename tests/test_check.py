"""``lnstab check`` end to end at a tiny size: every input form, the verdicts on constructed cases, bad input.

Each check runs in-process through ``lnstab.cli.main`` (so the one-line error handling and exit codes are the
console script's) with a few optimizer steps of tiny models on the synthetic stream, one thread.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.check import ENCODER, GPT, TINY, check, rows
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lnstab.check.criteria import IDS
from lnstab.cli import main
from lnstab.rundir import read_json, read_summary

TESTS = Path(__file__).parent


def scalar_tags(run_dir: Path) -> set[str]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"])


def test_lnstab_peri_ln_runs_end_to_end_and_passes_the_bound(tmp_path, capsys) -> None:
    out = tmp_path / "card"
    code, report = check(out, *GPT, "--model.norm_placement", "peri", "--lrs", "1e-2", *TINY)
    assert code == report["exit_code"] == (1 if report["status"] == "fail" else 0)
    assert [r["id"] for r in report["criteria"]] == list(IDS)
    bound = rows(report)["bound"]
    assert bound["status"] == "pass" and bound["measured"] == 0 and "holds" in bound["why"]
    # The Peri-LN reference is the checked model itself: its runs are reused, the Pre-LN reference ran.
    assert report["references"]["peri-ln"]["same_as"] == "checked"
    assert [(r["subject"], r["lr"], r["seed"]) for r in report["runs"]] == [("checked", 0.01, 0), ("pre-ln", 0.01, 0)]
    for name in ("report.md", "thresholds.yaml"):
        assert (out / name).read_text().strip()
    for name in ("growth.png", "sensitivity.png", "loss.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tags = scalar_tags(out / "tb" / "checked" / "lr0.01_seed0")
    assert {"train/loss", "hidden/mean_abs/L01_mlp", "bound/violations", "jacobian/sensitivity/L01",
            "grad/norm/L00", "growth/exp_rate"} <= tags
    assert "bound/violations" not in scalar_tags(out / "tb" / "pre-ln" / "lr0.01_seed0")
    printed = capsys.readouterr().out
    assert printed.startswith("lnstab check: ") and all(r["title"] in printed for r in report["criteria"])
    depths = report["summaries"]["checked"]["profiles"]["init"]["mean_abs"][0]
    assert depths == [0.5, 1.0, 1.5, 2.0]  # half-steps of two layers


def test_hugging_face_gpt2_directory_runs_end_to_end(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "card"
    code, report = check(out, "--hf", str(tmp_path / "gpt2"), "--hf-init", "--lrs", "1e-2", *TINY)
    assert code == report["exit_code"]
    vocab = report["data"]["vocab"]  # a fresh init takes the protocol vocabulary: the distinct tokens of the windows
    assert vocab["mode"] == "protocol" and vocab["own"] == 128 and vocab["size"] <= 128
    assert report["model"]["shape"] == {"n_layer": 2, "n_embd": 32, "block_size": 32, "vocab_size": vocab["size"],
                                        "n_head": 2}
    for ref in ("pre-ln", "peri-ln"):  # references of the checked model's width, depth and context
        assert report["references"][ref]["shape"] == report["model"]["shape"]
        assert report["references"][ref]["same_as"] is None
    checked = report["summaries"]["checked"]
    assert checked["profiles"]["init"]["mean_abs"][0] == [1.0, 2.0]  # one site per Hugging Face block
    assert len(checked["sensitivity"]["points"]) == 4 and rows(report)["bound"]["status"] == "n/a"
    assert read_summary(out / "tb" / "checked" / "lr0.01_seed0")["status"] == "completed"


def test_hugging_face_llama_directory_runs_end_to_end(tmp_path) -> None:
    """A Llama-family decoder (RMSNorm, gated MLP, grouped-query attention, rotary positions): blocks are found under
    ``model.layers``, the final norm under ``model.norm``, and the references copy its shape from the config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    out = tmp_path / "card"
    code, report = check(out, "--hf", str(tmp_path / "llama"), "--hf-init", "--lrs", "1e-2", *TINY)
    assert code == report["exit_code"] == (1 if report["status"] == "fail" else 0)
    assert report["model"]["label"] == "checked (llama, init)"
    assert report["model"]["shape"] == {"n_layer": 3, "n_embd": 32, "block_size": 32,
                                        "vocab_size": report["data"]["vocab"]["size"], "n_head": 4}
    assert report["references"]["pre-ln"]["shape"] == report["model"]["shape"]
    assert report["summaries"]["checked"]["profiles"]["init"]["mean_abs"][0] == [1.0, 2.0, 3.0]  # one per layer
    assert rows(report)["bound"]["status"] == "n/a"  # no output norms: Theorem 4 does not apply
    tags = scalar_tags(out / "tb" / "checked" / "lr0.01_seed0")
    assert {"hidden/mean_abs/L02", "hidden/mean_abs/final", "jacobian/sensitivity/L02", "grad/norm/L02"} <= tags


def test_hugging_face_directory_loads_its_trained_weights(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from lnstab.check.subjects import hf_subject

    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    saved = GPT2LMHeadModel(config)
    saved.save_pretrained(tmp_path / "gpt2")
    loaded = hf_subject(str(tmp_path / "gpt2"), init=False).build().hf.state_dict()
    fresh = hf_subject(str(tmp_path / "gpt2"), init=True).build().hf.state_dict()
    key = "transformer.h.0.attn.c_attn.weight"
    torch.testing.assert_close(loaded[key], saved.state_dict()[key])
    assert not torch.equal(fresh[key], saved.state_dict()[key])


@pytest.mark.parametrize("head", [None, "^head$"])
def test_factory_transformer_encoder_runs_end_to_end(tmp_path, head) -> None:
    out = tmp_path / "card"
    code, report = check(out, *ENCODER, "--lrs", "1e-2", *TINY, *(["--head-pattern", head] if head else []))
    assert code == report["exit_code"]
    log_z = rows(report)["log_z"]
    if head is None:  # its head is not named lm_head: without --head-pattern the logits are not found
        assert log_z["status"] == "n/a" and "the output logits were not found" in log_z["why"]
    else:  # found by the factory model's own name, under the stress run's prefix (model.head), by every instrument
        assert log_z["status"] != "n/a" and math.isfinite(log_z["measured"])
        assert report["summaries"]["checked"]["log_z"]["init"] == pytest.approx(math.log(128), abs=0.5)
        assert "output/log_z_mean" in scalar_tags(out / "tb" / "checked" / "lr0.01_seed0")
    assert report["model"]["shape"]["n_layer"] == 2 and report["model"]["shape"]["n_embd"] == 32
    assert report["model"]["shape"]["vocab_size"] == 128  # read off the logits
    checked = report["summaries"]["checked"]
    assert len(checked["sensitivity"]["points"]) == 4
    assert rows(report)["grad_spread"]["status"] != "n/a"  # per-layer gradients found from layers.<i>
    assert {"hidden/mean_abs/L01", "jacobian/sensitivity/L00", "grad/norm/L01"} <= scalar_tags(
        out / "tb" / "checked" / "lr0.01_seed0")


def test_a_factory_models_own_attention_is_measured_through_patterns(tmp_path) -> None:
    own = ["--factory", "check_factories:own_attention_lm", "--layer-pattern", r"blocks\.(\d+)$"]
    code, report = check(tmp_path / "auto", *own, "--lrs", "1e-2", *TINY)
    assert rows(report)["attention"]["status"] == "n/a" and "--q-pattern" in rows(report)["attention"]["why"]
    qk = ["--q-pattern", r"\.query$", "--k-pattern", r"\.key$", "--n-head", "2", "--head-pattern", "out$"]
    code, report = check(tmp_path / "named", *own, *qk, "--lrs", "1e-2", *TINY)
    assert code == report["exit_code"]
    for cid in ("attention", "log_z"):
        assert rows(report)[cid]["status"] != "n/a" and math.isfinite(rows(report)[cid]["measured"]), cid
    assert {"attn/max_logit/L00", "attn/max_logit/L01"} <= scalar_tags(tmp_path / "named" / "tb" / "checked" /
                                                                       "lr0.01_seed0")


def test_no_norm_model_at_a_high_learning_rate_fails_divergence(tmp_path) -> None:
    args = [*GPT, "--model.norm_placement", "none", "--lrs", "0.3", *TINY, "--seeds", "0,1", "--steps", "10",
            "--measure-every", "5"]
    code, report = check(tmp_path / "card", *args)
    divergence = rows(report)["divergence"]
    assert divergence["status"] == "fail" and code == 1
    assert divergence["measured"] > max(divergence["references"].values())
    assert "more often than both references" in divergence["why"]
    first = [r["first_bad"] for r in report["runs"] if r["subject"] == "checked"]
    assert all(fb is not None and fb["step"] < 10 for fb in first)
    assert all(not r["diverged"] for r in report["runs"] if r["subject"] != "checked")
    assert read_summary(tmp_path / "card" / "tb" / "checked" / "lr0.3_seed0")["status"] == "diverged"


def test_blocks_that_triple_the_residual_warn_on_the_growth_law(tmp_path) -> None:
    args = ["--factory", "check_factories:tripling_lm", "--module-types", "check_factories.TriplingBlock",
            "--lrs", "1e-2", *TINY]
    code, report = check(tmp_path / "card", *args)
    growth = rows(report)["growth_trained"]  # growth warns only: its harm is its size (overflow judges that)
    assert growth["status"] == "warn" and growth["fail"] is None and code == report["exit_code"]
    assert growth["measured"] > growth["warn"] and growth["measured"] > max(growth["references"].values())
    assert "faster than both references" in growth["why"] and "exponential law fits better" in growth["why"]
    init = rows(report)["growth_init"]  # at initialisation exactly ×3 per layer: ×9 over the deeper 2 of 4 layers
    assert init["measured"] == pytest.approx(2 * math.log2(3), rel=0.02) and init["status"] == "warn"


def test_a_thresholds_file_changes_a_verdict(tmp_path) -> None:
    args = [*GPT, "--model.norm_placement", "pre", "--lrs", "1e-2", "--no-reference", *TINY]
    code, report = check(tmp_path / "default", *args)
    default = rows(report)["loss"]  # an outcome: only outcomes can fail (issue 39)
    assert default["status"] != "fail" and default["fail_source"] == "absolute"
    stricter = default["measured"] - 0.1 * abs(default["measured"]) - 1e-3
    thresholds = tmp_path / "strict.yaml"
    thresholds.write_text(f"loss:\n  absolute: {{warn: null, fail: {stricter!r}}}\n")
    code, report = check(tmp_path / "strict", *args, "--thresholds", str(thresholds))
    strict = rows(report)["loss"]
    assert strict["measured"] == pytest.approx(default["measured"])  # same seed, same model: same measurement
    assert strict["status"] == "fail" and strict["fail"] == pytest.approx(stricter) and code == 1
    assert f"{stricter!r}" in (tmp_path / "strict" / "thresholds.yaml").read_text()


def test_logits_in_a_tuple_or_a_dict_and_a_half_precision_model_are_checked_as_the_plain_one(tmp_path) -> None:
    """A tuple's first item or a dict's "logits" is what trains (the auxiliary loss is not trained on: the same
    card as the plain model's); a model built in float16 trains in the protocol's fp32 (as built, AdamW's eps
    underflowed and every run diverged, a FAIL that was the dtype's, not the design's)."""
    _, plain = check(tmp_path / "plain", *ENCODER, "--lrs", "1e-2", "--no-reference", *TINY)
    measured = {r["id"]: r["measured"] for r in plain["criteria"]}
    for factory in ("tuple_lm", "dict_lm"):
        _, packed = check(tmp_path / factory, "--factory", f"check_factories:{factory}", *ENCODER[2:], "--lrs",
                          "1e-2", "--no-reference", *TINY)
        assert {r["id"]: r["measured"] for r in packed["criteria"]} == measured, factory
    _, half = check(tmp_path / "half", "--factory", "check_factories:half_lm", *ENCODER[2:], "--lrs", "1e-2",
                    "--no-reference", *TINY)
    assert rows(half)["divergence"]["measured"] == 0
    assert rows(half)["loss"]["measured"] == pytest.approx(measured["loss"], abs=0.05)  # fp16-rounded initial weights


def test_a_block_skipped_in_training_is_named_as_why_growth_after_training_is_n_a(tmp_path) -> None:
    """Before, the card blamed "fewer than two layer sites" (the steps were dropped because a block did not run)."""
    _, report = check(tmp_path / "drop", "--factory", "check_factories:layerdrop_lm", "--layer-pattern",
                      r"blocks\.(\d+)$", "--lrs", "1e-2", "--no-reference", *TINY)
    init, trained = rows(report)["growth_init"], rows(report)["growth_trained"]
    assert init["status"] == "pass" and "not measured" not in init["why"]  # step 0 saw both blocks
    assert trained["status"] == "n/a" and trained["why"].startswith("1 run(s) not measured after training: a block "
                                                                    "did not run at that step")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--factory", "no_such_module_xyz.models:build"], "cannot be imported"),
        (["--factory", "check_factories:pooled_lm"], "it must map token ids (B, T) to logits (B, T, V)"),
        (["--factory", "check_factories:last_position_lm", *ENCODER[2:]], "as nanoGPT's GPT returns without targets"),
        ([*ENCODER[:2], "--layer-pattern", r"nomatch\.(\d+)$"], "matched no module"),
        # the four LayerNorms were graded as the model's blocks ("4 layers × 32 wide"), exit 0
        ([*ENCODER[:2], "--module-types", "torch.nn.LayerNorm"], "--module-types 'torch.nn.LayerNorm' is not allowed; "
         "it matched 4 modules with no submodules (encoder.layers.0.norm1, encoder.layers.0.norm2, …), which cannot "
         "be Transformer blocks"),
        (["--factory", "check_factories:table_lm", "--layer-pattern", r"blocks\.(\d+)$"],
         "matched no module of the model from --factory 'check_factories:table_lm' (it has no submodules, only the "
         "TableLM itself)"),  # it said "(its modules: , …)"
        ([*ENCODER, "--head-pattern", "^lm_head$"], "--head-pattern '^lm_head$' matched no module"),
        ([*ENCODER, "--q-pattern", "q$", "--k-pattern", "k$"], "--q-pattern, --k-pattern and --n-head go together"),
        ([*ENCODER, "--q-pattern", "linear1$", "--k-pattern", "linear2$", "--n-head", "2"],
         "are not allowed with --factory"),
        ([*GPT, "--n-head", "2"], "describe a --factory model"),
        (["--factory", "check_factories:not_a_module"], "it must return a torch.nn.Module"),
        (["--factory", "check_factories:bidirectional_lm", *ENCODER[2:]], "is not causal: changing tokens 8…15"),
        (["--factory", "check_factories:peek_in_training_lm", *ENCODER[2:]],
         "is not causal in train mode (its training forward: in eval mode it is causal): changing tokens 8…15"),
        (["--factory", "check_factories:encoder_lm", "--layer-pattern", "(unclosed"], "not a valid regular expression"),
        (["--hf", "/no/such/dir/gpt2"], "cannot be loaded"),
        ([], "exactly one of"),
        ([*GPT, "--hf", "x"], "exactly one of"),
        ([*GPT, "--model.norm_placement", "sideways"], "norm_placement='sideways' is not allowed"),
        ([*GPT, "--model.min_lr", "1e-4"], "--model.min_lr is not used"),
        ([*GPT, "--model.weight_decay_mode", "independent"], "--model.weight_decay_mode=independent is not used"),
        ([*GPT, "--measure-every", "4"], "it must divide the number of steps"),
        ([*GPT, "--warmup-steps", "7"], "--warmup-steps=7 is not allowed with --steps=6"),
        ([*GPT, "--seq-len", "33"], "context of 32; it must be at most 32"),
        # a factory's position embedding (64) shorter than the run: the IndexError said nothing of --seq-len
        ([*ENCODER, "--seq-len", "100"], "(IndexError: index out of range in self); if its context is shorter than "
                                         "100 tokens, give a smaller --seq-len"),
        ([*GPT, "--lrs", "abc"], "is not a comma-separated list of numbers"),
        ([*GPT, "--data.source", "auto", "--data.path", "owt.jsonl.gz", "--vocab", "model"], "holds GPT-2 tokens"),
        ([*GPT, "--data.path", "owt.jsonl.gz"], "is not used with --data.source synthetic"),
        ([*ENCODER, "--z-loss", "-1"], "--z-loss=-1.0 is not allowed; it must be a finite number >= 0"),
        ([*ENCODER, "--z-loss", "nan"], "--z-loss=nan is not allowed"),
        ([*GPT, "--z-loss", "1e-4"], "lnstab's GPT takes --model.z_loss"),
        (["--validate", "--z-loss", "1e-4"], "--z-loss is not used with --validate"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, expected) -> None:
    out = tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", *TINY, *args, "--out", str(out)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lnstab: error: ") and expected in err and "\n" not in err, err
    assert not out.exists()


def test_more_threads_than_cpus_are_refused_before_anything_is_loaded(tmp_path, capsys, monkeypatch) -> None:
    """``--threads 1000`` on two cores was taken as asked: the card was made by '1 worker × 1000 threads'. Now one
    line naming the flag and its range, exit 2, before the factory's module is imported or --out is made."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    (tmp_path / "threads_lm.py").write_text("from check_factories import encoder_lm  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    threads, out = torch.get_num_threads(), tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", "--factory", "threads_lm:encoder_lm", *ENCODER[2:], *TINY, "--threads", "1000", "--out",
              str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == ("lnstab: error: --threads=1000 is not allowed; it must be an integer in "
                                            "[1, 2], the CPUs this process may use"), err
    assert "threads_lm" not in sys.modules and not out.exists() and torch.get_num_threads() == threads


@pytest.mark.parametrize(("factory", "advice"), [
    ("short_embedding_lm", "its logits are 128 wide, so the protocol draws token ids from all 128: give its embedding "
                           "128 rows, one per logit"),
    ("short_embedding_sized_lm", r"the check builds it with vocab_size=\d+ \(the protocol vocabulary, the distinct "
                                 r"tokens of its windows\): size its embedding by vocab_size, as its logits are"),
])
def test_an_embedding_smaller_than_the_protocol_vocabulary_is_said_so(tmp_path, capsys, factory, advice) -> None:
    # it was the IndexError of a position embedding, 'give a smaller --seq-len', which changed nothing
    out = tmp_path / "card"
    with pytest.raises(SystemExit) as info:
        main(["check", *TINY, "--factory", f"check_factories:{factory}", *ENCODER[2:], "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and not out.exists()
    assert re.fullmatch(rf"lnstab: error: checked \(check_factories:{factory}\) has too small a vocabulary for the "
                        r"protocol's token ids: they run from 0 to \d+, but its embedding 'embed' has 100 rows "
                        rf"\(IndexError: index out of range in self\); {advice}", err), err


def test_bad_thresholds_and_an_existing_run_directory_are_refused(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.yaml"
    for text, expected in (("growth: {fail: 1}\n", "criterion 'growth' is not allowed"),
                           ("loss: {warn: __import__('os')}\n", "loss.warn="),
                           ("loss: {warn: 'pre +'}\n", "it is not an expression")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as info:
            main(["check", *GPT, *TINY, "--thresholds", str(bad), "--out", str(tmp_path / "card")])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and expected in err and "\n" not in err, err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "report.md").write_text("an earlier card\n")
    with pytest.raises(SystemExit) as info:
        main(["check", *GPT, *TINY, "--out", str(tmp_path / "used")])
    assert info.value.code == 2 and "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "used" / "report.md").read_text() == "an earlier card\n"


def test_default_run_directories_are_never_overwritten(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["check", *GPT, "--lrs", "1e-2", "--no-reference", *TINY]
    for _ in range(2):
        try:
            main(args)
        except SystemExit as exc:
            assert exc.code == 1
    names = sorted(p.name for p in (tmp_path / "runs" / "check").iterdir())
    assert names == ["tiny-pre-layernorm-dt1", "tiny-pre-layernorm-dt1-1"]
    assert all((tmp_path / "runs" / "check" / n / "report.json").is_file() for n in names)


@pytest.mark.slow
@pytest.mark.system
def test_console_script_exit_status(tmp_path) -> None:
    """``lnstab check`` as a CI gate: exit 1 when a criterion fails, 2 with one line on misuse."""
    exe = Path(sys.executable).with_name("lnstab")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "HF_HUB_OFFLINE": "1"}
    cmd = [str(exe), "check", *GPT, "--model.norm_placement", "none", "--lrs", "0.3", "--no-reference", *TINY,
           "--out", str(tmp_path / "card")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Divergence rate" in done.stdout and "FAIL" in done.stdout
    assert json.loads((tmp_path / "card" / "report.json").read_text())["exit_code"] == 1
    done = subprocess.run([str(exe), "check", "--factory", "check_factories:pooled_lm", *TINY], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "lnstab: error:" in done.stderr


def test_a_card_names_no_path_of_this_machine_and_says_where_it_was_made(tmp_path) -> None:
    from lnstab.check.runner import public_command

    out = tmp_path / "deep" / "card"
    code, report = check(out, *GPT, "--lrs", "1e-2", *TINY, "--no-reference")
    for name in ("report.json", "report.md", "thresholds.yaml"):
        assert str(tmp_path) not in (out / name).read_text(), name
    made = report["provenance"]
    assert made["lnstab"].startswith("0.") and made["machine"]["cpu"] and made["machine"]["threads_per_worker"] == 1
    assert isinstance(made["machine"]["native_bf16"], bool | None)
    assert made["machine"]["isa"] == torch.backends.cpu.get_cpu_capability()
    assert f"cores, {made['machine']['isa']}, " in (out / "report.md").read_text()
    assert "Made by lnstab" in (out / "report.md").read_text()
    assert "train mode" in report["model"]["training"] and "precision 32-true" in report["protocol_text"]
    shown = public_command(["--data.path", "/srv/x/owt.jsonl.gz", "--out=/srv/y/card", "--steps", "3"])
    assert shown == "lnstab check --data.path owt.jsonl.gz --out=card --steps 3"


def test_a_factory_taking_vocab_size_gets_the_protocol_vocabulary(tmp_path, capsys) -> None:
    sized = ["--factory", "check_factories:sized_lm", "--layer-pattern", r"layers\.(\d+)$"]
    code, report = check(tmp_path / "card", *sized, "--lrs", "1e-2", *TINY, "--no-reference")
    vocab = report["data"]["vocab"]
    assert vocab["mode"] == "protocol" and report["model"]["shape"]["vocab_size"] == vocab["size"] <= 128
    assert "protocol vocabulary" in report["data_text"]
    code, report = check(tmp_path / "own", *sized, "--lrs", "1e-2", *TINY, "--no-reference", "--vocab", "model")
    assert report["data"]["vocab"]["mode"] == "model" and report["model"]["shape"]["vocab_size"] == 128
    with pytest.raises(SystemExit) as info:  # a vocab_size argument that does not set the logits' width
        main(["check", "--factory", "check_factories:deaf_lm", *TINY, "--out", str(tmp_path / "deaf")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "returned logits over 128 tokens" in err and not (tmp_path / "deaf").exists()


def test_stress_runs_train_in_train_mode_with_dropout_off(tmp_path) -> None:
    import check_factories

    check_factories.MODES.clear()
    check_factories.FLUSHED.clear()
    assert not check_factories.denormals_flushed()  # the premise: this CPU keeps denormals unless told not to
    code, report = check(tmp_path / "card", "--factory", "check_factories:mode_lm", "--layer-pattern",
                         r"layers\.(\d+)$", "--lrs", "1e-2", *TINY, "--no-reference")
    # the 7 training steps (6 updates and the measured step after), and the causality probe's two train-mode forwards
    assert check_factories.MODES.count(True) == 7 + 2
    assert "1 dropout (nn.Dropout modules, nn.MultiheadAttention's) set to 0" in report["model"]["training"]
    # Denormals are flushed while a stress run trains (a speed-up, lnstab.check.training.denormals_flushed), in the
    # stress run only: not in the check's shape probes before it, nor in this process after it
    # (the causality probe's two train-mode forwards come first, in the check's own process: not flushed)
    assert [flushed for training, flushed in check_factories.FLUSHED if training] == [False] * 2 + [True] * 7
    assert check_factories.FLUSHED[0] == (False, False)  # the check's first shape probe, before any stress run
    assert not check_factories.denormals_flushed()


def test_multihead_attentions_dropout_is_switched_off_too() -> None:
    """nn.MultiheadAttention applies its dropout functionally from a float: the card said 'dropout off' while a
    factory model of nn.TransformerEncoderLayer(dropout=0.5) trained with its attention dropout on."""
    import torch
    from torch import nn

    from lnstab.check.subjects import dropout_off

    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True)
    assert dropout_off(layer) == 4 and layer.self_attn.dropout == 0.0  # dropout, dropout1, dropout2 and attention's
    x = torch.randn(2, 5, 16)
    layer.train()
    assert torch.equal(layer(x), layer(x))  # nothing random left in train mode


@pytest.mark.slow
def test_worker_processes_give_the_same_card(tmp_path) -> None:
    args = [*GPT, "--model.norm_placement", "peri", "--lrs", "1e-2,1e-1", *TINY]
    _, one = check(tmp_path / "one", *args)
    _, two = check(tmp_path / "two", *args, "--workers", "2")  # the later --workers wins
    assert two["provenance"]["machine"]["workers"] == 2 and one["provenance"]["machine"]["workers"] == 1
    assert [(r["id"], r["status"]) for r in one["criteria"]] == [(r["id"], r["status"]) for r in two["criteria"]]
    one, two = (read_json(tmp_path / name / "report.json") for name in ("one", "two"))  # NaN back as a float
    for a, b in zip(one["criteria"], two["criteria"], strict=True):
        assert a["measured"] == pytest.approx(b["measured"], rel=1e-4, nan_ok=True), a["id"]


def test_a_card_names_an_untied_or_xavier_initialised_model() -> None:
    """Before, the label and name of an untied, Xavier-initialised GPT read as a GPT-2-initialised, tied one's."""
    from lnstab.check.subjects import lnstab_subject

    subject, _ = lnstab_subject({"preset": "tiny", "tie_embeddings": False, "init": "xavier"})
    assert subject.label.endswith("untied, xavier init)") and subject.name.endswith("-untied-xavier")
    default, _ = lnstab_subject({"preset": "tiny"})
    assert "untied" not in default.label and "init" not in default.label


def test_factory_blocks_run_in_the_order_their_pattern_indexes_them_and_bad_models_are_one_line() -> None:
    """Blocks created last to first were numbered in creation order: the card's growth over depth read the profile
    backwards (x0.333 where a known model grows x2); an unanchored pattern also took each block's submodules as
    layers (8 of 4); a model on the meta device failed in its first forward with exit 3 and no error.txt."""
    import re

    import check_factories

    from lnstab.callbacks._sites import find_sites
    from lnstab.check.factory import factory_subject
    from lnstab.errors import LNStabError

    subject = factory_subject("check_factories:reversed_lm", r"unit_(\d+)$", None, 16)
    sites = find_sites(check_factories.reversed_lm(), re.compile(subject.sites.hidden_pattern))
    assert [s.name for s in sites] == [f"trunk.unit_{i}" for i in range(4)]  # the order they run
    with pytest.raises(LNStabError, match=r"gives layer index 3 to 'trunk.unit_3' and 'trunk.unit_3.layer'"):
        factory_subject("check_factories:reversed_lm", r"unit_(\d+)", None, 16)
    with pytest.raises(LNStabError, match=r"tensors on the meta device \(e.g. 'embed.weight'\)"):
        factory_subject("check_factories:meta_lm", r"blocks\.(\d+)$", None, 16)


def test_blocks_named_without_an_index_say_why_gradient_spread_is_not_measured(tmp_path) -> None:
    """The sentence written for it never reached the card (the grading was not given the parameter pattern): blocks
    named ``first``/``second`` read 'no per-layer gradient norms were measured', as if every run had diverged."""
    code, report = check(tmp_path / "card", "--factory", "check_factories:named_blocks_lm", "--layer-pattern",
                         "^(?:first|second)$", "--lrs", "1e-2", *TINY, "--no-reference")
    row = rows(report)["grad_spread"]
    assert row["status"] == "n/a" and row["why"] == ("no per-layer gradient norms (block names need a numeric index, "
                                                     "e.g. layers.3)"), row


def test_blocks_in_a_module_dict_get_their_gradient_spread_from_the_layer_pattern(tmp_path) -> None:
    """An nn.ModuleDict's blocks.b0, blocks.b1 under --layer-pattern 'blocks\\.b(\\d+)$' (the index its first group
    captures, as the option asks) got no gradient spread: the parameter pattern wanted names ending in '.<index>', and
    the card said the names 'need a numeric index'."""
    from lnstab.check.factory import param_pattern

    pattern = re.compile(r"blocks\.b(\d+)$")
    assert param_pattern(["blocks.b0", "blocks.b1"], pattern) == r"(?:^|\.)(?:blocks\.b)(\d+)\."
    assert param_pattern(["layers.0", "layers.1"], pattern) == r"(?:^|\.)(?:layers)\.(\d+)\."  # as before
    assert param_pattern(["first", "second"], re.compile("^(?:first|second)$")) is None
    code, report = check(tmp_path / "card", "--factory", "check_factories:dict_blocks_lm", "--layer-pattern",
                         r"blocks\.b(\d+)$", "--lrs", "1e-2", *TINY, "--no-reference")
    row = rows(report)["grad_spread"]
    assert row["status"] != "n/a" and math.isfinite(row["measured"]), row
