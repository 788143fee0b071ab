"""Gradient clipping by total norm, with the factor it multiplies the gradients by.

:func:`norm_and_factor` and :func:`scale_` together do what
``torch.nn.utils.clip_grad_norm_`` does (the same norm, the same factor
``min(max_norm / (norm + 1e-6), 1)``, the same in-place multiplication, so the same
bits), split in two so that the caller knows the factor: LowDiff+ carries it to its
replica instead of copying the clipped gradients to host memory a second time.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from lowdiff.errors import InvalidArgumentError


def norm_and_factor(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The total ``norm_type`` norm of ``grads`` (as one vector) and the clipping factor.

    Raises:
        RuntimeError: With ``error_if_nonfinite``, if the norm is ``nan`` or ``inf``.
    """
    if not grads:
        raise InvalidArgumentError("no gradient to clip")
    total_norm_of = getattr(torch.nn.utils, "get_total_norm", None)
    if total_norm_of is not None:
        total = total_norm_of(grads, norm_type, error_if_nonfinite, foreach)
    else:  # PyTorch before 2.6: the for-loop form of the same reduction
        first = grads[0].device
        norms = [torch.linalg.vector_norm(g, norm_type).to(first) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` "
                "is non-finite, so it cannot be clipped."
            )
    factor = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    return total, factor


def scale_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``factor`` (one foreach call per device and dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))
