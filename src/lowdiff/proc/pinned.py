"""Page-locked shared host memory, so that device copies into it run asynchronously.

Used for the record slots of LowDiff and LowDiff+ and for CheckFreq's snapshot buffer.
"""

from __future__ import annotations

import contextlib
import warnings

import torch


def pin(t: torch.Tensor) -> bool:
    """Page-lock shared host memory so CUDA copies into it run asynchronously.

    Returns whether the range was registered; a registered range must be given back with
    :func:`unpin` before its memory is unmapped, or a later mapping at the same address
    cannot be registered.
    """
    size = t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(t.data_ptr(), size, 0))
    except Exception as e:  # noqa: BLE001 -- no CUDA runtime binding: said, not raised
        why = f"{type(e).__name__}: {e}"
    else:
        if err == 0:
            return True
        with contextlib.suppress(Exception):
            cudart.cudaGetLastError()  # clear it, or the next CUDA call reports it
        why = f"cudaHostRegister returned error {err}"
    warnings.warn(
        f"lowdiff: could not page-lock {size / 2**20:.1f} MiB of shared host memory "
        f"({why}); copies from the GPU into it will be synchronous and slower",
        stacklevel=3,
    )
    return False


def unpin(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostUnregister(t.data_ptr())) != 0:
            cudart.cudaGetLastError()
