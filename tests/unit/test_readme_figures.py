"""The README's cost table says what BENCHMARKS.md's latest stock check measured (within 10 %).

The latest stock check is the first (newest) section of BENCHMARKS.md that has a row or paragraph running
``scripts/stock-check.sh`` with figures in it, one ``.ci/run`` at least not beside other work (a check whose every
run was loaded proves the commands pass, not what they cost a quiet machine). From that text, each distribution's
clause (from its name to the next one's) gives the quickstart's seconds, then ``.ci/run``'s (``loaded`` after a
figure marks a run beside other work), and the passed count. A section that states no skipped count for the stock
machines (3ae90d8's states only ``919 passed``) gives it as the test count less that passed count, the test count
being the whole check's (``CI=true bash .ci/run``: passed plus skipped) of the same section, the same commit's
suite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION = re.compile(r"\b(?:noble|bookworm|trixie)\b")
TOLERANCE = 0.10
NUMBER = r"\d{1,3}(?:[ ,]\d{3})+|\d+"  # 1032, 1 032, 1,032


def _int(text: str) -> int:
    return int(re.sub(r"[ ,]", "", text))


@dataclass
class StockCheck:
    heading: str
    quickstart_s: dict[str, float] = field(default_factory=dict)
    ci_s: dict[str, float] = field(default_factory=dict)
    ci_loaded_s: dict[str, float] = field(default_factory=dict)
    passed: int | None = None
    skipped: int | None = None
    tests: int | None = None


def _chunks(section: str) -> list[str]:
    """A section's paragraphs, each table row on its own."""
    out = []
    for para in re.split(r"\n\s*\n", section):
        if para.lstrip().startswith("|"):
            out += para.splitlines()
        else:
            out.append(para)
    return out


def _read_stock(heading: str, text: str) -> StockCheck | None:
    """The figures of one stock-check row or paragraph (None when it holds none)."""
    check = StockCheck(heading)
    plain = re.sub(r"`[^`]*`", "", text)  # the command and its arguments name the distributions too
    names = [(m.start(), m.group(0)) for m in DISTRIBUTION.finditer(plain)]
    for i, (start, name) in enumerate(names):
        clause = plain[start : names[i + 1][0] if i + 1 < len(names) else len(plain)]
        seconds = re.findall(r"\b(\d+(?:\.\d+)?) s\b( loaded)?", clause)
        if len(seconds) < 2 or name in check.quickstart_s:
            continue
        check.quickstart_s[name] = float(seconds[0][0])
        (check.ci_loaded_s if seconds[1][1] else check.ci_s)[name] = float(seconds[1][0])
    if not check.quickstart_s:
        return None
    passed = re.findall(rf"({NUMBER}) passed", plain)
    skipped = re.findall(rf"({NUMBER}) skipped", plain)
    check.passed = _int(passed[0]) if passed else None
    check.skipped = _int(skipped[0]) if skipped else None
    return check


def latest_stock_check(text: str) -> StockCheck:
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    for section in sections:
        heading = section.splitlines()[0].strip()
        for chunk in _chunks(section):
            if "stock-check.sh" not in chunk:
                continue
            check = _read_stock(heading, chunk)
            if check is None or not check.ci_s:
                continue  # no figure, or every `.ci/run` beside other work: not what the table's quiet machine costs
            whole = [c for c in _chunks(section) if "CI=true" in c and "stock-check.sh" not in c]
            for c in whole:
                m = re.search(rf"({NUMBER}) passed, ({NUMBER}) skipped", c)
                if m:
                    check.tests = _int(m.group(1)) + _int(m.group(2))
                    break
            if check.skipped is None and check.tests is not None and check.passed is not None:
                check.skipped = check.tests - check.passed
            return check
    raise AssertionError("BENCHMARKS.md: no section with a stock-check.sh row or paragraph holding figures")


@dataclass
class CostTable:
    quickstart_s: tuple[float, float]
    ci_s: tuple[float, float]
    ci_loaded_s: float | None
    tests: int | None
    passed: int | None
    skipped: int | None


def readme_cost_table(text: str) -> CostTable:
    section = text[text.index("What each command costs and leaves") :]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `bash (examples/quickstart\.sh|\.ci/run)` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert set(rows) == {"examples/quickstart.sh", ".ci/run"}, f"README's cost table: rows found {sorted(rows)}"

    def span(name: str) -> tuple[float, float]:
        m = re.search(r"(\d+(?:\.\d+)?) s to (\d+(?:\.\d+)?) s", rows[name])
        assert m, f"README's cost table: no 'N s to M s' in the time of {name}: {rows[name]!r}"
        return float(m.group(1)), float(m.group(2))

    ci = rows[".ci/run"]

    def count(pattern: str) -> int | None:
        m = re.search(rf"({NUMBER}) {pattern}", ci)
        return _int(m.group(1)) if m else None

    loaded = re.search(r"\((\d+(?:\.\d+)?) s [^;)]*(?:loaded|beside|busy)", ci)
    return CostTable(
        quickstart_s=span("examples/quickstart.sh"),
        ci_s=span(".ci/run"),
        ci_loaded_s=float(loaded.group(1)) if loaded else None,
        tests=count("tests"),
        passed=count("passed"),
        skipped=count("skipped"),
    )


def _close(readme: float, bench: float) -> bool:
    return abs(readme - bench) <= TOLERANCE * max(abs(bench), 1)


