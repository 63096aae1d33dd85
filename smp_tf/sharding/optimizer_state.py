"""Optimizer state divided over the data-parallel replicas (``shard_optimizer_state``).

With R replicas, replica r keeps and updates piece r of every optimizer
slot of its pipeline's variables (`smp_tf.sharding.pieces`: a flat run of
``ceil(n / R)`` elements), the ZeRO stage 1 of DeepSpeed and the
``shard_optimizer_state`` of the SageMaker library. One step, for a
variable ``v`` whose gradient was reduce-scattered to its piece ``g_r``
(`smp_tf.distributed.collectives.reduce_scatter_bucket`)::

    p_r = piece r of v                      # this replica's parameters
    optimizer.update_step(g_r, p_r)         # its slots are pieces too
    v = all_gather(p_0, ..., p_{R-1})       # every replica, bit-identical

The user's code does not change: ``optimizer.apply_gradients(zip(grads,
variables))`` receives the pieces that ``StepOutput.accumulate()`` (or
Keras ``fit``) returns, and this module, installed into Keras's optimizer,
recognises them (`smp_tf.sharding.pieces.piece_of`):

* a slot of the variable's shape is created whole by Keras, then divided
  (`smp_tf.sharding.storage.shard_over_data`): this process keeps its piece
  only. Reading a slot whole (a checkpoint) gathers the pieces;
* the update runs Keras's own ``update_step`` on the pieces, as tensor
  parallelism's update does on its pieces: the optimizer is handed the
  piece of the parameters, and its slots read their pieces while it runs;
* ``clipnorm`` and ``global_clipnorm`` are applied first, with norms summed
  over every replica's pieces (an all-reduce of the sums of squares), never
  over a piece alone; the optimizer's own clipping is off meanwhile.

Optimizers whose update is element-wise in the variable, its gradient and
its slots compute, on a piece, what they compute on the whole variable
(`SHARDABLE`). Lamb's trust ratio takes the norms of the whole variable and
of its whole update, Adafactor's factored moments means over whole rows
and columns: their update of a piece sums those over the replicas
(`_NORMED_UPDATES`). Any other optimizer is refused at its first update.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence

import tensorflow as tf

from smp_tf import placement, state
from smp_tf.distributed import collectives
from smp_tf.sharding import pieces, storage

__all__ = ["SHARDABLE", "install", "begin_step", "check_shardable"]

#: Keras optimizers whose update is element-wise (see module doc).
SHARDABLE = frozenset(["SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Lion", "Ftrl"])
#: Why the other built-in optimizers cannot be updated on pieces.
_WHY_NOT = {
    "LossScaleOptimizer": "it checks that every gradient of the replica is finite before it updates",
    "Muon": "it orthogonalises each whole weight matrix's update",
}

_LOCAL = threading.local()


def check_shardable(optimizer: Any) -> None:
    """Raises ValueError naming `optimizer` when its update cannot run on
    pieces (module doc)."""
    cls = type(optimizer)
    name = cls.__name__
    builtin = cls.__module__.startswith("keras.")
    if builtin and (name in SHARDABLE or name in _NORMED_UPDATES):
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                f"shard_optimizer_state cannot update {name} with gradient_accumulation_steps="
                f"{optimizer.gradient_accumulation_steps}: its accumulators add whole gradients. Accumulate over "
                "micro-batches instead (the config key 'microbatches')."
            )
        return
    supported = ", ".join(sorted(SHARDABLE | set(_NORMED_UPDATES)))
    why = _WHY_NOT.get(name) if builtin else (
        "smp_tf cannot tell whether its update of a variable works on pieces; only built-in optimizers "
        "can be sharded")
    why = why or "its update is not known to work on pieces"
    raise ValueError(
        f"shard_optimizer_state cannot divide the state of optimizer {name} over the replicas: {why}. "
        f"Use one of {supported}, or leave shard_optimizer_state off."
    )


# --------------------------------------------------------------------------
# the collectives, keyed alike on every replica
# --------------------------------------------------------------------------
def _partition_of(variable: Any) -> int:
    """The partition whose device holds `variable` (a Keras or tf.Variable)."""
    resource = placement._resource_variable(variable)
    device = (variable if resource is None else resource).device
    return placement.partition_of_device(device, state.topology().devices)


def _gather_for(device: str, partition: int, name: str, size: int) -> Any:
    """The all-gather of one variable's pieces on `device` (a slot read whole)."""
    key = collectives.instance_key("data-piece", name, size)

    def gather(local: tf.Tensor) -> tf.Tensor:
        return collectives.all_gather(local, partition, device, key)

    return gather


