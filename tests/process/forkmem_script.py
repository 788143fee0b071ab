"""A trainer whose Checkpointer forks the process server: what the server and the trainer
see of the training state afterwards (tests/process/test_forkmem.py).

``python forkmem_script.py DIR STRATEGY``: prints one JSON line.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver as mpfs
import os
import resource
import sys

import torch

import lowdiff

MB = 1 << 20


def vma_rss_kb(pid: int, address: int) -> int:
    """Rss (kB) of the mapping of process ``pid`` that holds ``address`` (0: none)."""
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    return 0


def write_faults(tensors: list[torch.Tensor]) -> int:
    """Minor page faults this process takes to write every byte of ``tensors``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with torch.no_grad():
        for t in tensors:
            t.add_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def main() -> None:
    directory, strategy = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 1024)
    model(x).square().mean().backward()
    opt.step()  # the optimizer state exists, and the gradients
    bystander = torch.zeros(8 * MB // 4)  # a tensor of no Checkpointer: shared as before
    bystander.add_(1.0)
    weight = model[0].weight
    state = [weight, weight.grad, opt.state[weight]["exp_avg"], opt.state[weight]["exp_avg_sq"]]
    options = {"compressor": lowdiff.TopK(0.05)} if strategy == "lowdiff" else {}
    assert mpfs._forkserver._forkserver_pid is None  # this Checkpointer forks the server
    ck = lowdiff.Checkpointer(model, opt, directory, strategy=strategy, **options)
    server = mpfs._forkserver._forkserver_pid
    assert server is not None
    page = os.sysconf("SC_PAGESIZE")
    inner = weight.untyped_storage().data_ptr() // page * page + page
    out = {
        "server_rss_kb_state": vma_rss_kb(server, inner),
        "server_rss_kb_bystander": vma_rss_kb(
            server, bystander.untyped_storage().data_ptr() // page * page + page
        ),
        "page_kb": page // 1024,
        "state_pages": sum(t.untyped_storage().nbytes() for t in state) // page,
        "faults_state": write_faults(state),
        "bystander_pages": bystander.untyped_storage().nbytes() // page,
        "faults_bystander": write_faults([bystander]),
    }
    # a later fork of the trainer (a DataLoader worker's) sees the state as usual
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, weight.detach().numpy().tobytes()[:4096])
        os._exit(0)
    os.close(w)
    seen = b""
    while chunk := os.read(r, 4096):
        seen += chunk
    os.waitpid(pid, 0)
    out["later_fork_sees_state"] = seen == weight.detach().numpy().tobytes()[:4096]
    # the server's processes checkpoint as usual
    start = ck.resume()
    for step in range(start, 6):
        torch.manual_seed(step)
        model(torch.randn(4, 1024)).square().mean().backward()
        ck.step()
        opt.zero_grad()
    ck.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 8))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    lowdiff.restore(directory, fresh, fresh_opt, step=6)
    pairs = list(zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    for sa, sb in zip(opt.state.values(), fresh_opt.state.values(), strict=True):
        pairs += [(sa[k], sb[k]) for k in sa]
    out["restored_equal"] = all(torch.equal(a, b) for a, b in pairs)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
