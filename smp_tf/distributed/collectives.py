"""Collectives between the replicas of a partition, inside TensorFlow graphs.

Each partition's device forms a group with the same partition's device in
every other replica (group key ``GROUP_BASE + partition``). Every collective
is a TensorFlow collective op (ring all-reduce over gRPC on CPUs, NCCL on
GPUs) with:

* a fixed instance key derived from what it carries (``zlib.crc32`` of its
  site, partition, bucket, dtype and size), so that every rank, and every
  retrace, issues the same keys;
* the ordering token of its device: collectives of one device run in the
  order they were created, the same on every rank, while those of different
  devices are independent (a partition's all-reduce overlaps the rest of the
  pipeline);
* no timeout (a per-op timeout holds threads for its duration on every call);
  dead or stalled replicas are detected by the coordination service's
  heartbeats and by the step watchdog instead.

The gradient all-reduce is bucketed: the gradients of a partition are
concatenated, by dtype, into buckets of at most `BUCKET_BYTES`, each
all-reduced once. Every bucket carries two extra elements: the replica's
weight (1, or its number of rows under Keras ``fit``; it also scales the
replica's values) and 1 if the replica runs this step (0 from a replica that
ran out of data and only joins the collectives, `smp.join`). The sum is
divided by the summed weights, so uneven inputs average over the replicas
that had data, and a replica learns from the second sum how many are still
running.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from smp_tf.distributed import runtime
from smp_tf.sharding import pieces as data_pieces

__all__ = [
    "GROUP_BASE",
    "BUCKET_BYTES",
    "group_key",
    "instance_key",
    "all_reduce_sum",
    "reduce_scatter_sum",
    "all_gather",
    "Bucket",
    "GradientReducer",
    "buckets_of",
    "reduce_bucket",
    "reduce_scatter_bucket",
    "broadcast_variables",
    "sync_state",
    "last_plan",
    "replay",
]

#: Group key of partition p: GROUP_BASE + p (clear of tf.distribute's keys).
GROUP_BASE = 1000
#: Largest bucket of the gradient all-reduce (bytes).
BUCKET_BYTES = 8 << 20
#: A partition's gradient all-reduce starts as soon as that partition's
#: gradients are accumulated (True), or after the whole pipeline (False: for
#: measuring what the overlap gains, benchmarks/data_parallel).
OVERLAP = True


#: Group index of device k > 0 of a partition's tensor-parallel stage:
#: partition + k * SHARD_STRIDE (a collective group has one device per
#: replica, so each device of a stage has its own group).
SHARD_STRIDE = 1 << 12


def group_key(partition: int) -> int:
    """The collective group of a partition's devices across replicas."""
    return GROUP_BASE + int(partition)


def stage_group(partition: int, shard: int) -> int:
    """The group index (what `group_key` takes) of device `shard` of
    partition `partition`'s tensor-parallel stage across the replicas."""
    return int(partition) + SHARD_STRIDE * int(shard)


def instance_key(*parts: Any) -> int:
    """A key that every rank derives alike from what a collective carries."""
    return (zlib.crc32("|".join(str(p) for p in parts).encode()) & 0x3FFFFFFF) + 1


_TOKENS: Dict[str, Any] = {}


def _ordering_token(device: str) -> tf.Tensor:
    """The handle of the device's ordering token (a scalar variable, created once)."""
    token = _TOKENS.get(device)
    if token is None:
        with tf.init_scope(), tf.device(device):
            token = tf.Variable(0.0, trainable=False, name="smp_tf_ordering_token")
        _TOKENS[device] = token
    return token.handle


