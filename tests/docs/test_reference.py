"""The reference pages cover the code: every public name, option, error, statistic and
environment variable is documented, so none can be added without its page."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from tests.docs.pages import DOCS, ROOT

import lowdiff
from lowdiff import errors

API = DOCS / "reference" / "api.md"
ERRORS = DOCS / "reference" / "errors.md"
OPTIONS = DOCS / "reference" / "options.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"


def _rows(text: str) -> set[str]:
    """The names in the first column of the page's tables (``| `name` | ...``)."""
    return set(re.findall(r"^\| `([A-Za-z_][\w*]*)`", text, re.MULTILINE))


def test_the_api_reference_lists_every_public_name():
    documented = set(
        re.findall(r"^::: lowdiff\.(\w+)$", API.read_text() + ERRORS.read_text(), re.M)
    )
    public = set(lowdiff.__all__) - {"__version__"}
    assert sorted(public - documented) == [], "add `::: lowdiff.NAME` to docs/reference/api.md"
    assert sorted(documented - public) == [], "documented, but not in lowdiff.__all__"


def _error_classes() -> list[type]:
    return [
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if c.__module__ == errors.__name__ and issubclass(c, (errors.LowDiffError, Warning))
    ]


def test_every_error_class_has_its_cause_and_fix():
    troubleshooting = TROUBLESHOOTING.read_text()
    reference = ERRORS.read_text()
    for cls in _error_classes():
        name = cls.__name__
        assert re.search(rf"^\| `{name}`", troubleshooting, re.M), f"troubleshooting: {name}"
        assert f"::: lowdiff.{name}\n" in reference, f"reference/errors.md: {name}"
        assert re.search(rf"\b{name}\b", reference.split(":::")[0]), f"the hierarchy: {name}"


def _documented_args(obj: object) -> set[str]:
    """The names of an ``Args:`` section of ``obj``'s docstring (what the API reference
    renders)."""
    doc = inspect.getdoc(obj) or ""
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    section = re.split(r"\n\S", section, maxsplit=1)[0]  # up to the next section
    return set(re.findall(r"^    (\w+):", section, re.MULTILINE))


def test_every_option_is_documented_once_where_the_api_reference_reads_it():
    for fn in (lowdiff.Checkpointer, lowdiff.attach):
        params = inspect.signature(fn).parameters.values()
        options = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        missing = sorted(options - _documented_args(lowdiff.Checkpointer))
        assert missing == [], f"{fn.__name__}: options missing in Checkpointer's docstring"
    for cls in (lowdiff.ReplicaOptions, lowdiff.RemoteOptions, lowdiff.Timeouts):
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - _documented_args(cls))
        assert missing == [], f"{cls.__name__}: fields missing in its docstring"
    page = OPTIONS.read_text()
    assert not _rows(page.split("## Statistics", 1)[0]), "options are documented in docstrings"
    for name in ("Checkpointer", "ReplicaOptions", "RemoteOptions", "Timeouts"):
        assert f"(api.md#lowdiff.{name})" in page


def test_every_environment_variable_is_documented():
    text = OPTIONS.read_text()
    used: set[str] = set()
    for pkg in ("lowdiff", "lowdiff_lab"):
        for path in (ROOT / "src" / pkg).rglob("*.py"):
            used |= set(re.findall(r"\bLOWDIFF_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(v for v in used if f"`{v}`" not in text)
    assert missing == [], f"environment variables missing in {OPTIONS.name}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compressor", [lowdiff.TopK(ratio=0.05), None], ids=["lowdiff", "plus"])
def test_every_statistic_is_documented(tmp_path, compressor):
    text = OPTIONS.read_text().split("## Statistics", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", text))
    prefixes = tuple(p for p in re.findall(r"`([a-z]+_)\*`", text))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with lowdiff.Checkpointer(tmp_path / "ck", model, optimizer, compressor=compressor) as ck:
        ck.resume()
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            ck.step()
            optimizer.zero_grad()
        ck.flush()
        keys = set(ck.stats)
    missing = sorted(k for k in keys if k not in documented and not k.startswith(prefixes))
    assert missing == [], f"ck.stats keys missing in the Statistics table of {OPTIONS.name}"
