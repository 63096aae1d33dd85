"""Load-balancing algorithms over a sequence of *units* (plain Python, no TensorFlow).

A unit is an indivisible piece of the model (a colocation group). The caller
supplies, in forward order:

* ``costs[i]``: the non-negative cost of unit ``i`` (time or memory);
* ``cut_costs[i]``: for contiguous splits, what a boundary between unit ``i``
  and unit ``i + 1`` costs (e.g. bytes sent across it);
* ``edges``: for non-contiguous assignments, ``(u, v, weight)`` pairs paid
  when ``u`` and ``v`` land in different parts.

Contiguous splits are exact and run in two stages:

1. `min_bottleneck`: the smallest achievable maximum segment cost ``B*``.
   It uses Nicol's probe-based search: every probe is a greedy feasibility
   test done with binary searches over prefix sums (``O(k log n)``), and
   ``O(k log n)`` probes pin ``B*`` down exactly, so the whole search is
   ``O(n + k^2 log^2 n)``.
2. `contiguous_split`: among the splits whose segments all cost at most
   ``(1 + tolerance) * B*``, one with the smallest total cut cost. A DP over
   prefix positions whose admissible predecessors form a sliding window, so a
   monotone deque gives ``O(k n)`` (plus ``O(n log n)`` to locate the windows).

`stage_weighted_split` is the pipeline-memory variant: segment p costs
``fixed[p] + static + multipliers[p] * activations``, so the cost of a unit
depends on the stage it lands on. The same two stages apply (bisection on
the bound with an exact reachable-set feasibility test, then a sliding-window
cut-cost DP, ``O(k n log n)``).

`balanced_assignment` is the non-contiguous counterpart: LPT greedy for the
load, then bounded single-move / swap refinement that lowers the cut weight
without letting any part exceed a load cap.

`equal_count_split` and `equal_cost_greedy_split` are naive baselines kept for
benchmarks; `brute_force_contiguous` is an exhaustive reference for tests.

Boundaries are lists ``[b0 = 0, b1, ..., bk = n]``; segment ``j`` holds units
``b_j .. b_{j+1} - 1``.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from bisect import bisect_left, bisect_right
from collections import deque
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "min_bottleneck",
    "contiguous_split",
    "balanced_assignment",
    "lpt_assignment",
    "assignment_cut",
    "split_cut_cost",
    "segment_costs",
    "brute_force_contiguous",
    "stage_weighted_split",
    "equal_count_split",
    "equal_cost_greedy_split",
]

#: Relative slack (times the total cost) used in every "sum <= bound" test, so
#: that prefix-sum rounding never turns an achievable bound into an infeasible one.
REL_EPS = 1e-12
#: Refinement sweeps over all units in `balanced_assignment`.
REFINE_PASSES = 3
#: Blocked units remembered per (from, to) part pair as swap partners (bounds
#: the work per blocked move).
MAX_SWAP_CANDIDATES = 8

_INF = float("inf")


# --------------------------------------------------------------------------- validation


def _check_k(k: int) -> int:
    try:
        k_int = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be an integer >= 1. Received: {k!r}") from None
    if isinstance(k, bool) or k_int < 1:
        raise ValueError(f"k must be an integer >= 1. Received: {k!r}")
    return k_int


def _check_costs(costs: Sequence[float], name: str = "costs") -> List[float]:
    out = []
    for i, c in enumerate(costs):
        try:
            f = float(c)
        except (TypeError, ValueError):
            raise ValueError(f"{name}[{i}] must be a finite number >= 0. Received: {c!r}") from None
        # `not f >= 0` also catches NaN.
        if not (f >= 0.0) or f == _INF:
            raise ValueError(f"{name}[{i}] must be a finite number >= 0. Received: {c!r}")
        out.append(f)
    return out


def _check_tolerance(tolerance: float) -> float:
    t = float(tolerance)
    if not (t >= 0.0) or t == _INF:  # rejects NaN too
        raise ValueError(f"tolerance must be a finite number >= 0. Received: {tolerance!r}")
    return t


def _check_cut_costs(cut_costs: Sequence[float], n: int) -> List[float]:
    if len(cut_costs) != max(n - 1, 0):
        raise ValueError(
            f"cut_costs must have len(costs) - 1 = {max(n - 1, 0)} entries. "
            f"Received: {len(cut_costs)} entries"
        )
    return _check_costs(cut_costs, "cut_costs")


def _check_limit(
    limit_costs: Optional[Sequence[float]], limit: Optional[float], n: int
) -> Tuple[Optional[List[float]], Optional[float]]:
    """Validates a second, capped cost per unit (e.g. variable bytes)."""
    if limit_costs is None and limit is None:
        return None, None
    if limit_costs is None or limit is None:
        raise ValueError(
            f"limit_costs and limit go together. Received: limit_costs={'None' if limit_costs is None else '...'}, "
            f"limit={limit!r}"
        )
    if len(limit_costs) != n:
        raise ValueError(f"limit_costs must have len(costs) = {n} entries. Received: {len(limit_costs)} entries")
    v = _check_costs(limit_costs, "limit_costs")
    lim = float(limit)
    if not (lim >= 0.0) or lim == _INF:
        raise ValueError(f"limit must be a finite number >= 0. Received: {limit!r}")
    worst = max(v, default=0.0)
    if worst > lim + _eps(sum(v)):
        raise ValueError(
            f"limit={limit!r} is below the largest limit_costs entry ({worst!r}): no part can hold that unit. "
            "Raise the limit to at least the largest entry."
        )
    return v, lim


def _cap_reach(pv: List[float], limit: float) -> List[int]:
    """``reach[j]``: the furthest end i with ``sum(v[j:i]) <= limit`` (`pv`: prefix sums of v)."""
    bound = limit + _eps(pv[-1])
    return [bisect_right(pv, pv[j] + bound, j) - 1 for j in range(len(pv))]


def _check_boundaries(boundaries: Sequence[int], n: Optional[int] = None) -> List[int]:
    try:
        b = [operator.index(x) for x in boundaries]
    except TypeError:
        raise ValueError(f"boundaries must be integers. Received: {list(boundaries)}") from None
    if len(b) < 2 or b[0] != 0 or any(b[i] > b[i + 1] for i in range(len(b) - 1)):
        raise ValueError(
            f"boundaries must be non-decreasing, start at 0 and have >= 2 entries. Received: {list(boundaries)}"
        )
    if n is not None and b[-1] != n:
        raise ValueError(f"boundaries must end at n = {n}. Received: {list(boundaries)}")
    return b


def _prefix(costs: Sequence[float]) -> List[float]:
    s = [0.0] * (len(costs) + 1)
    acc = 0.0
    for i, c in enumerate(costs):
        acc += c
        s[i + 1] = acc
    return s


def _eps(total: float) -> float:
    return REL_EPS * total


# --------------------------------------------------------------------------- contiguous


def _segment_end(s: List[float], pos: int, bound: float, cap: Optional[List[int]]) -> int:
    """Furthest end of a segment starting at `pos` with sum <= bound (and, with
    `cap`, ending by ``cap[pos]``)."""
    end = bisect_right(s, s[pos] + bound, pos) - 1
    return end if cap is None else min(end, cap[pos])


def _feasible(s: List[float], start: int, parts: int, bound: float, cap: Optional[List[int]] = None) -> bool:
    """Greedy test: can units ``start..n-1`` be covered by `parts` segments of sum <= bound?

    Taking the longest admissible segment each time is optimal, and each jump
    is one binary search, so a probe costs O(parts log n). With `cap` (see
    `_cap_reach`) a segment starting at j also ends by ``cap[j]``; both limits
    grow with j, so the longest admissible segment is still optimal.
    """
    n = len(s) - 1
    pos = start
    for _ in range(parts):
        if pos == n:
            return True
        pos = _segment_end(s, pos, bound, cap)
    return pos == n


def _greedy_peak(s: List[float], k: int, bound: float, cap: List[int]) -> float:
    """Largest segment sum of the greedy cover at `bound` (a feasible bound)."""
    n = len(s) - 1
    pos, peak = 0, 0.0
    for _ in range(k):
        if pos == n:
            break
        end = _segment_end(s, pos, bound, cap)
        peak = max(peak, s[end] - s[pos])
        pos = end
    return peak


def _min_bottleneck_capped(s: List[float], k: int, cap: List[int]) -> float:
    """`_min_bottleneck` when segments must also end by `cap` (bisection).

    The bound is bisected down to rounding and then snapped to the peak of a
    feasible greedy cover, which is itself a segment sum: the result is the
    optimum up to the rounding of prefix sums.
    """
    n = len(s) - 1
    if n == 0:
        return 0.0
    eps = _eps(s[n])
    hi = s[n]
    if not _feasible(s, 0, k, hi + eps, cap):
        raise ValueError(f"limit cannot be met with {k} contiguous segments; raise it.")
    lo = 0.0
    if _feasible(s, 0, k, eps, cap):
        return _greedy_peak(s, k, eps, cap)
    # Invariant: lo infeasible, hi feasible.
    for _ in range(200):
        if hi - lo <= eps:
            break
        mid = 0.5 * (lo + hi)
        if _feasible(s, 0, k, mid + eps, cap):
            hi = mid
        else:
            lo = mid
    return _greedy_peak(s, k, hi + eps, cap)


def _min_bottleneck(s: List[float], k: int) -> float:
    n = len(s) - 1
    if n == 0:
        return 0.0
    eps = _eps(s[n])
    # Nicol's search. With the first segment starting at `i`, let j be the
    # smallest end such that bound S[j]-S[i] is feasible. Then either the
    # optimum equals S[j]-S[i], or the optimal greedy first segment is [i, j-1)
    # and the optimum is that of the rest with one part fewer. Unrolling gives
    # B* = min over p of max(lo_p, cand_p), with lo_p the committed prefix max.
    best = _INF
    lo = 0.0
    i = 0
    for p in range(k - 1):
        parts = k - p
        a, b = i, n  # S[n]-S[i] with one segment is always feasible
        while a < b:
            m = (a + b) // 2
            if _feasible(s, i, parts, s[m] - s[i] + eps):
                b = m
            else:
                a = m + 1
        j = a
        best = min(best, max(lo, s[j] - s[i]))
        if j == i:  # bound 0 works: the rest is all zeros
            return best
        lo = max(lo, s[j - 1] - s[i])
        i = j - 1
    return min(best, max(lo, s[n] - s[i]))


def min_bottleneck(
    costs: Sequence[float],
    k: int,
    limit_costs: Optional[Sequence[float]] = None,
    limit: Optional[float] = None,
) -> float:
    """Smallest achievable maximum segment cost over splits into k contiguous segments.

    Segments may be empty (this only matters when ``len(costs) < k``; with
    non-negative costs an empty segment never helps otherwise).

    Args:
        costs: non-negative cost of each unit, in order.
        k: number of segments (>= 1).
        limit_costs: optional second cost per unit (e.g. variable bytes)...
        limit: ...that no segment may exceed in total. Both or neither.

    Returns:
        The optimal bottleneck ``B*`` (0.0 for no units). Exact up to the
        rounding of prefix sums.

    Raises:
        ValueError: `k` < 1, a cost is negative, NaN or infinite, or `limit`
            cannot be met by k contiguous segments.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    v, lim = _check_limit(limit_costs, limit, len(c))
    if k >= len(c):  # one unit per segment is optimal
        return max(c, default=0.0)
    if v is not None:
        return _min_bottleneck_capped(_prefix(c), k, _cap_reach(_prefix(v), lim))
    return _min_bottleneck(_prefix(c), k)