def disagreements(readme: CostTable, bench: StockCheck) -> list[str]:
    where = f"BENCHMARKS.md's latest stock check ({bench.heading!r})"
    pairs: list[tuple[str, float | None, float | None]] = []
    if bench.quickstart_s:
        pairs += [
            ("the quickstart's fastest seconds", readme.quickstart_s[0], min(bench.quickstart_s.values())),
            ("the quickstart's slowest seconds", readme.quickstart_s[1], max(bench.quickstart_s.values())),
        ]
    if bench.ci_s:
        pairs += [
            (".ci/run's fastest seconds", readme.ci_s[0], min(bench.ci_s.values())),
            (".ci/run's slowest seconds", readme.ci_s[1], max(bench.ci_s.values())),
        ]
    if bench.ci_loaded_s:
        pairs.append((".ci/run's loaded seconds", readme.ci_loaded_s, max(bench.ci_loaded_s.values())))
    pairs += [
        ("the test count", readme.tests, bench.tests),
        ("the passed count", readme.passed, bench.passed),
        ("the skipped count", readme.skipped, bench.skipped),
    ]
    out = []
    for name, said, measured in pairs:
        if measured is None:
            continue  # not stated there: nothing to hold the README to
        if said is None:
            out.append(f"{name}: the README states none, {where} says {measured:g}")
        elif not _close(said, measured):
            out.append(f"{name}: the README says {said:g}, {where} says {measured:g} (more than 10 % apart)")
    return out


def test_the_readme_cost_table_has_the_latest_stock_checks_figures() -> None:
    bench = latest_stock_check((REPO / "BENCHMARKS.md").read_text(encoding="utf-8"))
    assert bench.ci_s and bench.passed is not None and bench.skipped is not None, bench  # the parser read it
    readme = readme_cost_table((REPO / "README.md").read_text(encoding="utf-8"))
    problems = disagreements(readme, bench)
    assert not problems, "\n".join(problems)


def test_the_parsers_read_both_ways_benchmarks_writes_a_stock_check() -> None:
    """A table row (3ae90d8's) and a paragraph with skipped counts (d5a09d6's); a disagreement names its figure."""
    row = (
        "## Newest (stop 53)\n\n| check | figure |\n|---|---|\n"
        "| `CI=true bash .ci/run`, fresh clone | **exit 0**, 1028 passed, 4 skipped, 30 min 05 s |\n"
        "| `STOCK_NETWORKS=host bash scripts/stock-check.sh noble bookworm trixie` | every step exit 0: noble "
        "3.12.3 (quickstart 55 s, `.ci/run` 1562 s loaded, 919 passed), bookworm 3.11.2 (50 s, 386 s), trixie "
        "3.13.5 (33 s, 304 s); the tool venv/pipx 7-32 s each |\n\n"
        "## Older\n\n**The stock machines** (`bash scripts/stock-check.sh noble`): noble: quickstart 9 s, 9 s.\n"
    )
    got = latest_stock_check(row)
    assert got.heading == "Newest (stop 53)"
    assert got.quickstart_s == {"noble": 55, "bookworm": 50, "trixie": 33}
    assert got.ci_s == {"bookworm": 386, "trixie": 304} and got.ci_loaded_s == {"noble": 1562}
    assert (got.tests, got.passed, got.skipped) == (1032, 919, 113)

    para = (
        "## Stop 52\n\n**The stock machines** at d5a09d6 (`STOCK_NETWORKS=host bash scripts/stock-check.sh noble\n"
        "bookworm trixie`): every step exit 0. Ubuntu noble (3.12.3):\nquickstart 61 s, `.ci/run` 1710 s loaded "
        "(917 passed, 113 skipped), the tool offline venv 18 s, pipx 27 s;\nDebian bookworm (3.11.2): 46 s, 339 s "
        "(917 passed), 8 s, 15 s; Debian trixie (3.13.5): 27 s, 301 s (917\npassed), 8 s, 18 s.\n"
    )
    got = latest_stock_check(para)
    assert got.quickstart_s == {"noble": 61, "bookworm": 46, "trixie": 27}
    assert got.ci_s == {"bookworm": 339, "trixie": 301} and got.ci_loaded_s == {"noble": 1710}
    assert (got.passed, got.skipped) == (917, 113)

    readme = readme_cost_table(
        "What each command costs and leaves\n\n| | time |\n|---|---|\n"
        "| `bash examples/quickstart.sh` | 17 s to 22 s (115 s on a busy host), most of it pip |\n"
        "| `bash .ci/run` | 260 s to 300 s (864 tests; 90 skipped there) |\n"
    )
    assert (readme.quickstart_s, readme.ci_s, readme.tests, readme.skipped) == ((17, 22), (260, 300), 864, 90)
    problems = disagreements(readme, latest_stock_check(row))
    assert "the quickstart's fastest seconds: the README says 17, BENCHMARKS.md's latest stock check" in problems[0]
    assert any(p.startswith("the test count: the README says 864") and "says 1032 (more" in p for p in problems)
    assert any(p.startswith("the skipped count: the README says 90") and "says 113 (more" in p for p in problems)
    assert any(p.startswith("the passed count: the README states none") for p in problems), problems


def test_a_stock_check_whose_every_run_was_loaded_is_not_the_tables() -> None:
    text = (
        "## Newest\n\n| `STOCK_NETWORKS=host bash scripts/stock-check.sh noble bookworm` | noble (quickstart 49 s, "
        "`.ci/run` 749 s loaded), bookworm (38 s, 509 s loaded) |\n\n"
        "## Older\n\n| `bash scripts/stock-check.sh bookworm` | bookworm (50 s, 386 s, 919 passed) |\n"
    )
    got = latest_stock_check(text)
    assert got.heading == "Older" and got.ci_s == {"bookworm": 386}
