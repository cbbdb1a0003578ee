"""The import direction (pyproject.toml's import-linter contracts) holds: the stages import downwards only,
dsconv.family imports no stage, nothing below the runner imports it, and the runner reads as entrypoints >
engine > models."""

import ast
import dataclasses
import re
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


ENGINE = ROOT / "runner" / "engine"
CONNECTOR_WORDS = re.compile(r"(^|_)(offload\w*|transfer\w*|leases?|lease_\w*|handoffs?)(_|$)", re.IGNORECASE)


def _identifiers(tree: ast.AST) -> set[str]:
    """Every name a module's code uses or defines: names, attributes, functions, classes, arguments, keywords."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
    return names


def test_the_scheduler_worker_and_loop_know_only_the_connector_seam():
    """Issue 73: P/D and KV offload are connectors (runner/engine/kv_connector/); scheduler.py, worker.py and core.py
    name no offload, transfer, lease or hand-over type or field (pyproject's contract keeps their modules out)."""
    words = "offload, transfer, lease, handoff"
    assert CONNECTOR_WORDS.search("kv_offload") and not CONNECTOR_WORDS.search("releases"), words
    for module in ("scheduler.py", "worker.py", "core.py"):
        named = sorted(n for n in _identifiers(ast.parse((ENGINE / module).read_text())) if CONNECTOR_WORDS.search(n))
        assert not named, f"{module} names {named}"


def test_the_scheduler_is_small_and_no_engine_class_is_large():
    """Issue 73: scheduler.py at most 450 lines, no class of runner/engine over 300."""
    assert len((ENGINE / "scheduler.py").read_text().splitlines()) <= 450
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 300, f"{path.name}: {node.name}"


def test_every_engine_flag_is_declared_once():
    """Issue 73: the engine's flags are EngineOptions' fields (runner/entrypoints/options.py) and nowhere else: no
    dsrun command that runs the engine declares one as a parameter of its own, no command's options dataclass as a
    field (`dsrun router`, which runs no engine, has options of its own)."""
    from dsconv.runner.entrypoints.options import EngineOptions

    flags = {field.name for field in dataclasses.fields(EngineOptions)}
    assert "enable_eplb" in flags and len(flags) > 20
    cli = ast.parse((ROOT / "runner" / "cli.py").read_text())
    for node in ast.walk(cli):
        engine_command = any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "engine_command"
                             for d in getattr(node, "decorator_list", ()))
        if isinstance(node, ast.FunctionDef) and engine_command:  # a command that runs the engine
            own = {arg.arg for arg in node.args.args + node.args.kwonlyargs}
            assert not own & flags, f"dsrun {node.name} declares {sorted(own & flags)} itself"
    for path in (ROOT / "runner" / "entrypoints").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Options") and \
                    node.name not in ("EngineOptions", "RouterOptions"):
                fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
                assert not fields & flags, f"{path.name}: {node.name} declares {sorted(fields & flags)}"
