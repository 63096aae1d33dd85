"""Placement: every variable a step uses lives on the device of its partition.

Variables are moved once per `smp.init`, by the first step that is
partitioned; a step partitioned later in the same run keeps them where they
are and puts the ops that use them there too (`pinned_partitions`).

A move keeps the variable's identity. The `tf.Variable` object (and the
Keras variable around it) stays the same Python object; only the resource
behind its handle is created anew on the target device, with the same value.
So everything that keys on the variable keeps working: a Keras optimizer
built earlier finds its state (it keys on the variable's ``_unique_id``),
``tf.train.Checkpoint`` and ``GradientTape`` see the same object, and new
traces read the new handle.

What captured the old handle before the move is re-pointed at the new one:

* every `tf.function` traced earlier (each of its concrete functions gets
  its captured inputs replaced). They are found in a registry of the
  concrete functions, function graphs and Keras optimizers created since
  the first `smp.init` of the process (`smp_tf.live_objects`); when
  TensorFlow had created variables before it, one scan of all live objects
  adds the older ones first;
* every graph being traced at the moment of the move (the user's
  `tf.function` that called the step), whose capture of the old handle is
  re-keyed to the new handle, so that later reads in that trace share it.
  Keras's cached ``train``/``test``/``predict`` functions are such functions:
  they read the moved variables from then on, without a retrace;
* optimizer slots (Adam's moments, momentum, ...) of a moved variable move
  with it, and slots created later are created on its device.

With tensor parallelism a variable may be split instead of moved: its
storage becomes pieces on its stage's devices (`smp_tf.sharding.storage`),
its own handle an empty one on device 0 of the stage; its slots are split
the same way. A split variable placed again by a later `smp.init` is first
gathered whole.

The old resource is freed once nothing refers to it. What holds a raw handle
of its own (a TF1 ``Session`` graph, a handle tensor kept by the user) keeps
the old value: see ``docs/partitioning.md``, "Variables and functions
traced before the first step".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

from smp_tf import live_objects, state
from smp_tf.sharding import pieces as registry
from smp_tf.sharding import storage
from smp_tf.trace import CapturedVariable

logger = logging.getLogger("smp_tf")

__all__ = [
    "relocate_variable",
    "place_variables",
    "pinned_partitions",
    "install_slot_placement",
    "known_optimizers",
    "live_models",
    "register_model",
    "same_device",
    "partition_of_device",
    "placed_in",
]

#: Attribute set on a moved `tf.Variable`: the `state.generation()` it was placed in.
_PLACED = "_smp_tf_generation"
# The partition a variable was placed for: with virtual stages a device holds
# several partitions, so its device alone does not say which.
_PARTITION = "_smp_tf_partition"
#: Attribute set on a Keras optimizer slot: a weak reference to its variable.
_REFERENCE = "_smp_tf_reference"

_OPTIMIZERS: "weakref.WeakSet[Any]" = weakref.WeakSet()
_MODELS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_model(model: Any) -> None:
    """Records a `DistributedModel` (for `live_models`)."""
    _MODELS.add(model)


def live_models() -> List[Any]:
    """The `DistributedModel` instances alive in this process."""
    return list(_MODELS)


def same_device(a: str, b: str) -> bool:
    """Whether two device names name the same device.

    The job, replica and task count only when both names give them: a name
    without them (``/device:CPU:1``) means this process's device.
    """
    da, db = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
    for field in ("job", "replica", "task"):
        x, y = getattr(da, field), getattr(db, field)
        if x is not None and y is not None and x != y:
            return False
    return (da.device_type or "CPU").upper() == (db.device_type or "CPU").upper() and (
        da.device_index or 0
    ) == (db.device_index or 0)


def partition_of_device(device: str, devices: Sequence[str]) -> int:
    """The partition whose device (`devices[p]`) `device` names; 0 when none does."""
    if device:
        for p, d in enumerate(devices):
            if same_device(device, d):
                return p
    return 0


def placed_in(variable: Any) -> Any:
    """The `state.generation()` a variable was last placed in (None if never)."""
    v = _resource_variable(variable)
    return getattr(v, _PLACED, None) if v is not None else None


def _resource_variable(variable: Any) -> Optional[Any]:
    """The `tf.Variable` behind a Keras variable (or the variable itself);
    None if it cannot be moved in place (not a plain resource variable)."""
    from tensorflow.python.ops import resource_variable_ops

    v = getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable
    if type(v).__name__ in ("MirroredVariable", "SyncOnReadVariable", "DistributedVariable"):
        return None
    if isinstance(v, resource_variable_ops.BaseResourceVariable) and getattr(v, "_handle", None) is not None:
        return v
    return None


def relocate_variable(variable: Any, device: str) -> Optional[Any]:
    """Moves `variable`'s storage to `device`, keeping the Python object.

    Args:
        variable: a `tf.Variable` or a Keras variable.
        device: the target device.

    Returns:
        The old handle (a resource tensor) if the variable moved, None if it
        already lived on `device`.

    Raises:
        TypeError: `variable` is not a resource variable (e.g. a variable of a
            `tf.distribute` strategy), which cannot be moved in place.
    """
    v = _resource_variable(variable)
    if v is None:
        raise TypeError(
            f"smp_tf can only move plain resource variables to their partition's device. "
            f"Received: {variable!r} ({type(variable).__name__})."
        )
    old = v.handle
    if same_device(old.device, device):
        return None
    from tensorflow.python.ops import resource_variable_ops

    with tf.init_scope(), tf.device(device):
        fresh = resource_variable_ops.ResourceVariable(
            v.read_value(), dtype=v.dtype, shape=v.shape, trainable=False,
            name=v.name.split(":")[0],
        )
    new = fresh._handle
    fresh._handle = None  # the new resource now belongs to `v`
    new._parent_trackable = weakref.ref(v)
    new._name = getattr(old, "_name", new._name)
    new._unique_id = getattr(old, "_unique_id", v._unique_id)
    v._handle = new
    v._cached_value = None
    return old


# --------------------------------------------------------------------------
# optimizer slots
# --------------------------------------------------------------------------
_SLOT_HOOK = threading.local()


@contextlib.contextmanager
def on_slot_created(hook: Callable[[Any, Any], None]) -> Iterator[None]:
    """Calls ``hook(reference_variable, slot)`` right after each optimizer
    slot this thread creates inside the block (`install_slot_placement`):
    ``shard_optimizer_state`` divides each slot before Keras creates the
    next one, so that the optimizer's whole state never exists at once."""
    previous = getattr(_SLOT_HOOK, "hook", None)
    _SLOT_HOOK.hook = hook
    try:
        yield
    finally:
        _SLOT_HOOK.hook = previous


