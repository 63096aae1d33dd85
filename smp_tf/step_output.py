"""`StepOutput`: one value returned by an `smp.step` function.

An `smp.step` function runs once per micro-batch, so each value it returns
exists ``M`` times. `StepOutput` holds those ``M`` values (in micro-batch
order) and combines them: `reduce_mean` (e.g. a loss), `accumulate` (e.g.
gradients), `merge` (e.g. predictions, back in the original row order) and
the lower-level `reduce_sum`, `concat` and `stack`. All of them build
TensorFlow ops, so they work eagerly and inside `tf.function`.
"""

from __future__ import annotations

import smp_tf._autograph  # noqa: F401  (keeps AutoGraph out of smp_tf)

import functools
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf

from smp_tf.split import merge_microbatches

__all__ = ["StepOutput", "FusedOp", "SplitValue"]

# The combinations use plain Python control flow over Python values; AutoGraph
# must not rewrite them when they are called inside a tf.function.
_no_autograph = tf.autograph.experimental.do_not_convert


def _combination(method):
    """Runs a combination on the device that produced the values.

    In a pipeline the values of a gradient live on the device of its
    variable's partition; summing them there avoids sending every
    micro-batch's gradient to another device.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with tf.device(self._device() or None):
            return method(self, *args, **kwargs)

    return _no_autograph(wrapper)


def _count_constant(count: int, dtype: tf.DType, device: str) -> tf.Tensor:
    """`tf.constant(count, dtype)` on `device` (the device of the values it
    divides), made once per graph, dtype and device rather than once per
    gradient: the graph optimiser would merge the copies anyway, and each op
    costs the first call about half a millisecond to build."""
    if tf.executing_eagerly():
        return tf.constant(count, dtype=dtype)
    graph = tf.compat.v1.get_default_graph()
    # Kept on the graph, as the step's other per-graph state is.
    cache = getattr(graph, "_smp_tf_counts", None)
    if cache is None:
        cache = graph._smp_tf_counts = {}
    key = (count, dtype, device)
    if key not in cache:
        # Outside any control dependencies of the caller, which the later
        # users of the constant do not share.
        with tf.control_dependencies(None), tf.device(device or None):
            cache[key] = tf.constant(count, dtype=dtype)
    return cache[key]


class SplitValue:
    """One micro-batch's value of a gradient the step returns in pieces.

    With tensor parallelism, a split variable's gradient is made in ``t``
    pieces, piece k on device k of its stage. The step returns the pieces
    (`smp_tf.sharding.lower`): `StepOutput.accumulate` sums each piece on
    its own device, and the optimizer's update of the split variable reads
    them piece by piece, so no device holds the whole gradient. Anything
    that needs the value as one tensor (`reduce_mean`, indexing a
    `StepOutput`, ``tf.convert_to_tensor``) gets the pieces concatenated on
    piece 0's device.

    Attributes:
        axis: the dimension the pieces split.
        pieces: the pieces, in device order.
        devices: the device each piece is made on (a task's outputs carry
            the device of its call, its stage's first device, whichever
            device made them).
    """

    __slots__ = ("axis", "pieces", "devices")

    def __init__(self, axis: int, pieces: Sequence[tf.Tensor], devices: Optional[Sequence[str]] = None) -> None:
        self.axis = int(axis)
        self.pieces = tuple(pieces)
        self.devices = tuple(devices) if devices is not None else tuple(p.device for p in self.pieces)
        if len(self.devices) != len(self.pieces):
            raise ValueError(f"SplitValue needs one device per piece. Received {len(self.pieces)} pieces and "
                             f"devices={list(self.devices)}")

    @property
    def device(self) -> str:
        """Piece 0's device (where the whole value is made when asked for)."""
        return self.devices[0]

    @property
    def dtype(self) -> tf.DType:
        return self.pieces[0].dtype

    def whole(self) -> tf.Tensor:
        """The pieces concatenated, on piece 0's device."""
        with tf.device(self.device or None):
            return tf.concat(list(self.pieces), axis=self.axis)


tf.register_tensor_conversion_function(
    SplitValue, lambda value, dtype=None, name=None, as_ref=False: value.whole())


def _public(value: Any) -> Any:
    """A micro-batch value as the user sees it: a split one whole."""
    return value.whole() if isinstance(value, SplitValue) else value


def _describe(value: Any) -> str:
    if isinstance(value, SplitValue):
        shape = list(value.pieces[0].shape)
        shape[value.axis] = sum(int(p.shape[value.axis]) for p in value.pieces)
        return f"dtype={value.dtype.name}, shape={tuple(shape)}, in {len(value.pieces)} pieces along axis {value.axis}"
    if isinstance(value, tf.IndexedSlices):
        return f"tf.IndexedSlices(dtype={value.dtype.name}, dense_shape={value.dense_shape})"
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return f"dtype={value.dtype.name}, shape={tuple(value.shape) if value.shape.rank is not None else None}"
    return f"type={type(value).__name__}"


