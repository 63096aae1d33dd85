"""From a partitioned graph to tasks: one sub-graph per (partition, wave).

The *wave* of an op is the number of partition boundaries on the longest
path into it. Ops that depend on no step argument and no other partition
(variable reads, seed updates, ...) are not bound by that path; they join the
earliest task of their partition that needs them. Every access of a resource
the step writes (a seed state, BatchNorm statistics) is in one task, so the
state advances exactly once per micro-batch, in micro-batch order (see
`waves`). For a chain of P stages
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

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from smp_tf.graph_view import OpGraph, OpNode, strongly_connected
from smp_tf.partitioner.groups import ROUNDING_DTYPES, free_ops
from smp_tf.schedules import TaskKind, TaskSpec
from smp_tf.schedules.tasks import KindFlags

#: Gradient ops that only read shapes.
_SHAPE_ONLY = frozenset(["Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"])

__all__ = [
    "Task",
    "BackwardSplit",
    "split_backward",
    "FusedGradient",
    "build_tasks",
    "fusable_gradients",
    "PreTransposed",
    "pretransposable_products",
    "pretranspose_graph_def",
    "task_specs",
    "task_graph_def",
    "shared_squares",
    "duplicable_ops",
    "waves",
    "StateOrderError",
    "RECOMPUTE_MODES",
    "recomputable_ops",
    "RANDOM_OP_PREFIXES",
    "is_random_op",
    "WEIGHT_GRADIENT_KERNELS",
]

#: Values of the ``recompute`` setting that `build_tasks` takes, per partition.
RECOMPUTE_MODES = ("never", "selective", "full")

#: ``recompute="selective"`` keeps the outputs of ops that cost at least this
#: many estimated flops per output element (matrix products, convolutions,
#: attention products: 2K flops per element for a contraction over K) and
#: recomputes the cheaper ones (element-wise ops, normalisation, softmax,
#: dropout), which hold most of the bytes for few of the flops.
SELECTIVE_MIN_FLOPS_PER_ELEMENT = 8.0

#: Random number generators. Under ``recompute="selective"`` a boolean
#: computed straight from one of their draws (a dropout's keep mask) is kept:
#: one byte per element spares drawing the numbers again, which on a CPU
#: costs as much as the products the mode keeps.
RANDOM_OP_PREFIXES = ("StatelessRandom", "RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                      "StatelessTruncatedNormal", "StatelessParameterizedTruncatedNormal", "RandomGamma",
                      "RandomPoisson", "StatelessMultinomial", "Multinomial")


def is_random_op(op_type: str) -> bool:
    """Whether ops of `op_type` draw random numbers (seeded or not)."""
    return op_type.startswith(RANDOM_OP_PREFIXES)


#: Ops never recomputed: control flow and function calls (their outputs are
#: kept instead; a loop's accumulators are its gradient's inputs).
_NOT_RECOMPUTED = frozenset(
    ["While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
     "StatefulPartitionedCall", "SymbolicGradient"]
)


@dataclass
class Task(KindFlags):
    """The ops of one partition in one wave, run once per micro-batch.

    Attributes:
        partition, wave: the task's key.
        members: op indices owned by the task (creation order).
        copies: duplicable op indices copied in (free ops, placeholders).
        inputs: tensor ids read from other tasks.
        outputs: tensor ids other tasks or the step's outputs need.
        producer_of_input: tensor id -> (partition, wave) of its producer task.
        kind: a `TaskKind`: ``FORWARD``, ``BACKWARD`` (gradient ops),
            ``FUSED`` (forward and gradient ops) or ``WEIGHT`` (the part of a
            backward task that leads only to weight gradients,
            ``build_tasks(split_weight=True)``); ``backward``, ``fused`` and
            ``weight`` read it.
        flops: estimated flops of the members.
        arg_names: step arguments the task's function reads (set when the
            task is lowered).
        transposed_reads: variable reads the task's function takes
            transposed (``pretranspose_weights``; set when lowered).
        recomputed: forward ops of an earlier task of the same partition
            that this (backward) task runs again instead of receiving their
            outputs (activation recomputation, see `recomputable_ops`).
        pinned: tensors of the task that the single-device graph reads
            several times but the task reads once (see `pinned_tensors`);
            the lowering gives each one a second, negligible reader.
    """

    partition: int
    wave: int
    members: List[int] = field(default_factory=list)
    copies: List[int] = field(default_factory=list)
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    producer_of_input: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    kind: TaskKind = TaskKind.FORWARD
    flops: float = 0.0
    arg_names: List[str] = field(default_factory=list)
    transposed_reads: List[int] = field(default_factory=list)
    recomputed: List[int] = field(default_factory=list)
    pinned: List[int] = field(default_factory=list)

    @property
    def key(self) -> Tuple[int, int]:
        return (self.partition, self.wave)

    def boundary_inputs(self) -> List[int]:
        """Inputs that come from another partition (each gets an SMPInput)."""
        return [t for t in self.inputs if self.producer_of_input[t][0] != self.partition]

    def kept_inputs(self) -> List[int]:
        """Inputs produced by an earlier task of the same partition: what the
        partition keeps alive between its tasks (activations for the backward)."""
        return [t for t in self.inputs if self.producer_of_input[t][0] == self.partition]


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


class StateOrderError(ValueError):
    """The step's state accesses cannot all run in one task per micro-batch.

    A resource the step writes (a seed, BatchNorm statistics, any variable
    write) must be read and written within one task, so that each
    micro-batch sees exactly the state the previous one left, as in the
    reference loop. Raised when the graph makes that impossible: a path
    between two accesses of the state leaves the partition and comes back.
    """


#: Ops that pass values on (or read their shapes) without computing new ones.
_CARRY_ONLY = _SHAPE_ONLY | frozenset(["Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "Cast"])


def forward_values_in_gradients(graph: OpGraph, dup: Sequence[bool]) -> List[bool]:
    """Gradient ops that only carry forward values or their shapes on.

    An embedding's gradient is a `tf.IndexedSlices` whose indices are the
    token ids reshaped, and whose dense shape is the table's shape: gradient
    ops that read forward values only, without gradient arithmetic, and
    run as soon as the forward exists. So do the shape reads of a
    convolution's gradient. They sit in forward tasks (rule 1 of `waves`)
    without making them backward tasks; otherwise the first partition of
    every model with an embedding would run its forward as a fused task,
    and the schedule would keep all its micro-batches' activations.

    Returns:
        Per op: a gradient op of `_CARRY_ONLY` type whose inputs are
        forward ops, duplicable ops or such gradient ops.
    """
    carried = [False] * len(graph.ops)
    for op in graph.ops:  # creation order is a topological order
        if not op.is_gradient or op.type not in _CARRY_ONLY:
            continue
        producers = [graph.tensors[t].producer for t in op.inputs]
        carried[op.index] = op.type in _SHAPE_ONLY or all(
            dup[j] or not graph.ops[j].is_gradient or carried[j] for j in producers
        )
    return carried


def gradient_preludes(graph: OpGraph, dup: Sequence[bool]) -> List[bool]:
    """Gradient ops computed from forward values only (the ``x ** 2`` of a
    GELU's gradient), and the gradient ops computed from those.

    The loss's own gradient, ones of the loss's shape, is computed from a
    forward value as well; so every gradient op downstream of it counts,
    except those that read variables or only shapes and what is computed
    from them."""
    prelude = [False] * len(graph.ops)
    for op in graph.ops:
        i = op.index
        if dup[i] or not op.is_gradient or op.type in _SHAPE_ONLY or op.variables:
            continue
        producers = [graph.tensors[t].producer for t in op.inputs]
        prelude[i] = all(dup[j] or not graph.ops[j].is_gradient or prelude[j] for j in producers)
    return prelude


def waves(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    dup: Sequence[bool],
    carried: Optional[Sequence[bool]] = None,
    prelude: Optional[Sequence[bool]] = None,
) -> List[Optional[int]]:
    """The wave of every non-duplicable op (None for duplicable ones).

    `carried` is `forward_values_in_gradients(graph, dup)` and `prelude`
    `gradient_preludes(graph, dup)`, computed here when not given.

    Rules, in order:

    1. An op *depends on data* when it reads a step argument (directly or
       through duplicable ops computed from it, such as a ``Cast`` or a
       rescaling of the input) or an op that depends on data, on its own
       partition or another. Its wave is the most partition boundaries on
       a path into it from a step argument.
    2. Every op that takes the handle of a resource the step writes (seed
       states, BatchNorm statistics, any variable write) is in the task of
       every other such op of that resource, so that each micro-batch reads
       exactly what the previous micro-batch wrote, as in the reference
       loop. Ops on a path between two of them join that task as well.
    3. Ops that depend on no data join the earliest task of their partition
       that needs them: of the partition's waves from rule 1, the latest
       that still precedes every consumer (one wave earlier for a consumer
       on another partition; that wave itself if the partition has none
       before it), or the partition's first task if nothing consumes them.
       This holds for ops that read such values from another partition
       too (a dropout mask drawn from a seed that another partition reads
       and advances): they join their readers' task, not one of their own.
    4. Gradient ops computed from forward values only (preludes of the
       backward, e.g. the ``x ** 2`` of a GELU's gradient) join the task
       of their consumers in the same way, never an earlier wave than
       rule 1 gives them. The loss's own gradient (ones of its shape) is
       computed from a forward value, so in practice this places every
       gradient op downstream of it too (see `gradient_preludes`): as late
       as its readers allow, which for a chain of gradients is where its
       inputs put it.
    5. A forward wave of a partition that holds only values its later
       tasks read (a decoder's mask and position bias, computed from its
       token ids and variables) joins the latest other wave of the
       partition that runs forward work (a forward task, or the last
       stage's fused one) and precedes every reader, instead of being a
       task of its own (see `_defer_lone_forward_values`).
    6. A gradient op that rule 4 put later than its inputs allow, at a
       wave where its partition computes no other gradients (one wave
       before a reader on another partition), joins the latest task of its
       partition that does (backward or fused) and follows its inputs,
       instead of being a task of its own (see `_join_backward_tasks`).
       Rule 3 then uses the waves after rules 5 and 6.

    Cross-partition control edges are ignored: the schedule orders tasks.

    Raises:
        StateOrderError: rule 2 cannot hold (see `StateOrderError`).
    """
    n = len(graph.ops)
    tensors = graph.tensors
    part = partition_of_op
    # Duplicable ops computed from a step argument carry the dependence.
    dup_data = [False] * n
    for op in graph.ops:
        if dup[op.index]:
            dup_data[op.index] = op.kind == "arg" or any(dup_data[tensors[t].producer] for t in op.inputs)

    # Units: non-duplicable ops, joined per written resource (rule 2).
    unit = list(range(n))

    def find(x: int) -> int:
        while unit[x] != x:
            unit[x] = unit[unit[x]]
            x = unit[x]
        return x

    written = {v for op in graph.ops for v in op.writes}
    first_access: Dict[str, int] = {}
    for op in graph.ops:
        if dup[op.index]:
            continue
        for v in op.variables:
            if v in written:
                a, b = find(first_access.setdefault(v, op.index)), find(op.index)
                if a != b:
                    unit[max(a, b)] = min(a, b)

    # Edges between units: data edges, and control edges inside a partition.
    edges: Dict[Tuple[int, int], int] = {}
    reads_data = [False] * n
    for op in graph.ops:
        i = op.index
        if dup[i]:
            continue
        ui = find(i)
        for t in op.inputs:
            j = tensors[t].producer
            if dup[j]:
                reads_data[ui] = reads_data[ui] or dup_data[j]
                continue
            uj = find(j)
            if uj != ui or part[j] != part[i]:
                key = (uj, ui)
                edges[key] = max(edges.get(key, 0), int(part[j] != part[i]))
        for j in op.control_inputs:
            if not dup[j] and part[j] == part[i] and find(j) != ui:
                edges.setdefault((find(j), ui), 0)

    roots = sorted({find(i) for i in range(n) if not dup[i]})
    node_of = {r: k for k, r in enumerate(roots)}
    succ: List[List[int]] = [[] for _ in roots]
    for (a, b) in edges:
        if a != b:
            succ[node_of[a]].append(node_of[b])
    comp_of_node = strongly_connected(succ)
    ncomp = max(comp_of_node, default=-1) + 1
    comp = [-1] * n
    for i in range(n):
        if not dup[i]:
            comp[i] = comp_of_node[node_of[find(i)]]

    # A component is one task: it cannot span partitions or contain a boundary.
    comp_part: Dict[int, int] = {}
    for i in range(n):
        if not dup[i]:
            if comp_part.setdefault(comp[i], part[i]) != part[i]:
                _raise_state_order(graph, part, comp, comp[i], written)
    comp_edges: Dict[Tuple[int, int], int] = {}
    for (a, b), cross in edges.items():
        ca, cb = comp[a], comp[b]
        if ca == cb:
            if cross:
                _raise_state_order(graph, part, comp, ca, written)
            continue
        comp_edges[(ca, cb)] = max(comp_edges.get((ca, cb), 0), cross)
    preds: List[List[Tuple[int, int]]] = [[] for _ in range(ncomp)]
    succs: List[List[Tuple[int, int]]] = [[] for _ in range(ncomp)]
    for (a, b), cross in comp_edges.items():
        preds[b].append((a, cross))
        succs[a].append((b, cross))
    comp_reads_data = [False] * ncomp
    for i in range(n):
        if not dup[i] and reads_data[find(i)]:
            comp_reads_data[comp[i]] = True

    # Tarjan numbers components in reverse topological order.
    topo = list(range(ncomp - 1, -1, -1))
    data_dep = [False] * ncomp
    asap = [0] * ncomp
    for c in topo:
        dd = comp_reads_data[c]
        w = 0
        for p, cross in preds[c]:
            if data_dep[p]:
                dd = True
                w = max(w, asap[p] + cross)
        data_dep[c] = dd
        asap[c] = w

    # Gradient ops computed from forward values only (the ``x ** 2`` of a
    # GELU's gradient) are preludes of the backward: they run with the
    # backward that reads them, not in the forward task, which then stays a
    # forward (the schedule runs it as one) and keeps ``x``, not its prelude.
    if prelude is None:
        prelude = gradient_preludes(graph, dup)
    comp_prelude = [True] * ncomp
    for i in range(n):
        if not dup[i] and not prelude[i]:
            comp_prelude[comp[i]] = False
    wave_of = list(asap)
    # Preludes first: everything that reads them depends on data too.
    for c in reversed(topo):
        if data_dep[c] and comp_prelude[c]:
            limits = [wave_of[s] - cross for s, cross in succs[c]]
            wave_of[c] = max(asap[c], min(limits)) if limits else asap[c]
    if carried is None:
        carried = forward_values_in_gradients(graph, dup)
    gradient, forward_work = _component_work(graph, carried, comp, ncomp)
    _defer_lone_forward_values(graph, comp, comp_part, data_dep, comp_prelude, succs, wave_of, written,
                               gradient, forward_work)
    _join_backward_tasks(topo, preds, comp_part, data_dep, comp_prelude, asap, wave_of, gradient)
    # The waves at which a partition has tasks anyway (its ops that depend
    # on data).
    data_waves: Dict[int, Set[int]] = {}
    first_wave: Dict[int, int] = {}
    for c in range(ncomp):
        if data_dep[c]:
            p = comp_part[c]
            data_waves.setdefault(p, set()).add(wave_of[c])
            first_wave[p] = min(first_wave.get(p, wave_of[c]), wave_of[c])
    for c in reversed(topo):
        if data_dep[c]:
            continue
        limits = [wave_of[s] - cross for s, cross in succs[c]]
        if not limits:
            wave_of[c] = first_wave.get(comp_part[c], 0)
            continue
        # The latest task of the partition that precedes every consumer,
        # rather than a task of its own between two of them.
        limit = min(limits)
        earlier = [w for w in data_waves.get(comp_part[c], ()) if w <= limit]
        wave_of[c] = max(earlier) if earlier else limit
    wave: List[Optional[int]] = [None if dup[i] else wave_of[comp[i]] for i in range(n)]
    lowest = min((w for w in wave if w is not None), default=0)
    if lowest < 0:
        wave = [None if w is None else w - lowest for w in wave]
    return wave


def _component_work(
    graph: OpGraph, carried: Sequence[bool], comp: Sequence[int], ncomp: int
) -> Tuple[List[bool], List[bool]]:
    """Per component of `waves`: whether it holds gradient ops that make a
    task a backward one (gradient ops that only carry forward values on do
    not, see `_assemble`), and whether it holds forward work
    (`_is_forward_work`)."""
    gradient = [False] * ncomp
    forward_work = [False] * ncomp
    for op in graph.ops:
        c = comp[op.index]
        if c < 0:
            continue
        if op.is_gradient and not carried[op.index]:
            gradient[c] = True
        elif _is_forward_work(op):
            forward_work[c] = True
    return gradient, forward_work


def _join_backward_tasks(
    topo: Sequence[int],
    preds: Sequence[Sequence[Tuple[int, int]]],
    comp_part: Dict[int, int],
    data_dep: Sequence[bool],
    comp_prelude: Sequence[bool],
    asap: Sequence[int],
    wave_of: List[int],
    gradient: Sequence[bool],
) -> None:
    """Rule 6 of `waves`, in place on `wave_of` (per component).

    Rule 4 puts a gradient op as late as its readers allow: in its reader's
    task when they share a partition, one wave before the reader when the
    reader is on another partition. When the op's inputs are ready earlier,
    that wave may be one at which its partition computes nothing else
    (DeBERTa's masked relative-position gradients, read by the partition
    of the shared embedding at the end of the backward): a task of two
    ops, one more call per micro-batch. Such an op joins instead the
    latest task of its partition, between its inputs and that wave, that
    computes gradients anyway (a backward or fused task, whose gradient
    ops sit where their inputs put them); a forward task would become a
    fused one. Moving an op earlier keeps every reader after it; `topo`
    (producers first) moves an op's producers before the op, whose
    earliest wave then follows theirs.
    """
    # The waves at which a partition computes gradients anyway: those of
    # gradient ops that rule 4 left where their inputs put them.
    own: Dict[int, Set[int]] = {}
    for c in range(len(wave_of)):
        if data_dep[c] and gradient[c] and (not comp_prelude[c] or wave_of[c] == asap[c]):
            own.setdefault(comp_part[c], set()).add(wave_of[c])
    for c in topo:
        if not (data_dep[c] and comp_prelude[c]) or wave_of[c] == asap[c]:
            continue
        waves_of_part = own.get(comp_part[c], set())
        if wave_of[c] in waves_of_part:
            continue
        earliest = max((wave_of[p] + cross for p, cross in preds[c] if data_dep[p]), default=0)
        candidates = [w for w in waves_of_part if earliest <= w <= wave_of[c]]
        if candidates:
            wave_of[c] = max(candidates)


def _defer_lone_forward_values(
    graph: OpGraph,
    comp: Sequence[int],
    comp_part: Dict[int, int],
    data_dep: Sequence[bool],
    comp_prelude: Sequence[bool],
    succs: Sequence[Sequence[Tuple[int, int]]],
    wave_of: List[int],
    written: Set[str],
    gradient: Sequence[bool],
    forward_work: Sequence[bool],
) -> None:
    """Rule 5 of `waves`, in place on `wave_of` (per component).

    A forward wave of a partition may hold nothing but values computed from
    step arguments and variables that only later tasks read: a decoder's
    attention mask and relative-position bias, which depend on its token
    ids but not on the encoder. As soon as possible puts them at wave 0, a
    task of their own ahead of the partition's first real one: one more
    call per micro-batch and one more function. Such a wave joins, of its
    partition's other waves that run forward work (forward tasks, and the
    fused forward-backward task of the last stage), the latest that still
    precedes every reader, when there is one; never a backward task, which
    forward work would make a fused one. Ops that touch state the step
    writes, draw random numbers or compute gradients stay where they are
    (rules 2 and 4).
    """
    ncomp = len(wave_of)
    movable = [data_dep[c] and not comp_prelude[c] and bool(succs[c]) for c in range(ncomp)]
    for op in graph.ops:
        c = comp[op.index]
        if c >= 0 and (is_random_op(op.type) or any(v in written for v in op.variables)):
            movable[c] = False
    groups: Dict[Tuple[int, int], List[int]] = {}
    for c in range(ncomp):
        if data_dep[c]:
            groups.setdefault((comp_part[c], wave_of[c]), []).append(c)
    # Latest waves first: a group's readers are at its wave or later
    # (later on another partition), so their waves are final when it moves.
    # partition -> its waves that stay and run forward work: forward tasks,
    # and fused ones (the last stage's), which forward ops leave fused.
    anchors: Dict[int, Set[int]] = {}
    for (p, w) in sorted(groups, key=lambda key: -key[1]):
        members = groups[(p, w)]
        if all(movable[c] and not gradient[c] for c in members):
            inside = set(members)
            limits = [wave_of[s] - cross for c in members for s, cross in succs[c] if s not in inside]
            later = [a for a in anchors.get(p, ()) if limits and w < a <= min(limits)]
            if later:
                for c in members:
                    wave_of[c] = max(later)
                continue
        if not any(gradient[c] for c in members) or any(forward_work[c] for c in members):
            anchors.setdefault(p, set()).add(w)


def _is_forward_work(op: OpNode) -> bool:
    """A forward op that computes something: in a backward task it makes the
    task a fused one."""
    return not op.is_gradient and op.flops > 0


def _raise_state_order(graph: OpGraph, part: Sequence[int], comp: Sequence[int], c: int, written: Set[str]) -> None:
    members = [i for i in range(len(graph.ops)) if comp[i] == c]
    state = sorted({v for i in members for v in graph.ops[i].variables if v in written})
    accessors = [graph.ops[i].name for i in members if set(graph.ops[i].variables) & set(state)][:4]
    parts = sorted({part[i] for i in members})
    outside = [graph.ops[i].name for i in members if not set(graph.ops[i].variables) & set(state)][:3]
    raise StateOrderError(
        f"The step writes {state[:3]} and reads or writes it in ops {accessors}, which must run "
        f"in one pipeline task per micro-batch for the result to equal the single-device "
        f"loop; but a path between those ops crosses partitions {parts} (through {outside}). "
        "Keep every read and write of that state in one layer (or one `smp.partition` block), "
        "or place the ops between them on one partition with `smp.partition`."
    )


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


def recomputable_ops(graph: OpGraph, mode: str, dup: Optional[Sequence[bool]] = None) -> List[bool]:
    """The forward ops whose outputs a backward task may compute again.

    An op qualifies when running it twice gives the same values and changes
    nothing: a forward (non-gradient) op that is not duplicable anyway, is
    not control flow or a function call, and is stateless, except for a
    ``ReadVariableOp`` of a variable the step does not write (the weights
    are the same for the whole step). An op that reads state the step writes
    (the read of a seed or of BatchNorm statistics) or draws with a stateful
    random op does not qualify: its outputs are kept, so a recomputed
    dropout replays the seed the forward read and draws the same mask, and
    no state is updated twice. With ``mode="selective"`` the ops that cost
    at least `SELECTIVE_MIN_FLOPS_PER_ELEMENT` flops per output element
    (products, convolutions) do not qualify either: their outputs are kept;
    nor do booleans computed from a random draw (a dropout's keep mask,
    one byte per element), so the draw is not repeated.

    Args:
        graph: the traced graph.
        mode: one of `RECOMPUTE_MODES`.
        dup: duplicable ops (`duplicable_ops`); computed when None.

    Returns:
        One flag per op.

    Raises:
        ValueError: `mode` is not one of `RECOMPUTE_MODES`.
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}. Received: recompute={mode!r}")
    if mode == "never":
        return [False] * len(graph.ops)
    if dup is None:
        dup = duplicable_ops(graph)
    written = {v for op in graph.ops for v in op.writes}
    out = [False] * len(graph.ops)
    for op in graph.ops:
        if dup[op.index] or op.kind != "op" or op.is_gradient or op.type in _NOT_RECOMPUTED:
            continue
        if op.writes or any(v in written for v in op.variables):
            continue
        if op.stateful and op.type != "ReadVariableOp":
            continue
        if mode == "selective":
            elements = sum(graph.tensors[t].elements for t in op.outputs)
            if op.flops >= SELECTIVE_MIN_FLOPS_PER_ELEMENT * max(elements, 1):
                continue
            if _random_mask(graph, op):
                continue
        out[op.index] = True
    return out


#: Ops through which a tensor still counts as a random draw (a uniform
#: draw is scaled and shifted into its range before it is compared).
_DRAW_PASSTHROUGH = frozenset(["Mul", "AddV2", "Add", "Sub", "Cast", "Identity", "Reshape"])


def _drawn(graph: OpGraph, tensor: int, depth: int = 4) -> bool:
    """Whether `tensor` is a random draw, possibly scaled or shifted."""
    op = graph.ops[graph.tensors[tensor].producer]
    if is_random_op(op.type):
        return True
    return depth > 0 and op.type in _DRAW_PASSTHROUGH and any(_drawn(graph, t, depth - 1) for t in op.inputs)


def _random_mask(graph: OpGraph, op: OpNode) -> bool:
    """Whether `op` makes booleans from a random draw (a dropout's keep mask)."""
    return bool(op.outputs) and all(graph.tensors[t].dtype == "bool" for t in op.outputs) and any(
        _drawn(graph, t) for t in op.inputs)


def _recompute_modes(recompute: Union[str, Sequence[str]], partition_of_op: Sequence[int]) -> Dict[int, str]:
    parts = sorted(set(partition_of_op))
    if isinstance(recompute, str):
        return {p: recompute for p in parts}
    modes = list(recompute)
    if parts and len(modes) <= parts[-1]:
        raise ValueError(
            f"recompute lists {len(modes)} modes but the plan has partition {parts[-1]}; "
            "give one mode per partition or a single mode."
        )
    return {p: modes[p] for p in parts}


def build_tasks(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    output_tensors: Sequence[int],
    exclude: Sequence[int] = (),
    recompute: Union[str, Sequence[str]] = "never",
    split_weight: bool = False,
    memo: Optional[Dict[Any, Any]] = None,
) -> List[Task]:
    """Cuts a partitioned graph into tasks (see the module doc).

    With recomputation, a backward task that would read a tensor computed by
    an earlier task of its own partition computes it again instead, from
    the tensors that partition keeps anyway (what it received from other
    partitions) and from the outputs of ops that may not run twice (see
    `recomputable_ops`), which are then all it keeps between its tasks.
    The earlier task no longer returns what nobody reads from it.

    Args:
        graph: the traced graph.
        partition_of_op: partition of each op.
        output_tensors: tensor ids the tasks must return (the step's outputs).
        exclude: op indices computed outside the tasks (fused gradients);
            nothing left in the tasks may read them.
        recompute: one of `RECOMPUTE_MODES`, or one per partition.
        memo: a dict kept by a caller that cuts one graph under many
            splits (the planner): what does not depend on the split (the
            duplicable ops, the forward values gradients read, the
            gradients' preludes) is computed once per outputs and
            exclusions.
        split_weight: split every backward task with weight-gradient work
            into B and a W task (`split_backward`), for the ``zero_bubble``
            schedule; a fused task gives W only its weight-gradient
            kernels (see the comment in the code). A W task's wave is above
            every other wave (nothing but the step's outputs waits for it),
            so the order below stays topological.

    Returns:
        Tasks sorted by (wave, partition), which is a topological order.

    Raises:
        ValueError: an unknown recompute mode.
    """
    dup, carried, prelude = _unsplit_analysis(graph, output_tensors, exclude, memo)
    wave = waves(graph, partition_of_op, dup, carried, prelude)
    modes = _recompute_modes(recompute, partition_of_op)
    tasks = _assemble(graph, partition_of_op, output_tensors, dup, carried, wave, modes, set())
    if not split_weight:
        return tasks
    top = max(t.wave for t in tasks)
    weight_ops: Set[int] = set()
    for task in tasks:
        if task.fused and modes[task.partition] != "never":
            # A W task reads what it needs from the task before it, and
            # with recomputation it would run the last stage's forward
            # again (that stage keeps nothing between tasks otherwise): more
            # work, and the recomputed values round differently (seen on
            # BERT). The fused task stays whole there.
            continue
        split = split_backward(graph, task, tasks)
        if split is None:
            continue
        w_ops: Sequence[int] = split.w
        if task.fused:
            # The last stage's fused task gives W only its weight-gradient
            # kernels and what carries their results on. With all of W
            # moved out (the element-wise parts of normalisation gradients
            # too), TensorFlow's graph optimiser rewrote the rest of the
            # task's arithmetic differently from the single-device step, and
            # the input gradients it sends back rounded differently (seen
            # on MobileNetV3).
            w_ops = _weight_kernel_leaves(graph, split.w)
        for i in w_ops:
            if i in task.members:  # recomputed ops follow their readers
                wave[i] = top + 1 + task.wave
                weight_ops.add(i)
    if not weight_ops:
        return tasks
    return _assemble(graph, partition_of_op, output_tensors, dup, carried, wave, modes, weight_ops)


def _unsplit_analysis(
    graph: OpGraph, output_tensors: Sequence[int], exclude: Sequence[int], memo: Optional[Dict[Any, Any]]
) -> Tuple[List[bool], List[bool], List[bool]]:
    """What `build_tasks` needs that does not depend on the split: the
    duplicable ops (`exclude` among them), `forward_values_in_gradients` and
    `gradient_preludes`; kept in `memo` per outputs and exclusions."""
    key = (tuple(output_tensors), tuple(sorted(set(exclude))))
    found = None if memo is None else memo.get(key)
    if found is None:
        keep = [graph.tensors[t].producer for t in output_tensors]
        dup = duplicable_ops(graph, keep)
        for i in exclude:
            # Marked duplicable, they join no task; nothing reads them, so no
            # task copies them in either.
            dup[i] = True
        found = (dup, forward_values_in_gradients(graph, dup), gradient_preludes(graph, dup))
        if memo is not None:
            memo[key] = found
    return found


#: Kernels that compute a weight gradient from an activation and an output gradient.
WEIGHT_GRADIENT_KERNELS = frozenset([
    "Conv2DBackpropFilter", "Conv2DBackpropFilterV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNativeBackpropFilter", "BiasAddGrad", "MatMul", "BatchMatMulV2", "BatchMatMulV3",
])


def _weight_kernel_leaves(graph: OpGraph, w: Sequence[int]) -> Set[int]:
    """The weight-gradient kernels of `w`, with the ops of `w` that only
    carry their results on (reshapes, identities, sums of their outputs)."""
    members = set(w)
    out = {i for i in members if graph.ops[i].type in WEIGHT_GRADIENT_KERNELS}
    grew = True
    while grew:
        grew = False
        for i in sorted(members - out):
            producers = {graph.tensors[t].producer for t in graph.ops[i].inputs} & members
            if producers and producers <= out:
                out.add(i)
                grew = True
    # What stays behind must not read W: drop every op that an op staying
    # behind reads, until none does.
    shrank = True
    while shrank:
        shrank = False
        for i in sorted(out):
            readers = {c for t in graph.ops[i].outputs for c in graph.tensors[t].consumers}
            if readers & (members - out):
                out.discard(i)
                shrank = True
    return out


def _assemble(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    output_tensors: Sequence[int],
    dup: Sequence[bool],
    carried: Sequence[bool],
    wave: Sequence[Optional[int]],
    modes: Dict[int, str],
    weight_ops: Set[int],
) -> List[Task]:
    """Tasks from each op's (partition, wave): members, copies, recomputed
    ops, inputs and outputs (the body of `build_tasks`). Tasks made of
    `weight_ops` are W tasks; gradient ops marked `carried`
    (`forward_values_in_gradients`) leave a task a forward task."""
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
        if op.index in weight_ops:  # a W task holds weight ops only (its own wave)
            task.kind = TaskKind.WEIGHT
        # Gradient ops that only carry forward values (the ShapeN of a
        # convolution's gradient, the indices of an embedding's gradient)
        # run as soon as the forward exists; they may sit in a forward task
        # without making it a backward one.
        elif op.is_gradient and not carried[op.index]:
            task.kind = TaskKind.BACKWARD
        task_of_op[op.index] = task

    again = {mode: recomputable_ops(graph, mode, dup) for mode in set(modes.values())}
    needed: Dict[int, Set[Tuple[int, int]]] = {}
    for task in tasks.values():
        member_set = set(task.members)
        can = again[modes[task.partition]]
        recomputed: Set[int] = set()
        copies: Set[int] = set()
        stack = []
        inputs: Set[int] = set()
        pending = [t for i in task.members for t in graph.ops[i].inputs]
        while pending:
            t = pending.pop()
            j = graph.tensors[t].producer
            if dup[j]:
                stack.append(j)
            elif j in member_set or j in recomputed:
                continue
            elif task.backward and can[j] and partition_of_op[j] == task.partition:
                # Computed again here from what the partition keeps anyway.
                recomputed.add(j)
                pending.extend(graph.ops[j].inputs)
            else:
                inputs.add(t)
        while stack:  # transitive closure of the duplicable inputs
            j = stack.pop()
            if j in copies:
                continue
            copies.add(j)
            stack.extend(graph.tensors[t].producer for t in graph.ops[j].inputs)
        task.copies = sorted(copies)
        task.recomputed = sorted(recomputed)
        task.flops += sum(graph.ops[i].flops for i in recomputed)
        task.inputs = sorted(inputs)
        for t in task.inputs:
            needed.setdefault(t, set()).add(task.key)
            task.producer_of_input[t] = task_of_op[graph.tensors[t].producer].key
        if task.kind is TaskKind.BACKWARD and any(
            _is_forward_work(graph.ops[i]) for i in task.members
        ):
            task.kind = TaskKind.FUSED
    for t in set(needed) | set(output_tensors):
        producer = task_of_op[graph.tensors[t].producer]
        if producer is not None and t not in producer.outputs:
            producer.outputs.append(t)
    for task in tasks.values():
        task.outputs.sort()
        task.pinned = pinned_tensors(graph, task)
    return sorted(tasks.values(), key=lambda t: (t.wave, t.partition))


@dataclass(frozen=True)
class BackwardSplit:
    """A backward task's ops split by what waits for them (see `split_backward`).

    Attributes:
        b: ops on a path to a tensor another task waits for (the gradients
            of the task's inputs, which the previous stage needs), and ops
            that must keep their place (stateful ops, accesses of a resource
            the step writes): the critical path. Member and recomputed op
            indices, sorted.
        w: the other ops: they lead only to the step's outputs (the weight
            gradients), so they can run later, in a bubble.
        handoff: tensors B computes and W reads: kept from B until W runs.
        b_flops, w_flops: estimated flops of each part.
    """

    b: Tuple[int, ...]
    w: Tuple[int, ...]
    handoff: Tuple[int, ...]
    b_flops: float
    w_flops: float


def split_backward(graph: OpGraph, task: Task, tasks: Sequence[Task]) -> Optional[BackwardSplit]:
    """Splits a backward task into B (input gradients) and W (weight gradients).

    Derived from the graph alone: B is everything of the task (members and
    recomputed ops) that a tensor another task reads depends on, through
    data or control edges, plus every stateful op and every op on a
    resource the step writes (so state still advances once per micro-batch,
    in order), with what those depend on. W is the rest. Free ops copied
    into the task are copied wherever they are needed and belong to
    neither.

    Args:
        graph: the traced graph.
        task: a task of `tasks` (as `build_tasks` returns them).
        tasks: all tasks of the step: who reads what from `task`.

    Returns:
        The split, or None when `task` is not a backward task or W would
        do no work (nothing to move).
    """
    if not task.backward:
        return None
    own = set(task.members) | set(task.recomputed)
    critical = {t for other in tasks if other.key != task.key
                for t, producer in other.producer_of_input.items() if producer == task.key}
    written = {v for op in graph.ops for v in op.writes}
    seeds = [graph.tensors[t].producer for t in critical]
    seeds += [i for i in own if graph.ops[i].stateful or written.intersection(graph.ops[i].variables)]
    b: Set[int] = set()
    stack = [i for i in seeds if i in own]
    while stack:
        i = stack.pop()
        if i in b:
            continue
        b.add(i)
        op = graph.ops[i]
        stack.extend(j for j in [graph.tensors[t].producer for t in op.inputs] + list(op.control_inputs) if j in own)
    w = own - b
    w_flops = sum(graph.ops[i].flops for i in w)
    if w_flops <= 0:
        return None
    handoff = sorted({t for i in w for t in graph.ops[i].inputs if graph.tensors[t].producer in b})
    return BackwardSplit(
        b=tuple(sorted(b)), w=tuple(sorted(w)), handoff=tuple(handoff),
        b_flops=float(sum(graph.ops[i].flops for i in b)), w_flops=float(w_flops),
    )


def pinned_tensors(graph: OpGraph, task: Task) -> List[int]:
    """Tensors of `task` read by one op of the task but by several in the step.

    TensorFlow's graph optimiser rewrites arithmetic differently depending
    on how many ops read a tensor: it folds a chain of additions into one
    ``AddN`` (which rounds differently) and fuses an op into its reader only
    when that reader is the sole one. In the single-device graph a forward
    activation is read by its forward consumer and by its gradient; in a
    task that recomputes it, or in a forward task that no longer returns it
    because the backward recomputes it, only one reader is left, and the
    optimiser would rewrite that task's arithmetic in a way the single-device
    run did not. The lowering therefore gives each such tensor a second
    reader that costs nothing (a one-element slice returned by the task).

    Args:
        graph: the traced graph.
        task: a task of `build_tasks` (members, copies, recomputed ops and
            outputs set).

    Returns:
        Sorted tensor ids, produced by the task's members or recomputed ops,
        that exactly one op of the task reads, that the task does not return
        and that two or more ops of the traced graph read.
    """
    own = set(task.members) | set(task.copies) | set(task.recomputed)
    returned = set(task.outputs)
    out = []
    for i in sorted(set(task.members) | set(task.recomputed)):
        op = graph.ops[i]
        if op.kind != "op":
            continue
        for t in op.outputs:
            info = graph.tensors[t]
            if t in returned or not info.dtype.startswith(ROUNDING_DTYPES):
                continue
            readers = set(info.consumers)
            if len(readers) >= 2 and len(readers & own) == 1:
                out.append(t)
    return out


def task_specs(tasks: Sequence[Task], device_of_partition: Optional[Sequence[int]] = None) -> List[TaskSpec]:
    """The scheduling view of `tasks` (dependencies and relative costs).

    Args:
        tasks: the tasks.
        device_of_partition: the device number of each partition; None: the
            partition's own number (one partition per device).
    """
    total = sum(t.flops for t in tasks) or 1.0
    n = len(tasks)
    specs = []
    for t in tasks:
        deps = tuple(sorted(set(t.producer_of_input.values())))
        # Relative cost; a floor keeps near-empty tasks visible in the simulation.
        cost = max(t.flops / total * n, 0.05)
        device = None if device_of_partition is None else device_of_partition[t.partition]
        specs.append(TaskSpec(t.partition, t.wave, deps, cost=cost, kind=t.kind, device=device))
    return specs


def shared_squares(graph: OpGraph, task: Task, is_three: Callable[[int], bool]) -> Dict[int, int]:
    """Cubes of `task` whose gradient's square runs in another task.

    TensorFlow's graph optimiser computes ``x ** 3`` as ``x * square(x)``
    and the gradient's ``x ** (3 - 1)`` as ``square(x)``; in one function
    (the single-device step) the two squares are one op, which keeps the
    gradient op's name. The optimiser orders the operands of products by
    name, and reassociates ``c * (x * square(x))`` (GELU's tanh
    approximation) around the operand that sorts first, so the name of the
    square decides how the cube rounds. A forward task without the gradient
    names its square after the forward op, and rounds differently; the
    lowering names the forward op under the gradient op instead (see
    `task_graph_def`).

    Args:
        graph: the traced graph.
        task: a task (members and recomputed ops set).
        is_three: whether a tensor (by id) is the constant 3.

    Returns:
        Forward ``Pow`` op of the task -> its gradient's ``Pow`` (same base,
        exponent ``y - 1`` of the same ``y``), for those whose gradient
        ``Pow`` is not in the task and whose output the task does not
        return.
    """
    own = set(task.members) | set(task.recomputed)
    returned = set(task.outputs) | set(task.pinned)
    twins: Dict[int, int] = {}
    for i in sorted(own):
        op = graph.ops[i]
        if op.type != "Pow" or op.is_gradient or len(op.inputs) != 2 or not is_three(op.inputs[1]):
            continue
        if returned & set(op.outputs):
            continue
        base, exponent = op.inputs
        for c in graph.tensors[base].consumers:
            twin = graph.ops[c]
            if c in own or twin.type != "Pow" or not twin.is_gradient or twin.inputs[:1] != [base]:
                continue
            sub = graph.ops[graph.tensors[twin.inputs[1]].producer]
            if sub.type == "Sub" and sub.inputs[:1] == [exponent]:
                twins[i] = c
                break
    return twins


def _constant_equals(nodes, graph: OpGraph, tensor: int, value: float) -> bool:
    """Whether `tensor` is the output of a scalar ``Const`` node equal to `value`."""
    from tensorflow.python.framework import tensor_util

    node = nodes.get(graph.ops[graph.tensors[tensor].producer].name)
    if node is None or node.op != "Const":
        return False
    array = tensor_util.MakeNdarray(node.attr["value"].tensor)
    # Integers and floats (bfloat16 is not a numpy kind of its own).
    real = array.dtype.kind in "iuf" or "float" in array.dtype.name
    return real and array.size == 1 and float(array.reshape(())) == value


def _rename_nodes(graph_def, renames: Dict[str, str]) -> None:
    """Renames nodes of `graph_def` (old name -> new), and the inputs that read them."""
    for node in graph_def.node:
        if node.name in renames:
            node.name = renames[node.name]
        for k, x in enumerate(node.input):
            control = x.startswith("^")
            name, colon, port = x.lstrip("^").partition(":")
            if name in renames:
                node.input[k] = ("^" if control else "") + renames[name] + colon + port


def task_graph_def(graph_def, graph: OpGraph, task: Task, device: str, nodes=None):
    """The `GraphDef` of `task`: its members and copies, placed on `device`.

    ``device=""`` leaves every node without a device: imported into a
    function, the ops then run on the device of the function's call.
    Inputs produced by other tasks, and captured tensors other than
    variable handles, stay as references to nodes that are not in the
    result; the importer maps them (``input_map``). Control inputs
    from outside the task are dropped: the schedule orders tasks.
    `nodes` (name -> NodeDef of `graph_def`) may be passed to avoid
    rebuilding the index for every task.
    """
    from tensorflow.core.framework import graph_pb2

    if nodes is None:
        nodes = {n.name: n for n in graph_def.node}
    own = task.members + task.copies + task.recomputed
    names = {graph.ops[i].name for i in own}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    if len(graph_def.library.function):
        out.library.CopyFrom(graph_def.library)
    for i in sorted(own):
        if graph.ops[i].kind == "capture" and not graph.ops[i].variables:
            # Captured by the task function under this name (see lowering).
            continue
        src = nodes[graph.ops[i].name]
        if graph.ops[i].static_value is not None:
            _add_static_shape(out, src, graph.ops[i].static_value, device)
            continue
        node = out.node.add()
        node.CopyFrom(src)
        node.device = device
        if "_class" in node.attr:
            del node.attr["_class"]
        keep = [x for x in node.input if not x.startswith("^") or x[1:] in names]
        del node.input[:]
        node.input.extend(keep)
    # A cube whose gradient's square runs elsewhere takes a name under that
    # gradient op, so that the square the optimiser makes for it sorts as in
    # the single-device function (see `shared_squares`).
    twins = shared_squares(graph, task, lambda t: _constant_equals(nodes, graph, t, 3.0))
    if twins:
        _rename_nodes(out, {
            graph.ops[i].name: f"{graph.ops[j].name}/{graph.ops[i].name.rpartition('/')[2]}"
            for i, j in twins.items()
        })
    return out


def _int_const(graph_def, name: str, value, dtype: int, device: str) -> None:
    """Appends a ``Const`` node of int `dtype` holding `value` (an int or a tuple)."""
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

    node = graph_def.node.add()
    node.name = name
    node.op = "Const"
    node.device = device
    node.attr["dtype"].type = dtype
    tensor = tensor_pb2.TensorProto(dtype=dtype)
    values = list(value) if isinstance(value, tuple) else [value]
    if isinstance(value, tuple):
        tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(values))]))
    if dtype == types_pb2.DT_INT64:
        tensor.int64_val.extend(values)
    else:
        tensor.int_val.extend(values)
    node.attr["value"].tensor.CopyFrom(tensor)


def _add_static_shape(graph_def, src, value, device: str) -> None:
    """A shape op whose value is known (`OpNode.static_value`) as constants.

    ``Shape``, ``Size`` and ``Rank`` become a ``Const`` of the same name, as
    the graph optimiser materialises them in a single-device run. A
    ``ShapeN`` becomes an ``IdentityN`` of the same name over one constant
    per output, named as the optimiser names the ones it materialises; it
    forwards them to the consumers, which then read the same constants as
    in a single-device run.
    """
    from tensorflow.core.framework import types_pb2

    dtype = src.attr["out_type"].type if "out_type" in src.attr else types_pb2.DT_INT32
    if src.op != "ShapeN":
        _int_const(graph_def, src.name, value[0], dtype, device)
        return
    names = [f"ConstantFolding/{src.name}-matshapes-{k}" for k in range(len(value))]
    for name, v in zip(names, value):
        _int_const(graph_def, name, v, dtype, device)
    node = graph_def.node.add()
    node.name = src.name
    node.op = "IdentityN"
    node.device = device
    node.input.extend(names)
    node.attr["T"].list.type.extend([dtype] * len(names))
