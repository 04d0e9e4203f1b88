"""A sweep grid: a base experiment, axes over config keys, ``exclude``/``include``, expanded to named runs.

A grid file (``experiments/grids/*.yaml``)::

    base: ../gpt2_pre_dt1.yaml          # the experiment every run starts from (relative to this file)
    name: gpt2_divergence               # optional; default: the file's stem. Runs land in <root>/<name>/<run>/
    overrides:                          # optional; config keys set in every run
      trainer.max_steps: 60000
    axes:                               # the Cartesian product of these, in this order
      model.norm_placement: [pre, peri, none]
      model.weight_decay: {label: wd, values: [0.1, 0.0]}
      seed_everything: {label: s, values: [0, 1, 2, 3, 4]}
      recipe:                           # a compound axis: each named value sets several keys
        values:
          lr1e-3: {model.learning_rate: 1.0e-3}
          lr1e-2: {model.learning_rate: 1.0e-2, model.warmup_steps: 10}
    exclude:                            # optional; drop every run that matches all the pairs of an entry
      - {model.norm_placement: none, model.weight_decay: 0.0}
    include:                            # optional; extra runs: a value for every axis, plus any other keys
      - {model.norm_placement: post, model.weight_decay: 0.1, seed_everything: 0}
    slurm: {nodes: 1, gpus_per_node: 8, time: "24:00:00"}   # optional; defaults of the SLURM script

A run's name joins, axis by axis, ``label + value`` with ``_`` (``pre_wd0.1_s3``); a compound axis contributes the
name of its value; an ``include`` entry's extra keys add ``<last key part><value>``. Default labels: ``dt`` for
``model.residual_scale``, ``wd`` for ``model.weight_decay``, ``lr`` for ``model.learning_rate``, ``s`` for
``seed_everything``; none for text values; otherwise the key's last part. Names are stable: the same grid always
gives the same names, so a rerun finds its runs. A name is a directory under ``<root>/<grid>/``, so it must stay
one there: :data:`RUN_NAME_RE` (letters, digits, ``_ + - .``; not ``.``, ``..`` or any name starting with ``.``
or ``-``; at most :data:`MAX_NAME` characters), refused at load otherwise. Everything here is structural;
:func:`validate_with_cli` checks the keys and values against what ``lnstab fit --print_config`` accepts. The file
is read within :mod:`lnstab.safeload`'s bounds.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lnstab.errors import ConfigError
from lnstab.rundir import short_path
from lnstab.safeload import DataFileError, load_yaml

DEFAULT_LABELS = {
    "model.residual_scale": "dt",
    "model.weight_decay": "wd",
    "model.learning_rate": "lr",
    "seed_everything": "s",
}
# Keys that say where a run lives: the sweep sets them, a grid may not.
RESERVED = ("run_dir", "ckpt_path", "trainer.default_root_dir", "trainer.logger", "config", "extends")
GRID_KEYS = ("base", "name", "overrides", "axes", "exclude", "include", "slurm")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# A run's name is a directory under <root>/<grid>/ and a file name in .sweep/ (logs, locks, attempts).
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9_+][A-Za-z0-9._+-]*$")
MAX_NAME = 200


class GridError(ConfigError):
    """A grid file that cannot be expanded (one line naming the file, the field and the problem)."""


@dataclass(frozen=True)
class Run:
    """One run of a grid: its name, the config overrides that make it, and which axis values it has."""

    name: str
    overrides: dict[str, Any]
    point: dict[str, Any] = field(default_factory=dict)

    def cli_args(self) -> list[str]:
        """The overrides as ``--key value`` arguments of ``lnstab fit``."""
        args: list[str] = []
        for key, value in self.overrides.items():
            args += [f"--{key}", cli_value(value)]
        return args


@dataclass(frozen=True)
class Axis:
    """One axis: a config key (``values`` are its values) or a compound axis (``values`` maps names to overrides)."""

    key: str
    values: tuple[Any, ...]
    names: tuple[str, ...]
    label: str = ""
    compound: bool = False

    def overrides(self, index: int) -> dict[str, Any]:
        """The config keys the ``index``-th value sets."""
        return dict(self.values[index]) if self.compound else {self.key: self.values[index]}


@dataclass
class Grid:
    """An expanded grid: where it came from, its base experiment, and its runs in a stable order."""

    path: Path
    name: str
    base: Path
    runs: list[Run]
    axes: list[Axis]
    slurm: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str) -> Run:
        """The run called ``name``."""
        for run in self.runs:
            if run.name == name:
                return run
        raise GridError(f"grid {self.path}: run={name!r} is not allowed; it has no such run (see --dry-run)")


def cli_value(value: Any) -> str:
    """A YAML value as one command-line word that jsonargparse reads back as the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        text = repr(value)
        # YAML 1.1 reads "1e-05" as a string: give the mantissa a dot ("1.0e-05")
        return re.sub(r"^(-?\d+)(e)", r"\1.0\2", text) if "e" in text and "." not in text else text
    if isinstance(value, int | str):
        return str(value)
    return json.dumps(value)


