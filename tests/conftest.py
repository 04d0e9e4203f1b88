"""Test-wide settings: no test may reach a network (set before any Hugging Face library is imported), and
torch.compile's on-disk cache is kept per CPU instruction set; the fixtures several test modules share."""

import getpass
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
# lnstab check trains its references afresh in every test (no card reuses another test's, nor the user's
# ~/.cache/lnstab/check); tests/test_check_cache.py turns the cache on where it tests it.
os.environ["LNSTAB_CHECK_CACHE"] = "off"

# Inductor's cache (/tmp/torchinductor_<user>) does not tell kernels built for AVX-512 from kernels built for AVX2
# (torch 2.13): with the suite run natively and then under ATEN_CPU_CAPABILITY=avx2 (this suite's stand-in for an
# AVX2-only CPU, see tests/test_precision_paths.py) on one machine, the second run reused the first's kernels and
# the compiled model trained on NaN; in the other order it died with a segmentation fault. One cache per capability.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))


# Under pytest-xdist (pyproject.toml's addopts) the workers share the machine's cores: each gets its share of torch
# threads, and so do the lnstab processes a test starts (OMP_NUM_THREADS is inherited), instead of every worker
# running as many threads as there are cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cpus // _WORKERS)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.fixture
def offline(monkeypatch) -> None:
    """``HF_HUB_OFFLINE=1`` for one test even where the environment says ``0`` (the ``setdefault`` above yields to
    it): the data modules read it when called and refuse the hub in one line. A module whose tests read text asks
    for it with ``pytestmark = pytest.mark.usefixtures("offline")``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The real-SLURM module first (the longest: 7 min on 2 cores, mostly waiting on slurmctld), then the other
    modules with a ``slow`` test, then the rest, each module's tests in their order. With ``--dist loadfile`` a worker
    takes a whole module at a time, and a long module taken last runs alone at the end while the other worker idles
    (it did: 14.3 min with the SLURM module last)."""
    slurm = {item.path for item in items if "cluster" in getattr(item, "fixturenames", ())}
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slurm, item.path not in slow))  # stable within each class


def pytest_unconfigure(config) -> None:
    """Child processes a test left running (DataLoader workers of an iterator still referenced, say) would make the
    interpreter's exit wait for them; name them and end them so that the suite always exits."""
    import gc
    import multiprocessing

    gc.collect()
    left = multiprocessing.active_children()
    if left:
        print(f"\nconftest: {len(left)} child process(es) left running by the tests, killed: "
              + ", ".join(f"{p.name} (pid {p.pid})" for p in left))
        for p in left:
            p.kill()
            p.join(10)


@pytest.fixture
def terminal(capsys) -> Iterator[Callable[[], list[str]]]:
    """What a terminal shows, line by line: Lightning's progress bar (stdout) and its log lines (its own handler, on
    stderr, which pytest's logging replaces) on one stream, as on one screen. Call it after the fit."""
    class Stdout:  # sys.stdout when written to: capsys puts its own in place only as the test runs
        def write(self, text: str) -> int:
            return sys.stdout.write(text)

        def flush(self) -> None:
            sys.stdout.flush()

    handler = logging.StreamHandler(Stdout())
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        yield lambda: capsys.readouterr().out.replace("\r", "\n").split("\n")
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)


@pytest.fixture
def grid(tmp_path):
    """A sweep directory of eight lnstab runs over three configurations, one run planned and missing
    (``support.report.write_grid``)."""
    from support.report import write_grid  # after the offline settings above

    return write_grid(tmp_path)


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 64 KB tmpfs, every byte taken by a file (directories and empty files can still be made in it). ``mount``
    needs root: the test is skipped, saying so, where it is refused."""
    from support.hostile import small_tmpfs

    with small_tmpfs(tmp_path / "disk", "64k") as mounted:
        if not mounted:
            pytest.skip("mount -t tmpfs is refused here (it needs root): no real full disk to test against")
        fd = os.open(tmp_path / "disk" / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield tmp_path / "disk"
