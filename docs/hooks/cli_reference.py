"""MkDocs hook: reference text generated from the code when the site is built.

- A page line ``<!-- lowdiff-cli: COMMAND -->`` becomes the output of
  ``lowdiff COMMAND --help`` (``<!-- lowdiff-cli: -->``: of ``lowdiff --help``), taken
  from :func:`lowdiff.cli.main.main`. A page that holds any such line must hold one for
  every command ``lowdiff --help`` lists, so a new command cannot go undocumented; a
  command that does not exist fails the build.
- A page line ``<!-- lowdiff-layers -->`` becomes the table of the packages' layers, read
  from ``LAYERS`` in ``tests/test_layers.py``, the test that enforces them.
- The Sphinx roles of the docstrings (``:class:`lowdiff.Checkpointer```) are shown as the
  code they name: mkdocstrings renders docstrings as Markdown, role and all.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!-- lowdiff-cli: *([a-z-]*) *-->$", re.MULTILINE)
LAYERS_MARKER = "<!-- lowdiff-layers -->"
ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?=<code>)")
LAYERS_TEST = Path(__file__).resolve().parents[2] / "tests" / "test_layers.py"
_cache: dict[str, str] = {}


def _help(command: str) -> str:
    """``lowdiff [COMMAND] --help`` as the CLI prints it (80 columns)."""
    if command in _cache:
        return _cache[command]
    from lowdiff.cli.main import main

    argv = [command, "--help"] if command else ["--help"]
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    text = out.getvalue()
    if code not in (0, None) or not text.startswith("usage: lowdiff"):
        raise PluginError(
            f"`lowdiff {' '.join(argv)}` failed (exit {code}): {err.getvalue()[-2000:]}"
        )
    _cache[command] = text.rstrip() + "\n"
    return _cache[command]


def _commands() -> list[str]:
    """The commands ``lowdiff --help`` lists."""
    top = _help("")
    m = re.search(r"\{([a-z,-]+)\}", top)
    if m:
        return m.group(1).split(",")
    # argparse with metavar: the commands are the indented names under the positional list
    return re.findall(r"^    ([a-z][a-z-]*) ", top, re.MULTILINE)


def _layers_table() -> str:
    """``LAYERS`` of the layer test as a Markdown table, lowest layer first."""
    tree = ast.parse(LAYERS_TEST.read_text())
    for node in tree.body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "LAYERS" and node.value is not None:
            layers = ast.literal_eval(node.value)
            break
    else:
        raise PluginError(f"{LAYERS_TEST}: no LAYERS table")
    rows = ["| package | layer | modules and packages |", "| --- | --- | --- |"]
    for pkg, entries in layers.items():
        for layer, names in entries:
            shown = ", ".join(f"`{pkg}.{n}`" if n else f"`{pkg}` (its `__init__`)" for n in names)
            rows.append(f"| `{pkg}` | {layer} | {shown} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if LAYERS_MARKER in markdown:
        markdown = markdown.replace(LAYERS_MARKER, _layers_table())
    found = MARKER.findall(markdown)
    if not found:
        return markdown
    missing = [c for c in _commands() if c not in found]
    if missing:
        raise PluginError(
            f"{page.file.src_uri}: no `<!-- lowdiff-cli: NAME -->` for the command(s) "
            f"{', '.join(missing)} that `lowdiff --help` lists"
        )
    return MARKER.sub(lambda m: f"```text\n{_help(m.group(1))}```", markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return ROLE.sub("", html)
