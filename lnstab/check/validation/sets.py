"""The validation set, the held-out set and the supplements, read from this package's YAML files (``rows.yaml``,
``heldout.yaml``, ``supplements.yaml``, whose headers say what each field means): the rows and what their published
outcomes imply, fixed before a run, so that ``git log`` on those files is the record of what was fixed when.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lnstab.check.protocol import TIERS  # lnstab check --tier: what a row's `reachable` is said for
from lnstab.check.validation.families import HF_FAMILIES
from lnstab.errors import LNStabError
from lnstab.safeload import DataFileError, load_yaml

HERE = Path(__file__).parent
DEFAULT_SHAPE = ("--model.preset", "mini", "--model.block_size", "128")
STABLE = ("pass", "warn")
STATUSES = ("pass", "warn", "fail")
HF_NAMES = tuple(HF_FAMILIES)  # a tuple: an unhashable hf (a list) is refused, not a TypeError
REACH_KEYS = ("reachable", "reported", "reach_note")


@dataclass(frozen=True)
class Row:
    """One architecture of the validation set.

    Attributes:
        id: Short name (its card's directory).
        design: The design in words.
        model: ``--model.KEY VALUE`` arguments beyond the default shape (lnstab's family), or ``()`` with ``hf``.
        outcome: The published outcome, one line.
        source: Paper and table / figure / section.
        expected: The verdicts that outcome implies (lower case card statuses).
        hf: A Hugging Face family (a key of ``families.HF_FAMILIES``) built at the default shape, or ``None``.
        reachable: The tiers (``quick``, ``proxy``) within whose depth, steps, learning rates and precision the source
            reports the outcome.
        reported: Whether the source reports the outcome for this design (``False``: only implied); ``None`` for a
            supplement's row, which does not say.
        reach_note: Why, in one line (``None`` where ``reported`` is).
    """

    id: str
    design: str
    model: tuple[str, ...]
    outcome: str
    source: str
    expected: tuple[str, ...]
    hf: str | None = None
    reachable: tuple[str, ...] = ()
    reported: bool | None = None
    reach_note: str | None = None

    def scored(self, tier: str) -> bool:
        """Whether the row counts in the headline agreement at ``tier``: reachable there and reported."""
        return tier in self.reachable and self.reported is True


@dataclass(frozen=True)
class Supplement:
    """A re-run of (some of) the validation set under other arguments, with its question and prediction, both fixed
    before it first ran. Its expected verdicts are the rows' own, but for the rows in ``rows``: the same designs
    with the outcome the literature reports under this protocol.

    Attributes:
        id: Directory under ``<out>/supplements/``.
        args: ``lnstab check --validate`` arguments beyond the data (shape or protocol).
        question: What the re-run asks.
        prediction: What was expected of it before it ran.
        rows: Rows whose published outcome differs under this protocol (replacing the set's rows of the same id).
    """

    id: str
    args: tuple[str, ...]
    question: str
    prediction: str
    rows: tuple[Row, ...] = ()


def model_flags(model: dict[str, Any]) -> list[str]:
    """``{"a": 1, "b": True}`` as ``["--model.a", "1", "--model.b", "true"]``."""
    return [arg for k, v in model.items()
            for arg in (f"--model.{k}", str(v).lower() if isinstance(v, bool) else str(v))]


class _Fields:
    """Reads one mapping of a data file with only ``keys``, naming ``file: where.field`` in every refusal."""

    def __init__(self, data: Any, file: str, where: str, keys: tuple[str, ...]) -> None:
        if not isinstance(data, dict):
            raise DataFileError(f"{file}: {where} is {type(data).__name__}; a mapping is allowed")
        extra = [k for k in data if k not in keys]
        if extra:
            raise DataFileError(f"{file}: {where} has {extra[0]!r}; allowed: {', '.join(keys)}")
        self.data, self.file, self.where = data, file, where

    def bad(self, key: str, value: Any, allowed: str) -> DataFileError:
        return DataFileError(f"{self.file}: {self.where}.{key} is {value!r}; {allowed}")

    def text(self, key: str) -> str:
        value = self.data.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.bad(key, value, "a non-empty string is allowed")
        return value

    def strings(self, key: str, allowed: tuple[str, ...] | None = None) -> tuple[str, ...]:
        value = self.data.get(key)
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise self.bad(key, value, "a non-empty list of strings is allowed")
        odd = [v for v in value if allowed is not None and v not in allowed]
        if odd:
            raise self.bad(key, odd[0], f"allowed: {', '.join(allowed or ())}")
        return tuple(value)

    def flag(self, key: str) -> bool:
        value = self.data.get(key)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false is allowed")
        return value


def _reach(f: _Fields) -> tuple[tuple[str, ...], bool, str]:
    """A row's ``reachable`` (a mapping of every tier to true or false), ``reported`` and ``reach_note``."""
    value = f.data.get("reachable")
    if not isinstance(value, dict) or sorted(value) != sorted(TIERS) or not all(isinstance(v, bool)
                                                                               for v in value.values()):
        raise f.bad("reachable", value, f"a mapping of each tier ({', '.join(TIERS)}) to true or false is allowed")
    return tuple(t for t in TIERS if value[t]), f.flag("reported"), f.text("reach_note")


def _row(data: Any, file: str, where: str, reach: bool = True) -> Row:
    """One row; ``reach``: its ``reachable``, ``reported`` and ``reach_note`` are required (the two sets' rows),
    else refused (a supplement's)."""
    f = _Fields(data, file, where, ("id", "design", "model", "hf", "outcome", "source", "expected",
                                    *(REACH_KEYS if reach else ())))
    hf, model = f.data.get("hf"), f.data.get("model")
    if (hf is None) == (model is None):
        raise f.bad("model", model, "give either model (lnstab's family) or hf (a Hugging Face family), not both")
    if hf is not None and hf not in HF_NAMES:
        raise f.bad("hf", hf, f"allowed: {', '.join(HF_NAMES)}")
    if model is not None and (not isinstance(model, dict)
                              or not all(isinstance(v, str | int | float | bool) for v in model.values())):
        raise f.bad("model", model, "a mapping of --model options to values is allowed")
    said = (f.text("id"), f.text("design"), tuple(model_flags(model or {})), f.text("outcome"), f.text("source"),
            f.strings("expected", STATUSES), hf)
    return Row(*said, *(_reach(f) if reach else ()))


def _rows(data: Any, file: str, where: str, reach: bool = True) -> tuple[Row, ...]:
    if not isinstance(data, list) or not data:
        raise DataFileError(f"{file}: {where} is {data!r}; a non-empty list of rows is allowed")
    rows = tuple(_row(item, file, f"{where}[{i}]", reach) for i, item in enumerate(data))
    ids = [r.id for r in rows]
    twice = [i for i in ids if ids.count(i) > 1]
    if twice:
        raise DataFileError(f"{file}: {where} has row id {twice[0]!r} twice; each id is allowed once")
    return rows


def _top(name: str, keys: tuple[str, ...]) -> _Fields:
    return _Fields(load_yaml(HERE / name, name), name, "the file", keys)


def load_rows() -> tuple[Row, ...]:
    """The main set (``rows.yaml``).

    Raises:
        DataFileError: A field is missing or malformed; one line naming the file and the field.
    """
    return _rows(_top("rows.yaml", ("rows",)).data.get("rows"), "rows.yaml", "rows")


def load_heldout() -> tuple[tuple[Row, ...], str]:
    """The held-out set and its prediction (``heldout.yaml``)."""
    f = _top("heldout.yaml", ("prediction", "rows"))
    return _rows(f.data.get("rows"), "heldout.yaml", "rows"), f.text("prediction")


def load_supplements() -> tuple[Supplement, ...]:
    """The supplements (``supplements.yaml``)."""
    items = _top("supplements.yaml", ("supplements",)).data.get("supplements")
    if not isinstance(items, list) or not items:
        raise DataFileError(f"supplements.yaml: supplements is {items!r}; a non-empty list is allowed")
    found = []
    for i, item in enumerate(items):
        f = _Fields(item, "supplements.yaml", f"supplements[{i}]", ("id", "args", "question", "prediction", "rows"))
        own = (_rows(f.data["rows"], "supplements.yaml", f"supplements[{i}].rows", reach=False)
               if "rows" in f.data else ())
        found.append(Supplement(f.text("id"), f.strings("args"), f.text("question"), f.text("prediction"), own))
    return tuple(found)


ROWS: tuple[Row, ...] = load_rows()
HELDOUT, HELDOUT_PREDICTION = load_heldout()
SUPPLEMENTS: tuple[Supplement, ...] = load_supplements()
SUPPLEMENT_IDS = {s.id: s for s in SUPPLEMENTS}


def checked_supplement(sup_id: str, argv: list[str]) -> Supplement:
    """Supplement ``sup_id``, for a ``--validate`` command line ``argv`` that gives none of the flags it sets.

    Raises:
        LNStabError: ``sup_id`` is not a supplement, or ``argv`` gives a flag the supplement sets itself.
    """
    sup = SUPPLEMENT_IDS.get(sup_id)
    if sup is None:
        raise LNStabError(f"--supplement {sup_id} is not allowed; supplements: {', '.join(SUPPLEMENT_IDS)}")
    own = [a for a in sup.args if a.startswith("--")]
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    clash = [a for a in own if a in given]
    if clash:
        raise LNStabError(f"--supplement {sup_id} sets {', '.join(own)} itself; {clash[0]} is not allowed with it "
                          "(give only the data, output and machine options)")
    return sup


def supplement_rows(sup: Supplement | None, rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """``rows`` with supplement ``sup``'s own rows (its protocol's outcomes) in place of theirs."""
    own = {r.id: r for r in sup.rows} if sup is not None else {}
    return tuple(own.get(r.id, r) for r in rows)
