"""A read-only view of a traced graph for the partitioner.

`OpGraph` is plain Python data: ops in a topological order of the data and
control edges, their input and output tensors with static byte sizes, an
estimated flop count per op, which variables each op touches and which it
may write, which Keras layer created it, and for each gradient op the forward
op it differentiates.

The order is creation order wherever that is already topological. It is not
always: TensorFlow's gradient of a ``tf.while_loop`` adds inputs to the
forward ``While`` op (the accumulators of the intermediates the gradient
needs) from ops created later. Such an op is *tied* to the ops that feed
those late inputs and to the consumers of the matching loop outputs (the
gradient loop): they belong together, like the ops of one layer.
The partitioner only ever sees an `OpGraph`, so it can be tested on graphs
written by hand (`OpGraph.from_spec`).

`from_tf_graph` reads a `tf.Graph` through its Python API (it never creates
ops and does not import TensorFlow).

Flop model (an estimate used only to balance partitions):

* ``MatMul`` / ``BatchMatMul*``: ``2 * prod(output) * K`` (K the contracted size,
  ``a[-2] * a[-1] / out[-2]``).
* ``Conv*D`` and both of their back-propagation ops: ``2 * prod(out) * kh * kw * cin``,
  where ``out`` is the forward output (the back-prop ops cost what the
  forward costs); depthwise: ``2 * prod(out) * kh * kw``.
* ``Einsum``: ``2 * prod(output) * prod(contracted sizes)`` from its
  equation; without one (or with an ellipsis)
  ``2 * prod(output) * sqrt(prod(a) * prod(b) / prod(output))``.
* Reductions (``Sum``, ``Mean``, ``Max``, ...): ``prod(input)``.
* Ops that only move or name data (``Identity``, ``Reshape``, ``ReadVariableOp``,
  ``Const``, ``Placeholder``, ``Shape``, ...): 0.
* Everything else (element-wise and the rest): ``prod(output)``.

Unknown dimensions count as 1.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "OpNode",
    "TensorInfo",
    "OpGraph",
    "estimate_flops",
    "from_tf_graph",
    "forward_name_of_gradient",
    "free_op_flags",
    "static_shape_value",
    "strongly_connected",
]

Shape = Optional[Tuple[Optional[int], ...]]

_ZERO_COST = frozenset(
    """Const Placeholder PlaceholderWithDefault Identity IdentityN Reshape ReadVariableOp
    VarHandleOp VariableShape Shape ShapeN Size Rank NoOp StopGradient Squeeze ExpandDims
    AssignVariableOp _Arg _Retval ZerosLike OnesLike Snapshot PreventGradient
    EnsureShape BroadcastArgs BroadcastGradientArgs""".split()
)
_REDUCTIONS = frozenset("Sum Mean Max Min Prod All Any ArgMax ArgMin".split())
_CONV = frozenset(["Conv2D", "Conv3D", "Conv1D"])
_CONV_BACKPROP = frozenset(
    ["Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"]
)
_DEPTHWISE = frozenset(
    ["DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"]
)

# Gradient ops are created by tf.GradientTape under "gradient_tape/<forward
# op scope>/" and by tf.gradients under "gradients/<forward op>_grad/".
_TAPE_PREFIX = re.compile(r"^gradient_tape(?:_\d+)?/")
_GRADIENTS_PREFIX = re.compile(r"^gradients(?:_\d+)?/")


def _prod(shape: Shape) -> int:
    if shape is None:
        return 1
    n = 1
    for d in shape:
        n *= 1 if d is None or d < 0 else d
    return n


def estimate_flops(
    op_type: str, input_shapes: Sequence[Shape], output_shapes: Sequence[Shape], equation: Optional[str] = None
) -> float:
    """Estimated floating point operations of one op (see the module doc);
    `equation`: an ``Einsum``'s, which gives its exact count."""
    if op_type in _ZERO_COST:
        return 0.0
    out = output_shapes[0] if output_shapes else None
    if op_type in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = input_shapes[0] if input_shapes else None
        k = 1.0
        # a's matrix is M x K or K x M (transposed) and M = out[-2], so
        # K = a[-2] * a[-1] / out[-2], whatever the transposes and however
        # the batch dimensions broadcast.
        if a is not None and out is not None and len(a) >= 2 and len(out) >= 2:
            k = max(_prod(a[-2:]) / max(_prod(out[-2:-1]), 1), 1.0)
        return 2.0 * _prod(out) * k
    if op_type in _CONV:
        f = input_shapes[1] if len(input_shapes) > 1 else None
        per_out = _prod(f[:-1]) if f else 1
        return 2.0 * _prod(out) * per_out
    if op_type in _CONV_BACKPROP:
        # Inputs: (input or input_sizes, filter or filter_sizes, out_backprop).
        f = input_shapes[1] if op_type.endswith("Input") or op_type.endswith("InputV2") else output_shapes[0]
        out_bp = input_shapes[2] if len(input_shapes) > 2 else None
        per_out = _prod(f[:-1]) if f else 1
        return 2.0 * _prod(out_bp) * per_out
    if op_type in _DEPTHWISE:
        if op_type == "DepthwiseConv2dNative":
            f, o = (input_shapes[1] if len(input_shapes) > 1 else None), out
        elif op_type.endswith("Input"):
            f, o = input_shapes[1] if len(input_shapes) > 1 else None, (input_shapes[2] if len(input_shapes) > 2 else None)
        else:
            f, o = output_shapes[0], (input_shapes[2] if len(input_shapes) > 2 else None)
        per_out = _prod(f[:2]) if f else 1
        return 2.0 * _prod(o) * per_out
    if op_type == "Einsum" and len(input_shapes) >= 2 and equation:
        exact = _einsum_flops(equation, input_shapes, out)
        if exact is not None:
            return exact
    if op_type == "Einsum" and len(input_shapes) >= 2:
        k = math.sqrt(max(_prod(input_shapes[0]) * _prod(input_shapes[1]) / max(_prod(out), 1), 1.0))
        return 2.0 * _prod(out) * k
    if op_type in _REDUCTIONS:
        return float(_prod(input_shapes[0])) if input_shapes else 0.0
    return float(sum(_prod(s) for s in output_shapes))


