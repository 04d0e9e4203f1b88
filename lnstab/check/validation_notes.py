"""What the validation README says beyond the numbers, written after a run: why a row disagrees (:data:`NOTES`, by
row id), what each supplement found (:data:`SUPPLEMENT_NOTES`) and any threshold changed after the set was first run
(:data:`THRESHOLD_CHANGES`, each with its reason; every verdict is then re-run) and any row changed after its first
run (:data:`ROW_CHANGES`: corrected citations, a corrected model). Kept apart from
:mod:`lnstab.check.validation`, whose history shows the expected verdicts fixed before the run.

A note quotes the run's numbers through placeholders that :func:`render` fills from the cards of that run, so a note
never quotes a number its run did not measure (typed by hand, they went stale when the set was re-run on another CPU
kind): ``{row.criterion}`` is a criterion's value on that row's card, ``{row.criterion@pre-ln}`` a reference's value
on it, ``{row.criterion#warn}`` (``#fail``) its threshold, each as the card reads it (``×2.1e6`` for a gradient
spread); ``{row:summaries/checked/lr_sensitivity/points/0.01|.2f}`` is any value of the row's ``report.json``, by
its keys (list indices as numbers), with an optional format; ``{a/b|times}`` is the ratio of two such values (or
numbers: ``{row.overflow/65504|times}``) and ``{a/b|decades}``, ``{a|decades}`` its log10, to the decade, each of a
spread or growth taken as its factor. What a note says about the numbers is still prose.
"""

from __future__ import annotations

import math
import re
from typing import Any

from lnstab.check.card import FACTOR_BASES, as_factor

# The held-out set's row notes (lnstab.check.validation.HELDOUT): written after its run, to explain its numbers;
# they change no verdict.
HELDOUT_NOTES: dict[str, str] = {
    "pre-rmsnorm": "graded as Pre-LN is (growth after training {pre-rmsnorm.growth_trained} against Pre-LN's "
                   "{pre-rmsnorm.growth_trained@pre-ln}, Jacobian slope {pre-rmsnorm.sensitivity}), and it also warns "
                   "on gradient spread ({pre-rmsnorm.grad_spread} against {pre-rmsnorm.grad_spread@pre-ln} and "
                   "{pre-rmsnorm.grad_spread@peri-ln}; warn above {pre-rmsnorm.grad_spread#warn})",
    "pre-ln-nobias": "its references are built without biases too, so its Pre-LN reference is the row itself: it shows "
                     "that Pre-LN's verdict holds without biases, not that removing them changes it",
    "pre-ln-zloss": "the z-loss (1e-4) does not move log Z in 30 steps ({pre-ln-zloss.log_z} against "
                    "{pre-ln-zloss.log_z@pre-ln}), as in the main set's OLMo 2 row, so the card is Pre-LN's",
    "peri-ln-dt0.1": "warns only on the Jacobian slope ({peri-ln-dt0.1.sensitivity} against Peri-LN's "
                     "{peri-ln-dt0.1.sensitivity@peri-ln}; warn above {peri-ln-dt0.1.sensitivity#warn}); its best loss "
                     "is the lowest of the three ({peri-ln-dt0.1.loss} against {peri-ln-dt0.1.loss@peri-ln} and "
                     "{peri-ln-dt0.1.loss@pre-ln} nats), as Kan et al. report at 124M",
    "post-rmsnorm": "agrees on the mechanism, not on the loss, as the main set's Post-LN row does: its per-layer "
                    "gradient norms span {post-rmsnorm.grad_spread} at lr "
                    "{post-rmsnorm:summaries/checked/grad_spread/lr} (the references {post-rmsnorm.grad_spread@pre-ln} "
                    "and {post-rmsnorm.grad_spread@peri-ln}), while it learns about as well as Pre-LN "
                    "({post-rmsnorm.loss} against {post-rmsnorm.loss@pre-ln} nats)",
    "llama-hf": "its largest |x| {llama-hf.overflow} is beyond fp16's maximum (Pre-LN's {llama-hf.overflow@pre-ln}, "
                "Peri-LN's {llama-hf.overflow@peri-ln}), far beyond the massive activations Sun et al. 2024 find in "
                "LLaMA2-7B (a few fixed dimensions, in the thousands); it also grows faster at initialisation "
                "({llama-hf.growth_init} against {llama-hf.growth_init@pre-ln}), "
                "Hugging Face's Llama drawing every projection at std 0.02 without GPT-2's 1/√(2L) for the "
                "residual outputs",
    "olmo2-hf": "the prediction's uncertain branch came out a pass: gradient spread {olmo2-hf.grad_spread} against "
                "{olmo2-hf.grad_spread@pre-ln} and {olmo2-hf.grad_spread@peri-ln}, where lnstab's OLMo 2 row warns; "
                "Theorem 4's bound is checked on its located output norms ({olmo2-hf.bound} violations); QK-norm "
                "keeps its attention logits at {olmo2-hf.attention} against {olmo2-hf.attention@pre-ln}; it warns on "
                "LR sensitivity ({olmo2-hf.lr_sensitivity}, warn above {olmo2-hf.lr_sensitivity#warn}) and on "
                "growth at initialisation and after training",
    "gpt2-hf": "graded as lnstab's Pre-LN is, on the same two criteria (growth after training "
               "{gpt2-hf.growth_trained} against {gpt2-hf.growth_trained@pre-ln}, Jacobian slope "
               "{gpt2-hf.sensitivity} against {gpt2-hf.sensitivity@pre-ln}): the Hugging Face path and lnstab's "
               "family agree on Pre-LN",
}

