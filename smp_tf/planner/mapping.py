"""Rank mapping: which device runs which stage of which replica.

A layout of ``R`` data-parallel replicas of a pipeline of ``P`` stages, each
stage split over ``t`` devices (tensor parallelism), needs ``R * P * t``
devices of a `ResourceGraph`. Which ones, and in which order, decides what
each transfer costs:

* a stage's ``t`` devices exchange partial sums every layer: they must share
  a host (a hard rule: a stage's devices belong to one process);
* consecutive stages of a replica exchange the boundary tensors of every
  micro-batch: the heaviest boundaries want the fastest links;
* the replicas of a stage all-reduce its gradients once per step: they can
  take the slowest links.

`MappingProblem.step_seconds` predicts a mapping's step time from the
graph's speeds and links:

    (M + P - 1) * max over (replica, stage) of [compute + send to next stage]
    + max over stages of the all-reduce of its gradients (a ring over its
      replicas' first devices: 2 (R-1)/R of the bytes over the ring's
      slowest link, plus 2 (R-1) latencies)

The first term is the pipeline (``M`` micro-batches through ``P`` stages,
the slowest stage setting the pace); a stage's compute is its work at its
slowest device's speed (its ``t`` devices work in step).

`brute_force` tries every assignment of stage groups to blocks of devices
(exact; small clusters only). `map_ranks` uses it up to a number of
assignments, and beyond that a heuristic: each replica's stages on
consecutive blocks, host by host (the fastest hosts and devices first), so
that a pipeline crosses hosts as rarely as the sizes allow; then, while
the predicted step time falls, the first move that lowers it (or keeps it
and lowers the sum of every group's time, to leave a plateau of the
maximum): two stage groups exchange their blocks, or one moves to an
unused block. Plain
Python.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from smp_tf.planner.resources import ResourceGraph

__all__ = ["MappingProblem", "Mapping", "brute_force", "map_ranks"]


#: Stage group ``(replica, stage)`` -> the names of its devices.
Layout = Dict[Tuple[int, int], Sequence[str]]
#: Every stage group's compute and send, and every stage's all-reduce
#: (`MappingProblem.state`).
State = Tuple[Dict[Tuple[int, int], float], Dict[int, float]]


@dataclass(frozen=True)
class MappingProblem:
    """What a mapping is judged on.

    Attributes:
        replicas: data-parallel replicas ``R``.
        stages: pipeline stages ``P``.
        tensor_degree: devices per stage ``t``.
        stage_flops: each stage's work per micro-batch, by cost class.
        boundary_bytes: bytes stage ``p`` sends to stage ``p + 1`` per
            micro-batch, forward and backward together (``P - 1`` entries).
        gradient_bytes: bytes of each stage's gradients, all-reduced over
            the replicas once per step.
        microbatches: micro-batches per step ``M``.
    """

    replicas: int
    stages: int
    tensor_degree: int
    stage_flops: Sequence[Dict[str, float]]
    boundary_bytes: Sequence[float]
    gradient_bytes: Sequence[float]
    microbatches: int = 1

    def __post_init__(self) -> None:
        for name in ("replicas", "stages", "tensor_degree", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1. Received: {getattr(self, name)}")
        if len(self.stage_flops) != self.stages or len(self.gradient_bytes) != self.stages:
            raise ValueError(f"stage_flops and gradient_bytes need {self.stages} entries (one per stage).")
        if len(self.boundary_bytes) != self.stages - 1:
            raise ValueError(f"boundary_bytes needs {self.stages - 1} entries (one per boundary).")

    @property
    def groups(self) -> List[Tuple[int, int]]:
        """The stage groups ``(replica, stage)``, replica by replica."""
        return [(r, p) for r in range(self.replicas) for p in range(self.stages)]

    def step_seconds(self, graph: ResourceGraph, mapping: "Mapping") -> float:
        """The predicted step time of `mapping` (module doc)."""
        return self.score(graph, mapping)[0]

    def score(self, graph: ResourceGraph, mapping: "Mapping") -> Tuple[float, float]:
        """(the predicted step time, the sum of every stage group's compute
        and send and every stage's all-reduce): the second breaks ties of
        the first, so that a search can leave a plateau of the maximum."""
        return self.state_score(self.state(graph, mapping.devices))

    def critical(self, graph: ResourceGraph, mapping: "Mapping") -> List[Tuple[int, int]]:
        """The stage groups on the critical path: the slowest (replica,
        stage) and its next stage, and the replicas of the stage whose
        all-reduce takes longest."""
        groups, rings = self.state(graph, mapping.devices)
        slowest = max(groups.values(), default=0.0)
        on_path = set()
        for (r, p), seconds in groups.items():
            if seconds >= slowest * (1 - 1e-9):
                on_path.update({(r, p), (r, min(p + 1, self.stages - 1))})
        reducing = {p: seconds for p, seconds in rings.items() if self.gradient_bytes[p] > 0}
        if reducing:
            worst = max(reducing, key=reducing.get)
            on_path.update((r, worst) for r in range(self.replicas))
        return sorted(on_path)

    def _seconds(self, graph: ResourceGraph, name: str, p: int) -> float:
        """Stage `p`'s compute on device `name`, remembered: a search scores
        many mappings of the same stages and devices."""
        memo = self.__dict__.setdefault("_memo", {})
        key = (id(graph), name, p)
        found = memo.get(key)
        if found is None:
            found = memo[key] = graph.device(name).seconds(self.stage_flops[p])
        return found

    def _group_seconds(self, graph: ResourceGraph, p: int, block: Tuple[str, ...], after: Optional[str]) -> float:
        """Stage `p`'s compute on `block` (a tuple of device names) plus its
        send to the next stage's first device `after`, remembered: a move
        changes two groups, so a search scores the others from memory."""
        memo = self.__dict__.setdefault("_group_memo", {})
        block = tuple(block)
        key = (id(graph), p, block, after)
        found = memo.get(key)
        if found is None:
            compute = max(self._seconds(graph, n, p) for n in block)
            send = graph.link(block[0], after).seconds(self.boundary_bytes[p]) if after is not None else 0.0
            found = memo[key] = compute + send
        return found

    def _ring_seconds(self, graph: ResourceGraph, p: int, ring: Tuple[str, ...]) -> float:
        """`ring_allreduce_seconds` of stage `p`'s gradients, remembered."""
        memo = self.__dict__.setdefault("_ring_memo", {})
        key = (id(graph), p, ring)
        found = memo.get(key)
        if found is None:
            found = memo[key] = ring_allreduce_seconds(graph, ring, self.gradient_bytes[p])
        return found

    def _group_of(self, graph: ResourceGraph, devices: Layout, r: int, p: int) -> float:
        """Stage group ``(r, p)``'s compute and send under `devices`."""
        after = devices[(r, p + 1)][0] if p + 1 < self.stages else None
        return self._group_seconds(graph, p, devices[(r, p)], after)

    def _ring_of(self, graph: ResourceGraph, devices: Layout, p: int) -> float:
        """Stage `p`'s all-reduce over its replicas under `devices`."""
        if self.replicas < 2 or self.gradient_bytes[p] <= 0:
            return 0.0
        return self._ring_seconds(graph, p, tuple(devices[(r, p)][0] for r in range(self.replicas)))

    def state(self, graph: ResourceGraph, devices: Layout) -> State:
        """Every stage group's seconds and every stage's all-reduce under
        `devices`: what `state_score` scores, and what a move changes only
        in part (`moved`)."""
        groups = {(r, p): self._group_of(graph, devices, r, p)
                  for r in range(self.replicas) for p in range(self.stages)}
        rings = {p: self._ring_of(graph, devices, p) for p in range(self.stages)} if self.replicas > 1 else {}
        return groups, rings

    def moved(self, graph: ResourceGraph, devices: Layout, state: State,
              changed: Sequence[Tuple[int, int]]) -> State:
        """`state` after the stage groups `changed` took new blocks in
        `devices`: their own seconds, their previous stages' sends, and
        their stages' all-reduces are computed again."""
        groups, rings = dict(state[0]), state[1]
        for r, p in changed:
            groups[(r, p)] = self._group_of(graph, devices, r, p)
            if p > 0:
                groups[(r, p - 1)] = self._group_of(graph, devices, r, p - 1)
        if rings:
            rings = dict(rings)
            for p in {p for _, p in changed}:
                rings[p] = self._ring_of(graph, devices, p)
        return groups, rings

    def state_score(self, state: State) -> Tuple[float, float]:
        """`score` from a `state`."""
        groups, rings = state
        slowest = max(groups.values(), default=0.0)
        reduce = max(rings.values(), default=0.0)
        return ((self.microbatches + self.stages - 1) * slowest + reduce,
                sum(groups.values()) + sum(rings.values()))


def ring_allreduce_seconds(graph: ResourceGraph, ring: Sequence[str], nbytes: float) -> float:
    """A ring all-reduce of `nbytes` over the devices `ring`: ``2 (R-1)/R``
    of the bytes over its slowest link, and ``2 (R-1)`` of its highest
    latency."""
    R = len(ring)
    if R < 2:
        return 0.0
    links = [graph.link(ring[i], ring[(i + 1) % R]) for i in range(R)]
    bandwidth = min(l.bandwidth for l in links)
    latency = max(l.latency for l in links)
    return 2 * (R - 1) / R * nbytes / bandwidth + 2 * (R - 1) * latency


@dataclass
class Mapping:
    """Devices of each stage group: ``devices[(replica, stage)]`` is the
    names of its ``t`` devices (the first is the stage's own)."""

    devices: Dict[Tuple[int, int], Tuple[str, ...]]
    step_seconds: float = math.inf
    tried: int = 0
    method: str = ""
    notes: List[str] = field(default_factory=list)

    def table(self) -> str:
        """One line per stage group."""
        lines = [f"rank mapping ({self.method}, {self.tried} tried): predicted step {self.step_seconds * 1e3:.3f} ms"]
        for (r, p), names in sorted(self.devices.items()):
            lines.append(f"  replica {r} stage {p}: {', '.join(names)}")
        return "\n".join(lines)


def _blocks(graph: ResourceGraph, t: int) -> List[Tuple[str, ...]]:
    """The host-aligned blocks of ``t`` consecutive devices (a stage's devices)."""
    out = []
    for host in graph.hosts:
        names = [d.name for d in graph.devices if d.host == host]
        out.extend(tuple(names[i:i + t]) for i in range(0, len(names) - t + 1, t))
    return out


def _check_fits(problem: MappingProblem, blocks: Sequence[Tuple[str, ...]], graph: ResourceGraph) -> None:
    need = problem.replicas * problem.stages
    if len(blocks) < need:
        raise ValueError(
            f"{problem.replicas} replica(s) x {problem.stages} stage(s) x tensor_parallel_degree "
            f"{problem.tensor_degree} need {need} groups of {problem.tensor_degree} device(s) of one host; "
            f"the cluster has {len(blocks)} ({len(graph.devices)} devices on {len(graph.hosts)} host(s))."
        )


def brute_force(problem: MappingProblem, graph: ResourceGraph, limit: int = 200_000) -> Mapping:
    """The best mapping, trying every assignment of stage groups to device
    blocks (exact).

    Raises:
        ValueError: the cluster cannot hold the layout, or more than `limit`
            assignments would be tried (use `map_ranks`).
    """
    blocks = _blocks(graph, problem.tensor_degree)
    _check_fits(problem, blocks, graph)
    groups = problem.groups
    count = math.perm(len(blocks), len(groups))
    if count > limit:
        raise ValueError(f"{count} assignments to try (more than {limit}): use map_ranks for this cluster.")
    best: Optional[Mapping] = None
    for chosen in itertools.permutations(blocks, len(groups)):
        m = Mapping(dict(zip(groups, chosen)))
        m.step_seconds = problem.step_seconds(graph, m)
        if best is None or m.step_seconds < best.step_seconds - 1e-15:
            best = m
    assert best is not None
    best.tried, best.method = count, "brute force"
    return best


def map_ranks(problem: MappingProblem, graph: ResourceGraph, exact_limit: int = 50_000,
              max_tries: int = 5_000) -> Mapping:
    """A good mapping: exact (`brute_force`) when at most `exact_limit`
    assignments exist, else the heuristic of the module doc, trying at most
    `max_tries` mappings from each of its starting orders."""
    blocks = _blocks(graph, problem.tensor_degree)
    _check_fits(problem, blocks, graph)
    if math.perm(len(blocks), len(problem.groups)) <= exact_limit:
        return brute_force(problem, graph, limit=exact_limit)
    return _heuristic(problem, graph, blocks, max_tries)


def _orders(problem: MappingProblem, hosts: int) -> List[List[Tuple[int, int]]]:
    """Orders in which stage groups take the blocks (host by host).

    Replica-major (each replica's pipeline on consecutive blocks: the
    boundaries stay within hosts), and, for S = 2 .. hosts segments, the
    pipeline cut at its S - 1 lightest boundaries with each segment's
    groups of all replicas together (the pipeline crosses hosts at light
    boundaries, and a stage's replicas share a host for their all-reduce).
    """
    P, R = problem.stages, problem.replicas
    orders = [[(r, p) for r in range(R) for p in range(P)]]
    for segments in range(2, min(P, hosts) + 1):
        cuts = sorted(sorted(range(P - 1), key=lambda i: problem.boundary_bytes[i])[:segments - 1])
        bounds = [0] + [c + 1 for c in cuts] + [P]
        orders.append([(r, p) for a, b in zip(bounds, bounds[1:]) for r in range(R) for p in range(a, b)])
    return orders


def _heuristic(problem: MappingProblem, graph: ResourceGraph, blocks: List[Tuple[str, ...]],
               max_tries: int = 5_000) -> Mapping:
    # Blocks host by host (the hosts with the most speed first, each host's
    # fastest blocks first), taken in each order of `_orders`; from each,
    # local moves (`_descend`); the best result.
    speed = {d.name: d.speed() for d in graph.devices}
    by_host: Dict[str, List[Tuple[str, ...]]] = {}
    for b in blocks:
        by_host.setdefault(graph.device(b[0]).host, []).append(b)
    ordered = [b for h in sorted(by_host, key=lambda h: -sum(speed[b[0]] for b in by_host[h]))
               for b in sorted(by_host[h], key=lambda b: -min(speed[n] for n in b))]
    best: Optional[Tuple[Tuple[float, float], Mapping]] = None
    tried = 0
    n = len(problem.groups)
    for order in _orders(problem, len(by_host)):
        m = Mapping(dict(zip(order, ordered[:n])))
        score, count = _descend(problem, graph, m, list(ordered[n:]), max_tries)
        tried += count
        if best is None or _better(score, best[0]):
            best = (score, m)
    assert best is not None
    score, m = best
    m.step_seconds, m.tried, m.method = score[0], tried, "heuristic"
    return m


def _descend(problem: MappingProblem, graph: ResourceGraph, m: Mapping,
             unused: List[Tuple[str, ...]], max_tries: int = 5_000) -> Tuple[Tuple[float, float], int]:
    """Applies the first improving move (`_better`) until none improves:
    two stage groups exchange their blocks, or one moves to an unused
    block. Changes `m` in place; returns its score and the mappings tried."""
    state = problem.state(graph, m.devices)
    score = problem.state_score(state)
    tried = 1
    improved = True
    # On a large layout only moves of the critical groups are tried (the
    # others cannot lower the maximum), within a bound on the mappings.
    small = len(m.devices) <= 16
    while improved and tried < max_tries:
        improved = False
        keys = list(m.devices)
        movers = keys if small else problem.critical(graph, m)
        moves = [("swap", a, b) for a, b in itertools.combinations(keys, 2)] if small else [
            ("swap", a, b) for a in movers for b in keys if b != a]
        moves += [("move", a, u) for a in movers for u in range(len(unused))]
        for kind, a, b in moves:
            trial = dict(m.devices)
            if kind == "swap":
                trial[a], trial[b] = trial[b], trial[a]
            else:
                trial[a] = unused[b]
            # Only the moved groups, their previous stages and their
            # stages' all-reduces change.
            trial_state = problem.moved(graph, trial, state, [a, b] if kind == "swap" else [a])
            trial_score = problem.state_score(trial_state)
            tried += 1
            if _better(trial_score, score):
                if kind == "move":
                    unused[b] = m.devices[a]
                m.devices, score, state = trial, trial_score, trial_state
                improved = True
                break
    return problem.score(graph, m), tried


def _better(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    """Whether score `a` is better than `b`: a lower step time, or the same
    (within rounding) and a lower total."""
    if a[0] < b[0] * (1 - 1e-12):
        return True
    return a[0] <= b[0] * (1 + 1e-12) and a[1] < b[1] * (1 - 1e-12)