def _einsum_equation(op: Any) -> Optional[str]:
    """An ``Einsum`` op's equation (None for other ops)."""
    if op.type != "Einsum":
        return None
    try:
        eq = op.get_attr("equation")
    except (ValueError, AttributeError):
        return None
    return eq.decode() if isinstance(eq, bytes) else eq


def _einsum_flops(equation: str, input_shapes: Sequence[Shape], out: Shape) -> Optional[float]:
    """``2 * prod(output) * prod(contracted sizes)`` of an einsum of two
    operands whose shapes are known; None otherwise (an ellipsis, a shape
    not known, or labels that do not match the shapes)."""
    if "..." in equation or "->" not in equation or out is None:
        return None
    lhs, result = equation.replace(" ", "").split("->")
    operands = lhs.split(",")
    if len(operands) != len(input_shapes):
        return None
    size: Dict[str, int] = {}
    for labels, shape in zip(operands, input_shapes):
        if shape is None or len(labels) != len(shape) or any(d is None for d in shape):
            return None
        for label, d in zip(labels, shape):
            size[label] = max(size.get(label, 1), int(d))
    contracted = [size[c] for c in size if c not in result]
    return 2.0 * _prod(out) * float(_prod(contracted) if contracted else 1)


@dataclass
class TensorInfo:
    """One tensor: produced by op `producer` at output `index`."""

    id: int
    producer: int
    index: int
    bytes: int
    dtype: str = "float32"
    shape: Shape = None
    consumers: List[int] = field(default_factory=list)

    @property
    def elements(self) -> int:
        """Number of elements (unknown dimensions count as 1)."""
        return _prod(self.shape)


@dataclass
class OpNode:
    """One op of the traced graph.

    Attributes:
        index: position in the graph's topological order.
        inputs: tensor ids of the data inputs.
        outputs: tensor ids of the outputs.
        control_inputs: op indices this op has control edges from.
        variables: keys of the variables whose handle this op takes.
        writes: the subset of `variables` the op may write (everything but
            reads; a function call or loop writes what its body writes).
        layer: key of the Keras layer that created it (None if none).
        call: key of the call of that layer that created it (a layer called
            twice, like a tied embedding used as the output projection, has
            two); None when unknown, then `layer` stands for it.
        glue: created directly by a layer call that also called other layers
            (a composite layer's residual additions, gating products and
            masks, between the calls of its sublayers).
        forward: for a gradient op, the index of the forward op it belongs to.
        colocate_with: op names TensorFlow asks to colocate with (``_class``).
        manual_partition: partition of the enclosing `smp.partition` block.
        kind: ``"op"``, ``"arg"`` (step argument) or ``"capture"``
            (captured tensor or variable handle).
        tied: op indices that must share this op's partition (a loop and
            the accumulators its gradient added, see the module doc).
        compiled: a function call that XLA compiles (``_XlaMustCompile``;
            Keras runs grouped convolutions so on TensorFlow, and their
            gradient with them): its memory is XLA's, not that of the ops
            of its function.
        static_value: for a ``Shape``, ``ShapeN``, ``Size`` or ``Rank`` of
            tensors whose shapes are fully known, the value of each output
            (a tuple of ints, or an int). Such an op is a constant: it has
            no data inputs in the view, and every task that needs it gets
            the constant (see `static_shape_value`).
    """

    index: int
    name: str
    type: str
    inputs: List[int] = field(default_factory=list)
    outputs: List[int] = field(default_factory=list)
    control_inputs: List[int] = field(default_factory=list)
    flops: float = 0.0
    variables: Tuple[str, ...] = ()
    writes: Tuple[str, ...] = ()
    layer: Optional[str] = None
    call: Optional[str] = None
    glue: bool = False
    forward: Optional[int] = None
    is_gradient: bool = False
    stateful: bool = False
    colocate_with: Tuple[str, ...] = ()
    manual_partition: Optional[int] = None
    kind: str = "op"
    tied: Tuple[int, ...] = ()
    static_value: Optional[Tuple[Any, ...]] = None
    compiled: bool = False


