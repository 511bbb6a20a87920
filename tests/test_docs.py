"""The README and docs stay what a newcomer can use: a README read in five minutes, no issue
numbers a reader cannot see, every measured figure in one place (docs/results.md), links that
lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
README_MAX_LINES = 250


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_reads_in_five_minutes() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    longest = max(lines, key=len)
    assert len(longest) <= 200 or longest.startswith("|"), f"a prose line of {len(longest)} characters"


ISSUE = re.compile(r"\bissues? ?#?\d+|\bthe issue(?:'s)?\b", re.IGNORECASE)


def test_no_issue_numbers_in_the_product_docs() -> None:
    """A reader has no access to the tracker: say what the thing is instead."""
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
        for page in _pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not found, "\n".join(found)


# What counts as a figure, for the one-place check. A measured figure restated elsewhere is
# nearly always restated with its neighbours, so two kinds are told apart:
# - distinctive on its own: a series ("26.2 / 29.2 / 32.5"), a number with thousands separators
#   ("12,656"), three decimals ("1.098"): the chance that another measurement prints the same is
#   small, so one occurrence elsewhere is a repeat;
# - common on its own: a decimal with a unit or a ratio ("31.0 ms", "1.91x"): two measurements
#   often share one by chance, so it counts as a repeat only beside another figure of the same
#   row (within 300 characters).
# Text in code spans (commands, flags) and links is not a figure. Table lines of the topic pages
# are left out: a detailed table there is the story a results row sums up in a line or two, and
# the row links to it; prose that restates the row is what this check finds.
DISTINCTIVE = re.compile(r"\d[\d.,]*(?:\s*/\s*\d[\d.,]*)+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d\.\d{3,}")
COMMON = re.compile(r"\d+\.\d+\s?(?:ms|s|x|%)(?!\w)|x\d+\.\d+")
NEAR = 300
TIMES = "\u00d7"  # the multiplication sign some pages write ratios with


def _figures(pattern: re.Pattern[str], cell: str) -> set[str]:
    text = re.sub(r"`[^`]*`|<[^>]+>|\[[^\]]*\]\([^)]*\)", " ", cell).replace(TIMES, "x")
    found = {re.sub(r"\s+", " ", f).strip(" ,.") for f in pattern.findall(text)}
    return {f for f in found if len(re.sub(r"\D", "", f)) >= 3}


def _occurrences(figure: str, text: str) -> list[re.Match[str]]:
    body = re.escape(figure).replace(r"\ ", r"\s?")
    return list(re.finditer(rf"(?<![\d.,]){body}(?!\d)", text))


def _results_rows() -> dict[str, list[str]]:
    """{anchor: [what, date, commit, machine, command, figure]} of every results row."""
    rows = {}
    for line in RESULTS.read_text().splitlines():
        anchor = re.match(r'\| <a id="([a-z0-9-]+)"></a>', line)
        if anchor:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            assert anchor.group(1) not in rows, f"two rows named {anchor.group(1)}"
            rows[anchor.group(1)] = cells
    return rows


def test_every_results_row_says_when_where_and_how() -> None:
    rows = _results_rows()
    assert len(rows) >= 20
    for name, (what, date, commit, machine, command, figure) in rows.items():
        assert what and machine and figure, name
        assert command.startswith(("`", "the ")), f"{name}: the command that measured it"
        if "to be confirmed" not in figure:
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"{name}: date {date!r}"
            assert re.fullmatch(r"[0-9a-f]{7,12}", commit), f"{name}: commit {commit!r}"


def test_each_figure_of_the_results_page_appears_nowhere_else() -> None:
    pages = {
        page: " ".join(
            line for line in page.read_text().replace(TIMES, "x").splitlines() if not line.lstrip().startswith("|")
        )
        for page in _pages()
        if page != RESULTS
    }
    repeats = []
    for name, cells in _results_rows().items():
        distinctive, common = _figures(DISTINCTIVE, cells[-1]), _figures(COMMON, cells[-1])
        for page, text in pages.items():
            where = page.relative_to(ROOT)
            repeats += [f"{where}: {f!r} (row {name})" for f in distinctive if _occurrences(f, text)]
            for figure in common:
                for match in _occurrences(figure, text):
                    near = text[max(0, match.start() - NEAR) : match.end() + NEAR]
                    partners = sorted(g for g in (distinctive | common) - {figure} if _occurrences(g, near))
                    if partners:
                        repeats.append(f"{where}: {figure!r} beside {partners} (row {name})")
    assert not repeats, "figures of docs/results.md repeated; link to the row instead:\n" + "\n".join(repeats)


def test_the_check_finds_a_repeated_figure() -> None:
    """The heuristic above, on a row and a page made up here: it must catch what it claims."""
    cell = "p99 26.2 / 29.2 / 32.5 ms, 12,656 req/s, straggler 1.91x, slowdown 1.86x, `--rates 20,60,120`"
    assert _figures(DISTINCTIVE, cell) == {"26.2 / 29.2 / 32.5", "12,656"}
    assert _figures(COMMON, cell) == {"32.5 ms", "1.91x", "1.86x"}
    assert _occurrences("12,656", "it sustained 12,656 req/s")
    assert not _occurrences("12,656", "it sustained 112,656 req/s")
    assert _occurrences("26.2 / 29.2 / 32.5", "p99 26.2/29.2/32.5 ms")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors, and explicit <a id> ones."""
    text = page.read_text()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_links_lead_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"
