"""A variable whose value lives in pieces on a stage's devices.

Tensor parallelism splits a variable's storage, not only its products: a
variable with layout ``S(d)`` keeps its Python object (the `tf.Variable`,
and the Keras variable around it, so optimizers, checkpoints and the model
find it as before), but its value lives in ``t`` plain resource variables,
piece ``k`` (the ``k``-th of ``t`` equal slices along dimension ``d``) on
device ``k`` of its stage. Its own handle becomes an empty resource on
device 0 of the stage: it holds no value (a read of that handle itself,
which nothing of smp_tf or Keras makes, returns an empty tensor).

Outside a traced step the variable behaves as a whole one:

* reading it (``read_value``, ``value``, ``numpy``, a Keras layer called
  eagerly or in a `tf.function`) concatenates the pieces on device 0;
* assigning (``assign``, ``assign_add``, ``assign_sub``, the ``scatter_*``
  updates of sparse gradients) splits the value and writes each piece on
  its device. A Keras optimizer's update of a split variable and of its
  slots (which are split the same way) therefore runs whole on device 0
  and stores its result in pieces: the optimizer state is split, the
  update's temporaries are not;
* checkpoints save and restore the whole value (`_serialize_to_tensors`),
  so they do not depend on ``t``.

Inside the trace of an `smp.step` (`reading_own_handle`), reads use the
variable's own handle: the traced graph is then the same as for a whole
variable, and the sharding rewrite (`smp_tf.sharding.lower`) replaces each
read by reads of the pieces. A SavedModel is exported the same way: its
functions read the variable's handle and its checkpoint holds the whole
value, so it serves without smp_tf.

Gradients with respect to a split variable come from `smp.step` (whose
trace reads the whole handle); a `tf.GradientTape` around an eager read
outside a step does not reach it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

__all__ = [
    "reading_own_handle",
    "shard_over_data",
    "is_data_sharded",
    "local_piece_of",
    "shard_variable",
    "unshard_variable",
    "is_sharded",
    "shards_of",
    "split_dim_of",
    "piece_shape",
]

_LOCAL = threading.local()
_CLASSES: Dict[type, type] = {}


@contextlib.contextmanager
def reading_own_handle() -> Iterator[None]:
    """Graph-mode reads of split variables use their own (whole) handle
    while this is active: for the trace of a step and for export."""
    previous = getattr(_LOCAL, "own", False)
    _LOCAL.own = True
    try:
        yield
    finally:
        _LOCAL.own = previous


def _own_handle_mode() -> bool:
    return getattr(_LOCAL, "own", False) and not tf.executing_eagerly()


def is_sharded(variable: Any) -> bool:
    """Whether `variable` (a `tf.Variable` or a Keras variable) is split."""
    return isinstance(_tf_variable(variable), _ShardedStorage)


def shards_of(variable: Any) -> Optional[List[tf.Variable]]:
    """The pieces of a split variable, in device order; None if whole."""
    v = _tf_variable(variable)
    return list(v._smp_shards) if isinstance(v, _ShardedStorage) else None


def split_dim_of(variable: Any) -> Optional[int]:
    """The dimension a split variable is split along; None if whole."""
    v = _tf_variable(variable)
    return v._smp_split_dim if isinstance(v, _ShardedStorage) else None


def piece_shape(shape: Sequence[int], dim: int, t: int) -> List[int]:
    """The shape of one of `t` equal pieces of `shape` split along `dim`."""
    return [n // t if i == dim else n for i, n in enumerate(shape)]


def _tf_variable(variable: Any) -> Any:
    if isinstance(variable, tf.Variable):
        return variable
    return getattr(variable, "_value", variable)


class _PieceWrites:
    """What both kinds of divided storage write alike: a whole value's
    ``assign``, ``assign_add`` and ``assign_sub`` go to ``_write``, which
    writes the pieces."""

    def _whole_value(self, kind: str, value: Any) -> tf.Tensor:
        """`value` as a tensor of the variable's dtype and whole shape."""
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if not value.shape.is_compatible_with(self.shape):
            raise ValueError(
                f"Cannot {kind} a value of shape {value.shape} to variable {self.name!r} of shape {self.shape}."
            )
        return value

    def assign(self, value: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        return self._write("assign", value, read_value)

    def assign_add(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        return self._write("assign_add", delta, read_value)

    def assign_sub(self, delta: Any, use_locking: Any = None, name: Any = None, read_value: bool = True) -> Any:
        return self._write("assign_sub", delta, read_value)



class _ShardedStorage(_PieceWrites):
    """Overrides put before a resource variable's own class (module doc)."""

    _smp_shards: List[tf.Variable]
    _smp_split_dim: int

    # -- reading ---------------------------------------------------------
    def _gather(self) -> tf.Tensor:
        pieces = []
        for shard in self._smp_shards:
            with tf.device(shard.device):
                pieces.append(shard.read_value_no_copy())
        with tf.device(self.device):
            return tf.concat(pieces, axis=self._smp_split_dim)

    def _read_variable_op(self, no_copy: bool = False) -> tf.Tensor:
        if _own_handle_mode():
            return super()._read_variable_op(no_copy=no_copy)
        with tf_ops.colocate_with(None, ignore_existing=True):
            return self._gather()

    def sparse_read(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
        if _own_handle_mode():
            return super().sparse_read(indices, name=name)
        return tf.gather(self._read_variable_op(), indices, name=name)

    def gather_nd(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
        if _own_handle_mode():
            return super().gather_nd(indices, name=name)
        return tf.gather_nd(self._read_variable_op(), indices, name=name)

    def is_initialized(self, name: Optional[str] = None) -> tf.Tensor:
        return tf.reduce_all(tf.stack([s.is_initialized() for s in self._smp_shards]), name=name)

    # -- writing ---------------------------------------------------------
    def _write(self, kind: str, value: Any, read_value: bool) -> Any:
        value = self._whole_value(kind, value)
        t = len(self._smp_shards)
        with tf_ops.colocate_with(None, ignore_existing=True):
            pieces = tf.split(value, t, axis=self._smp_split_dim)
            ops = []
            for shard, piece in zip(self._smp_shards, pieces):
                with tf.device(shard.device):
                    ops.append(getattr(shard, kind)(piece, read_value=False))
            if tf.executing_eagerly():
                return self
            with tf.control_dependencies(ops):
                return self._gather() if read_value else tf.group(*ops)

    def _scatter(self, sparse_delta: Any, combine: Any) -> Any:
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(f"sparse_delta is not IndexedSlices: {sparse_delta}")
        whole = self._read_variable_op()
        indices = tf.expand_dims(sparse_delta.indices, -1)
        updated = combine(whole, indices, tf.cast(sparse_delta.values, self.dtype))
        return self._write("assign", updated, read_value=False)

    def scatter_add(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Any:
        return self._scatter(sparse_delta, tf.tensor_scatter_nd_add)

    def scatter_sub(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Any:
        return self._scatter(sparse_delta, tf.tensor_scatter_nd_sub)

    def scatter_update(self, sparse_delta: Any, use_locking: bool = False, name: Any = None) -> Any:
        return self._scatter(sparse_delta, tf.tensor_scatter_nd_update)

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Variable {self.name!r} is split over {len(self._smp_shards)} devices by tensor parallelism; "
            "it supports reads, assign, assign_add, assign_sub and scatter_add/sub/update. "
            "Leave it whole with a layout_map entry of None for each dimension."
        )

    scatter_max = scatter_min = scatter_mul = scatter_div = batch_scatter_update = _unsupported
    scatter_nd_sub = scatter_nd_add = scatter_nd_update = scatter_nd_max = scatter_nd_min = _unsupported

    # -- checkpoints -----------------------------------------------------
    def _serialize_to_tensors(self) -> Dict[str, Any]:
        from tensorflow.python.trackable import base as trackable

        def read():
            with tf.device("/device:CPU:0"):
                return tf.identity(self._gather())

        return {trackable.VARIABLE_VALUE_KEY: read()}

    def _restore_from_tensors(self, restored_tensors: Dict[str, Any]) -> Any:
        from tensorflow.python.trackable import base as trackable

        value = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        if not tf.TensorShape(value.shape).is_compatible_with(self.shape):
            raise ValueError(
                f"Received incompatible tensor with shape {value.shape} when attempting to restore "
                f"variable with shape {self.shape} and name {self.name}."
            )
        return self._write("assign", value, read_value=False)


def _sharded_class(cls: type) -> type:
    """The class of a split variable of class `cls`.

    TensorFlow's eager fast path reads an instance of ``ResourceVariable``
    (and of its subclasses) through its handle in C++, past any Python
    override; the split class therefore derives from
    ``BaseResourceVariable`` instead, for which the fast path converts
    through `_dense_var_to_tensor` (the gathered value). What
    ``ResourceVariable`` adds is its constructors and its composite-tensor
    type, which a placed variable does not use.
    """
    if cls not in _CLASSES:
        from tensorflow.python.ops import resource_variable_ops as rvo

        base = rvo.BaseResourceVariable if issubclass(cls, rvo.ResourceVariable) else cls
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (_ShardedStorage, base), {"_smp_base": cls})
    return _CLASSES[cls]


def _empty_handle(variable: Any, device: str) -> Any:
    """A handle to a resource of the variable's dtype and shape that holds nothing."""
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope(), tf.device(device):
        handle = resource_variable_ops._variable_handle_from_shape_and_dtype(
            variable.shape, variable.dtype, shared_name=None, name=variable.name.split(":")[0], graph_mode=False
        )
    old = variable._handle
    handle._parent_trackable = weakref.ref(variable)
    handle._name = getattr(old, "_name", getattr(handle, "_name", None))
    handle._unique_id = getattr(old, "_unique_id", variable._unique_id)
    return handle


def shard_variable(variable: Any, dim: int, devices: Sequence[str]) -> Any:
    """Splits `variable`'s storage along `dim` over `devices` (module doc).

    Args:
        variable: a plain resource `tf.Variable` (or a Keras variable).
        dim: the dimension to split; ``len(devices)`` must divide it.
        devices: one device per piece; the first also holds the (empty)
            handle of the variable.

    Returns:
        The variable's old handle (a resource tensor), for what captured it.

    Raises:
        ValueError: the dimension is not divisible, or the variable is
            already split.
    """
    v = _tf_variable(variable)
    if isinstance(v, _ShardedStorage):
        raise ValueError(f"Variable {v.name!r} is already split over {len(v._smp_shards)} devices.")
    t = len(devices)
    shape = v.shape.as_list()
    if not 0 <= dim < len(shape) or shape[dim] is None or shape[dim] % t:
        raise ValueError(
            f"Cannot split variable {v.name!r} of shape {shape} along dimension {dim} over {t} devices: "
            f"{t} must divide it."
        )
    from tensorflow.python.ops import resource_variable_ops

    base = v.name.split(":")[0]
    with tf.init_scope():
        whole = v.read_value()
        pieces = tf.split(whole, t, axis=dim)
        shards = []
        for k, (device, piece) in enumerate(zip(devices, pieces)):
            # Each piece owns its memory: a split along dimension 0 is a view
            # of the whole value, and the first updates then left a whole
            # copy of the variable in use for good (measured: 8 x
            # Dense(2048) at t=2 kept 96 MiB more with Adam, 34 with SGD).
            with tf.device(device):
                shards.append(resource_variable_ops.ResourceVariable(
                    tf.raw_ops.DeepCopy(x=piece), dtype=v.dtype, trainable=False, name=f"{base}/smp_shard_{k}"))
        del whole, pieces
    old = v._handle
    v._handle = _empty_handle(v, devices[0])
    v._cached_value = None
    v._smp_shards = shards
    v._smp_split_dim = dim
    v.__class__ = _sharded_class(type(v))
    return old


# --------------------------------------------------------------------------
# pieces over the data-parallel replicas (shard_optimizer_state)
# --------------------------------------------------------------------------
class _DataShardedStorage(_PieceWrites):
    """Overrides for a variable divided over the data-parallel replicas:
    this process keeps only its replica's piece (`smp_tf.sharding.pieces`),
    a flat, padded run of the elements, in ``_smp_local``.

    Reading it whole (``read_value``, ``numpy``, a checkpoint) gathers the
    pieces of every replica (``_smp_gather``: a collective, so every
    replica must read at the same time); assigning a whole value writes
    this replica's piece of it. The optimizer update works on the piece
    itself (`smp_tf.placement`), as tensor parallelism's update does.
    """

    _smp_local: tf.Variable
    _smp_piece: Any
    _smp_gather: Any

    def _whole(self) -> tf.Tensor:
        piece = self._smp_piece
        with tf.device(self._smp_local.device):
            flat = self._smp_gather(self._smp_local.read_value_no_copy())
            return tf.reshape(flat[: piece.size], piece.shape)

    def _read_variable_op(self, no_copy: bool = False) -> tf.Tensor:
        with tf_ops.colocate_with(None, ignore_existing=True):
            return self._whole()

    def sparse_read(self, indices: Any, name: Optional[str] = None) -> tf.Tensor:
        return tf.gather(self._read_variable_op(), indices, name=name)

    def is_initialized(self, name: Optional[str] = None) -> tf.Tensor:
        return self._smp_local.is_initialized(name=name)

    def _write(self, kind: str, value: Any, read_value: bool) -> Any:
        value = self._whole_value(kind, value)
        with tf_ops.colocate_with(None, ignore_existing=True), tf.device(self._smp_local.device):
            op = getattr(self._smp_local, kind)(local_piece(value, self._smp_piece), read_value=False)
            if tf.executing_eagerly():
                return self
            with tf.control_dependencies([op]):
                return self._whole() if read_value else tf.group(op)

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Variable {self.name!r} is divided over {self._smp_piece.replicas} data-parallel replicas "
            "(shard_optimizer_state); it supports reads, assign, assign_add and assign_sub."
        )

    scatter_add = scatter_sub = scatter_update = scatter_max = scatter_min = _unsupported
    scatter_mul = scatter_div = batch_scatter_update = gather_nd = _unsupported
    scatter_nd_sub = scatter_nd_add = scatter_nd_update = scatter_nd_max = scatter_nd_min = _unsupported

    def _serialize_to_tensors(self) -> Dict[str, Any]:
        from tensorflow.python.trackable import base as trackable

        return {trackable.VARIABLE_VALUE_KEY: self._whole()}

    def _restore_from_tensors(self, restored_tensors: Dict[str, Any]) -> Any:
        from tensorflow.python.trackable import base as trackable

        return self._write("assign", restored_tensors[trackable.VARIABLE_VALUE_KEY], read_value=False)


def local_piece(value: tf.Tensor, piece: Any) -> tf.Tensor:
    """`piece` (a `smp_tf.sharding.pieces.Piece`) of a whole value: its
    elements flattened, padded with zeros, and the owner's run taken."""
    flat = tf.reshape(value, [-1])
    flat = tf.pad(flat, [[0, piece.length * piece.replicas - piece.size]])
    return flat[piece.rank * piece.length:(piece.rank + 1) * piece.length]


def is_data_sharded(variable: Any) -> bool:
    """Whether `variable` is divided over the data-parallel replicas."""
    return isinstance(_tf_variable(variable), _DataShardedStorage)


def local_piece_of(variable: Any) -> Optional[tf.Variable]:
    """This replica's piece (a 1-D `tf.Variable`) of a variable divided over
    the replicas; None if it is whole here."""
    v = _tf_variable(variable)
    return v._smp_local if isinstance(v, _DataShardedStorage) else None


def shard_over_data(variable: Any, piece: Any, gather: Any) -> Any:
    """Keeps only `piece` of `variable`'s value in this process (module
    doc of `_DataShardedStorage`).

    Args:
        variable: a plain resource `tf.Variable` (or a Keras variable).
        piece: this replica's `smp_tf.sharding.pieces.Piece` of it.
        gather: the collective that concatenates every replica's piece (a
            1-D tensor) in replica order.

    Returns:
        The variable's old handle (a resource tensor).

    Raises:
        ValueError: the variable is already split.
    """
    from tensorflow.python.ops import resource_variable_ops

    v = _tf_variable(variable)
    if isinstance(v, (_ShardedStorage, _DataShardedStorage)):
        raise ValueError(f"Variable {v.name!r} is already split.")
    with tf.init_scope(), tf.device(v.device):
        local = resource_variable_ops.ResourceVariable(
            tf.raw_ops.DeepCopy(x=local_piece(v.read_value(), piece)), dtype=v.dtype, trainable=False,
            name=f"{v.name.split(':')[0]}/smp_data_piece")
    old = v._handle
    v._handle = _empty_handle(v, v.device)
    v._cached_value = None
    v._smp_local = local
    v._smp_piece = piece
    v._smp_gather = gather
    v.__class__ = _data_sharded_class(type(v))
    return old


_DATA_CLASSES: Dict[type, type] = {}


def _data_sharded_class(cls: type) -> type:
    """The class of a variable of class `cls` divided over the replicas
    (derived from ``BaseResourceVariable`` for the reason `_sharded_class`
    gives)."""
    if cls not in _DATA_CLASSES:
        from tensorflow.python.ops import resource_variable_ops as rvo

        base = rvo.BaseResourceVariable if issubclass(cls, rvo.ResourceVariable) else cls
        _DATA_CLASSES[cls] = type(f"DataSharded{cls.__name__}", (_DataShardedStorage, base), {"_smp_base": cls})
    return _DATA_CLASSES[cls]


def unshard_variable(variable: Any, device: Optional[str] = None) -> Any:
    """Gathers a split variable back into one resource on `device` (default:
    where its handle is). Returns its old (empty) handle; None if it was whole."""
    v = _tf_variable(variable)
    if not isinstance(v, _ShardedStorage):
        return None
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope():
        whole = v._gather()
        with tf.device(device or v.device):
            fresh = resource_variable_ops.ResourceVariable(
                tf.identity(whole), dtype=v.dtype, shape=v.shape, trainable=False, name=v.name.split(":")[0])
    old = v._handle
    new = fresh._handle
    fresh._handle = None  # the new resource now belongs to `v`
    new._parent_trackable = weakref.ref(v)
    new._name = getattr(old, "_name", new._name)
    new._unique_id = getattr(old, "_unique_id", v._unique_id)
    v.__class__ = type(v)._smp_base
    v._handle = new
    v._cached_value = None
    del v._smp_shards, v._smp_split_dim
    return old