class OpGraph:
    """Plain-data view of a traced graph (see the module doc)."""

    def __init__(
        self,
        ops: List[OpNode],
        tensors: List[TensorInfo],
        variable_bytes: Mapping[str, int],
        trainable: Optional[Mapping[str, bool]] = None,
    ) -> None:
        self.ops = ops
        self.tensors = tensors
        self.variable_bytes: Dict[str, int] = dict(variable_bytes)
        self.trainable: Dict[str, bool] = dict(trainable or {k: True for k in variable_bytes})
        self.op_index: Dict[str, int] = {op.name: op.index for op in ops}
        self._consumers_of_op: Optional[List[List[int]]] = None

    def __len__(self) -> int:
        return len(self.ops)

    def op(self, name: str) -> OpNode:
        """Returns the op called `name`."""
        try:
            return self.ops[self.op_index[name]]
        except KeyError:
            raise KeyError(f"No op named {name!r} in this graph.") from None

    def input_ops(self, index: int) -> List[int]:
        """Producer op indices of op `index`'s data inputs."""
        return [self.tensors[t].producer for t in self.ops[index].inputs]

    def consumer_ops(self, index: int) -> List[int]:
        """Op indices that consume any output of op `index`."""
        if self._consumers_of_op is None:
            cons: List[List[int]] = [[] for _ in self.ops]
            for t in self.tensors:
                cons[t.producer].extend(t.consumers)
            self._consumers_of_op = cons
        return self._consumers_of_op[index]

    def tensor_name(self, tid: int) -> str:
        t = self.tensors[tid]
        return f"{self.ops[t.producer].name}:{t.index}"

    @property
    def total_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @classmethod
    def from_spec(
        cls,
        spec: Sequence[Mapping[str, Any]],
        variable_bytes: Optional[Mapping[str, int]] = None,
    ) -> "OpGraph":
        """Builds a graph by hand, for tests and examples.

        Each entry is a dict with ``name`` and optional ``type`` (default
        ``"Op"``), ``inputs`` (op names; each op has one output tensor),
        ``bytes`` (size of its output, default 4), ``shape`` and ``dtype``
        of its output (default unknown, ``"float32"``), ``flops`` (default 1),
        ``variables``, ``writes`` (variables it writes; they are added to
        ``variables``), ``layer``, ``call`` (which call of the layer),
        ``forward`` (name of the forward op, marks
        a gradient op), ``colocate_with``, ``manual_partition``, ``kind``,
        ``stateful`` (default: true when it writes), ``control_inputs``,
        ``tied`` (names of earlier ops it is tied to), ``compiled`` (an XLA
        compiled call).
        """
        ops: List[OpNode] = []
        tensors: List[TensorInfo] = []
        index: Dict[str, int] = {}
        for i, s in enumerate(spec):
            name = s["name"]
            if name in index:
                raise ValueError(f"Duplicate op name {name!r} in graph spec.")
            missing = [n for n in s.get("inputs", ()) if n not in index]
            if missing:
                raise ValueError(
                    f"Op {name!r} uses {missing} before they are defined; list ops in creation order."
                )
            op = OpNode(
                index=i,
                name=name,
                type=s.get("type", "Op"),
                inputs=[index[n] for n in s.get("inputs", ())],  # output tensor id == op index
                outputs=[i],
                control_inputs=[index[n] for n in s.get("control_inputs", ())],
                flops=float(s.get("flops", 1.0)),
                variables=tuple(dict.fromkeys(tuple(s.get("variables", ())) + tuple(s.get("writes", ())))),
                writes=tuple(s.get("writes", ())),
                layer=s.get("layer"),
                call=s.get("call"),
                glue=bool(s.get("glue", False)),
                forward=index[s["forward"]] if s.get("forward") else None,
                is_gradient=bool(s.get("forward")) or bool(s.get("is_gradient", False)),
                stateful=bool(s.get("stateful", bool(s.get("writes")))),
                colocate_with=tuple(s.get("colocate_with", ())),
                manual_partition=s.get("manual_partition"),
                kind=s.get("kind", "op"),
                tied=tuple(index[n] for n in s.get("tied", ())),
                compiled=bool(s.get("compiled", False)),
            )
            ops.append(op)
            shape = tuple(s["shape"]) if s.get("shape") is not None else None
            tensors.append(TensorInfo(id=i, producer=i, index=0, bytes=int(s.get("bytes", 4)),
                                      dtype=str(s.get("dtype", "float32")), shape=shape))
            for t in op.inputs:
                tensors[t].consumers.append(i)
            index[name] = i
        vb = dict(variable_bytes or {})
        for op in ops:
            for v in op.variables:
                vb.setdefault(v, 4)
        return cls(ops, tensors, vb)


def _xla_compiled(op: Any) -> bool:
    """Whether `op` is a function call that XLA compiles (``jit_compile=True``)."""
    attr = op.node_def.attr
    return "_XlaMustCompile" in attr and bool(attr["_XlaMustCompile"].b)