def format_value(value: Any) -> str:
    """A value as it appears in a run name: ``0.1``, ``0``, ``1e-3`` → ``0.001``, ``bf16-mixed``."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = format(value, "g")
    elif value is None:
        text = "none"
    elif isinstance(value, int | str):
        text = str(value)
    else:
        text = json.dumps(value, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "x"


def default_label(key: str, values: list[Any]) -> str:
    """The name prefix of an axis without a ``label``: :data:`DEFAULT_LABELS`, none for text, else the key's end."""
    if key in DEFAULT_LABELS:
        return DEFAULT_LABELS[key]
    if all(isinstance(v, str) for v in values):
        return ""
    return key.rsplit(".", 1)[-1]


def load_grid(path: str | Path) -> Grid:
    """Read and expand the grid file at ``path``.

    Raises:
        GridError: A missing or malformed file, an empty axis, an unknown grid field, a reserved or malformed key,
            a key set twice, an ``exclude`` that matches nothing, an ``include`` missing an axis, or two runs with the
            same name. Nothing is written.
    """
    path = Path(path)
    where = f"grid {path}"
    if not path.is_file():
        raise GridError(f"{where} is not a file")
    try:
        spec = load_yaml(path, where)
    except DataFileError as exc:
        raise GridError(str(exc)) from None
    if not isinstance(spec, dict):
        raise GridError(f"{where} is not allowed; it must hold a mapping with base, axes, …")
    unknown = sorted(set(spec) - set(GRID_KEYS))
    if unknown:
        raise GridError(f"{where}: field {unknown[0]!r} is not allowed; a grid has: {', '.join(GRID_KEYS)}")
    base = spec.get("base")
    if not isinstance(base, str) or not base:
        raise GridError(f"{where}: base={base!r} is not allowed; name the experiment YAML the runs start from")
    base_path = short_path(path.parent / base)
    if not base_path.is_file():
        raise GridError(f"{where}: base={base!r} is not allowed; {base_path} is not a file")
    name = spec.get("name", path.stem)
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise GridError(f"{where}: name={name!r} is not allowed; use letters, digits, '.', '_', '-'")
    fixed = _mapping(where, "overrides", spec.get("overrides") or {})
    axes = _axes(where, spec.get("axes"))
    owner = {key: "overrides" for key in fixed}
    for axis in axes:
        keys = {k for v in axis.values for k in v} if axis.compound else {axis.key}
        for key in sorted(keys):
            if key in owner:
                raise GridError(f"{where}: key {key!r} is set by both {owner[key]} and axis {axis.key!r}")
            owner[key] = f"axis {axis.key!r}"
    runs = _expand(where, axes, fixed, spec.get("exclude") or [], spec.get("include") or [])
    slurm = _mapping(where, "slurm", spec.get("slurm") or {}, keys=False)
    return Grid(path=path, name=name, base=base_path, runs=runs, axes=axes, slurm=slurm, overrides=fixed)


