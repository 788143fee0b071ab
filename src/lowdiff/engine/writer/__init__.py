"""LowDiff's writer: the checkpointing process of ``method="lowdiff"``. Its entry point
and takeover are in :mod:`~lowdiff.engine.writer.main`, what it does with each message in
:mod:`~lowdiff.engine.writer.writer`. Nothing here runs on the trainer."""
