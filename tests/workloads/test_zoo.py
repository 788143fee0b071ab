"""Tests of the benchmark model zoo: registry, determinism, gradients, errors, sizes."""

from __future__ import annotations

import pytest
import torch

from lowdiff_lab.workloads import models, text, zoo

TINY = zoo.workload_names(tiny=True)
FULL = zoo.workload_names(tiny=False)
# One tiny workload per family, for the checks that need not run on all of them.
ONE_PER_FAMILY = ["gpt2-s-tiny", "bert-base-tiny", "resnet-50-tiny", "qwen3-0.6b-tiny"]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- registry
def test_registry_names() -> None:
    expected_full = [
        "gpt2-s", "gpt2-m", "gpt2-l", "bert-base", "bert-large", "resnet-50", "resnet-101",
        "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b",
    ]  # fmt: skip
    assert expected_full == FULL
    assert set(TINY) == {f"{n}-tiny" for n in expected_full} | {"gpt2-demo", "gpt2-tiny", "gpt2-3m"}
    assert zoo.workload_names() == list(zoo.WORKLOADS)
    assert sorted(zoo.workload_names()) == sorted(FULL + TINY)
    for name in FULL:
        tiny = zoo.WORKLOADS[f"{name}-tiny"]
        assert tiny.family == zoo.WORKLOADS[name].family and tiny.tiny


@pytest.mark.parametrize("name", FULL)
def test_full_sizes_match_published(name: str) -> None:
    spec = zoo.WORKLOADS[name]
    assert spec.published_params is not None
    n = zoo.count_parameters_meta(name)
    assert abs(n / spec.published_params - 1.0) < 0.05, (name, n)


def test_meta_count_leaves_rng_alone_and_matches_a_real_build() -> None:
    state = torch.get_rng_state()
    n = zoo.count_parameters_meta("qwen3-1.7b-tiny")
    assert torch.equal(torch.get_rng_state(), state)
    assert n == zoo.build_workload("qwen3-1.7b-tiny").n_params


@pytest.mark.parametrize("name", ["gpt2-l", "bert-large", "resnet-101", "qwen3-4b"])
def test_tiny_keeps_the_block_types(name: str) -> None:
    def block_types(n: str) -> set[str]:
        spec = zoo.WORKLOADS[n]
        with torch.device("meta"):
            model = zoo._model_class(spec.family)(zoo._hf_config(spec))
        return {type(m).__name__ for m in model.modules()}

    assert block_types(f"{name}-tiny") == block_types(name)


# --------------------------------------------------------------------------- every tiny one
@pytest.mark.parametrize("name", TINY)
def test_tiny_workload_runs_with_finite_grads(name: str) -> None:
    w = zoo.build_workload(name, seed=0)
    spec = zoo.WORKLOADS[name]
    assert (w.name, w.family, w.device, w.amp, w.grad_accum) == (
        name, spec.family, torch.device("cpu"), None, 1,
    )  # fmt: skip
    assert w.model.training
    assert w.n_params == models.count_parameters(w.model) == zoo.count_parameters_meta(name)
    batch = w.batch(0)
    assert batch[0].shape[0] == spec.batch_size
    loss = w.forward_backward(0)
    assert torch.isfinite(torch.tensor(loss))
    for pname, p in w.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, pname
            assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_weights_and_batches(name: str) -> None:
    a = zoo.build_workload(name, seed=3, data_seed=7)
    b = zoo.build_workload(name, seed=3, data_seed=7)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for x, y in zip(a.batch(5), b.batch(5), strict=True):
        assert torch.equal(x, y)
    other = zoo.build_workload(name, seed=3, data_seed=8)
    assert not torch.equal(a.batch(5)[0], other.batch(5)[0])
    assert not torch.equal(a.batch(5)[0], a.batch(6)[0])


def test_different_seed_different_weights() -> None:
    a = zoo.build_workload("qwen3-0.6b-tiny", seed=0).model.state_dict()
    b = zoo.build_workload("qwen3-0.6b-tiny", seed=1).model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- data
def test_language_batches_come_from_the_byte_corpus() -> None:
    w = zoo.build_workload("qwen3-4b-tiny", seed=0, data_seed=11, batch_size=3, seq_len=32)
    x, y = w.batch(2)
    ref = text.batch_for(2, 3, 32, 11)
    assert torch.equal(x, ref[0]) and torch.equal(y, ref[1])


def test_bert_masks_a_fixed_share_of_every_sequence() -> None:
    w = zoo.build_workload("bert-base-tiny", data_seed=0, batch_size=8, seq_len=60)
    x, labels = w.batch(0)
    original = text.batch_for(0, 8, 60, 0)[0]
    chosen = labels != -100
    assert (chosen.sum(dim=1) == 9).all()  # round(0.15 * 60)
    assert torch.equal(labels[chosen], original[chosen])
    assert torch.equal(x[~chosen], original[~chosen])
    assert (x[chosen] == zoo.MASK_ID).float().mean() > 0.5
    assert x.max() < w.model.config.vocab_size


def test_images_are_labelled_patterns() -> None:
    w = zoo.build_workload("resnet-50-tiny", data_seed=0, batch_size=64, image_size=48)
    x, y = w.batch(0)
    assert x.shape == (64, 3, 48, 48) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and int(y.min()) >= 0 and int(y.max()) < 10
    assert torch.isfinite(x).all()
    # The mean colour alone already separates classes: same class, similar mean.
    means = x.mean(dim=(2, 3))
    k = int(y[0])
    same = means[y == k]
    assert (same - same.mean(0)).norm(dim=1).max() < 0.5