@dataclass(frozen=True)
class FusedOp:
    """A step output computed from its inputs after the pipeline.

    With ``fuse_weight_gradients`` a weight gradient is not computed inside
    the pipeline for each micro-batch: the pipeline returns the op's inputs,
    and the op runs once here, on all micro-batches' inputs concatenated
    along axis 0 (which yields the sum of the per-micro-batch values), or
    once per micro-batch when those values are asked for.

    Attributes:
        op_type: ``"MatMul"`` (with ``transpose_a=True``) or ``"BiasAddGrad"``.
        data_format: the ``data_format`` of a ``BiasAddGrad``.
        device: the device of the op's partition.
    """

    op_type: str
    data_format: str = "NHWC"
    device: str = ""

    def apply(self, inputs: Sequence[tf.Tensor]) -> tf.Tensor:
        """Runs the op on `inputs`, on `device`."""
        with tf.device(self.device or None):
            if self.op_type == "MatMul":
                return tf.linalg.matmul(inputs[0], inputs[1], transpose_a=True)
            if self.op_type == "BiasAddGrad":
                return tf.raw_ops.BiasAddGrad(out_backprop=inputs[0], data_format=self.data_format)
        raise ValueError(f"FusedOp cannot run op type {self.op_type!r}; expected 'MatMul' or 'BiasAddGrad'.")

    def apply_summed(self, per_microbatch: Sequence[Sequence[tf.Tensor]]) -> tf.Tensor:
        """The sum over micro-batches, as one op on the concatenated inputs."""
        if len(per_microbatch) == 1:
            return self.apply(per_microbatch[0])
        with tf.device(self.device or None):
            columns = [tf.concat(list(c), axis=0) for c in zip(*per_microbatch)]
        return self.apply(columns)


