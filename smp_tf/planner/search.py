"""The planner's search: candidate configurations, each predicted on a cluster.

Plain Python over the traced step's `OpGraph` (no TensorFlow): the
TensorFlow side (`smp_tf.planner.plan`) traces the step once per
micro-batch size and hands the graphs here.

For every candidate (partitions ``P``, tensor-parallel degree ``t``,
data-parallel replicas ``R``, micro-batches ``M``, schedule, virtual stages
``v`` and recompute mode) `predict` does what `smp.init` and the first step
would do, without running anything:

1. **Devices.** Stage ``p`` of replica ``r`` gets ``t`` devices of one host
   (`smp_tf.planner.mapping.map_ranks`: exact on small clusters, a stated
   heuristic beyond).
2. **Split.** `assign_partitions` with ``optimize="speed"``, each stage
   weighted by its device's speed on the step's mix of work, on the graph
   of the candidate's micro-batch with that graph's colocation groups, as
   `smp.init` with the candidate's config splits it.
3. **Tasks.** `rewrite.build_tasks` with the candidate's recompute mode.
4. **Time.** Each task's seconds on its device: every op it runs (its
   members and what it recomputes) at the device's speed for the op's cost
   class (or for its type, `Device.op_speed`) plus the device's per-op
   overhead (products and convolutions
   also their operands' bytes at the device's streaming bandwidth); with
   ``t > 1`` the slowest of
   the stage's devices plus the bytes its devices exchange; plus the time
   its boundary inputs take over the link from their producer. The
   schedule is simulated on those seconds; CPU devices that share a host's
   cores (`ResourceGraph.cores`) slow down while more of them run than
   there are cores (`simulate_shared`). To the pipeline's span the step
   adds the optimizer update (element-wise work per trainable element) and,
   with ``R > 1``, each stage's gradient all-reduce as a ring over the
   replicas' links (after the pipeline, as smp_tf runs it), and the
   runtime's cost of a step (`ResourceGraph.runtime`; each action also
   pays its ``"action"`` cost).
5. **Memory.** `smp_tf.memory.predict_assignment` gives every device's
   predicted peak (with the gradients the step returns for every
   micro-batch, alive until `StepOutput.accumulate` sums them); a
   candidate fits when every device's peak is within its
   memory (the cluster's ``memory`` per device, lowered by
   ``memory_budget``, less a headroom: 20% by default, for the
   allocator's own rounding); the CPU devices of a host whose cores they share
   (logical devices of one process, one allocator) fit together within
   the host's memory (their shares together).

`search` enumerates candidates, predicts their times first (cheap), then
their memory in order of time until ``keep`` fitting rows are found. A
candidate's time is predicted only once the ranking reaches a lower bound
of it: ``M`` micro-batches of every op of the step (at the fastest
devices' speeds) shared by its ``P * t`` devices, and its update and
all-reduce at their least (`_lower_bound`; not on CPU devices that
share cores). A candidate whose bound is slower than
every row the ranking needs is never predicted; the rows are those that
predicting every candidate gives. A candidate that recomputes activations
is predicted only when the same candidate without recomputation does not
fit (recomputing only adds time). What it does not predict, and why, is
listed in ``skipped``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from smp_tf.graph_view import OpGraph
from smp_tf.planner.mapping import ring_allreduce_seconds
from smp_tf.planner.resources import ResourceGraph, cost_class, effective_speeds, graph_flops_by_class

__all__ = [
    "Candidate",
    "GraphInfo",
    "PlanRow",
    "Skipped",
    "SearchResult",
    "candidates",
    "interpolate_graph",
    "scale_sharded",
    "predict_memory",
    "predict_time",
    "search",
    "simulate_shared",
    "APPLY_FLOPS_PER_ELEMENT",
]

RECOMPUTE_MODES = ("never", "selective", "full")
#: Element-wise operations of the optimizer update per trainable element and
#: optimizer slot (a read, an update and a write of each), plus the
#: variable's own update.
APPLY_FLOPS_PER_ELEMENT = 4.0


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner predicts.

    Attributes:
        partitions: pipeline stages' devices ``P``.
        tensor_parallel_degree: devices per stage ``t``.
        replicas: data-parallel replicas ``R`` (one process each).
        microbatches: micro-batches per step and replica ``M``.
        pipeline: the schedule kind.
        virtual_stages: model chunks per device ``v``.
        recompute: the recompute mode.
        shard_optimizer_state: the optimizer state divided over the ``R``
            replicas (only with ``R > 1`` and ``t = 1``).
        sequence_parallel: the ops between the tensor-parallel regions on
            ``1/t`` of the sequence each (only with ``t > 1``).
    """

    partitions: int = 1
    tensor_parallel_degree: int = 1
    replicas: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    virtual_stages: int = 1
    recompute: str = "never"
    shard_optimizer_state: bool = False
    sequence_parallel: bool = False

    @property
    def devices(self) -> int:
        """Devices the candidate uses: ``P * t * R``."""
        return self.partitions * self.tensor_parallel_degree * self.replicas

    @property
    def stages(self) -> int:
        """Model chunks ``P * v``."""
        return self.partitions * self.virtual_stages

    def config(self) -> Dict[str, Any]:
        """The keys of this candidate for `smp.init` (replicas are processes,
        not a key: see `PlanRow.replicas`)."""
        out: Dict[str, Any] = {"partitions": self.partitions, "microbatches": self.microbatches,
                               "pipeline": self.pipeline, "recompute": self.recompute}
        if self.virtual_stages > 1:
            out["virtual_stages"] = self.virtual_stages
        if self.tensor_parallel_degree > 1:
            out["tensor_parallel_degree"] = self.tensor_parallel_degree
        if self.shard_optimizer_state:
            out["shard_optimizer_state"] = True
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        return out

    @property
    def slot_share(self) -> float:
        """The share of each optimizer slot a replica keeps: ``1 / R``
        under ``shard_optimizer_state``, else 1."""
        return 1.0 / self.replicas if self.shard_optimizer_state else 1.0

    def label(self) -> str:
        """``P2 t1 R1 M8 interleaved v1 never``: the table's columns in one word each."""
        return (f"P{self.partitions} t{self.tensor_parallel_degree} R{self.replicas} M{self.microbatches} "
                f"{self.pipeline} v{self.virtual_stages} {self.recompute}"
                + (" shard_optimizer_state" if self.shard_optimizer_state else "")
                + (" sequence_parallel" if self.sequence_parallel else ""))


@dataclass
class GraphInfo:
    """The traced step at one micro-batch size (and tensor-parallel degree).

    Attributes:
        graph: the op graph (sharded when ``t > 1``).
        outputs: the step's output tensor ids.
        shard_of_op: with ``t > 1``, each op's device within its stage.
        split_variables: with ``t > 1``, the variables stored in pieces.
        structure: a graph with the same ops at another size (the one it was
            extrapolated from), whose split and tasks stand for this one's;
            None: its own.
    """

    graph: OpGraph
    outputs: List[int]
    shard_of_op: Optional[List[int]] = None
    split_variables: Sequence[str] = ()
    structure: Optional[OpGraph] = None


