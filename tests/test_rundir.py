"""``lnstab.rundir``, how run files are written and read back: a file of the wrong shape or not UTF-8 is a
``RunFileError`` naming it, and non-finite numbers are written as strict JSON and read back as floats while the
strings "nan" and "inf" stay strings.
"""

from __future__ import annotations

import math

import pytest

from lnstab import rundir
from lnstab.rundir import read_events, read_hidden_series, read_json, read_summary, write_json


def test_readers_raise_run_file_error_for_wrong_shapes(tmp_path) -> None:
    for name, text, said, read in (
        ("summary.json", "[1, 2]", "it holds a JSON list, not a run summary", read_summary),
        ("summary.json", '{"val": "low"}', "'val' holds a JSON str, not an object", read_summary),
        ("hidden_stats.json", '{"tags": [0], "steps": []}', "'tags' must be a list of strings", read_hidden_series),
        ("divergence_events.jsonl", '{"step": 1}\n[2]\n', "line 2 holds a JSON list", read_events),
        ("summary.json", b'{"status": "\xff"}', "not UTF-8 text (byte 0xff at offset 12)", read_summary),
    ):
        run = tmp_path / name.replace(".", "_") / str(len(text))
        run.mkdir(parents=True)
        (run / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(rundir.RunFileError) as info:  # the class other code catches
            read(run)
        assert str(info.value) == f"{run / name} is damaged: {said}" or said in str(info.value), str(info.value)
        assert info.value.path == run / name and said in info.value.problem


def test_non_finite_numbers_are_tagged_and_strings_stay_strings(tmp_path) -> None:
    write_json(tmp_path / "summary.json", {"status": "diverged", "name": "nan", "note": "-inf",
                                           "val": {"loss": math.nan, "ppl": math.inf}, "low": -math.inf})
    back = read_summary(tmp_path)
    assert back["name"] == "nan" and back["note"] == "-inf"  # a run named nan stays a name
    assert math.isnan(back["val"]["loss"]) and back["val"]["ppl"] == math.inf and back["low"] == -math.inf
    assert '"$float": "nan"' in (tmp_path / "summary.json").read_text()  # strict JSON: no NaN literal
    assert read_json(tmp_path / "summary.json", numbers=False)["val"]["loss"] == {"$float": "nan"}
