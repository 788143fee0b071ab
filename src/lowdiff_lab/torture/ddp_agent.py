"""``torchrun`` whose ranks are forks of the agent: ``python -m lowdiff_lab.torture.ddp_agent``.

It takes ``torchrun``'s own arguments, parsed by ``torch.distributed.run``, and runs
torch's own elastic agent with them: the same rendezvous, the same environment in each
rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_RESTART_COUNT``, ...),
the same ``--max-restarts`` of the whole job when a rank fails. One thing differs: each
rank is a fork of the agent (``start_method="fork"``), which imported torch,
``torch._dynamo`` (what ``DistributedDataParallel`` imports) and lowdiff once, instead of
a new interpreter that imports them again, every rank of every restart. Each rank then
runs the training script or module as ``python`` would (:func:`lowdiff_lab.prefork.run_as_python`).

The torture's and the tests' 2-rank jobs use it (:func:`lowdiff_lab.torture.ddp.torchrun`),
where it saves several seconds of CPU per rank; what is checked about ``torchrun``
itself runs under the real one.
"""

from __future__ import annotations

import signal
import sys

from lowdiff_lab.prefork import run_as_python


def _rank(*argv: str) -> None:
    # a fork inherits the agent's Python signal handlers (its SIGTERM raises an exception
    # meant for the agent): a rank starts with an interpreter's own, as under torchrun
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    code = run_as_python(argv)
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m lowdiff_lab.torture.ddp_agent [torchrun arguments]``."""
    import torch._dynamo  # noqa: F401 -- imported once here, not in every rank
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    import lowdiff  # noqa: F401

    args = parse_args(sys.argv[1:] if argv is None else argv)
    config, cmd, cmd_args = config_from_args(args)
    if cmd != sys.executable:
        print(f"ddp_agent: cannot fork {cmd!r} (only Python programs)", file=sys.stderr)
        return 2
    config.start_method = "fork"
    try:
        elastic_launch(config, entrypoint=_rank)(*cmd_args)
    except ChildFailedError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
