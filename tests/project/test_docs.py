"""The written front door: README.md stays short, every relative link in README.md and docs/
reaches a file of the repository, and benchmarks/RESULTS.md opens with its current figures.

Links are Markdown's `[text](target)`: a target with a scheme (`https:`, `mailto:`) or only an
anchor (`#section`) is not a file; for the others the anchor and query are dropped and the
path is taken relative to the page that holds the link. Fenced code blocks are not text, so a
link-shaped string inside one is not a link.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

README_MAX_LINES = 250
RESULTS_MAX_LINES = 400

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
FENCE = re.compile(r"^\s*(```|~~~)")
TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
TABLE_RULE = re.compile(r"^\s*\|(\s*:?-{3,}:?\s*\|)+\s*$")
HOW_WE_GOT_HERE = re.compile(r"^#{1,6}\s+how we got here\b", re.IGNORECASE)
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in `page` that names a file."""
    links = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if SCHEME.match(target) or target.startswith("#"):
                continue
            links.append((number, target))
    return links


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """`page:line: target` for each relative link of `page` whose file is not under `root`."""
    broken = []
    for number, target in relative_links(page):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(f"{page.relative_to(root)}:{number}: {target}")
    return broken


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def tables(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the header, data rows) of every Markdown table outside code blocks."""
    lines = prose_lines(text)
    found = []
    i = 0
    while i + 1 < len(lines):
        (number, header), (_, rule) = lines[i], lines[i + 1]
        if TABLE_ROW.match(header) and TABLE_RULE.match(rule):
            rows, j = [], i + 2
            while j < len(lines) and TABLE_ROW.match(lines[j][1]):
                rows.append(lines[j][1])
                j += 1
            found.append((number, rows))
            i = j
        else:
            i += 1
    return found


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_keeps_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


def test_every_relative_link_resolves():
    checked = [link for page in pages() for link in relative_links(page)]
    assert checked, "no relative links found: the link pattern no longer matches the pages"
    broken = [b for page in pages() for b in broken_links(page)]
    assert not broken, "links to files that are not in the repository:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# there\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/there.md#top), [missing](docs/no_such_page.md#x), [site](https://example.com), "
        "[anchor](#top), [outside](../elsewhere.md)\n```\n[in code](also_missing.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path.parent / "elsewhere.md").write_text("outside the repository\n", encoding="utf-8")
    targets = [t for _, t in relative_links(page)]
    assert targets == ["docs/there.md#top", "docs/no_such_page.md#x", "../elsewhere.md"]
    assert broken_links(page, root=tmp_path) == ["README.md:1: docs/no_such_page.md#x", "README.md:1: ../elsewhere.md"]


def test_results_is_a_page_of_current_figures():
    text = RESULTS.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= RESULTS_MAX_LINES, f"RESULTS.md has {len(lines)} lines; history lives in git"
    found = tables(text)
    assert found, "RESULTS.md has no table of figures"
    first_table = found[0][0]
    sections = [n for n, line in prose_lines(text) if HOW_WE_GOT_HERE.match(line)]
    assert all(first_table < n for n in sections), "the first table must come before 'How we got here'"


def test_every_figure_row_names_its_commit_and_date():
    text = RESULTS.read_text(encoding="utf-8")
    end = min((n for n, line in prose_lines(text) if HOW_WE_GOT_HERE.match(line)), default=len(text.splitlines()) + 1)
    rows = [row for number, body in tables(text) if number < end for row in body]
    assert rows
    missing = [row for row in rows if not (COMMIT.search(row) and DATE.search(row))]
    assert not missing, "rows without a commit and a date:\n" + "\n".join(missing)


def test_the_pages_speak_of_the_project_only():
    """No machine paths and no numbered work sessions or issues in the front door."""
    banned = re.compile(r"\b[Ss]essions? [0-9]+|\b[Ii]ssues? [0-9]+|/work/|/root/|\.pyenv/")
    hits = []
    for page in [*pages(), RESULTS]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if banned.search(line):
                hits.append(f"{page.relative_to(ROOT)}:{number}: {banned.search(line).group(0)}")
    assert not hits, "\n".join(hits)
