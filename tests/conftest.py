"""Test-wide settings: no test may reach a network (set before any Hugging Face library is imported)."""

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