class StepOutput:
    """One value returned by an `smp.step` function: its ``M`` per-micro-batch values.

    Example:

    ```python
    @smp.step
    def train_step(x, y):
        pred = model(x)
        loss = loss_fn(y, pred)
        return loss, tape.gradient(loss, model.trainable_variables), pred

    loss, grads, pred = train_step(x, y)
    optimizer.apply_gradients(zip([g.accumulate() for g in grads], variables))
    loss.reduce_mean(), pred.merge()
    ```

    Args:
        outputs: the per-micro-batch values, in micro-batch order.

    Raises:
        ValueError: `outputs` is not a sequence or is empty.
    """

    def __init__(self, outputs: Sequence[Any]) -> None:
        if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
            raise ValueError(
                "StepOutput expects a list with one value per micro-batch. "
                f"Received: outputs={outputs!r} (of type {type(outputs).__name__})"
            )
        if len(outputs) == 0:
            raise ValueError(
                "StepOutput expects at least one value (one per micro-batch). "
                "Received: outputs=[]"
            )
        self._values: Optional[List[Any]] = list(outputs)
        self._fused: Optional[FusedOp] = None
        self._fused_inputs: List[Tuple[Any, ...]] = []
        # With data parallelism: (reducer, index) averaging this output over
        # the replicas too, in buckets with the other gradients.
        self._replicas: Optional[Tuple[Any, int]] = None

    @classmethod
    def _from_fused(cls, op: FusedOp, per_microbatch_inputs: Sequence[Sequence[Any]]) -> "StepOutput":
        """A StepOutput whose values are `op` applied to each micro-batch's inputs."""
        out = cls([None] * len(per_microbatch_inputs))
        out._values = None
        out._fused = op
        out._fused_inputs = [tuple(x) for x in per_microbatch_inputs]
        return out

    @property
    def _outputs(self) -> List[Any]:
        if self._values is None:
            # Per-micro-batch values of a fused output are built on demand.
            self._values = [self._fused.apply(x) for x in self._fused_inputs]
        return self._values

    # -- container protocol -------------------------------------------------
    @property
    def outputs(self) -> List[Any]:
        """The per-micro-batch values (a new list), in micro-batch order."""
        return [_public(o) for o in self._outputs]

    def __len__(self) -> int:
        return len(self._fused_inputs) if self._fused is not None else len(self._outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def __getitem__(self, microbatch: int) -> Any:
        return _public(self._outputs[microbatch])

    def __repr__(self) -> str:
        if self._fused is not None and self._values is None:
            return f"StepOutput(microbatches={len(self)}, fused {self._fused.op_type})"
        return f"StepOutput(microbatches={len(self._outputs)}, {_describe(self._outputs[0])})"

    # -- helpers ------------------------------------------------------------
    def _device(self) -> str:
        """Device of the first value (empty when unknown)."""
        if self._fused is not None:
            return self._fused.device
        for o in self._outputs:
            if o is None:
                continue
            o = o.values if isinstance(o, tf.IndexedSlices) else o
            return getattr(o, "device", "") or ""
        return ""

    def _tensors(self, method: str, densify: bool = True) -> List[Any]:
        """The outputs as tensors, after checking they can be combined."""
        nones = [m for m, o in enumerate(self._outputs) if o is None]
        if nones:
            raise ValueError(
                f"StepOutput.{method}() cannot combine None values (micro-batches "
                f"{nones} are None; a gradient is None when the loss does not "
                f"depend on the variable). Received: {self!r}"
            )
        tensors = []
        for o in self._outputs:
            if isinstance(o, tf.IndexedSlices):
                # Sparse gradients are densified: a dense result is what a
                # mean/sum/concat of micro-batch values means. `accumulate`
                # keeps them sparse instead.
                tensors.append(tf.convert_to_tensor(o) if densify else o)
            else:
                tensors.append(tf.convert_to_tensor(o))
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(
                f"StepOutput.{method}() needs all micro-batch values to have the "
                f"same dtype. Received dtypes: {[t.dtype.name for t in tensors]}"
            )
        return tensors

    @staticmethod
    def _check_numeric(tensors: List[Any], method: str) -> None:
        dtype = tensors[0].dtype
        if dtype == tf.bool or dtype == tf.string or not (
            dtype.is_floating or dtype.is_integer or dtype.is_complex
        ):
            raise ValueError(
                f"StepOutput.{method}() needs numeric values. Received values of "
                f"dtype {dtype.name}; cast them (e.g. with tf.cast) inside the "
                "step function or combine them with concat()/stack()."
            )

    def _divide(self, total: Any) -> Any:
        # A constant in the values' own dtype (no float32 -> float64 upcast).
        count = _count_constant(len(self), total.dtype, total.device)
        if total.dtype.is_floating or total.dtype.is_complex:
            return total / count
        # Integers: true division, as `tf.add_n(outputs) / M` does (int32 and
        # int64 give float64).
        return tf.math.truediv(total, count)

    # -- combinations -------------------------------------------------------
    @_combination
    def reduce_sum(self) -> tf.Tensor:
        """Sum of the per-micro-batch values.

        `tf.IndexedSlices` values are converted to dense tensors first.

        Returns:
            A tensor with the shape and dtype of one micro-batch value.

        Raises:
            ValueError: a value is None, the values are not numeric, or their
                dtypes differ.
        """
        if self._fused is not None:
            return self._fused.apply_summed(self._fused_inputs)
        tensors = self._tensors("reduce_sum")
        self._check_numeric(tensors, "reduce_sum")
        return tf.add_n(tensors)

    @_combination
    def reduce_mean(self) -> tf.Tensor:
        """Mean of the per-micro-batch values (e.g. the loss of the batch).

        Floating-point values keep their dtype; integer values give the dtype
        of `tf.math.truediv` (float64 for int32/int64). `tf.IndexedSlices`
        values are converted to dense tensors first (use `accumulate` to keep
        them sparse).

        Returns:
            A tensor with the shape of one micro-batch value.

        Raises:
            ValueError: a value is None, the values are not numeric, or their
                dtypes differ.
        """
        if self._fused is not None:
            return self._divide(self._fused.apply_summed(self._fused_inputs))
        tensors = self._tensors("reduce_mean")
        self._check_numeric(tensors, "reduce_mean")
        return self._divide(tf.add_n(tensors))

    @_combination
    def concat(self, axis: int = 0) -> tf.Tensor:
        """Concatenates the per-micro-batch values along `axis`.

        The result is in micro-batch order (all rows of micro-batch 0, then of
        micro-batch 1, ...), not in the original row order of the batch, since
        the split is strided; use `merge` for the original order.

        Args:
            axis: the axis to concatenate along.

        Returns:
            The concatenated tensor.

        Raises:
            ValueError: a value is None or 0-d, or the dtypes differ.
        """
        tensors = self._tensors("concat")
        if tensors[0].shape.rank == 0:
            raise ValueError(
                "StepOutput.concat() cannot concatenate 0-d (scalar) values; use "
                f"stack() or reduce_mean(). Received: {self!r}"
            )
        return tf.concat(tensors, axis=axis)

    @_combination
    def stack(self, axis: int = 0) -> tf.Tensor:
        """Stacks the per-micro-batch values along a new axis `axis`.

        Args:
            axis: the position of the new micro-batch axis.

        Returns:
            A tensor with one more dimension, of size ``M`` at `axis`.

        Raises:
            ValueError: a value is None or the dtypes differ.
        """
        return tf.stack(self._tensors("stack"), axis=axis)

    @_combination
    def merge(self, axis: int = 0) -> tf.Tensor:
        """Merges the per-micro-batch values back into the original row order.

        The inverse of the strided split of the inputs: for per-row outputs
        such as predictions, row ``r`` of the result belongs to row ``r`` of
        the input batch.

        Args:
            axis: the axis the inputs were split along.

        Returns:
            The merged tensor, ``M`` times larger along `axis`.

        Raises:
            ValueError: a value is None or 0-d, or the dtypes differ.
        """
        return merge_microbatches(self._tensors("merge"), axis=axis)

    @_combination
    def accumulate(self) -> Optional[Any]:
        """Mean of the per-micro-batch values, built as a running sum; with
        data parallelism, also over the replicas.

        Meant for gradients: the value equals `reduce_mean`, but it is summed
        one micro-batch at a time (``acc = o0; acc += o1; ...``) so that at
        most one partial sum is alive besides the micro-batch values.
        When every value is a `tf.IndexedSlices` (e.g. an embedding gradient)
        the result stays sparse: the values (scaled by ``1/M``) and indices
        are concatenated and the dense shape kept. When every value is None
        (a variable the loss does not depend on) the result is None, which
        `optimizer.apply_gradients` skips. A fused output
        (``fuse_weight_gradients``) is computed with one op over all
        micro-batches instead.

        With data parallelism (``horovod`` and several processes), the
        accumulated gradient is then averaged over the replicas: gradients
        are all-reduced in buckets, per partition, on the partition's device,
        as soon as the partition's micro-batches are done. Every replica gets
        the same value (dense, for sparse gradients). Other outputs (a loss)
        are averaged over the micro-batches only.

        Returns:
            A tensor, a `tf.IndexedSlices`, or None.

        Raises:
            ValueError: only some values are None, the values are not numeric,
                or their dtypes differ.
        """
        if self._replicas is not None:
            reducer, index = self._replicas
            return reducer.value(index)
        return self._local_accumulate()

    def _accumulate_split(self) -> tf.Tensor:
        """`accumulate` of a gradient returned in pieces (`SplitValue`):
        each piece's running sum on its own device, element for element
        the whole running sum. Returns the pieces' concatenation, which is
        registered as held in them (`smp_tf.sharding.pieces.register_split`):
        the update of a split variable reads the pieces instead, and inside
        a ``tf.function`` the unread concatenation is never computed."""
        from smp_tf.sharding import pieces as registry

        first = self._outputs[0]
        if any(o.axis != first.axis or len(o.pieces) != len(first.pieces) for o in self._outputs):
            raise ValueError(f"StepOutput.accumulate() got micro-batch values split differently. Received: {self!r}")
        self._check_numeric(list(first.pieces), "accumulate")
        sums = []
        for k in range(len(first.pieces)):
            column = [o.pieces[k] for o in self._outputs]
            with tf.device(first.devices[k] or None):
                total = column[0]
                for x in column[1:]:
                    total = total + x
                sums.append(self._divide(total))
        whole = SplitValue(first.axis, sums, first.devices).whole()
        return registry.register_split(whole, first.axis, sums)

    def _local_accumulate(self) -> Optional[Any]:
        """`accumulate` over this replica's micro-batches only."""
        if self._fused is not None:
            # One op over all micro-batches (see FusedOp): no per-micro-batch
            # values and no running sum are built.
            return self.reduce_mean()
        if all(o is None for o in self._outputs):
            return None
        if all(isinstance(o, SplitValue) for o in self._outputs):
            return self._accumulate_split()
        if all(isinstance(o, tf.IndexedSlices) for o in self._outputs):
            slices = self._tensors("accumulate", densify=False)
            self._check_numeric(slices, "accumulate")
            index_dtypes = {s.indices.dtype for s in slices}
            index_dtype = tf.int64 if len(index_dtypes) > 1 else slices[0].indices.dtype
            values = tf.concat([s.values for s in slices], axis=0)
            indices = tf.concat([tf.cast(s.indices, index_dtype) for s in slices], axis=0)
            return tf.IndexedSlices(self._divide(values), indices, slices[0].dense_shape)
        tensors = self._tensors("accumulate")
        self._check_numeric(tensors, "accumulate")
        total = tensors[0]
        for t in tensors[1:]:
            total = total + t
        return self._divide(total)