def install_slot_placement() -> None:
    """Makes Keras optimizer slots live on the device of their variable.

    Keras creates a slot with ``add_variable_from_reference(variable)``; under
    the default distribution strategy nothing places it, so a slot of a moved
    variable would land on the default device. This wraps that method (once
    per process) to create the slot on the reference variable's device and
    to remember which variable each slot belongs to.
    """
    try:
        from keras.src.backend.tensorflow.optimizer import TFOptimizer
    except ImportError:  # pragma: no cover - another Keras layout
        logger.warning("smp_tf: cannot place optimizer slots on their variables' devices.")
        return
    if getattr(TFOptimizer.add_variable_from_reference, "_smp_tf", False):
        return
    original = TFOptimizer.add_variable_from_reference

    def add_variable_from_reference(self, reference_variable, *args, **kwargs):
        value = getattr(reference_variable, "value", reference_variable)
        device = getattr(value, "device", "") or ""
        with tf.init_scope(), tf.device(device or None):
            slot = original(self, reference_variable, *args, **kwargs)
        try:
            setattr(slot, _REFERENCE, weakref.ref(reference_variable))
        except (AttributeError, TypeError):  # pragma: no cover - exotic variables
            pass
        # The slot of a split variable is split the same way (Adam's moments
        # have its shape; a slot of another shape stays whole).
        rv, sv = _resource_variable(reference_variable), _resource_variable(slot)
        pieces = storage.shards_of(rv) if rv is not None else None
        if pieces and sv is not None and tuple(sv.shape) == tuple(rv.shape):
            storage.shard_variable(sv, storage.split_dim_of(rv), [p.device for p in pieces])
            setattr(sv, _PLACED, getattr(rv, _PLACED, None))
        hook = getattr(_SLOT_HOOK, "hook", None)
        if hook is not None:
            hook(reference_variable, slot)
        _OPTIMIZERS.add(self)
        return slot

    add_variable_from_reference.__wrapped__ = original
    add_variable_from_reference._smp_tf = True
    TFOptimizer.add_variable_from_reference = add_variable_from_reference
    _install_update_placement(TFOptimizer)


