"""Sharding a traced step: completion over its graph, then the graph rewritten.

`shard_traced` is the one step between the trace and the partitioner
(trace -> **shard** -> partition -> tasks -> schedule -> lowering). It reads
the traced `GraphDef` into a `ShardGraph`, completes the specs from the
variables' layouts and the `smp.shard_tensor` constraints, and writes a new
`GraphDef` in which

* every op that runs sharded becomes ``t`` copies (``<name>__smp_s<k>``),
  copy ``k`` computing device ``k``'s piece from the pieces of its inputs,
  with its shape inputs made local (a reshape's target shape);
* every reshard is a few plain ops (`smp_tf.sharding.reshard`): ``Split``
  (split), ``ConcatV2`` (all-gather), ``AddV2`` in device order (all-reduce
  of a partial sum), added once per tensor and target layout;
* everything else is unchanged.

Copy ``k`` carries the attribute ``_smp_shard = k``; the lowering places it
on device ``k`` of its partition's stage (`place_shards`), and every op
without it on device 0. In one process TensorFlow's runtime moves the
tensors between the stage's devices: no transport of smp_tf's own.

Variables stay whole on device 0 of their stage: a sharded variable is read
whole and split for its readers, and its gradient is gathered whole for the
step's outputs. The optimizer, checkpoints and the model are then unchanged;
the products, the activations and their gradients are split over the
devices.

The new graph has the same arguments, captures and outputs as the traced
one, so the partitioner and everything after it work on it unchanged; the
copies of an op belong to its layer, so a stage keeps all of them.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2

from smp_tf.graph_view import OpGraph, from_tf_graph
from smp_tf.sharding.completion import READ_OPS, ShardGraph, ShardOp, ShardPlan, complete
from smp_tf.sharding.rules import OpInfo
from smp_tf.sharding.spec import ShardSpec
from smp_tf.trace import CapturedVariable, Traced

__all__ = ["SHARD_ATTR", "shard_graph_of", "shard_traced", "expand_graph_def", "place_shards", "shard_of_ops",
           "origin_of"]

#: NodeDef attribute of a shard's copy: its device's index in the stage.
SHARD_ATTR = "_smp_shard"
#: Attribute `smp.shard_tensor` sets on its Identity: the spec, as text.
CONSTRAINT_ATTR = "_smp_shard_spec"
_MARK = "__smp"

# Attributes a rule reads, as plain values.
_ATTRS = ("transpose_a", "transpose_b", "adj_x", "adj_y", "keep_dims", "equation", "data_format", "batch_dims")


def origin_of(name: str) -> str:
    """The traced op a node of the sharded graph comes from."""
    return name.split(_MARK, 1)[0]


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
        data_inputs = [x for x in node.input if not x.startswith("^")]
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
        ))
        for x in op.outputs:
            bytes_of[g.tensor_name(x)] = g.tensors[x].bytes
    return ShardGraph(ops, [o for o in outputs if o], bytes_of)


class _Writer:
    """Writes the sharded GraphDef (see the module doc)."""

    def __init__(self, graph_def: Any, plan: ShardPlan, op_graph: OpGraph, t: int,
                 infos: Optional[Mapping[str, OpInfo]] = None) -> None:
        self.src = {n.name: n for n in graph_def.node}
        # What completion read of each op (its constant inputs), for the
        # special lowerings.
        self.plan_info: Mapping[str, OpInfo] = infos or {}
        self.plan = plan
        self.g = op_graph
        self.t = t
        self.out = graph_pb2.GraphDef()
        self.out.versions.CopyFrom(graph_def.versions)
        if len(graph_def.library.function):
            self.out.library.CopyFrom(graph_def.library)
        self.sharded: Dict[str, bool] = {}  # op name -> runs as copies
        # Static shape of every tensor the writer makes (name -> shape): the
        # graph it writes is imported without the variables' handle data, so
        # its own shape inference cannot know them (see `_restore_shapes`).
        self.shapes: Dict[str, Any] = {}
        self.physical: Dict[str, ShardSpec] = {}  # tensor -> layout it is produced in
        self.pieces: Dict[Tuple[str, ShardSpec], List[str]] = {}
        self.shape_of = {g_name: op_graph.tensors[x].shape for x in range(len(op_graph.tensors))
                         for g_name in [op_graph.tensor_name(x)]}

    # -- helpers -------------------------------------------------------------
    def _node(self, name: str, op: str, inputs: Sequence[str], dtype: Any = None, shard: Optional[int] = None):
        node = self.out.node.add()
        node.name = name
        node.op = op
        node.input.extend(inputs)
        if dtype is not None:
            node.attr["T"].type = dtype
        if shard is not None:
            node.attr[SHARD_ATTR].i = shard
        return node

    def _const(self, name: str, value: Any, shard: Optional[int] = None) -> str:
        node = self._node(name, "Const", [], shard=shard)
        node.attr["dtype"].type = tf.int32.as_datatype_enum
        node.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.asarray(value, dtype=np.int32)))
        return name

    def _dtype_of(self, tensor: str) -> int:
        return tf.as_dtype(self.g.tensors[self._tid(tensor)].dtype).as_datatype_enum

    def _tid(self, tensor: str) -> int:
        name, _, port = tensor.partition(":")
        op = self.g.ops[self.g.op_index[name]]
        return op.outputs[int(port or 0)]

    @staticmethod
    def _ref(tensor: str) -> str:
        name, _, port = tensor.partition(":")
        return name if port in ("", "0") else tensor

    # -- pieces of a tensor in a layout ---------------------------------------
    def piece(self, tensor: str, need: ShardSpec, k: Optional[int]) -> str:
        """The name of `tensor` in layout `need` on device `k` (None: whole)."""
        have = self.physical.get(tensor)
        if have is None:
            have = ShardSpec.replicated(need.rank)
        if need.is_replicated:
            return self._whole(tensor, have)
        key = (tensor, need)
        if key not in self.pieces:
            self.pieces[key] = self._reshard(tensor, have, need)
        return self.pieces[key][k or 0]

    def _copies(self, tensor: str) -> List[str]:
        name, _, port = tensor.partition(":")
        return [self._ref(f"{name}{_MARK}_s{k}:{port or 0}") for k in range(self.t)]

    def _whole(self, tensor: str, have: ShardSpec) -> str:
        if have.is_replicated:
            return self._ref(tensor)
        key = (tensor, ShardSpec.replicated(have.rank))
        if key not in self.pieces:
            self.pieces[key] = [self._gather(tensor, have)] * self.t
        return self.pieces[key][0]

    def _gather(self, tensor: str, have: ShardSpec) -> str:
        """All-gather (split) or all-reduce (partial) into a whole tensor on device 0."""
        dtype = self._dtype_of(tensor)
        base = tensor.replace(":", "_")
        parts = self._copies(tensor)
        shape = self.shape_of.get(tensor)
        if have.partial:
            # Added in device order, so that a run repeats itself bit for bit.
            acc = parts[0]
            for k in range(1, self.t):
                acc = self._node(f"{base}{_MARK}_sum{k}", "AddV2", [acc, parts[k]], dtype).name
                self.shapes[f"{acc}:0"] = shape
            return acc
        axis = self._const(f"{base}{_MARK}_gather_axis", have.split_dim)
        node = self._node(f"{base}{_MARK}_gather", "ConcatV2", parts + [axis], dtype)
        node.attr["N"].i = self.t
        node.attr["Tidx"].type = tf.int32.as_datatype_enum
        self.shapes[f"{node.name}:0"] = shape
        return node.name

    def _reshard(self, tensor: str, have: ShardSpec, need: ShardSpec) -> List[str]:
        if have == need:
            return self._copies(tensor)
        whole = self._whole(tensor, have)
        dtype = self._dtype_of(tensor)
        base = tensor.replace(":", "_")
        d = need.split_dim
        axis = self._const(f"{base}{_MARK}_split{d}_axis", d)
        node = self._node(f"{base}{_MARK}_split{d}", "Split", [axis, whole], dtype)
        node.attr["num_split"].i = self.t
        for k in range(self.t):
            self.shapes[f"{node.name}:{k}"] = self._local(self.shape_of.get(tensor), need)
        return [f"{node.name}:{k}" if k else node.name for k in range(self.t)]

    # -- ops -------------------------------------------------------------------
    def write(self) -> None:
        for op in self.g.ops:
            src = self.src.get(op.name)
            if src is None:
                continue
            if op.static_value is not None:
                self._static(op, src)
                continue
            dec = self.plan.decisions.get(op.name)
            if dec is not None and dec.kind in _SPECIAL:
                _SPECIAL[dec.kind](self, op, src, dec)
            elif dec is None or op.type in READ_OPS or dec.kind != "local" or op.writes or op.stateful:
                self._as_is(op, src, dec)
            else:
                self._copy(op, src, dec)

    def finish(self) -> None:
        """Colocation constraints that name an op now split point at its
        first copy (the named op no longer exists)."""
        for node in self.out.node:
            if "_class" not in node.attr:
                continue
            refs = list(node.attr["_class"].list.s)
            fixed = []
            for ref in refs:
                name = ref.decode()[len("loc:@"):] if ref.startswith(b"loc:@") else None
                fixed.append(f"loc:@{name}{_MARK}_s0".encode() if name and self.sharded.get(name) else ref)
            if fixed != refs:
                del node.attr["_class"].list.s[:]
                node.attr["_class"].list.s.extend(fixed)

    def _control(self, inputs: Sequence[str]) -> List[str]:
        out = []
        for x in inputs:
            name = x[1:]
            if self.sharded.get(name):
                out.extend(f"^{name}{_MARK}_s{k}" for k in range(self.t))
            else:
                out.append(x)
        return out

    def _static(self, op: Any, src: Any) -> None:
        """A shape known when tracing: a constant (its input may now be pieces)."""
        node = self.out.node.add()
        node.CopyFrom(src)
        del node.input[:]
        node.input.extend(self._control([x for x in src.input if x.startswith("^")]))
        if op.type in ("Shape", "Size", "Rank"):
            dtype = src.attr["out_type"].type if "out_type" in src.attr else tf.int32.as_datatype_enum
            node.op = "Const"
            for key in list(node.attr):
                del node.attr[key]
            node.attr["dtype"].type = dtype
            node.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(np.asarray(op.static_value[0], dtype=tf.as_dtype(dtype).as_numpy_dtype))
            )
        else:  # ShapeN and the like keep their (whole) inputs
            del node.input[:]
            node.input.extend([self.piece(x, ShardSpec.replicated(0), None) for x in src.input if not x.startswith("^")])
            node.input.extend(self._control([x for x in src.input if x.startswith("^")]))
        for x in op.outputs:
            self.physical[self.g.tensor_name(x)] = ShardSpec.replicated(0)

    def _data_inputs(self, src: Any) -> List[str]:
        return [x for x in src.input if not x.startswith("^")]

    def _as_is(self, op: Any, src: Any, dec: Any) -> None:
        """Runs whole: every data input whole (a write's value too)."""
        node = self.out.node.add()
        node.CopyFrom(src)
        del node.input[:]
        for x in self._data_inputs(src):
            t = self._canonical(x)
            shape = self.shape_of.get(t)
            node.input.append(self.piece(t, ShardSpec.replicated(len(shape) if shape else 0), None)
                              if t in self.physical else x)
        node.input.extend(self._control([x for x in src.input if x.startswith("^")]))
        for x in op.outputs:
            name = self.g.tensor_name(x)
            shape = self.g.tensors[x].shape
            self.physical[name] = ShardSpec.replicated(len(shape) if shape else 0)

    def _canonical(self, x: str) -> str:
        return x if ":" in x else f"{x}:0"

    def _copy(self, op: Any, src: Any, dec: Any) -> None:
        self.sharded[op.name] = True
        data = self._data_inputs(src)
        controls = self._control([x for x in src.input if x.startswith("^")])
        out_shape = self.g.tensors[op.outputs[0]].shape if op.outputs else None
        out_spec = dec.outputs[0] if dec.outputs else None
        local = None
        if out_shape is not None and out_spec is not None and out_spec.split_dim is not None and None not in out_shape:
            local = list(out_shape)
            local[out_spec.split_dim] //= self.t
        for k in range(self.t):
            node = self.out.node.add()
            node.CopyFrom(src)
            node.name = f"{op.name}{_MARK}_s{k}"
            del node.input[:]
            for position, x in enumerate(data):
                t = self._canonical(x)
                if local is not None and self._is_shape_input(op.type, position):
                    node.input.append(self._const(f"{op.name}{_MARK}_shape_s{k}", local, shard=k))
                    continue
                node.input.append(self.piece(t, dec.inputs[position], k))
            node.input.extend(controls)
            node.attr[SHARD_ATTR].i = k
            if "_class" in node.attr:
                del node.attr["_class"]
        for x, spec in zip(op.outputs, dec.outputs):
            name = self.g.tensor_name(x)
            self.physical[name] = spec
            port = name.rsplit(":", 1)[1]
            for k in range(self.t):
                self.shapes[f"{op.name}{_MARK}_s{k}:{port}"] = self._local(self.g.tensors[x].shape, spec)

    def _local(self, shape: Any, spec: ShardSpec) -> Any:
        """The shape of one device's piece of a tensor of `shape` in `spec`."""
        d = spec.split_dim
        if shape is None or d is None or shape[d] is None:
            return shape
        return tuple(n // self.t if i == d else n for i, n in enumerate(shape))

    @staticmethod
    def _is_shape_input(op_type: str, position: int) -> bool:
        return (op_type == "Reshape" and position == 1) or (op_type == "Conv2DBackpropInput" and position == 0) or (
            op_type == "Conv2DBackpropFilter" and position == 1)


def _built(writer: "_Writer", op: Any, inputs: Mapping[str, Tuple[str, Any, Any]], build: Any) -> Dict[str, str]:
    """Writes ops made with TensorFlow's Python API into the sharded graph.

    `build(placeholders, shard)` makes them in a scratch graph from
    placeholders standing for `inputs` (placeholder name -> (tensor of the
    sharded graph, dtype, shape)), calling ``shard(k)`` (a context) around
    the ops of device k; it returns name -> scratch tensor of the results.
    Their nodes are copied under ``<op>__smp_x/``, device k's marked for its
    device; returns name -> the result's name in the sharded graph."""
    import contextlib

    scratch = tf.Graph()
    owner: Dict[str, int] = {}

    @contextlib.contextmanager
    def shard(k: int):
        before = {o.name for o in scratch.get_operations()}
        yield
        for o in scratch.get_operations():
            if o.name not in before:
                owner.setdefault(o.name, k)

    with scratch.as_default():
        placeholders = {}
        for name, (_, dtype, shape) in inputs.items():
            placeholders[name] = tf.compat.v1.placeholder(tf.as_dtype(dtype), shape=shape, name=name)
        results = build(placeholders, shard)
    prefix = f"{op.name}{_MARK}_x/"
    mapping = {p.op.name: inputs[n][0] for n, p in placeholders.items()}
    for node in scratch.as_graph_def().node:
        if node.name in mapping:
            continue
        new = writer.out.node.add()
        new.CopyFrom(node)
        new.name = prefix + node.name
        del new.input[:]
        for x in node.input:
            control = x.startswith("^")
            name, colon, port = x.lstrip("^").partition(":")
            ref = mapping.get(name)
            if ref is None:
                ref = prefix + name + (colon + port if colon else "")
            elif colon and port != "0":
                raise ValueError(f"A placeholder has one output; received {x!r}.")
            new.input.append(("^" if control else "") + (ref.split(":")[0] if control else ref))
        k = owner.get(node.name, 0)
        if k:
            new.attr[SHARD_ATTR].i = k
    for o in scratch.get_operations():
        if o.name in mapping:
            continue
        for j, x in enumerate(o.outputs):
            if x.shape.rank is not None:
                writer.shapes[f"{prefix}{o.name}:{j}"] = tuple(x.shape.as_list())
    return {n: f"{prefix}{t.op.name}:{t.value_index}" for n, t in results.items()}


def _vocab_cross_entropy(writer: "_Writer", op: Any, src: Any, dec: Any) -> None:
    """Megatron-LM's vocabulary-parallel cross-entropy (see the rule): the
    logits stay split by classes; the maxima, the sums of exponentials and
    the label's logit are reduced over the devices in device order."""
    t = writer.t
    feats, labels = [writer._canonical(x) for x in writer._data_inputs(src)[:2]]
    n, v = writer.shape_of[feats]
    local = v // t
    # SparseSoftmaxCrossEntropyWithLogits takes class ids (N,), whole;
    # SoftmaxCrossEntropyWithLogits label weights (N, V), split like the logits.
    dense = op.type == "SoftmaxCrossEntropyWithLogits"
    inputs = {f"f{k}": (writer.piece(feats, dec.inputs[0], k), writer._dtype_of(feats), (n, local))
              for k in range(t)}
    if dense:
        inputs.update({f"l{k}": (writer.piece(labels, dec.inputs[1], k), writer._dtype_of(labels), (n, local))
                       for k in range(t)})
    else:
        inputs["labels"] = (writer.piece(labels, dec.inputs[1], None), writer._dtype_of(labels), (n,))

    def build(ph, shard):
        f = [ph[f"f{k}"] for k in range(t)]
        if dense:
            return _dense_cross_entropy(f, [ph[f"l{k}"] for k in range(t)], shard)
        lab = ph["labels"]
        maxima = []
        for k in range(t):
            with shard(k):
                maxima.append(tf.reduce_max(f[k], axis=1))
        m = maxima[0]
        for k in range(1, t):
            m = tf.maximum(m, maxima[k])
        m = tf.stop_gradient(m)
        exps, sums, picked, hot = [], [], [], []
        for k in range(t):
            with shard(k):
                e = tf.exp(f[k] - m[:, None])
                exps.append(e)
                sums.append(tf.reduce_sum(e, axis=1))
                mine = tf.logical_and(lab >= k * local, lab < (k + 1) * local)
                index = tf.where(mine, lab - k * local, tf.zeros_like(lab))
                value = tf.gather(f[k], index[:, None], axis=1, batch_dims=1)[:, 0]
                picked.append(tf.where(mine, value, tf.zeros_like(value)))
                hot.append(tf.one_hot(index, local, dtype=f[k].dtype) * tf.cast(mine, f[k].dtype)[:, None])
        total, label_logit = sums[0], picked[0]
        for k in range(1, t):
            total = total + sums[k]
            label_logit = label_logit + picked[k]
        loss = tf.math.log(total) - (label_logit - m)
        out = {"loss": loss}
        for k in range(t):
            with shard(k):
                out[f"backprop{k}"] = exps[k] / total[:, None] - hot[k]
        return out

    names = _built(writer, op, inputs, build)
    writer.sharded[op.name] = True
    # The op's outputs under the names the writer gives a split op's:
    # output 0 (the loss, whole) under the op's own name, output 1 (the
    # gradient, split by classes) under each copy's.
    whole = writer.out.node.add()
    whole.name = op.name
    whole.op = "IdentityN"
    whole.input.extend([names["loss"], names["backprop0"]])
    whole.attr["T"].list.type.extend([src.attr["T"].type, src.attr["T"].type])
    for k in range(t):
        node = writer.out.node.add()
        node.name = f"{op.name}{_MARK}_s{k}"
        node.op = "IdentityN"
        node.input.extend([names["loss"], names[f"backprop{k}"]])
        node.attr["T"].list.type.extend([src.attr["T"].type, src.attr["T"].type])
        if k:
            node.attr[SHARD_ATTR].i = k
        writer.shapes[f"{node.name}:1"] = (n, local)
        writer.shapes[f"{node.name}:0"] = (n,)
    writer.shapes[f"{op.name}:0"] = (n,)
    writer.shapes[f"{op.name}:1"] = (n, local)
    writer.physical[f"{op.name}:0"] = dec.outputs[0]
    writer.physical[f"{op.name}:1"] = dec.outputs[1]


def _dense_cross_entropy(f: List[tf.Tensor], labels: List[tf.Tensor], shard: Any) -> Dict[str, tf.Tensor]:
    """The vocabulary-parallel loss of label weights split like the logits:
    per device sum(labels * (log(total) - (logits - max))), added over the
    devices; the gradient softmax - labels stays split."""
    t = len(f)
    maxima = []
    for k in range(t):
        with shard(k):
            maxima.append(tf.reduce_max(f[k], axis=1))
    m = maxima[0]
    for k in range(1, t):
        m = tf.maximum(m, maxima[k])
    m = tf.stop_gradient(m)
    exps, sums = [], []
    for k in range(t):
        with shard(k):
            exps.append(tf.exp(f[k] - m[:, None]))
            sums.append(tf.reduce_sum(exps[k], axis=1))
    total = sums[0]
    for k in range(1, t):
        total = total + sums[k]
    log_total = tf.math.log(total)
    out: Dict[str, tf.Tensor] = {}
    losses = []
    for k in range(t):
        with shard(k):
            losses.append(tf.reduce_sum(labels[k] * (log_total[:, None] - (f[k] - m[:, None])), axis=1))
            out[f"backprop{k}"] = exps[k] / total[:, None] - labels[k]
    loss = losses[0]
    for k in range(1, t):
        loss = loss + losses[k]
    out["loss"] = loss
    return out


def _split_log_softmax(writer: "_Writer", op: Any, src: Any, dec: Any) -> None:
    """Log-softmax over a split last axis: (x - max) - log(sum(exp(x - max))),
    the maximum and the sum reduced over the devices in device order."""
    t = writer.t
    x = writer._canonical(writer._data_inputs(src)[0])
    shape = writer.shape_of[x]
    local = writer._local(shape, dec.inputs[0])
    inputs = {f"x{k}": (writer.piece(x, dec.inputs[0], k), writer._dtype_of(x), local) for k in range(t)}

    def build(ph, shard):
        xs = [ph[f"x{k}"] for k in range(t)]
        maxima = []
        for k in range(t):
            with shard(k):
                maxima.append(tf.reduce_max(xs[k], axis=-1, keepdims=True))
        m = maxima[0]
        for k in range(1, t):
            m = tf.maximum(m, maxima[k])
        sums = []
        for k in range(t):
            with shard(k):
                sums.append(tf.reduce_sum(tf.exp(xs[k] - m), axis=-1, keepdims=True))
        total = sums[0]
        for k in range(1, t):
            total = total + sums[k]
        log_total = tf.math.log(total)
        out = {}
        for k in range(t):
            with shard(k):
                out[f"y{k}"] = (xs[k] - m) - log_total
        return out

    names = _built(writer, op, inputs, build)
    _name_copies(writer, op, src, [names[f"y{k}"] for k in range(t)], dec.outputs[0], local)


def _masked_gather(writer: "_Writer", op: Any, src: Any, dec: Any) -> None:
    """Each device looks up the indices that fall in its piece of the
    gathered axis and zeroes the rest: a partial sum with one addend not
    zero per element (its all-reduce is exact)."""
    t = writer.t
    data = [writer._canonical(x) for x in writer._data_inputs(src)]
    params, indices = data[0], data[1]
    pshape, ishape = writer.shape_of[params], writer.shape_of[indices]
    axis = int(writer.plan_info[op.name].const_inputs[2]) % len(pshape)
    batch_dims = int(src.attr["batch_dims"].i) if "batch_dims" in src.attr else 0
    local = writer._local(pshape, dec.inputs[0])
    size = local[axis]
    inputs = {f"p{k}": (writer.piece(params, dec.inputs[0], k), writer._dtype_of(params), local) for k in range(t)}
    inputs["i"] = (writer.piece(indices, dec.inputs[1], None), writer._dtype_of(indices), ishape)
    trailing = len(pshape) - axis - 1
    out_shape = writer.shape_of[f"{op.name}:0"]

    def build(ph, shard):
        out = {}
        for k in range(t):
            with shard(k):
                ids = ph["i"]
                mine = tf.logical_and(ids >= k * size, ids < (k + 1) * size)
                index = tf.where(mine, ids - k * size, tf.zeros_like(ids))
                value = tf.gather(ph[f"p{k}"], index, axis=axis, batch_dims=batch_dims)
                mask = tf.reshape(mine, tf.concat([tf.shape(mine), tf.ones([trailing], tf.int32)], 0))
                out[f"y{k}"] = tf.where(mask, value, tf.zeros_like(value))
        return out

    names = _built(writer, op, inputs, build)
    _name_copies(writer, op, src, [names[f"y{k}"] for k in range(t)], dec.outputs[0], out_shape)


def _name_copies(writer: "_Writer", op: Any, src: Any, pieces: List[str], spec: ShardSpec, shape: Any) -> None:
    """Names device k's result of a one-output op ``<op>__smp_s<k>``, as the
    writer names a split op's copies, so that its readers find it."""
    writer.sharded[op.name] = True
    dtype = src.attr["T"].type if "T" in src.attr else src.attr["Tparams"].type
    for k, piece in enumerate(pieces):
        node = writer.out.node.add()
        node.name = f"{op.name}{_MARK}_s{k}"
        node.op = "Identity"
        node.input.append(piece)
        node.attr["T"].type = dtype
        if k:
            node.attr[SHARD_ATTR].i = k
        writer.shapes[f"{node.name}:0"] = tuple(shape) if shape is not None else None
    writer.physical[f"{op.name}:0"] = spec


#: Decisions computed by more than a copy per device (`Decision.kind`).
_SPECIAL = {
    "vocab_cross_entropy": _vocab_cross_entropy,
    "split_log_softmax": _split_log_softmax,
    "masked_gather": _masked_gather,
}


def expand_graph_def(graph_def: Any, op_graph: OpGraph, plan: ShardPlan, t: int, outputs: Sequence[Optional[str]],
                     infos: Optional[Mapping[str, OpInfo]] = None):
    """The sharded `GraphDef`, the names of `outputs` in it (whole), and the
    static shapes of its tensors. `infos`: op name -> `OpInfo` (from the
    `ShardGraph`), which the special lowerings read."""
    w = _Writer(graph_def, plan, op_graph, t, infos)
    w.write()
    w.finish()
    renamed = []
    for name in outputs:
        if name is None:
            renamed.append(None)
            continue
        spec = w.physical.get(name)
        if spec is None or spec.is_replicated:
            renamed.append(name)
        else:
            ref = w._whole(name, spec)
            renamed.append(ref if ":" in ref else f"{ref}:0")
    shapes = dict(w.shape_of)
    shapes.update(w.shapes)
    return w.out, renamed, shapes


def _restore_shapes(view: OpGraph, shapes: Mapping[str, Any]) -> None:
    """Gives the view the static shapes the traced graph had.

    A plain `tf.Graph` imported from a `GraphDef` does not know the shapes
    of the captured variables (their handle data lives on the traced
    function's placeholders, not in the `GraphDef`), so every value computed
    from a variable would have an unknown shape, and the task functions'
    inputs with it. The shapes are those of the traced graph, and of the
    pieces for the copies and reshards."""
    from smp_tf.graph_view import _bytes_of, estimate_flops

    changed = False
    for t in view.tensors:
        known = shapes.get(view.tensor_name(t.id))
        if known is not None and (t.shape is None or None in t.shape) and known != t.shape:
            t.shape = tuple(known)
            t.bytes = _bytes_of(tf.as_dtype(t.dtype), t.shape)
            changed = True
    if changed:
        for op in view.ops:
            op.flops = estimate_flops(op.type, [view.tensors[x].shape for x in op.inputs],
                                      [view.tensors[x].shape for x in op.outputs])


def shard_traced(
    traced: Traced, variable_specs: Mapping[str, ShardSpec], t: int, graph: Optional[ShardGraph] = None
) -> Tuple[Traced, ShardPlan]:
    """Completes and applies the sharding of a traced step (module doc).

    Returns:
        The sharded `Traced` (same arguments, captures and outputs) and the
        `ShardPlan`.
    """
    g = traced.op_graph
    sgraph = graph or shard_graph_of(traced.graph_def, g, [n for n in traced.output_names if n], t)
    plan = complete(sgraph, variable_specs, t)
    if not plan.decisions:
        return traced, plan
    graph_def, outputs, shapes = expand_graph_def(traced.graph_def, g, plan, t, traced.output_names,
                                                  {op.name: op.info for op in sgraph.ops})
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    by_name = {op.name: op for op in g.ops}
    captured_vars = {}
    for name, cap in traced.captures.items():
        if isinstance(cap, CapturedVariable):
            key = by_name[name].variables[0] if name in by_name and by_name[name].variables else cap.key
            captured_vars[name] = (key, g.variable_bytes.get(key, 0), g.trainable.get(key, True))

    def lookup(attr: str):
        return lambda op: getattr(by_name.get(origin_of(op.name)), attr, None)

    t0 = time.perf_counter()
    view = from_tf_graph(
        graph,
        arg_ops=traced.arg_names,
        captured_variables=captured_vars,
        captured_ops=list(traced.captures),
        layer_of=lookup("layer"),
        layer_call_of=lookup("call"),
        glue_of=lambda op: bool(getattr(by_name.get(origin_of(op.name)), "glue", False)),
        manual_partition_of=lookup("manual_partition"),
        graph_def=graph_def,
    )
    _restore_shapes(view, shapes)
    sharded = Traced(graph_def, view, traced.arg_names, outputs, traced.output_structure, traced.captures,
                     traced.layers, traced.view_seconds + time.perf_counter() - t0)
    sharded._graph = graph
    return sharded, plan


def shard_of_ops(graph_def: Any, op_graph: OpGraph) -> List[int]:
    """The device of each op of the sharded graph within its stage (the
    index of `op_graph.ops`): its copy's ``k``, 0 for what is not split."""
    shard = {n.name: n.attr[SHARD_ATTR].i for n in graph_def.node if SHARD_ATTR in n.attr}
    return [shard.get(op.name, 0) for op in op_graph.ops]


def place_shards(graph_def: Any, stage_devices: Sequence[str]) -> None:
    """Puts each shard's copy on its device of the stage (in place); the
    other ops keep the device of the call (the stage's device 0)."""
    for node in graph_def.node:
        if SHARD_ATTR in node.attr:
            k = node.attr[SHARD_ATTR].i
            del node.attr[SHARD_ATTR]
            if k:
                node.device = stage_devices[k]