def _apply_site() -> str:
    """Names one optimizer update alike on every replica: how many sharded
    updates this graph (or the eager context) emitted before."""
    graph = tf.compat.v1.get_default_graph() if not tf.executing_eagerly() else _LOCAL
    count = getattr(graph, "_smp_tf_sharded_updates", 0)
    setattr(graph, "_smp_tf_sharded_updates", count + 1)
    return f"update/{count}"


# --------------------------------------------------------------------------
# clipping with norms over all pieces
# --------------------------------------------------------------------------
def _summed_squares(grads: Sequence[tf.Tensor], variables: Sequence[Any], site: str) -> List[tf.Tensor]:
    """Each gradient's sum of squares over every replica's piece: one
    all-reduce per partition of the sums of its pieces."""
    by_partition: Dict[int, List[int]] = {}
    for i, v in enumerate(variables):
        by_partition.setdefault(_partition_of(v), []).append(i)
    devices = state.topology().devices
    out: List[Optional[tf.Tensor]] = [None] * len(grads)
    for p, members in sorted(by_partition.items()):
        with tf.device(devices[p]):
            local = tf.stack([tf.reduce_sum(tf.square(tf.cast(grads[i], tf.float32))) for i in members])
            key = collectives.instance_key("clip-norm", site, p, len(members))
            summed = collectives.all_reduce_sum(local, p, devices[p], key)
            for j, i in enumerate(members):
                out[i] = summed[j]
    return out


def _clip(optimizer: Any, grads: List[tf.Tensor], variables: List[Any], site: str) -> List[tf.Tensor]:
    """``clipnorm`` / ``global_clipnorm`` on pieces, with Keras's formulas
    on norms summed over the replicas (``clipvalue`` is element-wise and
    stays the optimizer's)."""
    clipnorm, global_clipnorm = optimizer.clipnorm, optimizer.global_clipnorm
    if not ((clipnorm and clipnorm > 0) or (global_clipnorm and global_clipnorm > 0)):
        return grads
    squares = _summed_squares(grads, variables, site)
    if clipnorm and clipnorm > 0:
        out = []
        for g, l2sum in zip(grads, squares):
            with tf.device(g.device):
                l2sum = tf.cast(l2sum, g.dtype)
                l2norm = tf.where(l2sum > 0, tf.sqrt(tf.where(l2sum > 0, l2sum, tf.ones_like(l2sum))), l2sum)
                out.append(g * clipnorm / tf.maximum(l2norm, tf.cast(clipnorm, g.dtype)))
        return out
    norm = tf.sqrt(tf.add_n(squares))
    scale = global_clipnorm * tf.minimum(1.0 / norm, 1.0 / global_clipnorm)
    scale = scale + (norm - norm)  # NaN for a non-finite norm, as Keras
    return [g * tf.cast(scale, g.dtype) for g in grads]


# --------------------------------------------------------------------------
# the update
# --------------------------------------------------------------------------
@contextlib.contextmanager
def _updating_pieces(variables: Dict[int, pieces.Piece], site: str) -> Iterator[None]:
    previous = getattr(_LOCAL, "pieces", None)
    _LOCAL.pieces = (variables, site)
    try:
        yield
    finally:
        _LOCAL.pieces = previous


def _piece_update_of(var: Any) -> Optional[tuple]:
    current = getattr(_LOCAL, "pieces", None)
    if current is None:
        return None
    variables, site = current
    piece = variables.get(id(var))
    return None if piece is None else (piece, site)


def _slots_of(optimizer: Any, var: Any) -> List[Any]:
    """The Keras slots an optimizer keeps for `var`: entry i of each of its
    per-variable lists (Adam's ``_momentums``, Adagrad's ``_accumulators``,
    the moving averages, ...), i being `var`'s index. Found by structure,
    not by name: Keras names some slots after the variable and others
    only after their role."""
    from keras import Variable as KerasVariable

    trainable = list(getattr(optimizer, "_trainable_variables", None) or [])
    index = optimizer._get_variable_index(var)
    slots = []
    for name, value in vars(optimizer).items():
        if name in ("_trainable_variables", "_variables") or not isinstance(value, list) or len(value) != len(trainable):
            continue
        if all(isinstance(x, KerasVariable) for x in value) and value[index] is not trainable[index]:
            slots.append(value[index])
    return slots