def _hint(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return "nccl" if (spec.device_type or "").upper() == "GPU" else "ring"


def _issue(collective: Callable[..., tf.Tensor], t: tf.Tensor, partition: int, device: str, key: int,
           **kwargs: Any) -> tf.Tensor:
    """Calls TensorFlow's `collective` on `t` over partition `partition`'s
    group, on `device`, keyed and ordered as every collective of smp_tf
    (module doc)."""
    group = runtime.group()
    full = group.device(device)
    with tf.device(full):
        return collective(
            t,
            group_size=group.size,
            group_key=group_key(partition),
            instance_key=key,
            communication_hint=_hint(device),
            timeout=0,
            ordering_token=_ordering_token(full),
            **kwargs,
        )


def all_reduce_sum(t: tf.Tensor, partition: int, device: str, key: int) -> tf.Tensor:
    """The sum of `t` over the replicas, on `device` (partition `partition`)."""
    from tensorflow.python.ops import collective_ops

    return _issue(collective_ops.all_reduce_v2, t, partition, device, key, merge_op="Add", final_op="Id")


def reduce_scatter_sum(t: tf.Tensor, partition: int, device: str, key: int) -> tf.Tensor:
    """Row ``rank`` of the sum over the replicas of `t` (shape ``[replicas,
    n]``), on `device`.

    TensorFlow's ``CollectiveReduceScatterV2`` has no CPU implementation
    (its collective registry has none for the ring), so this is
    ``CollectiveAllToAllV2`` (row ``j`` of every replica goes to replica
    ``j``) followed by the sum of the rows received, in replica order:
    each replica sends and receives ``(replicas - 1) / replicas`` of `t`,
    what a ring reduce-scatter moves, and every replica sums its row in the
    same order.
    """
    from tensorflow.python.ops import collective_ops

    received = _issue(collective_ops.all_to_all_v2, t, partition, device, key)
    with tf.device(runtime.group().device(device)):
        rows = tf.unstack(received, num=runtime.group().size)
        total = rows[0]
        for row in rows[1:]:
            total = total + row
        return total


def all_gather(t: tf.Tensor, partition: int, device: str, key: int) -> tf.Tensor:
    """The replicas' `t` (all of one shape) concatenated along dimension 0
    in replica order, on `device` (``CollectiveGatherV2``)."""
    from tensorflow.python.ops import collective_ops

    return _issue(collective_ops.all_gather_v2, t, partition, device, key)


# --------------------------------------------------------------------------
# The plan of a step's collectives (replayed by replicas without data)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """One all-reduce of a step: where it runs and what it carries.

    Attributes:
        partition: the partition (group) it belongs to.
        device: the local device it runs on.
        key: its instance key.
        dtype: its dtype name.
        size: its number of elements, the active-replica flag included.
    """

    partition: int
    device: str
    key: int
    dtype: str
    size: int


#: The collectives of the last traced step that reduced gradients, in the
#: order they were created: what a replica that ran out of data issues to
#: keep the others going (`smp.join`).
_LAST_PLAN: List[Bucket] = []


def last_plan() -> List[Bucket]:
    """The collectives of the last traced step that reduced gradients."""
    return list(_LAST_PLAN)


class _Plan:
    """The collectives of one emitted step, in creation order."""

    def __init__(self) -> None:
        self.buckets: List[Bucket] = []
        self._marker: Any = None

    def add(self, bucket: Bucket) -> None:
        global _LAST_PLAN
        self.buckets.append(bucket)
        _LAST_PLAN = self.buckets

    def started(self) -> List[Any]:
        """Control inputs of the step's collectives: the op that tells the
        watchdog the step started (created with the first collective)."""
        if self._marker is None:
            from smp_tf.distributed.watchdog import step_marker

            self._marker = step_marker()
        return [self._marker] if self._marker is not None else []


def replay(plan: Sequence[Bucket]) -> Callable[[], tf.Tensor]:
    """A function that issues `plan`'s collectives contributing nothing (zero
    weight, not running), and returns how many replicas are still running
    the step (0: all have finished)."""

    @tf.function(autograph=False)
    def shadow():
        running = [tf.constant(0.0)]
        steps = _Plan()
        for b in plan:
            with tf.control_dependencies(steps.started()):
                zeros = tf.zeros([b.size], b.dtype)
            summed = all_reduce_sum(zeros, b.partition, b.device, b.key)
            running.append(tf.cast(summed[-1], tf.float32))
        return tf.reduce_max(tf.stack(running))

    return shadow


# --------------------------------------------------------------------------
# Gradient all-reduce, bucketed per partition
# --------------------------------------------------------------------------
def _dense(x: Any) -> tf.Tensor:
    return tf.convert_to_tensor(x) if isinstance(x, tf.IndexedSlices) else x


def _dense_of_static_shape(values: Sequence[Any], collective: str) -> List[tf.Tensor]:
    """`values` as dense tensors, each of a static shape (what a bucket's
    layout and its collective's key need)."""
    dense = [_dense(x) for x in values]
    if any(not x.shape.is_fully_defined() for x in dense):
        raise ValueError(
            f"smp_tf can only {collective} gradients of static shape across replicas; "
            f"got shapes {[x.shape for x in dense]}."
        )
    return dense


def buckets_of(members: Sequence[int], partition_of: Dict[int, int], nbytes: Dict[int, int],
               dtypes: Dict[int, tf.DType]) -> List[Tuple[int, List[int]]]:
    """Groups outputs into buckets: per partition, the last outputs first
    (the gradients of the last layers are ready first), by dtype, each at
    most `BUCKET_BYTES`. Returns (partition, member indices) per bucket, in
    the order they are all-reduced; the same on every rank."""
    by_partition: Dict[int, List[int]] = {}
    for k in members:
        by_partition.setdefault(partition_of[k], []).append(k)
    out: List[Tuple[int, List[int]]] = []
    for p, ks in sorted(by_partition.items()):
        current: Optional[List[int]] = None
        size = 0
        for k in reversed(ks):
            b = nbytes.get(k, 0)
            if current is None or dtypes[current[0]] != dtypes[k] or size + b > BUCKET_BYTES:
                current = []
                out.append((p, current))
                size = 0
            current.append(k)
            size += b
    return out


def reduce_bucket(
    values: Sequence[Any],
    partition: int,
    device: str,
    index: int,
    site: str,
    plan: "_Plan",
    weight: Any = None,
    raise_if_uneven: bool = False,
) -> List[Any]:
    """The weighted mean over the replicas of one bucket of local values.

    Each replica contributes ``weight * value`` and its weight (1 by default;
    0 from a replica without data, which only joins the collective); the
    result is the sum divided by the summed weights. None values stay None.
    """
    present = [i for i, v in enumerate(values) if v is not None]
    out: List[Any] = [None] * len(values)
    if not present:
        return out
    with tf.device(device):
        dense = _dense_of_static_shape([values[i] for i in present], "all-reduce")
        dtype = dense[0].dtype
        sizes = [int(x.shape.num_elements()) for x in dense]
        with tf.control_dependencies(plan.started()):
            packed, total = _pack(dense, dtype, weight)
        key = instance_key("grad", site, partition, index, dtype.name, total)
        plan.add(Bucket(partition, device, key, dtype.name, total))
        summed = all_reduce_sum(packed, partition, device, key)
        mean = _unpack(summed, raise_if_uneven)
        parts = tf.split(mean, sizes) if len(sizes) > 1 else [mean]
        for i, part, x in zip(present, parts, dense):
            out[i] = tf.reshape(part, tf.shape(x))
    return out


def reduce_scatter_bucket(
    values: Sequence[Any],
    partition: int,
    device: str,
    index: int,
    site: str,
    plan: "_Plan",
    weight: Any = None,
    raise_if_uneven: bool = False,
) -> List[Any]:
    """This replica's piece of the weighted mean over the replicas of each
    of one bucket's local values (``shard_optimizer_state``).

    The bucket is laid out as a ``[replicas, chunk]`` matrix whose row ``j``
    holds replica ``j``'s piece of every value (`smp_tf.sharding.pieces`),
    followed by the weight and the running flag of `reduce_bucket`, and
    reduce-scattered (`reduce_scatter_sum`): each replica receives only the
    sum of its own row. Returns, per value, its piece (1-D, padded,
    registered with `smp_tf.sharding.pieces.register`); None values stay
    None.
    """
    present = [i for i, v in enumerate(values) if v is not None]
    out: List[Any] = [None] * len(values)
    if not present:
        return out
    group = runtime.group()
    replicas, rank = group.size, group.rank
    with tf.device(device):
        dense = _dense_of_static_shape([values[i] for i in present], "reduce-scatter")
        dtype = dense[0].dtype
        parts = [data_pieces.Piece(tuple(x.shape.as_list()), replicas, rank) for x in dense]
        with tf.control_dependencies(plan.started()):
            w = tf.ones([], dtype) if weight is None else tf.cast(weight, dtype)
            rows = []
            for x, piece in zip(dense, parts):
                flat = tf.reshape(tf.cast(x, dtype), [-1]) * w
                flat = tf.pad(flat, [[0, piece.length * replicas - piece.size]])
                rows.append(tf.reshape(flat, [replicas, piece.length]))
            trailer = tf.tile(tf.reshape(tf.stack([w, tf.ones([], dtype)]), [1, 2]), [replicas, 1])
            matrix = tf.concat(rows + [trailer], axis=1)
        chunk = sum(p.length for p in parts) + 2
        key = instance_key("grad-scatter", site, partition, index, dtype.name, chunk)
        summed = reduce_scatter_sum(matrix, partition, device, key)
        mean = _unpack(summed, raise_if_uneven)
        split = tf.split(mean, [p.length for p in parts]) if len(parts) > 1 else [mean]
        for i, part, piece in zip(present, split, parts):
            out[i] = data_pieces.register(part, piece)
    return out


class GradientReducer:
    """The data-parallel mean of a step's gradient outputs, in buckets.

    A gradient's `StepOutput.accumulate()` asks for its mean over the
    micro-batches and the replicas; the first request of a bucket
    accumulates every member of the bucket, all-reduces them at once on the
    partition's device and keeps the results.

    Args:
        local_values: flat output index -> a function computing the output's
            local mean over micro-batches.
        members: the flat indices of the gradient outputs.
        partition_of: flat output index -> partition.
        devices: device of each partition.
        nbytes: flat output index -> bytes (for bucketing; 0 if unknown).
        dtypes: flat output index -> dtype.
        site: names the emission (same on every rank).
        raise_if_uneven: every replica must contribute (else an error).
        plan: where the bucket all-reduces are recorded, in order.
        scatter: reduce-scatter instead of all-reduce: each gradient's
            value is this replica's piece of the mean
            (``shard_optimizer_state``, `reduce_scatter_bucket`).
    """

    def __init__(
        self,
        local_values: Dict[int, Callable[[], Any]],
        members: Sequence[int],
        partition_of: Dict[int, int],
        devices: Sequence[str],
        nbytes: Dict[int, int],
        dtypes: Dict[int, tf.DType],
        site: str,
        raise_if_uneven: bool = False,
        plan: Optional[_Plan] = None,
        after_pipeline: Sequence[Any] = (),
        scatter: bool = False,
    ) -> None:
        self._local = local_values
        self._scatter = scatter
        self._reduce = reduce_scatter_bucket if scatter else reduce_bucket
        self._after_pipeline = list(after_pipeline)
        self._site = site
        self._raise = raise_if_uneven
        self._devices = list(devices)
        self._plan = plan if plan is not None else _Plan()
        self._buckets = buckets_of(members, partition_of, nbytes, dtypes)
        self._bucket_of = {k: b for b, (_, ks) in enumerate(self._buckets) for k in ks}
        self._index_in_partition = {}
        seen: Dict[int, int] = {}
        for b, (p, _) in enumerate(self._buckets):
            self._index_in_partition[b] = seen.get(p, 0)
            seen[p] = seen.get(p, 0) + 1
        self._result: Dict[int, Any] = {}

    def __contains__(self, k: int) -> bool:
        return k in self._bucket_of

    def value(self, k: int) -> Any:
        """The mean of output `k` over micro-batches and contributing replicas."""
        if k not in self._result:
            b = self._bucket_of[k]
            p, ks = self._buckets[b]
            deps = [] if OVERLAP else self._after_pipeline
            with tf.device(self._devices[p]), tf.control_dependencies(deps):
                locals_ = [self._local[m]() for m in ks]
            # A gradient held in pieces over a tensor-parallel stage is
            # reduced piece by piece, each on its own device.
            split = [None if v is None or self._scatter else data_pieces.split_of(v) for v in locals_]
            reduced = self._reduce(
                [None if g is not None else v for v, g in zip(locals_, split)], p, self._devices[p],
                self._index_in_partition[b], self._site, self._plan, raise_if_uneven=self._raise,
            )
            for i, (m, v, local) in enumerate(zip(ks, reduced, locals_)):
                if split[i] is not None:
                    self._result[m] = self._reduce_pieces(split[i], p, f"{self._index_in_partition[b]}/{i}")
                    continue
                # The bucket's dtype is its values': the cast returns a
                # registered piece itself.
                self._result[m] = None if local is None else tf.cast(v, _dense(local).dtype)
        return self._result[k]

    def _reduce_pieces(self, split: Any, partition: int, index: str) -> tf.Tensor:
        """The mean over the replicas of a gradient held in pieces: each
        piece all-reduced on its device, in the group of that device of the
        stage (`stage_group`); the result held in pieces again."""
        out = []
        for k, piece in enumerate(split.pieces):
            device = piece.device
            (mean,) = reduce_bucket([piece], stage_group(partition, k), device, index, self._site, self._plan,
                                    raise_if_uneven=self._raise)
            out.append(mean)
        with tf.device(out[0].device):
            whole = tf.concat(out, axis=split.axis)
        return data_pieces.register_split(whole, split.axis, out)


def _pack(values: Sequence[tf.Tensor], dtype: tf.DType, weight: Any) -> Tuple[tf.Tensor, int]:
    """[weight * values..., weight, 1]: what a running replica contributes."""
    w = tf.ones([], dtype) if weight is None else tf.cast(weight, dtype)
    flat = [tf.reshape(tf.cast(x, dtype), [-1]) * w for x in values]
    packed = tf.concat(flat + [tf.reshape(w, [1]), tf.ones([1], dtype)], axis=0)
    return packed, sum(int(x.shape.num_elements()) for x in values) + 2


def _unpack(summed: tf.Tensor, raise_if_uneven: bool) -> tf.Tensor:
    """The weighted mean from a summed bucket; with ``uneven_inputs='raise'``
    every replica must be running the step."""
    weights, running = summed[-2], summed[-1]
    if raise_if_uneven:
        check = tf.debugging.assert_equal(
            tf.cast(tf.round(running), tf.int32), runtime.group().size,
            message=(
                "smp_tf: a data-parallel replica ran out of data before the others "
                "(uneven inputs, and the config says uneven_inputs='raise')"
            ),
        )
        with tf.control_dependencies([check]):
            weights = tf.identity(weights)
    return summed[:-2] / tf.maximum(weights, tf.ones([], weights.dtype) * 1e-30)


def sync_state(
    variables: Sequence[Any],
    partition_of: Sequence[int],
    devices: Sequence[str],
    after: Dict[int, Any],
    site: str,
    plan: _Plan,
    raise_if_uneven: bool = False,
    weight: Any = None,
) -> List[Any]:
    """Averages, over the contributing replicas, the state a step wrote.

    BatchNorm statistics (and any float variable the step writes that is not
    trained) are updated by each replica from its own data; averaging the new
    values keeps every replica's variables identical, as a mirrored variable
    with mean aggregation does. Runs after partition p's last action
    (`after[p]`).

    Returns:
        The assignment ops.
    """
    by_key: Dict[Tuple[int, str], List[Any]] = {}
    for v, p in zip(variables, partition_of):
        by_key.setdefault((p, v.dtype.name), []).append(v)
    ops = []
    for (p, dtype), vs in sorted(by_key.items()):
        device = devices[p]
        sizes = [int(v.shape.num_elements()) for v in vs]
        deps = ([after[p]] if p in after else []) + plan.started()
        with tf.device(device), tf.control_dependencies(deps):
            active = None if weight is None else tf.cast(tf.cast(weight, tf.bool), dtype)
            flat, total = _pack([v.read_value() for v in vs], tf.as_dtype(dtype), active)
            key = instance_key("state", site, p, dtype, total)
            plan.add(Bucket(p, device, key, dtype, total))
            summed = all_reduce_sum(flat, p, device, key)
            mean = _unpack(summed, raise_if_uneven)
            parts = tf.split(mean, sizes) if len(sizes) > 1 else [mean]
            for v, part in zip(vs, parts):
                ops.append(v.assign(tf.reshape(part, v.shape), read_value=False))
    return ops


# --------------------------------------------------------------------------
# Broadcast of variables from rank 0
# --------------------------------------------------------------------------
def broadcast_variables(
    variables: Sequence[Any], partition_of: Sequence[int], devices: Sequence[str], site: str, root: int = 0
) -> None:
    """Gives every replica `root`'s values of `variables` (eagerly).

    A masked all-reduce per partition and dtype (the root adds the values,
    the others zeros), ordered by the device's token like every other
    collective. Every rank must pass the same variables in the same order.
    """
    group = runtime.group()
    if group is None or group.size == 1 or not variables:
        return
    by_key: Dict[Tuple[int, str], List[Any]] = {}
    for v, p in zip(variables, partition_of):
        # Keras variables: their tf.Variable (what is read and assigned).
        v = v if isinstance(v, tf.Variable) else getattr(v, "_value", v)
        by_key.setdefault((p, tf.as_dtype(v.dtype).name), []).append(v)
    with tf.init_scope():
        for (p, dtype), vs in sorted(by_key.items()):
            device = devices[p]
            sizes = [int(v.shape.num_elements()) for v in vs]
            total = sum(sizes)
            key = instance_key("broadcast", site, root, p, dtype, total)

            @tf.function(autograph=False)
            def sync(vs=vs, sizes=sizes, p=p, device=device, key=key):
                with tf.device(group.device(device)):
                    flat = tf.concat([tf.reshape(v.read_value(), [-1]) for v in vs], axis=0)
                    if group.rank != root:
                        flat = tf.zeros_like(flat)
                    summed = all_reduce_sum(flat, p, device, key)
                    for v, part in zip(vs, tf.split(summed, sizes) if len(sizes) > 1 else [summed]):
                        v.assign(tf.reshape(part, v.shape))

            sync()
