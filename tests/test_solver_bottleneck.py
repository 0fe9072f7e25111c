"""The bottleneck knapsack is exact: against brute force over every per-unit split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jabascli.solver.bottleneck import BLOCK, BottleneckTable, minmax_convolve

# Costs from a small set of values so that ties (the hard case for argmins) are frequent.
cost_value = st.one_of(st.integers(0, 6).map(float), st.just(float("inf")))


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[np.ndarray], list[int], int]:
    size = draw(st.integers(1, 7))
    types = draw(st.integers(1, 3))
    costs = [np.array(draw(st.lists(cost_value, min_size=size, max_size=size))) for _ in range(types)]
    counts = draw(st.lists(st.integers(0, 3), min_size=types, max_size=types).filter(lambda c: 0 < sum(c) <= 4))
    return costs, counts, size


def brute_force(costs: list[np.ndarray], counts: list[int], total: int) -> float:
    units = [t for t, n in enumerate(counts) for _ in range(n)]
    best = float("inf")
    for extras in itertools.product(range(total + 1), repeat=len(units)):
        if sum(extras) == total:
            best = min(best, max(costs[t][e] for t, e in zip(units, extras, strict=True)))
    return best


@settings(max_examples=150, deadline=None)
@given(instances())
def test_optimum_equals_brute_force(instance: tuple[list[np.ndarray], list[int], int]) -> None:
    costs, counts, size = instance
    table = BottleneckTable(costs, counts, size)
    for total in range(size):
        expected = brute_force(costs, counts, total)
        assert table.value(total) == expected
        if np.isfinite(expected):
            split = table.assignment(total)
            assert [len(units) for units in split] == counts
            assert sum(map(sum, split)) == total
            assert max(costs[t][e] for t, units in enumerate(split) for e in units) == expected
        else:
            with pytest.raises(ValueError):
                table.assignment(total)


@settings(max_examples=40, deadline=None)
@given(instances())
def test_batched_assignments_equal_single_ones(instance: tuple[list[np.ndarray], list[int], int]) -> None:
    costs, counts, size = instance
    table = BottleneckTable(costs, counts, size)
    feasible = [e for e in range(size) if np.isfinite(table.value(e))]
    batch = table.assignments(feasible)
    for row, total in enumerate(feasible):
        assert [units[row].tolist() for units in batch] == table.assignment(total)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_square_shortcut_matches_the_general_convolution(data: st.DataObject) -> None:
    """``f ⊗ f`` only looks at half the splits; values and chosen splits must not change."""
    m = data.draw(st.sampled_from([1, 2, 3, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3]))
    f = np.array(data.draw(st.lists(cost_value, min_size=m, max_size=m)))
    square, square_split = minmax_convolve(f, f)
    general, general_split = minmax_convolve(f, f.copy())
    assert np.array_equal(square, general)
    finite = np.isfinite(general)
    assert np.array_equal(square_split[finite], general_split[finite])
    for e in range(m):
        naive = min(max(f[a], f[e - a]) for a in range(e + 1))
        assert general[e] == naive


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError):
        BottleneckTable([np.zeros(3)], [0], 3)
    with pytest.raises(ValueError):
        BottleneckTable([np.zeros(3)], [1, 1], 3)
    with pytest.raises(ValueError):
        minmax_convolve(np.zeros(2), np.zeros(3))
    table = BottleneckTable([np.array([1.0, 2.0])], [2], 4)
    assert table.value(3) == float("inf") and table.value(99) == float("inf")
