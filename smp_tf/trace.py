"""Tracing one micro-batch of a step, and what the trace records.

`trace_microbatch` traces the step body for one micro-batch into a graph and
returns a `Traced`: the graph, its `OpGraph` view, and the variables it
captured. While it traces, it records which Keras layer and which
`smp.partition(i)` block created each op.

Op names are not enough for either: TensorFlow uniquifies name scopes per
graph (a layer called ``dense`` may trace under ``sequential_1/dense_1``), and
a `smp.partition` block has no name at all. Ops get increasing ids in
creation order, so a context that is active from id ``a`` to id ``b`` owns the
ops created in between; the innermost context wins.
"""

from __future__ import annotations

import smp_tf._autograph  # noqa: F401  (keeps AutoGraph out of smp_tf)

import contextlib
import gc
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from smp_tf.graph_view import OpGraph, from_tf_graph
from smp_tf.sharding import storage

__all__ = [
    "partition", "TraceRecord", "recording", "CapturedVariable", "CapturedShard", "Traced", "trace_microbatch",
]

_local = threading.local()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector inside the block.

    Tracing a large model and importing its tasks allocate millions of
    objects that all stay alive (ops, tensors); the allocations set off full
    collections that walk every object of the process, again and again
    (about 0.5 s of ResNet50's first call). Paused, one collection after the
    block does that work once. Nothing is leaked: the collector runs as
    usual after the block.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _current_record() -> Optional["TraceRecord"]:
    """The record of the graph being built now, inside `recording()`; else None."""
    records = getattr(_local, "records", None)
    if records is None:
        return None
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
    """What one trace recorded: op id -> layer call, op id -> manual partition."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        # op id -> (layer, ordinal of the call in this trace): the innermost
        # layer call that created the op.
        self.layer_of_op: Dict[int, Tuple[Any, int]] = {}
        self.calls = 0
        # Ordinals of the layer calls open now (innermost last), and of the
        # calls that called another layer (composite layers).
        self.open_calls: List[int] = []
        self.composite_calls: set = set()
        self.partition_of_op: Dict[int, int] = {}
        self.layers: List[Any] = []
        self.models: List[Any] = []

    def _close(self, start: int, target: Dict[int, Any], value: Any) -> None:
        end = _next_op_id(self.graph)
        for op_id in range(start + 1, end + 1):
            # Inner contexts close first, so setdefault keeps the innermost.
            target.setdefault(op_id, value)

    def layer_name_of(self, op: Any) -> Optional[str]:
        call = self.layer_of_op.get(op._id)
        return None if call is None else _layer_key(call[0])

    def layer_call_of(self, op: Any) -> Optional[str]:
        """Key of the layer call that created `op`: one per call of a layer."""
        call = self.layer_of_op.get(op._id)
        return None if call is None else f"{_layer_key(call[0])}@{call[1]}"

    def is_glue(self, op: Any) -> bool:
        """Whether `op` was created directly by a layer call that also called
        other layers (the glue of a composite layer: residual additions, a
        gating product, masks)."""
        call = self.layer_of_op.get(op._id)
        return call is not None and call[1] in self.composite_calls

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
    if record is None:
        return _original_call(self, *args, **kwargs)
    if _is_model(self):
        # A model's own ops (the glue in a subclassed model's call: residual
        # adds, a tied projection) span the whole network; grouping them as
        # one "layer" would pin them all together. Its layers still record;
        # the model is kept only to name its variables.
        if not any(m is self for m in record.models):
            record.models.append(self)
        return _original_call(self, *args, **kwargs)
    if not any(l is self for l in record.layers):
        record.layers.append(self)
    record.calls += 1
    ordinal = record.calls
    if record.open_calls:
        record.composite_calls.add(record.open_calls[-1])
    record.open_calls.append(ordinal)
    try:
        with _in_graph_context(record, record.layer_of_op, (self, ordinal)):
            return _original_call(self, *args, **kwargs)
    finally:
        record.open_calls.pop()


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
        if state.is_initialized() and index >= state.config().num_stages:
            raise ValueError(
                f"smp.partition index {index} must be less than the number of "
                f"{state.config()._stages_phrase()}."
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


@dataclass
class CapturedVariable:
    """A variable the traced step reads or writes.

    Attributes:
        key: unique readable name (the Keras variable path when there is one).
        variable: the `tf.Variable` captured by the trace. Placement moves it
            in place (same object, new handle), so it is always current.
        owner: the Keras variable wrapping it, if any.
    """

    key: str
    variable: Any
    owner: Any = None

    @property
    def current(self) -> Any:
        """The `tf.Variable` to use now (the same object as `variable`)."""
        return self.variable


@dataclass
class CapturedShard:
    """One device's piece of a variable whose storage tensor parallelism
    splits (`smp_tf.sharding.storage`): the step reads it instead of the
    variable's own handle.

    Attributes:
        key: the variable's key (as its `CapturedVariable`'s).
        variable: the split `tf.Variable`.
        shard: the piece, which is device ``shard`` of the stage.
    """

    key: str
    variable: Any
    shard: int

    def piece(self) -> Any:
        """The `tf.Variable` holding this piece now."""
        shards = getattr(self.variable, "_smp_shards", None)
        if shards is None or self.shard >= len(shards):
            raise RuntimeError(
                f"Variable {self.key!r} is not split into {self.shard + 1} or more pieces any more; "
                "call the step again after smp.init so that it is placed anew."
            )
        return shards[self.shard]


@dataclass
class Traced:
    """One traced micro-batch step.

    Attributes:
        graph: a plain `tf.Graph` copy of the traced graph (it holds no
            reference to the captured variables, so moved variables are
            freed), imported from `graph_def` on first use.
        graph_def: the traced graph's `GraphDef`.
        op_graph: the `OpGraph` view.
        arg_names: placeholder names of the flat tensor arguments, in order.
        output_names: names of the flat output tensors (None for None outputs).
        output_structure: the returned structure, for packing.
        captures: placeholder name -> `CapturedVariable`, or -> the external
            tensor for captured non-variable tensors.
        layers: the Keras layers called during the trace.
        view_seconds: time spent building `op_graph`.
        functions: the functions the traced graph calls (kept registered).
        split_outputs: with tensor parallelism, flat output index -> (the
            dimension it is split along, the names of its ``t`` pieces, one
            per device of its stage) for the gradients the step returns in
            pieces (`smp_tf.sharding.lower`); ``output_names`` names piece 0.
    """

    graph_def: Any
    op_graph: OpGraph
    arg_names: List[str]
    output_names: List[Optional[str]]
    output_structure: Any
    captures: Dict[str, Any]
    layers: List[Any] = field(default_factory=list)
    view_seconds: float = 0.0
    functions: List[Any] = field(default_factory=list, repr=False, compare=False)
    split_outputs: Dict[int, Tuple[int, List[str]]] = field(default_factory=dict)
    _graph: Optional[tf.Graph] = field(default=None, init=False, repr=False, compare=False)

    @property
    def graph(self) -> tf.Graph:
        """A plain `tf.Graph` imported from `graph_def` on first use: the
        step itself needs only the `GraphDef`, and importing a large graph
        costs about as much as tracing its forward pass."""
        if self._graph is None:
            graph = tf.Graph()
            with graph.as_default():
                tf.graph_util.import_graph_def(self.graph_def, name="")
            self._graph = graph
        return self._graph

    def output_tensors(self) -> List[Optional[int]]:
        """`op_graph` tensor id of each flat output (None for None outputs)."""
        g = self.op_graph
        ids = {g.tensor_name(t.id): t.id for t in g.tensors}
        return [None if name is None else ids[name] for name in self.output_names]

    def split_output_tensors(self) -> Dict[int, Tuple[int, List[int]]]:
        """`split_outputs` with `op_graph` tensor ids for the pieces."""
        g = self.op_graph
        ids = {g.tensor_name(t.id): t.id for t in g.tensors}
        return {k: (dim, [ids[name] for name in names]) for k, (dim, names) in self.split_outputs.items()}


def _keras_variables_of(layers: Sequence[Any]) -> Dict[int, Any]:
    """id(tf.Variable) -> Keras variable, for the variables of `layers`."""
    out: Dict[int, Any] = {}
    for layer in layers:
        try:
            variables = list(layer.variables)
        except Exception:  # pragma: no cover - exotic layers
            continue
        for kv in variables:
            value = getattr(kv, "_value", None)
            if isinstance(value, tf.Variable):
                out[id(value)] = kv
    return out


def _unique(key: str, used: Dict[str, int]) -> str:
    n = used.get(key, 0)
    used[key] = n + 1
    return key if n == 0 else f"{key}_{n}"


class _Leaf:
    """Stands for the k-th tensor leaf of a step's arguments."""

    def __init__(self, k: int) -> None:
        self.k = k


