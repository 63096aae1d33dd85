"""`smp.shard_tensor` and the layout of a traced step's variables."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from smp_tf.sharding.builtin import attention_layouts, output_layer_layouts, pair_layouts
from smp_tf.sharding.completion import ShardGraph
from smp_tf.sharding.layout_map import resolve_layout
from smp_tf.sharding.lower import shard_traced
from smp_tf.sharding.read import CONSTRAINT_ATTR, constraint_text, shard_graph_of
from smp_tf.trace import CapturedVariable
from smp_tf.sharding.spec import ShardSpec, parse_spec

__all__ = ["shard_tensor", "variable_layouts", "shard_step"]


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
    return out


def shard_step(traced: Any, cfg: Any) -> Any:
    """The traced step sharded over ``cfg.tensor_parallel_degree`` devices
    per stage, and its `ShardPlan` (`smp_tf.sharding.lower.shard_traced`)."""
    t = cfg.tensor_parallel_degree
    shapes: Dict[str, Any] = {}
    for cap in traced.captures.values():
        if isinstance(cap, CapturedVariable):
            shapes[cap.key] = tuple(cap.variable.shape.as_list())
    graph = shard_graph_of(traced.graph_def, traced.op_graph, [n for n in traced.output_names if n], t)
    specs = variable_layouts(graph, shapes, t, cfg.layout_map, traced.layers)
    sharded, plan = shard_traced(traced, specs, t, graph=graph)
    plan.whole_variables = sorted(k for k in shapes if k not in specs or specs[k].is_replicated)
    return sharded, plan