def contiguous_split(
    costs: Sequence[float],
    cut_costs: Sequence[float],
    k: int,
    tolerance: float = 0.0,
    limit_costs: Optional[Sequence[float]] = None,
    limit: Optional[float] = None,
) -> List[int]:
    """Exact two-stage contiguous split: bottleneck first, then cut cost.

    Among all splits of the units (in order) into k non-empty contiguous
    segments whose costs are all at most ``(1 + tolerance) * min_bottleneck``,
    returns one with the smallest sum of ``cut_costs`` at its boundaries.
    With fewer units than segments, returns n singletons followed by empty
    segments.

    Args:
        costs: non-negative cost of each of the n units, in order.
        cut_costs: ``cut_costs[i]`` is paid when a boundary falls between unit
            i and unit i + 1; exactly ``max(n - 1, 0)`` entries.
        k: number of segments (>= 1).
        tolerance: allowed relative excess over the optimal bottleneck.
        limit_costs: optional second cost per unit (e.g. variable bytes)...
        limit: ...that no segment may exceed in total; the bottleneck is then
            the optimum among the splits that respect it. Both or neither.

    Returns:
        Boundaries ``[0, b1, ..., n]`` (k + 1 non-decreasing entries).

    Raises:
        ValueError: `k` < 1, a negative / NaN / infinite cost or cut cost, a
            `cut_costs` of the wrong length, a negative / NaN `tolerance`, or
            a `limit` that k contiguous segments cannot meet.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    n = len(c)
    cut = _check_cut_costs(cut_costs, n)
    tol = _check_tolerance(tolerance)
    v, lim = _check_limit(limit_costs, limit, n)
    if n <= k:  # no choice: every unit alone, the rest empty
        return list(range(n + 1)) + [n] * (k - n)
    pv = None if v is None else _prefix(v)
    cap = None if pv is None else _cap_reach(pv, lim)
    if k == 1:
        if cap is not None and cap[0] < n:
            raise ValueError(f"limit={limit!r} cannot be met with 1 segment (the total is {sum(v)!r}); raise it.")
        return [0, n]

    s = _prefix(c)
    eps = _eps(s[n])
    best = _min_bottleneck(s, k) if cap is None else _min_bottleneck_capped(s, k, cap)
    bound = (1.0 + tol) * best + eps

    # left[i]: first j with S[i] - S[j] <= bound (and the limit kept), i.e.
    # segment [j, i) admissible; non-decreasing in i.
    left = [bisect_left(s, si - bound) for si in s]
    if pv is not None:
        vbound = lim + _eps(pv[n])
        left = [max(a, bisect_left(pv, pv[i] - vbound)) for i, a in enumerate(left)]
    # reach[t]: furthest prefix coverable by t segments (greedy forward);
    # back[t]: smallest start whose suffix is coverable by t segments. They
    # prune the DP to positions that can lie on a feasible split.
    reach = [0] * (k + 1)
    for t in range(1, k + 1):
        reach[t] = _segment_end(s, reach[t - 1], bound, cap)
    back = [n] * (k + 1)
    for t in range(1, k + 1):
        back[t] = left[back[t - 1]]

    # dp[i]: min cut cost of covering units [0, i) with `seg` non-empty
    # segments; args[seg][i] is where the last segment of that optimum starts.
    # Only positions that can lie on a feasible split are visited.
    dp = [_INF] * (n + 1)
    for i in range(1, min(reach[1], n - k + 1) + 1):
        dp[i] = 0.0  # left[i] == 0 for i <= reach[1]
    args: List[Optional[List[int]]] = [None, None]
    for seg in range(2, k + 1):
        lo_i = max(seg, back[k - seg])
        hi_i = min(n - (k - seg), reach[seg])
        if seg == k:
            lo_i = hi_i = n
        # The window holds (dp[j] + cut at j, j) for admissible predecessors j,
        # increasing in value: both window ends only move right as i grows.
        cur = [_INF] * (n + 1)
        arg = [-1] * (n + 1)
        window: deque = deque()
        j_next = max(seg - 1, left[lo_i])
        for i in range(lo_i, hi_i + 1):
            while j_next < i:  # admit j = i-1 (non-empty last segment)
                v = dp[j_next]
                if v < _INF:
                    v += cut[j_next - 1]
                    # Strict '>' keeps the earliest j among equal values (deterministic).
                    while window and window[-1][0] > v:
                        window.pop()
                    window.append((v, j_next))
                j_next += 1
            li = left[i]
            while window and window[0][1] < li:
                window.popleft()
            if window:
                cur[i], arg[i] = window[0]
        dp = cur
        args.append(arg)

    if dp[n] == _INF:  # cannot happen: the bound is achievable by construction
        raise RuntimeError(f"contiguous_split found no split within bound {bound} (n={n}, k={k}).")
    bounds = [n]
    i = n
    for seg in range(k, 1, -1):
        i = args[seg][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return bounds


def segment_costs(costs: Sequence[float], boundaries: Sequence[int]) -> List[float]:
    """Cost of each segment of a split.

    Args:
        costs: cost of each unit.
        boundaries: ``[0, ..., len(costs)]``, non-decreasing.

    Returns:
        One sum per segment (``len(boundaries) - 1`` entries).

    Raises:
        ValueError: malformed boundaries.
    """
    b = _check_boundaries(boundaries, len(costs))
    s = _prefix([float(x) for x in costs])
    return [s[b[j + 1]] - s[b[j]] for j in range(len(b) - 1)]


def split_cut_cost(boundaries: Sequence[int], cut_costs: Sequence[float]) -> float:
    """Total cut cost of a split: ``cut_costs[b - 1]`` for each distinct inner boundary b.

    Args:
        boundaries: ``[0, ..., n]``, non-decreasing; repeated entries (empty
            segments) count once, and 0 and n are no cut.
        cut_costs: ``max(n - 1, 0)`` boundary costs.

    Returns:
        The summed cost.

    Raises:
        ValueError: malformed boundaries or a `cut_costs` of the wrong length.
    """
    b = _check_boundaries(boundaries)
    n = b[-1]
    if len(cut_costs) != max(n - 1, 0):
        raise ValueError(
            f"cut_costs must have {max(n - 1, 0)} entries for n = {n}. Received: {len(cut_costs)} entries"
        )
    return float(sum(float(cut_costs[x - 1]) for x in sorted(set(b)) if 0 < x < n))


def brute_force_contiguous(
    costs: Sequence[float],
    cut_costs: Sequence[float],
    k: int,
    tolerance: float = 0.0,
    limit_costs: Optional[Sequence[float]] = None,
    limit: Optional[float] = None,
) -> Tuple[float, float]:
    """Exhaustive reference for `min_bottleneck` / `contiguous_split` (tests, small n only).

    Enumerates every split into k non-empty segments (or the forced split
    when ``n < k``) and sums segments directly rather than through prefix sums.

    Args:
        costs: unit costs.
        cut_costs: boundary costs (``max(n - 1, 0)`` entries).
        k: number of segments (>= 1).
        tolerance: allowed relative excess over the optimal bottleneck.
        limit_costs, limit: as `contiguous_split`; splits with a segment over
            the limit are left out.

    Returns:
        ``(optimal bottleneck, minimal cut cost among splits within
        (1 + tolerance) * bottleneck)``.

    Raises:
        ValueError: as `contiguous_split`.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    n = len(c)
    cut = _check_cut_costs(cut_costs, n)
    tol = _check_tolerance(tolerance)
    v, lim = _check_limit(limit_costs, limit, n)
    if n <= k:
        splits = [list(range(n + 1)) + [n] * (k - n)]
    else:
        splits = [[0, *inner, n] for inner in itertools.combinations(range(1, n), k - 1)]
    if v is not None:
        slack = lim + _eps(sum(v))
        splits = [b for b in splits if all(sum(v[b[j]:b[j + 1]]) <= slack for j in range(k))]
        if not splits:
            raise ValueError(f"limit={limit!r} cannot be met with {k} contiguous segments; raise it.")
    scored = []
    for b in splits:
        peak = max(sum(c[b[j]:b[j + 1]]) for j in range(k))
        scored.append((peak, sum(cut[x - 1] for x in set(b) if 0 < x < n)))
    best = min(p for p, _ in scored)
    bound = (1.0 + tol) * best + _eps(sum(c))
    return best, min(q for p, q in scored if p <= bound)