def forward_name_of_gradient(name: str) -> Optional[str]:
    """The forward scope a gradient op name points at, or None for forward ops.

    ``gradient_tape/model/dense/MatMul/MatMul_1`` -> ``model/dense/MatMul``;
    ``gradients/dense/MatMul_grad/MatMul`` -> ``dense/MatMul``.
    """
    m = _TAPE_PREFIX.match(name)
    if m:
        rest = name[m.end():]
        return rest.rsplit("/", 1)[0] if "/" in rest else ""
    m = _GRADIENTS_PREFIX.match(name)
    if m:
        parts = name[m.end():].split("/")[:-1]
        return "/".join(p[: -len("_grad")] if p.endswith("_grad") else p for p in parts)
    return None


def _fed_by(cands: List[int], producers: set, ops: List[OpNode], readers_of: Dict[int, List[int]]) -> List[int]:
    """Of `cands` (forward ops of one scope), those whose outputs the layer
    calls that sent a gradient op its incoming gradients read.

    `producers` are the ops the gradient op reads; the gradient ops among
    them are linked to forward ops of the layer calls downstream.
    """
    calls = {ops[ops[p].forward].call or ops[ops[p].forward].layer for p in producers
             if ops[p].is_gradient and ops[p].forward is not None}
    calls.discard(None)
    if not calls:
        return []
    own = {ops[c].call or ops[c].layer for c in cands}
    if calls & own:
        return []  # the gradient comes from within the scope's own layer call: `via` decides
    return [c for c in cands
            if any((ops[r].call or ops[r].layer) in calls and not ops[r].is_gradient for r in readers_of.get(c, ()))]


def _shared_reader(op: OpNode, cands: set, ops: List[OpNode], tensors: List[TensorInfo]) -> Optional[int]:
    """The one op of `cands` (forward ops of one scope) that reads a computed
    forward value `op` (a gradient op) reads, or None if there is not
    exactly one.

    Values that nothing computes (constants, step arguments, captures) do not
    count: a scope's ops share them without being related.
    """
    found = set()
    for t in op.inputs:
        if _computes_forward_value(ops[tensors[t].producer]):
            found.update(c for c in tensors[t].consumers if c in cands)
    return found.pop() if len(found) == 1 else None


def free_op_flags(ops: Sequence[OpNode], tensors: Sequence[TensorInfo]) -> List[bool]:
    """For each op (in creation order), whether it depends only on constants
    and step arguments: stateless, touching no variable, every data input
    free (step-argument placeholders and captured constants are free)."""
    free = [False] * len(ops)
    for op in ops:
        if op.kind == "arg":
            free[op.index] = True
            continue
        if op.stateful or op.variables:
            continue
        if op.kind == "capture":  # a captured constant tensor
            free[op.index] = True
            continue
        free[op.index] = all(free[tensors[t].producer] for t in op.inputs)
    return free


def _computes_forward_value(op: OpNode) -> bool:
    """`op` is a forward op that computes its output (not a constant, a step
    argument or a capture)."""
    return not op.is_gradient and op.kind == "op" and bool(op.inputs)


def _through_sums(producers: set, ops: List[OpNode], tensors: List[TensorInfo], first_gradient: Optional[int]) -> set:
    """`producers` with each sum of gradient contributions among them replaced
    by its terms.

    The tape adds up the gradients that reach one forward tensor from several
    readers in an ``AddN`` named outside every gradient scope, which is only
    recognised as a gradient op later. Its terms are gradient ops whose
    forward ops read that tensor: they tell which op of a scope a gradient
    op reading the sum differentiates (the reshape whose output a
    mixture-of-experts block's router and experts both read).
    """
    out: set = set()
    seen = set(producers)
    stack = list(producers)
    while stack:
        p = stack.pop()
        op = ops[p]
        if op.type == "AddN" and not op.is_gradient and first_gradient is not None and p > first_gradient:
            terms = {tensors[t].producer for t in op.inputs}
            if any(ops[q].is_gradient or ops[q].type == "AddN" for q in terms):
                stack.extend(terms - seen)
                seen |= terms
                continue
        out.add(p)
    return out


