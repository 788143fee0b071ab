"""lowdiff's lab: the baselines it is measured against, the benchmarks (``lowdiff
bench``), the failure experiments (``lowdiff chaos``), the crash and corruption tests
(``lowdiff torture``), the demo, the workloads they train, and the test suite's process
server.

It uses the library's API and registers itself through the library's public hooks
(:func:`lowdiff.register_method` and the ``lowdiff.plugins`` entry point): the library
never imports it. Install it with ``pip install 'lowdiff[lab]'``.
"""
