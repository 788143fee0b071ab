"""lowdiff's own methods (``"lowdiff"``, ``"lowdiff+"``, ``"compression-only"``), grouped
by who runs the code:

- :mod:`lowdiff.engine.trainer`: the training process. One strategy
  (:class:`~lowdiff.engine.trainer.strategy.EngineStrategy`) for the three methods; what
  differs is its backend, the checkpointing process it feeds, behind
  :class:`~lowdiff.engine.trainer.backend.Backend`.
- :mod:`lowdiff.engine.writer`: LowDiff's writer process (records and full checkpoints
  to disk).
- :mod:`lowdiff.engine.replica`: LowDiff+'s replica process (a CPU replica merged every
  step, persisted in the background).
- :mod:`lowdiff.engine.process`: what both processes run (full-checkpoint writes and
  retention, the remote tier's uploads, the process side of a takeover).
- :mod:`lowdiff.engine.wire`: what crosses the process boundary (messages, the
  processes' configurations).

Data flow: gradient (trainer: compressed, or snapshotted during backward) -> record slot
in shared memory -> ``Record`` / ``Step`` message -> writer: batch -> record file /
replica: merge -> persisted full checkpoint. :mod:`lowdiff.engine.options` holds the
methods' options. Nothing is imported here: a checkpointing process imports only its own
side.
"""