def _link_gradients(ops: List[OpNode], tensors: List[TensorInfo]) -> None:
    """Marks gradient ops and sets their `forward` op (see module doc).

    Gradient ops are found by name. The tape also sums the gradients that
    reach one forward tensor from several consumers (``AddN``) outside any
    gradient scope, and a custom gradient (``tf.custom_gradient``, e.g.
    TensorFlow's swish, which Keras uses) builds its ops under no scope at
    all; swish's recomputes ``sigmoid(x)`` from the forward ``x`` after a
    control edge from the incoming gradient. So an op after the first
    gradient op, in no layer, that reads a gradient op or such an op
    (through a data or a control edge), or that only such ops read, is one
    too: it belongs to the forward op its consumer differentiates, else to
    the earliest one its inputs differentiate. (Left as forward ops, they
    would follow the whole forward pass, on the last partition, and every
    backward would cross to it and back.)
    """
    by_name: Dict[str, int] = {}
    by_scope: Dict[str, List[int]] = {}
    first_gradient = None
    # Gradient ops linked through their readers, to one of these forward ops.
    in_scope: Dict[int, List[int]] = {}
    for op in ops:
        if forward_name_of_gradient(op.name) is None:
            by_name[op.name] = op.index
            by_scope.setdefault(op.name.rsplit("/", 1)[0] if "/" in op.name else "", []).append(op.index)
        elif first_gradient is None:
            first_gradient = op.index
    consumers: Dict[int, List[int]] = {}
    for op in ops:
        for t in op.inputs:
            consumers.setdefault(tensors[t].producer, []).append(op.index)
    free = free_op_flags(ops, tensors)
    for op in ops:
        scope = forward_name_of_gradient(op.name)
        if scope is None:
            continue
        op.is_gradient = True
        producers = {tensors[t].producer for t in op.inputs}
        # The root scope names no forward op: tf.gradients puts its gradient
        # sums there (``gradients/AddN_3``); they are linked below, through
        # their consumers, like the tape's sums.
        while scope:
            if scope in by_name and by_name[scope] < op.index:
                op.forward = by_name[scope]
                break
            # Only ops created before the gradient op can be what it differentiates.
            cands = [c for c in by_scope.get(scope, ()) if c < op.index]
            if cands:
                # Prefer a forward op it reads, then what its gradient inputs
                # in the same scope differentiate. Failing both, the scope
                # alone does not tell which of its ops this one differentiates
                # (a concatenation's gradient slices read only the incoming
                # gradient and constants): it is linked below, through the ops
                # that read it, to one of the scope's ops, else to the scope's
                # newest op.
                direct = [c for c in cands if c in producers]
                cand_set = set(cands)
                # A producer computed from constants only (a permutation or
                # a shape, copied into every task that reads it) carries no
                # gradient, and its link comes from the tape's names alone:
                # where a producer that carries the incoming gradient points
                # at an op of the scope, that one decides (the transposes
                # undoing a gather along a later axis read such a
                # permutation). Otherwise its link is the best hint left.
                linked = [p for p in sorted(producers) if ops[p].is_gradient and ops[p].forward in cand_set]
                via = [ops[p].forward for p in ([p for p in linked if not free[p]] or linked)]
                # Its incoming gradient is that of the outputs of the op it
                # differentiates, and comes from the layer calls that read
                # them: of a product ``z = a * b`` glued in a layer's scope,
                # ``dz * b`` reads ``b``, but belongs with ``z``, which the
                # layer that sent ``dz`` reads (with ``b`` made on another
                # partition, linking it to ``b`` sends the backward there
                # and back). When the incoming gradient is the tape's sum of
                # several contributions, their senders count.
                fed = [] if via else _fed_by(cands, _through_sums(producers, ops, tensors, first_gradient),
                                             ops, consumers)
                # But the senders can be many: the tape's sum for a residual
                # stream gathers contributions from the block's own layers
                # and from later blocks, and `fed` then names the scope's
                # last op. ``dz * b`` also reads ``b``, as ``z`` does: when
                # exactly one op of the scope reads a computed value this
                # gradient op reads, that op is the one it differentiates.
                shared = _shared_reader(op, cand_set, ops, tensors) if fed else None
                if via:
                    op.forward = direct[-1] if direct else via[-1]
                elif shared is not None:
                    op.forward = shared
                elif fed or direct:
                    op.forward = fed[-1] if fed else direct[-1]
                elif op.inputs:
                    in_scope[op.index] = cands
                # (A constant differentiates nothing: it is free, copied to
                # every task that reads it.)
                break
            scope = scope.rsplit("/", 1)[0] if "/" in scope else ""
    if first_gradient is None:
        return
    # In topological order, so one pass finds the ops that read such ops;
    # one pass in reverse finds those that only such ops read (a custom
    # gradient recomputing ``sigmoid(x)`` from the forward ``x``).
    backward = [op.is_gradient for op in ops]
    late_index = set()
    for op in ops[first_gradient:]:
        if op.is_gradient:
            if op.forward is None and op.inputs:
                late_index.add(op.index)
        elif op.layer is None and (
            any(backward[tensors[t].producer] for t in op.inputs) or any(backward[c] for c in op.control_inputs)
        ):
            late_index.add(op.index)
            backward[op.index] = True
    readers: Dict[int, List[int]] = {i: list(c) for i, c in consumers.items()}
    for op in ops:
        for c in op.control_inputs:
            readers.setdefault(c, []).append(op.index)
    for op in reversed(ops[first_gradient:]):
        if backward[op.index] or op.layer is not None or op.kind != "op" or not op.inputs:
            continue  # (an op without inputs is free: every task that needs it gets a copy)
        users = readers.get(op.index)
        if users and all(backward[u] for u in users):
            late_index.add(op.index)
            backward[op.index] = True
    late = [ops[i] for i in sorted(late_index)]
    for op in late:
        op.is_gradient = True
    for op in reversed(late):
        fwd = [ops[c].forward for c in consumers.get(op.index, ()) if ops[c].forward is not None]
        if op.index in in_scope:
            # The first reader's forward op that is one of its scope's; a
            # gradient op never leaves the layer its name says it belongs to.
            allowed = set(in_scope[op.index])
            fwd = [f for f in fwd if f in allowed] or [in_scope[op.index][-1]]
        op.forward = fwd[0] if fwd else None
    for op in late:
        if op.forward is None:
            # Nothing reads it (a custom gradient's gradient for a constant,
            # like swish's beta): it reads the gradient coming from a later
            # layer and values of the layer it differentiates, the earliest.
            fwd = []
            for t in op.inputs:
                src = ops[tensors[t].producer]
                if src.forward is not None:
                    fwd.append(src.forward)
                elif _computes_forward_value(src):
                    fwd.append(src.index)
            op.forward = min(fwd) if fwd else None