# --------------------------------------------------------------------------- stage-weighted contiguous


def _stage_reach(w: List[float], a: int, room: float) -> int:
    """Furthest end b with ``w[b] <= w[a] + room``: the longest segment from `a`
    whose weighted cost fits in `room` (``a - 1`` when even an empty one does not).

    Every admissibility test of `stage_weighted_split` goes through this one
    float comparison, so the feasibility search and the tie-break DP agree on
    which segments fit, rounding included.
    """
    return bisect_right(w, w[a] + room, a) - 1


def _stage_weighted_feasible(
    ws: List[List[float]],
    fixed: List[float],
    unit_order: List[List[int]],
    unit_keys: List[List[float]],
    bound: float,
    eps: float,
    keep: Optional[List[Tuple[List[Tuple[int, int]], List[int], float]]] = None,
) -> bool:
    """Can the units be split into ``k = len(ws)`` non-empty contiguous
    segments, segment p costing at most `bound` on stage p?

    With stage-dependent weights and non-empty segments the greedy "longest
    segment first" is not optimal: a stage may need to stop early so that the
    next stage starts on a unit it can hold at all. So the set ``E_p`` of ends
    reachable after stages 0..p is propagated exactly, as a sorted list of
    disjoint integer intervals. A start ``a`` is usable by stage p unless unit
    ``a`` alone does not fit there (those units, the only ones that break the
    intervals, are found by a binary search over the units pre-sorted by their
    weight on that stage); a run ``[u, v]`` of usable starts inside ``E_{p-1}``
    reaches exactly ``[u + 1, reach_p(v)]`` because reach_p is non-decreasing.
    A probe costs ``O(k log n)`` plus the work on the intervals and on the
    units too heavy for a stage, which stay few near the optimum.

    With `keep` (a list), appends ``(E_{p-1}, heavy units, room)`` for each
    stage p, for `_stage_weighted_witness`.
    """
    k = len(ws)
    n = len(ws[0]) - 1
    cur: List[Tuple[int, int]] = [(0, 0)]
    for p in range(k):
        w = ws[p]
        room = bound - fixed[p] + eps
        if room < 0.0:
            return False
        cap = n - (k - 1 - p)  # leave one unit for each later stage
        # Units that do not fit stage p even alone, in index order. The key
        # test is loose by a rounding margin; the exact test is the same float
        # comparison `_stage_reach` makes.
        keys = unit_keys[p]
        first = bisect_right(keys, room - 1e-14 * (w[n] + room))
        heavy = sorted(a for a in unit_order[p][first:] if w[a + 1] > w[a] + room)
        n_heavy = len(heavy)
        if keep is not None:
            keep.append((cur, heavy, room))
        nxt: List[Tuple[int, int]] = []
        for s, t in cur:
            i = bisect_left(heavy, s)
            u = s
            while u <= t:
                if i < n_heavy and heavy[i] <= t:
                    v, u_next = heavy[i] - 1, heavy[i] + 1
                    i += 1
                else:
                    v, u_next = t, t + 1
                if u <= v:
                    r = min(_stage_reach(w, v, room), cap)
                    if r > u:
                        if nxt and u <= nxt[-1][1]:  # touches the last interval
                            nxt[-1] = (nxt[-1][0], max(nxt[-1][1], r))
                        else:
                            nxt.append((u + 1, r))
                u = u_next
        if not nxt:
            return False
        cur = nxt
    return cur[-1][1] == n


