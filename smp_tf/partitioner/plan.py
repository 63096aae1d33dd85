"""From an `OpGraph` to an op -> partition assignment, and the `PartitionPlan`.

The pipeline of `assign_partitions`:

1. colocation groups (`groups.py`); free ops are set aside;
2. the groups that hold forward ops become *units*, in the forward order
   (a topological order of their forward values, first forward op first
   among the ready ones; `_group_positions`);
3. each unit gets a cost: ``speed`` -> its share of the estimated flops plus
   a tenth of its share of the variables; ``memory`` -> bytes of its
   variables times (1 + optimizer slots) plus the forward activations its
   gradient ops keep alive, and no partition may hold more than
   `VARIABLE_BALANCE` times the even share of variable bytes (where the
   largest unit and, for contiguous splits, the order allow);
4. ``contiguous=True``: an exact split of the unit sequence into contiguous
   ranges (minimum bottleneck, then minimum bytes cut); otherwise a balanced
   non-contiguous assignment that keeps heavy edges inside partitions;
5. the remaining groups (gradient ops with no forward op, pass-through ops)
   follow their heaviest neighbour, and free ops go to the lowest partition
   among their consumers.

Everything here is plain Python over `OpGraph`.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from smp_tf.graph_view import OpGraph, strongly_connected
from smp_tf.memory import format_bytes
from smp_tf.partitioner import balance
from smp_tf.partitioner.groups import Groups, colocation_groups

__all__ = [
    "assign_partitions", "complete_assignment", "check_assignment", "PartitionPlan", "unit_costs", "stage_memory_costs",
]

#: Optimizer slot variables per trainable variable assumed by ``optimize="memory"``
#: (Adam keeps two).
DEFAULT_SLOTS = 2.0
#: Weight of the variable-count share next to the flop share for ``optimize="speed"``.
VARIABLE_COUNT_WEIGHT = 0.1
#: ``optimize="memory"``: no partition holds more than this times the ideal
#: variable bytes (total / partitions, or the largest colocation group's when
#: that is more), unless a contiguous split cannot do it; then the least a
#: contiguous split can do.
VARIABLE_BALANCE = 1.10

_PASS_THROUGH = frozenset(["Identity", "IdentityN", "Snapshot", "NoOp"])


def _group_positions(graph: OpGraph, groups: Groups) -> List[Optional[int]]:
    """Each group's place in the forward order (None for groups of gradient
    ops only and for lone pass-through ops).

    The forward order is a topological order of the groups by the forward
    values they read from each other, taking among the groups whose inputs
    are all placed the one whose first forward op comes first. A group can
    start before a group it reads later (a colocation rule joined an op to
    an earlier one: ``inputs + residual(x)`` joined to the op that made
    `inputs`); ordered by first forward op alone, the split could cut
    between the two and send the forward pass back. Groups that read each
    other's values (a strongly connected set: a router's softmax and the
    top-k it feeds and reads back) go together, in the order of their first
    forward ops, when every group they read outside the set is placed.
    """
    n = len(groups)
    first = _first_forward_ops(graph, groups)
    readers: List[set] = [set() for _ in range(n)]
    for t in graph.tensors:
        if graph.ops[t.producer].is_gradient:
            continue
        pg = groups.group_of[t.producer]
        if pg < 0:
            continue
        for c in t.consumers:
            cg = groups.group_of[c]
            if cg >= 0 and cg != pg and not graph.ops[c].is_gradient:
                readers[pg].add(cg)
    # Edges join groups with forward ops only; the others stay components
    # of their own, left out below.
    component = strongly_connected([sorted(r) for r in readers])
    nodes = [g for g in range(n) if first[g] is not None]
    members: Dict[int, List[int]] = {}
    for g in nodes:
        members.setdefault(component[g], []).append(g)
    waiting = {c: 0 for c in members}
    successors: Dict[int, set] = {c: set() for c in members}
    for g in nodes:
        for r in readers[g]:
            a, b = component[g], component[r]
            if a != b and b not in successors[a]:
                successors[a].add(b)
                waiting[b] += 1
    key = {c: min(first[g] for g in ms) for c, ms in members.items()}
    ready = [(key[c], c) for c in members if waiting[c] == 0]
    heapq.heapify(ready)
    order: List[int] = []
    while ready:
        _, c = heapq.heappop(ready)
        order.extend(sorted(members[c], key=lambda g: first[g]))
        for b in successors[c]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, (key[b], b))
    pos: List[Optional[int]] = [None] * n
    for rank, g in enumerate(order):
        if _is_unit(graph, groups, first, g):
            pos[g] = rank
    return pos


def _first_forward_ops(graph: OpGraph, groups: Groups) -> List[Optional[int]]:
    """The first forward op of each group (None for groups of gradient ops only)."""
    first: List[Optional[int]] = [None] * len(groups)
    for g, ms in enumerate(groups.members):
        for i in ms:
            if not graph.ops[i].is_gradient:
                first[g] = i
                break
    return first


def _is_unit(graph: OpGraph, groups: Groups, first: Sequence[Optional[int]], g: int) -> bool:
    """Whether group `g` is a unit of the split: it holds a forward op and is
    not a lone pass-through op (the step's output identities follow their
    neighbours)."""
    ms = groups.members[g]
    return first[g] is not None and not (len(ms) == 1 and graph.ops[ms[0]].type in _PASS_THROUGH)


def _group_variables(graph: OpGraph, groups: Groups) -> List[List[str]]:
    """The variables of each group, each variable in the first group that reads it."""
    out: List[List[str]] = [[] for _ in range(len(groups))]
    seen = set()
    for g, ms in enumerate(groups.members):
        for i in ms:
            for v in graph.ops[i].variables:
                if v not in seen:
                    seen.add(v)
                    out[g].append(v)
    return out


def unit_costs(graph: OpGraph, groups: Groups, optimize: str, slots: float = DEFAULT_SLOTS) -> List[float]:
    """Cost of each group under the `optimize` objective (see the module doc)."""
    n = len(groups)
    if optimize == "speed":
        flops = [sum(graph.ops[i].flops for i in ms) for ms in groups.members]
        nvars = [len(vs) for vs in _group_variables(graph, groups)]
        tf_ = sum(flops) or 1.0
        tv = sum(nvars) or 1.0
        return [flops[g] / tf_ + VARIABLE_COUNT_WEIGHT * nvars[g] / tv for g in range(n)]
    if optimize == "memory":
        cost = [0.0] * n
        for g, vs in enumerate(_group_variables(graph, groups)):
            for v in vs:
                factor = 1.0 + (slots if graph.trainable.get(v, True) else 0.0)
                cost[g] += graph.variable_bytes.get(v, 0) * factor
        for g, ms in enumerate(groups.members):
            for i in ms:
                op = graph.ops[i]
                if not op.is_gradient:
                    # Activations kept for the backward: outputs read by gradient ops.
                    for t in op.outputs:
                        tensor = graph.tensors[t]
                        if any(graph.ops[c].is_gradient for c in tensor.consumers):
                            cost[g] += tensor.bytes
        return cost
    raise ValueError(f"optimize must be 'speed' or 'memory'. Received: optimize={optimize!r}")


def stage_memory_costs(
    graph: OpGraph, groups: Groups, slots: float = DEFAULT_SLOTS, recompute: str = "never"
) -> "tuple[List[float], List[float]]":
    """Per group: (static bytes, activation bytes kept per micro-batch).

    Static: its variables, their optimizer slots (`slots` per trainable
    byte) and the gradients summed over micro-batches (a running sum and
    one micro-batch's gradient). Kept: the bytes of its forward outputs
    that a gradient op reads, under `recompute` (`rewrite.recomputable_ops`:
    an output that would be recomputed is not kept; ``"full"`` keeps only
    the outputs of ops that may not run twice).
    """
    from smp_tf.memory import storage_bytes
    from smp_tf.rewrite import recomputable_ops

    again = recomputable_ops(graph, recompute)
    storage = storage_bytes(graph)
    static = [0.0] * len(groups)
    kept = [0.0] * len(groups)
    for g, vs in enumerate(_group_variables(graph, groups)):
        for v in vs:
            trainable = graph.trainable.get(v, True)
            static[g] += graph.variable_bytes.get(v, 0) * (1.0 + (slots + 2.0 if trainable else 0.0))
    for g, ms in enumerate(groups.members):
        for i in ms:
            op = graph.ops[i]
            if op.is_gradient or again[i]:
                continue
            for t in op.outputs:
                if any(graph.ops[c].is_gradient for c in graph.tensors[t].consumers):
                    kept[g] += storage[t]
    return static, kept


def unit_variable_bytes(graph: OpGraph, groups: Groups) -> List[float]:
    """Bytes of the variables of each group (each variable counted once, in
    the first group that reads it, as `unit_costs` does)."""
    return [float(sum(graph.variable_bytes.get(v, 0) for v in vs)) for vs in _group_variables(graph, groups)]


def variable_limit(var_bytes: Sequence[float], num_partitions: int, contiguous: bool) -> float:
    """The most variable bytes a partition may hold under ``optimize="memory"``.

    `VARIABLE_BALANCE` times the larger of the ideal share and the largest
    unit; for contiguous splits at least the smallest maximum a contiguous
    split achieves (contiguity may not allow less).
    """
    total = float(sum(var_bytes))
    limit = VARIABLE_BALANCE * max(total / num_partitions, max(var_bytes, default=0.0))
    if contiguous:
        limit = max(limit, balance.min_bottleneck(var_bytes, num_partitions))
    return limit


def _cut_costs(graph: OpGraph, groups: Groups, unit_of_group: Dict[int, int], n_units: int) -> List[float]:
    """Bytes crossing the boundary between unit i and i+1, for every i.

    A tensor whose producer and consumers span units [lo, hi] crosses every
    boundary in between once (difference array, linear time).
    """
    diff = [0.0] * (n_units + 1)
    for t in graph.tensors:
        if t.bytes == 0 or not t.consumers:
            continue
        gp = groups.group_of[t.producer]
        up = unit_of_group.get(gp) if gp >= 0 else None
        if up is None:
            continue
        lo = hi = up
        for c in t.consumers:
            uc = unit_of_group.get(groups.group_of[c])
            if uc is not None:
                lo = min(lo, uc)
                hi = max(hi, uc)
        if hi > lo:
            diff[lo] += t.bytes
            diff[hi] -= t.bytes
    cuts = []
    acc = 0.0
    for i in range(n_units - 1):
        acc += diff[i]
        cuts.append(acc)
    return cuts


def _unit_edges(graph: OpGraph, groups: Groups, unit_of_group: Dict[int, int]) -> List[tuple]:
    weights: Dict[tuple, float] = {}
    for t in graph.tensors:
        if t.bytes == 0:
            continue
        gp = groups.group_of[t.producer]
        up = unit_of_group.get(gp) if gp >= 0 else None
        if up is None:
            continue
        for uc in {unit_of_group.get(groups.group_of[c]) for c in t.consumers}:
            if uc is not None and uc != up:
                key = (up, uc) if up < uc else (uc, up)
                weights[key] = weights.get(key, 0.0) + t.bytes
    return [(a, b, w) for (a, b), w in weights.items()]


def _exchange_by_partition(graph: OpGraph, groups: Groups, g: int, part_of_group: List[Optional[int]]) -> Dict[int, float]:
    """Bytes group `g` exchanges with each partition (placed neighbours only)."""
    score: Dict[int, float] = {}
    for i in groups.members[g]:
        op = graph.ops[i]
        for t in op.inputs:
            pg = groups.group_of[graph.tensors[t].producer]
            if pg >= 0 and pg != g and part_of_group[pg] is not None:
                p = part_of_group[pg]
                score[p] = score.get(p, 0.0) + graph.tensors[t].bytes
        for t in op.outputs:
            parts = set()
            for c in graph.tensors[t].consumers:
                cg = groups.group_of[c]
                if cg >= 0 and cg != g and part_of_group[cg] is not None:
                    parts.add(part_of_group[cg])
            for p in parts:
                score[p] = score.get(p, 0.0) + graph.tensors[t].bytes
    return score


#: How far over the split's bound the forward-order repair of
#: `_adjust_split` may load a partition, as a fraction of the bound.
FORWARD_ORDER_SLACK = 0.02


def _adjust_split(
    graph: OpGraph,
    groups: Groups,
    unit_groups: List[int],
    costs: List[float],
    part_of_group: List[Optional[int]],
    num_partitions: int,
    bound: float,
) -> None:
    """Two adjustments of the contiguous split, on variable-free units.

    1. Cheap units move to the partition they talk to most. The exact
       split works on the forward order; a unit that reads a big tensor
       from a partition far away in that order (the loss after a tied
       output projection that lives with the embedding) is better placed
       there. A move is made only if it strictly lowers the bytes exchanged
       and keeps every partition within `bound`.
    2. A unit that reads forward values from a later partition moves to the
       latest such partition. The split cuts the units in the forward order
       (`_group_positions`), which every cut keeps unless groups read each
       other's values both ways; then a unit can read from a partition after
       its own, and the forward pass would go to the next partition and
       back: one more crossing and one more task per micro-batch. The
       partition may go `FORWARD_ORDER_SLACK` over `bound` (a round trip
       between partitions costs more than so small a piece of compute).

    Neither empties a partition (its device would idle in the pipeline)
    nor breaks the forward order (`_keeps_forward_order`).
    """
    light = max(bound, 1e-30) * 0.05

    def talks_to_most(u: int, g: int) -> Optional[int]:
        if costs[u] > light:
            return None
        score = _exchange_by_partition(graph, groups, g, part_of_group)
        if not score:
            return None
        p = max(sorted(score), key=lambda q: score[q])
        return p if score[p] > score.get(part_of_group[g], 0.0) else None

    def latest_read(u: int, g: int) -> Optional[int]:
        reads, _ = _placed_neighbours(graph, groups, g, part_of_group, gradient=False)
        later = max((r for r in reads if r is not None), default=part_of_group[g])
        return later if later > part_of_group[g] else None

    def move(limit: float, target: Callable[[int, int], Optional[int]]) -> None:
        # Each variable-free unit to target(unit, group) (None: it stays),
        # in up to two sweeps.
        load = [0.0] * num_partitions
        count = [0] * num_partitions
        for u, g in enumerate(unit_groups):
            load[part_of_group[g]] += costs[u]
            count[part_of_group[g]] += 1
        for _ in range(2):
            moved = False
            for u, g in enumerate(unit_groups):
                if any(graph.ops[i].variables for i in groups.members[g]):
                    continue
                here, to = part_of_group[g], target(u, g)
                if (to is not None and to != here and count[here] > 1 and load[to] + costs[u] <= limit
                        and _keeps_forward_order(graph, groups, g, part_of_group, to)):
                    load[here] -= costs[u]
                    load[to] += costs[u]
                    count[here] -= 1
                    count[to] += 1
                    part_of_group[g] = to
                    moved = True
            if not moved:
                break

    move(bound, talks_to_most)
    move(bound * (1 + FORWARD_ORDER_SLACK), latest_read)


def _placed_neighbours(
    graph: OpGraph, groups: Groups, g: int, part_of_group: List[Optional[int]], gradient: bool
) -> Tuple[List[Optional[int]], List[Optional[int]]]:
    """The partitions (None: not placed yet) of the other groups whose values
    the ops of group `g` read, and of those that read its values, counting
    only values of one pass: between forward ops (`gradient` False) or
    between gradient ops (True)."""
    reads: List[Optional[int]] = []
    sends: List[Optional[int]] = []
    for i in groups.members[g]:
        op = graph.ops[i]
        if op.is_gradient != gradient:
            continue
        for t in op.inputs:
            src = graph.tensors[t].producer
            pg = groups.group_of[src]
            if pg >= 0 and pg != g and graph.ops[src].is_gradient == gradient:
                reads.append(part_of_group[pg])
        for t in op.outputs:
            for c in graph.tensors[t].consumers:
                cg = groups.group_of[c]
                if cg >= 0 and cg != g and graph.ops[c].is_gradient == gradient:
                    sends.append(part_of_group[cg])
    return reads, sends


def _keeps_forward_order(graph: OpGraph, groups: Groups, g: int, part_of_group: List[Optional[int]], p: int) -> bool:
    """Whether group `g` on partition `p` reads forward values only from
    partitions up to `p` and sends them only to partitions from `p` on."""
    reads, sends = _placed_neighbours(graph, groups, g, part_of_group, gradient=False)
    return all((r or 0) <= p for r in reads) and all((s or 0) >= p for s in sends)


def _follow_neighbours(graph: OpGraph, groups: Groups, part_of_group: List[Optional[int]], default: int) -> None:
    """Assigns unplaced groups to the partition they exchange most bytes with."""
    pending = [g for g, p in enumerate(part_of_group) if p is None]
    for _ in range(2):  # second sweep picks up groups whose neighbours were pending
        still = []
        for g in pending:
            score: Dict[int, float] = {}
            for i in groups.members[g]:
                op = graph.ops[i]
                for t in op.inputs:
                    pg = groups.group_of[graph.tensors[t].producer]
                    if pg >= 0 and part_of_group[pg] is not None:
                        p = part_of_group[pg]
                        score[p] = score.get(p, 0.0) + graph.tensors[t].bytes + 1e-9
                for t in op.outputs:
                    # A tensor is sent once to each partition that reads it.
                    parts = set()
                    for c in graph.tensors[t].consumers:
                        cg = groups.group_of[c]
                        if cg >= 0 and part_of_group[cg] is not None:
                            parts.add(part_of_group[cg])
                    for p in parts:
                        score[p] = score.get(p, 0.0) + graph.tensors[t].bytes + 1e-9
            if score:
                window = _backward_window(graph, groups, g, part_of_group)
                candidates = sorted(score) if window is None else list(range(window[0], window[1] + 1))
                part_of_group[g] = max(candidates, key=lambda p: score.get(p, 0.0))
            else:
                still.append(g)
        pending = still
    for g in pending:
        part_of_group[g] = default


def _backward_window(
    graph: OpGraph, groups: Groups, g: int, part_of_group: List[Optional[int]]
) -> Optional[Tuple[int, int]]:
    """For a group of gradient ops only, the partitions on which it keeps the
    backward order, as ``(first, last)``; None when it is not such a group,
    when none of the gradients it reads is placed yet, or when no partition
    keeps the order (then the bytes alone decide).

    The backward runs from the last partition to the first: a gradient op
    should read gradients only from its own partition or later ones, and
    send them only to its own or earlier ones. A sum of gradient
    contributions whose terms come from partitions 0 and 1 and whose result
    is read on 0 (a tensor read on both sides of a boundary: a Transformer
    layer's input, read by its query projection on one partition and by its
    key and value projections on the next) belongs on 0. On 1, where most of
    its bytes come from, partition 0 would send its term forward, and each
    micro-batch's backward would go 1 -> 0 -> 1 -> 0: two more tasks, each
    waiting for the other partition.
    """
    if not all(graph.ops[i].is_gradient for i in groups.members[g]):
        return None
    reads, sends = _placed_neighbours(graph, groups, g, part_of_group, gradient=True)
    reads = [r for r in reads if r is not None]
    if not reads:
        return None
    first, last = max((s for s in sends if s is not None), default=0), min(reads)
    return (first, last) if first <= last else None


def _unequal(stage_speeds: Optional[Sequence[float]], num_partitions: int) -> bool:
    """Whether `stage_speeds` asks for a speed-aware split (checked)."""
    if stage_speeds is None:
        return False
    if len(stage_speeds) != num_partitions or any(not s > 0 for s in stage_speeds):
        raise ValueError(f"stage_speeds needs {num_partitions} positive speeds. Received: {list(stage_speeds)}")
    return max(stage_speeds) > min(stage_speeds) * (1 + 1e-9)


def assign_partitions(
    graph: OpGraph,
    num_partitions: int,
    *,
    optimize: str = "speed",
    contiguous: bool = True,
    auto_partition: bool = True,
    default_partition: int = 0,
    slots: float = DEFAULT_SLOTS,
    tolerance: float = 0.0,
    groups: Optional[Groups] = None,
    pinned: Optional[Mapping[str, int]] = None,
    stage_multipliers: Optional[Sequence[float]] = None,
    recompute: str = "never",
    stage_overheads: Optional[Sequence[float]] = None,
    bound_shifts: Optional[Sequence[int]] = None,
    stage_speeds: Optional[Sequence[float]] = None,
) -> List[int]:
    """Assigns every op of `graph` to a partition.

    Args:
        graph: the traced graph.
        num_partitions: number of partitions (>= 1).
        optimize: ``"speed"`` or ``"memory"`` (the unit cost, module doc).
        contiguous: each partition is one contiguous range of the forward order.
        auto_partition: False places ops where `smp.partition` put them and
            everything else on `default_partition`.
        default_partition: see `auto_partition`.
        slots: optimizer slots per trainable variable for ``memory``.
        tolerance: for contiguous splits, the bottleneck may exceed the optimum
            by this fraction if that lowers the bytes cut.
        groups: precomputed colocation groups.
        pinned: variable key -> partition for variables that already live on
            a partition (placed by an earlier step). With
            ``auto_partition=True`` their groups stay there and every other
            group follows the neighbours it exchanges most bytes with.
        stage_multipliers: with ``optimize="memory"`` and ``contiguous``,
            how many micro-batches' activations stage ``p`` keeps at once
            (`smp_tf.memory.stage_multipliers`): the split then balances each
            stage's predicted peak, static state plus its activations times
            its multiplier (`stage_memory_costs`), instead of capped
            variable bytes.
        recompute: the recompute mode the activations are counted under.
        stage_overheads: with `stage_multipliers`, bytes each stage needs
            whatever units it gets (its boundary buffers and the transient
            workspace of its largest task, as a previous prediction found
            them; `smp_tf.memory.refine_memory_split`).
        bound_shifts: with `stage_multipliers`, moves each interior
            boundary of the split by this many units (positive: later),
            each partition keeping at least one unit
            (`smp_tf.memory.refine_memory_split` settles the split on the
            predicted peaks this way).
        stage_speeds: with ``optimize="speed"`` and ``contiguous``, the
            speed of each stage's device (any unit; `smp.cluster()`): the
            split balances each stage's cost divided by its speed, its
            predicted time, instead of its cost.

    Returns:
        The partition of each op, indexed like ``graph.ops``.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1. Received: {num_partitions}")
    groups = colocation_groups(graph) if groups is None else groups
    part_of_group: List[Optional[int]] = [None] * len(groups)

    if num_partitions == 1:
        part_of_group = [0] * len(groups)
    elif pinned and auto_partition:
        for g, ms in enumerate(groups.members):
            for v in (v for i in ms for v in graph.ops[i].variables):
                if v in pinned:
                    if not 0 <= pinned[v] < num_partitions:
                        raise ValueError(
                            f"pinned partition {pinned[v]} of variable {v!r} is out of range "
                            f"[0, {num_partitions})."
                        )
                    part_of_group[g] = pinned[v]
                    break
        _follow_neighbours(graph, groups, part_of_group, default_partition)
    elif not auto_partition:
        # Forward ops outside every smp.partition block go to
        # default_partition; pass-through ops (the step's output identities)
        # and groups of gradient ops only follow their neighbours, so that
        # returning a gradient does not send it to another device.
        first = _first_forward_ops(graph, groups)
        for g in range(len(groups)):
            if g in groups.manual:
                part_of_group[g] = groups.manual[g]
            elif _is_unit(graph, groups, first, g):
                part_of_group[g] = default_partition
        _follow_neighbours(graph, groups, part_of_group, default_partition)
    else:
        pos = _group_positions(graph, groups)
        units = sorted((p, g) for g, p in enumerate(pos) if p is not None)
        unit_groups = [g for _, g in units]
        unit_of_group = {g: u for u, g in enumerate(unit_groups)}
        all_costs = unit_costs(graph, groups, optimize, slots)
        costs = [all_costs[g] for g in unit_groups]
        # Memory: activations count, but the variables (what stays resident
        # whatever the batch) are kept within VARIABLE_BALANCE of even.
        limit_kw = {}
        if optimize == "memory":
            var_bytes = unit_variable_bytes(graph, groups)
            unit_vb = [var_bytes[g] for g in unit_groups]
            limit_kw = {"limit_costs": unit_vb, "limit": variable_limit(unit_vb, num_partitions, contiguous)}
        if contiguous:
            cuts = _cut_costs(graph, groups, unit_of_group, len(unit_groups))
            if optimize == "memory" and stage_multipliers is not None:
                if len(stage_multipliers) != num_partitions:
                    raise ValueError(
                        f"stage_multipliers has {len(stage_multipliers)} entries for "
                        f"{num_partitions} partitions. Received: {list(stage_multipliers)}"
                    )
                static, kept = stage_memory_costs(graph, groups, slots, recompute)
                bounds = balance.stage_weighted_split(
                    [static[g] for g in unit_groups], [kept[g] for g in unit_groups],
                    list(stage_multipliers), cuts, tolerance=tolerance,
                    fixed_costs=None if stage_overheads is None else [float(x) for x in stage_overheads],
                )
                if bound_shifts is not None:
                    bounds = _shift_bounds(bounds, bound_shifts)
                costs = [static[g] + stage_multipliers[0] * kept[g] for g in unit_groups]
            elif optimize == "speed" and _unequal(stage_speeds, num_partitions):
                # Unequal devices: a stage's time is its cost over its
                # device's speed, the multiplier of the stage-weighted split.
                fastest = max(stage_speeds)
                bounds = balance.stage_weighted_split(
                    [0.0] * len(costs), costs, [fastest / s for s in stage_speeds], cuts, tolerance=tolerance)
            else:
                bounds = balance.contiguous_split(costs, cuts, num_partitions, tolerance=tolerance, **limit_kw)
            for p in range(num_partitions):
                for u in range(bounds[p], bounds[p + 1]):
                    part_of_group[unit_groups[u]] = p
            if not (optimize == "speed" and _unequal(stage_speeds, num_partitions)):
                # (Its bound is one cost for every partition: with unequal
                # devices the exact split above stands as it is.)
                bottleneck = max(balance.segment_costs(costs, bounds)) if costs else 0.0
                _adjust_split(graph, groups, unit_groups, costs, part_of_group, num_partitions,
                              bottleneck * (1 + tolerance))
        else:
            edges = _unit_edges(graph, groups, unit_of_group)
            parts = balance.balanced_assignment(
                costs, num_partitions, edges, tolerance=max(tolerance, 0.05), **limit_kw
            )
            for u, p in enumerate(parts):
                part_of_group[unit_groups[u]] = p
        _follow_neighbours(graph, groups, part_of_group, num_partitions - 1)

    assignment = complete_assignment(graph, groups, part_of_group, default_partition)
    check_assignment(graph, assignment, num_partitions)
    return assignment


def _shift_bounds(bounds: Sequence[int], shifts: Sequence[int]) -> List[int]:
    """`bounds` (``P + 1`` unit offsets) with interior bound ``p`` moved by
    ``shifts[p - 1]``, each segment keeping at least one unit."""
    if len(shifts) != len(bounds) - 2:
        raise ValueError(f"bound_shifts needs {len(bounds) - 2} entries (one per interior boundary). Received: "
                         f"{list(shifts)}")
    out = list(bounds)
    for p in range(1, len(out) - 1):
        out[p] = bounds[p] + int(shifts[p - 1])
    n = len(out) - 1
    # Keep segments non-empty where the original ones were.
    for p in range(1, n):
        lo = out[p - 1] + (1 if bounds[p] > bounds[p - 1] else 0)
        out[p] = max(out[p], lo)
    for p in range(n - 1, 0, -1):
        hi = out[p + 1] - (1 if bounds[p + 1] > bounds[p] else 0)
        out[p] = min(out[p], hi)
    return out


def complete_assignment(
    graph: OpGraph, groups: Groups, part_of_group: List[Optional[int]], default_partition: int = 0
) -> List[int]:
    """Op -> partition from group -> partition, placing what is left.

    Groups still unplaced follow the partition they exchange most bytes with;
    free ops go to the lowest partition among their consumers (or to
    `default_partition` when nothing consumes them).
    """
    if any(p is None for p in part_of_group):
        part_of_group = list(part_of_group)
        _follow_neighbours(graph, groups, part_of_group, default_partition)
    assignment = [-1] * len(graph.ops)
    for g, ms in enumerate(groups.members):
        for i in ms:
            assignment[i] = part_of_group[g]
    # Free ops go to the lowest partition among their consumers; reverse creation order
    # visits consumers before producers.
    for op in reversed(graph.ops):
        if assignment[op.index] != -1:
            continue
        p = None
        for c in graph.consumer_ops(op.index):
            if assignment[c] != -1:
                p = assignment[c] if p is None else min(p, assignment[c])
        assignment[op.index] = default_partition if p is None else p
    return assignment


def check_assignment(graph: OpGraph, assignment: Sequence[int], num_partitions: int) -> None:
    """Invariant: every op of the graph is in exactly one partition.

    Raises:
        RuntimeError: an op is missing or has a partition out of range.
    """
    if len(assignment) != len(graph.ops):
        raise RuntimeError(
            f"Partition invariant violated: {len(assignment)} assignments for {len(graph.ops)} ops."
        )
    bad = [graph.ops[i].name for i, p in enumerate(assignment) if not (isinstance(p, int) and 0 <= p < num_partitions)]
    if bad:
        raise RuntimeError(
            f"Partition invariant violated: {len(bad)} ops have no partition in "
            f"[0, {num_partitions}), e.g. {bad[:5]}. Please report this with the model."
        )


class PartitionPlan:
    """The result of partitioning one traced step.

    Attributes:
        num_partitions: number of partitions.
        graph: the traced `tf.Graph` (forward, loss and backward of one micro-batch);
            the constructor also takes a callable that builds it when first read.
        op_graph: the `OpGraph` view of `graph`.
        assignment: op name -> partition index, for every op of `graph`.
        devices: device of each partition (with ``virtual_stages`` v,
            each device is the device of v partitions).
        device_index: for each partition, the index of its device among
            the distinct devices, in order of first appearance (the device
            numbers of the schedule).
        seconds: time spent partitioning (graph view + groups + assignment).
        trace_seconds: time spent tracing the step (set by `smp.step`).
        view_seconds: the part of `seconds` spent building the graph view.
    """

    def __init__(
        self,
        graph: Any,
        op_graph: OpGraph,
        partition_of_op: Sequence[int],
        num_partitions: int,
        devices: Sequence[str] = (),
        seconds: float = 0.0,
    ) -> None:
        check_assignment(op_graph, partition_of_op, num_partitions)
        # The graph, or a callable that builds it when first read (importing
        # a large graph costs about as much as tracing it).
        self._graph = graph
        self.op_graph = op_graph
        self.partition_of_op: List[int] = list(partition_of_op)
        self.num_partitions = num_partitions
        self.devices = list(devices)
        distinct = list(dict.fromkeys(self.devices))
        self.device_index: List[int] = [distinct.index(d) for d in self.devices]
        self.seconds = seconds
        self.trace_seconds = 0.0
        self.view_seconds = 0.0
        # Tensor parallelism (`tensor_parallel_degree` > 1): the completed
        # specs (`smp_tf.sharding.completion.ShardPlan`) and the devices
        # each partition's ops are split over.
        self.shard_plan: Any = None
        self.tensor_devices: Optional[List[Sequence[str]]] = None
        # The device of each op within its partition's stage (index of
        # `op_graph.ops`); None without tensor parallelism.
        self.shard_of_op: Optional[List[int]] = None
        # The data-parallel replicas each optimizer slot is divided over
        # (``shard_optimizer_state``; 1: whole on every replica).
        self.data_shards: int = 1
        # With a declared cluster (config key "cluster"): the
        # `smp_tf.planner.resources.Device` of each stage.
        self.stage_resources: Optional[List[Any]] = None
        # ... and the `smp_tf.planner.resources.ResourceGraph` they are in.
        self.cluster: Any = None
        self.assignment: Dict[str, int] = {
            op.name: p for op, p in zip(op_graph.ops, self.partition_of_op)
        }

    @property
    def graph(self) -> Any:
        """The traced `tf.Graph` (forward, loss and backward of one micro-batch)."""
        if callable(self._graph):
            self._graph = self._graph()
        return self._graph

    def partition_of_variable(self) -> Dict[str, int]:
        """Variable key -> partition of the ops that use it."""
        out: Dict[str, int] = {}
        for op, p in zip(self.op_graph.ops, self.partition_of_op):
            for v in op.variables:
                out.setdefault(v, p)
        return out

    @property
    def cut_bytes(self) -> int:
        """Bytes sent between partitions per micro-batch (forward and backward).

        A tensor consumed on k other partitions counts k times; tensors of
        free ops (constants, step arguments) are not sent, they are fed or
        duplicated where needed.
        """
        from smp_tf.partitioner.groups import free_ops

        free = free_ops(self.op_graph)
        total = 0
        for t in self.op_graph.tensors:
            if free[t.producer] or t.bytes == 0:
                continue
            src = self.partition_of_op[t.producer]
            dst = {self.partition_of_op[c] for c in t.consumers} - {src}
            total += t.bytes * len(dst)
        return total

    def summary(self) -> List[Dict[str, Any]]:
        """One dict per partition: ``partition``, ``device``, ``ops``,
        ``variables``, ``variable_bytes``, ``flops``. With tensor
        parallelism, one per device of every partition's stage, with
        ``shard`` (the device's index in its stage) besides: a variable
        whose storage is split counts on every device of its stage with
        its share of the bytes, any other on device 0."""
        t = len(self.tensor_devices[0]) if self.tensor_devices and self.shard_of_op is not None else 1
        rows = [
            {"partition": p, "device": (self.tensor_devices[p][k] if t > 1 else
                                        self.devices[p] if p < len(self.devices) else None),
             "ops": 0, "variables": 0, "variable_bytes": 0, "flops": 0.0, **({"shard": k} if t > 1 else {})}
            for p in range(self.num_partitions) for k in range(t)
        ]
        for i, (op, p) in enumerate(zip(self.op_graph.ops, self.partition_of_op)):
            r = rows[p * t + (self.shard_of_op[i] if t > 1 else 0)]
            r["ops"] += 1
            r["flops"] += op.flops
        split = self.shard_plan.stored_split if self.shard_plan is not None and t > 1 else {}
        for v, p in self.partition_of_variable().items():
            nbytes = self.op_graph.variable_bytes.get(v, 0)
            for k in range(t) if v in split else (0,):
                rows[p * t + k]["variables"] += 1
                rows[p * t + k]["variable_bytes"] += nbytes // t if v in split else nbytes
        return rows

    def variable_storage(self) -> List[Dict[str, Any]]:
        """How each variable is stored, one dict per variable (in partition
        order): ``variable``, ``partition``, and for ``parameters``,
        ``gradients`` and ``optimizer`` (its slots) one of ``"whole"``,
        ``"tensor"`` (in pieces over the devices of its tensor-parallel
        stage), ``"data"`` (in pieces over the data-parallel replicas), with
        ``tensor`` (t) and ``data`` (R), the number of pieces."""
        t = len(self.tensor_devices[0]) if self.tensor_devices and self.shard_of_op is not None else 1
        split = self.shard_plan.stored_split if self.shard_plan is not None and t > 1 else {}
        rows = []
        for v, p in sorted(self.partition_of_variable().items(), key=lambda kv: (kv[1], kv[0])):
            trained = self.op_graph.trainable.get(v, True)
            kind = "tensor" if v in split else "whole"
            optimizer = kind if kind == "tensor" or self.data_shards == 1 else "data"
            rows.append({"variable": v, "partition": p, "parameters": kind,
                         "gradients": kind if trained else None, "optimizer": optimizer if trained else None,
                         "tensor": t, "data": self.data_shards})
        return rows

    def _storage_lines(self) -> List[str]:
        """`variable_storage` grouped by how the variables are stored."""
        groups: Dict[Tuple[Any, ...], List[str]] = {}
        for r in self.variable_storage():
            key = tuple(r[k] for k in ("parameters", "gradients", "optimizer"))
            groups.setdefault(key, []).append(r["variable"])
        if list(groups) == [("whole", "whole", "whole")]:
            return []
        t = len(self.tensor_devices[0]) if self.tensor_devices and self.shard_of_op is not None else 1
        label = {"whole": "whole", "tensor": f"pieces over tensor ({t})", "data": f"pieces over data ({self.data_shards})",
                 None: "-"}
        lines = ["storage of the variables (parameters / gradients / optimizer slots):"]
        for (params, grads, slots), names in groups.items():
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  {len(names):>4} variables: {label[params]} / {label[grads]} / {label[slots]}: {shown}")
        return lines

    def report(self) -> str:
        """A readable table of the partitions."""
        rows = self.summary()
        tot_f = sum(r["flops"] for r in rows) or 1.0
        tot_v = sum(r["variable_bytes"] for r in rows) or 1
        # Devices of other processes (`pipeline_processes`) carry their job
        # and task, longer than a local device's name.
        width = max([16] + [len(str(r["device"] or "-")) for r in rows])
        lines = [
            f"PartitionPlan: {self.num_partitions} partitions, {len(self.op_graph)} ops, "
            f"{format_bytes(self.cut_bytes)} cut per micro-batch, {self.seconds:.2f} s",
            f"{'part':>4}  {'device':<{width}} {'ops':>7} {'vars':>5} {'var bytes':>10} {'share':>6} {'GFLOP':>9} "
            f"{'share':>6}",
        ]
        for r in rows:
            part = f"{r['partition']}.{r['shard']}" if "shard" in r else str(r["partition"])
            lines.append(
                f"{part:>4}  {str(r['device'] or '-'):<{width}} {r['ops']:>7} {r['variables']:>5} "
                f"{format_bytes(r['variable_bytes']):>10} {100 * r['variable_bytes'] / tot_v:>5.1f}% "
                f"{r['flops'] / 1e9:>9.3f} {100 * r['flops'] / tot_f:>5.1f}%"
            )
        if self.stage_resources:
            lines.append("declared devices (cluster): speed on this graph's work, predicted compute and sends "
                         "per micro-batch")
            sends = self.stage_send_seconds()
            for p, (device, seconds) in enumerate(zip(self.stage_resources, self.stage_seconds())):
                speed = self.op_graph_speed(p)
                lines.append(f"{p:>4}  {device.name:<{width}} {speed / 1e9:>9.2f} GFLOP/s {seconds * 1e3:>10.3f} ms "
                             f"compute {sends[p] * 1e3:>9.3f} ms sends")
        lines.extend(self._storage_lines())
        if self.shard_plan is not None:
            lines.append(self.shard_plan.summary())
        return "\n".join(lines)

    def _stage_work(self, p: int) -> "tuple[Dict[str, float], int]":
        from smp_tf.planner.resources import graph_flops_by_class

        ops = [op for op, q in zip(self.op_graph.ops, self.partition_of_op) if q == p]
        return graph_flops_by_class([op.type for op in ops], [op.flops for op in ops]), len(ops)

    def stage_seconds(self) -> List[float]:
        """Predicted compute seconds of each stage per micro-batch (forward
        and backward) on its declared device: its ops' operations per cost
        class at the device's speeds, plus its per-op overhead. Empty
        without a declared cluster."""
        if not self.stage_resources:
            return []
        out = []
        for p, device in enumerate(self.stage_resources):
            work, ops = self._stage_work(p)
            out.append(device.seconds(work, ops))
        return out

    def stage_send_seconds(self) -> List[float]:
        """Predicted seconds each stage spends per micro-batch sending the
        tensors other stages read, over the declared links (each tensor
        once per reading stage). Empty without a declared cluster."""
        if not self.stage_resources or self.cluster is None:
            return []
        out = [0.0] * len(self.stage_resources)
        for t in self.op_graph.tensors:
            p = self.partition_of_op[t.producer]
            for q in {self.partition_of_op[c] for c in t.consumers} - {p}:
                link = self.cluster.link(self.stage_resources[p].name, self.stage_resources[q].name)
                out[p] += link.seconds(t.bytes)
        return out

    def op_graph_speed(self, p: int) -> float:
        """Stage `p`'s declared device's speed on the stage's own work
        (operations per second)."""
        work, _ = self._stage_work(p)
        seconds = self.stage_resources[p].seconds(work) if self.stage_resources else 0.0
        return sum(work.values()) / seconds if seconds > 0 else 0.0

    def __repr__(self) -> str:
        return self.report()
