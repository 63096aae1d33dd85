"""Tests for smp_tf.partitioner.balance (pure Python, no TensorFlow)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from smp_tf.partitioner import balance
from smp_tf.partitioner.balance import (
    assignment_cut,
    balanced_assignment,
    brute_force_contiguous,
    contiguous_split,
    equal_cost_greedy_split,
    equal_count_split,
    lpt_assignment,
    min_bottleneck,
    segment_costs,
    split_cut_cost,
    stage_weighted_split,
)


def _check_boundaries(bounds, n, k):
    assert len(bounds) == k + 1
    assert bounds[0] == 0 and bounds[-1] == n
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    if n >= k:
        assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds


def _loads(costs, parts, k):
    loads = [0.0] * k
    for u, p in enumerate(parts):
        loads[p] += costs[u]
    return loads


# --------------------------------------------------------------------------- hand-computed


def test_min_bottleneck_hand():
    # [1,2,3 | 4,5] -> 6 and 9; moving the boundary either way gives 10 or 12,
    # so the best bottleneck for k=2 is 9.
    assert min_bottleneck([1, 2, 3, 4, 5], 2) == 9
    assert contiguous_split([1, 2, 3, 4, 5], [0, 0, 0, 0], 2) == [0, 3, 5]
    # [3 | 1,1,1 | 3]: every segment costs 3, and no unit is above 3.
    assert min_bottleneck([3, 1, 1, 1, 3], 3) == 3
    assert contiguous_split([3, 1, 1, 1, 3], [1, 1, 1, 1], 3) == [0, 1, 4, 5]


def test_tolerance_trades_bottleneck_for_cut():
    # Four units of 4: the only split with bottleneck 8 cuts the expensive
    # middle boundary (10). With 50% tolerance (bound 12) the split 4 | 12
    # (or 12 | 4) costs only 1; ties go to the earliest boundary.
    costs, cuts = [4, 4, 4, 4], [1, 10, 1]
    assert contiguous_split(costs, cuts, 2, tolerance=0.0) == [0, 2, 4]
    bounds = contiguous_split(costs, cuts, 2, tolerance=0.5)
    assert bounds == [0, 1, 4]
    assert split_cut_cost(bounds, cuts) == 1
    assert max(segment_costs(costs, bounds)) == 12


def test_single_huge_unit():
    # B* = 100; any segment holding the 100 plus a 1 costs 101 > B*, so the
    # 100 must stand alone: boundaries 2 and 3 (cuts 1 + 1), not the outer 5s.
    costs, cuts = [1, 1, 100, 1, 1], [5, 1, 1, 5]
    assert min_bottleneck(costs, 3) == 100
    bounds = contiguous_split(costs, cuts, 3)
    assert bounds == [0, 2, 3, 5]
    assert split_cut_cost(bounds, cuts) == 2
    assert brute_force_contiguous(costs, cuts, 3) == (100, 2)


def test_all_zero_costs_pick_cheapest_cuts():
    # Every split has bottleneck 0, so only the cut matters: the two cheapest
    # boundaries are after unit 1 (cost 1) and after unit 2 (cost 2).
    costs, cuts = [0, 0, 0, 0, 0], [3, 1, 2, 5]
    assert min_bottleneck(costs, 3) == 0
    assert contiguous_split(costs, cuts, 3) == [0, 2, 3, 5]


def test_fewer_units_than_segments():
    # Two units, four segments: singletons then empty segments; the bottleneck
    # is the biggest unit.
    assert contiguous_split([2, 3], [7], 4) == [0, 1, 2, 2, 2]
    assert min_bottleneck([2, 3], 4) == 3
    assert brute_force_contiguous([2, 3], [7], 4) == (3, 7)
    assert contiguous_split([], [], 3) == [0, 0, 0, 0]
    assert min_bottleneck([], 3) == 0


def test_k_equals_one_and_n():
    costs = [5, 1, 2, 7]
    assert contiguous_split(costs, [1, 1, 1], 1) == [0, 4]
    assert min_bottleneck(costs, 1) == 15
    # k == n: every unit alone, bottleneck = biggest unit.
    assert contiguous_split(costs, [1, 1, 1], 4) == [0, 1, 2, 3, 4]
    assert min_bottleneck(costs, 4) == 7


def test_segment_and_cut_helpers():
    assert segment_costs([1, 2, 3, 4], [0, 1, 1, 4]) == [1, 0, 9]
    # A repeated boundary is one cut; 0 and n are no cut.
    assert split_cut_cost([0, 1, 1, 4], [10, 20, 30]) == 10
    assert split_cut_cost([0, 2, 3, 3], [1, 2]) == 2


def test_baselines():
    # 5 units in 3 segments: sizes 2, 2, 1.
    assert equal_count_split(5, 3) == [0, 2, 4, 5]
    assert equal_count_split(2, 4) == [0, 1, 2, 2, 2]
    assert equal_count_split(0, 2) == [0, 0, 0]
    # total/k = 6: the first segment fills 1+1+1+1 = 4 < 6 and would take the
    # 8 too, but must leave one unit for the second segment.
    assert equal_cost_greedy_split([1, 1, 1, 1, 8], 2) == [0, 4, 5]
    # target 3: [2, 2] reaches 4 >= 3, then [3] reaches 3, the rest is last.
    assert equal_cost_greedy_split([2, 2, 3, 1, 1], 3) == [0, 2, 3, 5]
    assert equal_cost_greedy_split([1], 3) == [0, 1, 1, 1]
    # target 6: 4 + 1 = 5 < 6 so the 4 joins too (9 | 3); the exact split is 5 | 7.
    assert equal_cost_greedy_split([4, 1, 4, 3], 2) == [0, 3, 4]
    assert contiguous_split([4, 1, 4, 3], [0, 0, 0], 2) == [0, 2, 4]
    rng = random.Random(3)
    for _ in range(50):
        n, k = rng.randint(0, 20), rng.randint(1, 6)
        costs = [rng.randint(0, 9) for _ in range(n)]
        _check_boundaries(equal_cost_greedy_split(costs, k), n, k)
        _check_boundaries(equal_count_split(n, k), n, k)


# --------------------------------------------------------------------------- brute force


def test_contiguous_matches_brute_force():
    rng = random.Random(1234)
    for _ in range(400):
        n, k = rng.randint(0, 9), rng.randint(1, 4)
        costs = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(n)]
        cuts = [rng.randint(0, 10) for _ in range(max(n - 1, 0))]
        tol = rng.choice([0.0, 0.1])
        best, best_cut = brute_force_contiguous(costs, cuts, k, tol)
        assert min_bottleneck(costs, k) == pytest.approx(best, abs=1e-9)
        bounds = contiguous_split(costs, cuts, k, tol)
        _check_boundaries(bounds, n, k)
        assert max(segment_costs(costs, bounds), default=0.0) <= (1 + tol) * best + 1e-9
        assert split_cut_cost(bounds, cuts) == pytest.approx(best_cut, abs=1e-9)


def test_min_bottleneck_float_costs_vs_brute_force():
    rng = random.Random(7)
    for _ in range(100):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        costs = [rng.random() for _ in range(n)]
        best, _ = brute_force_contiguous(costs, [0.0] * (n - 1), k)
        assert min_bottleneck(costs, k) == pytest.approx(best, rel=1e-9)


def test_limited_contiguous_matches_brute_force():
    """With a cap on a second cost, the split is still optimal for the first
    (among the splits that keep the cap), then for the cut."""
    rng = random.Random(4321)
    checked = 0
    for _ in range(400):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        costs = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        var = [rng.choice([0, 0, 1, 4, 6]) for _ in range(n)]
        cuts = [rng.randint(0, 10) for _ in range(n - 1)]
        tol = rng.choice([0.0, 0.1])
        limit = rng.uniform(max(var), sum(var) + 1)
        try:
            best, best_cut = brute_force_contiguous(costs, cuts, k, tol, var, limit)
        except ValueError:
            # No split keeps the cap: the fast path says so too.
            with pytest.raises(ValueError, match="limit"):
                contiguous_split(costs, cuts, k, tol, limit_costs=var, limit=limit)
            continue
        checked += 1
        assert min_bottleneck(costs, k, var, limit) == pytest.approx(best, abs=1e-9)
        bounds = contiguous_split(costs, cuts, k, tol, limit_costs=var, limit=limit)
        _check_boundaries(bounds, n, k)
        assert max(segment_costs(var, bounds)) <= limit + 1e-9
        assert max(segment_costs(costs, bounds)) <= (1 + tol) * best + 1e-9
        assert split_cut_cost(bounds, cuts) == pytest.approx(best_cut, abs=1e-9)
    assert checked > 200


def test_limit_moves_the_split_away_from_the_unlimited_optimum():
    # Costs alone split [5 | 1 1 1 1 1]; the second cost (all in the tail)
    # forbids that: the tail may hold at most 6 of the 10.
    costs = [5, 1, 1, 1, 1, 1]
    var = [0, 0, 2, 2, 3, 3]
    assert contiguous_split(costs, [0] * 5, 2) == [0, 1, 6]
    bounds = contiguous_split(costs, [0] * 5, 2, limit_costs=var, limit=6)
    assert bounds == [0, 4, 6]
    assert min_bottleneck(costs, 2, var, 6) == 8


def test_balanced_assignment_keeps_the_limit():
    rng = random.Random(17)
    for _ in range(100):
        n, k = rng.randint(4, 40), rng.randint(2, 5)
        costs = [rng.choice([1, 2, 3, 20]) for _ in range(n)]
        var = [rng.choice([0, 1, 2, 5]) for _ in range(n)]
        edges = [(rng.randrange(n), rng.randrange(n), rng.choice([0.5, 4.0])) for _ in range(2 * n)]
        limit = 1.10 * max(sum(var) / k, max(var))
        parts = balanced_assignment(costs, k, edges, limit_costs=var, limit=limit)
        start = balance._lpt_limited([float(c) for c in costs], [float(v) for v in var], limit, k, {})
        start_max = max(_loads(var, start, k))
        # Refinement never pushes a part over the limit (or over where the
        # greedy start left it, when that could not keep the limit).
        assert max(_loads(var, parts, k)) <= max(limit, start_max) + 1e-9


def test_limited_greedy_start_fits_what_plain_lpt_does_not():
    # Plain LPT on costs piles the variable-heavy units together.
    costs = [10, 6, 4, 1, 1]
    var = [0, 0, 5, 0, 5]
    assert max(_loads(var, lpt_assignment(costs, 2), 2)) == 10
    parts = balanced_assignment(costs, 2, [], limit_costs=var, limit=6)
    assert max(_loads(var, parts, 2)) == 5
    assert max(_loads(costs, parts, 2)) == 11


def test_large_contiguous_finishes():
    # Not a timing assertion: just that the O(k n) path handles a big input.
    rng = random.Random(0)
    n, k = 100_000, 8
    costs = [rng.random() for _ in range(n)]
    cuts = [rng.random() for _ in range(n - 1)]
    bounds = contiguous_split(costs, cuts, k, tolerance=0.05)
    _check_boundaries(bounds, n, k)
    best = min_bottleneck(costs, k)
    assert best >= sum(costs) / k - 1e-9
    assert max(segment_costs(costs, bounds)) <= 1.05 * best * (1 + 1e-9)


# --------------------------------------------------------------------------- non-contiguous


def test_lpt_hand():
    # LPT, k=2: 7 -> p0, 5 -> p1, 4 -> p1 (5 < 7), 3 -> p0 (9 > 7), 1 -> p1
    # (10 vs 9): loads 10 / 10.
    assert lpt_assignment([7, 5, 4, 3, 1], 2) == [0, 1, 1, 0, 1]


def test_refinement_swaps_to_cut_light_edge():
    # Four unit-cost units, heavy edges 0-1 and 2-3. LPT alternates parts
    # ([0, 1, 0, 1]) and cuts both heavy edges (20). Single moves would
    # unbalance (cap 2.1 < 3), so a swap of units 1 and 2 gives {0,1} {2,3}
    # with only the light 0-2 edge cut.
    costs = [1, 1, 1, 1]
    edges = [(0, 1, 10.0), (2, 3, 10.0), (0, 2, 1.0)]
    start = lpt_assignment(costs, 2)
    assert assignment_cut(start, edges) == 20
    parts = balanced_assignment(costs, 2, edges, tolerance=0.05)
    assert assignment_cut(parts, edges) == 1
    assert sorted(_loads(costs, parts, 2)) == [2, 2]


def test_refinement_is_local_but_improves_chain():
    # Chain of 6 equal units, k=2, edges only along the chain. LPT alternates
    # parts ([0, 1, 0, 1, 0, 1]) and cuts all 5 edges. Refinement is a local
    # search (positive-gain moves and swaps under the cap 3), so it must keep
    # loads at 3 / 3 and cut fewer edges, though it need not reach the global
    # optimum of 1.
    costs = [1] * 6
    edges = [(i, i + 1, 1.0) for i in range(5)]
    assert assignment_cut(lpt_assignment(costs, 2), edges) == 5
    parts = balanced_assignment(costs, 2, edges, tolerance=0.0)
    assert 1 <= assignment_cut(parts, edges) < 5
    assert sorted(_loads(costs, parts, 2)) == [3, 3]


def test_balanced_assignment_random_properties():
    rng = random.Random(99)
    for _ in range(150):
        n, k = rng.randint(1, 40), rng.randint(1, 6)
        costs = [rng.choice([0, 1, 2, 3, 5, 10]) for _ in range(n)]
        n_edges = rng.randint(0, 3 * n)
        edges = [(rng.randrange(n), rng.randrange(n), rng.choice([0.5, 1.0, 4.0])) for _ in range(n_edges)]
        tol = rng.choice([0.0, 0.05, 0.3])
        fixed = {u: rng.randrange(k) for u in rng.sample(range(n), rng.randint(0, min(3, n)))}
        start = lpt_assignment(costs, k, fixed)
        parts = balanced_assignment(costs, k, edges, tolerance=tol, fixed=fixed)
        assert len(parts) == n and all(0 <= p < k for p in parts)
        assert all(parts[u] == p for u, p in fixed.items())
        # Refinement only takes positive-gain moves.
        assert assignment_cut(parts, edges) <= assignment_cut(start, edges) + 1e-9
        # The cap: never above the LPT start, nor above the tolerance bound
        # whenever LPT itself was within it.
        lpt_max = max(_loads(costs, start, k))
        bound = (1 + tol) * max(sum(costs) / k, max(costs))
        got = max(_loads(costs, parts, k))
        assert got <= max(lpt_max, bound) + 1e-9
        if lpt_max <= bound:
            assert got <= bound + 1e-9
        if not fixed and n >= k:
            assert set(parts) == set(range(k))


def test_balanced_assignment_nonempty_with_zero_costs():
    # Zero-cost units still spread over every part (ties go to emptier parts),
    # and refinement never empties a part even though all edges pull together.
    costs = [0] * 6
    edges = [(i, j, 1.0) for i in range(6) for j in range(i + 1, 6)]
    parts = balanced_assignment(costs, 3, edges)
    assert set(parts) == {0, 1, 2}


def test_balanced_assignment_fewer_units_than_parts():
    parts = balanced_assignment([3, 1], 4, [(0, 1, 5.0)])
    assert len(set(parts)) == 2


def test_balanced_assignment_larger_graph():
    # Not a timing assertion (the 100k-unit size is benchmarked elsewhere).
    rng = random.Random(5)
    n, k = 20_000, 8
    costs = [rng.random() for _ in range(n)]
    edges = [(i, i + 1, 1.0) for i in range(n - 1)]
    edges += [(rng.randrange(n), rng.randrange(n), rng.random()) for _ in range(2 * n)]
    start = lpt_assignment(costs, k)
    parts = balanced_assignment(costs, k, edges, tolerance=0.05)
    assert set(parts) == set(range(k))
    assert assignment_cut(parts, edges) < assignment_cut(start, edges)
    assert max(_loads(costs, parts, k)) <= 1.05 * sum(costs) / k + 1e-6


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call, bad",
    [
        (lambda: min_bottleneck([1, 2], 0), "0"),
        (lambda: min_bottleneck([1, -2], 1), "-2"),
        (lambda: min_bottleneck([1, float("nan")], 1), "nan"),
        (lambda: min_bottleneck([1, float("inf")], 1), "inf"),
        (lambda: contiguous_split([1, 2], [1], -3), "-3"),
        (lambda: contiguous_split([1, 2], [1], 2.5), "2.5"),
        (lambda: contiguous_split([1, -7.5], [1], 2), "-7.5"),
        (lambda: contiguous_split([1, 2, 3], [1], 2), "1 entries"),
        (lambda: contiguous_split([1, 2], [-4], 2), "-4"),
        (lambda: contiguous_split([1, 2], [float("nan")], 2), "nan"),
        (lambda: contiguous_split([1, 2], [1], 2, tolerance=-0.25), "-0.25"),
        (lambda: contiguous_split([1, 2], [1], 2, tolerance=float("nan")), "nan"),
        (lambda: balanced_assignment([1, 2], 0), "0"),
        (lambda: balanced_assignment([1, -9], 2), "-9"),
        (lambda: balanced_assignment([1, 2], 2, tolerance=-1.5), "-1.5"),
        (lambda: balanced_assignment([1, 2], 2, fixed={5: 0}), "5"),
        (lambda: balanced_assignment([1, 2], 2, fixed={0: 7}), "7"),
        (lambda: balanced_assignment([1, 2], 2, edges=[(0, 9, 1.0)]), "(0, 9, 1.0)"),
        (lambda: balanced_assignment([1, 2], 2, edges=[(0, 1, -3.0)]), "(0, 1, -3.0)"),
        (lambda: contiguous_split([1, 2], [1], 2, limit_costs=[1, 2]), "limit=None"),
        (lambda: contiguous_split([1, 2], [1], 2, limit_costs=[1], limit=3), "1 entries"),
        (lambda: contiguous_split([1, 2], [1], 2, limit_costs=[1, -1], limit=3), "-1"),
        (lambda: contiguous_split([1, 2], [1], 2, limit_costs=[1, 2], limit=1.5), "1.5"),
        (lambda: contiguous_split([1, 2, 3], [1, 1], 1, limit_costs=[1, 1, 1], limit=2), "limit=2"),
        (lambda: min_bottleneck([1, 2, 3], 2, [2, 2, 2], 2.5), "limit"),
        (lambda: balanced_assignment([1, 2], 2, limit_costs=[1, 2], limit=float("nan")), "nan"),
        (lambda: equal_count_split(-2, 2), "-2"),
        (lambda: equal_cost_greedy_split([1, 2], 0), "0"),
        (lambda: segment_costs([1, 2], [0, 3]), "[0, 3]"),
        (lambda: split_cut_cost([0, 2, 1, 3], [1, 1]), "[0, 2, 1, 3]"),
    ],
)
def test_invalid_inputs_raise_value_error(call, bad):
    with pytest.raises(ValueError) as err:
        call()
    assert bad in str(err.value)


def test_module_does_not_import_tensorflow():
    # The partitioner core is plain Python; check the source, since the test
    # session itself has TensorFlow loaded.
    src = open(balance.__file__).read()
    assert "import tensorflow" not in src and math.isfinite(balance.REL_EPS)


# --------------------------------------------------------------------------- stage-weighted split


def _stage_costs(static, act, mult, fixed, bounds):
    """Cost of each stage of a split, summed directly (no prefix sums)."""
    return [
        fixed[p] + sum(static[bounds[p]:bounds[p + 1]]) + mult[p] * sum(act[bounds[p]:bounds[p + 1]])
        for p in range(len(mult))
    ]


def _stage_weighted_brute(static, act, mult, cuts, fixed, tol):
    """Every split (non-empty segments, or the forced one when n <= k):
    ``(optimal bottleneck, min cut within (1 + tol) * it, lexicographically
    smallest min-cut split)``."""
    n, k = len(static), len(mult)
    if n <= k:
        splits = [list(range(n + 1)) + [n] * (k - n)]
    else:
        splits = [[0, *inner, n] for inner in itertools.combinations(range(1, n), k - 1)]
    peaks = [max(_stage_costs(static, act, mult, fixed, b)) for b in splits]
    best = min(peaks)
    within = [b for b, pk in zip(splits, peaks) if pk <= (1 + tol) * best + 1e-9]
    best_cut = min(split_cut_cost(b, cuts) for b in within)
    chosen = min(b for b in within if split_cut_cost(b, cuts) == best_cut)
    return best, best_cut, chosen


def test_stage_weighted_hand():
    # 4 equal units, activation cost only, multipliers [2, 1] (stage 0 keeps
    # two micro-batches alive). Splits: 1|3 -> 2*1, 1*3 = 3; 2|2 -> 4, 2;
    # 3|1 -> 6, 1. The best bottleneck (3) gives the first stage fewer units.
    assert stage_weighted_split([0] * 4, [1] * 4, [2, 1]) == [0, 1, 4]
    # Equal multipliers and no activations: the plain balanced split 2|2.
    assert stage_weighted_split([1] * 4, [0] * 4, [1, 1]) == [0, 2, 4]
    # 1F1B with P = 4 stages and M = 8 micro-batches keeps min(P - p, M) =
    # 4, 3, 2, 1 activations alive. 12 units of activation 1: under bound 6
    # the stages hold at most 1, 2, 3 and 6 units, exactly 12, so 1|2|3|6
    # (costs 4, 6, 6, 6) is the only split; under bound 5 they hold at most
    # 1 + 1 + 2 + 5 = 9 < 12 units.
    assert stage_weighted_split([0] * 12, [1] * 12, [4, 3, 2, 1]) == [0, 1, 3, 6, 12]


def test_stage_weighted_fixed_costs_shift_the_split():
    # Stage 0 also holds e.g. the embedding (fixed 3): with 6 unit-cost units
    # the split 1|5 costs 4, 5 and 2|4 costs 5, 4; both have bottleneck 5, and
    # ties go to the lexicographically smallest boundaries.
    assert stage_weighted_split([1] * 6, [0] * 6, [1, 1], fixed_costs=[3, 0]) == [0, 1, 6]
    # A large fixed cost on stage 1 leaves it the fewest units: 3|1 costs 3,
    # 11 while 1|3 costs 1, 13 (and 2|2 costs 2, 12).
    bounds = stage_weighted_split([1] * 4, [0] * 4, [1, 1], fixed_costs=[0, 10])
    assert bounds == [0, 3, 4]
    assert max(_stage_costs([1] * 4, [0] * 4, [1, 1], [0, 10], bounds)) == 11


def test_stage_weighted_stage_must_stop_early():
    # Greedy "extend each stage as far as it fits" is not enough when stages
    # weigh units differently: with bound 2, stage 0 could take units 0 and 1,
    # but then stage 1 (multiplier 100) would start on unit 2 (cost 100). The
    # only split with bottleneck 2 gives stage 1 just the free unit 1.
    act, mult = [1, 0, 1, 1], [1, 100, 1]
    bounds = stage_weighted_split([0] * 4, act, mult)
    assert bounds == [0, 1, 2, 4]
    assert max(_stage_costs([0] * 4, act, mult, [0, 0, 0], bounds)) == 2


def test_stage_weighted_cut_tiebreak_and_tolerance():
    # Four units of activation 1, multipliers [1, 1]: only 2|2 has bottleneck
    # 2, and it pays the expensive middle cut (10). With 50% tolerance
    # (bound 3), 1|3 and 3|1 are allowed and cost 1; the smaller boundary wins.
    cuts = [1, 10, 1]
    assert stage_weighted_split([0] * 4, [1] * 4, [1, 1], cut_costs=cuts) == [0, 2, 4]
    assert stage_weighted_split([0] * 4, [1] * 4, [1, 1], cut_costs=cuts, tolerance=0.5) == [0, 1, 4]


def test_stage_weighted_fewer_units_than_stages():
    # As contiguous_split: singletons, then empty trailing segments.
    assert stage_weighted_split([2, 3], [1, 1], [3, 2, 1, 1]) == [0, 1, 2, 2, 2]
    assert stage_weighted_split([], [], [1, 1, 1]) == [0, 0, 0, 0]
    assert stage_weighted_split([5], [1], [2]) == [0, 1]
    assert stage_weighted_split([5, 1, 2], [1, 1, 1], [7]) == [0, 3]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_stage_weighted_matches_brute_force(seed):
    # Integer data keeps every stage cost exact, so the bottleneck, the cut
    # cost and the chosen (lexicographically smallest) split must all match.
    rng = random.Random(seed)
    for _ in range(150):
        n, k = rng.randint(0, 8), rng.randint(1, 4)
        static = [rng.choice([0, 0, 1, 2, 5]) for _ in range(n)]
        act = [rng.choice([0, 1, 3, 7]) for _ in range(n)]
        mult = [rng.choice([0, 1, 2, 4, 100]) for _ in range(k)]
        fixed = [rng.choice([0, 0, 3, 20]) for _ in range(k)] if rng.random() < 0.5 else None
        cuts = [rng.randint(0, 5) for _ in range(max(n - 1, 0))] if rng.random() < 0.7 else None
        tol = rng.choice([0.0, 0.0, 0.1, 0.5])
        fx = fixed or [0] * k
        ct = cuts or [0] * max(n - 1, 0)
        best, best_cut, chosen = _stage_weighted_brute(static, act, mult, ct, fx, tol)
        bounds = stage_weighted_split(static, act, mult, cut_costs=cuts, fixed_costs=fixed, tolerance=tol)
        _check_boundaries(bounds, n, k)
        peak = max(_stage_costs(static, act, mult, fx, bounds))
        assert peak <= (1 + tol) * best + 1e-9
        if tol == 0.0:
            assert peak == best
        assert split_cut_cost(bounds, ct) == best_cut
        assert bounds == chosen


def test_stage_weighted_float_bottleneck_matches_brute_force():
    rng = random.Random(11)
    for _ in range(300):
        n, k = rng.randint(1, 8), rng.randint(1, 4)
        static = [rng.random() for _ in range(n)]
        act = [rng.random() * rng.choice([0, 1, 5]) for _ in range(n)]
        mult = [rng.choice([0, 1, 2.5, 4, 100]) for _ in range(k)]
        fixed = [rng.choice([0, 0.3, 2.0]) for _ in range(k)]
        best, _, _ = _stage_weighted_brute(static, act, mult, [0] * max(n - 1, 0), fixed, 0.0)
        bounds = stage_weighted_split(static, act, mult, fixed_costs=fixed)
        _check_boundaries(bounds, n, k)
        assert max(_stage_costs(static, act, mult, fixed, bounds)) == pytest.approx(best, rel=1e-9)


def test_stage_weighted_reduces_to_min_bottleneck():
    # Multipliers all 1 and no activations: the plain contiguous problem.
    rng = random.Random(21)
    for _ in range(100):
        n, k = rng.randint(0, 30), rng.randint(1, 6)
        static = [rng.choice([0, 1, 2, 3, 5, 8, 13]) for _ in range(n)]
        bounds = stage_weighted_split(static, [0] * n, [1] * k)
        _check_boundaries(bounds, n, k)
        assert max(segment_costs(static, bounds)) == min_bottleneck(static, k)


def test_stage_weighted_large_finishes():
    # Not a timing assertion: just that the bisection + O(k n) DP handles the
    # sizes a real model produces. The result can be no worse than any split,
    # the equal-count one included.
    rng = random.Random(0)
    for n, k in [(2000, 8), (3000, 16)]:
        static = [rng.random() for _ in range(n)]
        act = [3 * rng.random() for _ in range(n)]
        mult = [min(k - p, 2 * k) for p in range(k)]  # 1F1B, M = 2k micro-batches
        fixed = [1.0] * k
        cuts = [rng.random() for _ in range(n - 1)]
        bounds = stage_weighted_split(static, act, mult, cut_costs=cuts, fixed_costs=fixed, tolerance=0.02)
        _check_boundaries(bounds, n, k)
        peak = max(_stage_costs(static, act, mult, fixed, bounds))
        naive = max(_stage_costs(static, act, mult, fixed, equal_count_split(n, k)))
        assert peak <= 1.02 * naive + 1e-6
        # Early stages keep more activations alive, so they get fewer units.
        assert bounds[1] - bounds[0] < bounds[k] - bounds[k - 1]


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(static_costs=[1, 2], activation_costs=[1], multipliers=[1]), "1 entries"),
        (dict(static_costs=[1, -2], activation_costs=[1, 1], multipliers=[1]), "-2"),
        (dict(static_costs=[1, 2], activation_costs=[1, float("nan")], multipliers=[1]), "nan"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[]), "[]"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1, -3]), "-3"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[float("inf")]), "inf"),
        (dict(static_costs=[1, 2, 3], activation_costs=[1, 1, 1], multipliers=[1], cut_costs=[1]), "1 entries"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1], cut_costs=[-4]), "-4"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1, 1], fixed_costs=[1]), "1 entries"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1, 1], fixed_costs=[1, -0.5]), "-0.5"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1], tolerance=-0.25), "-0.25"),
        (dict(static_costs=[1, 2], activation_costs=[1, 1], multipliers=[1], tolerance=float("nan")), "nan"),
    ],
)
def test_stage_weighted_invalid_inputs(kwargs, bad):
    with pytest.raises(ValueError) as err:
        stage_weighted_split(**kwargs)
    assert bad in str(err.value)