def _stage_weighted_witness(
    ws: List[List[float]], keep: List[Tuple[List[Tuple[int, int]], List[int], float]]
) -> List[int]:
    """A split that a successful `_stage_weighted_feasible` probe (run with
    `keep`) proved to exist, rebuilt backwards from the reachable sets.

    For a reachable end e of stage p, the largest usable start ``a < e`` in
    ``E_{p-1}`` reaches furthest (reach_p is non-decreasing), so it reaches e
    whenever any start does.
    """
    k = len(ws)
    n = len(ws[0]) - 1
    bounds = [n]
    e = n
    for p in range(k - 1, -1, -1):
        prev, heavy, room = keep[p]
        skip = set(heavy)
        start = -1
        for s, t in reversed(prev):
            a = min(t, e - 1)
            while a >= s and a in skip:
                a -= 1
            if a >= s:
                start = a
                break
        if start < 0 or _stage_reach(ws[p], start, room) < e:  # cannot happen
            raise RuntimeError(f"stage_weighted_split: no start for stage {p} ending at {e}.")
        bounds.append(start)
        e = start
    bounds.reverse()
    return bounds


def stage_weighted_split(
    static_costs: Sequence[float],
    activation_costs: Sequence[float],
    multipliers: Sequence[float],
    cut_costs: Optional[Sequence[float]] = None,
    fixed_costs: Optional[Sequence[float]] = None,
    tolerance: float = 0.0,
) -> List[int]:
    """Contiguous split into pipeline stages whose cost depends on the stage.

    Giving units ``[a, b)`` to stage p costs ``fixed_costs[p] +
    sum(static_costs[a:b]) + multipliers[p] * sum(activation_costs[a:b])``.
    This models a stage's memory: variables and optimizer state, plus the
    activations kept for the backward pass times the number of micro-batches
    the schedule keeps alive on that stage (``min(P - p, M)`` under 1F1B, so
    early stages weigh activations more), plus a per-stage fixed term.

    With ``k = len(multipliers)`` and n units, the split minimises the largest
    stage cost ``B*`` (each segment non-empty when ``n >= k``); among the splits
    whose stages all cost at most ``(1 + tolerance) * B*`` it returns one with
    the smallest total cut cost, and among those the lexicographically
    smallest boundaries. With fewer units than stages, returns n singletons
    followed by empty segments, as `contiguous_split` does.

    ``B*`` is found by bisection on the bound (down to the rounding slack
    ``REL_EPS`` times the largest possible stage cost), each probe an exact
    feasibility test over interval sets (see `_stage_weighted_feasible`); the
    tie-break is a DP over suffixes whose admissible next boundaries form a
    sliding window: a monotone deque plus one binary search per start,
    ``O(k n log n)``.

    Args:
        static_costs: non-negative per-unit cost paid once (e.g. variable and
            optimizer bytes), n entries in order.
        activation_costs: non-negative per-unit cost scaled by the stage's
            multiplier (e.g. activation bytes per micro-batch); n entries.
        multipliers: non-negative factor of each stage, in pipeline order;
            its length is the number of stages k (>= 1).
        cut_costs: ``cut_costs[i]`` is paid when a boundary falls between unit
            i and unit i + 1; exactly ``max(n - 1, 0)`` entries. Defaults to
            zeros.
        fixed_costs: non-negative cost each stage pays whatever it holds; k
            entries. Defaults to zeros.
        tolerance: allowed relative excess over the optimal bottleneck that
            the cut-cost tie-break may use.

    Returns:
        Boundaries ``[0, b1, ..., n]`` (k + 1 non-decreasing entries); stage p
        holds units ``b_p .. b_{p+1} - 1``.

    Raises:
        ValueError: no multipliers, a list of the wrong length, a negative /
            NaN / infinite cost, multiplier or fixed cost, or a negative / NaN
            `tolerance`.
    """
    c = _check_costs(static_costs, "static_costs")
    n = len(c)
    if len(activation_costs) != n:
        raise ValueError(
            f"activation_costs must have len(static_costs) = {n} entries. "
            f"Received: {len(activation_costs)} entries"
        )
    act = _check_costs(activation_costs, "activation_costs")
    if len(multipliers) < 1:
        raise ValueError(f"multipliers must have at least 1 entry (one per stage). Received: {list(multipliers)!r}")
    mult = _check_costs(multipliers, "multipliers")
    k = len(mult)
    if cut_costs is None:
        cut = [0.0] * max(n - 1, 0)
    else:
        if len(cut_costs) != max(n - 1, 0):
            raise ValueError(
                f"cut_costs must have len(static_costs) - 1 = {max(n - 1, 0)} entries. "
                f"Received: {len(cut_costs)} entries"
            )
        cut = _check_costs(cut_costs, "cut_costs")
    if fixed_costs is None:
        fixed = [0.0] * k
    else:
        if len(fixed_costs) != k:
            raise ValueError(
                f"fixed_costs must have len(multipliers) = {k} entries. Received: {len(fixed_costs)} entries"
            )
        fixed = _check_costs(fixed_costs, "fixed_costs")
    tol = _check_tolerance(tolerance)
    if n <= k:  # no choice: every unit alone, the rest empty
        return list(range(n + 1)) + [n] * (k - n)
    if k == 1:
        return [0, n]

    # ws[p][i]: weighted prefix sum on stage p, so [a, b) costs
    # fixed[p] + ws[p][b] - ws[p][a]. Non-decreasing in i.
    s, sa = _prefix(c), _prefix(act)
    ws = [[si + m * ai for si, ai in zip(s, sa)] for m in mult]
    eps = _eps(max(f + w[n] for f, w in zip(fixed, ws)))
    unit_order: List[List[int]] = []
    unit_keys: List[List[float]] = []
    for w in ws:
        d = [w[i + 1] - w[i] for i in range(n)]
        order = sorted(range(n), key=d.__getitem__)
        unit_order.append(order)
        unit_keys.append([d[i] for i in order])

    def feasible(bound: float) -> bool:
        return _stage_weighted_feasible(ws, fixed, unit_order, unit_keys, bound, eps)

    # Bisection. Every stage pays its fixed cost, so B* >= max(fixed); any
    # split fits under the cost of the heaviest stage holding everything.
    lo = max(fixed)
    if feasible(lo):
        hi = lo
    else:
        hi = max(f + w[n] for f, w in zip(fixed, ws))
        if not feasible(hi):  # cannot happen: every split fits
            raise RuntimeError(f"stage_weighted_split: bound {hi} should be feasible (n={n}, k={k}).")
        # Invariant: lo infeasible, hi feasible.
        for _ in range(200):
            if hi - lo <= eps:
                break
            mid = 0.5 * (lo + hi)
            if feasible(mid):
                hi = mid
            else:
                lo = mid
    # Snap to the peak of a split that fits `hi`: an actual stage cost, so the
    # optimum itself up to the rounding slack (hi may be up to eps below it,
    # which (1 + tol) would magnify). The eps in every room keeps that split
    # admissible at tol = 0.
    keep: List[Tuple[List[Tuple[int, int]], List[int], float]] = []
    _stage_weighted_feasible(ws, fixed, unit_order, unit_keys, hi, eps, keep)
    witness = _stage_weighted_witness(ws, keep)
    peak = max(fixed[p] + ws[p][witness[p + 1]] - ws[p][witness[p]] for p in range(k))
    bound = (1.0 + tol) * peak

    # Tie-break DP over suffixes. best[a]: min cut cost of covering units
    # [a, n) with stages p..k-1 (a cut at a is paid by the stage before);
    # nexts[p][a]: the smallest end of stage p's segment achieving it, so a
    # forward walk yields the lexicographically smallest optimal boundaries.
    nexts: List[List[int]] = [[]] * k
    # Last stage: must end at n.
    w = ws[k - 1]
    room = bound - fixed[k - 1] + eps
    best = [_INF] * (n + 1)
    for a in range(k - 1, n):
        if _stage_reach(w, a, room) >= n:
            best[a] = 0.0
    nexts[k - 1] = [n] * (n + 1)
    for p in range(k - 2, -1, -1):
        w = ws[p]
        room = bound - fixed[p] + eps
        cap = n - (k - 1 - p)  # ends leave one unit per later stage
        cur = [_INF] * (n + 1)
        arg = [-1] * (n + 1)
        # Window of candidate ends b (value best[b] + cut at b), added in
        # decreasing b; values increase from front to back, and a newer entry
        # evicts older ones that are not smaller, so the front is the minimum
        # with the smallest b among ties.
        window: deque = deque()
        for a in range(cap - 1, p - 1, -1):
            b = a + 1
            v = best[b]
            if v < _INF:
                v += cut[b - 1]
                while window and window[-1][0] >= v:
                    window.pop()
                window.append((v, b))
            r = _stage_reach(w, a, room)  # may exceed cap; the window only holds b <= cap
            while window and window[0][1] > r:
                window.popleft()
            if window:
                cur[a], arg[a] = window[0]
        best = cur
        nexts[p] = arg

    if best[0] == _INF:  # cannot happen: the bound is feasible by construction
        raise RuntimeError(f"stage_weighted_split found no split within bound {bound} (n={n}, k={k}).")
    bounds = [0]
    a = 0
    for p in range(k):
        a = nexts[p][a]
        bounds.append(a)
    return bounds