#: Ops whose outputs are functions of their inputs' shapes only.
_SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def static_shape_value(op_type: str, input_shapes: Sequence[Shape], input_dtypes: Sequence[str]) -> Optional[Tuple[Any, ...]]:
    """The outputs of a shape op whose inputs' shapes are fully known, else None.

    The graph optimiser folds such ops into constants in a single-device
    run; a pipeline task must see the same constants rather than receive
    the value from another task as an argument it knows nothing about, or
    it folds, and therefore rounds, differently.

    Returns:
        One value per output: a tuple of ints for ``Shape``/``ShapeN``, an
        int for ``Size`` and ``Rank``.
    """
    if op_type not in _SHAPE_OPS or not input_shapes:
        return None
    for shape, dtype in zip(input_shapes, input_dtypes):
        # A resource's or variant's shape is that of the handle, not of its value.
        if shape is None or any(d is None for d in shape) or dtype in ("resource", "variant"):
            return None
    if op_type == "Shape":
        return (tuple(input_shapes[0]),)
    if op_type == "ShapeN":
        return tuple(tuple(s) for s in input_shapes)
    if op_type == "Size":
        return (_prod(input_shapes[0]),)
    return (len(input_shapes[0]),)


def _shape_of(t: Any) -> Shape:
    try:
        dims = t.shape.as_list()
    except ValueError:  # unknown rank
        return None
    return tuple(dims)


def _bytes_of(dtype: Any, shape: Shape) -> int:
    if dtype.name in ("resource", "variant", "string"):
        return 0
    return _prod(shape) * dtype.size


#: Ops that take a resource handle and only read the resource (or its shape).
_RESOURCE_READS = frozenset(
    """ReadVariableOp VariableShape ResourceGather ResourceGatherNd VarIsInitializedOp
    _ReadVariablesOp""".split()
)
#: Ops that pass a resource handle on unchanged (output i is input i).
_RESOURCE_PASS = frozenset(["Identity", "IdentityN"])
#: ``DT_RESOURCE`` in TensorFlow's ``types.proto``.
_DT_RESOURCE = 20


#: Ops whose inputs reach the arguments of the functions they call.
_CALL_OPS = frozenset(
    "While StatelessWhile If StatelessIf Case StatelessCase PartitionedCall StatefulPartitionedCall".split()
)


def _callees(op_type: str, attr: Any, position: int, is_function: Callable[[str], bool]) -> Optional[List[Tuple[str, int]]]:
    """(function name, argument index) pairs that input `position` of a call
    or control-flow op reaches, or None if the op calls no function."""
    def fn(key):
        return attr[key].func.name if key in attr else None

    if op_type in ("While", "StatelessWhile"):
        return [(f, position) for f in (fn("body"), fn("cond")) if f]
    if op_type in ("If", "StatelessIf"):
        if position == 0:
            return []  # the predicate
        return [(f, position - 1) for f in (fn("then_branch"), fn("else_branch")) if f]
    if op_type in ("Case", "StatelessCase"):
        if position == 0:
            return []  # the branch index
        branches = attr["branches"].list.func if "branches" in attr else []
        return [(b.name, position - 1) for b in branches]
    if op_type in ("PartitionedCall", "StatefulPartitionedCall"):
        return [(fn("f"), position)] if fn("f") else None
    if is_function(op_type):  # a direct call of a library function
        return [(op_type, position)]
    return None


class _ResourceWrites:
    """Which resource inputs an op may write, reading the `FunctionDef`s of
    the functions it calls (and those they call). Unknown functions count as
    writing every resource they take.

    Args:
        functions: function name -> `FunctionDef` (or None if unknown); only
            called for ops that call functions.
    """

    def __init__(self, functions: Callable[[str], Any]) -> None:
        self.functions = functions
        self._memo: Dict[str, frozenset] = {}

    def op_writes(self, op_type: str, attr: Any, position: int) -> bool:
        """Whether input `position` (a resource) of an op may be written by it."""
        if op_type in _RESOURCE_READS:
            return False
        callees = _callees(op_type, attr, position, lambda name: self.functions(name) is not None)
        if callees is None:
            return True
        return any(pos in self.written_args(name) for name, pos in callees)

    def written_args(self, name: str) -> frozenset:
        if name in self._memo:
            return self._memo[name]
        fdef = self.functions(name)
        if fdef is None:
            return frozenset(range(10_000))
        self._memo[name] = frozenset()  # recursion guard (recursive functions)
        alias = {a.name: i for i, a in enumerate(fdef.signature.input_arg) if a.type == _DT_RESOURCE}
        written = set()
        changed = True
        while changed:  # node_def is not in topological order: iterate to a fixpoint
            changed = False
            for node in fdef.node_def:
                for position, ref in enumerate(node.input):
                    arg = alias.get(ref)
                    if arg is None:
                        continue
                    if node.op in _RESOURCE_PASS:
                        out = f"{node.name}:output:{position if node.op == 'IdentityN' else 0}"
                        if out not in alias:
                            alias[out] = arg
                            changed = True
                    elif arg not in written and self.op_writes(node.op, node.attr, position):
                        written.add(arg)
                        changed = True
        self._memo[name] = frozenset(written)
        return self._memo[name]


