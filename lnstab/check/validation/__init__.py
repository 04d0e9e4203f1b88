"""The validation of ``lnstab check`` against the published record: its data (``rows.yaml``, ``heldout.yaml``,
``supplements.yaml``: designs, published outcomes, the verdicts they imply, fixed before a run; ``notes.yaml`` and
``changes.yaml``: what was written after), read by :mod:`.sets`; the Hugging Face families its rows build
(:mod:`.families`); ``lnstab check --validate`` (:mod:`.run`); its READMEs rendered from a run record
(:mod:`.readme`, from ``readme.md`` and ``sections.md``), their notes' placeholders (:mod:`.notes`).
"""

from lnstab.check.validation.families import HF_FAMILIES
from lnstab.check.validation.sets import (
    DEFAULT_SHAPE,
    HELDOUT,
    HELDOUT_PREDICTION,
    ROWS,
    STABLE,
    SUPPLEMENT_IDS,
    SUPPLEMENTS,
    Row,
    Supplement,
    supplement_argv,
    supplement_rows,
)

__all__ = ["DEFAULT_SHAPE", "HELDOUT", "HELDOUT_PREDICTION", "HF_FAMILIES", "ROWS", "STABLE", "SUPPLEMENT_IDS",
           "SUPPLEMENTS", "Row", "Supplement", "supplement_argv", "supplement_rows"]
