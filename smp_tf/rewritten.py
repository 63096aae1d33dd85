"""A task's memory on the graph TensorFlow runs: its function after Grappler.

TensorFlow does not run a function's traced graph as it is: Grappler
rewrites it first (constant folding simplifies arithmetic and moves
constant factors, function inlining, pruning, ...), and the executor runs
the result. The rewrites change which ops exist and which can run early.
On `keras.applications.ConvNeXtTiny` (P=2, M=4) they compute factors of
the GELU gradients that depend only on forward values at the start of the
backward task, where the traced graph has them after the incoming
gradient: the task's traced prediction was 72.7 MB, its measured peak
86.9 MB, and the prediction on the rewritten graph 86.9 MB (256 bytes
less than the measurement).

`rewritten_workspace` runs Grappler on a task's concrete function with
the runtime's own rewrite options (``tf.config.optimizer``), reads the
result into an `OpGraph` (shapes the rewrite leaves unknown are taken from
the traced function by tensor name: a rewrite keeps the names of the ops it
keeps) and returns `smp_tf.memory.task_workspace` on it. Anything that
fails returns None, and the caller keeps the traced prediction.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import tensorflow as tf

from smp_tf.graph_view import from_tf_graph
from smp_tf.memory import task_workspace
from smp_tf.rewrite import Task

__all__ = ["rewritten_graph", "rewritten_workspace"]

_log = logging.getLogger(__name__)


def rewritten_graph(fn: Any) -> tf.Graph:
    """The graph Grappler makes of concrete function `fn`'s graph, with the
    runtime's rewrite options, fetching the function's outputs.

    Raises:
        Whatever Grappler or the import raises (the caller falls back).
    """
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context
    from tensorflow.python.grappler import tf_optimizer

    traced = fn.graph
    meta = tf.compat.v1.train.export_meta_graph(graph_def=traced.as_graph_def(add_shapes=True), graph=traced)
    fetch = meta.collection_def["train_op"].node_list.value
    for t in fn.outputs:
        fetch.append(t.name)
    config = config_pb2.ConfigProto()
    config.CopyFrom(context.context().config)
    optimized = tf_optimizer.OptimizeGraph(config, meta, graph_id=b"smp_tf_task")
    out = tf.Graph()
    with out.as_default():
        tf.graph_util.import_graph_def(optimized, name="")
    shapes = {t.name: t.shape for op in traced.get_operations() for t in op.outputs}
    for op in out.get_operations():
        for t in op.outputs:
            if not t.shape.is_fully_defined() and t.name in shapes:
                try:
                    t.set_shape(shapes[t.name])
                except ValueError:
                    pass  # the rewrite changed this tensor: keep what it says
    return out


def rewritten_workspace(fn: Any, partition: int, wave: int, cpu_scratch: bool = True,
                        on_cpu: bool = True) -> Optional[int]:
    """`task_workspace` of the task whose concrete function is `fn`, on the
    graph Grappler makes of it (module doc); None where that fails."""
    try:
        graph = rewritten_graph(fn)
        op_graph = from_tf_graph(graph)
        index = {op.name: op.index for op in op_graph.ops}
        outputs = []
        for t in fn.outputs:
            name, _, k = t.name.rpartition(":")
            if name in index and int(k) < len(op_graph.ops[index[name]].outputs):
                outputs.append(op_graph.ops[index[name]].outputs[int(k)])
        members = [op.index for op in op_graph.ops if op.kind == "op"]
        task = Task(partition, wave, members=members, outputs=outputs)
        return task_workspace(op_graph, task, cpu_scratch=cpu_scratch, on_cpu=on_cpu)
    except Exception as e:  # noqa: BLE001 - any failure keeps the traced prediction
        _log.debug("smp_tf: no rewritten graph for task (%d, %d): %s", partition, wave, e)
        return None