def _mapping(where: str, field_name: str, value: Any, keys: bool = True) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GridError(f"{where}: {field_name}={value!r} is not allowed; it must be a mapping")
    if keys:
        for key in value:
            check_key(where, field_name, key)
    return dict(value)


def check_key(where: str, field_name: str, key: Any) -> None:
    """Refuse a key that is not a dotted config key, or one that says where runs live (the sweep sets those)."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise GridError(f"{where}: {field_name} key {key!r} is not allowed; give a dotted config key such as "
                        f"model.weight_decay")
    if any(key == r or key.startswith(r + ".") for r in RESERVED):
        raise GridError(f"{where}: {field_name} key {key!r} is not allowed; the sweep sets where runs live "
                        f"(<root>/<grid>/<run>)")


def _axes(where: str, spec: Any) -> list[Axis]:
    if not isinstance(spec, dict) or not spec:
        raise GridError(f"{where}: axes={spec!r} is not allowed; give at least one axis (config key: [values])")
    axes = []
    for key, entry in spec.items():
        label = None
        if isinstance(entry, dict) and "values" in entry:
            extra = sorted(set(entry) - {"values", "label"})
            if extra:
                raise GridError(f"{where}: axis {key!r} field {extra[0]!r} is not allowed; an axis has values, label")
            label, values = entry.get("label"), entry["values"]
        else:
            values = entry
        if label is not None and (not isinstance(label, str) or (label and not NAME_RE.match(label))):
            raise GridError(f"{where}: axis {key!r} label={label!r} is not allowed; use letters, digits, '.', '_', '-'")
        if isinstance(values, dict) and values and all(isinstance(v, dict) for v in values.values()):
            for vname, sets in values.items():
                if not isinstance(vname, str) or not NAME_RE.match(vname):
                    raise GridError(f"{where}: axis {key!r} value name {vname!r} is not allowed; use letters, digits, "
                                    f"'.', '_', '-'")
                if not sets:
                    raise GridError(f"{where}: axis {key!r} value {vname!r} is empty; give the keys it sets")
                for k in sets:
                    check_key(where, f"axis {key!r} value {vname!r}", k)
            names = [(label or "") + n for n in values]
            axes.append(Axis(str(key), tuple(dict(v) for v in values.values()), tuple(names), label or "", True))
            continue
        check_key(where, "axes", key)
        if isinstance(values, dict):  # {name: value}: names chosen by hand
            if not values:
                raise GridError(f"{where}: axis {key!r} is empty; give at least one value")
            names = [(label or "") + format_value(n) for n in values]
            axes.append(Axis(key, tuple(values.values()), tuple(names), label or ""))
            continue
        if not isinstance(values, list) or not values:
            raise GridError(f"{where}: axis {key!r} values={values!r} is not allowed; give a non-empty list")
        label = default_label(key, values) if label is None else label
        axes.append(Axis(key, tuple(values), tuple(label + format_value(v) for v in values), label))
    return axes


def _axis_index(axis: Axis, value: Any) -> int | None:
    """Index of ``value`` on ``axis`` (for a compound axis: the name of a value, with or without its label)."""
    for i, v in enumerate(axis.values):
        if axis.compound:
            if str(value) in (axis.names[i], axis.names[i][len(axis.label):]):
                return i
        elif _same(v, value):
            return i
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _expand(where: str, axes: list[Axis], fixed: dict[str, Any], exclude: Any, include: Any) -> list[Run]:
    by_key = {a.key: a for a in axes}
    if not isinstance(exclude, list) or not isinstance(include, list):
        raise GridError(f"{where}: exclude and include are not allowed as given; each must be a list of mappings")
    rules: list[dict[str, int]] = []
    for i, entry in enumerate(exclude):
        if not isinstance(entry, dict) or not entry:
            raise GridError(f"{where}: exclude[{i}]={entry!r} is not allowed; give a mapping of axis: value")
        rule = {}
        for key, value in entry.items():
            if key not in by_key:
                raise GridError(f"{where}: exclude[{i}] key {key!r} is not allowed; choose an axis: "
                                f"{', '.join(by_key)}")
            index = _axis_index(by_key[key], value)
            if index is None:
                raise GridError(f"{where}: exclude[{i}] {key}={value!r} is not allowed; it is not a value of the axis")
            rule[key] = index
        rules.append(rule)
    used = [False] * len(rules)
    runs: list[Run] = []
    for combo in itertools.product(*(range(len(a.values)) for a in axes)):
        point = {a.key: i for a, i in zip(axes, combo, strict=True)}
        hit = [all(point[k] == v for k, v in rule.items()) for rule in rules]
        if any(hit):
            used = [u or h for u, h in zip(used, hit, strict=True)]
            continue
        runs.append(_make_run(axes, point, fixed, {}))
    for i, u in enumerate(used):
        if not u:
            raise GridError(f"{where}: exclude[{i}]={exclude[i]!r} matches no run; remove it or fix its values")
    for i, entry in enumerate(include):
        if not isinstance(entry, dict):
            raise GridError(f"{where}: include[{i}]={entry!r} is not allowed; give a mapping of axis: value")
        point, extra = {}, {}
        for key, value in entry.items():
            if key in by_key:
                index = _axis_index(by_key[key], value)
                if index is None:
                    raise GridError(f"{where}: include[{i}] {key}={value!r} is not allowed; it is not a value of the "
                                    f"axis (put other values in an axis, or in extra keys of the entry)")
                point[key] = index
            else:
                check_key(where, f"include[{i}]", key)
                if key in fixed:
                    raise GridError(f"{where}: include[{i}] key {key!r} is not allowed; it is set by overrides")
                extra[key] = value
        missing = [k for k in by_key if k not in point]
        if missing:
            raise GridError(f"{where}: include[{i}] is not allowed without axis {missing[0]!r}; give every axis "
                            f"a value")
        runs.append(_make_run(axes, point, fixed, extra))
    seen: dict[str, Run] = {}
    for run in runs:
        check_run_name(where, run.name, _describe(run))
        if run.name in seen:
            raise GridError(f"{where}: two runs are named {run.name!r} ({_describe(seen[run.name])} and "
                            f"{_describe(run)}); give the axes distinct labels or value names")
        seen[run.name] = run
    return runs


def check_run_name(where: str, name: Any, what: str = "") -> None:
    """Refuse a run name that would not be one directory inside its grid's directory (``..``, ``.x``, ``a/b``).

    Raises:
        GridError: One line naming the run, its values (``what``) and what a name may hold.
    """
    if isinstance(name, str) and RUN_NAME_RE.match(name) and len(name) <= MAX_NAME:
        return
    of = f" (from {what})" if what else ""
    raise GridError(f"{where}: run name {name!r}{of} is not allowed; a run name is a directory in the grid's "
                    f"directory: letters, digits, '_', '+', '-', '.', not starting with '.' or '-', at most "
                    f"{MAX_NAME} characters (give the axis a label or named values)")


def _make_run(axes: list[Axis], point: dict[str, int], fixed: dict[str, Any], extra: dict[str, Any]) -> Run:
    overrides = dict(fixed)
    parts = []
    for axis in axes:
        overrides.update(axis.overrides(point[axis.key]))
        parts.append(axis.names[point[axis.key]])
    for key, value in extra.items():
        overrides[key] = value
        parts.append(key.rsplit(".", 1)[-1] + format_value(value))
    values = {a.key: (a.names[point[a.key]] if a.compound else a.values[point[a.key]]) for a in axes}
    return Run(name="_".join(p for p in parts if p), overrides=overrides, point={**values, **extra})


def _describe(run: Run) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in run.point.items())
