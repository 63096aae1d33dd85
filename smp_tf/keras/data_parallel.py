"""Keras ``fit`` and ``evaluate`` with data parallelism (``horovod`` on, several processes).

What changes from one pipeline:

* **Input sharding** (``shard_inputs=True``, the default, as
  ``tf.distribute`` does): every replica iterates the same data, and takes
  its share of each batch, rows ``rank, rank + size, ...``; ``batch_size``
  is the global batch. With ``shard_inputs=False`` each replica trains on
  the data it is given (shard it yourself), and ``batch_size`` is per
  replica.
* **Gradients**: each replica's accumulated gradients are averaged over the
  replicas in buckets, per partition, on the partition's device, weighted
  by the replica's rows: the result is the mean over the global batch. A
  replica whose share of a (last, small) batch is empty contributes nothing.
* **State** written by the step (BatchNorm statistics) is averaged over the
  replicas after every step, so every replica keeps identical variables.
* **Uneven inputs** (``shard_inputs=False``, replicas with different numbers
  of batches): at the end of an epoch a replica that finished first joins
  the others' remaining steps (`smp_tf.distributed.join`), then every
  replica takes the variables of one that finished last.
* **Metrics**: per batch, each replica's metrics (the progress bar) are its
  own; the epoch's logs (``History``, callbacks) are computed from the
  metrics' states summed over the replicas, so they describe the global
  data, as with ``tf.distribute``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import tensorflow as tf

from smp_tf import state
from smp_tf.distributed import collectives

__all__ = ["shard", "reduce_gradients", "sync_written_state", "global_metrics", "run_or_contribute_nothing"]


def shard(data: Any, rank: int, size: int) -> Any:
    """This replica's rows (``rank, rank + size, ...``) of every batched leaf."""
    def take(t):
        if t is None or not hasattr(t, "shape") or t.shape.rank == 0:
            return t
        return t[rank::size]

    return tf.nest.map_structure(take, data)


def run_or_contribute_nothing(rows: tf.Tensor, run: Callable[[], Tuple[Any, List[Any], Any]],
                              gradient_shapes: List[Any]) -> Tuple[Any, List[Any], Any]:
    """Runs the pipelined step, or, on a replica whose share of the batch is
    empty, returns a zero loss, zero gradients and no predictions (it still
    joins the collectives that follow)."""
    static = tf.get_static_value(rows)
    if static is not None and static > 0:
        return run()
    structure: Dict[str, Any] = {}

    def pipelined():
        loss, grads, y_pred = run()
        structure["grads"] = [g is None for g in grads]
        structure["dtypes"] = [g.dtype for g in grads if g is not None]
        structure["y_pred"] = y_pred
        flat = tf.nest.flatten(y_pred)
        dense = [tf.convert_to_tensor(g) for g in grads if g is not None]
        return [loss] + dense + flat

    def empty():
        y_pred = structure["y_pred"]
        loss = tf.zeros([], tf.float32)
        shapes = [s for s, none in zip(gradient_shapes, structure["grads"]) if not none]
        zeros = [tf.zeros(s, d) for s, d in zip(shapes, structure["dtypes"])]
        # No rows: predictions of shape [0, ...] (the other dimensions as traced).
        flat = [tf.zeros([0] + [d if d is not None else 1 for d in t.shape.as_list()[1:]], t.dtype)
                for t in tf.nest.flatten(y_pred)]
        return [loss] + zeros + flat

    out = tf.cond(rows > 0, pipelined, empty)
    loss = out[0]
    n_grads = sum(1 for none in structure["grads"] if not none)
    dense = iter(out[1:1 + n_grads])
    grads = [None if none else next(dense) for none in structure["grads"]]
    y_pred = tf.nest.pack_sequence_as(structure["y_pred"], out[1 + n_grads:])
    return loss, grads, y_pred


