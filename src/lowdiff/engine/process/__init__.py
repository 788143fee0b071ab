"""What both of lowdiff's checkpointing processes run: full-checkpoint writes and
retention (:mod:`~lowdiff.engine.process.full_writer`), the remote tier's upload thread
(:mod:`~lowdiff.engine.process.remote`), and the process side of a takeover
(:mod:`~lowdiff.engine.process.takeover`). Nothing here runs on the trainer."""
