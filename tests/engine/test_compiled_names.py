"""A ``torch.compile``d model's checkpoint uses the canonical names (no ``_orig_mod.``).

A run of the plain model is resumed by the same model compiled, and the compiled run's
checkpoint restores into the plain model: the same bits either way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import lowdiff
from lowdiff.format import layout
from lowdiff.state.record import RecordLayout


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, directory: Path, steps: int) -> int:
    ck = lowdiff.Checkpointer(
        directory, model, opt, compressor=lowdiff.TopK(0.5), full_every=2, records_per_file=2
    )
    start = ck.resume()
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    return start


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": v.clone() for k, v in s.items()})
    return out


@pytest.mark.multiprocess
def test_plain_run_resumes_compiled_and_restores_plain_again(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    plain = _net()
    _train(plain, torch.optim.Adam(plain.parameters(), lr=0.01), d, 3)
    net = _net()
    compiled = torch.compile(net, backend="eager")
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    opt = torch.optim.Adam(compiled.parameters(), lr=0.01)
    assert _train(compiled, opt, d, 5) == 3  # the plain run's names fit the compiled model
    names = {
        p.name for p in RecordLayout.from_json(layout.read_manifest(d)["record_layout"]).params
    }
    assert names == {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"}
    # the compiled run's checkpoint, into the plain model
    again = _net()
    again_opt = torch.optim.Adam(again.parameters(), lr=0.01)
    assert lowdiff.restore(d, again, again_opt) == 5
    want, got = _state(net, opt), _state(again, again_opt)
    assert len(want) == 6 + 3 + 6 * 3  # parameters, BatchNorm buffers, Adam state
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.multiprocess
def test_checkpoint_with_orig_mod_names_restores_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled model's checkpoint written before names were canonical (``_orig_mod.``
    in its layout) restores into the plain and the compiled model, and exports canonical
    names."""
    from lowdiff.state import capture

    d = tmp_path / "ck"
    net = _net()
    compiled = torch.compile(net, backend="eager")
    opt = torch.optim.Adam(compiled.parameters(), lr=0.01)
    with monkeypatch.context() as m:
        m.setattr(capture, "_compiled_class", lambda: None)  # names as they used to be
        _train(compiled, opt, d, 3)
    saved = {
        p.name for p in RecordLayout.from_json(layout.read_manifest(d)["record_layout"]).params
    }
    assert "_orig_mod.0.weight" in saved
    want = _state(net, opt)
    for target in (_net(), torch.compile(_net(), backend="eager")):
        o = torch.optim.Adam(target.parameters(), lr=0.01)
        assert lowdiff.restore(d, target, o) == 3
        got = _state(getattr(target, "_orig_mod", target), o)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert lowdiff.export(d, out=tmp_path / "out.pt", format="torch") == 3
    exported = torch.load(tmp_path / "out.pt")["model"]
    assert exported.keys() == net.state_dict().keys()
    assert all(torch.equal(v, exported[k]) for k, v in net.state_dict().items())
