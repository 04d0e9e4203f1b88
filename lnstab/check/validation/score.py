"""How a validation run is scored (issue 39): the agreement over the rows whose source reached the outcome at the
run's tier and reports it, beside the best verdict a card that never looked at the model could give on the same rows,
with a 95 % Wilson score interval, so that "10 of 12" is read with its uncertainty and its baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lnstab.check.validation.sets import Row

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval
CONSTANTS = ("warn", "pass", "fail")  # the constant verdicts, in the order a tie is resolved


def wilson(agree: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``agree`` of ``n`` (Wilson 1927; what
    ``scipy.stats.binomtest(agree, n).proportion_ci(method="wilson")`` gives).

    Raises:
        ValueError: ``n`` is not positive or ``agree`` is not within 0…``n``.
    """
    if n <= 0 or not 0 <= agree <= n:
        raise ValueError(f"wilson: agree={agree}, n={n}; 0 <= agree <= n and n > 0 are allowed")
    p, z2 = agree / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def constant_counts(rows: list[Row]) -> dict[str, int]:
    """How many of ``rows`` each constant verdict agrees with."""
    return {v: sum(v in r.expected for r in rows) for v in CONSTANTS}


def best_constant(rows: list[Row]) -> tuple[str, int]:
    """The constant verdict that agrees with the most of ``rows`` (ties: WARN, then PASS, then FAIL) and its count."""
    counts = constant_counts(rows)
    best = max(CONSTANTS, key=lambda v: counts[v])
    return best, counts[best]


@dataclass(frozen=True)
class Score:
    """The headline of one run at one tier.

    Attributes:
        tier: The tier the rows' reachability is read at.
        scored: The rows reachable at ``tier`` and reported, in the run's order.
        agree: How many of ``scored`` the cards agree with.
        interval: The 95 % Wilson interval of ``agree / len(scored)`` (``None`` when nothing is scored).
        baseline: The best constant verdict on ``scored`` and its count.
        left_out: The other rows, each with why (``not reachable``, ``implied``, or both).
    """

    tier: str
    scored: tuple[Row, ...]
    agree: int
    interval: tuple[float, float] | None
    baseline: tuple[str, int]
    left_out: tuple[tuple[Row, str], ...]


def why_left_out(row: Row, tier: str) -> str:
    """``not reachable``, ``implied`` or both (``""`` for a row that is scored)."""
    return " and ".join(w for w, off in (("not reachable", tier not in row.reachable),
                                         ("implied", row.reported is not True)) if off)


def score(rows: list[Row], cards: list[str], tier: str) -> Score:
    """The agreement of the cards' verdicts (``pass``, ``warn``, ``fail``, in ``rows``' order) over the rows
    reachable at ``tier`` and reported, with its interval and the best constant verdict on the same rows."""
    pairs = [(r, c) for r, c in zip(rows, cards, strict=True) if r.scored(tier)]
    agree = sum(c in r.expected for r, c in pairs)
    scored = [r for r, _ in pairs]
    return Score(tier, tuple(scored), agree, wilson(agree, len(scored)) if scored else None, best_constant(scored),
                 tuple((r, why_left_out(r, tier)) for r in rows if not r.scored(tier)))