def _install_update_placement(TFOptimizer: Any) -> None:
    """Runs each variable's optimizer update on that variable's device.

    Under the default distribution strategy Keras places the update of a
    variable (``lr * grad`` and the slot arithmetic) on the function's
    default device, the first partition's: every other partition's
    gradients would travel there and back each step, across processes
    when a pipeline spans them. The same kernels run on the variable's
    device instead, so the results are the same.
    """
    original = getattr(TFOptimizer, "_distributed_tf_update_step", None)
    if original is None or getattr(original, "_smp_tf", False):  # pragma: no cover - another Keras layout
        return

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        if tf.distribute.has_strategy():
            return original(self, distribution, grads_and_vars, learning_rate)

        def apply_grad_to_update_var(var, grad, learning_rate):
            if storage.is_sharded(var) and _updates_in_pieces(self, grad):
                return _update_in_pieces(self, var, grad, learning_rate)
            with tf.device(getattr(var, "device", "") or None):
                return self.update_step(grad, var, learning_rate)

        for grad, var in grads_and_vars:
            distribution.extended.update(var, apply_grad_to_update_var, args=(grad, learning_rate), group=False)

    _distributed_tf_update_step.__wrapped__ = original
    _distributed_tf_update_step._smp_tf = True
    TFOptimizer._distributed_tf_update_step = _distributed_tf_update_step

    # Under the default strategy the "all-reduce" of the gradients is an
    # identity over one replica, built as device-less identity ops: they
    # would run on the function's default device, and every gradient of a
    # remote partition would cross to it and back (over the network when a
    # pipeline spans processes). The values are the gradients themselves.
    reduce = getattr(TFOptimizer, "_all_reduce_sum_gradients", None)
    if reduce is None or getattr(reduce, "_smp_tf", False):  # pragma: no cover - another Keras layout
        return

    def _all_reduce_sum_gradients(self, grads_and_vars):
        if tf.distribute.has_strategy():
            return reduce(self, grads_and_vars)
        return list(grads_and_vars)

    _all_reduce_sum_gradients.__wrapped__ = reduce
    _all_reduce_sum_gradients._smp_tf = True
    TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients


#: Keras optimizers whose update of a variable is element-wise in it, its
#: gradient and its slots (scalars aside): updating each piece of a split
#: variable on its own computes each element as the whole update does.
_ELEMENT_WISE = frozenset(["SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Lion"])


def _updates_in_pieces(optimizer: Any, grad: Any) -> bool:
    cls = type(optimizer)
    return (cls.__name__ in _ELEMENT_WISE and cls.__module__.startswith("keras.")
            and isinstance(grad, tf.Tensor))


def _update_in_pieces(optimizer: Any, var: Any, grad: tf.Tensor, learning_rate: Any) -> None:
    """A split variable's optimizer update, one piece at a time on the
    piece's device: the update's temporaries are a piece's size, not the
    whole variable's (see `_ELEMENT_WISE`).

    For piece ``k`` the optimizer is handed piece ``k`` of the variable,
    of the gradient and of each of the variable's slots (the Keras slot
    variables read piece ``k`` while it runs); the piece names the whole
    variable as its container, so the optimizer finds the slots it keeps
    for the variable.
    """
    pieces = storage.shards_of(var)
    dim = storage.split_dim_of(var)
    slots = [slot for slot, reference in _slots_by_reference(optimizer)
             if _resource_variable(reference) is var and storage.is_sharded(_resource_variable(slot))]
    split = registry.split_of(grad)
    if split is not None and split.axis == dim and len(split.pieces) == len(pieces):
        # Accumulated in its pieces (`StepOutput.accumulate`): piece k is
        # already on device k, and the whole gradient is never made.
        grads = list(split.pieces)
    else:
        with tf.device(var.device):
            grads = tf.split(grad, len(pieces), axis=dim)
    for k, (piece, g) in enumerate(zip(pieces, grads)):
        held = [(slot, slot._value) for slot in slots]
        try:
            for slot, whole in held:
                slot._value = storage.shards_of(whole)[k]
            piece._distributed_container = weakref.ref(var)
            with tf.device(piece.device):
                optimizer.update_step(g, piece, learning_rate)
        finally:
            for slot, whole in held:
                slot._value = whole
            del piece._distributed_container


def known_optimizers() -> List[Any]:
    """The Keras optimizers that created slots since smp_tf was imported."""
    return list(_OPTIMIZERS)


