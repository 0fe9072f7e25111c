"""The IIDP sampler: exact coverage, proportional shares, the remainder rule, resume under another plan."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from jabascli.engine.plan import RankPlan, TrainingPlan
from jabascli.engine.sampler import IIDPSampler


def plan_of(ranks: list[tuple[int, int]], lbs: int) -> TrainingPlan:
    return TrainingPlan(lbs, tuple(RankPlan(r, f"s{r}", "cpu", v, g) for r, (v, g) in enumerate(ranks)))


def consumed(sampler: IIDPSampler, plan: TrainingPlan, epoch: int, position: int = 0) -> list[int]:
    """Every index every rank, VSW and GA step trains on in the rest of the epoch, in worker order."""
    per_rank = [list(sampler.rank_iterations(epoch, position, plan, r)) for r in range(plan.world_size)]
    indices = []
    for iterations in zip(*per_rank, strict=True):
        batches = sorted((mb for it in iterations for mb in it.micro_batches), key=lambda mb: mb.worker)
        assert [mb.worker for mb in batches] == list(range(plan.workers))
        for mb in batches:
            assert len(mb.indices) == plan.lbs
            indices += mb.indices
    return indices


ranks_strategy = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(ranks=ranks_strategy, lbs=st.integers(1, 5), iterations=st.integers(1, 4), epoch=st.integers(0, 3))
def test_an_epoch_uses_the_permutation_exactly_once(
    ranks: list[tuple[int, int]], lbs: int, iterations: int, epoch: int
) -> None:
    plan = plan_of(ranks, lbs)
    sampler = IIDPSampler(plan.gbs * iterations, seed=3)
    assert consumed(sampler, plan, epoch) == sampler.permutation(epoch)


@settings(max_examples=40, deadline=None)
@given(ranks=ranks_strategy, lbs=st.integers(1, 5), size=st.integers(1, 200))
def test_the_remainder_is_left_out_and_every_used_sample_is_used_once(
    ranks: list[tuple[int, int]], lbs: int, size: int
) -> None:
    plan = plan_of(ranks, lbs)
    sampler = IIDPSampler(size, seed=0)
    used = consumed(sampler, plan, 0)
    full = size // plan.gbs * plan.gbs
    assert used == sampler.permutation(0)[:full]
    assert sampler.iterations_per_epoch(plan.gbs) == size // plan.gbs


def test_each_rank_gets_a_share_proportional_to_its_workers() -> None:
    plan = plan_of([(3, 1), (1, 0), (2, 2)], lbs=4)  # 6 + 1 + 6 workers
    sampler = IIDPSampler(plan.gbs * 5, seed=1)
    for rank, expected in enumerate((6, 1, 6)):
        iterations = list(sampler.rank_iterations(0, 0, plan, rank))
        assert len(iterations) == 5
        assert all(sum(len(mb.indices) for mb in it.micro_batches) == expected * 4 for it in iterations)
        assert {(mb.vsw, mb.ga_step) for mb in iterations[0].micro_batches} == {
            (v, a) for v in range(plan.rank(rank).vsw) for a in range(plan.rank(rank).ga + 1)
        }


def test_every_rank_draws_the_same_permutation_and_it_changes_per_epoch() -> None:
    a, b = IIDPSampler(100, seed=5), IIDPSampler(100, seed=5)
    assert a.permutation(2) == b.permutation(2)
    assert a.permutation(2) != a.permutation(3)
    assert sorted(a.permutation(0)) == list(range(100))
    assert IIDPSampler(100, seed=6).permutation(2) != a.permutation(2)


def test_resuming_mid_epoch_under_another_plan_neither_repeats_nor_skips() -> None:
    before = plan_of([(2, 1), (1, 0)], lbs=3)  # GBS 15
    after = plan_of([(1, 0), (1, 1), (2, 0), (1, 0)], lbs=3)  # GBS 18, four ranks
    sampler = IIDPSampler(200, seed=9)
    first = consumed(sampler, before, 1)[: 4 * before.gbs]  # stopped after 4 iterations
    position = 4 * before.gbs
    rest = consumed(sampler, after, 1, position)
    perm = sampler.permutation(1)
    assert first + rest == perm[: position + (200 - position) // after.gbs * after.gbs]
    assert max(Counter(first + rest).values()) == 1


def test_worker_seeds_follow_the_samples_not_the_plan() -> None:
    sampler = IIDPSampler(120, seed=2)
    one = plan_of([(4, 2)], lbs=5)
    three = plan_of([(1, 0), (2, 1), (1, 5)], lbs=5)
    seeds = {}
    for plan in (one, three):
        for rank in range(plan.world_size):
            for it in sampler.rank_iterations(0, 0, plan, rank):
                for mb in it.micro_batches:
                    assert seeds.setdefault(mb.position, mb.seed) == mb.seed
    assert len(set(seeds.values())) == len(seeds)
