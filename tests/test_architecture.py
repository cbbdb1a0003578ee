"""The import direction (pyproject.toml's import-linter contracts) holds: the stages import downwards only,
dsconv.family imports no stage, nothing below the runner imports it, and the runner reads as entrypoints >
engine > models."""

import ast
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


def _package_modules() -> dict[str, Path]:
    """Every module of the installed package (pyproject's packages), by dotted name."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = {}
    for package in pyproject["tool"]["setuptools"]["packages"]:
        folder = ROOT.joinpath(*package.split(".")[1:])
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def _imports(tree: ast.Module, known: dict[str, Path]) -> tuple[set[str], list[tuple[int, str]]]:
    """A module's imports of the package: (those it makes when imported, [(line, module)] of those it defers: inside
    a function, or under `if TYPE_CHECKING`)."""
    eager, deferred = set(), []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name in known]
        base = node.module or ""
        return [m for m in (base, *(f"{base}.{a.name}" for a in node.names)) if m in known]

    def visit(node, deferring: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if deferring:
                        deferred.append((child.lineno, target))
                    else:
                        eager.add(target)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, True)
            else:
                visit(child, deferring)

    visit(tree, False)
    return eager, deferred


def test_no_deferred_import_breaks_a_cycle():
    """An import made late (in a function, or for type checking only) is there to keep a command's start fast or an
    optional dependency optional, never to hide a cycle: the module it imports never imports, as it loads, the one
    that defers."""
    modules = _package_modules()
    graph, deferred = {}, {}
    for name, path in modules.items():
        graph[name], deferred[name] = _imports(ast.parse(path.read_text()), modules)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        return False

    assert len(modules) > 50 and any(deferred.values())
    cycles = [f"{modules[name].relative_to(ROOT)}:{line} imports {target} late, which imports {name} as it loads"
              for name, late in deferred.items() for line, target in late if reaches(target, name)]
    assert not cycles, "\n".join(cycles)
