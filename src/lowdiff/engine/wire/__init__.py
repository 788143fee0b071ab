"""What crosses the process boundary between a trainer and lowdiff's checkpointing
processes: the messages (:mod:`~lowdiff.engine.wire.messages`) and the configurations a
process is started with (:mod:`~lowdiff.engine.wire.configs`). Both sides import these
modules; neither side's code lives here."""
