"""From a partitioned graph to tasks: one sub-graph per (partition, wave).

The *wave* of an op is the number of partition boundaries on the longest
path into it. Ops that depend on no step argument and no other partition
(variable reads, seed updates, ...) are not bound by that path; they join the
earliest task of their partition that needs them. For a chain of P stages
this yields, on stage p < P-1, a forward task (wave p) and a backward task
(wave 2P-2-p), and on the last stage one fused forward+backward task.

A task's inputs are the tensors it reads from other tasks: across partitions
they pass through an ``SMPOutput`` (producer side) and an ``SMPInput``
(consumer side); within a partition (activations stashed for the backward)
they are handed over as they are. Ops that read only constants and step
arguments ("free" ops) and captured placeholders are copied into every task
that needs them (a free op that is also a step output has one owning task
that returns it, and is recomputed, statelessly, where another copy needs
it); every other op belongs to exactly one task, so stateful ops run exactly
once per micro-batch.

This module is plain Python over `OpGraph`, plus slicing of the `GraphDef`
protobuf; it creates no TensorFlow ops.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from smp_tf.graph_view import OpGraph
from smp_tf.partitioner.groups import free_ops
from smp_tf.schedule import TaskSpec

#: Gradient ops that only read shapes.
_SHAPE_ONLY = frozenset(["Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"])

__all__ = [
    "Task",
    "FusedGradient",
    "build_tasks",
    "fusable_gradients",
    "PreTransposed",
    "pretransposable_products",
    "pretranspose_graph_def",
    "task_specs",
    "task_graph_def",
    "duplicable_ops",
    "waves",
]


@dataclass
class Task:
    """The ops of one partition in one wave, run once per micro-batch.

    Attributes:
        partition, wave: the task's key.
        members: op indices owned by the task (creation order).
        copies: duplicable op indices copied in (free ops, placeholders).
        inputs: tensor ids read from other tasks.
        outputs: tensor ids other tasks or the step's outputs need.
        producer_of_input: tensor id -> (partition, wave) of its producer task.
        backward: the task holds gradient ops.
        fused: the task holds forward and gradient ops.
        flops: estimated flops of the members.
        arg_names: step arguments the task's function reads (set when the
            task is lowered).
        transposed_reads: variable reads the task's function takes
            transposed (``pretranspose_weights``; set when lowered).
    """

    partition: int
    wave: int
    members: List[int] = field(default_factory=list)
    copies: List[int] = field(default_factory=list)
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    producer_of_input: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    backward: bool = False
    fused: bool = False
    flops: float = 0.0
    arg_names: List[str] = field(default_factory=list)
    transposed_reads: List[int] = field(default_factory=list)

    @property
    def key(self) -> Tuple[int, int]:
        return (self.partition, self.wave)

    def boundary_inputs(self) -> List[int]:
        """Inputs that come from another partition (each gets an SMPInput)."""
        return [t for t in self.inputs if self.producer_of_input[t][0] != self.partition]


def duplicable_ops(graph: OpGraph, keep: Sequence[int] = ()) -> List[bool]:
    """Ops that may be copied into several tasks: free ops and placeholders.

    `keep` lists op indices that must stay single (e.g. producers of step
    outputs).
    """
    dup = free_ops(graph)
    for op in graph.ops:
        if op.kind in ("capture", "arg"):
            dup[op.index] = True
    for i in keep:
        if graph.ops[i].kind == "op":
            dup[i] = False
    return dup


def waves(graph: OpGraph, partition_of_op: Sequence[int], dup: Sequence[bool]) -> List[Optional[int]]:
    """The wave of every non-duplicable op (None for duplicable ones).

    Cross-partition control edges are ignored: the schedule orders tasks.
    """
    n = len(graph.ops)
    tensors = graph.tensors
    part = partition_of_op
    # 1. Which ops depend on data: a step argument or another partition.
    data_dep = [False] * n
    asap: List[Optional[int]] = [None] * n
    for op in graph.ops:
        i = op.index
        if dup[i]:
            data_dep[i] = op.kind == "arg"
            continue
        w = 0
        dd = False
        for t in op.inputs:
            j = tensors[t].producer
            if dup[j]:
                dd = dd or data_dep[j]
                continue
            cross = part[j] != part[i]
            if cross or data_dep[j]:
                dd = True
                w = max(w, asap[j] + (1 if cross else 0))
        for j in op.control_inputs:
            if not dup[j] and part[j] == part[i] and data_dep[j]:
                dd = True
                w = max(w, asap[j])
        data_dep[i] = dd
        asap[i] = w

    # 2. Ops that depend on no data join the earliest task of their
    # partition that needs them (latest start that still precedes every
    # consumer), or the partition's first task.
    first_wave: Dict[int, int] = {}
    for i in range(n):
        if not dup[i] and data_dep[i]:
            p = part[i]
            first_wave[p] = min(first_wave.get(p, asap[i]), asap[i])
    consumers: List[List[Tuple[int, bool]]] = [[] for _ in range(n)]
    for op in graph.ops:
        if dup[op.index]:
            continue
        for t in op.inputs:
            j = tensors[t].producer
            if not dup[j]:
                consumers[j].append((op.index, part[j] != part[op.index]))
        for j in op.control_inputs:
            if not dup[j] and part[j] == part[op.index]:
                consumers[j].append((op.index, False))
    wave: List[Optional[int]] = list(asap)
    for i in range(n - 1, -1, -1):
        if dup[i] or data_dep[i]:
            continue
        limits = [wave[c] - (1 if cross else 0) for c, cross in consumers[i]]
        wave[i] = min(limits) if limits else first_wave.get(part[i], 0)
    lowest = min((w for w in wave if w is not None), default=0)
    if lowest < 0:
        wave = [None if w is None else w - lowest for w in wave]
    return wave


@dataclass(frozen=True)
class FusedGradient:
    """A step output computed once over all micro-batches instead of per micro-batch.

    Its op sums over the rows of its batched inputs, so on the inputs of all
    micro-batches concatenated along axis 0 it yields the sum of the
    per-micro-batch values: ``concat(X_m)^T concat(dY_m) = sum_m X_m^T dY_m``
    for a weight gradient ``MatMul(X, dY, transpose_a=True)``, and likewise
    for ``BiasAddGrad``. The op (and the ``Identity`` ops between it and the
    step output) leave the tasks; the tasks return its inputs instead.

    Attributes:
        output: position of the output in the step's flat outputs.
        op: index of the op.
        removed: op indices taken out of the tasks (the op and its Identity chain).
        inputs: tensor ids of the op's inputs, concatenated over micro-batches.
    """

    output: int
    op: int
    removed: Tuple[int, ...]
    inputs: Tuple[int, ...]


def _sums_over_rows(op_type: str, attrs: Dict[str, object]) -> bool:
    if op_type == "MatMul":
        return bool(attrs.get("transpose_a")) and not attrs.get("transpose_b")
    return op_type == "BiasAddGrad"


def fusable_gradients(
    graph: OpGraph,
    output_tensors: Sequence[Optional[int]],
    attrs_of: Callable[[int], Dict[str, object]],
) -> List[FusedGradient]:
    """The step outputs that can be computed once over all micro-batches.

    An output qualifies when it is (through ``Identity`` ops only) the result
    of a ``MatMul`` with ``transpose_a=True, transpose_b=False`` (a dense
    layer's weight gradient) or of a ``BiasAddGrad``, nothing else in the
    graph reads that result or waits on those ops, and the op's inputs are
    produced by ops of the graph or are step arguments.

    Args:
        graph: the traced graph.
        output_tensors: tensor id of each flat step output (None for None).
        attrs_of: op index -> the op's attributes (``transpose_a``, ...).

    Returns:
        One `FusedGradient` per qualifying output, in output order.
    """
    counts: Dict[int, int] = {}
    for t in output_tensors:
        if t is not None:
            counts[t] = counts.get(t, 0) + 1
    waited_on = {j for op in graph.ops for j in op.control_inputs}
    found: List[FusedGradient] = []
    for position, t in enumerate(output_tensors):
        if t is None or counts[t] > 1 or graph.tensors[t].consumers:
            continue
        chain = []
        op = graph.ops[graph.tensors[t].producer]
        while op.type == "Identity" and len(op.inputs) == 1:
            chain.append(op.index)
            src = graph.tensors[op.inputs[0]]
            if len(src.consumers) != 1 or counts.get(src.id):
                break
            op = graph.ops[src.producer]
        if op.type == "Identity" or op.kind != "op" or len(op.outputs) != 1:
            continue
        if not _sums_over_rows(op.type, attrs_of(op.index)):
            continue
        removed = tuple(chain) + (op.index,)
        if waited_on.intersection(removed):
            continue
        if any(graph.ops[graph.tensors[x].producer].kind == "capture" for x in op.inputs):
            continue
        found.append(FusedGradient(position, op.index, removed, tuple(op.inputs)))
    return found


@dataclass(frozen=True)
class PreTransposed:
    """A product that reads a variable transposed: ``MatMul(a, read(W), transpose_b=True)``.

    With ``pretranspose_weights`` the product reads ``W^T``, computed once per
    step, with ``transpose_b=False`` instead (the same values; small products
    with a transposed operand are much slower in some kernels, e.g. oneDNN's
    on CPUs).

    Attributes:
        op: index of the MatMul.
        read: index of the ``ReadVariableOp`` it reads the variable through.
        capture: index of the captured variable handle.
    """

    op: int
    read: int
    capture: int


def pretransposable_products(
    graph: OpGraph, attrs_of: Callable[[int], Dict[str, object]]
) -> List[PreTransposed]:
    """The products that can read a once-per-step transposed variable.

    A ``MatMul`` with ``transpose_b=True`` whose second input is a
    ``ReadVariableOp`` of a captured variable that nothing in the step writes
    (every user of the handle is a ``ReadVariableOp``), so its value is the
    same for every micro-batch.
    """
    read_only = set()
    for op in graph.ops:
        if op.kind == "capture" and op.outputs:
            users = graph.tensors[op.outputs[0]].consumers
            if users and all(graph.ops[u].type == "ReadVariableOp" for u in users):
                read_only.add(op.index)
    found = []
    for op in graph.ops:
        if op.type != "MatMul" or len(op.inputs) != 2 or not attrs_of(op.index).get("transpose_b"):
            continue
        read = graph.ops[graph.tensors[op.inputs[1]].producer]
        if read.type != "ReadVariableOp" or len(read.inputs) != 1:
            continue
        handle = graph.tensors[read.inputs[0]].producer
        if handle in read_only:
            found.append(PreTransposed(op.index, read.index, handle))
    return found


def pretranspose_graph_def(graph_def, products: Dict[str, str], placeholders: Dict[str, Tuple[int, List[int]]]) -> None:
    """Rewrites a task's `GraphDef` in place to read transposed variables.

    Args:
        graph_def: the task's `GraphDef`.
        products: MatMul node name -> name of the placeholder it reads its
            second operand from (with ``transpose_b`` turned off).
        placeholders: placeholder name -> (dtype enum, shape) to add.
    """
    for node in graph_def.node:
        if node.name in products:
            node.input[1] = products[node.name]
            node.attr["transpose_b"].b = False
    device = graph_def.node[0].device if len(graph_def.node) else ""
    for name, (dtype, shape) in placeholders.items():
        node = graph_def.node.add()
        node.name = name
        node.op = "Placeholder"
        node.device = device
        node.attr["dtype"].type = dtype
        for d in shape:
            node.attr["shape"].shape.dim.add().size = d


def build_tasks(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    output_tensors: Sequence[int],
    exclude: Sequence[int] = (),
) -> List[Task]:
    """Cuts a partitioned graph into tasks (see the module doc).

    Args:
        graph: the traced graph.
        partition_of_op: partition of each op.
        output_tensors: tensor ids the tasks must return (the step's outputs).
        exclude: op indices computed outside the tasks (fused gradients);
            nothing left in the tasks may read them.

    Returns:
        Tasks sorted by (wave, partition), which is a topological order.
    """
    keep = [graph.tensors[t].producer for t in output_tensors]
    dup = duplicable_ops(graph, keep)
    excluded = set(exclude)
    for i in excluded:
        # Marked duplicable, they join no task; nothing reads them, so no
        # task copies them in either.
        dup[i] = True
    wave = waves(graph, partition_of_op, dup)
    tasks: Dict[Tuple[int, int], Task] = {}
    task_of_op: List[Optional[Task]] = [None] * len(graph.ops)
    for op in graph.ops:
        if dup[op.index]:
            continue
        key = (partition_of_op[op.index], wave[op.index])
        task = tasks.get(key)
        if task is None:
            task = tasks[key] = Task(*key)
        task.members.append(op.index)
        task.flops += op.flops
        # Gradient ops that only read shapes (the ShapeN of a convolution's
        # gradient) run as soon as the forward exists; they may sit in a
        # forward task without making it a backward one.
        if op.is_gradient and op.type not in _SHAPE_ONLY:
            task.backward = True
        task_of_op[op.index] = task

    needed: Dict[int, Set[Tuple[int, int]]] = {}
    for task in tasks.values():
        member_set = set(task.members)
        copies: Set[int] = set()
        stack = []
        inputs: Set[int] = set()
        for i in task.members:
            for t in graph.ops[i].inputs:
                j = graph.tensors[t].producer
                if dup[j]:
                    stack.append(j)
                elif j not in member_set:
                    inputs.add(t)
                    needed.setdefault(t, set()).add(task.key)
        while stack:  # transitive closure of the duplicable inputs
            j = stack.pop()
            if j in copies:
                continue
            copies.add(j)
            stack.extend(graph.tensors[t].producer for t in graph.ops[j].inputs)
        task.copies = sorted(copies)
        task.inputs = sorted(inputs)
        for t in task.inputs:
            task.producer_of_input[t] = task_of_op[graph.tensors[t].producer].key
        task.fused = task.backward and any(not graph.ops[i].is_gradient and graph.ops[i].flops > 0 for i in task.members)
    for t in set(needed) | set(output_tensors):
        producer = task_of_op[graph.tensors[t].producer]
        if producer is not None and t not in producer.outputs:
            producer.outputs.append(t)
    for task in tasks.values():
        task.outputs.sort()
    return sorted(tasks.values(), key=lambda t: (t.wave, t.partition))


def task_specs(tasks: Sequence[Task]) -> List[TaskSpec]:
    """The scheduling view of `tasks` (dependencies and relative costs)."""
    total = sum(t.flops for t in tasks) or 1.0
    n = len(tasks)
    specs = []
    for t in tasks:
        deps = tuple(sorted(set(t.producer_of_input.values())))
        # Relative cost; a floor keeps near-empty tasks visible in the simulation.
        cost = max(t.flops / total * n, 0.05)
        specs.append(TaskSpec(t.partition, t.wave, deps, cost=cost, backward=t.backward, fused=t.fused))
    return specs


def task_graph_def(graph_def, graph: OpGraph, task: Task, device: str, nodes=None):
    """The `GraphDef` of `task`: its members and copies, placed on `device`.

    Inputs produced by other tasks stay as references to nodes that are not
    in the result; the importer maps them (``input_map``). Control inputs
    from outside the task are dropped: the schedule orders tasks.
    `nodes` (name -> NodeDef of `graph_def`) may be passed to avoid
    rebuilding the index for every task.
    """
    from tensorflow.core.framework import graph_pb2

    if nodes is None:
        nodes = {n.name: n for n in graph_def.node}
    names = {graph.ops[i].name for i in task.members} | {graph.ops[i].name for i in task.copies}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    if len(graph_def.library.function):
        out.library.CopyFrom(graph_def.library)
    for i in sorted(task.members + task.copies):
        src = nodes[graph.ops[i].name]
        node = out.node.add()
        node.CopyFrom(src)
        node.device = device
        if "_class" in node.attr:
            del node.attr["_class"]
        keep = [x for x in node.input if not x.startswith("^") or x[1:] in names]
        del node.input[:]
        node.input.extend(keep)
    return out