def _argument_names(fn: Callable, structure: tuple, positions: Sequence[int], specs: Sequence[Any]) -> List[str]:
    """The names `tf.function(fn)` gives the placeholders of the tensor leaves
    at `positions` of ``flatten(structure)`` (``structure = (args, kwargs)``).

    A single-device run of the step is a ``tf.function`` of it, and the graph
    optimiser's rewrites depend on node names (it sorts the inputs of
    commutative ops by name); the trace names its placeholders the same way
    so that its tasks are rewritten as that run is. Found by tracing an empty
    function with `fn`'s signature (cheap); if the signature cannot be read,
    ``arg0``, ``arg1``, ... .
    """
    fallback = [f"arg{k}" for k in range(len(positions))]
    try:
        signature = inspect.signature(fn)
        leaves = tf.nest.flatten(structure)
        marked, spec_leaves = list(leaves), list(leaves)
        for k, i in enumerate(positions):
            marked[i], spec_leaves[i] = _Leaf(k), specs[k]
        m_args, m_kwargs = tf.nest.pack_sequence_as(structure, marked)
        where = signature.bind(*m_args, **m_kwargs).arguments
        s_args, s_kwargs = tf.nest.pack_sequence_as(structure, spec_leaves)
    except (TypeError, ValueError):
        return fallback
    found: Dict[int, str] = {}

    def probe(*args, **kwargs):
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if name in where:  # defaults the caller did not pass hold no leaf
                for leaf, t in zip(tf.nest.flatten(where[name]), tf.nest.flatten(value)):
                    if isinstance(leaf, _Leaf) and isinstance(t, tf.Tensor):
                        found[leaf.k] = t.op.name
        return tf.constant(0)

    probe.__signature__ = signature
    try:
        tf.function(probe, autograph=False).get_concrete_function(*s_args, **s_kwargs)
    except (TypeError, ValueError):
        return fallback
    names = [found.get(k) for k in range(len(positions))]
    return fallback if None in names or len(set(names)) != len(names) else names


