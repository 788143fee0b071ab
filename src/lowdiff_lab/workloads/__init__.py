"""Reproducible demo workloads: real text, real models, a real training job.

- :mod:`lowdiff_lab.workloads.text`: a byte-level corpus built from the running Python's own
  standard-library source, with deterministic ``(seed, step)`` batches;
- :mod:`lowdiff_lab.workloads.models`: small GPT-2-style byte LMs built from configs;
- :mod:`lowdiff_lab.workloads.train`: the checkpointed training job
  (``python -m lowdiff_lab.workloads.train --config CONFIG.json``) that ``lowdiff demo`` runs;
- :mod:`lowdiff_lab.workloads.zoo`: the benchmark workloads (GPT-2, BERT, ResNet, Qwen3) by
  name, from the registry of :mod:`lowdiff_lab.workloads.specs`, with the generated batches
  of :mod:`lowdiff_lab.workloads.batches`.

Submodules are imported on demand; ``transformers`` is only needed by ``models``.
"""

from __future__ import annotations
