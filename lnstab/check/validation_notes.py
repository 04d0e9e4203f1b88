"""What the validation README says beyond the numbers, written after a run: why a row disagrees (:data:`NOTES`, by
row id) and any threshold changed after the set was first run (:data:`THRESHOLD_CHANGES`, each with its reason; every
verdict is then re-run). Kept apart from :mod:`lnstab.check.validation`, whose history shows the expected verdicts
fixed before the run.
"""

NOTES: dict[str, str] = {}
THRESHOLD_CHANGES: list[str] = []
