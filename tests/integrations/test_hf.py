"""transformers.Trainer with lowdiff.integrations.hf.LowDiffCallback: SIGKILL the real
process mid-epoch, resume through the callback's resume point, and get the uninterrupted
run's steps, epochs and final state (model, optimizer, scheduler, RNG, global step) bit
for bit."""

from __future__ import annotations

import pytest
from tests.integrations.harness import kill_resume_compare, reference_run, steps

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip(
    "accelerate", reason="accelerate (needed by transformers.Trainer) is not installed"
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_trainer_resumes_bit_exactly_after_sigkill(tmp_path):
    # 100 samples, batches of 8, 2 accumulation steps: 7 updates per epoch; the kill lands
    # inside the second epoch, so the Trainer skips batches on resume
    err: list[str] = []
    start, ref = kill_resume_compare(
        tmp_path, "hf_trainer.py", ["--steps", "20"], kill_after=9, resumed_stderr=err
    )
    assert start % 7 != 0
    assert len(ref) == 20
    # the resume point's weights hold every key, tied ones included: the Trainer, which
    # loads them before lowdiff restores the model, has no missing key to warn about
    assert "missing keys" not in err[0], err[0][-3000:]


def test_the_trainers_own_checkpoints_after_a_resume(tmp_path):
    """A resumed run whose Trainer also saves checkpoints of its own (save_strategy
    "steps"): the saves after the resume point work (they look up every stateful
    callback's state), and training stays bit-identical."""
    start, _ = kill_resume_compare(
        tmp_path, "hf_trainer.py", ["--steps", "12", "--save-steps", "5"], kill_after=4
    )
    assert start < 10  # the Trainer saves again at step 10, after the resume point
    saved = {p.name for p in (tmp_path / "ck-out").glob("checkpoint-*")}
    # step 10 and the last step (12) were saved by the resumed Trainer
    assert {"checkpoint-10", "checkpoint-12"} <= saved, saved


@pytest.mark.parametrize("strategy", ["lowdiff", "lowdiff+"])
def test_a_resume_at_a_step_the_trainer_evaluated_is_bit_exact(tmp_path, strategy):
    """eval_strategy "steps": the run resumes at step 10, mid-epoch, where the Trainer
    evaluated after the update (its eval loader's iterator drew random numbers, and the
    best metric was set). The step is saved with the TrainerState and RNG states as they
    were after the evaluation, so the later steps' dropout, evaluations and best metric,
    and the final state, are the uninterrupted run's."""
    args = ["--steps", "16", "--eval-strategy", "steps", "--eval-steps", "5"]
    args += ["--strategy", strategy]
    start, ref = kill_resume_compare(tmp_path, "hf_trainer.py", args, kill_after=11, sleep=0.3)
    assert start == 10 and start % 7 != 0  # 7 updates per epoch: mid-epoch
    evals = steps(reference_run("hf_trainer.py", args)[0], "eval")
    assert {5, 10, 15} <= set(evals)  # one at the resume step, more after it
    # the best metric the evaluation at the resume step set (after step 10's own line)
    assert ref[10][-1] != ref[11][-1] and float(ref[11][-1]) == float.fromhex(evals[10][0])


def test_a_resume_at_an_epoch_end_the_trainer_evaluated_is_bit_exact(tmp_path):
    """eval_strategy "epoch": the run resumes at step 7, the end of the first epoch, where
    the Trainer evaluated before the next epoch began."""
    args = ["--steps", "16", "--eval-strategy", "epoch"]
    start, ref = kill_resume_compare(tmp_path, "hf_trainer.py", args, kill_after=8, sleep=0.3)
    assert start == 7 and ref[7][1] == "1.0"  # the epoch's end
    evals = steps(reference_run("hf_trainer.py", args)[0], "eval")
    assert 7 in evals and 14 in evals


def test_ignore_data_skip_is_refused(tmp_path):
    import torch
    import transformers

    from lowdiff.errors import LowDiffError
    from lowdiff.integrations.hf import LowDiffCallback

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    ds = [{"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}] * 4
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
        ignore_data_skip=True, report_to=[], use_cpu=True, save_strategy="no",
    )  # fmt: skip
    cb = LowDiffCallback(tmp_path / "ck", compressor=None, strategy="lowdiff+")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    with pytest.raises(LowDiffError, match="ignore_data_skip=False"):
        trainer.train()
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
