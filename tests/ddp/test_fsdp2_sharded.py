"""Models sharded across ranks (FSDP2 ``fully_shard``, DTensor), with 2 gloo ranks.

Every strategy but ``"lowdiff+"`` (which runs ``fully_shard``: test_fsdp2_plus.py),
``attach`` with them, and ``restore`` refuse such a model with
:class:`lowdiff.UnsupportedSetupError` before touching the directory (before, rank 1 of
a ``fully_shard`` job failed on the directory lock, taken for a second single-process
trainer); ``"lowdiff+"`` refuses tensor parallelism. An FSDP2 job is not continued under
DDP, nor a DDP job under ``fully_shard``. What the errors point to works: a lowdiff checkpoint exported with
``--format dcp`` loads into the ``fully_shard``ed model with ``dcp.load`` and
``set_state_dict``, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from tests.ddp.spawned import join_group, run_ranks
from torch import nn

import lowdiff

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("fully_shard (FSDP2) is public from torch 2.6", allow_module_level=True)
from lowdiff.methods import method_names

STRATEGIES = method_names()

WORLD = 2
REFUSED = [s for s in STRATEGIES if s != "lowdiff+"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _refusals(
    model: nn.Module, opt: torch.optim.Optimizer, base: Path, strategies: list[str]
) -> dict[str, str]:
    """Each entry point's error message (or what went wrong instead)."""
    out: dict[str, str] = {}
    calls = {
        **{
            s: (lambda s=s: lowdiff.Checkpointer(model, opt, base / s, strategy=s))
            for s in strategies
        },
        "attach": lambda: lowdiff.attach(
            base / "attach", model, opt, method="lowdiff", compressor=lowdiff.TopK(ratio=0.01)
        ),
        "restore": lambda: lowdiff.restore(base / "restore", model, opt),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "accepted"
        except lowdiff.UnsupportedSetupError as e:
            touched = [p.name for p in base.iterdir()] if base.exists() else []
            out[name] = str(e) + (f" TOUCHED {touched}" if touched else "")
        except Exception as e:  # noqa: BLE001 -- reported to the test, which fails on it
            out[name] = f"WRONG {type(e).__name__}: {e}"
    return out


def _crossed(model: nn.Module, opt: torch.optim.Optimizer, tmp: Path) -> dict[str, str]:
    """An FSDP2 job continued under DDP, and a DDP job under fully_shard: the errors."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model())
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for m, o, d in ((model, opt, "fsdp2-job"), (ddp, ddp_opt, "ddp-job")):
        ck = lowdiff.Checkpointer(tmp / d, m, o, method="lowdiff+")
        ck.resume()
        ck.close()
    out = {}
    ddp = DDP(_model())  # a new one: DDP takes one communication hook per model
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for name, m, o, d in (("ddp", ddp, ddp_opt, "fsdp2-job"), ("fsdp2", model, opt, "ddp-job")):
        try:
            ck = lowdiff.Checkpointer(tmp / d, m, o, method="lowdiff+")
        except Exception as e:  # noqa: BLE001 -- reported to the test
            out[name] = f"{type(e).__name__}: {e}"
            continue
        try:
            ck.resume()
            out[name] = "accepted"
        except Exception as e:  # noqa: BLE001 -- reported to the test
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            ck.close()
    return out


def _rank(rank: int, tmp: Path, exported: Path, want_file: Path) -> None:
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    join_group(rank, WORLD, tmp / "store")
    report: dict[str, object] = {}
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # every strategy but LowDiff+ (tests/ddp/test_fsdp2_plus.py)
    report["fsdp2"] = _refusals(model, opt, tmp / "fsdp2", REFUSED)

    # tensor parallelism without FSDP: a DTensor parameter in a plain module
    tp = _model()
    tp[0].weight = nn.Parameter(distribute_tensor(tp[0].weight.detach(), mesh, [Shard(0)]))
    tp_opt = torch.optim.SGD(tp.parameters(), lr=0.1)
    report["dtensor"] = _refusals(tp, tp_opt, tmp / "dtensor", ["lowdiff+", "lowdiff"])
    # an optimizer whose state spans rows (Adafactor's factored second moment)
    factored = torch.optim.Adafactor(model.parameters())
    report["adafactor"] = _refusals(model, factored, tmp / "adafactor", ["lowdiff+"])

    # what the errors point to: the dcp export of a lowdiff checkpoint, into fully_shard
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp_load(state, checkpoint_id=str(exported))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    want = torch.load(want_file)
    same: list[str] = []
    for name, p in model.named_parameters():
        full = p.full_tensor()  # a collective: every rank calls it
        if torch.equal(full, want["model"][name]):
            same.append(name)
        for key, v in opt.state[p].items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            if torch.equal(got, want["optimizer"][name][key]):
                same.append(f"{name}.{key}")
    report["loaded"] = same
    report["crossed"] = _crossed(model, opt, tmp)
    (tmp / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _lowdiff_checkpoint(tmp: Path) -> tuple[Path, Path]:
    """A 3-step single-process lowdiff checkpoint, exported as dcp, and its state."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ck = lowdiff.Checkpointer(
        tmp / "plain",
        model,
        opt,
        method="lowdiff",
        full_every=2,
        compressor=lowdiff.TopK(ratio=0.01),
    )
    ck.resume()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    exported = tmp / "export-dcp"
    assert lowdiff.export(tmp / "plain", out=exported, format="dcp") == 3
    names = {id(p): n for n, p in model.named_parameters()}
    want = {
        "model": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": {names[id(p)]: dict(s) for p, s in opt.state.items()},
    }
    want_file = tmp / "want.pt"
    torch.save(want, want_file)
    return exported, want_file


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_models_are_refused_and_dcp_export_loads_into_fully_shard(
    tmp_path: Path,
) -> None:
    exported, want_file = _lowdiff_checkpoint(tmp_path)
    codes = run_ranks(_rank, WORLD, tmp_path, exported, want_file, timeout=120)
    assert codes == [0] * WORLD
    for rank in range(WORLD):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fsdp2, tp = report["fsdp2"], report["dtensor"]
        assert set(fsdp2) == {*REFUSED, "attach", "restore"}
        for name, msg in fsdp2.items():
            # refused with the error that says what and why, before any file was made
            assert "does not support models sharded across ranks" in msg, (name, msg)
            assert "fully_shard (FSDP2)" in msg and "TOUCHED" not in msg, (name, msg)
        assert "torch.distributed.checkpoint" in fsdp2["dcp-async"]
        assert "no compressed gradient to reuse" in fsdp2["lowdiff"]
        assert "export --format dcp" in fsdp2["restore"]
        for name, msg in tp.items():
            assert "is a DTensor" in msg and "TOUCHED" not in msg, (name, msg)
        # LowDiff+ runs fully_shard only: tensor parallelism is refused, saying why
        assert "no module of the model is sharded with fully_shard" in tp["lowdiff+"]
        adafactor = report["adafactor"]["lowdiff+"]
        assert "Adafactor does not update each element on its own" in adafactor, adafactor
        assert "TOUCHED" not in adafactor
        # every parameter and every Adam state tensor, bit for bit
        assert len(report["loaded"]) == 4 * 4, report["loaded"]
        crossed = report["crossed"]
        assert crossed["ddp"].startswith("UnsupportedSetupError: "), crossed
        assert "written under fully_shard (FSDP2)" in crossed["ddp"]
        assert crossed["fsdp2"].startswith("CheckpointMismatchError: "), crossed
        assert "was written by DDP" in crossed["fsdp2"]
