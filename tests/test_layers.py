"""The layer contract (pyproject.toml, import-linter): imports point down only, and the check bites."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)


def test_imports_point_down() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """A copy of the package where a model reaches into the engine (the old ``llama.py`` -> ``kv_cache``)."""
    shutil.copytree(ROOT / "loraplex", tmp_path / "loraplex", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    base = tmp_path / "loraplex" / "models" / "base.py"
    base.write_text(base.read_text() + "\nfrom loraplex.engine.kv_cache import KVCache  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "loraplex.models.base -> loraplex.engine.kv_cache" in result.stdout