# --------------------------------------------------------------------------- baselines


def equal_count_split(n: int, k: int) -> List[int]:
    """Baseline: boundaries giving each segment the same number of units (+-1).

    The first ``n % k`` segments get one extra unit; with ``n < k`` that is n
    singletons followed by empty segments. Costs are ignored.

    Args:
        n: number of units (>= 0).
        k: number of segments (>= 1).

    Returns:
        Boundaries ``[0, ..., n]``.

    Raises:
        ValueError: `n` < 0 or `k` < 1.
    """
    k = _check_k(k)
    if not hasattr(n, "__index__") or operator.index(n) < 0:
        raise ValueError(f"n must be an integer >= 0. Received: {n!r}")
    q, r = divmod(operator.index(n), k)
    return [j * q + min(j, r) for j in range(k + 1)]


def equal_cost_greedy_split(costs: Sequence[float], k: int) -> List[int]:
    """Baseline: fill each segment, in order, until its cost reaches ``total / k``.

    Each segment takes at least one unit and leaves at least one unit per
    remaining segment (when ``n >= k``); the last segment takes the rest. This
    is the naive split the exact `contiguous_split` is measured against: it
    ignores cut costs and can overshoot badly on heavy units.

    Args:
        costs: non-negative unit costs.
        k: number of segments (>= 1).

    Returns:
        Boundaries ``[0, ..., n]``.

    Raises:
        ValueError: `k` < 1 or an invalid cost.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    n = len(c)
    if n <= k:
        return list(range(n + 1)) + [n] * (k - n)
    target = sum(c) / k
    bounds = [0]
    pos = 0
    for seg in range(k - 1):
        last_start = n - (k - 1 - seg)  # keep one unit for each later segment
        acc = c[pos]
        pos += 1
        while pos < last_start and acc < target:
            acc += c[pos]
            pos += 1
        bounds.append(pos)
    bounds.append(n)
    return bounds


# --------------------------------------------------------------------------- non-contiguous


def _check_fixed(fixed: Optional[Mapping[int, int]], n: int, k: int) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for u, p in (fixed or {}).items():
        if not hasattr(u, "__index__") or not 0 <= operator.index(u) < n:
            raise ValueError(f"fixed unit must be an integer in [0, {n}). Received: {u!r}")
        if not hasattr(p, "__index__") or not 0 <= operator.index(p) < k:
            raise ValueError(f"fixed part of unit {u} must be an integer in [0, {k}). Received: {p!r}")
        out[operator.index(u)] = operator.index(p)
    return out


def lpt_assignment(costs: Sequence[float], k: int, fixed: Optional[Mapping[int, int]] = None) -> List[int]:
    """LPT greedy: pinned units first, then largest unit first to the least loaded part.

    Ties on load go to the part with fewer units (so zero-cost units still
    fill empty parts), then to the lower index.

    Args:
        costs: non-negative unit costs.
        k: number of parts (>= 1).
        fixed: unit -> part pins.

    Returns:
        The part of each unit.

    Raises:
        ValueError: `k` < 1, an invalid cost or an out-of-range pin.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    return _lpt(c, k, _check_fixed(fixed, len(c), k))


