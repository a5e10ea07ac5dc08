"""The documentation: the MkDocs site builds in strict mode (a broken link, a page missing from the nav or
a link to a file outside docs/ fails), the architecture page names every engine module and no module
that does not exist, and no page or heading carries a tracker number."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_the_site_builds_in_strict_mode(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # raises mkdocs.exceptions.Abort on any warning under strict
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_the_architecture_page_names_every_engine_module_and_only_modules_that_exist():
    page = (DOCS / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z_]+\.py)`", page)) | set(re.findall(r"`([a-z_]+/)`", page))
    engine = {p for p in (ROOT / "workbench").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(str(p.relative_to(ROOT)) for p in engine if p.name not in named)
    assert not missing, f"docs/architecture.md does not say what these hold: {missing}"
    packages = sorted(p.name + "/" for p in (ROOT / "workbench").iterdir() if (p / "__init__.py").is_file())
    assert [p for p in packages if p not in named] == []
    everywhere = {p.name for folder in ("workbench", "widgets", "benchmarks", "planner", "testbed", "tests")
                  for p in (ROOT / folder).rglob("*.py")}
    invented = sorted(name for name in named if name.endswith(".py") and name not in everywhere)
    assert not invented, f"docs/architecture.md names modules that do not exist: {invented}"


def test_no_heading_or_sentence_carries_a_tracker_number():
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        found = re.findall(r"\(issue \d+\)|issue #\d+|\bissue \d+\b", page.read_text())
        assert not found, f"{page.name}: {found}"