def _function_defs(graph: Any) -> Callable[[str], Any]:
    """Name -> `FunctionDef` of the functions of `graph` (None if unknown)."""
    cache: Dict[str, Any] = {}
    library: List[Optional[Dict[str, Any]]] = [None]

    def get(name: str) -> Any:
        if name in cache:
            return cache[name]
        fdef = None
        getter = getattr(graph, "_get_function", None)
        f = getter(name) if getter is not None else None
        if f is not None:
            fdef = getattr(f, "definition", None)
        elif getter is None:
            if library[0] is None:
                library[0] = {d.signature.name: d for d in graph.as_graph_def().library.function}
            fdef = library[0].get(name)
        cache[name] = fdef
        return fdef

    return get


def _topological_order(tf_ops: Sequence[Any]) -> List[Any]:
    """`tf_ops` in a topological order of data and control edges that keeps
    creation order wherever creation order allows (Kahn's algorithm with the
    creation position as priority)."""
    created = {op.name: i for i, op in enumerate(tf_ops)}

    def deps_of(op: Any) -> set:
        deps = {created[t.op.name] for t in op.inputs if t.op.name in created}
        return deps | {created[c.name] for c in op.control_inputs if c.name in created}

    all_deps = [deps_of(op) for op in tf_ops]
    late = any(d > i for i, deps in enumerate(all_deps) for d in deps)
    if not late:
        return list(tf_ops)
    waiting = [0] * len(tf_ops)
    users: List[List[int]] = [[] for _ in tf_ops]
    for i, deps in enumerate(all_deps):
        waiting[i] = len(deps)
        for d in deps:
            users[d].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(tf_ops[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(tf_ops):
        stuck = [tf_ops[i].name for i, w in enumerate(waiting) if w > 0][:5]
        raise ValueError(f"The traced graph has a cycle through {stuck}; it cannot be partitioned.")
    return order


def from_tf_graph(
    graph: Any,
    *,
    arg_ops: Iterable[str] = (),
    captured_variables: Optional[Mapping[str, Tuple[str, int, bool]]] = None,
    captured_ops: Optional[Iterable[str]] = None,
    layer_of: Optional[Callable[[Any], Optional[str]]] = None,
    layer_call_of: Optional[Callable[[Any], Optional[str]]] = None,
    glue_of: Optional[Callable[[Any], bool]] = None,
    manual_partition_of: Optional[Callable[[Any], Optional[int]]] = None,
    graph_def: Any = None,
) -> OpGraph:
    """Reads a `tf.Graph` (or `FuncGraph`) into an `OpGraph`.

    Ops are indexed in a topological order (see the module doc), whatever
    order they were created in.

    Args:
        graph: the traced graph.
        arg_ops: names of the placeholders of the step's arguments.
        captured_variables: placeholder op name -> (variable key, bytes,
            trainable) for captured variable handles.
        captured_ops: names of the ops that hold captured tensors. A small
            captured eager tensor is a ``Const`` op that is also an input of
            the function (its value is passed when the function is called),
            a larger one a ``Placeholder``. Default: every ``Placeholder``
            that is not a step argument.
        layer_of: op -> key of the Keras layer that created it.
        layer_call_of: op -> key of the layer call that created it.
        glue_of: op -> whether it is the glue of a composite layer call
            (`OpNode.glue`).
        manual_partition_of: op -> partition of its `smp.partition` block.
        graph_def: ``graph.as_graph_def()``, if the caller has it.
    """
    arg_ops = set(arg_ops)
    # Colocation attributes, read from the NodeDefs: asking every op for an
    # attribute it mostly lacks costs an exception each.
    if graph_def is None:
        graph_def = graph.as_graph_def()
    colocation = {n.name: list(n.attr["_class"].list.s) for n in graph_def.node if "_class" in n.attr}
    captured_variables = dict(captured_variables or {})
    captured_ops = None if captured_ops is None else set(captured_ops)
    created_ops = graph.get_operations()
    created = {op.name: i for i, op in enumerate(created_ops)}
    tf_ops = _topological_order(created_ops)
    op_index = {op.name: i for i, op in enumerate(tf_ops)}
    ops: List[OpNode] = []
    tensors: List[TensorInfo] = []
    tensor_id: Dict[str, int] = {}
    variable_bytes: Dict[str, int] = {}
    trainable: Dict[str, bool] = {}
    # Resource tensors are followed through Identity-like ops to the variable.
    var_of_tensor: Dict[int, str] = {}
    resource_writes: Optional[_ResourceWrites] = None
    ties: List[Tuple[int, int]] = []

    for i, op in enumerate(tf_ops):
        static = (
            static_shape_value(op.type, [_shape_of(t) for t in op.inputs], [t.dtype.name for t in op.inputs])
            if op.type in _SHAPE_OPS else None
        )
        # A shape known when tracing is a constant: the op reads no tensor.
        in_ids = [] if static is not None else [tensor_id[t.name] for t in op.inputs]
        out_ids = []
        out_shapes = []
        for j, t in enumerate(op.outputs):
            shape = _shape_of(t)
            tid = len(tensors)
            tensors.append(TensorInfo(tid, i, j, _bytes_of(t.dtype, shape), t.dtype.name, shape))
            tensor_id[t.name] = tid
            out_ids.append(tid)
            out_shapes.append(shape)
        for tid in in_ids:
            tensors[tid].consumers.append(i)

        kind = "op"
        variables: List[str] = []
        writes: List[str] = []
        if op.type == "Placeholder":
            if op.name in captured_variables:
                key, nbytes, train = captured_variables[op.name]
                variable_bytes[key] = nbytes
                trainable[key] = train
                var_of_tensor[out_ids[0]] = key
                variables.append(key)
                kind = "capture"
            elif op.name in arg_ops:
                kind = "arg"
            elif captured_ops is None or op.name in captured_ops:
                kind = "capture"
        elif captured_ops is not None and op.name in captured_ops:
            # A captured constant: the function reads it as an argument, so
            # the graph optimiser cannot fold it, and neither may a task.
            kind = "capture"
        elif op.type in ("VarHandleOp",):
            key = op.get_attr("shared_name").decode() or op.name
            try:
                shape = tuple(op.get_attr("shape").dim[k].size for k in range(len(op.get_attr("shape").dim)))
            except Exception:  # pragma: no cover - exotic shape attrs
                shape = None
            variable_bytes[key] = _bytes_of(op.get_attr("dtype"), shape)
            trainable[key] = True
            var_of_tensor[out_ids[0]] = key
            variables.append(key)
        for position, tid in enumerate(in_ids):
            key = var_of_tensor.get(tid)
            if key is None:
                continue
            if key not in variables:
                variables.append(key)
            if op.type in _RESOURCE_PASS or key in writes:
                continue
            if resource_writes is None:
                resource_writes = _ResourceWrites(_function_defs(graph))
            if resource_writes.op_writes(op.type, op.node_def.attr, position):
                writes.append(key)
        if op.type in _RESOURCE_PASS and op.outputs and variables:
            for position, tid in enumerate(out_ids):
                if tensors[tid].dtype == "resource":
                    source = in_ids[position] if op.type == "IdentityN" and position < len(in_ids) else in_ids[0]
                    var_of_tensor[tid] = var_of_tensor.get(source, variables[0])

        # Inputs added after the op was created (a while loop's gradient
        # accumulators): tie the op to their producers and, for a loop, to
        # the consumers of the matching outputs (the gradient loop).
        me = created[op.name]
        for position, t in enumerate(op.inputs):
            if created.get(t.op.name, -1) > me:
                ties.append((i, op_index[t.op.name]))
                if op.type in ("While", "StatelessWhile") and position < len(op.outputs):
                    for c in op.outputs[position].consumers():
                        if c.name in op_index:
                            ties.append((i, op_index[c.name]))

        try:
            stateful = bool(op.op_def.is_stateful)
        except Exception:  # function call ops may have no registered op_def
            stateful = True
        coloc = tuple(
            c.decode()[len("loc:@"):] for c in colocation.get(op.name, ()) if c.decode().startswith("loc:@")
        )
        coloc = tuple(c for c in coloc if c in op_index and c != op.name)
        ops.append(
            OpNode(
                index=i,
                name=op.name,
                type=op.type,
                inputs=in_ids,
                outputs=out_ids,
                control_inputs=[op_index[c.name] for c in op.control_inputs if c.name in op_index],
                flops=estimate_flops(op.type, [tensors[t].shape for t in in_ids], out_shapes,
                                     _einsum_equation(op)),
                variables=tuple(variables),
                writes=tuple(writes),
                layer=layer_of(op) if layer_of else None,
                call=layer_call_of(op) if layer_call_of else None,
                glue=bool(glue_of(op)) if glue_of else False,
                stateful=stateful,
                colocate_with=coloc,
                manual_partition=manual_partition_of(op) if manual_partition_of else None,
                kind=kind,
                static_value=static,
                compiled=_xla_compiled(op),
            )
        )
    for a, b in ties:
        if b not in ops[a].tied and b != a:
            ops[a].tied = ops[a].tied + (b,)
    _link_gradients(ops, tensors)
    return OpGraph(ops, tensors, variable_bytes, trainable)


def strongly_connected(succ: Sequence[Sequence[int]]) -> List[int]:
    """Strongly connected components of a directed graph.

    Args:
        succ: the successors of each node ``0 .. len(succ) - 1``.

    Returns:
        The component id of every node; ids are in reverse topological order
        of the component graph (Tarjan's algorithm, iterative, so that deep
        graphs do not reach Python's recursion limit).
    """
    n = len(succ)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: List[int] = []
    counter = 0
    ncomp = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, k = work[-1]
            if k < len(succ[v]):
                work[-1] = (v, k + 1)
                w = succ[v][k]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
            if low[v] == index[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = ncomp
                    if w == v:
                        break
                ncomp += 1
    return comp
