"""Records, while a step is traced, which Keras layer and which
`smp.partition(i)` block created each op.

Op names are not enough for either: TensorFlow uniquifies name scopes per
graph (a layer called ``dense`` may trace under ``sequential_1/dense_1``), and
a `smp.partition` block has no name at all. Ops get increasing ids in
creation order, so a context that is active from id ``a`` to id ``b`` owns the
ops created in between; the innermost context wins.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["partition", "TraceRecord", "recording"]

_local = threading.local()


def _current_record() -> Optional["TraceRecord"]:
    """The record of the graph being built now, inside `recording()`; else None."""
    records = getattr(_local, "records", None)
    if records is None:
        return None
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    for r in records:
        if r.graph is graph:
            return r
    r = TraceRecord(graph)
    records.append(r)
    return r


def _next_op_id(graph: Any) -> int:
    """Id of the newest op of `graph` (0 for an empty graph).

    Op ids are not dense (a new graph starts at 2), so the count of ops is
    not the newest id.
    """
    ops = graph.get_operations()
    return ops[-1]._id if ops else 0


class TraceRecord:
    """What one trace recorded: op id -> layer, op id -> manual partition."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.layer_of_op: Dict[int, Any] = {}
        self.partition_of_op: Dict[int, int] = {}
        self.layers: List[Any] = []

    def _close(self, start: int, target: Dict[int, Any], value: Any) -> None:
        end = _next_op_id(self.graph)
        for op_id in range(start + 1, end + 1):
            # Inner contexts close first, so setdefault keeps the innermost.
            target.setdefault(op_id, value)

    def layer_name_of(self, op: Any) -> Optional[str]:
        layer = self.layer_of_op.get(op._id)
        return None if layer is None else _layer_key(layer)

    def partition_of(self, op: Any) -> Optional[int]:
        return self.partition_of_op.get(op._id)


def _layer_key(layer: Any) -> str:
    # Layers are identified by object; the key must be unique and readable.
    return f"{getattr(layer, 'name', type(layer).__name__)}#{id(layer):x}"


@contextlib.contextmanager
def _in_graph_context(record: TraceRecord, target: Dict[int, Any], value: Any) -> Iterator[None]:
    start = _next_op_id(record.graph)
    try:
        yield
    finally:
        record._close(start, target, value)


_patch_lock = threading.Lock()
_patch_depth = 0
_original_call = None


def _patched_layer_call(self, *args, **kwargs):
    record = _current_record()
    if record is None or _is_model(self):
        # A model's own ops (the glue in a subclassed model's call: residual
        # adds, a tied projection) span the whole network; grouping them as
        # one "layer" would pin them all together. Its layers still record.
        return _original_call(self, *args, **kwargs)
    if not any(l is self for l in record.layers):
        record.layers.append(self)
    with _in_graph_context(record, record.layer_of_op, self):
        return _original_call(self, *args, **kwargs)


def _is_model(layer: Any) -> bool:
    import keras

    return isinstance(layer, keras.Model)


@contextlib.contextmanager
def recording() -> Iterator[List[TraceRecord]]:
    """Records layers and partition blocks of the ops of every graph traced inside.

    Yields a list that receives one `TraceRecord` per graph in which a layer
    was called or a `smp.partition` block was entered.
    """
    import keras

    global _patch_depth, _original_call
    records: List[TraceRecord] = []
    prev = getattr(_local, "records", None)
    _local.records = records
    with _patch_lock:
        if _patch_depth == 0:
            _original_call = keras.layers.Layer.__call__
            keras.layers.Layer.__call__ = _patched_layer_call
        _patch_depth += 1
    try:
        yield records
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                keras.layers.Layer.__call__ = _original_call
        _local.records = prev


class partition(contextlib.ContextDecorator):
    """Places the ops created inside the block on partition `index`.

    Used with ``auto_partition=False``: ops outside any block go to
    ``default_partition``. Blocks nest; the innermost wins. Outside a traced
    `smp.step` (for example when the model runs eagerly) the block has no
    effect.

    Args:
        index: partition index, ``0 <= index < partitions``.

    Raises:
        ValueError: `index` is not an int or is out of range.
    """

    def __init__(self, index: int) -> None:
        from smp_tf import state

        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(
                f"smp.partition expects an int partition index. Received: {index!r}"
            )
        if index < 0:
            raise ValueError(
                f"smp.partition index must be >= 0. Received: index={index}"
            )
        if state.is_initialized() and index >= state.config().partitions:
            raise ValueError(
                f"smp.partition index {index} must be less than the number of "
                f"partitions ({state.config().partitions})."
            )
        self.index = index
        self._cm = None

    def __enter__(self) -> "partition":
        record = _current_record()
        if record is None:
            self._cm = contextlib.nullcontext()
        else:
            self._cm = _in_graph_context(record, record.partition_of_op, self.index)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        cm, self._cm = self._cm, None
        return bool(cm.__exit__(*exc))
