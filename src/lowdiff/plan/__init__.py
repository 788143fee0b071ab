"""Choosing LowDiff's (f, b): the paper's wasted-time model, its inputs and the auto mode.

LowDiff has two knobs, the full-checkpoint interval ``f`` and the batch size ``b``
(records per record file), with ``1 <= b <= f``. This package is plain arithmetic (no
torch), in three layers:

- :mod:`.model`: the cost model :class:`CostModel`, the expected wasted GPU time
  :func:`wasted_time` and its argmin :func:`optimize` (the equations are in its
  docstring and in ``docs/plan.md``);
- :mod:`.inputs` (with the fits of :mod:`.fit`): the model's inputs measured by a
  ``lowdiff bench`` run (:func:`bench_inputs`, :func:`cost_model_from_bench`);
- :mod:`.tuner`: :class:`AutoTuner`, the policy behind ``full_every="auto"`` /
  ``batch_size="auto"``, which measures the inputs during training and re-plans.

Example:
    >>> from lowdiff.plan import CostModel, optimize
    >>> m = CostModel(tau=1, total_time=100, mtbf=50, full_bytes=10, record_bytes=1,
    ...               write_bw=1, read_bw=1)
    >>> optimize(m, f_values=[2, 4, 8, 16], b_values=[1, 2, 4]).f
    16
"""

from __future__ import annotations

from lowdiff.plan.fit import fit_bandwidth, fit_line
from lowdiff.plan.inputs import (
    BENCH_EXPERIMENTS,
    INPUT_SOURCES,
    bench_inputs,
    cost_model_from_bench,
)
from lowdiff.plan.model import (
    DEFAULT_B_VALUES,
    CostModel,
    Plan,
    continuous_f,
    default_f_values,
    optimize,
    optimize_exact,
    wasted_time,
    wasted_time_terms,
    young_daly_s,
)
from lowdiff.plan.tuner import (
    AUTO,
    DEFAULT_MTBF_S,
    MTBF_ENV,
    PLAN_HORIZON_S,
    START_B,
    START_F,
    AutoTuner,
    resolve_mtbf,
)

__all__ = [
    "AUTO",
    "BENCH_EXPERIMENTS",
    "DEFAULT_B_VALUES",
    "DEFAULT_MTBF_S",
    "INPUT_SOURCES",
    "MTBF_ENV",
    "PLAN_HORIZON_S",
    "START_B",
    "START_F",
    "AutoTuner",
    "CostModel",
    "Plan",
    "bench_inputs",
    "continuous_f",
    "cost_model_from_bench",
    "default_f_values",
    "fit_bandwidth",
    "fit_line",
    "optimize",
    "optimize_exact",
    "resolve_mtbf",
    "wasted_time",
    "wasted_time_terms",
    "young_daly_s",
]
