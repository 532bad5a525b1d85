"""The docs a newcomer follows: every link lands, the README stays short, node.yaml lists every key, the module map
matches the modules, and the docs stay references a user can read without our tracker."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from datastates.daemon.config import CurveConfig, NodeConfig, StorageConfig
from datastates.protocol.descriptors import Tier

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250
DOCS_MAX_WORDS = 30_000
PRODUCT = ("protocol", "client", "daemon", "integrations", "datastates")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(page: Path) -> str:
    """The page without its fenced code blocks, where brackets are code, not links."""
    return _FENCE.sub("", page.read_text())


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as '-'."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_prose(page)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page)) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_lands(page: Path) -> None:
    """Each relative link names an existing file, and each #anchor a heading of the page it points to."""
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_stays_short() -> None:
    """The README is the first screen and the way in; reference tables live in docs/."""
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (limit {README_MAX_LINES})"


def test_the_readme_starts_with_the_two_set_up_commands() -> None:
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:15])
    assert "make run" in first_screen and "make test" in first_screen


def _keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("section,cls", [("", NodeConfig), ("storage", StorageConfig), ("storage.tiers[]", Tier),
                                         ("curve", CurveConfig)])
def test_node_yaml_lists_every_config_key(section: str, cls: type) -> None:
    """deploy/node.yaml names every key daemon/config.py takes, set or commented out, nested ones in place."""
    text = (REPO / "deploy" / "node.yaml").read_text()
    missing = []
    for key in _keys(cls):
        top = rf"^(# )?{key}:"  # a top-level key, set or commented out
        nested = rf"^\s*#?\s+{key}:|[{{,]\s*{key}:"  # indented under its section, or inside a flow mapping
        if not re.search(top if not section else nested, text, re.M):
            missing.append(f"{section}.{key}" if section else key)
    assert not missing, f"deploy/node.yaml does not list {missing}"


def test_no_page_points_at_the_tracker() -> None:
    """A user has no issue list: a page says what holds, not which ticket it came from."""
    mention = re.compile(r"\bissue\s*#?\s*\d+", re.I)
    found = [f"{page.relative_to(REPO)}: {m.group(0)!r}" for page in PAGES for m in mention.finditer(page.read_text())]
    assert not found, "pages name tracker items: " + "; ".join(found)


def test_no_code_comment_or_test_points_at_the_tracker() -> None:
    """What the code, its comments and its tests say stands on its own: the reason, not the ticket it came from."""
    mention = re.compile(r"issues? #?[0-9]", re.I)
    tracked = subprocess.run(["git", "ls-files", "-z", "--", "*.py", "*.sh", ".ci/run", "Makefile"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split("\0")
    found = [f"{name}:{n}: {line.strip()[:80]!r}" for name in tracked if name
             for n, line in enumerate((REPO / name).read_text().splitlines(), 1) if mention.search(line)]
    assert not found, "tracked files name tracker items: " + "; ".join(found)


def test_the_docs_stay_under_their_word_budget() -> None:
    """References, not notebooks: history lives in git."""
    words = sum(len(page.read_text().split()) for page in (REPO / "docs").glob("*.md"))
    assert words < DOCS_MAX_WORDS, f"docs/ holds {words} words (limit {DOCS_MAX_WORDS}): cut repetition and history"


def _product_modules() -> dict[str, Path]:
    """Every module of the product by its path from the repository root; ``datastates/``'s links to the other
    folders are skipped, and so are empty ``__init__.py`` files."""
    modules = {}
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO)
            if any((REPO / parent).is_symlink() for parent in rel.parents) or not path.read_text().strip():
                continue
            modules[rel.as_posix()] = path
    return modules


def test_the_module_map_names_every_module_by_its_own_first_docstring_line() -> None:
    """docs/architecture.md's map has one line per module, `path`: the module's first docstring line."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    mapped = dict(re.findall(r"^- `([\w/]+\.py)`: (.*)$", section, re.M))
    modules = _product_modules()
    wrong = []
    for name, path in modules.items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc:
            wrong.append(f"{name} has no docstring")
        elif name not in mapped:
            wrong.append(f"{name} is missing from the map")
        elif mapped[name] != doc.splitlines()[0]:
            wrong.append(f"{name}: the map says {mapped[name]!r}, its docstring {doc.splitlines()[0]!r}")
    wrong += [f"{name} is in the map but is no module" for name in mapped if name not in modules]
    assert not wrong, "docs/architecture.md's module map: " + "; ".join(wrong)
