"""How lnstab writes numbers into its tables: one home for ``lnstab report``'s Markdown and ``lnstab check``'s cards.

Two conventions, each written once. The report's cells keep four significant digits and show a missing value as
``–``; the check's cards keep three, show a value that is not finite as ``n/a`` and whole numbers as such (in their
sentences: :func:`card_short`, and :func:`card_quote` for a value the card displays). Plain
Python: the check's parent imports it without Lightning.
"""

from __future__ import annotations

import math
from typing import Any

DASH = "–"  # a cell without a value
NA = "n/a"  # a card's value that is not finite


def cell(text: Any) -> str:
    """Text for a Markdown table cell (pipes escaped, e.g. in ``|x|``)."""
    return str(text).replace("|", "\\|")


def text(value: Any) -> str:
    """``value`` as text, ``–`` for ``None``."""
    return DASH if value is None else str(value)


def number(value: float | None, digits: int = 4, *, blank_nan: bool = False) -> str:
    """A report cell: ``value`` to ``digits`` significant digits, ``–`` for ``None`` (and for NaN with
    ``blank_nan``)."""
    if value is None or (blank_nan and isinstance(value, float) and math.isnan(value)):
        return DASH
    return f"{value:.{digits}g}"


def mean_pm(mean: float, std: float) -> str:
    """``mean ± std`` (``–`` without data, the mean alone for one run)."""
    if math.isnan(mean):
        return DASH
    return f"{mean:.4g}" if math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def interval(low: float, high: float) -> str:
    """``[low, high]`` to three significant digits (``–`` for an interval that is not defined)."""
    return DASH if math.isnan(low) else f"[{low:.3g}, {high:.3g}]"


def card_number(value: Any) -> str:
    """A card's table cell: ``–`` for ``None``, ``n/a`` for a float that is not finite, a whole float below 1e6 as an
    integer, any other float to three significant digits, anything else as text."""
    if value is None:
        return DASH
    if isinstance(value, float) and not math.isfinite(value):
        return NA
    if isinstance(value, float) and value == int(value) and abs(value) < 1e6:
        return f"{int(value)}"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def card_short(value: float | None, digits: int = 3) -> str:
    """A number in a card's sentence: ``digits`` significant digits, ``n/a`` for ``None`` or a value not finite."""
    if value is None or not math.isfinite(value):
        return NA
    return f"{value:.{digits}g}"


def card_quote(value: float, digits: int = 2) -> str:
    """A value as the card displays it: ``8.2e3`` from 1000 up, a whole number from 100, else ``digits`` significant
    digits (``n/a`` for a value not finite)."""
    if not math.isfinite(value):
        return NA
    if abs(value) >= 1000:
        mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"