def _divide_slots(optimizer: Any, var: Any, piece: pieces.Piece) -> List[Any]:
    """The Keras slots of `var` (`_slots_of`) that are divided over the
    replicas, divided the first time if Keras created them whole; a slot
    of another shape than the variable is kept whole where the optimizer's
    update on pieces expects it (`_WHOLE_SLOTS`)."""
    slots = []
    for slot in _slots_of(optimizer, var):
        sv = slot.value
        if not storage.is_data_sharded(sv):
            if tuple(sv.shape) != tuple(var.shape) and type(optimizer).__name__ in _WHOLE_SLOTS:
                continue
            if tuple(sv.shape) != tuple(var.shape):
                raise ValueError(
                    f"shard_optimizer_state: {type(optimizer).__name__} keeps a slot of shape {tuple(sv.shape)} for "
                    f"variable {var.name!r} of shape {tuple(var.shape)}; only slots of the variable's shape can be "
                    "divided over the replicas."
                )
            gather = _gather_for(var.device, _partition_of(var), sv.name, piece.size)
            storage.shard_over_data(sv, piece, gather)
        slots.append(slot)
    return slots


def _divide_new_slot(reference: Any, slot: Any, replicas: int, rank: int) -> None:
    """A slot Keras just created whole, divided at once (this replica
    keeps its piece): a slot of another shape than its variable stays
    whole here and is refused at the update (`_divide_slots`)."""
    sv = getattr(slot, "value", slot)
    if storage.is_data_sharded(sv) or tuple(sv.shape) != tuple(reference.shape):
        return
    piece = pieces.Piece(tuple(int(d) for d in reference.shape), replicas, rank)
    device = getattr(reference, "value", reference).device
    storage.shard_over_data(sv, piece, _gather_for(device, _partition_of(reference), sv.name, piece.size))


class _ParamPiece:
    """This replica's piece of a variable's parameters while the optimizer
    updates it: the optimizer's assignments replace a tensor, so no storage
    is kept for the piece between steps (the whole variable is assigned
    from the gathered pieces). It names the whole variable as its
    container, so that the optimizer finds the slots it keeps for it.
    """

    def __init__(self, var: Any, value: tf.Tensor) -> None:
        self._distributed_container = weakref.ref(var)
        self.dtype = var.dtype
        self.shape = value.shape
        self.current = value

    def assign(self, value: Any, *args: Any, **kwargs: Any) -> None:
        self.current = tf.convert_to_tensor(value, self.dtype)

    def assign_add(self, delta: Any, *args: Any, **kwargs: Any) -> None:
        self.current = self.current + delta

    def assign_sub(self, delta: Any, *args: Any, **kwargs: Any) -> None:
        self.current = self.current - delta

    def read_value(self) -> tf.Tensor:
        return self.current


tf.register_tensor_conversion_function(
    _ParamPiece, lambda piece, dtype=None, name=None, as_ref=False: piece.current)


def _lamb_update(optimizer: Any, grad: tf.Tensor, variable: "_ParamPiece", learning_rate: Any,
                 norms: Any, piece: pieces.Piece) -> None:
    """Keras's ``Lamb.update_step`` on a piece, its trust ratio from the
    norms of the whole variable and of its whole update (`norms`: the sums
    of squares of the piece's, summed over every replica; an element-wise
    update needs nothing else of `piece`)."""
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    gradient = tf.cast(grad, dtype)
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), local_step)
    beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), local_step)
    m = optimizer._momentums[optimizer._get_variable_index(variable)]
    v = optimizer._velocities[optimizer._get_variable_index(variable)]
    optimizer.assign_add(m, (gradient - m) * (1 - optimizer.beta_1))
    optimizer.assign_add(v, (tf.square(gradient) - v) * (1 - optimizer.beta_2))
    update = (m / (1.0 - beta_1_power)) / (tf.sqrt(v / (1.0 - beta_2_power)) + optimizer.epsilon)
    summed = norms(tf.stack([tf.reduce_sum(tf.pow(tf.convert_to_tensor(variable), 2)),
                             tf.reduce_sum(tf.pow(update, 2))]))
    w_norm, g_norm = tf.sqrt(summed[0]), tf.sqrt(summed[1])
    ratio = tf.where(w_norm > 0, tf.where(g_norm > 0, w_norm / g_norm, 1.0), 1.0)
    optimizer.assign_sub(variable, ratio * lr * update)


