"""The wheel installs ``callbacks/`` and ``datamodules/`` under the ``lnstab`` namespace, nothing at the top level."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.system  # builds a wheel and installs it into a new venv


@pytest.mark.slow
def test_wheel_installs_namespaced_packages_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(dist), "-q"],
        check=True, cwd=tmp_path, timeout=600,
    )
    (wheel,) = dist.glob("lnstab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"lnstab"}, tops  # no generic 'callbacks' or 'datamodules' at the top of site-packages
    for module in ("lnstab/callbacks/__init__.py", "lnstab/datamodules/__init__.py", "lnstab/model.py"):
        assert module in names
    for data in ("lnstab/datamodules/data/owt-sample-250.jsonl.gz", "lnstab/datamodules/data/README.md",
                 "lnstab/check/thresholds.yaml", "lnstab/check/validation/rows.yaml",
                 "lnstab/check/validation/readme.md", "lnstab/check/validation/sections.md", "lnstab/check/report.md"):
        assert data in names  # the OpenWebText sample the quickstart reads offline, and its notice; the templates

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=600)
    # The dependencies come from this interpreter's site-packages (no network); lnstab itself only from the wheel:
    # an editable install's import hook lives in a .pth file, which PYTHONPATH entries do not run.
    deps = os.pathsep.join(site.getsitepackages())
    code = (
        "import lnstab.callbacks, lnstab.datamodules, lnstab.model, importlib.util;"
        "from lnstab.datamodules.sample import sample_path;"
        "print(lnstab.callbacks.__file__);"
        "print(importlib.util.find_spec('callbacks') is None and importlib.util.find_spec('datamodules') is None);"
        "print(sample_path());"
        "import lnstab.check.validation.readme as r;"  # compiles the README's two templates from the wheel
        "print(r.TEMPLATES.get_template('report.md').filename)"
    )
    out = subprocess.run(
        [str(python), "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": deps},
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout.split()
    assert Path(out[0]).is_relative_to(env_dir) and out[0].endswith("lnstab/callbacks/__init__.py")
    assert out[1] == "True"
    assert Path(out[2]).is_relative_to(env_dir) and Path(out[2]).stat().st_size > 100_000  # found as package data
    assert Path(out[3]).is_relative_to(env_dir)  # the card's template, from the wheel
    script = env_dir / "bin" / "lnstab"
    assert script.is_file()  # the console script
