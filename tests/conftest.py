from __future__ import annotations

import os

import torch

# Tests run on 2 shared cores; more threads only add contention and noise.
torch.set_num_threads(int(os.environ.get("LOWDIFF_TEST_THREADS", "1")))