def _adafactor_update(optimizer: Any, grad: tf.Tensor, variable: "_ParamPiece", learning_rate: Any,
                      norms: Any, piece: pieces.Piece) -> None:
    """Keras's ``Adafactor.update_step`` on a piece.

    Its factored second moments (``r``, the mean of ``g^2 + eps1`` over a
    variable's last dimension, and ``c``, over its second-last) are small
    and kept whole on every replica: each replica adds its piece's elements
    into their rows and columns, and the sums are added over the replicas
    (`norms`, one all-reduce). So are the root-mean-squares of the
    variable and of the update that scale the step. The unfactored moment
    of a variable of fewer than 2 dimensions has the variable's shape and
    is divided like any slot. The padding of the last piece is left out of
    every sum."""
    dtype = variable.dtype
    shape = [int(d) for d in piece.shape]
    lr = tf.cast(learning_rate, dtype)
    gradient = tf.cast(grad, dtype)
    epsilon_2 = tf.cast(optimizer.epsilon_2, dtype)
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    if not callable(optimizer._learning_rate) and optimizer.relative_step:
        lr = tf.minimum(lr, 1 / tf.sqrt(local_step))
    index = optimizer._get_variable_index(variable)
    r, c, v = optimizer._r[index], optimizer._c[index], optimizer._v[index]
    start, stop = pieces.piece_bounds(piece.size, piece.replicas, piece.rank)
    positions = tf.range(start, start + piece.length)
    real = positions < stop
    n = float(piece.size)

    def rms(x: tf.Tensor) -> tf.Tensor:
        return tf.sqrt(norms(tf.reshape(tf.reduce_sum(tf.square(tf.where(real, x, tf.zeros_like(x)))), [1]))[0] / n)

    rho_t = tf.minimum(lr, 1 / tf.sqrt(local_step))
    alpha_t = tf.maximum(epsilon_2, rms(tf.convert_to_tensor(variable))) * rho_t
    regulated = tf.where(real, tf.square(gradient) + optimizer.epsilon_1, tf.zeros_like(gradient))
    beta_2_t = 1 - tf.pow(local_step, optimizer.beta_2_decay)
    if len(shape) >= 2:
        rows, cols = shape[-2], shape[-1]
        lead = max(piece.size // (rows * cols), 1)
        safe = tf.minimum(positions, piece.size - 1)  # padding indexes the last element; it is masked
        row_of = safe // cols  # over the leading dimensions and the rows
        col_of = (safe // (rows * cols)) * cols + safe % cols
        row_sums = tf.math.unsorted_segment_sum(regulated, row_of, lead * rows)
        col_sums = tf.math.unsorted_segment_sum(regulated, col_of, lead * cols)
        summed = norms(tf.concat([row_sums, col_sums], axis=0))
        row_mean = tf.reshape(summed[: lead * rows] / cols, shape[:-1])
        col_mean = tf.reshape(summed[lead * rows:] / rows, shape[:-2] + [cols])
        optimizer.assign(r, beta_2_t * r + (1 - beta_2_t) * row_mean)
        optimizer.assign(c, beta_2_t * c + (1 - beta_2_t) * col_mean)
        r_flat = tf.reshape(tf.convert_to_tensor(r), [-1])
        r_scaled = r_flat / tf.repeat(tf.reduce_mean(tf.reshape(r_flat, [lead, rows]), axis=-1), rows)
        second = tf.gather(r_scaled, row_of) * tf.gather(tf.reshape(tf.convert_to_tensor(c), [-1]), col_of)
        optimizer.assign(v, second)
    else:
        optimizer.assign(v, beta_2_t * v + (1 - beta_2_t) * regulated)
    u_t = tf.where(real, gradient / tf.sqrt(tf.where(real, tf.convert_to_tensor(v), tf.ones_like(gradient))),
                   tf.zeros_like(gradient))
    u_t_hat = u_t / tf.maximum(tf.cast(1.0, dtype), rms(u_t) / optimizer.clip_threshold)
    optimizer.assign_sub(variable, alpha_t * u_t_hat)


#: Built-in optimizers whose update takes norms or means over whole
#: variables: the update of a piece with those sums added over the
#: replicas.
_NORMED_UPDATES = {"Lamb": _lamb_update, "Adafactor": _adafactor_update}
#: Their slots that are not of the variable's shape, kept whole on every
#: replica (Adafactor's factored moments).
_WHOLE_SLOTS = frozenset(["Adafactor"])


def _summing(optimizer: Any, site: str, index: int, size: int, partition: int, device: str) -> Any:
    """An all-reduce sum over the replicas for one variable's update, each
    call keyed alike on every replica (an update may sum several times, and
    each optimizer its own shapes)."""
    calls = [0]

    def total(t: tf.Tensor) -> tf.Tensor:
        calls[0] += 1
        key = collectives.instance_key("update-norms", type(optimizer).__name__, optimizer.name, site, index, size,
                                       calls[0])
        return collectives.all_reduce_sum(t, partition, device, key)

    return total


def _update_piece(optimizer: Any, var: Any, grad: tf.Tensor, learning_rate: Any, piece: pieces.Piece,
                  index: int, site: str) -> tf.Tensor:
    """`var`'s update on this replica's piece; returns the updated piece
    (module doc). `index`: the variable's place in the update (names its
    collectives)."""
    slots = _divide_slots(optimizer, var, piece)
    device = var.device
    with tf.device(device):
        param = _ParamPiece(var, storage.local_piece(var.read_value(), piece))
    held = [(slot, slot._value) for slot in slots]
    try:
        for slot, whole in held:
            slot._value = storage.local_piece_of(whole)
        with tf.device(device):
            normed = _NORMED_UPDATES.get(type(optimizer).__name__)
            if normed is None:
                optimizer.update_step(grad, param, learning_rate)
            else:
                normed(optimizer, grad, param, learning_rate,
                       _summing(optimizer, site, index, piece.size, _partition_of(var), device), piece)
    finally:
        for slot, whole in held:
            slot._value = whole
    return param.read_value()


def _gather_into(updated: Sequence[tuple], site: str) -> None:
    """Every replica's updated pieces assembled into their variables: one
    all-gather per bucket of a partition's variables of one dtype (at most
    `collectives.BUCKET_BYTES` gathered), in the order of `updated`, the
    same on every replica.

    `updated`: ``(variable, piece, updated piece)`` per variable.
    """
    buckets: List[tuple] = []
    open_bucket: Dict[tuple, list] = {}
    for var, piece, value in updated:
        key = (_partition_of(var), var.dtype)
        gathered_bytes = piece.length * piece.replicas * var.dtype.size
        bucket = open_bucket.get(key)
        if bucket is None or bucket[1] + gathered_bytes > collectives.BUCKET_BYTES:
            bucket = [[], 0, key]
            open_bucket[key] = bucket
            buckets.append(bucket)
        bucket[0].append((var, piece, value))
        bucket[1] += gathered_bytes
    for index, (members, _, (partition, dtype)) in enumerate(buckets):
        device = members[0][0].device
        lengths = [piece.length for _, piece, _ in members]
        with tf.device(device):
            local = tf.concat([value for _, _, value in members], axis=0) if len(members) > 1 else members[0][2]
            key = collectives.instance_key("param-gather", site, index, partition, dtype.name, sum(lengths))
            gathered = collectives.all_gather(local, partition, device, key)
            rows = tf.reshape(gathered, [members[0][1].replicas, sum(lengths)])
            columns = tf.split(rows, lengths, axis=1) if len(members) > 1 else [rows]
            for (var, piece, _), column in zip(members, columns):
                flat = tf.reshape(column, [-1])[: piece.size]
                var.assign(tf.reshape(flat, piece.shape), read_value=False)


# --------------------------------------------------------------------------
# installed into Keras's optimizer
# --------------------------------------------------------------------------
def _check_pairing(grads: Sequence[Any], variables: Sequence[Any], found: Sequence[Optional[pieces.Piece]]) -> None:
    """Every gradient is a piece of its own variable (or None)."""
    for g, v, p in zip(grads, variables, found):
        name = getattr(v, "path", None) or v.name
        if p is None and g is not None:
            raise ValueError(
                f"shard_optimizer_state: the gradient of {name!r} is whole while others are this replica's pieces; "
                "pass every gradient from StepOutput.accumulate()."
            )
        if p is not None and tuple(p.shape) != tuple(v.shape):
            raise ValueError(
                f"shard_optimizer_state: a gradient piece of a variable of shape {p.shape} was paired with {name!r} "
                f"of shape {tuple(v.shape)}; keep the gradients in the order of the variables."
            )


def _unscaled_and_clipped(optimizer: Any, grads: List[Any], variables: List[Any], site: str) -> List[Any]:
    """What Keras's ``apply`` does to the gradients before the update, in
    its order, on the pieces: the loss scale divided out, then the norms
    clipped (`_clip`)."""
    scale = optimizer.loss_scale_factor
    if scale is not None:
        grads = [g if g is None else g / scale for g in grads]
    present = [(g, v) for g, v in zip(grads, variables) if g is not None]
    clipped = iter(_clip(optimizer, [g for g, _ in present], [v for _, v in present], site))
    return [g if g is None else next(clipped) for g in grads]


def _sharding() -> bool:
    return state.is_initialized() and state.config().shard_optimizer_state


def begin_step() -> None:
    """Before a step's gradients are reduced to pieces: the optimizer knows
    pieces (`install`), and the pieces of earlier steps are forgotten."""
    install()
    pieces.forget_all()


def install() -> None:
    """Wraps Keras's optimizer ``apply`` and per-variable update (once per
    process); inert unless ``shard_optimizer_state`` is on and the
    gradients are registered pieces."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    if getattr(TFOptimizer.apply, "_smp_tf_pieces", False):
        return
    original_apply = TFOptimizer.apply
    original_update = TFOptimizer._distributed_tf_update_step

    def apply(self, grads, trainable_variables=None):
        found = [pieces.piece_of(g) for g in grads] if _sharding() else []
        if not any(p is not None for p in found):
            return original_apply(self, grads, trainable_variables)
        check_shardable(self)
        variables = list(trainable_variables) if trainable_variables is not None else list(self._trainable_variables)
        _check_pairing(grads, variables, found)
        if not self.built:
            # Built now, outside the caller's trace: a slot created inside a
            # `tf.function` is initialised only when the function first runs,
            # and its value is read here to keep this replica's piece. Each
            # slot is divided as soon as Keras creates it, before the next.
            first = next(p for p in found if p is not None)
            replicas, rank = first.replicas, first.rank
            with tf.init_scope(), placement.on_slot_created(
                    lambda reference, slot: _divide_new_slot(reference, slot, replicas, rank)):
                self.build(variables)
            self.built = True
        site = _apply_site()
        grads = _unscaled_and_clipped(self, list(grads), variables, site)
        targets = {id(placement._resource_variable(v)): p for v, p in zip(variables, found) if p is not None}
        held = (self.clipnorm, self.global_clipnorm, self.loss_scale_factor)
        self.clipnorm = self.global_clipnorm = self.loss_scale_factor = None
        try:
            with _updating_pieces(targets, site):
                return original_apply(self, grads, variables)
        finally:
            self.clipnorm, self.global_clipnorm, self.loss_scale_factor = held

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        grads_and_vars = list(grads_and_vars)
        rest, updated, site = [], [], None
        for index, (grad, var) in enumerate(grads_and_vars):
            found = _piece_update_of(var)
            if found is None:
                rest.append((grad, var))
                continue
            piece, site = found
            updated.append((var, piece, _update_piece(self, var, grad, learning_rate, piece, index, site)))
        if updated:
            _gather_into(updated, site)
        if rest:
            return original_update(self, distribution, rest, learning_rate)
        return None

    apply._smp_tf_pieces = True
    apply.__wrapped__ = original_apply
    _distributed_tf_update_step._smp_tf_pieces = True
    _distributed_tf_update_step.__wrapped__ = original_update
    TFOptimizer.apply = apply
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step
