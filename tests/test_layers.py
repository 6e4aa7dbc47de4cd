"""The import contracts of pyproject.toml ([tool.importlinter], run by `make lint`): they hold on the
package as it is, and an import that runs back up the layers, even one hidden inside a function,
breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the copy of the package in ``tree`` (found first on the path), with the project's contracts."""
    exe = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(exe), "--no-logo", "--no-cache", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src" / "pg2delta", tmp_path / "pg2delta", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_layers_hold(tmp_path: Path) -> None:
    done = lint_imports(copy_package(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken" in done.stdout


def test_an_import_back_up_inside_a_function_breaks_them(tmp_path: Path) -> None:
    tree = copy_package(tmp_path)
    with (tree / "pg2delta" / "config.py").open("a") as f:
        f.write("\n\ndef _back_edge() -> None:\n    from pg2delta import job  # noqa: F401\n")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "pg2delta.config is not allowed to import pg2delta.job" in done.stdout


def test_the_architecture_page_lists_the_contracts_layers() -> None:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    page = (ROOT / "docs" / "architecture.md").read_text()
    marker = page.index("<!-- layers:")
    start = page.index("```\n", marker) + 4
    listed = page[start : page.index("```", start)].splitlines()
    assert listed == layers
