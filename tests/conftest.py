"""Test-wide settings: no test may reach a network (set before any Hugging Face library is imported)."""

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")


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
