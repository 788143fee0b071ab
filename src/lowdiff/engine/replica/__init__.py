"""LowDiff+'s replica: the checkpointing process of ``method="lowdiff+"``. Its entry
point and takeover are in :mod:`~lowdiff.engine.replica.main`, the replica itself (the
state in a shared arena, merged every step, persisted) in
:mod:`~lowdiff.engine.replica.replica`, and its optimizer in
:mod:`~lowdiff.engine.replica.optim`. Nothing here runs on the trainer, except
:func:`~lowdiff.engine.replica.optim.optimizer_class`, which the trainer calls to refuse
an optimizer the replica cannot run."""
