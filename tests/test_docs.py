"""The docs stay reference pages, and measurements stay results.

- every docs/*.md page is at most MAX_LINES lines;
- no markdown heading in docs/*.md carries a date (YYYY-MM-DD, or a month
  name with a year), except docs/results.md, the one page that summarises
  measurements by date;
- every relative link ``](path)`` and every backticked or bare repository
  path to a .md file (``docs/x.md``) in docs/*.md and README.md exists, and
  every link from docs/results.md to a results file exists, and every
  results file is linked from it;
- every benchmarks/results/*.json is named ``<YYYY-MM-DD>-<topic>.json``,
  parses, and has the keys of a result (docs/results.md, "Format").

Pure file checks: no engine, no compiled module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
MAX_LINES = 600
RESULT_KEYS = {"date", "command", "cpu", "commit", "figures", "notes"}

MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|December"
          "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec")
DATE = re.compile(rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b(?:{MONTHS})\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?\d{{4}}\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BACKTICKED = re.compile(r"`([^`\s]+\.md)`")
BARE_DOC = re.compile(r"(?<![\w./-])(docs/[\w./-]+?\.md)\b")


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def pages_with_readme() -> list[Path]:
    return [*doc_pages(), ROOT / "README.md"]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def headings(text: str) -> list[tuple[int, str]]:
    """Markdown ATX headings outside fenced code blocks, with line numbers."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced and re.match(r"#{1,6}\s", line):
            out.append((n, line))
    return out


def md_targets(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved path) for every .md path the page names: links
    resolve against the page's folder, repository paths against the root."""
    text = page.read_text(encoding="utf-8")
    found = []
    for target in LINK.findall(text):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor or a URL
            continue
        if path.endswith(".md") or page.name == "results.md" and path.endswith(".json"):
            found.append((target, (page.parent / path).resolve()))
    for path in BACKTICKED.findall(text):
        if "/" in path or path == "README.md":
            found.append((path, (ROOT / path).resolve()))
    for path in BARE_DOC.findall(text):
        found.append((path, (ROOT / path).resolve()))
    return found


def test_there_are_pages():
    assert len(doc_pages()) >= 5


@pytest.mark.parametrize("page", doc_pages(), ids=rel)
def test_page_length(page):
    n = len(page.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"{rel(page)}: expected at most {MAX_LINES} lines, got {n} (split it by topic)"


@pytest.mark.parametrize("page", [p for p in doc_pages() if p.name != "results.md"], ids=rel)
def test_no_dated_headings(page):
    dated = [f"line {n}: {h}" for n, h in headings(page.read_text(encoding="utf-8")) if DATE.search(h)]
    assert not dated, (f"{rel(page)}: expected reference headings without dates (dated measurements "
                       f"belong in benchmarks/results/ and docs/results.md), got {dated}")


@pytest.mark.parametrize("page", pages_with_readme(), ids=rel)
def test_md_links_exist(page):
    missing = sorted({written for written, path in md_targets(page) if not path.is_file()})
    assert not missing, f"{rel(page)}: expected every linked .md path to exist, missing {missing}"


def test_there_are_results():
    assert sorted(RESULTS.glob("*.json")), f"expected measurement results in {rel(RESULTS)}/, got none"


def test_results_page_links_every_result():
    page = DOCS / "results.md"
    linked = {path for _, path in md_targets(page)} if page.is_file() else set()
    unlinked = [p.name for p in sorted(RESULTS.glob("*.json")) if p.resolve() not in linked]
    assert not unlinked, f"docs/results.md: expected a link to every result, missing {unlinked}"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=rel)
def test_result_file(path):
    m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})-[a-z0-9]+(?:-[a-z0-9]+)*\.json", path.name)
    assert m, f"{rel(path)}: expected a name <YYYY-MM-DD>-<topic>.json (lower case, dashes)"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        pytest.fail(f"{rel(path)}: expected JSON, got {e}")
    assert isinstance(data, dict), f"{rel(path)}: expected an object, got {type(data).__name__}"
    missing = RESULT_KEYS - data.keys()
    assert not missing, f"{rel(path)}: expected keys {sorted(RESULT_KEYS)}, missing {sorted(missing)}"
    assert data["date"] == m.group(1), f"{rel(path)}: expected date {m.group(1)} (the name's), got {data['date']!r}"
    assert isinstance(data["command"], (str, list)) and data["command"], f"{rel(path)}: command: expected text"
    assert isinstance(data["cpu"], str) and data["cpu"], f"{rel(path)}: cpu: expected the machine, as text"
    assert data["commit"] is None or re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]), \
        f"{rel(path)}: commit: expected a hash or null, got {data['commit']!r}"
    assert isinstance(data["figures"], dict) and data["figures"], f"{rel(path)}: figures: expected an object"
    assert isinstance(data["notes"], str), f"{rel(path)}: notes: expected text"
