"""`smp.shard_tensor` and the layout of a traced step's variables."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from smp_tf.sharding.builtin import attention_layouts, embedding_layouts, output_layer_layouts, pair_layouts
from smp_tf.sharding.completion import ShardGraph
from smp_tf.sharding import storage
from smp_tf.sharding.layout_map import resolve_layout
from smp_tf.sharding.lower import shard_traced
from smp_tf.sharding.read import CONSTRAINT_ATTR, constraint_text, shard_graph_of
from smp_tf.trace import CapturedVariable
from smp_tf.sharding.spec import ShardSpec, parse_spec

__all__ = ["shard_tensor", "variable_layouts", "stored_split", "shard_step"]


def shard_tensor(x: Any, spec: Sequence[Optional[str]]) -> tf.Tensor:
    """Asks for activation `x` to be laid out as `spec` over the stage's
    devices (one ``"tensor"`` or None per dimension), as
    ``keras.distribution``'s layout constraints do.

    Completion starts from it as from a variable's layout: the ops that
    produce `x` and read it are split accordingly, with reshards where
    needed. Without tensor parallelism (or called eagerly) it returns `x`.

    Args:
        x: a tensor of the traced step.
        spec: one entry per dimension of `x`.

    Returns:
        `x`, through an identity that carries the constraint.

    Raises:
        ValueError: an axis other than ``"tensor"``, or a spec whose length
            is not `x`'s rank.
    """
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    parsed = parse_spec(spec, rank=rank, what="spec of smp.shard_tensor")
    if tf.executing_eagerly():
        return x
    y = tf.identity(x, name="smp_shard_tensor")
    y.op._set_attr(CONSTRAINT_ATTR, attr_value_pb2.AttrValue(s=constraint_text(parsed).encode()))
    return y


def variable_layouts(
    graph: ShardGraph,
    shapes: Mapping[str, Sequence[Optional[int]]],
    t: int,
    layout_map: Optional[Any],
    layers: Sequence[Any] = (),
) -> Dict[str, ShardSpec]:
    """The layout of every variable of a traced step: from `layout_map`
    when given (`resolve_layout`: its keys must match), else the built-in
    rules (`smp_tf.sharding.builtin`)."""
    if layout_map is not None:
        return resolve_layout(dict(layout_map), shapes, t)
    # The output layer first: a classifier's last hidden layer and its head
    # also look like an MLP pair, but the head split by classes lets the
    # loss run without gathering the logits.
    out = pair_layouts(graph, t, decided=output_layer_layouts(graph, t))
    # Each built-in rule splits only dimensions that t divides.
    for path, spec in attention_layouts(layers, t).items():
        if path in shapes:
            out[path] = spec
    # Embedding tables by vocabulary rows (a tied one is already decided).
    for path, spec in embedding_layouts(layers, t).items():
        if path in shapes and path not in out:
            out[path] = spec
    return out


#: Ops that may take the handle of a variable stored in pieces: each reads
#: its value (a read becomes reads of the pieces) or only its static shape.
_PIECEWISE_HANDLE_READERS = frozenset(["ReadVariableOp", "VariableShape"])


def stored_split(traced: Any, specs: Dict[str, ShardSpec], t: int, generation: Any = None) -> Dict[str, str]:
    """The variables of a traced step whose storage is split
    (`smp_tf.sharding.storage`): captured handle -> variable key.

    A variable is stored in pieces when its layout splits a dimension, the
    step only reads it (trainable, not written, every op on its handle a
    read or its static shape) and it is a plain resource variable. One
    placed for this `smp.init` already keeps what it has: split as before
    (its layout in `specs` is set to it), or whole (it stays whole, read
    whole and split for its readers).
    """
    from smp_tf import placement

    g = traced.op_graph
    out: Dict[str, str] = {}
    for name, cap in traced.captures.items():
        if not isinstance(cap, CapturedVariable) or name not in g.op_index:
            continue
        v = placement._resource_variable(cap.variable)
        if v is None:
            continue
        if generation is not None and placement.placed_in(v) == generation:
            dim = storage.split_dim_of(v)
            if dim is not None and len(storage.shards_of(v)) == t:
                specs[cap.key] = ShardSpec.split(v.shape.rank, dim)
                out[name] = cap.key
            continue
        spec = specs.get(cap.key)
        if spec is None or spec.partial or spec.split_dim is None or not g.trainable.get(cap.key, True):
            continue
        op = g.ops[g.op_index[name]]
        readers = [g.ops[c] for x in op.outputs for c in g.tensors[x].consumers]
        if any(r.writes or r.type not in _PIECEWISE_HANDLE_READERS for r in readers):
            continue
        out[name] = cap.key
    return out


def shard_step(traced: Any, cfg: Any, generation: Any = None) -> Any:
    """The traced step sharded over ``cfg.tensor_parallel_degree`` devices
    per stage, and its `ShardPlan` (`smp_tf.sharding.lower.shard_traced`).
    `generation`: the current `smp.init`'s, for the variables placed in it."""
    t = cfg.tensor_parallel_degree
    shapes: Dict[str, Any] = {}
    for cap in traced.captures.values():
        if isinstance(cap, CapturedVariable):
            shapes[cap.key] = tuple(cap.variable.shape.as_list())
    graph = shard_graph_of(traced.graph_def, traced.op_graph, [n for n in traced.output_names if n], t)
    specs = variable_layouts(graph, shapes, t, cfg.layout_map, traced.layers)
    pieces = stored_split(traced, specs, t, generation)
    sharded, plan = shard_traced(traced, specs, t, graph=graph, stored_split=pieces,
                                 sequence_parallel=bool(getattr(cfg, "sequence_parallel", False)))
    plan.whole_variables = sorted(k for k in shapes if k not in specs or specs[k].is_replicated)
    return sharded, plan