def reduce_gradients(grads: List[Any], variables: List[Any], weight: tf.Tensor, site: str,
                     raise_if_uneven: bool) -> List[Any]:
    """The mean over the replicas of each replica's gradients, weighted by
    its rows, bucketed per partition (the partition of the variable); under
    ``shard_optimizer_state`` this replica's piece of each mean
    (`collectives.reduce_scatter_bucket`)."""
    devices = state.topology().devices
    from smp_tf.placement import partition_of_device

    def partition(v):
        return partition_of_device(v.value.device if hasattr(v, "value") else v.device, devices)

    members = [k for k, g in enumerate(grads) if g is not None]
    partition_of = {k: partition(variables[k]) for k in members}
    nbytes = {k: int(variables[k].shape.num_elements()) * tf.as_dtype(variables[k].dtype).size for k in members}
    dtypes = {k: tf.as_dtype(grads[k].dtype) for k in members}
    plan = collectives._Plan()
    out = list(grads)
    index: Dict[int, int] = {}
    reduce = collectives.reduce_bucket
    if state.config().shard_optimizer_state:
        from smp_tf.sharding import optimizer_state

        optimizer_state.begin_step()
        reduce = collectives.reduce_scatter_bucket
    for p, ks in collectives.buckets_of(members, partition_of, nbytes, dtypes):
        i = index.get(p, 0)
        index[p] = i + 1
        reduced = reduce(
            [grads[k] for k in ks], p, devices[p], i, site, plan, weight=weight, raise_if_uneven=raise_if_uneven,
        )
        for k, r in zip(ks, reduced):
            out[k] = tf.cast(r, grads[k].dtype)
    return out


def sync_written_state(step_function: Any, weight: tf.Tensor, after: List[Any], site: str,
                       raise_if_uneven: bool) -> None:
    """Averages over the replicas the state the step wrote (after the step)."""
    entry = step_function.last_compiled
    written = entry.written_state() if entry is not None else []
    if not written:
        return
    with tf.control_dependencies([t for t in after if t is not None]):
        anchor = tf.no_op()
    plan = collectives._Plan()
    collectives.sync_state(
        [v for v, _ in written], [p for _, p in written], entry.devices,
        {p: anchor for _, p in written}, site, plan, raise_if_uneven, weight=weight,
    )


_METRIC_CALLS: Dict[str, int] = {}


def global_metrics(model: Any) -> Dict[str, Any]:
    """The model's metrics from their states summed over the replicas."""
    metrics = list(model.metrics)
    variables = [v for m in metrics for v in m.variables]
    group = state.process_group()
    if not variables:
        return model.get_metrics_result()
    values: List[Any] = [None] * len(variables)
    by_dtype: Dict[str, List[int]] = {}
    for i, v in enumerate(variables):
        by_dtype.setdefault(tf.as_dtype(v.dtype).name, []).append(i)
    device = state.topology().devices[0]
    for dtype, idx in sorted(by_dtype.items()):
        sizes = [max(1, int(variables[i].shape.num_elements())) for i in idx]
        key = collectives.instance_key("metrics", dtype, len(idx), sum(sizes))

        @tf.function(autograph=False)
        def summed(idx=idx, sizes=sizes, key=key):
            with tf.device(group.device(device)):
                flat = tf.concat([tf.reshape(tf.convert_to_tensor(variables[i]), [-1]) for i in idx], 0)
                out = collectives.all_reduce_sum(flat, 0, device, key)
                return tf.split(out, sizes) if len(sizes) > 1 else [out]

        for i, part in zip(idx, summed()):
            values[i] = tf.reshape(part, variables[i].shape)
    logs: Dict[str, Any] = {}
    position = 0
    for m in metrics:
        n = len(m.variables)
        result = m.stateless_result(values[position:position + n])
        position += n
        if isinstance(result, dict):
            logs.update(result)
        else:
            logs[m.name] = result
    from keras.src.utils import python_utils

    return python_utils.pythonify_logs(logs)