@dataclass
class PlanRow:
    """One predicted candidate.

    Attributes:
        candidate: the `Candidate`.
        config: the dict to give `smp.init` (with the keys the caller fixed).
        step_time: predicted seconds per step.
        peak: predicted peak bytes of every device the candidate uses
            (device name -> bytes); empty when memory was not predicted.
        capacity: each of those devices' memory (bytes; 0: unknown).
        fits: every device's peak is within its capacity.
        devices: ``(replica, stage)`` -> that stage's device names.
        times: the parts of ``step_time``: ``pipeline`` (the schedule's
            span), ``update`` (the optimizer), ``allreduce`` (data
            parallelism), ``step`` (the runtime's cost of a step),
            ``dispatch`` (the runtime's cost per op run, ``ops_run`` times
            the cluster's ``runtime["dispatch"]``).
        ops_run: the ops one replica runs per step: each task's ops (on
            its slowest device) once per micro-batch.
        measured: seconds per step measured by `Plan.measure` (None until).
        task_seconds: ``(partition, wave)`` -> the predicted seconds of
            one action of that task (one micro-batch) on its device alone.
        task_elapsed: the same, as the simulation ran it: stretched while
            devices shared cores (the mean over micro-batches); what a
            profile of the run measures.
        task_parts: ``(partition, wave)`` -> (seconds of its operations,
            ops it runs, seconds of its transfers and dispatch), on its
            slowest device alone.
        partition_of_op: the split the prediction is for: op index (of
            the step's graph) -> stage, as `smp.init` with ``config``
            splits the step (`PartitionPlan.partition_of_op`).
        model_flops: the model's operations per step: its forward and
            backward ops as the graph view counts them (`smp_tf.graph_view`),
            for every micro-batch of every replica, without recomputation.
        samples_per_second: the batch over the predicted step time.
        tokens_per_second: ``samples_per_second`` times the sequence length
            when the inputs have one (None otherwise).
        mfu: predicted model-flops utilisation: ``model_flops`` per
            predicted step against the product speed (``flops["matmul"]``)
            of every device the row uses.
    """

    candidate: Candidate
    config: Dict[str, Any]
    step_time: float
    peak: Dict[str, int] = field(default_factory=dict)
    capacity: Dict[str, int] = field(default_factory=dict)
    fits: bool = True
    devices: Dict[Tuple[int, int], Tuple[str, ...]] = field(default_factory=dict)
    times: Dict[str, float] = field(default_factory=dict)
    measured: Optional[float] = None
    task_seconds: Dict[Tuple[int, int], float] = field(default_factory=dict)
    task_elapsed: Dict[Tuple[int, int], float] = field(default_factory=dict)
    task_parts: Dict[Tuple[int, int], Tuple[float, int, float]] = field(default_factory=dict)
    partition_of_op: Sequence[int] = ()
    ops_run: int = 0
    model_flops: float = 0.0
    samples_per_second: float = 0.0
    tokens_per_second: Optional[float] = None
    mfu: float = 0.0

    def set_throughput(self, batch: int, sequence: Optional[int], product_speed: float) -> None:
        """Fills ``samples_per_second``, ``tokens_per_second`` and ``mfu``
        for a batch of `batch` samples of `sequence` tokens (None: not a
        sequence) on devices of `product_speed` operations per second in
        all."""
        if self.step_time <= 0:
            return
        self.samples_per_second = batch / self.step_time
        self.tokens_per_second = self.samples_per_second * sequence if sequence else None
        self.mfu = self.model_flops / (self.step_time * product_speed) if product_speed > 0 else 0.0

    @property
    def replicas(self) -> int:
        """Data-parallel replicas: launch this many copies of the job."""
        return self.candidate.replicas

    @property
    def max_peak(self) -> int:
        """The largest device peak."""
        return max(self.peak.values(), default=0)


@dataclass(frozen=True)
class Skipped:
    """A candidate the search did not rank, and why.

    Attributes:
        candidate: the candidate.
        reason: why, in words.
        kind: the reason's class: ``"slower"`` (predicted slower than the
            ranked rows; its memory was not predicted), ``"bound"`` (a
            lower bound of its time is slower than the ranked rows: not
            predicted),
            ``"memory"``
            (cannot fit), ``"devices"``, ``"batch"``, ``"trace"`` or
            ``"invalid"`` (the graph or schedule cannot take it) or
            ``"recompute"`` (the same candidate fits without recomputing,
            which only adds time, or was not ranked).
    """

    candidate: Candidate
    reason: str
    kind: str = "invalid"


@dataclass
class SearchResult:
    """What `search` found: ``rows`` (memory predicted, best first),
    ``skipped`` and the time the search took."""

    rows: List[PlanRow]
    skipped: List[Skipped]
    seconds: float
    evaluated: int