NOTES: dict[str, str] = {
    "post-ln": "agrees on the mechanism, not on the loss: its per-layer gradient norms span {post-ln.grad_spread} "
               "at lr {post-ln:summaries/checked/grad_spread/lr} (Xiong et al.'s gradient pathology), but at 4 "
               "layers and 30 steps it learns as well as Pre-LN ({post-ln.loss} against "
               "{pre-ln.loss} nats)",
    "no-ln": "{no-ln:summaries/checked/diverged} of {no-ln:summaries/checked/runs} runs diverge, and |mean log Z| "
             "reaches {no-ln.log_z} ({no-ln:summaries/checked/log_z/events} logit_drift events)",
    "pre-ln": "warns on growth after training ({pre-ln.growth_trained} over the deeper half, "
              "{pre-ln:summaries/checked/growth_trained/law} fit) and the Jacobian slope ({pre-ln.sensitivity}: "
              "sensitivity that does not fall with scale); its largest |x| {pre-ln.overflow} is just under half of "
              "fp16's maximum, so fp16's range holds at these rates (at lr 0.3, supplement seeds-rungs, it does not)",
    "pre-ln-qknorm": "QK-norm removes the attention-logit growth (largest |q·k|/√d {pre-ln-qknorm.attention} against "
                     "Pre-LN's {pre-ln.attention}, where {pre-ln:summaries/checked/attention/collapsed|.0%} of rows "
                     "collapse), as Wortsman et al. and Dehghani et al. report; its lower LR sensitivity is not "
                     "reproduced: every rung ends near the best at this scale (lr 1e-3, 1e-2, 0.1: "
                     "{pre-ln-qknorm:summaries/checked/lr_sensitivity/points/0.001|.2f}, "
                     "{pre-ln-qknorm:summaries/checked/lr_sensitivity/points/0.01|.2f}, "
                     "{pre-ln-qknorm:summaries/checked/lr_sensitivity/points/0.1|.2f} nats), and it is more "
                     "sensitive than Pre-LN ({pre-ln-qknorm.lr_sensitivity} against {pre-ln.lr_sensitivity})",
    "olmo2": "passes everything but growth at initialisation (warn only) and gradient spread ({olmo2.grad_spread} "
             "against {pre-ln.grad_spread} and {peri-ln.grad_spread}: warns, a margin of 2 sd over seeds, "
             "{olmo2.grad_spread#warn} in this run); attention logits {olmo2.attention} against {pre-ln.attention}; "
             "the z-loss (1e-5) does not move log Z in 30 steps ({olmo2.log_z} against {pre-ln.log_z} and "
             "{peri-ln.log_z})",
    "deepnorm": "disagrees: at 4 layers DeepNorm's α = (2N)^¼ = 1.68 and β initialisation barely change Post-LN, and "
                "its gradient spread at lr {deepnorm:summaries/checked/grad_spread/lr} ({deepnorm.grad_spread}) is "
                "Post-LN's ({post-ln.grad_spread}); DeepNet's evidence is at 18–1,000 layers, where the "
                "up-weighting matters; the check cannot tell the two apart at its default depth, nor at 16 "
                "or 18 layers (supplements depth16 and deep-regime), where DeepNorm also trains as Post-LN does",
    "rezero": "disagrees: {rezero:summaries/checked/diverged} runs diverge, both at lr "
              "{rezero:summaries/checked/first_bad/0/lr} (non-finite gradients at steps "
              "{rezero:summaries/checked/first_bad/0/step} and {rezero:summaries/checked/first_bad/1/step}), where "
              "both normalised references train; Bachlechner et al. train deep ReZero Transformers without warm-up "
              "at their own learning rate (not re-read), none reported at 0.1, so the check's verdict is about the "
              "ladder's top rung; at lr 1e-3 its gates, 0 at initialisation, barely move in 30 steps "
              "({rezero:summaries/checked/lr_sensitivity/points/0.001|.2f} from "
              "{rezero:summaries/checked/lr_sensitivity/initial|.2f} nats), hence also its LR-sensitivity warning; "
              "at 18 layers and 5e-4 and 1e-3 without warmup (supplement deep-regime) it trains and the card warns, "
              "which agrees",
    "layerscale": "largest |x| {layerscale.overflow}, beyond half of fp16's maximum (higher than Pre-LN's "
                  "{pre-ln.overflow})",
    "dyt-pre": "grows faster than Pre-LN after training ({dyt-pre.growth_trained} against {pre-ln.growth_trained}: it "
               "failed on that before the change to growth_trained, see Thresholds) and learns worse at lr 1e-2 "
               "({dyt-pre:summaries/checked/lr_sensitivity/points/0.01|.2f} against "
               "{pre-ln:summaries/checked/lr_sensitivity/points/0.01|.2f} nats), hence its LR-sensitivity warning; it "
               "also warns on gradient spread ({dyt-pre.grad_spread} against {pre-ln.grad_spread} and "
               "{peri-ln.grad_spread}) and on its best loss ({dyt-pre.loss} against {pre-ln.loss} and "
               "{peri-ln.loss}); it never diverges",
    "gemma2-hf": "Theorem 4's bound holds with Gemma's 1 + weight gains ({gemma2-hf.bound} violations); its attention "
                 "logits grow less than the references' (largest uncapped |q·k|·scale {gemma2-hf.attention} at lr "
                 "{gemma2-hf:summaries/checked/attention/lr} against {pre-ln.attention} and {peri-ln.attention}) and "
                 "its soft-cap (50) bounds what the softmax sees, yet up to "
                 "{gemma2-hf:summaries/checked/attention/collapsed|.0%} of rows collapse; warns on LR sensitivity only "
                 "({gemma2-hf.lr_sensitivity}: lr 1e-3 ends at "
                 "{gemma2-hf:summaries/checked/lr_sensitivity/points/0.001|.2f} nats, its best rate at "
                 "{gemma2-hf.loss})",
}
THRESHOLD_CHANGES: list[str] = [
    "after the first run (commit cc7836f, 5 of 12 rows agreeing), two thresholds changed, every verdict re-run: "
    "(1) `attention` fails above max(1000, 10·max(pre, peri)) instead of 1000: at lr 0.1 both references reach "
    "~8e3 with 99 % of attention rows collapsed, so the absolute threshold failed Pre-LN and Peri-LN themselves "
    "(and every row without QK-norm); the check's rule is that failing means worse than both references",
    "(2) `growth_trained` warns only (its fail, faster than both references, removed): it failed no LN, which fails "
    "by divergence anyway, and DyT in Pre-LN position, which trains like LayerNorm (Zhu et al. 2025); growth's harm "
    "is its size, which `overflow` judges against the number formats' limits",
]
# Rows changed after their first run (the thresholds are not touched), each said with its reason and, for a change
# to a model, what the re-run was expected to give, committed before it ran.
ROW_CHANGES: list[str] = [
    "the citations, given as recalled when the sets were fixed, were re-read on 2026-12-03 against stored copies of "
    "the papers and corrected where they were wrong: DeepNet's Fig. 1 is a chart of model depths (its Post-LN "
    "instability is §3); Liu et al. 2020's Fig. 1 (Admin) is about depth, with warm-up, so the warm-up evidence is "
    "now RAdam's Fig. 1 (Liu et al. 2020a); Sun et al. 2024 report massive activations as a few fixed, near-constant "
    "dimensions, not as growth over depth or an fp16 overflow, so Pre-LN's outcome now cites Kim et al.'s variance "
    "growth for its growth and no longer claims an fp16 overflow; Wortsman et al.'s output-logit divergence is "
    "§3.1.2, not §3.2; ReZero's, CaiT's, DyT's, Peri-LN's, CogView's, RMSNorm's, LLaMA's and OLMo 2's locations and "
    "wordings are narrowed to what was re-read, the rest marked 'not re-read'; no implied verdict changed",
    "OLMo 2 trained with a z-loss of 1e-5 (OLMo-core's OLMo2-7B training script; alphaXiv's summary of the paper), "
    "not PaLM's 1e-4, which the olmo2 row had: the row now trains with 1e-5, the only change to a model; predicted "
    "before its re-run: WARN as before, on "
    "growth at initialisation and gradient spread, with log Z where the 1e-4 run left it (that z-loss did not move "
    "it in 30 steps), so the agreement stays 10 of 12; result, on the AMX Xeon that re-ran both sets: as predicted, "
    "WARN on the same two criteria, log Z within 0.1 nats of a 1e-4 run's on the same machine, 10 of 12",
    "the Hugging Face rows (gemma2-hf here; llama-hf and olmo2-hf held out) are built from configs with "
    "pad_token_id 0, and the protocol vocabulary relabels a real token to 0, so until 2026-12-03 that token had "
    "the zero, frozen embedding row of nn.Embedding's padding_idx (the windows hold no padding); the check now "
    "clears pad_token_id for a fresh initialisation and padding_idx for every model, a change to those three "
    "models; predicted before the re-run: every verdict as before (gemma2-hf WARN on LR sensitivity alone, llama-hf "
    "and olmo2-hf WARN), measurements of those rows moving in the second or third digit, 10 of 12 and 8 of 8; "
    "result, on the AMX Xeon: every verdict as predicted, 10 of 12 and 8 of 8, but some measurements moved more than "
    "predicted: gemma2-hf's largest attention logit by about a fifth (3.6e3 to 4.4e3) and its LR sensitivity from "
    "0.12 to 0.13, still its only warning; llama-hf's LR sensitivity fell from 0.092 to 0.074, just under its "
    "warning (0.0745), which it crossed the other way in an earlier run, so it passes there now and the row warns on "
    "growth after training, overflow, the Jacobian slope and gradient spread; olmo2-hf as before",
]
SUPPLEMENT_NOTES: dict[str, str] = {
    "depth16": "The prediction's second branch came out: at 16 layers both still train like the references in 30 "
               "steps (final loss {post-ln.loss} and {deepnorm.loss} nats against {post-ln.loss@pre-ln} and "
               "{post-ln.loss@peri-ln}, no run diverges), and both spread their gradients over "
               "{deepnorm.grad_spread|decades}–{post-ln.grad_spread|decades} decades at lr "
               "{post-ln:summaries/checked/grad_spread/lr} (Post-LN {post-ln.grad_spread}, DeepNorm "
               "{deepnorm.grad_spread}; the references {post-ln.grad_spread@pre-ln} and "
               "{post-ln.grad_spread@peri-ln}). DeepNorm narrows the spread by "
               "{post-ln.grad_spread/deepnorm.grad_spread|decades} decades and still fails by "
               "{deepnorm.grad_spread/deepnorm.grad_spread#fail|decades}. The criterion, not the depth, misjudges "
               "DeepNorm: gradient spread at the top rung sees "
               "Post-LN's mechanism in both and, at 4 and at 16 layers, foretells no loss failure in either; the "
               "Post-LN row agrees on that mechanism only.",
    "seeds-rungs": "Its ladder, chosen for being off every default rung, is also the range over which Wortsman et "
                   "al. 2023 take their LR sensitivity (3e-4 to 3e-1). One row fewer than the default run, and a "
                   "prediction that failed: DyT in Pre-LN position fails on `log_z` ({dyt-pre.log_z} at lr "
                   "{dyt-pre:summaries/checked/log_z/lr}, beyond the fixed {dyt-pre.log_z#fail}, where the "
                   "references reach {dyt-pre.log_z@pre-ln} and {dyt-pre.log_z@peri-ln}; "
                   "{dyt-pre:summaries/checked/log_z/events} logit_drift events) and learns worst at its best rate "
                   "({dyt-pre.loss} nats against {dyt-pre.loss@pre-ln} and {dyt-pre.loss@peri-ln}). `log_z` fails "
                   "above an absolute {dyt-pre.log_z#fail} that the references themselves approach on a wider "
                   "ladder, as `attention`'s absolute threshold did before its change; it is reported here, not "
                   "changed. ReZero (divergence, lr {rezero:summaries/checked/first_bad/0/lr}) and DeepNorm "
                   "(gradient spread) fail as predicted; no LN diverges from lr "
                   "{no-ln:summaries/checked/first_bad/0/lr} ({no-ln:summaries/checked/diverged} of "
                   "{no-ln:summaries/checked/runs} runs). The other nine keep their verdicts; at lr 0.3 Pre-LN's "
                   "largest |x| reaches {pre-ln.overflow}, {pre-ln.overflow/65504|times} times fp16's maximum "
                   "(Peri-LN's: {peri-ln.overflow}), "
                   "so its warning now includes an fp16 overflow, which the default ladder does not reach.",
    "deep-regime": "Two of three rows agree, and the predictions held. ReZero agrees: no run diverges at these "
                   "rates, and the card warns (LR sensitivity, growth after training, Jacobian slope, loss: its "
                   "gates start at 0 and it ends behind the references, {rezero.loss} against "
                   "{rezero.loss@pre-ln} and {rezero.loss@peri-ln}), so its failure in the default run is the "
                   "ladder's top rung (0.1), a rate its source does not use. Post-LN fails on gradient spread "
                   "({post-ln.grad_spread} at lr {post-ln:summaries/checked/grad_spread/lr}, against the references' "
                   "{post-ln.grad_spread@pre-ln} and {post-ln.grad_spread@peri-ln}) and, without warmup, trains "
                   "behind Pre-LN ({post-ln.loss} against {post-ln.loss@pre-ln}; Peri-LN {post-ln.loss@peri-ln}), "
                   "so the loss criterion warns too; no run diverges (gradient clipping at 1 is kept). DeepNorm took "
                   "the prediction's first branch: it fails on gradient spread ({deepnorm.grad_spread}, narrower "
                   "than Post-LN's) and its loss is Post-LN's ({deepnorm.loss} against {post-ln.loss}), not the "
                   "references'. So the prediction's last clause (DeepNorm failing while training like the "
                   "references) did not arise, and gradient spread is not refuted by this run: at 18 layers × 128 "
                   "wide and 120 steps, DeepNet's α = 2.45 and β = 0.29 do not change how Post-LN trains. In all "
                   "three regimes tried (4, 16 and 18 layers; warmup 3 and 0) DeepNorm trains as Post-LN does, in "
                   "loss and in mechanism; the sources' difference (Post-LN failing where DeepNorm trains) does not "
                   "show at this width and length.",
    "no-clip": "The prediction's likelier branch: both fail again, on gradient spread alone (Post-LN "
               "{post-ln.grad_spread}, DeepNorm {deepnorm.grad_spread} at lr "
               "{deepnorm:summaries/checked/grad_spread/lr}; the references {post-ln.grad_spread@pre-ln} and "
               "{post-ln.grad_spread@peri-ln}), no run diverges, and the two end alike ({post-ln.loss} and "
               "{deepnorm.loss} nats). Their final losses are deep-regime's to 0.01 nats, so clipping at 1 barely "
               "touched them there; it is the references that lose without it (Pre-LN {post-ln.loss@pre-ln}, "
               "Peri-LN {post-ln.loss@peri-ln}, both behind their deep-regime losses), which is why Post-LN's loss "
               "no longer trails by enough to warn. Clipping did not hide the difference the sources report: "
               "without it, as with it, DeepNorm trains as Post-LN does at 18 × 128 and 120 steps.",
    "no-warmup-6": "As predicted: both fail on gradient spread alone (Post-LN {post-ln.grad_spread}, DeepNorm "
                   "{deepnorm.grad_spread} at lr {post-ln:summaries/checked/grad_spread/lr}; the references "
                   "{post-ln.grad_spread@pre-ln} and {post-ln.grad_spread@peri-ln}), no run diverges, and without "
                   "warmup both end behind Pre-LN ({post-ln.loss} and {deepnorm.loss} nats against "
                   "{post-ln.loss@pre-ln}; Peri-LN {post-ln.loss@peri-ln}), so the loss criterion warns: Xiong et "
                   "al.'s Post-LN without warmup, trailing in loss as they report, at 6 × 128 and 120 steps.",
    "long-warmup-6": "The prediction's likelier branch, and a disagreement: with the warmup Post-LN fails on gradient "
                     "spread as without it ({post-ln.grad_spread} at lr {post-ln:summaries/checked/grad_spread/lr}, "
                     "within 0.1 decades of no-warmup-6's; the references {post-ln.grad_spread@pre-ln} and "
                     "{post-ln.grad_spread@peri-ln}), and it still ends behind Pre-LN ({post-ln.loss} nats against "
                     "{post-ln.loss@pre-ln}; Peri-LN {post-ln.loss@peri-ln}): the gap to Pre-LN is 0.37 nats with "
                     "the warmup and 0.33 without. At 6 × 128 and 120 steps a warmup of 2/(1 − β₂) neither narrows "
                     "the spread nor closes the gap, so the card has nothing to credit, and the sources' Post-LN "
                     "that trains with a warmup does not show at this length either. The check judges Post-LN by a "
                     "mechanism that the recipe does not remove: a Post-LN design trained with a long warmup is "
                     "failed too, against its published outcome, and the main set's Post-LN row agrees on the "
                     "mechanism, not the recipe. DeepNorm again as Post-LN (spread {deepnorm.grad_spread}, loss "
                     "{deepnorm.loss}).",
}

PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_CRITERION = re.compile(r"(?P<row>[\w.-]+?)\.(?P<cid>[a-z_]+)(?:@(?P<ref>[\w-]+)|#(?P<level>warn|fail))?")
_PATH = re.compile(r"(?P<row>[\w.-]+):(?P<path>[^|]+)(?:\|(?P<fmt>.+))?")
_RATIO = re.compile(r"(?P<a>[^/|:]+)(?:/(?P<b>[^/|:]+))?\|(?P<fmt>decades|times)")


class NoteError(ValueError):
    """A placeholder of a note that the run's cards cannot fill."""


def number(value: float, digits: int = 2) -> str:
    """A quoted number: ``8.2e3`` from 1000 up, a whole number from 100, else ``digits`` significant digits."""
    if not math.isfinite(value):
        return "n/a"
    if abs(value) >= 1000:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def display(cid: str, value: float | None) -> str:
    """A criterion's value as the card reads it: spreads and growth as factors, losses in nats to 0.01."""
    if value is None or not math.isfinite(value):
        return "n/a"
    if cid in FACTOR_BASES:
        return "×" + number(as_factor(cid, value))
    if cid == "loss":
        return f"{value:.2f}"
    if cid == "sensitivity":
        return f"{value:+.2f}".replace("-", "−")
    if cid == "bound":
        return f"{value:.0f}"
    if cid == "divergence":
        return f"{value:.0%}"
    return number(value, 3 if cid == "log_z" else 2)


