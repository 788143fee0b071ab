"""lowdiff inside training frameworks, built on :func:`lowdiff.attach` and ``extra_state``.

- :mod:`lowdiff.integrations.hf`: ``LowDiffCallback`` for ``transformers.Trainer``
  (``pip install lowdiff[hf]``).
- :mod:`lowdiff.integrations.lightning`: ``LowDiffCallback`` for ``lightning.Trainer``
  (``pip install lowdiff[lightning]``).

Accelerate needs no integration: ``lowdiff.attach`` on the optimizer that
``accelerator.prepare`` returns (see the README).

Each module imports its framework; importing this package imports none.
"""
