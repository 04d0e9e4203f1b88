"""docs/api.md is generated from the code (``python -m lnstab.apidoc``) and documents every argument."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lnstab.apidoc import args_section, arguments, public_callbacks, render

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_api_reference_is_what_the_code_generates():
    done = subprocess.run([sys.executable, "-m", "lnstab.apidoc"], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    committed = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert done.stdout == committed, "docs/api.md is stale: run `python -m lnstab.apidoc > docs/api.md`"


def test_every_argument_of_every_public_callback_is_documented():
    classes = {c.__name__ for c in public_callbacks()}
    assert {"HiddenStateStatistics", "AttentionLogitStatistics", "DivergenceMonitor", "Throughput", "Instruments",
            "JacobianSensitivity", "RunStatus", "FinalEvaluation"} <= classes
    page = render()
    for cls in public_callbacks():
        assert f"\n## {cls.__name__}\n" in page
        for name, default, meaning in arguments(cls):
            assert meaning, f"{cls.__name__}({name}=…) has no entry in its docstring's Args"
            assert f"| `{name}` | {default.replace('|', chr(92) + '|')} |" in page, (cls.__name__, name)
    assert "| `every_n_steps` | `100` | Log on optimizer steps `0, N, 2N, …`. |" in page  # HiddenStateStatistics


def test_args_sections_as_google_style_writes_them():
    doc = """Summary.

    Args:
        every_n_steps: Log on steps
            0, N, 2N.
        layer_pattern, module_types: Sites, as in the other one.

            Example::

                not part of the meaning
        probe (Tensor): A fixed input.

    Raises:
        ValueError: never an argument.
    """
    import inspect

    assert args_section(inspect.cleandoc(doc)) == {
        "every_n_steps": "Log on steps 0, N, 2N.", "layer_pattern": "Sites, as in the other one.",
        "module_types": "Sites, as in the other one.", "probe": "A fixed input."}