def _slots_by_reference(optimizer: Any) -> List[Tuple[Any, Any]]:
    """(slot, reference variable) pairs of a Keras optimizer.

    Slots created after `smp.init` remember their variable. For older ones
    the Keras naming rule is used (``{variable.path with / as _}_{name}``):
    the optimizer's variable with the longest matching path and the same
    shape.
    """
    references = list(getattr(optimizer, "_trainable_variables", None) or [])
    prefixes = sorted(
        ((getattr(r, "path", "").replace("/", "_") + "_", r) for r in references if getattr(r, "path", "")),
        key=lambda pr: -len(pr[0]),
    )
    own = {id(r) for r in references}
    pairs = []
    for slot in getattr(optimizer, "variables", []):
        if id(slot) in own:
            continue
        ref = getattr(slot, _REFERENCE, None)
        reference = ref() if ref is not None else None
        if reference is None:
            name = getattr(slot, "name", "") or ""
            for prefix, r in prefixes:
                if name.startswith(prefix) and tuple(slot.shape) == tuple(r.shape):
                    reference = r
                    break
        if reference is not None:
            pairs.append((slot, reference))
    return pairs


# --------------------------------------------------------------------------
# re-pointing what captured an old handle
# --------------------------------------------------------------------------
def _retarget_graph(graph: Any, moved: Mapping[int, Any]) -> int:
    """Re-keys a function graph's captures of old handles to the new handles."""
    captures = getattr(graph, "_function_captures", None)
    if captures is None:
        return 0
    n = 0
    for key, external in list(captures.by_val_external.items()):
        new = moved.get(id(external))
        if new is None:
            continue
        internal = captures.by_val_internal[key]
        captures.pop(key, is_by_ref=False)
        captures.add_or_replace(key=id(new), external=new, internal=internal, is_by_ref=False)
        n += 1
    return n


def _retarget_function(function: Any, moved: Mapping[int, Any]) -> int:
    inputs = getattr(function, "_captured_inputs", None)
    if not inputs or not any(id(x) in moved for x in inputs):
        return 0
    replaced = [moved.get(id(x), x) for x in inputs]
    setter = getattr(function, "set_external_captures", None)
    if setter is not None:
        setter(replaced)
    else:  # pragma: no cover - older TensorFlow
        function._captured_inputs = replaced
    return 1


def _current_graphs() -> List[Any]:
    """The graphs being traced now, innermost first."""
    from tensorflow.python.framework.func_graph import FuncGraph

    out = []
    g = tf.compat.v1.get_default_graph()
    while isinstance(g, FuncGraph):
        out.append(g)
        g = getattr(g, "outer_graph", None)
    return out


def place_variables(
    captures: Mapping[str, Any], partition_of_variable: Mapping[str, int], devices: Sequence[str],
    split: Optional[Mapping[str, int]] = None, stage_devices: Optional[Sequence[Sequence[str]]] = None,
) -> Dict[str, str]:
    """Moves every captured variable to the device of its partition.

    A variable already placed since the last `smp.init` stays where it is
    (the partitioner pinned its ops there, see `pinned_partitions`). After
    the moves, optimizer slots follow their variables and everything that
    captured an old handle is re-pointed (see the module doc).

    Args:
        captures: placeholder name -> `CapturedVariable` (other entries are
            ignored).
        partition_of_variable: variable key -> partition.
        devices: device of each partition.
        split: variable key -> the dimension its storage is split along
            over its stage's devices (tensor parallelism).
        stage_devices: the devices of each partition's stage (with `split`).

    Returns:
        Variable key -> the device it lives on now (device 0 of its stage
        for a split one).
    """
    split = split or {}
    generation = state.generation()
    where: Dict[str, str] = {}
    moved: Dict[int, Any] = {}  # id(old handle) -> new handle
    # id(tf.Variable) -> its device, or (dimension, devices) when split
    moved_variables: Dict[int, Any] = {}
    placed_now: List[Tuple[Any, int]] = []  # (variable, partition), first placed by this call
    unmovable = []
    for cap in captures.values():
        if not isinstance(cap, CapturedVariable):
            continue
        v = _resource_variable(cap.current)
        if v is None:
            unmovable.append(cap.key)
            where[cap.key] = cap.current.device
            continue
        if getattr(v, _PLACED, None) == generation or cap.key not in partition_of_variable:
            where[cap.key] = v.device
            continue
        p = partition_of_variable[cap.key]
        split_on = (split[cap.key], list(stage_devices[p])) if cap.key in split and stage_devices is not None else None
        _place(v, devices[p], split_on, moved, moved_variables)
        setattr(v, _PLACED, generation)
        setattr(v, _PARTITION, p)
        placed_now.append((v, p))
        where[cap.key] = v.device
    if unmovable:
        logger.warning(
            "smp_tf: %d variable(s) are not plain resource variables and stay where they are "
            "(they are read across devices): %s", len(unmovable), unmovable[:10],
        )
    if placed_now and state.data_parallel():
        # Replicas start from rank 0's values (and stay equal: every step
        # averages the gradients and the state it writes).
        from smp_tf.distributed import collectives

        collectives.broadcast_variables(
            [v for v, _ in placed_now], [p for _, p in placed_now], devices, f"place/{generation}"
        )
    if not moved:
        return where
    live = live_objects.live_objects()
    _place_slots(live, moved, moved_variables, generation)
    functions = sum(_retarget_function(f, moved) for f in live["functions"])
    graphs = set(map(id, live["graphs"]))
    current = [g for g in _current_graphs() if id(g) not in graphs]
    traced = sum(_retarget_graph(g, moved) for g in live["graphs"] + current)
    logger.info(
        "smp_tf: moved %d variables; re-pointed %d traced functions and %d graph captures",
        len(moved), functions, traced,
    )
    return where


