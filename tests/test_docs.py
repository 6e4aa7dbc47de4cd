"""The docs' reference pages say what the code says, and the README stays a front door.

The configuration reference, the exit codes and the command-line reference are generated from
``pg2delta.config``, ``pg2delta.errors`` and ``pg2delta.cli`` by ``tools/gen_reference.py``; these tests fail when a page was not
regenerated (``make docs-reference``) or when a setting has no comment to document it.
``make docs`` builds the site itself with ``mkdocs build --strict``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from pg2delta import config, errors
from pg2delta.delta_features import FeatureSettings, RowSettings

ROOT = Path(__file__).resolve().parent.parent


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current() -> None:
    gen = _gen()
    for page in gen.PAGES:
        text = page.read_text()
        assert "<!-- generated: " in text, page
        assert gen.render(text) == text, f"{page.relative_to(ROOT)} is not current: run make docs-reference"


def test_every_setting_is_documented() -> None:
    gen = _gen()
    found = gen.settings()
    described = {(s.section, s.key) for s in found if s.description}
    assert {(s.section, s.key) for s in found} == described, "settings without a comment in the code or conf/*.toml"
    # Every field of every section's dataclass is a row (nothing dropped by the generator).
    keys = {s.key for s in found}
    for cls in (config.SourceConfig, config.WindowConfig, config.MaintainConfig, config.TableConfig, FeatureSettings, RowSettings):
        # TableConfig.delta and .rows hold the FeatureSettings and RowSettings keys of the same section
        assert {f.name for f in dataclasses.fields(cls)} - {"delta", "rows"} <= keys, cls
    assert {f.name for f in dataclasses.fields(config.Config().engine.__class__)} <= keys
    page = gen.CONFIG_PAGE.read_text()
    for s in found:
        assert f"| `{s.key}` |" in page, s.key
    # The environment variables and flags the loader knows are all named.
    for var in config._ENV:
        assert f"`{var}`" in page, var


def test_comments_are_read_as_written() -> None:
    gen = _gen()
    comments = gen.source_comments(
        "class A:\n"
        "    x: int = 1  # beside x\n"
        "    # above y,\n"
        "    # two lines\n"
        "    y: int = 2\n"
        "\n"
        "    # a block that a blank line ends\n"
        "\n"
        "    z: int = 3\n"
    )
    assert comments == {"x": "beside x", "y": "above y, two lines"}
    examples = gen.example_comments()
    assert examples[("lake", "root")].startswith("Delta tables at <root>/<schema>/<table>")
    assert "(default \"leaf\": a Delta table per partition)" in examples[("tables", "partitions")]


def test_every_exit_code_has_guidance() -> None:
    """Each code in pg2delta.errors is a row of the hand-written table that says what to do with it."""
    page = (ROOT / "docs" / "reference" / "exit-codes.md").read_text()
    guidance = page.split("<!-- generated: exit-codes -->")[0]
    rows = set(re.findall(r"^\| (\d+) \|", guidance, flags=re.M))
    codes = {str(code) for code, _name, _comment in _gen().exit_code_constants()}
    # 3 is the usual --idle-exit-code: the table's row "N" covers any idle code.
    assert codes - {str(errors.EXIT_NOTHING_TO_DO)} <= rows, codes - rows
    assert re.search(r"^\| N \| nothing to do, only with `--idle-exit-code N`", guidance, flags=re.M)


def test_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    for command in ("make demo", "make test"):
        assert command in readme
    # Every docs page it links exists.
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
    # Every exit code of pg2delta.errors is in its table (3 as the idle code N).
    for code, _name, _comment in _gen().exit_code_constants():
        if code != errors.EXIT_NOTHING_TO_DO:
            assert re.search(rf"^\| ([\d, ]*\b{code}\b[\d, ]*) \|", readme, flags=re.M), code


def test_paths_the_docs_name_exist() -> None:
    """A file or folder of the repository named in the docs (`src/...`, `tests/...`) is there: a
    module moved or a test renamed shows up here rather than as a dead pointer for the reader."""
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for path in re.findall(r"`((?:src|tests|tools|jobs|examples|conf|bench)/[^`\s<>…{}]*)`", page.read_text()):
            if not any(ROOT.glob(path.rstrip("/"))):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
