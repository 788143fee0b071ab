"""Device-to-host copy bandwidth into the kinds of host memory lowdiff copies into.

    python benchmarks/gpu_copy_check.py [--mib 512] [--repeats 5]

LowDiff's record slots and LowDiff+'s snapshot slots are shared memory page-locked with
``cudaHostRegister`` (:func:`lowdiff.proc.pinned.pin`); a copy from the GPU into them
runs asynchronously at the bus's speed only if that worked. This script says whether
``pin()`` works on this machine (and why not, if not) and times one device-to-host copy
of ``--mib`` MiB into: ordinary (pageable) memory, memory allocated pinned by PyTorch,
and shared memory registered by ``pin()``; the median of ``--repeats`` copies each.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from lowdiff.proc.pinned import pin, unpin


def copy_gbps(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    """Median GB/s of ``dst.copy_(src, non_blocking=True)`` and a synchronize."""
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(times[1:]) / 1e9


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_copy_check.py needs a CUDA device; none is available here")
    n = args.mib * 2**20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    shared = torch.zeros(n, dtype=torch.uint8).share_memory_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registered = pin(shared)
    for w in caught:
        print(f"pin() warned: {w.message}")
    out = {
        "pageable": copy_gbps(src, torch.empty(n, dtype=torch.uint8), args.repeats),
        "torch_pinned": copy_gbps(
            src, torch.empty(n, dtype=torch.uint8, pin_memory=True), args.repeats
        ),
        "shared_registered" if registered else "shared_not_registered": copy_gbps(
            src, shared, args.repeats
        ),
    }
    if registered:
        unpin(shared)
    print(f"pin() of {args.mib} MiB of shared memory: {'registered' if registered else 'FAILED'}")
    for k, v in out.items():
        print(f"device to host, {k:22s} {v:6.1f} GB/s")
    return out


if __name__ == "__main__":
    main()
