"""Section citations of the reference pages in docs/.

A citation names a page and section numbers: `docs/<page>.md §3`, `§2.1`, a range `§5.2-5.5`
or `§3-§5`, or a list `§0, §1, §4`. Every citation in a tracked file must name a page that
exists and only section numbers that page has; a page has section N when one of its Markdown
headings starts with `§N`. Inside a page with numbered sections, a bare `§N` refers to that page
and must exist there too.

The code also still cites the production reference documents by their old names (`SPEC §1`,
`NVFP4.md §3`, ...); each has a page in docs/ with the same numbering (`LEGACY_PAGES`), so
those citations must resolve there as well, which keeps a mechanical rewrite of them sound.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Old document name -> its page in docs/ (same section numbers).
LEGACY_PAGES: dict[str, str] = {
    "MUSE_CHAT": "muse_chat",
    "NVFP4": "nvfp4",
    "PARALLEL": "parallel",
    "DSPARK": "speculative",
    "SPEC": "spec",
}
# Pages whose numbering the code relies on.
REFERENCE_PAGES = tuple(LEGACY_PAGES.values())

_NUM = r"\d+(?:\.\d+)*"
_ITEM = rf"§\s*{_NUM}(?:\s*[-–]\s*§?\s*{_NUM})?"
_ITEMS = rf"(?P<items>{_ITEM}(?:\s*(?:,|and)\s*{_ITEM})*)"
_LEGACY = "|".join(LEGACY_PAGES)
CITATION = re.compile(rf"docs/(?P<page>[A-Za-z0-9_-]+)\.md\s+{_ITEMS}")
LEGACY_CITATION = re.compile(rf"(?<![A-Za-z0-9_])(?P<doc>{_LEGACY})(?:\.md)?\s+{_ITEMS}")
HEADING = re.compile(rf"^#{{1,6}}\s+§\s*({_NUM})(?![0-9.]*[0-9])", re.M)
_NUMBERS = re.compile(_NUM)

MAX_BYTES = 2_000_000  # larger tracked files are data (weights, tokenizers), not prose


def section_numbers(items: str) -> list[str]:
    """The section numbers named by one citation's items (both ends of a range)."""
    return _NUMBERS.findall(items)


def page_sections(text: str) -> set[str]:
    """The section numbers a page defines: headings that start with `§N`."""
    return set(HEADING.findall(text))


def citations(text: str) -> Iterator[tuple[str, list[str]]]:
    """(page, section numbers) of every `docs/<page>.md §N…` citation in `text`."""
    for m in CITATION.finditer(text):
        yield m["page"], section_numbers(m["items"])


def legacy_citations(text: str) -> Iterator[tuple[str, list[str]]]:
    """(page, section numbers) of every citation of an old document name in `text`."""
    for m in LEGACY_CITATION.finditer(text):
        yield LEGACY_PAGES[m["doc"]], section_numbers(m["items"])


def bare_references(text: str) -> list[str]:
    """Section numbers of `§N` references in a page that are not part of a citation of
    another page (those are checked as citations)."""
    stripped = LEGACY_CITATION.sub(" ", CITATION.sub(" ", text))
    stripped = HEADING.sub(" ", stripped)
    return [n for m in re.finditer(_ITEMS, stripped) for n in section_numbers(m["items"])]


def check_text(text: str, pages: Mapping[str, set[str]], own_page: str | None = None) -> list[str]:
    """Problems with the citations in `text`, given each page's sections. `own_page`: the
    page `text` is (its bare `§N` references are then checked against it)."""
    problems = []
    for kind, found in (("", citations(text)), ("old-name ", legacy_citations(text))):
        for page, numbers in found:
            if page not in pages:
                problems.append(f"{kind}citation of docs/{page}.md: no such page")
                continue
            problems += [
                f"{kind}citation of docs/{page}.md §{n}: the page has no section {n}"
                for n in numbers
                if n not in pages[page]
            ]
    if own_page is not None and pages.get(own_page):
        problems += [
            f"reference §{n} inside docs/{own_page}.md: the page has no section {n}"
            for n in bare_references(text)
            if n not in pages[own_page]
        ]
    return problems


