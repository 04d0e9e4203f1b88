"""What the validation README says beyond the numbers, written after a run: why a row disagrees (:data:`NOTES`, by
row id) and any threshold changed after the set was first run (:data:`THRESHOLD_CHANGES`, each with its reason; every
verdict is then re-run). Kept apart from :mod:`lnstab.check.validation`, whose history shows the expected verdicts
fixed before the run.
"""

NOTES: dict[str, str] = {
    "post-ln": "agrees on the mechanism, not on the loss: its per-layer gradient norms span ×2.1e6 at lr 0.1 "
               "(Xiong et al.'s and Liu et al.'s gradient pathology), but at 4 layers and 30 steps it learns as well "
               "as Pre-LN (7.03 against 7.04 nats)",
    "no-ln": "3 of 6 runs diverge (lr 1e-2 seed 1, lr 0.1 both seeds), and |mean log Z| reaches 122 (two "
             "logit_drift events)",
    "pre-ln": "warns on growth after training (×4.0 over the deeper half, exponential fit) and the Jacobian slope "
              "(−0.24: sensitivity that does not fall with scale); its largest |x| 3.1e4 is just under half of fp16's "
              "maximum, so the overflow the literature reports passes at this scale",
    "pre-ln-qknorm": "QK-norm removes the attention-logit growth (largest |q·k|/√d 11 against Pre-LN's 8.2e3, where "
                     "99 % of rows collapse), as Wortsman et al. and Dehghani et al. report; its lower LR sensitivity "
                     "is not reproduced: every rung ends within 0.07 nats of the best at this scale (0.027 against "
                     "0.009)",
    "olmo2": "passes everything but growth at initialisation (warn only) and gradient spread (×4.6 against ×2.3 "
             "and ×1.5: warns, a margin of 2 sd over seeds, ×3.2 in this run); attention logits 10 against 8e3; the "
             "z-loss (1e-4) does not move log Z in 30 steps (12.1 against 11.3–11.9)",
    "deepnorm": "disagrees: at 4 layers DeepNorm's α = (2N)^¼ = 1.68 and β initialisation barely change Post-LN, and "
                "its gradient spread at lr 0.1 (×4.6e6) is Post-LN's (×2.1e6); DeepNet's evidence is at 18–1,000 "
                "layers with a long warmup, where the up-weighting matters; the check cannot tell the two apart at "
                "its default depth, nor at 16 or 18 layers (supplements depth16 and deep-regime), where DeepNorm "
                "also trains as Post-LN does",
    "rezero": "disagrees: both runs at lr 0.1 diverge (non-finite gradients at steps 3 and 6), where both "
              "normalised references train; Bachlechner et al. report deep ReZero Transformers at ordinary learning "
              "rates, not at 0.1 after a 3-step warmup, so the check's verdict is about the ladder's top rung; at "
              "lr 1e-3 its gates, 0 at initialisation, barely move in 30 steps (8.24 from 8.27 nats), hence also its "
              "LR-sensitivity warning; at 18 layers and 5e-4 and 1e-3 without warmup (supplement deep-regime) it "
              "trains and the card warns, which agrees",
    "layerscale": "largest |x| 3.9e4, beyond half of fp16's maximum (higher than Pre-LN's 3.1e4)",
    "dyt-pre": "grows faster than Pre-LN after training (×7.3 against ×4.0: it failed on that before the change "
               "to growth_trained, see Thresholds) and learns worse at lr 1e-2 (7.74 against 7.07 nats), hence its "
               "LR-sensitivity warning; it also warns on gradient spread (×4.3 against ×2.3 and ×1.5) and on its best "
               "loss (7.08 against 7.04 and 7.05); it never diverges",
    "gemma2-hf": "Theorem 4's bound holds with Gemma's 1 + weight gains (0 violations); its attention logits grow "
                 "less than the references' (largest uncapped |q·k|·scale 3.7e3 at lr 0.1 against 8.2e3 and 8.1e3) "
                 "and its soft-cap (50) bounds what the softmax sees, yet up to 33 % of rows collapse; warns on LR "
                 "sensitivity only (0.12: lr 1e-3 lags by 0.32 nats)",
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
SUPPLEMENT_NOTES: dict[str, str] = {
    "depth16": "The prediction's second branch came out: at 16 layers both still train like the references in 30 "
               "steps (final loss 7.06 and 7.03 nats against 6.97 and 7.01, no run diverges), and both spread their "
               "gradients over 16–20 decades at lr 0.1 (Post-LN ×1.3e20, DeepNorm ×2.8e16; the references ×4.5 and "
               "×3.0). DeepNorm narrows the spread by four decades and still fails by fourteen. The criterion, not "
               "the depth, misjudges DeepNorm: gradient spread at the top rung sees Post-LN's mechanism in both and, "
               "at 4 and at 16 layers, foretells no loss failure in either; the Post-LN row agrees on that mechanism "
               "only.",
    "seeds-rungs": "Its ladder, chosen for being off every default rung, is also the range over which Wortsman et "
                   "al. 2023 take their LR sensitivity (3e-4 to 3e-1). One row fewer than the default run, and a "
                   "prediction that failed: DyT in Pre-LN position fails "
                   "on `log_z` (35.7 at lr 0.3, beyond the fixed 30, where the references reach 19.3 and 18.2; two "
                   "logit_drift events) and learns worst at its best rate (7.25 nats against 6.86 and 6.99). "
                   "`log_z` fails above an absolute 30 that the references themselves approach on a wider ladder, "
                   "as `attention`'s absolute threshold did before its change; it is reported here, not changed. "
                   "ReZero (divergence, lr 0.3) and DeepNorm (gradient spread) fail as predicted; no LN diverges "
                   "from lr 0.03 (4 of 8 runs). The other nine keep their verdicts; at lr 0.3 Pre-LN's largest |x| "
                   "reaches 2.65e5, four times fp16's maximum (Peri-LN's: 112), so its warning now includes the "
                   "fp16 overflow the literature reports, which the default ladder does not reach.",
    "deep-regime": "Two of three rows agree, and the predictions held. ReZero agrees: no run diverges at these "
                   "rates, and the card warns (LR sensitivity, growth after training, Jacobian slope, loss: its "
                   "gates start at 0 and it ends 0.10–0.25 nats behind the references, 7.41 against 7.16 and "
                   "7.31), so its failure in the default run is the ladder's top rung (0.1), a rate its source does "
                   "not use. Post-LN fails on gradient spread (×1.7e7 at lr 1e-3, against the references' ×15 and "
                   "×3.9) and, without warmup, trains 0.2 nats behind Pre-LN (7.36 against 7.16; Peri-LN 7.31), so "
                   "the loss criterion warns too; no run diverges (gradient clipping at 1 is kept). DeepNorm took "
                   "the prediction's first branch: it fails on gradient spread (×8.1e4, 2.3 decades narrower than "
                   "Post-LN's) and its loss is Post-LN's (7.37 against 7.36), not the references'. So the "
                   "prediction's last clause (DeepNorm failing while training like the references) did not arise, "
                   "and gradient spread is not refuted by this run: at 18 layers × 128 wide and 120 steps, "
                   "DeepNet's α = 2.45 and β = 0.29 do not change how Post-LN trains. In all three regimes tried "
                   "(4, 16 and 18 layers; warmup 3 and 0) DeepNorm trains as Post-LN does, in loss and in "
                   "mechanism; the sources' difference (Post-LN failing where DeepNorm trains) does not show at "
                   "this width and length.",
}
