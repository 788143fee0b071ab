"""The documentation's files, and the code blocks the tests take from them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"

NOT_USER_PAGES = {DOCS / "changelog.md"}
"""The changelog says what changed; every other page says what is true now."""


def user_pages() -> list[Path]:
    """The README, CONTRIBUTING.md and every docs page but the changelog."""
    pages = [README, ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in pages if p not in NOT_USER_PAGES]


def section(path: Path, name: str) -> str:
    """The text between ``--8<-- [start:NAME]`` and ``--8<-- [end:NAME]`` (the sections
    the docs include with pymdownx.snippets)."""
    text = path.read_text()
    m = re.search(
        rf"^[^\n]*--8<-- \[start:{re.escape(name)}\][^\n]*\n(.*?)^[^\n]*--8<-- \[end:{re.escape(name)}\]",
        text,
        re.MULTILINE | re.DOTALL,
    )
    assert m, f"{path.name}: no section {name!r}"
    return m.group(1)


def first_block(text: str, lang: str = "python") -> str:
    """The first fenced code block of ``lang`` in ``text``."""
    m = re.search(rf"^```{lang}\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    assert m, f"no ```{lang} block"
    return m.group(1)


def snippet_after(path: Path, name: str) -> str:
    """The first python block after the line ``<!-- tested: NAME -->`` of a page."""
    text = path.read_text()
    marker = f"<!-- tested: {name} -->"
    assert marker in text, f"{path.relative_to(ROOT)}: no {marker}"
    return first_block(text.split(marker, 1)[1])


def readme_quickstart() -> str:
    """The README's quickstart script, as a user copies it."""
    return first_block(section(README, "quickstart"))
