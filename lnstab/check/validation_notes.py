"""What the validation README says beyond the numbers, written after a run: why a row disagrees (:data:`NOTES`, by
row id) and any threshold changed after the set was first run (:data:`THRESHOLD_CHANGES`, each with its reason; every
verdict is then re-run). Kept apart from :mod:`lnstab.check.validation`, whose history shows the expected verdicts
fixed before the run.
"""

NOTES: dict[str, str] = {}
THRESHOLD_CHANGES: list[str] = [
    "after the first run (commit cc7836f, 5 of 12 rows agreeing), two thresholds changed, every verdict re-run: "
    "(1) `attention` fails above max(1000, 10·max(pre, peri)) instead of 1000: at lr 0.1 both references reach "
    "~8e3 with 99 % of attention rows collapsed, so the absolute threshold failed Pre-LN and Peri-LN themselves "
    "(and every row without QK-norm); the check's rule is that failing means worse than both references",
    "(2) `growth_trained` warns only (its fail, faster than both references, removed): it failed no LN, which fails "
    "by divergence anyway, and DyT in Pre-LN position, which trains like LayerNorm (Zhu et al. 2025); growth's harm "
    "is its size, which `overflow` judges against the number formats' limits",
]
