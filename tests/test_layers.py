"""The code's shape: one-way layers (import-linter, the contracts in
pyproject.toml), every package says what lives in it, and no source file
grows past 600 lines.

The layering check runs on the real tree and, as a negative control, on a
copy of it with one wrong import added; the control must fail, or the check
proves nothing.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ["specdec", "specdec_app", "draft_service", "target_service", "orchestrator", "gateway"]
GENERATED = REPO / "specdec" / "v1"
MAX_LINES = 600
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def copy_tree(dest: Path) -> Path:
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_tree_keeps_its_layers() -> None:
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module,wrong_import,contract", [
    # the foundation importing a service (a lazy import counts too)
    ("specdec/errors.py", "def _f() -> None:\n    import orchestrator.config\n", "one-way layers"),
    # a service importing the entry points
    ("target_service/config.py", "import specdec_app.commands\n", "one-way layers"),
    # one service importing another
    ("draft_service/config.py", "from target_service import config as _t\n", "independent"),
    ("gateway/config.py", "import orchestrator.config as _o\n", "independent"),
])
def test_a_wrong_import_breaks_the_check(tmp_path: Path, module: str, wrong_import: str, contract: str) -> None:
    root = copy_tree(tmp_path)
    assert lint_imports(root).returncode == 0  # the copy passes as the tree does
    with open(root / module, "a") as f:
        f.write("\n" + wrong_import)
    r = lint_imports(root)
    assert r.returncode != 0, r.stdout
    broken = r.stdout[r.stdout.index("Broken contracts"):]
    assert contract in broken and module.replace("/", ".").removesuffix(".py") in broken


def source_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    files += list((REPO / "scripts").glob("*.py")) + list((REPO / "tests").glob("*.py"))
    return [p for p in files if GENERATED not in p.parents and "__pycache__" not in p.parts]


def test_no_source_file_exceeds_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along a concern: {long}"


def test_every_folder_says_what_lives_in_it() -> None:
    missing = []
    for pkg in PACKAGES + ["tests"]:
        for init in (REPO / pkg).rglob("__init__.py"):
            if GENERATED in init.parents or init.parent == GENERATED:
                continue
            if not ast.get_docstring(ast.parse(init.read_text())):
                missing.append(str(init.relative_to(REPO)))
    for folder in ("scripts", "k8s", "docker", "protos", "docs", "benchmarks"):
        if not (REPO / folder / "README.md").exists():
            missing.append(f"{folder}/README.md")
    assert not missing, f"no docstring or README: {missing}"
