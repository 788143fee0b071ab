"""The documentation site builds in strict mode: a broken link, anchor or include, a
reference to a name the code does not have, or a command the CLI does not know fails
the build."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from tests.docs.pages import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (pip install -e '.[docs]'; the dev extra has it)",
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about MkDocs 2
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-8000:]}"

    # the generated pages hold what the generation put there
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("lowdiff.Checkpointer", "lowdiff.attach", "lowdiff.ReplicaOptions"):
        assert f'id="{name}"' in api, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "usage: lowdiff inspect" in cli and "lowdiff-cli:" not in cli
    layers = (site / "architecture" / "index.html").read_text()
    assert "lowdiff-layers" not in layers and "<code>lowdiff.engine</code>" in layers
    # the included README sections and examples are there, not their markers
    quickstart = (site / "getting-started" / "quickstart" / "index.html").read_text()
    assert "Checkpointer" in quickstart and "--8&lt;--" not in quickstart