def _criterion(match: re.Match[str], cards: dict[str, dict[str, Any]]) -> float | None:
    """The value a ``row.criterion[@reference|#level]`` placeholder names, in the card's units."""
    card = _card(match["row"], cards)
    found = [c for c in card["criteria"] if c["id"] == match["cid"]]
    if not found:
        raise NoteError(f"no criterion {match['cid']!r} on the card of {match['row']}")
    item = found[0]
    if match["ref"]:
        if match["ref"] not in item["references"]:
            raise NoteError(f"no reference {match['ref']!r} (have: {', '.join(item['references'])})")
        return item["references"][match["ref"]]
    return item[match["level"]] if match["level"] else item["measured"]


def _card(row: str, cards: dict[str, dict[str, Any]]) -> dict[str, Any]:
    card = cards.get(row)
    if card is None:
        raise NoteError(f"no card for row {row!r} (have: {', '.join(cards)})")
    return card


def _operand(text: str, cards: dict[str, dict[str, Any]]) -> float:
    """A ratio's operand: a criterion placeholder's value as the card reads it (a factor for spreads and growth),
    or a number (``65504``)."""
    match = _CRITERION.fullmatch(text.strip())
    if match is None:
        try:
            return float(text)
        except ValueError:
            raise NoteError(f"{text.strip()!r} is neither row.criterion[@reference|#warn|#fail] nor a number") from None
    value = _criterion(match, cards)
    if value is None or not math.isfinite(value):
        raise NoteError(f"{text.strip()} is not a finite number")
    return as_factor(match["cid"], value) if match["cid"] in FACTOR_BASES else value


