"""``lowdiff export --format {safetensors,torch,dcp,hf}``, each read back by its own library."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
import safetensors.torch
import torch

import lowdiff
from lowdiff.cli.main import main
from lowdiff.state.capture import diff_states, snapshot_state
from lowdiff_lab.torture.ddp_job import Net

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _objects():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    return net, opt, sched


def _no_rng(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("rng")}


def test_safetensors_of_a_job_is_rank0_model_state(ddp_job, tmp_path):
    ck, out = ddp_job
    dest = tmp_path / "m.safetensors"
    assert main(["export", str(ck), "--step", "8", "--out", str(dest)]) == 0
    got = safetensors.torch.load_file(dest)
    want = torch.load(out / "state-8-rank0.pt", weights_only=True)
    net = Net()
    net.load_state_dict(got)  # every name, every shape
    for k, v in got.items():
        assert torch.equal(v, want[f"model/{k}"]), k


def test_torch_format_loads_with_plain_resume_code(ddp_job, tmp_path):
    ck, out = ddp_job
    before = _digest(ck)
    dest = tmp_path / "step5.pt"
    assert lowdiff.export(ck, step=5, format="torch", out=dest) == 5
    ckpt = torch.load(dest, weights_only=True)
    assert ckpt["step"] == 5
    net, opt, sched = _objects()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    want = torch.load(out / "state-5-rank0.pt", weights_only=True)
    assert diff_states(_no_rng(want), _no_rng(snapshot_state(net, opt, sched))) == []
    assert _digest(ck) == before


def test_dcp_format_loads_with_dcp(ddp_job, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ck, out = ddp_job
    dest = tmp_path / "dcp"
    argv = ["export", str(ck), "--step", "12", "--format", "dcp", "--out", str(dest)]
    assert main(argv) == 0
    net, opt, sched = _objects()
    sd = {"model": get_model_state_dict(net), "optimizer": get_optimizer_state_dict(net, opt)}
    dcp.load(sd, checkpoint_id=str(dest), no_dist=True)
    set_model_state_dict(net, sd["model"])
    set_optimizer_state_dict(net, opt, sd["optimizer"])
    extra = {"step": 0, "scheduler": sched.state_dict()}
    dcp.load(extra, checkpoint_id=str(dest), no_dist=True)
    assert extra["step"] == 12
    sched.load_state_dict(extra["scheduler"])
    want = torch.load(out / "state-12-rank0.pt", weights_only=True)
    assert diff_states(_no_rng(want), _no_rng(snapshot_state(net, opt, sched))) == []


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0
    )
    return transformers, transformers.GPT2LMHeadModel(cfg)


def test_hf_format_loads_with_from_pretrained(tmp_path):
    transformers, model = _gpt2()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    d = tmp_path / "ck"
    live = {}
    with lowdiff.Checkpointer(
        d, model, opt, compressor=lowdiff.TopK(0.3), full_every=3, records_per_file=2
    ) as ck:
        ck.resume()
        for i in range(5):
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
            model(input_ids=ids, labels=ids).loss.backward()
            ck.step()
            opt.zero_grad()
            live[i + 1] = {k: v.clone() for k, v in model.state_dict().items()}
    for step in (4, 5):
        dest = tmp_path / f"hf-{step}"
        argv = ["export", str(d), "--step", str(step), "--format", "hf", "--out", str(dest)]
        assert main(argv) == 0
        assert (dest / "config.json").exists() and (dest / "model.safetensors").exists()
        # every file gets the mode a new file gets here (safetensors alone would give 0600)
        (tmp_path / f"probe-{step}").touch()
        usual = stat.S_IMODE((tmp_path / f"probe-{step}").stat().st_mode)
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in dest.iterdir()}
        assert modes == dict.fromkeys(modes, usual), modes
        loaded = transformers.AutoModelForCausalLM.from_pretrained(dest)
        assert type(loaded).__name__ == "GPT2LMHeadModel"
        got = loaded.state_dict()
        for k, v in live[step].items():
            assert torch.equal(got[k], v), k
    # a single-process directory exports to the other formats too
    # (an output name without a suffix too: torch names the archive inside after it)
    for name in ("s2.pt", "s2"):
        assert lowdiff.export(d, step=2, format="torch", out=tmp_path / name) == 2
        _, fresh = _gpt2()
        fresh.load_state_dict(torch.load(tmp_path / name, weights_only=True)["model"])
        for k, v in live[2].items():
            assert torch.equal(fresh.state_dict()[k], v), k


def test_bad_input_is_named_and_changes_nothing(ddp_job, tmp_path, capsys):
    ck, _ = ddp_job
    before = _digest(ck)
    dest = tmp_path / "x"
    with pytest.raises(lowdiff.CheckpointMismatchError, match="records none"):
        lowdiff.export(ck, step=5, format="hf", out=dest)
    with pytest.raises(ValueError, match="format must be one of .*'onnx'"):
        lowdiff.export(ck, step=5, format="onnx", out=dest)
    with pytest.raises(lowdiff.RecoveryError, match="step 99 is not recoverable in every shard"):
        lowdiff.export(ck, step=99, format="torch", out=dest)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        lowdiff.export(ck, step=5, format="torch", out=ck / "x.pt")
    assert main(["export", str(ck), "--format", "hf", "--out", str(dest)]) == 2
    assert "records none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", str(ck), "--format", "onnx", "--out", str(dest)])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    assert not dest.exists()
    assert _digest(ck) == before


def test_inspect_and_verify_a_job(ddp_job, tmp_path, capsys):
    ck, _ = ddp_job
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "recoverable  steps 0..12" in out and "rec-" not in out
    # --all lists every shard's files
    assert main(["inspect", str(ck), "--all"]) == 0
    out = capsys.readouterr().out
    for shard in ("rank-00000", "rank-00001"):
        for f in sorted((ck / shard / "records").glob("rec-*")) + sorted(
            (ck / shard / "full").glob("full-*")
        ):
            assert f.name in out, f.name
    assert main(["verify", str(ck)]) == 0
    capsys.readouterr()
