"""The installed wheel is one package, `dsconv`: it must not touch other distributions' import names.

Jupyter's `comm` and Hugging Face's `kernels` are real packages whose import names our stage folders carry;
installed under `dsconv.` they cannot collide. Built and installed as a user would (a non-editable wheel),
next to PyPI's `comm`, into a fresh virtual environment.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CHECK = """
import importlib.util, comm
assert callable(comm.create_comm), "comm.create_comm is gone: our wheel overwrote Jupyter's comm"
for name in ("kernels", "convert", "shard", "manifest", "runner"):
    assert importlib.util.find_spec(name) is None, f"the wheel installed a top-level {name!r}"
import dsconv.errors, dsconv.shard  # the stages live under dsconv
print("ok")
"""


def _run(*cmd, cwd=None):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_wheel_installs_only_dsconv_next_to_jupyters_comm(tmp_path):
    # built from a copy of the sources: setuptools reuses a checkout's build/ folder, whose stale copies of deleted
    # modules would land in the wheel
    sources = tmp_path / "sources"
    shutil.copytree(REPO, sources, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                                 ".import_linter_cache", ".whl", ".pytest_cache"))
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", tmp_path / "wheel", cwd=sources)
    (wheel,) = (tmp_path / "wheel").glob("dsconv-*.whl")
    archive = zipfile.ZipFile(wheel)
    tops = {name.split("/")[0] for name in archive.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dsconv"}, tops
    # no test-only code: the tests, the scripts, and the tiny models' training (which needs transformers)
    modules = [name for name in archive.namelist() if name.endswith(".py")]
    assert not [m for m in modules if m.split("/")[1] in ("tests", "scripts")], modules
    # transformers is imported by one module, dsrun compare's reference (the [compare] extra), and only inside the
    # functions that run it, so every module imports without it
    texts = {m: archive.read(m).decode() for m in modules}
    assert not [m for m, text in texts.items() if re.search(r"^(from|import) transformers\b", text, re.M)]
    lazy = [m for m, text in texts.items() if re.search(r"^\s+(from|import) transformers\b", text, re.M)]
    assert lazy == ["dsconv/runner/entrypoints/reference.py"], lazy

    env = tmp_path / "env"
    _run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    pip = (sys.executable, "-m", "pip", "--python", python, "install", "-q")
    _run(*pip, "comm")
    _run(*pip, "--no-deps", wheel)  # torch and the rest are not needed to see where files land
    # run outside the repository, whose own top-level folders would shadow what is installed
    assert _run(python, "-c", CHECK, cwd=tmp_path).strip().endswith("ok")
    # and uninstalling takes only what it installed
    _run(sys.executable, "-m", "pip", "--python", python, "uninstall", "-y", "-q", "dsconv")
    assert _run(python, "-c", "import comm; print(callable(comm.create_comm))", cwd=tmp_path).strip() == "True"


UNDECLARED = "filelock"  # installed as torch's dependency, declared by nothing here


def test_every_import_is_declared(tmp_path):
    """deptry over the package, its tests and its scripts ([tool.deptry]): every package they import is declared in
    pyproject.toml. The same check fails on a copy whose tests import a package that is installed only as another's
    dependency."""
    done = _deptry(REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "shared"))
    (copy / "tests" / "test_undeclared_import.py").write_text(f"import {UNDECLARED}\n")
    broken = _deptry(copy)
    assert broken.returncode != 0 and f"'{UNDECLARED}' imported but" in broken.stdout + broken.stderr


def _deptry(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deptry", "."], capture_output=True, text=True, cwd=root, timeout=300,
                          env={**os.environ, "NO_COLOR": "1"})