def _ratio(match: re.Match[str], cards: dict[str, dict[str, Any]]) -> str:
    """``a/b|times`` (the ratio, as :func:`number` quotes it) or ``a/b|decades``, ``a|decades`` (its log10, to the
    nearest whole decade)."""
    below = _operand(match["b"], cards) if match["b"] else 1.0
    if below == 0:
        raise NoteError(f"{match[0]} divides by 0")
    value = _operand(match["a"], cards) / below
    if match["fmt"] == "times":
        return number(value)
    if value <= 0:
        raise NoteError(f"{match[0]} has no decades: the ratio is {value}")
    return f"{math.log10(value):.0f}"


def _fill(text: str, cards: dict[str, dict[str, Any]]) -> str:
    ratio = _RATIO.fullmatch(text)
    if ratio:
        return _ratio(ratio, cards)
    criterion = _CRITERION.fullmatch(text) if ":" not in text else None
    match = criterion or _PATH.fullmatch(text)
    if not match:
        raise NoteError("neither row.criterion[@reference|#warn|#fail], row:path[|format] nor a[/b]|decades|times")
    if criterion:
        return display(match["cid"], _criterion(criterion, cards))
    card = _card(match["row"], cards)
    value: Any = card
    for key in match["path"].split("/"):
        try:
            # a card in memory keys its ladder by float (0.001), its report.json by string: match by the string
            value = value[int(key)] if isinstance(value, list) else next(v for k, v in value.items() if str(k) == key)
        except (StopIteration, IndexError, ValueError, TypeError, AttributeError):
            raise NoteError(f"the card of {match['row']} has no {match['path']!r} (at {key!r})") from None
    if match["fmt"]:
        return format(value, match["fmt"])
    return number(value) if isinstance(value, float) else str(value)


def render(note: str, cards: dict[str, dict[str, Any]]) -> str:
    """``note`` with every placeholder filled from ``cards`` (row id → card, as ``report.json`` holds it).

    Raises:
        NoteError: A placeholder names a row, criterion, reference or key the cards do not have; the message quotes
            the placeholder.
    """

    def fill(match: re.Match[str]) -> str:
        try:
            return _fill(match[1], cards)
        except NoteError as exc:
            raise NoteError(f"note placeholder {match[0]}: {exc}") from None

    return PLACEHOLDER.sub(fill, note)