# ---------------------------------------------------------------------------
# Candidates


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    num_devices: int,
    batch_size: int,
    *,
    partitions: Optional[Sequence[int]] = None,
    tensor_parallel_degrees: Sequence[int] = (1, 2, 4, 8),
    replicas: Optional[Sequence[int]] = None,
    microbatches: Optional[Sequence[int]] = None,
    pipelines: Sequence[str] = ("interleaved", "simple", "zero_bubble"),
    virtual_stages: Sequence[int] = (1, 2),
    recompute: Sequence[str] = RECOMPUTE_MODES,
    max_stages: Optional[int] = None,
    use_all: Optional[bool] = None,
) -> Tuple[List[Candidate], List[Skipped]]:
    """Every candidate on `num_devices` devices for a batch of `batch_size`.

    Each search dimension may be fixed by passing its values. By default
    ``P`` and ``R`` are the powers of two (and `num_devices` itself) up to
    `num_devices`, ``P * t * R <= num_devices``; ``M`` divides the replica's
    batch, is a power of two and at least ``P`` when ``P > 1`` (fewer
    micro-batches than stages leave stages idle); the schedule, virtual
    stages and recompute mode only vary when ``P > 1``; ``v > 1`` needs
    ``M`` a multiple of ``P``. With ``R > 1`` and ``t = 1`` every candidate
    comes again with ``shard_optimizer_state``, and with ``t > 1`` with
    ``sequence_parallel`` (`search` predicts them only where the candidate
    does not fit without). With `use_all` (the default on more than 8
    devices) only candidates that use every device (``P * t * R ==
    num_devices``); on up to 8, also those that leave some idle.

    Returns:
        (the candidates, the combinations left out and why).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1. Received: {num_devices}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1. Received: {batch_size}")
    powers = sorted({2 ** k for k in range(int(math.log2(num_devices)) + 1)} | {num_devices})
    ps = sorted(set(partitions)) if partitions is not None else powers
    rs = sorted(set(replicas)) if replicas is not None else powers
    out: List[Candidate] = []
    skipped: List[Skipped] = []
    use_all = num_devices > 8 if use_all is None else use_all
    for p, t, r in itertools.product(ps, sorted(set(tensor_parallel_degrees)), rs):
        if p * t * r > num_devices or (use_all and p * t * r != num_devices):
            continue
        if batch_size % r:
            skipped.append(Skipped(Candidate(p, t, r), f"batch {batch_size} is not a multiple of R={r}", "batch"))
            continue
        per_replica = batch_size // r
        if microbatches is not None:
            ms = [m for m in sorted(set(microbatches)) if per_replica % m == 0]
        else:
            ms = [m for m in _divisors(per_replica) if m & (m - 1) == 0 and (p == 1 or m >= p)]
            if p == 1:
                ms = ms[:1]  # without a pipeline, splitting the batch only adds steps
        for m in ms:
            for kind in (pipelines if p > 1 else pipelines[:1]):
                for v in (virtual_stages if p > 1 else (1,)):
                    if max_stages is not None and p * v > max_stages:
                        continue
                    if v > 1 and m % p:
                        continue
                    # One partition runs each micro-batch's forward and backward as one
                    # task: there is nothing to recompute.
                    for rc in (recompute if p > 1 else list(recompute)[:1]):
                        out.append(Candidate(p, t, r, m, kind, v, rc))
                        if r > 1 and t == 1:
                            out.append(Candidate(p, t, r, m, kind, v, rc, shard_optimizer_state=True))
                        if t > 1:
                            out.append(Candidate(p, t, r, m, kind, v, rc, sequence_parallel=True))
    return out, skipped


# ---------------------------------------------------------------------------
# Graphs at other micro-batch sizes


def _between(a: Any, b: Any, w: float) -> Any:
    """`a` + (`b` - `a`) * `w` for ints and nested tuples of ints; None where
    the result is not a whole number or the structures differ."""
    if a is None or b is None:
        return a if a == b else _MISMATCH
    if isinstance(a, (tuple, list)):
        if not isinstance(b, (tuple, list)) or len(a) != len(b):
            return _MISMATCH
        out = [_between(x, y, w) for x, y in zip(a, b)]
        return _MISMATCH if any(o is _MISMATCH for o in out) else type(a)(out)
    if isinstance(a, bool) or not isinstance(a, int) or not isinstance(b, int):
        return a if a == b else _MISMATCH
    v = a + (b - a) * w
    return int(round(v)) if abs(v - round(v)) < 1e-6 and v >= 0 else _MISMATCH


_MISMATCH = object()


def interpolate_graph(g1: OpGraph, b1: int, g2: OpGraph, b2: int, b: int) -> Optional[OpGraph]:
    """The step's graph at micro-batch size `b` from its graphs at `b1` and
    `b2`, or None where they differ in anything but sizes.

    A step's ops are the same at every batch size; what changes is linear
    in it: each tensor's batch-sized dimensions and bytes, each op's flops.
    So two traces give every other size without tracing again (the planner
    needs one graph per micro-batch size of its candidates). None (trace
    instead) when the graphs differ in structure (ops, types, tensors,
    ranks) or a size would not be a whole number.
    """
    if b1 == b2 or len(g1.ops) != len(g2.ops) or len(g1.tensors) != len(g2.tensors):
        return None
    if b == b1:
        return g1
    if b == b2:
        return g2
    w = (b - b1) / (b2 - b1)
    tensors: List[Any] = []
    for t1, t2 in zip(g1.tensors, g2.tensors):
        if t1.producer != t2.producer or t1.dtype != t2.dtype:
            return None
        shape = _between(t1.shape, t2.shape, w)
        nbytes = _between(t1.bytes, t2.bytes, w)
        if shape is _MISMATCH or nbytes is _MISMATCH:
            return None
        tensors.append(dataclasses.replace(t1, shape=shape, bytes=nbytes, consumers=list(t1.consumers)))
    ops: List[Any] = []
    for o1, o2 in zip(g1.ops, g2.ops):
        if o1.type != o2.type or o1.name != o2.name or o1.inputs != o2.inputs:
            return None
        static = _between(o1.static_value, o2.static_value, w)
        if static is _MISMATCH:
            return None
        ops.append(dataclasses.replace(o1, flops=max(o1.flops + (o2.flops - o1.flops) * w, 0.0), static_value=static))
    return OpGraph(ops, tensors, g1.variable_bytes, g1.trainable)


#: What the names of the nodes sharding adds carry after their op's name
#: (`smp_tf.sharding.read.MARK`; this module imports no TensorFlow).
_SHARD_MARK = "__smp"
#: A tensor of the sharded graph with no counterpart in the plain one (a
#: reshard's axis, a piece's shape) is kept as it is only up to this size.
_UNMATCHED_BYTES = 1024


def _plain_tensor(name: str, port: int, plain: OpGraph) -> Optional[int]:
    """The tensor of the unsharded graph that output `port` of sharded op
    `name` is (a piece of): the same output of the op it copies, or the
    tensor a reshard node was made for (``<op>_<port>[_again]__smp...``)."""
    origin = name.split(_SHARD_MARK, 1)[0]
    if origin in plain.op_index:
        outs = plain.ops[plain.op_index[origin]].outputs
        return outs[port] if port < len(outs) else None
    if origin.endswith("_again"):
        origin = origin[: -len("_again")]
    op, _, index = origin.rpartition("_")
    if op in plain.op_index and index.isdigit():
        outs = plain.ops[plain.op_index[op]].outputs
        return outs[int(index)] if int(index) < len(outs) else None
    return None


def _batch_sizes(origin: str, plain_at: OpGraph, plain: OpGraph) -> Optional[Dict[int, int]]:
    """The sizes of the dimensions that change with the batch among the
    tensors op `origin` reads and makes (size at `plain_at` -> size at
    `plain`), leaving out a size that some dimension keeps too (it could be
    either); None if `origin` is not an op of the graphs."""
    k = plain_at.op_index.get(origin)
    if k is None or plain.ops[k].name != origin:
        return None
    changes: Dict[int, set] = {}
    kept = set()
    op_at, op = plain_at.ops[k], plain.ops[k]
    for a, b in zip(op_at.inputs + op_at.outputs, op.inputs + op.outputs):
        s0, s1 = plain_at.tensors[a].shape, plain.tensors[b].shape
        if s0 is None or s1 is None or len(s0) != len(s1):
            continue
        for d0, d1 in zip(s0, s1):
            if d0 is None or d1 is None:
                continue
            if d0 == d1:
                kept.add(d0)
            else:
                changes.setdefault(d0, set()).add(d1)
    return {d0: next(iter(d1)) for d0, d1 in changes.items() if len(d1) == 1 and d0 not in kept}


def _scaled_shape(t: Any, sharded: OpGraph, plain_at: OpGraph, plain: OpGraph) -> Optional[Tuple[Any, ...]]:
    """Tensor `t` of `sharded`'s shape at the other size (`scale_sharded`)."""
    producer = sharded.ops[t.producer]
    ref = _plain_tensor(producer.name, t.index, plain_at)
    if ref is not None and t.shape is not None:
        before, after = plain_at.tensors[ref].shape, plain.tensors[ref].shape
        if before is not None and after is not None and len(before) == len(t.shape) == len(after):
            shape = []
            for d, b0, b1 in zip(t.shape, before, after):
                if b0 == b1 or d is None:
                    shape.append(d)
                elif b0 is None or b1 is None or (d * b1) % b0:
                    break
                else:
                    shape.append(d * b1 // b0)
            else:
                return tuple(shape)
    # A node a special lowering added inside one op (a vocabulary-parallel
    # cross-entropy's pieces): the sizes that op's tensors change.
    sizes = _batch_sizes(producer.name.split(_SHARD_MARK, 1)[0], plain_at, plain)
    if sizes is None or t.shape is None:
        return None
    return tuple(sizes.get(d, d) if d is not None else d for d in t.shape)


def scale_sharded(sharded: OpGraph, plain_at: OpGraph, plain: OpGraph) -> Optional[OpGraph]:
    """The sharded graph at another micro-batch size, from `sharded` (at
    the size of `plain_at`) and the unsharded graphs at both sizes
    (`plain_at`, `plain`), without sharding again; None where it cannot
    tell (sharding again is then needed).

    Every tensor of a sharded graph is a tensor of the unsharded one, or a
    piece of it along one dimension: the dimensions that change with the
    batch change by the same factor in the piece. A node that a special
    lowering adds inside one op takes the sizes that op's own tensors
    change. Each op's flops scale with those of the op it copies. None
    when the unsharded graphs differ in structure, a dimension would not
    be a whole number, or a tensor larger than `_UNMATCHED_BYTES` matches
    nothing.
    """
    if len(plain_at.ops) != len(plain.ops):
        return None
    tensors: List[Any] = []
    for t in sharded.tensors:
        shape = _scaled_shape(t, sharded, plain_at, plain)
        if shape is None:
            if t.bytes > _UNMATCHED_BYTES:
                return None
            tensors.append(dataclasses.replace(t, consumers=list(t.consumers)))
            continue
        elements = math.prod(x or 1 for x in t.shape)
        nbytes = t.bytes * math.prod(x or 1 for x in shape) // elements if elements else t.bytes
        tensors.append(dataclasses.replace(t, shape=tuple(shape), bytes=nbytes, consumers=list(t.consumers)))
    ops: List[Any] = []
    for op in sharded.ops:
        origin, _, tail = op.name.partition(_SHARD_MARK)
        flops = op.flops
        copy = not tail or (tail.startswith("_s") and tail[2:].isdigit())
        if flops:
            if copy and origin in plain_at.op_index and plain_at.ops[plain_at.op_index[origin]].flops:
                k = plain_at.op_index[origin]
                if plain.ops[k].name != origin:
                    return None
                flops = flops * plain.ops[k].flops / plain_at.ops[k].flops
            elif op.outputs and tensors[op.outputs[0]].bytes != sharded.tensors[op.outputs[0]].bytes:
                # A reshard's sum or split, a special lowering's node: as
                # its output's size.
                flops = flops * tensors[op.outputs[0]].bytes / sharded.tensors[op.outputs[0]].bytes
        ops.append(dataclasses.replace(op, flops=flops))
    return OpGraph(ops, tensors, sharded.variable_bytes, sharded.trainable)


# ---------------------------------------------------------------------------
# Time


def simulate_shared(
    order: Mapping[int, Sequence[Any]],
    deps: Mapping[Tuple[int, int], Sequence[Tuple[int, int]]],
    cost: Callable[[Any], float],
    host_of_device: Mapping[int, Optional[str]],
    cores: Mapping[str, float],
    elapsed: Optional[Dict[Any, float]] = None,
    cap: Optional[Callable[[Any], float]] = None,
) -> float:
    """The makespan of per-device orders when devices of a host share cores.

    Each device runs its actions in order; an action starts when its device
    is free and the same micro-batch's actions of the tasks it depends on
    have ended. The ``c`` cores of a host are shared by the actions running
    on its devices: each gets an equal share, but no more than its `cap`
    (how many cores it can use at once: its ops' parallelism), the cores it
    leaves going to the others (water-filling). An action with cost ``w``
    (core-seconds) on ``x`` cores takes ``w / x``. Devices whose host is
    not in `cores` (or is None) always run at rate 1: this is
    `Schedule.simulate` for them.

    Args:
        order: device -> its actions (each with ``.task`` = (partition,
            wave) and ``.microbatch``).
        deps: task -> the tasks it depends on.
        cost: action -> core-seconds (seconds on one core).
        host_of_device: device -> its host.
        cores: host -> cores shared by its devices.
        elapsed: if given, filled with action -> its seconds from start to
            end.
        cap: action -> the most cores it can use (default 1).
    """
    cap = cap or (lambda a: 1.0)
    position = {d: 0 for d in order}
    started: Dict[int, float] = {}
    done: set = set()
    remaining: Dict[int, float] = {}
    now = 0.0
    total = sum(len(a) for a in order.values())
    finished = 0
    while finished < total:
        # Start every action whose device is free and whose inputs are done.
        for d, acts in order.items():
            if d in remaining or position[d] >= len(acts):
                continue
            a = acts[position[d]]
            if all((dep, a.microbatch) in done for dep in deps.get(a.task, ())):
                remaining[d] = max(cost(a), 0.0)
                started[d] = now
        if not remaining:
            raise ValueError("the orders deadlock (an action waits for one that never runs)")
        rates: Dict[int, float] = {}
        by_host: Dict[str, List[int]] = {}
        for d in remaining:
            h = host_of_device.get(d)
            if h is None or h not in cores:
                rates[d] = 1.0
            else:
                by_host.setdefault(h, []).append(d)
        for h, ds in by_host.items():
            left, n = float(cores[h]), len(ds)
            for d in sorted(ds, key=lambda d: cap(order[d][position[d]])):
                rates[d] = min(max(cap(order[d][position[d]]), 1e-9), left / n)
                left -= rates[d]
                n -= 1
        step = min(remaining[d] / rates[d] for d in remaining)
        now += step
        for d in list(remaining):
            remaining[d] -= step * rates[d]
            if remaining[d] <= 1e-15:
                a = order[d][position[d]]
                done.add((a.task, a.microbatch))
                if elapsed is not None:
                    elapsed[a] = now - started[d]
                position[d] += 1
                finished += 1
                del remaining[d]
    return now


def _op_seconds(graph: OpGraph, device: Any) -> Callable[[int], float]:
    memo: Dict[int, float] = {}

    def seconds(i: int) -> float:
        s = memo.get(i)
        if s is None:
            op = graph.ops[i]
            s = 0.0
            if op.kind == "op":
                cls = cost_class(op.type)
                s = op.flops / device.op_speed(op.type) + device.overhead
                if device.bandwidth and cls != "elementwise":
                    # Products and convolutions also stream their operands: a
                    # product of few rows by a large weight reads the weight.
                    moved = sum(graph.tensors[t].bytes for t in list(op.inputs) + list(op.outputs))
                    s += moved / device.bandwidth
            memo[i] = s
        return s

    return seconds


class _Timer:
    """Seconds of each task of a candidate on its devices."""

    def __init__(self, info: GraphInfo, cluster: ResourceGraph, stage_devices: Sequence[Sequence[str]],
                 shared: Optional[Dict[str, Dict[Any, Any]]] = None):
        self.info = info
        self.cluster = cluster
        self.stage_devices = stage_devices
        # Op seconds per kind of device (its speeds, overhead and bandwidth),
        # and each task's compute on its stage's kinds of device (`_compute`),
        # shared by the timers of one graph: the candidates of a search run
        # on the same few kinds of devices.
        shared = {} if shared is None else shared
        self._seconds: Dict[Any, Callable[[int], float]] = shared.setdefault("op seconds", {})
        self._tasks: Dict[Any, Tuple[Any, ...]] = shared.setdefault("task compute", {})
        self._by_name: Dict[str, Callable[[int], float]] = {}
        self._kinds: Dict[str, Any] = {}
        #: task -> (seconds of its operations and streamed bytes, ops run,
        #: seconds of transfers and dispatch) on its slowest device: what
        #: `smp_tf.planner.learn` fits measured durations to.
        self.parts: Dict[Tuple[int, int], Tuple[float, int, float]] = {}
        #: task -> its ops' average parallelism (`_parallelism`).
        self.parallelism: Dict[Tuple[int, int], float] = {}

    def _key(self, name: str) -> Any:
        """The device's kind as the op seconds see it: speeds, overhead, bandwidth."""
        key = self._kinds.get(name)
        if key is None:
            device = self.cluster.device(name)
            key = self._kinds[name] = (tuple(sorted(device.flops.items())), device.overhead, device.bandwidth,
                                       tuple(sorted(device.ops.items())))
        return key

    def _on(self, name: str) -> Callable[[int], float]:
        f = self._by_name.get(name)
        if f is None:
            key = self._key(name)
            f = self._seconds.get(key)
            if f is None:
                f = self._seconds[key] = _op_seconds(self.info.graph, self.cluster.device(name))
            self._by_name[name] = f
        return f

    def _compute(self, task: Any, partition_of_op: Sequence[int], devices: Sequence[str]) -> Tuple[Any, ...]:
        """A task's ops on its stage's devices: seconds and op counts per
        device, the tensors that cross between them (bytes, from, to) and
        the ops' parallelism on the busiest. Depends on the devices' kinds
        only, so candidates that map a stage to other devices of the same
        kinds share it."""
        key = (id(task), tuple(self._key(d) for d in devices))
        found = self._tasks.get(key)
        if found is not None:
            return found
        graph = self.info.graph
        ops_of, tensors = graph.ops, graph.tensors
        shard = self.info.shard_of_op
        last = len(devices) - 1
        on = [self._on(d) for d in devices]
        ops = list(task.members) + list(task.recomputed)
        per_shard: Dict[int, float] = {}
        counts: Dict[int, int] = {}
        # A tensor crosses to another device of the stage once, however many
        # of that device's ops read it (one send and one receive per pair).
        crossed: Dict[Tuple[int, int], Tuple[int, int]] = {}
        split = shard is not None and last > 0
        for i in ops:
            k = min(shard[i], last) if shard is not None else 0
            per_shard[k] = per_shard.get(k, 0.0) + on[k](i)
            op = ops_of[i]
            counts[k] = counts.get(k, 0) + (op.kind == "op")
            if split:
                # Bytes a device of the stage reads from another of its devices.
                for tid in op.inputs:
                    j = tensors[tid].producer
                    kj = min(shard[j], last)
                    if kj != k and partition_of_op[j] == task.partition:
                        crossed.setdefault((tid, k), (kj, k))
        moves = [(tensors[tid].bytes, kj, k) for (tid, _), (kj, k) in crossed.items()]
        slowest = max(per_shard, key=per_shard.get, default=0)
        found = self._tasks[key] = (per_shard, counts, moves, slowest, self._parallelism(ops, devices, slowest))
        return found

    def task_seconds(self, task: Any, partition_of_op: Sequence[int]) -> float:
        graph = self.info.graph
        devices = self.stage_devices[task.partition]
        per_shard, counts, moves, slowest, parallelism = self._compute(task, partition_of_op, devices)
        links: Dict[Tuple[int, int], Any] = {}
        exchange = 0.0
        for nbytes, kj, k in moves:
            link = links.get((kj, k))
            if link is None:
                link = links[(kj, k)] = self.cluster.link(devices[kj], devices[k])
            exchange += link.seconds(nbytes)
        compute = max(per_shard.values(), default=0.0)
        receive = 0.0
        for tid in task.boundary_inputs():
            src = self.stage_devices[task.producer_of_input[tid][0]][0]
            receive += self.cluster.link(src, devices[0]).seconds(graph.tensors[tid].bytes)
        fixed = exchange + receive + self.cluster.runtime.get("action", 0.0)
        n = counts.get(slowest, 0)
        overhead = self.cluster.device(devices[slowest]).overhead
        self.parts[task.key] = (max(compute - n * overhead, 0.0), n, fixed)
        self.parallelism[task.key] = parallelism
        return compute + fixed

    def _parallelism(self, ops: Sequence[int], devices: Sequence[str], k: int) -> float:
        """How many of the task's ops can run at once on average on its
        device `k`: their seconds over the longest chain of them (a
        backward task's weight and input gradients run side by side)."""
        graph = self.info.graph
        shard = self.info.shard_of_op
        mine = [i for i in sorted(set(ops)) if shard is None or min(shard[i], len(devices) - 1) == k]
        inside = set(mine)
        seconds = self._on(devices[k])
        longest: Dict[int, float] = {}
        for i in mine:
            before = [longest[p] for t in graph.ops[i].inputs
                      for p in (graph.tensors[t].producer,) if p in inside and p in longest]
            longest[i] = seconds(i) + max(before, default=0.0)
        chain = max(longest.values(), default=0.0)
        return max(sum(seconds(i) for i in mine) / chain, 1.0) if chain > 0 else 1.0


# ---------------------------------------------------------------------------
# One candidate


#: Mappings of more candidates than this are found by the heuristic of
#: `map_ranks`, not by trying them all (the planner maps many candidates).
EXACT_MAPPING_LIMIT = 2000
#: Mappings the heuristic tries from each starting order, per candidate shape.
MAPPING_TRIES = 50


def _stage_groups(cluster: ResourceGraph, cand: Candidate, info: GraphInfo, partition_of_op: Optional[Sequence[int]],
                  cache: Optional[Dict[Any, Any]] = None):
    """``(replica, stage)`` -> device names: the devices in the cluster's
    order (host-aligned blocks of ``t``), then, on a cluster of several
    hosts or unequal devices, `map_ranks` on the split's stage work (kept
    in `cache` per split and shape of the candidate)."""
    if cache is not None and partition_of_op is not None:
        # One mapping per shape of candidate on a structure: the splits of its
        # stages balance their work, so their mappings are alike.
        key = ("mapping", cand.partitions, cand.virtual_stages, cand.tensor_parallel_degree, cand.replicas)
        if key not in cache:
            cache[key] = _stage_groups(cluster, cand, info, partition_of_op)
        return cache[key]
    from smp_tf.planner.mapping import Mapping as RankMapping, MappingProblem, _blocks, map_ranks

    blocks = _blocks(cluster, cand.tensor_parallel_degree)
    need = cand.replicas * cand.partitions
    if len(blocks) < need:
        raise ValueError(f"needs {need} groups of {cand.tensor_parallel_degree} device(s) on one host; "
                         f"the cluster has {len(blocks)}")
    default = {(r, p): blocks[r * cand.partitions + p] for r in range(cand.replicas) for p in range(cand.partitions)}
    if partition_of_op is None or (len(cluster.hosts) == 1 and _equal(cluster)):
        return default
    graph = info.graph
    flops: List[Dict[str, float]] = [dict() for _ in range(cand.partitions)]
    for op, c in zip(graph.ops, partition_of_op):
        cls = cost_class(op.type)
        f = flops[c % cand.partitions]
        f[cls] = f.get(cls, 0.0) + op.flops / cand.tensor_parallel_degree
    boundary = [0.0] * max(cand.partitions - 1, 0)
    for t in graph.tensors:
        a = partition_of_op[t.producer] % cand.partitions
        for c in t.consumers:
            b = partition_of_op[c] % cand.partitions
            if b == a + 1:
                boundary[a] += 2 * t.bytes  # forward and its gradient
                break
    grads = _gradient_bytes(info, partition_of_op, cand)
    problem = MappingProblem(cand.replicas, cand.partitions, cand.tensor_parallel_degree, flops, boundary,
                             grads, cand.microbatches)
    mapping = map_ranks(problem, cluster, exact_limit=EXACT_MAPPING_LIMIT, max_tries=MAPPING_TRIES)
    if problem.score(cluster, mapping) < problem.score(cluster, RankMapping(default)):
        return dict(mapping.devices)
    return default


def _equal(cluster: ResourceGraph) -> bool:
    first = cluster.devices[0]
    return all(dict(d.flops) == dict(first.flops) and d.overhead == first.overhead for d in cluster.devices)


def _gradient_bytes(info: GraphInfo, partition_of_op: Sequence[int], cand: Candidate) -> List[float]:
    """Each of the candidate's partitions' (chunks' modulo ``partitions``)
    gradient bytes (`smp_tf.memory.gradient_bytes_by_partition`)."""
    from smp_tf.memory import gradient_bytes_by_partition

    out = [0.0] * cand.partitions
    for p, nbytes in gradient_bytes_by_partition(info.graph, partition_of_op, info.outputs).items():
        out[p % cand.partitions] += nbytes
    return out


#: The share of each device's memory a plan leaves free by default: the
#: allocator needs room beside the bytes in use (TensorFlow's BFC allocator
#: rounds and splits its chunks). Measured on the CPU allocator: a step whose
#: in-use peak was 1248 MiB ran out of memory under a 1536 MiB limit.
HEADROOM = 0.2


def _capacity(cluster: ResourceGraph, name: str, memory_budget: Optional[int], headroom: float = 0.0) -> int:
    own = cluster.device(name).memory
    limits = [x for x in (own, memory_budget) if x]
    return int(min(limits) * (1 - headroom)) if limits else 0


def _split(mine: Dict[Any, Any], graph: OpGraph, cluster: ResourceGraph,
           groups: Mapping[Tuple[int, int], Tuple[str, ...]], cand: Candidate, slots: float) -> List[int]:
    """The split ``optimize="speed"`` makes of `graph` with the candidate's
    stages on `groups`' devices, kept in `mine` (the structure's cache; its
    ``"mix"`` weighs each device's speed).

    The runtime splits the graph of the micro-batch it runs, with that
    graph's colocation groups (which ops join a variable's group can depend
    on the bytes they exchange), and so does this. With
    ``optimize="speed"`` the split does not depend on the recompute mode.
    """
    from smp_tf.partitioner.groups import colocation_groups
    from smp_tf.partitioner.plan import assign_partitions

    P, S = cand.partitions, cand.stages
    devices = [cluster.device(groups[(0, c % P)][0]) for c in range(S)]
    speeds = effective_speeds(devices, mine["mix"])
    unequal = max(speeds) > min(speeds) * (1 + 1e-9)
    key = ("split", S, tuple(speeds) if unequal else None, id(graph))
    if key not in mine:
        if ("groups", id(graph)) not in mine:
            mine[("groups", id(graph))] = colocation_groups(graph)
        mine[key] = assign_partitions(graph, S, optimize="speed", slots=slots, groups=mine[("groups", id(graph))],
                                      stage_speeds=speeds if unequal else None)
    return mine[key]


def predict_time(info: GraphInfo, cand: Candidate, cluster: ResourceGraph, *, slots: float = 2.0,
                 fixed: Optional[Mapping[str, Any]] = None, cache: Optional[Dict[Any, Any]] = None
                 ) -> Tuple[PlanRow, Any]:
    """The predicted step time of one candidate (module doc, steps 1 to 4).

    `cache` (a dict kept across calls on the same graphs) keeps the
    colocation groups, splits, tasks, schedules and task seconds that
    candidates share.

    Returns:
        (the `PlanRow` without memory, the state `predict_memory` needs).

    Raises:
        ValueError: the candidate cannot be built on this graph or cluster
            (the message says why).
    """
    from smp_tf.rewrite import build_tasks, task_specs
    from smp_tf.schedules import schedule_builder

    graph = info.graph
    # Graphs of one structure (extrapolated from the same traces) share the
    # tasks and the schedules of a split, cut on the structure's own graph;
    # their sizes give each its own split (`_split`), seconds and peaks.
    shape = info.structure if info.structure is not None else graph
    P, S = cand.partitions, cand.stages
    cache = {} if cache is None else cache
    groups = _stage_groups(cluster, cand, info, None)
    if "mix" not in cache.setdefault(id(shape), {}):
        cache[id(shape)]["mix"] = graph_flops_by_class([op.type for op in shape.ops], [op.flops for op in shape.ops])
    mine = cache[id(shape)]

    assignment = _split(mine, graph, cluster, groups, cand, slots)
    mapped = _stage_groups(cluster, cand, info, assignment, mine)
    if mapped != groups:
        groups, assignment = mapped, _split(mine, graph, cluster, mapped, cand, slots)
    builder = schedule_builder(cand.pipeline)
    device_of = [c % P for c in range(S)] if cand.virtual_stages > 1 else None
    # Candidates with as many stages on other devices (P x v alike) often
    # come to the same split: one number per distinct split keys its tasks,
    # which do not depend on the devices the stages run on.
    akey = mine.setdefault(("assignment", tuple(assignment)), len(mine))
    built = ("tasks", akey, cand.recompute, builder.split_weight)
    if built not in mine:
        mine[built] = build_tasks(shape, assignment, sorted(set(info.outputs)), recompute=cand.recompute,
                                  split_weight=builder.split_weight, memo=mine.setdefault("cuts", {}))
    tkey = built + (P,)
    if tkey not in mine:
        mine[tkey] = (mine[built], task_specs(mine[built], device_of))
    tasks, specs = mine[tkey]
    skey = ("schedule", tkey, cand.microbatches, cand.pipeline)
    if skey not in mine:
        mine[skey] = _orders(builder, specs, cand.microbatches)
    order = mine[skey]
    stage_devices = [groups[(0, c % P)] for c in range(S)]
    ckey = ("seconds", tkey, tuple(stage_devices), id(graph))
    if ckey not in mine:
        timer = _Timer(info, cluster, stage_devices, shared=mine.setdefault(("timer caches", id(graph)), {}))
        mine[ckey] = ({t.key: timer.task_seconds(t, assignment) for t in tasks}, timer.parts, timer.parallelism)
    seconds, parts, parallel = mine[ckey]
    # Gradients are summed over the micro-batches as each task makes them.
    gkey = ("grads", akey, P, id(graph))
    if gkey not in mine:
        mine[gkey] = _gradient_bytes(info, assignment, cand)
    grads = mine[gkey]
    span, by_task = _span(order, specs, seconds, parallel, groups, cluster, cand)
    update = _update_seconds(grads, groups, cluster, cand, slots)
    allreduce = 0.0
    if cand.replicas > 1:
        allreduce = max(ring_allreduce_seconds(cluster, [groups[(r, p)][0] for r in range(cand.replicas)], grads[p])
                        for p in range(P))
    overhead = cluster.runtime.get("step", 0.0)
    # Ops the step runs (each task once per micro-batch, on its slowest
    # device): what the runtime's per-op dispatch cost, probed on the step
    # itself, adds to the wall time (`ResourceGraph.runtime`).
    ops_run = cand.microbatches * sum(p[1] for p in parts.values())
    dispatch = cluster.runtime.get("dispatch", 0.0) * ops_run
    row = PlanRow(
        candidate=cand, config={**dict(fixed or {}), **cand.config()},
        step_time=span + update + allreduce + overhead + dispatch,
        devices=dict(groups), times={"pipeline": span, "update": update, "allreduce": allreduce, "step": overhead,
                                     "dispatch": dispatch},
        ops_run=ops_run,
        # The model's own operations: every op of one micro-batch's graph
        # (whose ops are the stage devices' copies under tensor
        # parallelism, each its piece's share), for every micro-batch and
        # replica; recomputation is not the model's work.
        model_flops=float(sum(op.flops for op in graph.ops)) * cand.microbatches * cand.replicas,
    )
    row.task_seconds = seconds
    row.task_parts = parts
    row.partition_of_op = assignment
    # What each action takes as it runs, sharing cores: what a profile measures.
    row.task_elapsed = {k: (sum(by_task[k]) / len(by_task[k]) if k in by_task else v) for k, v in seconds.items()}
    return row, (assignment, groups, tasks)


def _orders(builder: Any, specs: Sequence[Any], microbatches: int) -> Dict[int, List[Any]]:
    """The builder's per-device orders, without `make_schedule`'s validation
    (a simulation each): the schedules' own tests validate them."""
    checked = tuple(sorted(specs, key=lambda t: t.key))
    built: Dict[int, List[Any]] = {
        d: [] for d in range(max((t.device if t.device is not None else t.partition) for t in checked) + 1)}
    built.update(builder.build(checked, microbatches))
    return built


def _span(order: Mapping[int, Sequence[Any]], specs: Sequence[Any], seconds: Mapping[Tuple[int, int], float],
          parallel: Mapping[Tuple[int, int], float], groups: Mapping[Tuple[int, int], Tuple[str, ...]],
          cluster: ResourceGraph, cand: Candidate) -> Tuple[float, Dict[Tuple[int, int], List[float]]]:
    """The pipeline's simulated span, and each task's actions' elapsed
    seconds where devices share cores (`simulate_shared`)."""
    from smp_tf.schedules.simulation import _run

    host_of = {d: cluster.device(groups[(0, d)][0]).host if cluster.device(groups[(0, d)][0]).kind == "CPU" else None
               for d in order}
    # CPU devices that share a host's cores: each action's work is spread over
    # its stage's t devices and its ops' parallelism, the cores shared by all.
    shared = {h: c for h, c in cluster.cores.items() if h in host_of.values()}
    deps = {s.key: s.deps for s in specs}
    t = cand.tensor_parallel_degree
    by_task: Dict[Tuple[int, int], List[float]] = {}
    if not shared:
        run = _run(order, deps, lambda a: seconds[a.task])
        if run.deadlocked:
            raise ValueError(f"the {cand.pipeline} schedule deadlocks on these tasks")
        return max(run.end.values(), default=0.0), by_task
    elapsed: Dict[Any, float] = {}
    # The share of the ops' parallelism the runtime realizes (a probe of the
    # step measures it; the longest chain is a bound no executor reaches).
    share = cluster.runtime.get("parallel", 1.0)
    span = simulate_shared(order, deps, lambda a: seconds[a.task] * t, host_of, shared, elapsed,
                           cap=lambda a: (1.0 + share * (parallel[a.task] - 1.0)) * t)
    for a, e in elapsed.items():
        by_task.setdefault(a.task, []).append(e)
    return span, by_task


def _update_seconds(grads: Sequence[float], groups: Mapping[Tuple[int, int], Tuple[str, ...]],
                    cluster: ResourceGraph, cand: Candidate, slots: float) -> float:
    """The optimizer update and the gradients' running sums: element-wise
    work per trainable element on each stage's devices (the slowest stage)."""
    update = 0.0
    t = cand.tensor_parallel_degree
    for p in range(cand.partitions):
        device = cluster.device(groups[(0, p)][0])
        elements = grads[p] / 4.0
        # Under shard_optimizer_state a replica updates 1/R of the elements.
        work = elements * (APPLY_FLOPS_PER_ELEMENT * (1 + slots)) / t * cand.slot_share
        accumulate = elements * max(cand.microbatches - 1, 0) / t
        update = max(update, (work + accumulate) / device.flops["elementwise"])
    return update


def predict_memory(row: PlanRow, state: Any, info: GraphInfo, cluster: ResourceGraph, *, slots: float = 2.0,
                   memory_budget: Optional[int] = None, headroom: float = HEADROOM,
                   outputs_held: bool = True) -> PlanRow:
    """Fills in `row`'s per-device peaks and whether it fits (module doc,
    step 5); `outputs_held` as for `smp_tf.memory.predict_assignment`."""
    from smp_tf.memory import predict_assignment

    assignment, groups, tasks = state
    cand = row.candidate
    P, S, t = cand.partitions, cand.stages, cand.tensor_parallel_degree
    cpu = cluster.device(groups[(0, 0)][0]).kind == "CPU"
    sharding: Dict[str, Any] = {}
    if t > 1 and info.shard_of_op is not None:
        sharding = dict(shard_of_op=info.shard_of_op, tensor_degree=t, split_variables=sorted(info.split_variables))
    report = predict_assignment(
        info.graph, assignment, [x for x in info.outputs if x is not None], num_partitions=S,
        num_microbatches=cand.microbatches, kind=cand.pipeline, recompute=cand.recompute,
        slots=slots * cand.slot_share, device_of_partition=[c % P for c in range(S)] if cand.virtual_stages > 1 else None,
        cpu_kernel_scratch=cpu, tasks=tasks, outputs_held=outputs_held, **sharding,
    )
    peak: Dict[str, int] = {}
    rows = report.devices if (t > 1 and report.devices) else report.partitions
    for r in rows:
        k = r.shard or 0
        for rep in range(cand.replicas):
            name = groups[(rep, r.partition % P)][min(k, len(groups[(rep, r.partition % P)]) - 1)]
            peak[name] = peak.get(name, 0) + int(r.total)
    row.peak = peak
    row.capacity = {n: _capacity(cluster, n, memory_budget, headroom) for n in peak}
    row.fits = all(not row.capacity[n] or peak[n] <= row.capacity[n] for n in peak)
    # The CPU devices of a host with shared cores are logical devices of one
    # process: one allocator holds them all, so together they are bounded by
    # the host's memory (its devices' shares together), not each by its share.
    for host in cluster.cores:
        mine = [n for n in peak if cluster.device(n).host == host and cluster.device(n).kind == "CPU"]
        if not mine:
            continue
        caps = [_capacity(cluster, d.name, memory_budget, headroom) for d in cluster.devices
                if d.host == host and d.kind == "CPU"]
        if all(caps):
            for n in mine:
                row.capacity[n] = sum(caps)
            fits_host = sum(peak[n] for n in mine) <= sum(caps)
            others = all(not row.capacity[n] or peak[n] <= row.capacity[n] for n in peak if n not in mine)
            row.fits = fits_host and others
    return row


def _static_floor(info: GraphInfo, cand: Candidate, slots: float) -> float:
    """Bytes every candidate must hold somewhere: the variables and their
    optimizer state, over the candidate's ``P * t`` devices (a lower bound
    of the fullest device's peak)."""
    graph = info.graph
    slots = slots * cand.slot_share
    total = sum(n * (1 + (slots if graph.trainable.get(k, True) else 0)) for k, n in graph.variable_bytes.items())
    return float(total) / (cand.partitions * cand.tensor_parallel_degree)


def _info_for(infos: Dict[Tuple[int, ...], Any], graph_for: Callable[..., Any], b: int, t: int,
              sequence_parallel: bool = False) -> Any:
    """The traced step at micro-batch `b` and degree `t` (`graph_for`, once
    per pair, kept in `infos`; with `sequence_parallel`, ``graph_for(b, t,
    True)``), or the error tracing it raised."""
    key = (b, t, True) if sequence_parallel else (b, t)
    if key not in infos:
        try:
            infos[key] = graph_for(*key)
        except (ValueError, RuntimeError, NotImplementedError) as e:
            infos[key] = e
    return infos[key]


def _split_variants(cands: Sequence[Candidate]) -> Tuple[List[Candidate], Dict[Candidate, List[Candidate]]]:
    """The candidates to predict first, and per candidate the variants that
    recompute or divide the optimizer state, predicted only where it does
    not fit (both only add time)."""
    variants: Dict[Candidate, List[Candidate]] = {}
    first: List[Candidate] = []
    given = set(cands)
    for c in cands:
        base = dataclasses.replace(c, recompute="never", shard_optimizer_state=False, sequence_parallel=False)
        if c != base and base in given:
            variants.setdefault(base, []).append(c)
        else:
            first.append(c)
    return first, variants


def _unranked(pending: Sequence[Tuple[float, int, Candidate]], heap: Sequence[Tuple[float, int, Any]],
              variants: Dict[Candidate, List[Candidate]], keep: int) -> List[Skipped]:
    """Why each candidate `search` did not rank was left out: never
    predicted (its bound), predicted but slower, or a variant of one of
    those."""
    skip: List[Skipped] = []
    not_ranked = "its variant without recomputation or sharding was not ranked"
    for bound, _, c in reversed(pending):
        skip.append(Skipped(c, f"a lower bound of its time (its ops shared by its devices at the fastest speeds, "
                               f"its update and all-reduce at their least), {bound * 1e3:.1f} ms, is slower than the "
                               f"{keep} fitting plans ranked (not predicted)", "bound"))
        skip.extend(Skipped(v, not_ranked, "recompute") for v in variants.pop(c, []))
    for _, _, (row, _, _) in sorted(heap, key=lambda x: x[0]):
        skip.append(Skipped(row.candidate, f"predicted {row.step_time * 1e3:.1f} ms, slower than the {keep} "
                                           "fitting plans ranked (memory not predicted)", "slower"))
        skip.extend(Skipped(v, not_ranked, "recompute") for v in variants.pop(row.candidate, []))
    for vs in variants.values():
        skip.extend(Skipped(v, "its variant without recomputation or sharding could not be predicted", "recompute")
                    for v in vs)
    return skip


class _BoundCache:
    """A lower bound of each candidate's predicted step time
    (`_lower_bound`), or 0 where the cluster's CPU devices share cores
    (a task may then use more than its device's share of them)."""

    def __init__(self, cluster: ResourceGraph, slots: float = 2.0) -> None:
        self.cluster = cluster
        self.slots = slots
        self.enabled = not cluster.cores
        self._per_graph: Dict[int, Tuple[float, float]] = {}
        # The links between two devices: the fastest and the quickest to start.
        links = list(cluster.links.values()) + list(cluster.pairs.values())
        self.bandwidth = max((l.bandwidth for l in links), default=math.inf)
        self.latency = min((l.latency for l in links), default=0.0)
        self.elementwise = max(d.flops["elementwise"] for d in cluster.devices) if cluster.devices else math.inf

    def __call__(self, cand: Candidate, infos: Dict[Tuple[int, int], Any], graph_for: Callable[[int, int], Any],
                 batch_size: int) -> float:
        if not self.enabled or cand.devices > len(self.cluster.devices):
            return 0.0
        info = _info_for(infos, graph_for, batch_size // (cand.replicas * cand.microbatches),
                         cand.tensor_parallel_degree, cand.sequence_parallel)
        if isinstance(info, Exception):
            return 0.0
        found = self._per_graph.get(id(info.graph))
        if found is None:
            from smp_tf.memory import gradient_bytes_by_partition

            grads = sum(gradient_bytes_by_partition(info.graph, [0] * len(info.graph.ops), info.outputs).values())
            found = self._per_graph[id(info.graph)] = (_fastest_ops_seconds(info.graph, info.outputs, self.cluster),
                                                      float(grads))
        seconds, grads = found
        return _lower_bound(seconds, grads, cand, self)


def _fastest_ops_seconds(graph: OpGraph, outputs: Sequence[int], cluster: ResourceGraph) -> float:
    """The seconds of one micro-batch's ops, each once, on the cluster's
    fastest kind of device (`_op_seconds`): the ops the tasks run
    themselves, not the free ones a task copies in (`duplicable_ops`)."""
    from smp_tf.rewrite import duplicable_ops

    dup = duplicable_ops(graph, [graph.tensors[x].producer for x in outputs])
    mine = [i for i in range(len(graph.ops)) if not dup[i]]
    best = math.inf
    seen = set()
    for device in cluster.devices:
        kind = (tuple(sorted(device.flops.items())), device.overhead, device.bandwidth, tuple(sorted(device.ops.items())))
        if kind in seen:
            continue
        seen.add(kind)
        on = _op_seconds(graph, device)
        best = min(best, sum(on(i) for i in mine))
    return 0.0 if best == math.inf else best


def _lower_bound(seconds: float, grads: float, cand: Candidate, figures: "_BoundCache") -> float:
    """A lower bound of `cand`'s predicted step time, whatever its split,
    schedule and mapping, from the terms `predict_time` adds up:

    * the pipeline: each micro-batch runs every op of the step once on one
      of the replica's ``P * t`` devices, so the busiest runs at least their
      share of ``M`` micro-batches' op seconds (`seconds`, on the fastest
      devices);
    * the update (`_update_seconds`) and, with ``R > 1``, the all-reduce: the
      largest stage holds at least ``1/P`` of the gradient bytes (`grads`),
      updated at the fastest element-wise speed and all-reduced over the
      fastest link with the least latency;
    * the runtime's cost of a step.
    """
    P, t, M, R = cand.partitions, cand.tensor_parallel_degree, cand.microbatches, cand.replicas
    pipeline = M * seconds / (P * t)
    elements = grads / P / 4.0
    work = elements * (APPLY_FLOPS_PER_ELEMENT * (1 + figures.slots)) / t * cand.slot_share
    update = (work + elements * max(M - 1, 0) / t) / figures.elementwise
    allreduce = 0.0
    if R > 1:
        allreduce = 2 * (R - 1) / R * (grads / P) / figures.bandwidth + 2 * (R - 1) * figures.latency
    return pipeline + update + allreduce + figures.cluster.runtime.get("step", 0.0)


def search(
    graph_for: Callable[[int, int], GraphInfo],
    batch_size: int,
    cluster: ResourceGraph,
    cands: Sequence[Candidate],
    *,
    slots: float = 2.0,
    memory_budget: Optional[int] = None,
    fixed: Optional[Mapping[str, Any]] = None,
    keep: int = 24,
    skipped: Sequence[Skipped] = (),
    headroom: float = HEADROOM,
    outputs_held: bool = True,
    cache: Optional[Dict[Any, Any]] = None,
) -> SearchResult:
    """Predicts `cands` on `cluster` and ranks them (module doc).

    Args:
        graph_for: ``(micro-batch size, t)`` -> the traced step
            (`GraphInfo`); called once per pair, so it may trace.
        batch_size: the step's batch (all replicas together).
        cluster: the machines.
        cands: the candidates (`candidates`).
        slots: optimizer slots per trainable byte.
        memory_budget: bytes per device, lowering every device's memory.
        fixed: config keys every row's config carries (the caller's).
        keep: rows whose memory is predicted: the fastest candidates by
            predicted time, until this many fit.
        skipped: combinations already left out (listed in the result).
        headroom: the share of each device's memory left free
            (`HEADROOM`).
        outputs_held: the step is called eagerly: every micro-batch's
            outputs are held until the end of the step
            (`smp_tf.memory.predict_assignment`).
        cache: `predict_time`'s cache, to share with another search of the
            same step on the same devices and links (its splits, tasks,
            schedules and task seconds; the runtime's ``dispatch`` and
            ``parallel`` may differ, as they do not enter them).

    Returns:
        The `SearchResult`: rows best first (fitting rows by predicted
        time, then the ones predicted not to fit), and every skipped
        candidate with its reason.
    """
    start = time.perf_counter()
    skip: List[Skipped] = list(skipped)
    infos: Dict[Tuple[int, int], Any] = {}
    cache = {} if cache is None else cache

    def timed(cand: Candidate) -> Optional[Tuple[PlanRow, Any, GraphInfo]]:
        if cand.devices > len(cluster.devices):
            skip.append(Skipped(cand, f"needs {cand.devices} devices; the cluster has {len(cluster.devices)}",
                                "devices"))
            return None
        b = batch_size // (cand.replicas * cand.microbatches)
        info = _info_for(infos, graph_for, b, cand.tensor_parallel_degree, cand.sequence_parallel)
        if isinstance(info, Exception):
            skip.append(Skipped(cand, f"tracing at micro-batch {b}, t={cand.tensor_parallel_degree} failed: {info}",
                                "trace"))
            return None
        try:
            row, st = predict_time(info, cand, cluster, slots=slots, fixed=fixed, cache=cache)
        except Exception as e:  # a candidate this graph cannot take; the reason is listed
            skip.append(Skipped(cand, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
            return None
        return row, st, info

    # Recomputation only adds time, and dividing the optimizer state adds
    # collectives: their variants wait until the candidate does not fit.
    first, variants = _split_variants(cands)
    heap: List[Tuple[float, int, Tuple[PlanRow, Any, GraphInfo]]] = []
    evaluated = 0
    # Candidates are predicted lazily, in the order of a lower bound of
    # their step time (`_lower_bound`): one whose bound exceeds the
    # predicted time of the next row to rank cannot come before it, so it
    # is predicted only when the ranking reaches its bound. The ranking is
    # the one predicting every candidate gives.
    bounds = _BoundCache(cluster, slots)
    pending: List[Tuple[float, int, Candidate]] = []
    for n, c in enumerate(first):
        pending.append((bounds(c, infos, graph_for, batch_size), n, c))
    pending.sort(key=lambda x: (x[0], x[1]))
    pending.reverse()  # popped from the end: the smallest bound first

    def predict(cand: Candidate) -> None:
        nonlocal evaluated
        got = timed(cand)
        if got is not None:
            evaluated += 1
            heapq.heappush(heap, (got[0].step_time, evaluated, got))

    rows: List[PlanRow] = []
    misfits: List[PlanRow] = []
    caps = [_capacity(cluster, d.name, memory_budget) for d in cluster.devices]
    while len(rows) < keep:
        while pending and not heap:
            predict(pending.pop()[2])
        # Every candidate that could be faster than the next row is predicted.
        while pending and heap and pending[-1][0] <= heap[0][0]:
            predict(pending.pop()[2])
        if not heap:
            break
        _, _, (row, st, info) = heapq.heappop(heap)
        floor = _static_floor(info, row.candidate, slots)
        if caps and all(caps) and floor > max(caps):
            row.fits = False
            skip.append(Skipped(row.candidate, f"the variables and optimizer state alone ({floor / 2**20:.1f} MiB "
                                               "per device) exceed every device's memory", "memory"))
            continue
        try:
            predict_memory(row, st, info, cluster, slots=slots, memory_budget=memory_budget, headroom=headroom,
                           outputs_held=outputs_held)
        except Exception as e:  # noqa: BLE001 - the reason is listed
            skip.append(Skipped(row.candidate, f"memory prediction failed: {type(e).__name__}: {e}"))
            continue
        if row.fits:
            rows.append(row)
            skip.extend(Skipped(v, "fits without recomputation, a divided optimizer state or sequence parallelism", "recompute")
                        for v in variants.pop(row.candidate, []))
            continue
        misfits.append(row)
        for v in variants.pop(row.candidate, []):
            predict(v)
    skip.extend(_unranked(pending, heap, variants, keep))
    return SearchResult(rows + misfits, skip, time.perf_counter() - start, evaluated)
