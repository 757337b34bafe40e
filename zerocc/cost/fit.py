"""Fitting the cost model's rates to measured times: non-negative least squares."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Non-negative least squares, exactly, for the few columns the fits have: the best of the
    unconstrained solutions over every subset of columns whose coefficients are all >= 0."""
    import numpy as np

    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    columns = a.shape[1]
    best, best_residual = [0.0] * columns, float(np.sum(b * b))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            sub = a[:, subset]
            if not np.any(sub):
                continue
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((sub @ coef - b) ** 2))
            if residual < best_residual:
                best_residual = residual
                best = [0.0] * columns
                for i, c in zip(subset, coef, strict=True):
                    best[i] = float(c)
    return best
