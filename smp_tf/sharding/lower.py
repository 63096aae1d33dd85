"""Sharding a traced step: completion over its graph, then the graph rewritten.

`shard_traced` is the one step between the trace and the partitioner
(trace -> **shard** -> partition -> tasks -> schedule -> lowering). It reads
the traced `GraphDef` into a `ShardGraph` (`smp_tf.sharding.read`), completes the specs from the
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

A split variable whose storage is split too (`ShardPlan.stored_split`: the
step only reads it, through ``ReadVariableOp``) is read piece by piece: its
captured handle becomes ``t`` captured handles (``<name>__smp_s<k>``, one
per piece, see `smp_tf.sharding.storage` and `CapturedShard`), and each read
``t`` reads of the pieces. Any other split variable is stored whole on
device 0 of its stage, read whole and split for its readers.

A gradient the step returns split (a split variable's weight gradient)
stays in its pieces: the step returns its ``t`` pieces, each on its device
(`Traced.split_outputs`), and nothing gathers it unless its user asks for
the whole value (`smp_tf.step_output.SplitValue`). Any other output is
gathered whole on device 0 of its stage.

The new graph has the same arguments and outputs as the traced one, and
the captures of the pieces besides the traced ones, so the partitioner and
everything after it work on it unchanged; the copies of an op belong to its
layer, so a stage keeps all of them.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from smp_tf.graph_view import OpGraph, from_tf_graph
from smp_tf.sharding.completion import READ_OPS, ShardGraph, ShardPlan, complete, returned_in_pieces
from smp_tf.sharding.read import MARK, SHARD_ATTR, is_float_gradient, origin_of, shard_graph_of
from smp_tf.sharding.rules import OpInfo
from smp_tf.sharding.special import SPECIAL
from smp_tf.sharding.spec import ShardSpec
from smp_tf.trace import CapturedShard, CapturedVariable, Traced

__all__ = ["shard_traced", "expand_graph_def", "place_shards", "shard_of_ops"]


class _Writer:
    """Writes the sharded GraphDef (see the module doc)."""

    def __init__(self, graph_def: Any, plan: ShardPlan, op_graph: OpGraph, t: int,
                 infos: Optional[Mapping[str, OpInfo]] = None,
                 stored_split: Optional[Mapping[str, str]] = None) -> None:
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
        self.shape_of = {op_graph.tensor_name(x): info.shape for x, info in enumerate(op_graph.tensors)}
        # Captured handles of the variables stored in pieces (name -> key).
        self.stored_split: Mapping[str, str] = stored_split or {}
        self.reader: Any = None  # the op being written

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

    def dtype_of(self, tensor: str) -> int:
        """The dtype (enum) of a tensor of the traced graph."""
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
        again = self._again(tensor, have)
        if need.is_replicated:
            return self._whole(tensor, have, again)
        key = (tensor + again, need)
        if key not in self.pieces:
            self.pieces[key] = self._reshard(tensor, have, need, again)
        return self.pieces[key][k or 0]

    def _again(self, tensor: str, have: ShardSpec) -> str:
        """``"_again"`` where the op being written is a gradient that reads
        a forward tensor made in pieces, under sequence parallelism: it
        gathers the pieces again rather than share the forward's gather, so
        that between the two passes each device keeps only its piece
        (Megatron-LM's sequence parallelism gathers again in the backward);
        else ``""``."""
        reader = self.reader
        if not self.plan.sequence_parallel or reader is None or not reader.is_gradient or have.split_dim is None:
            return ""
        producer = self.g.tensors[self._tid(tensor)].producer
        return "" if producer is None or self.g.ops[producer].is_gradient else "_again"

    def _copies(self, tensor: str) -> List[str]:
        name, _, port = tensor.partition(":")
        return [self._ref(f"{name}{MARK}_s{k}:{port or 0}") for k in range(self.t)]

    def _whole(self, tensor: str, have: ShardSpec, again: str = "") -> str:
        if have.is_replicated:
            return self._ref(tensor)
        key = (tensor + again, ShardSpec.replicated(have.rank))
        if key not in self.pieces:
            self.pieces[key] = [self._gather(tensor, have, again)] * self.t
        return self.pieces[key][0]

    def _gather(self, tensor: str, have: ShardSpec, again: str = "") -> str:
        """All-gather (split) or all-reduce (partial) into a whole tensor on device 0."""
        dtype = self.dtype_of(tensor)
        base = tensor.replace(":", "_") + again
        parts = self._copies(tensor)
        shape = self.shape_of.get(tensor)
        if have.partial:
            return self._sum_in_order(parts, f"{base}{MARK}_sum", dtype, shape)
        axis = self._const(f"{base}{MARK}_gather_axis", have.split_dim)
        node = self._node(f"{base}{MARK}_gather", "ConcatV2", parts + [axis], dtype)
        node.attr["N"].i = self.t
        node.attr["Tidx"].type = tf.int32.as_datatype_enum
        self.shapes[f"{node.name}:0"] = shape
        return node.name

    def _reshard(self, tensor: str, have: ShardSpec, need: ShardSpec, again: str = "") -> List[str]:
        if have == need:
            return self._copies(tensor)
        if have.partial:
            return self._reduce_scatter(tensor, need)
        whole = self._whole(tensor, have, again)
        dtype = self.dtype_of(tensor)
        base = tensor.replace(":", "_") + again
        d = need.split_dim
        axis = self._const(f"{base}{MARK}_split{d}_axis", d)
        node = self._node(f"{base}{MARK}_split{d}", "Split", [axis, whole], dtype)
        node.attr["num_split"].i = self.t
        local = self.local_shape(self.shape_of.get(tensor), need)
        out = [node.name]
        for k in range(1, self.t):
            self.shapes[f"{node.name}:{k}"] = local
            # Each piece moves to its device at once: a piece kept for the
            # backward is kept there, not where the split ran.
            moved = self._node(f"{base}{MARK}_split{d}_to{k}", "Identity", [f"{node.name}:{k}"], dtype, shard=k)
            self.shapes[f"{moved.name}:0"] = local
            out.append(moved.name)
        self.shapes[f"{node.name}:0"] = local
        return out

    def _reduce_scatter(self, tensor: str, need: ShardSpec) -> List[str]:
        """Reduce-scatter of a partial sum: each device splits its addend
        where it is, and device ``k`` adds the ``k``-th pieces in device
        order, the same sum as the all-reduce's for those elements; no
        device makes the whole sum."""
        dtype = self.dtype_of(tensor)
        base = tensor.replace(":", "_")
        d = need.split_dim
        local = self.local_shape(self.shape_of.get(tensor), need)
        pieces = []
        for j, part in enumerate(self._copies(tensor)):
            axis = self._const(f"{base}{MARK}_rs{j}_axis", d, shard=j)
            node = self._node(f"{base}{MARK}_rs{j}", "Split", [axis, part], dtype, shard=j)
            node.attr["num_split"].i = self.t
            names = [f"{node.name}:{k}" if k else node.name for k in range(self.t)]
            for name in names:
                self.shapes[name if ":" in name else f"{name}:0"] = local
            pieces.append(names)
        return [self._sum_in_order([p[k] for p in pieces], f"{base}{MARK}_rs_s{k}_sum", dtype, local, shard=k)
                for k in range(self.t)]

    def _sum_in_order(self, parts: Sequence[str], prefix: str, dtype: int, shape: Any,
                      shard: Optional[int] = None) -> str:
        """``((parts[0] + parts[1]) + parts[2]) + ...``: the addends of a
        partial sum added in device order, so that a run repeats itself bit
        for bit (on device `shard`; None: the stage's first)."""
        acc = parts[0]
        for j in range(1, len(parts)):
            acc = self._node(f"{prefix}{j}", "AddV2", [acc, parts[j]], dtype, shard=shard).name
            self.shapes[f"{acc}:0"] = shape
        return acc

    # -- ops -------------------------------------------------------------------
    def write(self) -> None:
        for op in self.g.ops:
            src = self.src.get(op.name)
            if src is None:
                continue
            if op.static_value is not None:
                self._static(op, src)
                continue
            if op.name in self.stored_split:
                self._pieces_of_handle(src)
                continue
            dec = self.plan.decisions.get(op.name)
            self.reader = op
            if op.type in READ_OPS and self._handle_of(src) in self.stored_split:
                self._read_pieces(op, src, dec)
                continue
            if dec is not None and dec.kind in SPECIAL:
                SPECIAL[dec.kind](self, op, src, dec)
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
                fixed.append(f"loc:@{name}{MARK}_s0".encode() if name and self.sharded.get(name) else ref)
            if fixed != refs:
                del node.attr["_class"].list.s[:]
                node.attr["_class"].list.s.extend(fixed)

    def _controls(self, src: Any) -> List[str]:
        """`src`'s control inputs, each split op's as all of its copies."""
        out = []
        for x in src.input:
            if not x.startswith("^"):
                continue
            name = x[1:]
            if self.sharded.get(name):
                out.extend(f"^{name}{MARK}_s{k}" for k in range(self.t))
            else:
                out.append(x)
        return out

    def _handle_of(self, src: Any) -> str:
        return self.data_inputs(src)[0].split(":")[0]

    def _pieces_of_handle(self, src: Any) -> None:
        """A captured handle of a variable stored in pieces: one captured
        handle per piece, on its device."""
        self.sharded[src.name] = True
        for k in range(self.t):
            self._shard_copy(src, k)

    def _read_pieces(self, op: Any, src: Any, dec: Any) -> None:
        """A read of a variable stored in pieces: each device reads its own."""
        self.sharded[op.name] = True
        handle = self._handle_of(src)
        controls = self._controls(src)
        for k in range(self.t):
            self._shard_copy(src, k, [f"{handle}{MARK}_s{k}"] + controls)
        self._record_outputs(op, dec.outputs[:1])

    def _shard_copy(self, src: Any, k: int, inputs: Optional[Sequence[str]] = None) -> Any:
        """Device `k`'s copy of NodeDef `src` (``<name>__smp_s<k>``), with
        `inputs` instead of its own when given; no colocation constraint
        (the copies are placed by `place_shards`)."""
        node = self.out.node.add()
        node.CopyFrom(src)
        node.name = f"{src.name}{MARK}_s{k}"
        if inputs is not None:
            del node.input[:]
            node.input.extend(inputs)
        node.attr[SHARD_ATTR].i = k
        if "_class" in node.attr:
            del node.attr["_class"]
        return node

    def _record_outputs(self, op: Any, specs: Sequence[ShardSpec]) -> None:
        """The layout each output of a split op is made in, and its pieces' shapes."""
        for x, spec in zip(op.outputs, specs):
            name = self.g.tensor_name(x)
            self.physical[name] = spec
            port = name.rsplit(":", 1)[1]
            for k in range(self.t):
                self.shapes[f"{op.name}{MARK}_s{k}:{port}"] = self.local_shape(self.g.tensors[x].shape, spec)

    def _static(self, op: Any, src: Any) -> None:
        """A shape known when tracing: a constant (its input may now be pieces)."""
        node = self.out.node.add()
        node.CopyFrom(src)
        del node.input[:]
        node.input.extend(self._controls(src))
        if op.type in ("Shape", "Size", "Rank", "VariableShape"):
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
            node.input.extend([self.piece(x, ShardSpec.replicated(0), None) for x in self.data_inputs(src)])
            node.input.extend(self._controls(src))
        for x in op.outputs:
            self.physical[self.g.tensor_name(x)] = ShardSpec.replicated(0)

    def data_inputs(self, src: Any) -> List[str]:
        """The data inputs of NodeDef `src` (not its control inputs)."""
        return [x for x in src.input if not x.startswith("^")]

    def _as_is(self, op: Any, src: Any, dec: Any) -> None:
        """Runs whole: every data input whole (a write's value too)."""
        node = self.out.node.add()
        node.CopyFrom(src)
        del node.input[:]
        for x in self.data_inputs(src):
            t = self.canonical(x)
            shape = self.shape_of.get(t)
            node.input.append(self.piece(t, ShardSpec.replicated(len(shape) if shape else 0), None)
                              if t in self.physical else x)
        node.input.extend(self._controls(src))
        for x in op.outputs:
            name = self.g.tensor_name(x)
            shape = self.g.tensors[x].shape
            self.physical[name] = ShardSpec.replicated(len(shape) if shape else 0)

    @staticmethod
    def canonical(x: str) -> str:
        """A tensor name with its output index (``"op"`` -> ``"op:0"``)."""
        return x if ":" in x else f"{x}:0"

    def _copy(self, op: Any, src: Any, dec: Any) -> None:
        self.sharded[op.name] = True
        data = self.data_inputs(src)
        controls = self._controls(src)
        # The target shape of a copy's reshape (or convolution gradient):
        # its own piece's, where the output is split and its shape known.
        out_shape = self.g.tensors[op.outputs[0]].shape if op.outputs else None
        local = None
        if out_shape is not None and None not in out_shape and dec.outputs and dec.outputs[0].split_dim is not None:
            local = list(self.local_shape(out_shape, dec.outputs[0]))
        for k in range(self.t):
            inputs = []
            for position, x in enumerate(data):
                if local is not None and self._is_shape_input(op.type, position):
                    inputs.append(self._const(f"{op.name}{MARK}_shape_s{k}", local, shard=k))
                else:
                    inputs.append(self.piece(self.canonical(x), dec.inputs[position], k))
            self._shard_copy(src, k, inputs + controls)
        self._record_outputs(op, dec.outputs)

    def local_shape(self, shape: Any, spec: ShardSpec) -> Any:
        """The shape of one device's piece of a tensor of `shape` in `spec`."""
        d = spec.split_dim
        if shape is None or d is None or shape[d] is None:
            return shape
        return tuple(n // self.t if i == d else n for i, n in enumerate(shape))

    @staticmethod
    def _is_shape_input(op_type: str, position: int) -> bool:
        return (op_type == "Reshape" and position == 1) or (op_type == "Conv2DBackpropInput" and position == 0) or (
            op_type == "Conv2DBackpropFilter" and position == 1)


def expand_graph_def(graph_def: Any, op_graph: OpGraph, plan: ShardPlan, t: int, outputs: Sequence[Optional[str]],
                     infos: Optional[Mapping[str, OpInfo]] = None, stored_split: Optional[Mapping[str, str]] = None,
                     split_gradients: bool = True):
    """The sharded `GraphDef`, the names of `outputs` in it, the static
    shapes of its tensors, and the outputs returned in pieces (flat index ->
    (split dimension, piece names); their name in the first list is piece
    0's). `infos`: op name -> `OpInfo` (from the `ShardGraph`), which the
    special lowerings read; `stored_split`: the captured handles of the
    variables stored in pieces (name -> key); `split_gradients`: return the
    split gradients in pieces (False: every output whole)."""
    w = _Writer(graph_def, plan, op_graph, t, infos, stored_split)
    w.write()
    w.finish()
    renamed: List[Optional[str]] = []
    split: Dict[int, Tuple[int, List[str]]] = {}
    for i, name in enumerate(outputs):
        if name is None:
            renamed.append(None)
            continue
        spec = w.physical.get(name)
        if spec is None or spec.is_replicated:
            renamed.append(name)
        elif split_gradients and returned_in_pieces(spec) and is_float_gradient(op_graph, name):
            pieces = [ref if ":" in ref else f"{ref}:0" for ref in w._copies(name)]
            split[i] = (spec.split_dim, pieces)
            renamed.append(pieces[0])
        else:
            ref = w._whole(name, spec)
            renamed.append(ref if ":" in ref else f"{ref}:0")
    shapes = dict(w.shape_of)
    shapes.update(w.shapes)
    return w.out, renamed, shapes, split


def _restore_shapes(view: OpGraph, shapes: Mapping[str, Any], graph: tf.Graph) -> None:
    """Gives the view the static shapes the traced graph had.

    A plain `tf.Graph` imported from a `GraphDef` does not know the shapes
    of the captured variables (their handle data lives on the traced
    function's placeholders, not in the `GraphDef`), so every value computed
    from a variable would have an unknown shape, and the task functions'
    inputs with it. The shapes are those of the traced graph, and of the
    pieces for the copies and reshards. The ops' flops are estimated again
    on those shapes (an ``Einsum``'s from its equation, read from `graph`)."""
    from smp_tf.graph_view import _bytes_of, _einsum_equation, estimate_flops

    changed = False
    for t in view.tensors:
        known = shapes.get(view.tensor_name(t.id))
        if known is not None and (t.shape is None or None in t.shape) and known != t.shape:
            t.shape = tuple(known)
            t.bytes = _bytes_of(tf.as_dtype(t.dtype), t.shape)
            changed = True
    if changed:
        for op in view.ops:
            equation = _einsum_equation(graph.get_operation_by_name(op.name)) if op.type == "Einsum" else None
            op.flops = estimate_flops(op.type, [view.tensors[x].shape for x in op.inputs],
                                      [view.tensors[x].shape for x in op.outputs], equation)


def shard_traced(
    traced: Traced, variable_specs: Mapping[str, ShardSpec], t: int, graph: Optional[ShardGraph] = None,
    stored_split: Optional[Mapping[str, str]] = None, sequence_parallel: bool = False,
) -> Tuple[Traced, ShardPlan]:
    """Completes and applies the sharding of a traced step (module doc).

    Args:
        stored_split: captured handle -> variable key, for the variables
            whose storage is split (`smp_tf.sharding.storage`): the step
            reads their pieces.
        sequence_parallel: split the ops between the tensor-parallel
            regions along the sequence (`complete`).

    Returns:
        The sharded `Traced` (same arguments and outputs; the captures of
        the pieces added) and the `ShardPlan`.
    """
    g = traced.op_graph
    stored_split = dict(stored_split or {})
    sgraph = graph or shard_graph_of(traced.graph_def, g, [n for n in traced.output_names if n], t)
    plan = complete(sgraph, variable_specs, t, sequence_parallel=sequence_parallel)
    if not plan.decisions:
        return traced, plan
    plan.stored_split = {key: variable_specs[key].split_dim for key in stored_split.values()}
    graph_def, outputs, shapes, split_outputs = expand_graph_def(
        traced.graph_def, g, plan, t, traced.output_names, {op.name: op.info for op in sgraph.ops}, stored_split)
    captures = dict(traced.captures)
    for name in stored_split:
        cap = traced.captures[name]
        for k in range(t):
            captures[f"{name}{MARK}_s{k}"] = CapturedShard(cap.key, cap.variable, k)
    sharded = Traced(graph_def, g, traced.arg_names, outputs, traced.output_structure, captures, traced.layers,
                     functions=traced.functions, split_outputs=split_outputs)
    by_name = {op.name: op for op in g.ops}
    captured_vars = {}
    for name, cap in captures.items():
        if isinstance(cap, (CapturedVariable, CapturedShard)):
            source = origin_of(name)
            key = by_name[source].variables[0] if source in by_name and by_name[source].variables else cap.key
            # Each piece's handle counts the whole variable: the stage holds
            # all of it (the devices' shares are the memory model's).
            captured_vars[name] = (key, g.variable_bytes.get(key, 0), g.trainable.get(key, True))

    def lookup(attr: str):
        return lambda op: getattr(by_name.get(origin_of(op.name)), attr, None)

    graph = sharded.graph  # imported from the GraphDef
    t0 = time.perf_counter()
    view = from_tf_graph(
        graph,
        arg_ops=traced.arg_names,
        captured_variables=captured_vars,
        captured_ops=list(captures),
        layer_of=lookup("layer"),
        layer_call_of=lookup("call"),
        glue_of=lambda op: bool(getattr(by_name.get(origin_of(op.name)), "glue", False)),
        manual_partition_of=lookup("manual_partition"),
        graph_def=graph_def,
    )
    _restore_shapes(view, shapes, graph)
    sharded.op_graph = view
    sharded.view_seconds = traced.view_seconds + time.perf_counter() - t0
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