def tracked_files() -> list[Path]:
    """The repository's files: tracked, plus new ones git does not ignore."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in ROOT.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts)]
    return [p for p in files if p.is_file()]


def read_text(path: Path) -> str | None:
    if path.stat().st_size > MAX_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def doc_pages() -> dict[str, set[str]]:
    return {p.stem: page_sections(p.read_text(encoding="utf-8")) for p in sorted(DOCS.glob("*.md"))}


# -- the helpers find planted mistakes ------------------------------------------------------------
# Planted citations are assembled at run time, so this file's own text cites nothing missing.

PAGES = {"nvfp4": {"1", "2", "3", "5", "5.2", "5.5"}, "parallel": {"0", "10"}}


def cite(page: str, items: str) -> str:
    return "docs/" + page + ".md " + items


def test_a_valid_citation_passes():
    text = f"see {cite('nvfp4', '§3')}, and {cite('parallel', '§10')}'s table; {cite('nvfp4', '§5.2-5.5')}"
    assert check_text(text, PAGES) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (cite("nvfp4", "§4"), cite("nvfp4", "§4") + ": the page has no section 4"),
        (cite("nosuch", "§1"), "docs/" + "nosuch.md: no such page"),
        (cite("nvfp4", "§5.2-5.3"), cite("nvfp4", "§5.3") + ": the page has no section 5.3"),
        (cite("nvfp4", "§1-§4"), cite("nvfp4", "§4") + ": the page has no section 4"),
        (cite("parallel", "§0, §1, §10"), cite("parallel", "§1") + ": the page has no section 1"),
        ("(" + "NVFP4" + ".md §42)", "old-name citation of " + cite("nvfp4", "§42")),
        ("PARALLEL" + " §3", "old-name citation of " + cite("parallel", "§3")),
    ],
)
def test_a_planted_bad_citation_is_found(text, problem):
    problems = check_text(text, PAGES)
    assert any(problem in p for p in problems), problems


def test_a_bad_reference_inside_a_page_is_found():
    page = "## §1 One\n\nsee §1 and §2\n\n## §2 Two\n\nsee §3\n"
    pages = {"page": page_sections(page)}
    assert pages["page"] == {"1", "2"}
    assert check_text(page, pages, own_page="page") == ["reference §3 inside docs/page.md: the page has no section 3"]


def test_headings_define_sections():
    text = "# Title\n## §2 A\n### §2.1 B\n#### §10 C\n## 3 not numbered with §\nbody §4\n"
    assert page_sections(text) == {"2", "2.1", "10"}


# -- the repository --------------------------------------------------------------------------------


def test_reference_pages_exist_with_numbered_sections():
    pages = doc_pages()
    for name in REFERENCE_PAGES:
        assert name in pages, f"docs/{name}.md is missing"
        assert pages[name], f"docs/{name}.md has no `## §N` headings"


def test_every_citation_in_the_repository_resolves():
    pages = doc_pages()
    problems = []
    for path in tracked_files():
        text = read_text(path)
        if text is None:
            continue
        own = path.stem if path.parent == DOCS and path.suffix == ".md" else None
        rel = path.relative_to(ROOT)
        problems += [f"{rel}: {p}" for p in check_text(text, pages, own_page=own)]
    assert problems == [], "\n".join(problems)


def test_the_reference_pages_are_cited():
    """The scan is not vacuous: the docs cite each other and the code cites their numbers."""
    found: set[str] = set()
    for path in tracked_files():
        text = read_text(path)
        if text is not None:
            found |= {page for page, _ in citations(text)} | {page for page, _ in legacy_citations(text)}
    missing = set(REFERENCE_PAGES) - found
    assert not missing, f"no citation of {sorted(missing)} found"