# --------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_grad_accum_equals_the_concatenated_batch(name: str) -> None:
    # In eval mode every family is deterministic and batch-independent (no dropout,
    # BatchNorm on running stats), and every micro-batch's mean has the same denominator,
    # so two accumulated halves equal one batch of both.
    w = zoo.build_workload(name, seed=0, grad_accum=2)
    w.model.eval()
    loss = w.forward_backward(3)
    accumulated = _grads(w.model)
    w.model.zero_grad(set_to_none=True)
    first, second = w.batch(6), w.batch(7)
    joint = tuple(torch.cat([a, b]) for a, b in zip(first, second, strict=True))
    joint_loss = w.loss(joint)
    joint_loss.backward()
    reference = _grads(w.model)
    assert accumulated.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(accumulated[k], reference[k], rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(float(joint_loss.detach()), rel=1e-5)


def test_grad_accum_sums_the_scaled_micro_batch_grads_in_train_mode() -> None:
    w = zoo.build_workload("gpt2-m-tiny", seed=0, grad_accum=2)
    state = torch.get_rng_state()
    loss = w.forward_backward(1)
    accumulated = _grads(w.model)
    # Replay with the same dropout masks, one micro-batch at a time.
    torch.set_rng_state(state)
    halves = []
    losses = []
    for i in (2, 3):
        w.model.zero_grad(set_to_none=True)
        batch_loss = w.loss(w.batch(i))
        (batch_loss / 2).backward()
        halves.append(_grads(w.model))
        losses.append(float(batch_loss.detach()))
    for k in accumulated:
        torch.testing.assert_close(accumulated[k], halves[0][k] + halves[1][k])
    assert loss == pytest.approx(sum(losses) / 2)


def test_legacy_names_match_the_demo_models() -> None:
    w = zoo.build_workload("gpt2-tiny", seed=5, data_seed=2)
    ref = models.build_model("gpt2-tiny", 5)
    sw, sr = w.model.state_dict(), ref.state_dict()
    assert all(torch.equal(sw[k], sr[k]) for k in sr)
    x, y = w.batch(4)
    rx, ry = text.batch_for(4, 4, 64, 2)
    assert torch.equal(x, rx) and torch.equal(y, ry)
    w.model.eval()
    ref.eval()
    assert torch.equal(w.loss((x, y)), models.lm_loss(ref, rx, ry))


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_bf16_autocast_runs_on_cpu(name: str) -> None:
    w = zoo.build_workload(name, amp="bf16")
    loss = w.forward_backward(0)
    assert torch.isfinite(torch.tensor(loss))
    for p in w.model.parameters():
        # Master weights and their gradients stay float32 under autocast.
        assert p.dtype == torch.float32
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.isfinite(p.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", [None, "bf16", "fp16"])
@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_cuda_workloads(name: str, amp: str | None) -> None:
    w = zoo.build_workload(name, device="cuda", amp=amp, grad_accum=2)
    assert all(p.device.type == "cuda" for p in w.model.parameters())
    assert all(t.device.type == "cuda" for t in w.batch(0))
    cpu = zoo.build_workload(name).model.state_dict()
    # Built on the CPU, then moved: the same initial weights on every device (compared
    # before the first forward pass, which moves BatchNorm's running statistics).
    assert [k for k, v in w.model.state_dict().items() if not torch.equal(v.cpu(), cpu[k])] == []
    loss = w.forward_backward(0)
    assert torch.isfinite(torch.tensor(loss))


# --------------------------------------------------------------------------- training
@pytest.mark.parametrize(
    ("name", "steps", "lr"), [("gpt2-s-tiny", 40, 3e-3), ("resnet-50-tiny", 40, 3e-3)]
)
def test_a_few_adam_steps_reduce_the_loss(name: str, steps: int, lr: float) -> None:
    w = zoo.build_workload(name, seed=0)
    opt = torch.optim.Adam(w.model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        w.model.zero_grad(set_to_none=True)
        losses.append(w.forward_backward(step))
        opt.step()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, losses


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "gpt3"}, "unknown workload 'gpt3'"),
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"batch_size": -2}, "batch_size must be a positive int, got -2"),
        ({"batch_size": 2.0}, "batch_size must be a positive int, got 2.0"),
        ({"grad_accum": 0}, "grad_accum must be a positive int, got 0"),
        ({"seq_len": 0}, "seq_len must be a positive int, got 0"),
        ({"seq_len": 129}, "seq_len must be at most 128 .* got 129"),
        ({"image_size": 32}, "image_size does not apply"),
        ({"amp": "fp8"}, "amp must be None or one of .* got 'fp8'"),
        ({"amp": "fp16"}, "amp 'fp16' needs a CUDA device"),
        ({"device": "nonsense"}, "device 'nonsense'"),
        ({"name": "resnet-50-tiny", "seq_len": 64}, "seq_len does not apply"),
        ({"name": "resnet-50-tiny", "image_size": 16}, "image_size must be at least 32, got 16"),
    ],
)
def test_bad_options_are_rejected(kwargs: dict, match: str) -> None:
    kwargs = {"name": "gpt2-s-tiny", **kwargs}
    with pytest.raises(ValueError, match=match):
        zoo.build_workload(**kwargs)


def test_bad_calls_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        zoo.count_parameters_meta("nope")
    with pytest.raises(TypeError, match="seed must be an int, got '1'"):
        zoo.build_workload("gpt2-s-tiny", seed="1")  # type: ignore[arg-type]
    w = zoo.build_workload("gpt2-s-tiny")
    with pytest.raises(ValueError, match="batch index must be a non-negative int, got -1"):
        w.batch(-1)
    with pytest.raises(ValueError, match="step must be a non-negative int, got -1"):
        w.forward_backward(-1)