def _lpt(c: List[float], k: int, fixed: Dict[int, int]) -> List[int]:
    n = len(c)
    parts = [-1] * n
    load = [0.0] * k
    count = [0] * k
    for u in sorted(fixed):
        p = fixed[u]
        parts[u] = p
        load[p] += c[u]
        count[p] += 1
    heap = [(load[p], count[p], p) for p in range(k)]
    heapq.heapify(heap)
    for u in sorted((u for u in range(n) if parts[u] < 0), key=lambda u: (-c[u], u)):
        ld, cnt, p = heapq.heappop(heap)
        parts[u] = p
        heapq.heappush(heap, (ld + c[u], cnt + 1, p))
    return parts


def _lpt_limited(c: List[float], v: List[float], limit: float, k: int, fixed: Dict[int, int]) -> List[int]:
    """LPT with a second, capped cost: each unit, largest first, goes to the
    least loaded part among those where its `v` still fits under `limit`.

    "Largest" weighs both costs: units are taken by the larger of their
    shares ``c / (total c / k)`` and ``v / limit``, so the units that are hard
    to fit under the limit are placed while there is room. When no part has
    room, the unit goes to the part with the least `v`.
    """
    n = len(c)
    parts = [-1] * n
    load = [0.0] * k
    vload = [0.0] * k
    count = [0] * k
    for u in sorted(fixed):
        p = fixed[u]
        parts[u] = p
        load[p] += c[u]
        vload[p] += v[u]
        count[p] += 1
    share = (sum(c) / k) or 1.0
    vlim = limit or 1.0
    slack = limit + _eps(sum(v))
    free = sorted((u for u in range(n) if parts[u] < 0), key=lambda u: (-max(c[u] / share, v[u] / vlim), u))
    for u in free:
        fits = [p for p in range(k) if vload[p] + v[u] <= slack]
        if fits:
            p = min(fits, key=lambda q: (load[q], count[q], q))
        else:
            p = min(range(k), key=lambda q: (vload[q], count[q], q))
        parts[u] = p
        load[p] += c[u]
        vload[p] += v[u]
        count[p] += 1
    return parts


