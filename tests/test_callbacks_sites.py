"""lnstab.callbacks.sites: the public names code outside the instruments uses, without Lightning; the check uses
them and no private callbacks module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_check_imports_no_private_callbacks_module() -> None:
    private = []
    for path in sorted((ROOT / "lnstab" / "check").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            private += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("lnstab.callbacks._")]
    assert private == []


def test_the_sites_api_imports_without_lightning() -> None:
    code = ("import sys, lnstab.callbacks.sites as s; print(len(s.__all__), "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split(" ", 1)[1].strip() == "[]" and int(out.split(" ", 1)[0]) > 10
