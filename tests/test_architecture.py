"""The import direction (pyproject.toml's import-linter contracts) holds: the stages import downwards only,
dsconv.family imports no stage, nothing below the runner imports it, and the runner reads as entrypoints >
engine > models."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_contracts_cover_every_package():
    """Every installed subpackage (one level below dsconv, and below dsconv.runner) sits in a layers contract."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layered = {name for contract in pyproject["tool"]["importlinter"]["contracts"] if contract["type"] == "layers"
               for layer in contract["layers"] for name in layer.split(" | ")}
    installed = pyproject["tool"]["setuptools"]["packages"]
    stages = {p for p in installed if p.count(".") == 1}
    runner_parts = {p for p in installed if p.startswith("dsconv.runner.") and p.count(".") == 2}
    assert stages and runner_parts
    assert stages | runner_parts <= layered, (stages | runner_parts) - layered


def test_lint_imports_keeps_every_contract():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "import-linter is a test dependency: pip install -e '.[test]'"
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout, result.stdout[-3000:]
