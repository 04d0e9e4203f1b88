"""The validation of ``lnstab check`` against the published record (``lnstab check --validate``): its files, data and
code, are listed in ARCHITECTURE.md (``lnstab/check/``, file by file)."""

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
    checked_supplement,
    supplement_rows,
)

__all__ = ["DEFAULT_SHAPE", "HELDOUT", "HELDOUT_PREDICTION", "HF_FAMILIES", "ROWS", "STABLE", "SUPPLEMENT_IDS",
           "SUPPLEMENTS", "Row", "Supplement", "checked_supplement", "supplement_rows"]
