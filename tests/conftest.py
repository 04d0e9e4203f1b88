"""Test-wide settings: no test may reach a network (set before any Hugging Face library is imported), and
torch.compile's on-disk cache is kept per CPU instruction set."""

import getpass
import os
import tempfile

import torch

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

# Inductor's cache (/tmp/torchinductor_<user>) does not tell kernels built for AVX-512 from kernels built for AVX2
# (torch 2.13): with the suite run natively and then under ATEN_CPU_CAPABILITY=avx2 (this suite's stand-in for an
# AVX2-only CPU, see tests/test_precision_paths.py) on one machine, the second run reused the first's kernels and
# the compiled model trained on NaN; in the other order it died with a segmentation fault. One cache per capability.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{torch.backends.cpu.get_cpu_capability().lower()}"))


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