def _check_edges(edges: Sequence[Tuple[int, int, float]], n: int) -> List[Tuple[int, int, float]]:
    out = []
    for e in edges:
        try:
            u, v, w = e
        except (TypeError, ValueError):
            raise ValueError(f"edges must be (u, v, weight) triples. Received: {e!r}") from None
        try:
            u, v, wf = operator.index(u), operator.index(v), float(w)
        except (TypeError, ValueError):
            raise ValueError(f"edges must be (int, int, number) triples. Received: {e!r}") from None
        if not (0 <= u < n and 0 <= v < n):
            raise ValueError(f"edge endpoints must be in [0, {n}). Received: {e!r}")
        if not (wf >= 0.0) or wf == _INF:
            raise ValueError(f"edge weight must be a finite number >= 0. Received: {e!r}")
        out.append((u, v, wf))
    return out


def assignment_cut(parts: Sequence[int], edges: Sequence[Tuple[int, int, float]]) -> float:
    """Total weight of the edges whose endpoints are in different parts.

    Args:
        parts: the part of each unit.
        edges: ``(u, v, weight)`` triples.

    Returns:
        The cut weight.

    Raises:
        ValueError: a malformed edge.
    """
    return float(sum(w for u, v, w in _check_edges(edges, len(parts)) if parts[u] != parts[v]))


