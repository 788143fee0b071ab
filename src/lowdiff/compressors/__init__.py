"""Gradient compressors: the contract (:mod:`.base`) and the built-in implementations.

Importing this package registers every built-in kind with :func:`compressor_from_spec`.

Example:
    >>> from lowdiff.compressors import TopK, compressor_from_spec
    >>> compressor_from_spec(TopK(ratio=0.05).spec())
    TopK(ratio=0.05, error_feedback=True)
"""

from __future__ import annotations

from lowdiff.compressors.base import (
    Compressor,
    FieldSpec,
    NoCompression,
    compressor_from_spec,
    index_dtype_for,
)
from lowdiff.compressors.merged import MergedSparse
from lowdiff.compressors.quantize import QSGD
from lowdiff.compressors.sparse import ApproxTopK, RandomK, TopK

__all__ = [
    "QSGD",
    "ApproxTopK",
    "Compressor",
    "FieldSpec",
    "MergedSparse",
    "NoCompression",
    "RandomK",
    "TopK",
    "compressor_from_spec",
    "index_dtype_for",
]
