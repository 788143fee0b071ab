"""A 2-rank DDP job (gloo, torchrun) shared by the portable-recovery tests."""

from __future__ import annotations

from pathlib import Path

import pytest

SAVED_STEPS = (3, 5, 8, 12)
"""Steps after which every rank of the job saved its live state (``state-{s}-rank{r}.pt``)."""


@pytest.fixture(scope="session")
def ddp_job(torchrun, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint directory, directory of the live states) of a 12-step 2-rank job."""
    base = tmp_path_factory.mktemp("ddp")
    ck, out = base / "ck", base / "out"
    out.mkdir()
    torchrun(
        "--dir", str(ck), "--out", str(out), "--ef", "--steps", "12",
        "--save-steps", ",".join(str(s) for s in SAVED_STEPS),
    )  # fmt: skip
    return ck, out
