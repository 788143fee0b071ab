"""Tests of the demo workloads: stdlib byte corpus, batches, models, the training job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests import launch

from lowdiff_lab.workloads import models, text
from lowdiff_lab.workloads.text import Corpus

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


# --------------------------------------------------------------------------- corpus
def _reassemble(c: Corpus) -> torch.Tensor:
    """Interleave the train and held-out blocks back into the original byte stream."""
    n = c.nbytes
    mask = torch.zeros(n, dtype=torch.bool)
    for i in c.heldout_blocks:
        mask[i * text.BLOCK_BYTES : (i + 1) * text.BLOCK_BYTES] = True
    out = torch.empty(n, dtype=torch.uint8)
    out[~mask] = c.train
    out[mask] = c.heldout
    return out


def test_corpus_loads_from_stdlib() -> None:
    c = text.load_corpus()
    assert c.root == str(text.stdlib_dir())
    assert c.files > 10
    assert c.nbytes == text.DEFAULT_BUDGET_BYTES
    assert c.train.dtype == torch.uint8 and c.heldout.dtype == torch.uint8
    assert 0.03 < c.heldout.numel() / c.nbytes < 0.07
    # It is Python source: the keyword "def " is everywhere, in both splits.
    assert b"def " in bytes(c.train[:100_000].tolist())
    assert b"def " in bytes(c.heldout.tolist())
    assert text.load_corpus() is c  # cached


def test_corpus_small_budget_is_a_prefix() -> None:
    big = _reassemble(text.load_corpus())
    small = text.load_corpus(budget_bytes=200_000)
    assert small.nbytes == 200_000
    assert torch.equal(_reassemble(small), big[:200_000])


def test_heldout_blocks_are_spread() -> None:
    held = text.heldout_blocks(256 * text.BLOCK_BYTES, 0.05)
    assert held[:3] == (19, 39, 59) and len(held) == 12
    assert text.heldout_blocks(2 * text.BLOCK_BYTES, 0.05) == (1,)
    assert text.heldout_blocks(3 * text.BLOCK_BYTES, 0.99) == (1, 2)
    with pytest.raises(ValueError):
        text.heldout_blocks(100, 0.05)


def test_corpus_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        text.load_corpus(budget_bytes=0)
    with pytest.raises(ValueError):
        text.load_corpus(heldout_fraction=1.0)


def test_batches_are_deterministic_and_shifted() -> None:
    x1, y1 = text.batch_for(17, 4, 32, seed=3)
    x2, y2 = text.batch_for(17, 4, 32, seed=3)
    assert x1.dtype == torch.int64 and y1.dtype == torch.int64
    assert x1.shape == (4, 32) and y1.shape == (4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = text.batch_for(18, 4, 32, seed=3)
    x4, _ = text.batch_for(17, 4, 32, seed=4)
    assert not torch.equal(x1, x3)
    assert not torch.equal(x1, x4)


def test_batches_do_not_touch_global_rng() -> None:
    before = torch.get_rng_state()
    text.batch_for(5, 8, 64, seed=0)
    text.eval_batches(2, 4, 64)
    assert torch.equal(before, torch.get_rng_state())


def test_batch_order_is_independent_of_history() -> None:
    # A resumed run asks for step 30 first; it must get what a run that asked for 0..29 first got.
    for s in range(30):
        text.batch_for(s, 2, 16, seed=9)
    after_history = text.batch_for(30, 2, 16, seed=9)
    fresh = text.batch_for(30, 2, 16, seed=9)
    assert torch.equal(after_history[0], fresh[0])


def test_heldout_split_is_disjoint() -> None:
    # Train bytes < 128, held-out bytes >= 128: any leak shows up as a wrong byte value.
    c = Corpus(
        train=torch.randint(0, 128, (5000,), dtype=torch.uint8),
        heldout=torch.randint(128, 256, (700,), dtype=torch.uint8),
        files=1,
        root="synthetic",
    )
    for s in range(50):
        x, y = text.batch_for(s, 8, 32, seed=1, corpus=c)
        assert int(x.max()) < 128 and int(y.max()) < 128
    batches = text.eval_batches(5, 4, 32, corpus=c)
    assert len(batches) == 5
    for x, y in batches:
        assert int(x.min()) >= 128 and int(y.min()) >= 128
    assert [
        torch.equal(a[0], b[0])
        for a, b in zip(batches, text.eval_batches(5, 4, 32, corpus=c), strict=True)
    ] == [True] * 5


# --------------------------------------------------------------------------- models
def test_tiny_model_builds_deterministically() -> None:
    m1 = models.build_model("gpt2-tiny", seed=1)
    m2 = models.build_model("gpt2-tiny", seed=1)
    m3 = models.build_model("gpt2-tiny", seed=2)
    assert m1.config._attn_implementation == "eager"
    assert m1.config.vocab_size == 256
    n = models.count_parameters(m1)
    assert 100_000 <= n <= 300_000
    for (k, a), (_, b) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    w1 = m1.transformer.h[0].attn.c_attn.weight
    w3 = m3.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(w1, w3)


def test_model_registry() -> None:
    assert {"gpt2-demo", "gpt2-tiny"} <= set(models.MODELS)
    assert models.model_spec("gpt2-demo")["n_layer"] == 4
    with pytest.raises(ValueError):
        models.build_model("gpt2-nonexistent", 0)


def test_lm_loss_and_dropout() -> None:
    m = models.build_model("gpt2-tiny", seed=0)
    x, y = text.batch_for(0, 2, 32, seed=0)
    loss = models.lm_loss(m, x, y)
    assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    with torch.no_grad():
        # Untrained byte LM: close to ln(256).
        assert 4.0 < float(loss) < 7.0
        # Dropout is on in training mode, so the RNG state changes the result ...
        assert float(models.lm_loss(m, x, y)) != float(loss)
        # ... and is off in eval mode.
        m.eval()
        assert float(models.lm_loss(m, x, y)) == float(models.lm_loss(m, x, y))


_LOSS_SCRIPT = """
import torch
from lowdiff_lab.workloads import models, text
torch.set_num_threads(1)
m = models.build_model("gpt2-tiny", seed=7)
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
out = []
for step in range(4):
    x, y = text.batch_for(step, 4, 32, seed=7)
    loss = models.lm_loss(m, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    out.append(float(loss).hex())
print(" ".join(out))
"""


@pytest.mark.multiprocess
def test_two_processes_give_bit_identical_losses() -> None:
    procs = [
        subprocess.Popen(  # new interpreters: each with its own hash seed
            [sys.executable, "-c", _LOSS_SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr
        outs.append(stdout.strip().splitlines()[-1])
    assert len(outs[0].split()) == 4
    assert outs[0] == outs[1]


# --------------------------------------------------------------------------- training job
def test_train_config_validation() -> None:
    from lowdiff_lab.workloads.train import TrainConfig

    cfg = TrainConfig.from_dict({"directory": "x", "model": "gpt2-tiny", "seq_len": 32})
    assert cfg.steps == 200 and cfg.compressor["kind"] == "topk"
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({"directory": "x", "stpes": 3})
    with pytest.raises(ValueError):
        TrainConfig.from_dict({"directory": "x", "model": "gpt2-tiny", "seq_len": 4096})
    with pytest.raises(ValueError):
        TrainConfig.from_dict({"directory": "x", "dump_state_at_step": 3})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_job_runs_and_reports(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = {
        "directory": str(tmp_path / "ck"),
        "model": "gpt2-tiny",
        "steps": 8,
        "batch_size": 2,
        "seq_len": 32,
        "full_every": 4,
        "threads": 1,
        "eval_batches": 2,
        "result_path": str(tmp_path / "result.json"),
        "dump_state_at_step": {"step": 5, "path": str(tmp_path / "s5.safetensors")},
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = launch.run(
        [sys.executable, "-m", "lowdiff_lab.workloads.train", "--config", str(tmp_path / "cfg.json")],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["start", "resumed"] and kinds[-1] == "done"
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(1, 9))
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["start_step"] == 0 and len(result["step_times"]) == 8
    assert result["eval_loss"] > 0 and result["recovery"] is None
    dump = load_file(str(tmp_path / "s5.safetensors"))
    assert len(dump) > 10
