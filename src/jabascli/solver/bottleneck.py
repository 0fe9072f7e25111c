"""Exact bottleneck assignment: the fastest way to share ``E`` extra workers among units.

The problem, stripped of everything about GPUs: there are unit *types*, type
``t`` has ``n_t`` identical units, and a unit given ``e >= 0`` extra workers
(``e + 1`` in all) takes ``cost_t[e]`` seconds (``inf`` when it cannot take
that many). Share exactly ``E`` extra workers among all units so that the
slowest unit is as fast as possible:

    OPT(E) = min over (e_u) with sum e_u = E of max_u cost_type(u)[e_u]

This is a bottleneck knapsack. Its classic solution scans thresholds ``T`` in
increasing order and stops at the first one at which ``E`` is reachable with
every unit under ``T``. The same optimum, for *every* ``E`` at once, is the
(min, max)-convolution of the units' cost arrays,

    (f ⊗ h)[E] = min over a + b = E of max(f[a], h[b]),

which is associative and commutative, so ``OPT = cost_1^{⊗ n_1} ⊗ ... ⊗ cost_k^{⊗ n_k}``:
the first threshold at which ``E`` is reachable is exactly ``(⊗ ...)[E]``.
Identical units are combined by repeated squaring (``O(log n_t)``
convolutions per type), and every convolution keeps, for each ``E``, how it
split ``E`` between its two operands, so an optimal assignment is recovered by
walking the splits back to the units. Only ``min`` and ``max`` touch the
costs, so the optimum is one of the input floats, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]


BLOCK = 64  # rows of the (a, E) matrix handled at once: bounds memory, skips the empty triangle


def minmax_convolve(f: FloatArray, h: FloatArray) -> tuple[FloatArray, IntArray]:
    """``r[e] = min_a max(f[a], h[e - a])`` for ``e < len(f)``, and the first ``a`` that attains it.

    ``f`` and ``h`` have the same length ``m``; entries of ``r`` that no split
    reaches are ``inf``. Only the half ``a <= e`` of the ``(a, e)`` matrix is
    computed, and only ``a <= e - a`` when ``f is h`` (the result is symmetric
    there, and the first minimising ``a`` is in that half).
    """
    m = f.size
    if h.size != m:
        raise ValueError("operands of a (min, max)-convolution must have the same length")
    square = f is h
    padded = np.concatenate((np.full(m - 1, np.inf), h))
    step = padded.strides[0]
    # shifted[a, e] = h[e - a], and inf where e < a: row a is h moved right by a.
    shifted = as_strided(padded[m - 1 :], shape=(m, m), strides=(-step, step), writeable=False)
    best = np.full(m, np.inf)
    split = np.zeros(m, dtype=np.int64)
    finite = np.isfinite(f)
    for a0 in range(0, (m + 1) // 2 if square else m, BLOCK):
        rows = a0 + np.flatnonzero(finite[a0 : a0 + BLOCK])
        if rows.size == 0:
            continue
        e0 = 2 * a0 if square else a0  # columns left of e0 cannot use these rows
        candidates = np.maximum(f[rows, None], shifted[rows, e0:])
        if square:  # keep a <= e - a
            candidates[np.arange(e0, m)[None, :] < 2 * rows[:, None]] = np.inf
        pick = candidates.argmin(axis=0)
        values = candidates[pick, np.arange(m - e0)]
        better = values < best[e0:]  # strict: earlier rows (smaller a) win ties
        best[e0:][better] = values[better]
        split[e0:][better] = rows[pick[better]]
    return best, split


@dataclass(eq=False)
class _Node:
    """A leaf (one unit of type ``leaf``) or the (min, max)-convolution of two nodes."""

    values: FloatArray
    leaf: int = -1
    left: _Node | None = None
    right: _Node | None = None
    split: IntArray | None = None


def _join(left: _Node, right: _Node) -> _Node:
    values, split = minmax_convolve(left.values, right.values)
    return _Node(values, left=left, right=right, split=split)


def _power(leaf: _Node, count: int) -> _Node:
    """``leaf ⊗ ... ⊗ leaf`` (``count`` times) by repeated squaring."""
    result: _Node | None = None
    square = leaf
    while True:
        if count & 1:
            result = square if result is None else _join(result, square)
        count >>= 1
        if not count:
            break
        square = _join(square, square)
    assert result is not None
    return result


class BottleneckTable:
    """``OPT(E)`` for every ``E < size``, and an optimal assignment for any of them.

    ``costs[t][e]`` is the time of one unit of type ``t`` given ``e`` extra
    workers (``inf`` when impossible); ``counts[t]`` is how many such units
    there are (0 is allowed). Arrays are cut or padded with ``inf`` to ``size``.
    """

    def __init__(self, costs: Sequence[FloatArray], counts: Sequence[int], size: int) -> None:
        if len(costs) != len(counts):
            raise ValueError("one unit count per cost array")
        if size < 1 or any(n < 0 for n in counts) or not any(counts):
            raise ValueError("need size >= 1 and at least one unit")
        self.size = size
        self.counts = tuple(counts)
        root: _Node | None = None
        for t, (cost, n) in enumerate(zip(costs, counts, strict=True)):
            if n == 0:
                continue
            values = np.full(size, np.inf)
            cost = np.asarray(cost, dtype=np.float64)[:size]
            values[: cost.size] = cost
            node = _power(_Node(values, leaf=t), n)
            root = node if root is None else _join(root, node)
        assert root is not None
        self._root = root

    @property
    def values(self) -> FloatArray:
        """``OPT(E)`` for ``E = 0 .. size - 1`` (``inf`` where unreachable)."""
        return self._root.values

    def value(self, extra: int) -> float:
        return float(self._root.values[extra]) if 0 <= extra < self.size else float("inf")

    def assignments(self, extras: Sequence[int]) -> list[IntArray]:
        """Optimal splits of each total in ``extras``, at once.

        Returns, per type, an array of shape ``(len(extras), n_t)``: the extra
        workers of each unit of that type, each row sorted largest first.
        """
        wanted = np.asarray(extras, dtype=np.int64).reshape(-1)
        if wanted.size and not np.all(np.isfinite(self.values[wanted])):
            raise ValueError("some totals cannot be shared among the units")
        columns: list[list[IntArray]] = [[] for _ in self.counts]
        stack = [(self._root, wanted)]
        while stack:
            node, e = stack.pop()
            if node.leaf >= 0:
                columns[node.leaf].append(e)
                continue
            assert node.split is not None and node.left is not None and node.right is not None
            a = node.split[e]
            stack.append((node.left, a))
            stack.append((node.right, e - a))
        out = []
        for cols in columns:
            units = np.stack(cols, axis=1) if cols else np.zeros((wanted.size, 0), dtype=np.int64)
            out.append(-np.sort(-units, axis=1))
        return out

    def assignment(self, extra: int) -> list[list[int]]:
        """Extra workers of each unit, per type (each list sorted, largest first), for an optimal split."""
        if not np.isfinite(self.value(extra)):
            raise ValueError(f"{extra} extra workers cannot be shared among the units")
        return [units[0].tolist() for units in self.assignments([extra])]
