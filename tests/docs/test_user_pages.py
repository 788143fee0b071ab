"""User pages say what is true now: no commit hashes, no notes of what changed, no option
names that are gone; results carry their stamp; the README stays one sitting and holds
the command CI runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tests.docs.pages import DOCS, EXAMPLES, README, ROOT, user_pages

PAGES = user_pages()
IDS = [str(p.relative_to(ROOT)) for p in PAGES]

HASH = re.compile(r"(?<![\w./:#-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
"""7 to 40 hex digits, with at least one digit and one letter, standing alone: what a
commit hash looks like (a word such as ``facade`` has no digit, a number no letter)."""

CHANGE_NOTES = [
    r"\bno longer\b",
    r"\bused to\b",
    r"\bpreviously\b",
    r"\bformerly\b",
    r"\b(?:before|after|since|until) (?:this|that|the) change\b",
    r"\b(?:at|before|since|until|from) (?:revision|commit)\b",
    r"\(was `",
    r"\bwas renamed\b",
    r"\brenamed from\b",
]
"""Phrases of a note about what changed (the changelog's business, not a user page's)."""

BEFORE_NOW = re.compile(r"\b(?:before|was|were|used to)\b[^.]*\bnow\b|\bnow\b[^.]*\bbefore\b")

REMOVED = [
    "batch_size=",
    "strategy=",
    "remote_options=",
    "max_lag=",
    "start_timeout=",
    "stall_timeout=",
    "idle_timeout=",
    "sigterm_timeout=",
    "replica_threads=",
    "remote_bandwidth=",
    "remote_timeout=",
    'strategy="none"',
    "own_strategy",
    "strategy_impl",
    "LOWDIFF_BENCH_CHILD",
]
"""Spellings of lowdiff 0.1 that the pages must not teach."""

ALLOWED = {"max_lag=": re.compile(r"ReplicaOptions\([^)]*$")}
"""Where a removed flat option lives on as a field of an option object."""


def _lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), 1))


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_commit_hashes(page):
    found = [f"{n}: {m.group()}" for n, line in _lines(page) for m in HASH.finditer(line)]
    assert found == [], f"{page.name}: a commit hash; stamp results with the version, and keep history in commits"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_notes_of_what_changed(page):
    found = [
        f"{n}: {line.strip()}"
        for n, line in _lines(page)
        if any(re.search(p, line, re.IGNORECASE) for p in CHANGE_NOTES)
    ]
    text = re.sub(r"\s+", " ", page.read_text())
    found += [m.group() for m in BEFORE_NOW.finditer(text)]
    assert found == [], f"{page.name}: a note of what changed belongs in CHANGELOG.md"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_removed_option_names(page):
    found = []
    for n, line in _lines(page):
        for name in REMOVED:
            pattern = re.escape(name) if not name[0].isalpha() else rf"\b{re.escape(name)}"
            for m in re.finditer(pattern, line):
                allowed = ALLOWED.get(name)
                if allowed is None or not allowed.search(line[: m.start()]):
                    found.append(f"{n}: {name}")
    assert found == [], f"{page.name}: spellings of lowdiff 0.1"


LOWDIFF_CALLS = {"Checkpointer", "attach", "LowDiffCallback", "restore", "export"}


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_use_todays_spellings(example):
    """The options of 0.1 in a call of lowdiff's (a data loader's ``batch_size=`` is its
    own business)."""
    text = example.read_text()
    found = [
        name for name in ("own_strategy", "strategy_impl", "LOWDIFF_BENCH_CHILD") if name in text
    ]
    old = {n.rstrip("=") for n in REMOVED if n.endswith("=")} | {"persist_every"}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in LOWDIFF_CALLS:
                found += [f"line {node.lineno}: {k.arg}=" for k in node.keywords if k.arg in old]
    assert found == [], f"examples/{example.name}"


def test_the_readme_is_read_in_one_sitting():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    order = ["Status", "Install", "Quickstart", "Concepts", "LowDiff or LowDiff+", "Integrations",
             "Guarantees", "Results", "Limits", "Documentation", "Citation", "Licence"]  # fmt: skip
    assert headings == order


def test_the_readme_holds_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert command in README.read_text().splitlines()
    assert command in (ROOT / "CONTRIBUTING.md").read_text().splitlines()


def test_the_readme_lists_every_extra():
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([a-z0-9-]+) = \[", deps, re.MULTILINE))
    table = re.search(r"\| extra \|.*?\n\n", README.read_text(), re.DOTALL)
    assert table and extras
    rows = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table.group(), re.MULTILINE))
    assert rows == extras


def test_the_readme_results_carry_their_stamp():
    results = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"lowdiff \d+\.\d+\.\d+", results), "the version"
    rows = [r for r in results.splitlines() if r.startswith("| ") and not r.startswith("| ---")]
    header, *body = rows
    assert all(c in header for c in ("machine", "date", "command")), header
    for row in body:
        assert re.search(r"\d{4}-\d{2}-\d{2}", row) and re.search(r"\| `[^`]+` \|$", row), row


STAMPED = [DOCS / "benchmarks.md", DOCS / "chaos.md", DOCS / "torture.md"]
STAMP = re.compile(r"^\*lowdiff \d+\.\d+\.\d+ ·(.+?)\*$", re.MULTILINE | re.DOTALL)
RESULT = re.compile(r"\d(?: ?%| ?×|x\b| ms\b| s\b| s/step| MiB| KiB| GB/s)")


@pytest.mark.parametrize("page", STAMPED, ids=lambda p: p.name)
def test_results_tables_carry_one_stamp(page):
    """Every table of measured figures follows a stamp in its section: ``*lowdiff VERSION ·
    machine · date · `command`*``; a summary table that points at the stamped ones says so
    in a column of its own."""
    for part in re.split(r"^#{2,4} ", page.read_text(), flags=re.MULTILINE):
        paragraphs = part.split("\n\n")
        stamped = False
        for para in paragraphs:
            para = para.strip()
            m = STAMP.match(para)
            if m:
                stamp = m.group(1)
                assert re.search(r"\d{4}-\d{2}-\d{2}", stamp), f"{page.name}: no date in {para}"
                assert re.search(r"`[^`]+`", stamp), f"{page.name}: no command in {para}"
                stamped = True
            elif para.startswith("|") and RESULT.search(para.split("\n", 2)[-1]):
                header = para.splitlines()[0]
                assert stamped or "stamp" in header, (
                    f"{page.name}: a table without a stamp:\n{para[:300]}"
                )


def test_the_packaging_facts():
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"Operating System :: POSIX :: Linux"' in pyproject
    assert 'license = { text = "Apache-2.0" }' in pyproject
    citation = (ROOT / "CITATION.cff").read_text()
    assert "preferred-citation:" in citation and "Differential" in citation
