"""The layer contracts (pyproject.toml, import-linter): imports point down only; the server, the integrations
and the CLI use the engine core only through the client and the shared data types; and both checks bite."""

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
    assert "2 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """A copy of the package where a model reaches into the engine (the old ``llama.py`` -> ``kv_cache``)."""
    shutil.copytree(ROOT / "loraplex", tmp_path / "loraplex", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    base = tmp_path / "loraplex" / "models" / "base.py"
    base.write_text(base.read_text() + "\nfrom loraplex.engine.kv_cache import KVCache  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "loraplex.models.base -> loraplex.engine.kv_cache" in result.stdout


SHARED_TYPES = {"loraplex.engine.request", "loraplex.engine.stats", "loraplex.engine.wire",
                "loraplex.engine.sampling.params", "loraplex.engine.sampling.structured.params",
                "loraplex.engine.sampling.structured.bounds",  # the schema rewrite params.py applies
                "loraplex.engine.pooling.params"}


def test_every_engine_module_is_a_shared_type_or_forbidden_to_the_server() -> None:
    """A new engine module must be classified: listed as forbidden to the server, or added to the shared types."""
    import tomllib

    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                    if c["type"] == "forbidden")
    forbidden = contract["forbidden_modules"]
    engine = ROOT / "loraplex" / "engine"
    modules = {".".join(("loraplex", "engine", *p.relative_to(engine).with_suffix("").parts))
               for p in engine.rglob("*.py") if p.name != "__init__.py"}
    unclassified = sorted(m for m in modules - SHARED_TYPES
                          if not any(m == f or m.startswith(f + ".") for f in forbidden))
    assert not unclassified, f"classify these engine modules in pyproject.toml's forbidden contract: {unclassified}"
    assert SHARED_TYPES <= modules


def test_a_server_import_of_the_engine_core_breaks_the_contract(tmp_path: Path) -> None:
    """A copy of the package where a route reaches past the client into the engine core."""
    shutil.copytree(ROOT / "loraplex", tmp_path / "loraplex", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    route = tmp_path / "loraplex" / "server" / "routes" / "models.py"
    route.write_text(route.read_text() + "\nfrom loraplex.engine.engine import Engine  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and "loraplex.server.routes.models -> loraplex.engine.engine" in result.stdout
