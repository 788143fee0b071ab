"""``lowdiff inspect``, ``verify`` and ``export`` take a remote tier's URL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lowdiff
from lowdiff.cli.main import main
from lowdiff.remote import RemoteStore

from .conftest import Backend

pytestmark = pytest.mark.multiprocess


def _options(backend: Backend) -> list[str]:
    out = []
    for k, v in backend.options.items():
        out += ["--remote-option", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return out


def test_cli_reads_a_remote_tier(
    backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ck = lowdiff.Checkpointer(tmp_path / "local", m, o, full_every=4, records_per_file=2, keep_full=None, remote=lowdiff.RemoteOptions(backend.url, storage_options=backend.options), compressor=lowdiff.TopK(ratio=0.01))  # fmt: skip
    ck.resume()
    for t in range(7):
        g = torch.Generator().manual_seed(t)
        m(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        ck.step()
        o.zero_grad()
    ck.close()
    assert ck.remote_durable_step == 7
    opts = _options(backend)

    assert main(["verify", backend.url, *opts]) == 0
    assert "0 bad" in capsys.readouterr().out
    assert main(["inspect", backend.url, "--json", *opts]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["recoverable"] == [0, 7] and len(info["full_checkpoints"]) == 2
    assert info["directory"] == backend.url  # the URL named, not the temporary download
    out = tmp_path / "model.safetensors"
    assert main(["export", backend.url, "--out", str(out), *opts]) == 0
    got = load_file(str(out))
    assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())

    # a committed object whose bytes changed is named, and verify fails
    store = RemoteStore(backend.url, backend.options)
    c = store.read_commit("records/rec-000000000004-000000000005.safetensors")
    raw = bytearray(store.fs.cat_file(store.key(c.object)))
    raw[-1] ^= 0xFF
    store.fs.pipe_file(store.key(c.object), bytes(raw))
    assert main(["verify", backend.url, *opts]) == 1
    printed = capsys.readouterr().out
    assert f"BAD  {backend.url}/{c.object}: checksum mismatch" in printed
    assert main(["verify", str(tmp_path / "local")]) == 0  # the local tier is intact
    capsys.readouterr()
    # inspect names the damaged object too, and every file by its URL, never by the
    # temporary download that held it while the command ran
    assert main(["inspect", backend.url, "--json", *opts]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"path": f"{backend.url}/{c.object}", "reason": "checksum mismatch with its commit"} in (
        info["problems"]
    )
    files = info["full_checkpoints"] + info["record_files"]
    assert files and all(f["path"].startswith(f"{backend.url}/") for f in files), files
