"""Reading a traced step for completion: its `ShardGraph`.

The ops of the graph view, with what the rules read of each: the
attributes (transposes, an einsum's equation, ``keep_dims``), the static
shapes, and the values of small integer inputs known when tracing
(constants, shapes of fully known tensors, and what the gradients compute
from them: the axes a broadcast's gradient sums over, an inverted
permutation, a slice of a shape). Also the names the sharded graph gives
its nodes (`SHARD_ATTR`, `origin_of`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from smp_tf.graph_view import OpGraph
from smp_tf.sharding.completion import READ_OPS, ShardGraph, ShardOp
from smp_tf.sharding.rules import OpInfo
from smp_tf.sharding.spec import ShardSpec

__all__ = ["SHARD_ATTR", "CONSTRAINT_ATTR", "MARK", "origin_of", "constraint_text", "shard_graph_of"]


#: NodeDef attribute of a shard's copy: its device's index in the stage.
SHARD_ATTR = "_smp_shard"
#: Attribute `smp.shard_tensor` sets on its Identity: the spec, as text.
CONSTRAINT_ATTR = "_smp_shard_spec"
#: What the names of the nodes the sharding adds carry after their op's name.
MARK = "__smp"


# Attributes a rule reads, as plain values.
_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "keep_dims", "equation", "data_format", "batch_dims", "axis")


def origin_of(name: str) -> str:
    """The traced op a node of the sharded graph comes from."""
    return name.split(MARK, 1)[0]


def _plain(attr: attr_value_pb2.AttrValue) -> Any:
    which = attr.WhichOneof("value")
    if which == "b":
        return attr.b
    if which == "s":
        return attr.s.decode()
    if which == "i":
        return attr.i
    return None


def _const_value(node: Any) -> Optional[Any]:
    if node.op != "Const":
        return None
    try:
        value = tf.make_ndarray(node.attr["value"].tensor)
    except Exception:  # pragma: no cover - exotic constants
        return None
    if value.dtype.kind not in "iu" or value.size > 16:
        return None
    return value.tolist()


def _known_values(g: OpGraph, nodes: Mapping[str, Any]) -> Dict[int, Any]:
    """tensor id -> value, for the small integer tensors known when tracing:
    constants, shapes of fully known tensors, and what the gradients compute
    from them (the axes a broadcast's gradient sums over, an inverted
    permutation), so that rules can read a reduction's axes or a transpose's
    permutation in the backward pass too."""
    known: Dict[int, Any] = {}
    for op in g.ops:
        value: Any = None
        if op.static_value is not None:
            values = list(op.static_value)
        else:
            node = nodes.get(op.name)
            ins = [known.get(x) for x in op.inputs]
            values = None
            if node is not None and op.type == "Const":
                values = [_const_value(node)]
            elif op.type in ("Identity", "Snapshot") and ins and ins[0] is not None:
                values = [ins[0]]
            elif op.type == "InvertPermutation" and ins and ins[0] is not None:
                perm = list(ins[0])
                values = [[perm.index(i) for i in range(len(perm))]]
            elif op.type == "StridedSlice" and node is not None and len(ins) == 4 and None not in ins:
                values = [_strided_slice_1d(ins, {k: node.attr[k].i for k in node.attr if k.endswith("_mask")})]
            elif op.type == "BroadcastGradientArgs" and len(ins) == 2 and None not in ins:
                values = list(_broadcast_gradient_args(list(ins[0]), list(ins[1])))
        if values is None:
            continue
        for x, value in zip(op.outputs, values):
            if value is not None:
                known[x] = value
    return known


def _strided_slice_1d(ins: List[Any], masks: Mapping[str, int]) -> Optional[Any]:
    """A slice of a known shape vector (``shape[:-2]`` in a product's
    gradient); None for anything but one axis without new or elided axes."""
    value, begin, end, strides = ins
    if not isinstance(value, list) or any(masks.get(k, 0) for k in ("ellipsis_mask", "new_axis_mask")):
        return None
    if not all(isinstance(v, list) and len(v) == 1 for v in (begin, end, strides)):
        return None
    b = None if masks.get("begin_mask", 0) & 1 else begin[0]
    e = None if masks.get("end_mask", 0) & 1 else end[0]
    if masks.get("shrink_axis_mask", 0) & 1:
        return value[begin[0]] if -len(value) <= begin[0] < len(value) else None
    return value[b:e:strides[0]]


def _broadcast_gradient_args(a: List[int], b: List[int]) -> Tuple[List[int], List[int]]:
    """The axes each input of a broadcasting op is summed over in its gradient
    (TensorFlow's own ``BroadcastGradientArgs``, run on the two shapes)."""
    with tf.init_scope():  # eagerly, also while a step is being traced
        ra, rb = tf.raw_ops.BroadcastGradientArgs(s0=tf.constant(a, tf.int32), s1=tf.constant(b, tf.int32))
        return ra.numpy().tolist(), rb.numpy().tolist()


def _parse_constraint(text: str) -> ShardSpec:
    return ShardSpec(tuple(None if d == "-" else "tensor" for d in text.split(",")) if text else ())


def constraint_text(spec: ShardSpec) -> str:
    """How `smp.shard_tensor` writes a spec into its op's attribute."""
    return ",".join("-" if d is None else "t" for d in spec.dims)


def shard_graph_of(graph_def: Any, op_graph: OpGraph, outputs: Sequence[str], t: int) -> ShardGraph:
    """The `ShardGraph` of a traced step (its ops in the view's order)."""
    nodes = {n.name: n for n in graph_def.node}
    g = op_graph
    ops: List[ShardOp] = []
    bytes_of: Dict[str, int] = {}
    known = _known_values(g, nodes)
    for op in g.ops:
        node = nodes.get(op.name)
        if node is None:
            continue
        attrs = {k: _plain(node.attr[k]) for k in _ATTRS if k in node.attr}
        const: Dict[int, Any] = {}
        for k, x in enumerate(op.inputs):
            value = known.get(x)
            if value is not None:
                const[k] = value
        info = OpInfo(
            name=op.name,
            type=op.type,
            attrs=attrs,
            input_shapes=tuple(g.tensors[x].shape for x in op.inputs),
            output_shapes=tuple(g.tensors[x].shape for x in op.outputs),
            const_inputs=const,
            t=t,
        )
        constraint = None
        if CONSTRAINT_ATTR in node.attr:
            constraint = _parse_constraint(node.attr[CONSTRAINT_ATTR].s.decode())
        variable = op.variables[0] if op.variables and (op.type in READ_OPS or op.writes) else None
        ops.append(ShardOp(
            info,
            tuple(g.tensor_name(x) for x in op.inputs),
            tuple(g.tensor_name(x) for x in op.outputs),
            variable=variable,
            constraint=constraint,
            stateful=op.stateful,
            argument=op.kind == "arg",
            gradient=op.is_gradient,
        ))
        for x in op.outputs:
            bytes_of[g.tensor_name(x)] = g.tensors[x].bytes
    wanted = [o for o in outputs if o]
    gradients = frozenset(o for o in wanted if is_float_gradient(g, o))
    return ShardGraph(ops, wanted, bytes_of, gradients)


def is_float_gradient(op_graph: OpGraph, name: str) -> bool:
    """Whether tensor `name` is a floating-point output of a gradient op
    (what the memory model counts as a gradient)."""
    from smp_tf.memory import is_gradient_output

    op_name, _, port = name.partition(":")
    op = op_graph.op_index[op_name]
    return is_gradient_output(op_graph, op, op_graph.ops[op].outputs[int(port or 0)])


