"""A gloo process group ends before the interpreter's finalisation in every process that imports lnstab.

Left to finalisation, gloo's worker threads sometimes abort a rank after a completed run (SIGABRT); see
:mod:`lnstab.distributed`.
"""

from __future__ import annotations

import subprocess
import sys

import torch.distributed as dist

from lnstab.distributed import end_gloo_group

SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist
# Registered before lnstab's handler, so it runs after it (atexit is last in, first out).
atexit.register(lambda: print("group alive at exit:", dist.is_initialized(), flush=True))
if sys.argv[1] == "lnstab":
    import lnstab  # noqa: F401
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
assert t.tolist() == [1.0, 1.0, 1.0]
"""


def run(mode: str, store: str) -> str:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode, store], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_lnstab_ends_a_gloo_group_at_exit_and_without_it_the_group_outlives_atexit(tmp_path) -> None:
    assert run("lnstab", str(tmp_path / "a")) == "group alive at exit: False"
    assert run("plain", str(tmp_path / "b")) == "group alive at exit: True"  # what Lightning leaves for gloo


def test_end_gloo_group_destroys_once_and_is_a_no_op_without_a_group(tmp_path) -> None:
    assert not dist.is_initialized()
    assert end_gloo_group() is False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert end_gloo_group() is True
        assert not dist.is_initialized()
        assert end_gloo_group() is False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
