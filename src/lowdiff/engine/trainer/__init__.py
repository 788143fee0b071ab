"""What lowdiff's methods run on the training process: the one strategy
(:mod:`~lowdiff.engine.trainer.strategy`), a step's path
(:mod:`~lowdiff.engine.trainer.pipeline`), resume (:mod:`~lowdiff.engine.trainer.resume`)
and the end of a session (:mod:`~lowdiff.engine.trainer.ending`), the trainer's side of a
checkpointing process (:mod:`~lowdiff.engine.trainer.session`, its backends, and
:mod:`~lowdiff.engine.trainer.takeover`)."""