def balanced_assignment(
    costs: Sequence[float],
    k: int,
    edges: Sequence[Tuple[int, int, float]] = (),
    tolerance: float = 0.05,
    fixed: Optional[Mapping[int, int]] = None,
    limit_costs: Optional[Sequence[float]] = None,
    limit: Optional[float] = None,
) -> List[int]:
    """Non-contiguous assignment: balanced loads, then fewer cut edges.

    Starts from `lpt_assignment`, then runs up to `REFINE_PASSES` sweeps over
    the units in index order. Each unpinned unit moves to the neighbouring part
    that lowers the cut weight the most; if the load cap blocks the move, it
    is swapped with a recently blocked unit that wanted the opposite move,
    when the pair together lowers the cut. Only positive-gain moves are
    taken, so the cut never grows (it is a local search, not an optimum), and
    no move may push a part above ``cap = max(LPT max load, (1 + tolerance) *
    max(total / k, largest unit cost))`` or empty a part.

    Args:
        costs: non-negative unit costs (n units).
        k: number of parts (>= 1).
        edges: ``(u, v, weight)`` communication costs paid when u and v are in
            different parts; duplicates add up, self-loops are ignored.
        tolerance: relative load slack the refinement may use.
        fixed: unit -> part pins; pinned units never move.
        limit_costs: optional second cost per unit (e.g. variable bytes)...
        limit: ...that each part should hold at most: the greedy start
            places every unit where it fits under the limit when one can
            (see `_lpt_limited`), and the refinement never pushes a part's
            total above ``max(limit, its total after the greedy start)``.
            Both or neither.

    Returns:
        The part of each unit. Every part is non-empty when ``n >= k``, unless
        the pins leave fewer free units than unpinned parts.

    Raises:
        ValueError: `k` < 1, an invalid cost, edge, pin, `tolerance` or
            limit.
    """
    k = _check_k(k)
    c = _check_costs(costs)
    n = len(c)
    tol = _check_tolerance(tolerance)
    pins = _check_fixed(fixed, n, k)
    es = _check_edges(edges, n)
    v, lim = _check_limit(limit_costs, limit, n)
    parts = _lpt(c, k, pins) if v is None else _lpt_limited(c, v, lim, k, pins)
    if k == 1 or not es:
        return parts

    vc = [0.0] * n if v is None else v
    load = [0.0] * k
    count = [0] * k
    vload = [0.0] * k
    for u, p in enumerate(parts):
        load[p] += c[u]
        count[p] += 1
        vload[p] += vc[u]
    vcap = max(max(vload), lim or 0.0) + _eps(sum(vc))
    total = sum(c)
    cap = max(max(load), (1.0 + tol) * max(total / k, max(c, default=0.0))) + _eps(total)

    nbrs: List[List[int]] = [[] for _ in range(n)]
    wts: List[List[float]] = [[] for _ in range(n)]
    wsum = 0.0
    for u, v, w in es:
        if u != v and w > 0.0:
            nbrs[u].append(v)
            wts[u].append(w)
            nbrs[v].append(u)
            wts[v].append(w)
            wsum += w
    # Gains below this are rounding noise; requiring more keeps the cut strictly falling.
    min_gain = REL_EPS * wsum

    def connections(u: int) -> Dict[int, float]:
        conn: Dict[int, float] = {}
        for v, w in zip(nbrs[u], wts[u]):
            q = parts[v]
            conn[q] = conn.get(q, 0.0) + w
        return conn

    for _ in range(REFINE_PASSES):
        moved = 0
        # (a, b) -> recent units of part a whose move to b was blocked.
        pending: Dict[Tuple[int, int], deque] = {}
        for u in range(n):
            if u in pins or not nbrs[u]:
                continue
            a = parts[u]
            conn = connections(u)
            inside = conn.get(a, 0.0)
            cu = c[u]
            best_q, best_gain = -1, min_gain
            blocked_q, blocked_gain = -1, min_gain
            for q, wq in conn.items():
                gain = wq - inside
                if q == a or gain <= min_gain:
                    continue
                if load[q] + cu <= cap and vload[q] + vc[u] <= vcap and count[a] > 1:
                    if gain > best_gain or (gain == best_gain and (load[q], q) < (load[best_q], best_q)):
                        best_q, best_gain = q, gain
                elif gain > blocked_gain or (gain == blocked_gain and q < blocked_q):
                    blocked_q, blocked_gain = q, gain
            if best_q >= 0:
                parts[u] = best_q
                load[a] -= cu
                load[best_q] += cu
                vload[a] -= vc[u]
                vload[best_q] += vc[u]
                count[a] -= 1
                count[best_q] += 1
                moved += 1
                continue
            if blocked_q < 0:
                continue
            # The cap (or a part that would become empty) blocks u: a -> b.
            # Pair it with an earlier unit v that was blocked going b -> a; a
            # swap keeps the part sizes and may fit under the cap.
            b = blocked_q
            partners = pending.get((b, a))
            swapped = False
            for idx, v in enumerate(partners or ()):
                cv = c[v]
                if parts[v] != b or load[b] - cv + cu > cap or load[a] - cu + cv > cap:
                    continue
                dv = vc[v] - vc[u]
                if vload[b] - dv > vcap or vload[a] + dv > vcap:
                    continue
                # v's gain is recomputed (parts changed since it was queued).
                # The edge u-v stays cut although both gains counted it as
                # becoming internal, hence -2 w_uv.
                to_a = to_b = w_uv = 0.0
                for x, w in zip(nbrs[v], wts[v]):
                    q = parts[x]
                    if x == u:
                        w_uv += w  # sums duplicate u-v edges
                    if q == a:
                        to_a += w
                    elif q == b:
                        to_b += w
                if blocked_gain + to_a - to_b - 2.0 * w_uv > min_gain:
                    parts[u], parts[v] = b, a
                    load[a] += cv - cu
                    load[b] += cu - cv
                    vload[a] += dv
                    vload[b] -= dv
                    del partners[idx]
                    moved += 1
                    swapped = True
                    break
            if not swapped:
                queue = pending.get((a, b))
                if queue is None:
                    queue = pending[(a, b)] = deque(maxlen=MAX_SWAP_CANDIDATES)
                queue.append(u)
        if not moved:
            break
    return parts