def _place(v: Any, device: str, split_on: Optional[Tuple[int, List[str]]], moved: Dict[int, Any],
           targets: Dict[int, Any]) -> None:
    """Puts variable `v` on `device`, or splits it along ``split_on =
    (dimension, devices)`` (a split variable is gathered whole first).
    Records the old handle -> the new one in `moved`, and where it went
    (a device, or `split_on`) in `targets`."""
    if storage.is_sharded(v):
        if split_on is not None and _split_as(v, split_on):
            # Already split this way: the pieces stay. Gathering and splitting
            # again would make new pieces, and the task functions of a step
            # compiled for this config (kept across `smp.init` with the same
            # config) read the old ones, which nothing updates any more.
            return
        moved[id(storage.unshard_variable(v))] = v.handle
        targets[id(v)] = device
    if split_on is not None:
        moved[id(storage.shard_variable(v, split_on[0], split_on[1]))] = v.handle
        targets[id(v)] = split_on
        return
    old = relocate_variable(v, device)
    if old is not None:
        moved[id(old)] = v.handle
        targets[id(v)] = device


def _split_as(v: Any, split_on: Tuple[int, List[str]]) -> bool:
    """Whether split variable `v` is split along ``split_on[0]`` with its
    pieces on the devices ``split_on[1]``, in that order."""
    dim, devices = split_on
    pieces = storage.shards_of(v) or []
    return (storage.split_dim_of(v) == dim and len(pieces) == len(devices)
            and all(same_device(piece.device, d) for piece, d in zip(pieces, devices)))


def _place_slots(live: Mapping[str, Any], moved: Dict[int, Any], targets: Dict[int, Any], generation: Any) -> None:
    """Optimizer slots follow their variables (`targets`): moved with a
    moved one; split with a split one when they have its shape, else on
    its stage's first device."""
    for opt in list(_OPTIMIZERS) + [o for o in live.get("optimizers", []) if o not in _OPTIMIZERS]:
        for slot, reference in _slots_by_reference(opt):
            rv, sv = _resource_variable(reference), _resource_variable(slot)
            if rv is None or sv is None or id(rv) not in targets:
                continue
            target = targets[id(rv)]
            if isinstance(target, tuple):
                same_shape = tuple(sv.shape) == tuple(rv.shape)
                _place(sv, target[1][0], target if same_shape else None, moved, targets)
            else:
                _place(sv, target, None, moved, targets)
            setattr(sv, _PLACED, generation)


def pinned_partitions(captures: Mapping[str, Any], devices: Sequence[str]) -> Dict[str, int]:
    """Variable key -> partition, for the captured variables placed since the
    last `smp.init` (their ops must go where they live)."""
    generation = state.generation()
    out: Dict[str, int] = {}
    for cap in captures.values():
        if not isinstance(cap, CapturedVariable):
            continue
        v = _resource_variable(cap.current)
        if v is None or getattr(v, _PLACED, None) != generation:
            continue
        p = getattr(v, _PARTITION, None)
        if p is not None and p < len(devices) and same_device(v.device, devices[p]):
            out[cap.key] = p
            continue
        for p, d in enumerate(devices):
            if same_device(v.device, d):
                out[cap.key] = p
                break
    return out

# Created once per process: slots of moved variables are created on their devices.
install_slot_placement()
