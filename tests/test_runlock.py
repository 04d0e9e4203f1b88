"""``lnstab.runlock``, the lock that gives a run directory one owner: a lock file that is a link (symbolic or hard)
is refused and never written through, by ``lnstab fit`` too, and a full disk under the lock is one line.

The full disk is real: a 64 KB tmpfs filled to the brim (the ``full_disk`` fixture; ``mount`` needs root, and the
test skips, saying so, where it is refused). Two runs into one live directory are in ``test_signals``.
"""

from __future__ import annotations

import os

import pytest
from support.hostile import ENOSPC
from support.runs import tiny_config

from lnstab import runlock
from lnstab.cli import main
from lnstab.errors import ConfigError, MachineError


@pytest.mark.parametrize("kind", ["link to a file", "dangling link", "hard link"])
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_untouched(kind, tmp_path) -> None:
    run, target = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    if kind != "dangling link":
        target.write_text("a file of the user's\n")
    if kind == "hard link":
        os.link(target, run / runlock.LOCK_FILE)
    else:
        (run / runlock.LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError) as info:
        runlock.hold(run)
    message = str(info.value)
    assert "\n" not in message and f"its lock file {run / runlock.LOCK_FILE} is " in message, message
    assert ("a file with 2 hard links" if kind == "hard link" else "a symbolic link") in message
    if kind == "dangling link":
        assert not target.exists()  # before: O_CREAT made it, wherever the link pointed
    else:
        assert target.read_text() == "a file of the user's\n"  # before: the holder's record written over it
    assert not runlock.holds(run)


def test_lnstab_fit_refuses_a_linked_lock_file_in_one_line(tmp_path, capsys) -> None:
    run, target = tmp_path / "run", tmp_path / "precious.txt"
    run.mkdir()
    target.write_text("a file of the user's\n")
    (run / runlock.LOCK_FILE).symlink_to(target)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(tiny_config(tmp_path)), "--run_dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("lnstab: error: --run_dir ") and "symbolic link" in err[-1]
    assert target.read_text() == "a file of the user's\n"
    assert sorted(p.name for p in run.iterdir()) == [runlock.LOCK_FILE]  # nothing written beside it


@pytest.mark.system
def test_a_full_disk_under_the_lock_is_one_line(full_disk) -> None:
    run = full_disk / "run"
    with pytest.raises(MachineError) as info:
        runlock.hold(run)
    assert str(info.value) == f"{run / runlock.LOCK_FILE} {ENOSPC}"
    assert not runlock.holds(run)
