"""``lnstab check --z-loss``: a Hugging Face or factory model trained on its cross-entropy plus PaLM's z-loss, the
same objective lnstab's GPT forms in its chunked head (``--model.z_loss``), the references without it. Bad values are
among ``test_check``'s bad inputs."""

from __future__ import annotations

import pytest
from support.check import GPT, TINY, check

AS_FACTORY = ["--factory", "check_factories:lnstab_gpt_lm", "--layer-pattern", r"transformer\.h\.(\d+)$"]
ONE = ["--lrs", "1e-2", *TINY, "--no-reference"]


def test_the_z_loss_on_the_logits_trains_as_the_chunked_heads(tmp_path) -> None:
    # The same GPT, seed and batches: through its chunked head with config.z_loss, and as a factory model trained on
    # its logits with --z-loss. The two objectives (and their gradients) must agree step by step.
    _, own = check(tmp_path / "own", *GPT, "--model.z_loss", "0.05", *ONE)
    _, given = check(tmp_path / "given", *AS_FACTORY, "--z-loss", "0.05", *ONE)
    _, plain = check(tmp_path / "plain", *AS_FACTORY, *ONE)
    keys = ("n_layer", "n_embd", "vocab_size")
    shapes = [{k: card["model"]["shape"][k] for k in keys} for card in (own, given, plain)]
    assert shapes[0] == shapes[1] == shapes[2]
    own_ce, given_ce, plain_ce = (card["runs"][0]["losses"] for card in (own, given, plain))
    assert len(own_ce) == len(given_ce) == 7  # the cross-entropy before each of 6 updates and after the last
    assert given_ce == pytest.approx(own_ce, rel=2e-5)
    assert plain_ce[0] == pytest.approx(own_ce[0], rel=1e-6)  # same model, same first batch
    moved = max(abs(a - b) for a, b in zip(own_ce[1:], plain_ce[1:], strict=True))
    assert moved > 100 * max(abs(a - b) for a, b in zip(own_ce, given_ce, strict=True))  # the z-loss was trained on
    assert "+ 0.05·mean (log Z)² (--z-loss)" in given["model"]["description"] and given["model"]["z_loss"] == 0.05
    assert own["model"]["z_loss"] == 0.05 and plain["model"]["z_loss"] == 0  # whichever way it was given
    assert "--z-loss" not in plain["model"]["description"] and "(log Z)²" not in own["model"]["description"]


def test_the_references_train_without_it(tmp_path) -> None:
    both = ["--lrs", "1e-2", *TINY]
    _, card = check(tmp_path / "card", *AS_FACTORY, "--z-loss", "0.05", *both)
    _, plain = check(tmp_path / "plain", *AS_FACTORY, *both)
    assert "(--z-loss)" in card["model"]["description"]
    assert all("log Z" not in ref["description"] for ref in card["references"].values())

    def losses(report: dict, subject: str) -> list[float]:
        return next(r["losses"] for r in report["runs"] if r["subject"] == subject)

    for ref in ("pre-ln", "peri-ln"):  # a reference trains alike whether or not the checked model has a z-loss
        assert losses(card, ref) == losses(plain, ref)
    assert losses(card, "checked") != losses(plain, "checked")


def test_a_hugging_face_olmo_2_directory_trains_with_the_z_loss_its_own_loss_lacks(tmp_path) -> None:
    from support.check import olmo2

    olmo2().save_pretrained(tmp_path / "olmo2")
    hf = ["--hf", str(tmp_path / "olmo2"), "--hf-init", *ONE]
    _, given = check(tmp_path / "given", *hf, "--z-loss", "0.05")
    _, plain = check(tmp_path / "plain", *hf)
    given_ce, plain_ce = given["runs"][0]["losses"], plain["runs"][0]["losses"]
    assert given_ce[0] == plain_ce[0] and given_ce[1:] != plain_ce[1:]
    assert "+ 0.05·mean (log Z)² (--z-loss)" in given["model"]["description"]