def trace_microbatch(
    fn: Callable,
    mb_args: tuple,
    mb_kwargs: dict,
    *,
    shapes: Optional[Sequence[Any]] = None,
    extra_variables: Sequence[Any] = (),
    tf_function_kwargs: Optional[dict] = None,
) -> Traced:
    """Traces `fn` for one micro-batch into a `Traced` (see `Traced`).

    Tensor leaves of the arguments become placeholders (in flatten order),
    with the given `shapes` (default: the leaves' own shapes); everything
    else is baked into the trace, as `tf.function` does.
    """
    with gc_paused():
        return _trace_microbatch(fn, mb_args, mb_kwargs, shapes, extra_variables, tf_function_kwargs)


def _trace_microbatch(fn, mb_args, mb_kwargs, shapes, extra_variables, tf_function_kwargs) -> Traced:
    structure = (mb_args, mb_kwargs)
    leaves = tf.nest.flatten(structure)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, tf.Tensor)]
    if shapes is None:
        shapes = [leaves[i].shape for i in positions]
    specs = [tf.TensorSpec(shape, leaves[i].dtype) for i, shape in zip(positions, shapes)]
    names = _argument_names(fn, structure, positions, specs)
    specs = [tf.TensorSpec(spec.shape, spec.dtype, name=name) for spec, name in zip(specs, names)]

    def flat_fn(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        a, k = tf.nest.pack_sequence_as(structure, filled)
        return fn(*a, **k)

    kwargs = dict(tf_function_kwargs or {})
    kwargs.pop("input_signature", None)
    kwargs.pop("jit_compile", None)
    # Variables whose storage tensor parallelism split are read through
    # their own handle: the trace is that of the whole variable, and the
    # sharding rewrite reads the pieces instead.
    with recording() as records, storage.reading_own_handle():
        concrete = tf.function(flat_fn, **kwargs).get_concrete_function(*specs)
    fg = concrete.graph
    record = next((r for r in records if r.graph is fg), None)
    layers = list(record.layers) if record is not None else []
    models = list(record.models) if record is not None else []

    n_args = len(fg.inputs) - len(fg.internal_captures)
    arg_names = [t.op.name for t in fg.inputs[:n_args]]

    # Map captured resource handles back to their variables.
    keras_of = _keras_variables_of(layers + models)
    for v in extra_variables:
        value = getattr(v, "_value", None)
        if isinstance(value, tf.Variable):
            keras_of.setdefault(id(value), v)
    var_by_handle = {id(v.handle): v for v in fg.variables}
    captures: Dict[str, Any] = {}
    captured_vars: Dict[str, Tuple[str, int, bool]] = {}
    used: Dict[str, int] = {}
    for external, internal in fg.captures:
        name = internal.op.name
        var = var_by_handle.get(id(external))
        if var is None:
            captures[name] = external
            continue
        owner = keras_of.get(id(var))
        key = _unique(owner.path if owner is not None else var.name.split(":")[0], used)
        captures[name] = CapturedVariable(key, var, owner)
        nbytes = int(np.prod(var.shape.as_list() or [1])) * var.dtype.size if var.shape.is_fully_defined() else 0
        captured_vars[name] = (key, nbytes, bool(var.trainable))

    graph_def = fg.as_graph_def()
    t_view = time.perf_counter()
    op_graph = from_tf_graph(
        fg,
        arg_ops=arg_names,
        captured_variables=captured_vars,
        captured_ops=captures,
        layer_of=record.layer_name_of if record is not None else None,
        layer_call_of=record.layer_call_of if record is not None else None,
        glue_of=record.is_glue if record is not None else None,
        manual_partition_of=record.partition_of if record is not None else None,
        graph_def=graph_def,
    )
    view_seconds = time.perf_counter() - t_view
    outputs = tf.nest.flatten(fg.structured_outputs, expand_composites=True)
    output_names = [None if t is None else t.name for t in outputs]

    # The capture-free GraphDef (see Traced.graph). The functions the graph
    # calls (a while loop's body, a gradient's) stay registered only while
    # something holds them; the task functions call them by name.
    traced = Traced(graph_def, op_graph, arg_names, output_names, _specs_of(fg.structured_outputs), captures, layers,
                    view_seconds, functions=list(getattr(fg, "_functions", {}).values()))
    _release_captures(fg, concrete)
    return traced


def _release_captures(fg: Any, concrete: Any) -> None:
    """Drops the traced graph's references to what it captured.

    The graph is not needed after the trace (`Traced` keeps its GraphDef),
    but it may outlive it: ``tf.custom_gradient`` registers a gradient
    function whose closure holds the graph's tensors for the life of the
    process (Keras's EfficientNetV2 has such ops). Its captures would keep
    the variables' resources from before placement alive, and the first
    write would give them a copy of their own (31 MiB on EfficientNetV2B0
    at P=2)."""
    captures = getattr(fg, "_function_captures", None)
    if captures is not None:
        captures.clear()
        recompute = getattr(captures, "_recompute_cached_properties", None)
        if recompute is not None:
            recompute()  # the cached (external, internal) pairs
    if getattr(concrete, "_captured_inputs", None):
        concrete._captured_inputs = []


def _specs_of(structure: Any) -> Any:
    """`structure` with every tensor and composite tensor replaced by its
    `tf.TypeSpec` (which packs and flattens the same way). The traced
    graph's own tensors would keep the graph alive, and with it its
    captures: the variables' resources from before placement, which get a
    copy of their own at the first write (a whole second copy of every
    moved variable)."""
    def spec(x: Any) -> Any:
        if isinstance(x, (tf.Tensor, tf.IndexedSlices, tf.__internal__.CompositeTensor)):
            return tf.type_spec_from_value(x)
        return x

    return tf.nest.map_structure(spec, structure)
