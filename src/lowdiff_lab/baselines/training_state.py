"""The whole training state as the baselines checkpoint it: one nested dict.

``{"step", "model", "optimizer", "scheduler", "rng"}``: model and optimizer as their
``state_dict()``, the scheduler's (or None), and the RNG states of
:mod:`lowdiff.state.capture`. ``torch-save``, ``checkfreq``, ``gemini`` and ``naive-dc``
write it (``naive-dc`` as its full checkpoints); every one of them restores it with
:func:`restore_state`, strictly: a checkpoint that does not fit the training is a
:class:`lowdiff.CheckpointMismatchError`, never a partial load.
"""

from __future__ import annotations

from typing import Any

import torch

from lowdiff.errors import CheckpointMismatchError
from lowdiff.state import capture as st


def capture_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    step: int,
    rng_layout: st.RngLayout,
) -> dict[str, Any]:
    """The whole training state after ``step`` updates, as live references (not copies).

    Model and optimizer tensors are the live ones: copy them (:func:`clone_state`) before
    the next update if the state must outlive it.
    """
    rng_t, rng_extra = st.capture_rng(rng_layout)
    return {
        "step": step,
        "model": st.unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": {"tensors": rng_t, "extra": rng_extra},
    }


def clone_state(obj: Any, *, device: str | torch.device = "cpu", pin: bool = False) -> Any:
    """Deep copy of a state: every tensor copied to ``device`` (pinned if asked)."""
    if isinstance(obj, torch.Tensor):
        out = torch.empty(obj.shape, dtype=obj.dtype, device=device, pin_memory=pin)
        out.copy_(obj.detach(), non_blocking=pin)
        return out
    if isinstance(obj, dict):
        return {k: clone_state(v, device=device, pin=pin) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v, device=device, pin=pin) for v in obj)
    return obj


def state_nbytes(obj: Any) -> int:
    """Bytes of tensor data in a state (storage shared by two names counted twice)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def restore_state(
    state: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any | None,
    *,
    where: str,
) -> None:
    """Load a state from :func:`capture_state` into the live objects (strictly)."""
    try:
        st.unwrap_model(model).load_state_dict(state["model"], strict=True)
    except RuntimeError as e:
        raise CheckpointMismatchError(
            f"{where}: the model does not match the checkpoint: {e}"
        ) from None
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointMismatchError(
            f"{where}: the optimizer does not match the checkpoint: {e}"
        ) from None
    check_scheduler(where, has_state=state["scheduler"] is not None, scheduler=scheduler)
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    st.restore_rng(state["rng"]["tensors"], state["rng"]["extra"])


def check_scheduler(where: str, *, has_state: bool, scheduler: Any | None) -> None:
    """Raise unless the checkpoint has a scheduler state exactly when the training has a scheduler."""
    if (scheduler is not None) == has_state:
        return
    raise CheckpointMismatchError(
        f"{where}: the checkpoint {'has no' if scheduler is not None else 'has a'} scheduler state, "
        f"the training {'has a' if scheduler is not None else 'has no'} scheduler"
    )
