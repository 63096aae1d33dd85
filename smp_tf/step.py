"""`smp.step`: split a batch into micro-batches, trace, partition, pipeline.

A call of a step function is equivalent to this sequential loop (the
*reference*), only faster::

    outputs = []
    for m in range(M):                     # M = microbatches
        args_m = rows m, m+M, m+2M, ... of every split argument
        outputs.append(fn(*args_m))
    return StepOutput per returned value, holding the M values

The body is traced once per micro-batch signature into a graph (forward,
loss and the gradients taken with `tf.GradientTape`), partitioned, cut into
tasks with `SMPInput`/`SMPOutput` boundaries and run on a pipeline schedule.
All of that is cached; later calls only run the built graph. Called eagerly,
the step runs a cached `tf.function`; called inside a `tf.function`, it emits
its ops into the caller's graph.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from smp_tf import state
from smp_tf.graph_view import OpGraph, from_tf_graph
from smp_tf.partitioner.plan import PartitionPlan, assign_partitions
from smp_tf.split import split_arguments
from smp_tf.step_output import FusedOp, StepOutput
from smp_tf.trace import recording

__all__ = ["step", "StepFunction", "register_post_partition_hook"]


@dataclass
class CapturedVariable:
    """A variable the traced step reads or writes.

    Attributes:
        key: unique readable name (the Keras variable path when there is one).
        variable: the `tf.Variable` captured by the trace.
        owner: the Keras variable wrapping it, if any (its value can be moved).
    """

    key: str
    variable: Any
    owner: Any = None

    @property
    def current(self) -> Any:
        """The `tf.Variable` to use now (the owner may have been moved)."""
        return self.owner.value if self.owner is not None else self.variable


@dataclass
class Traced:
    """One traced micro-batch step.

    Attributes:
        graph: a plain `tf.Graph` copy of the traced graph (it holds no
            reference to the captured variables, so moved variables are freed).
        op_graph: the `OpGraph` view.
        arg_names: placeholder names of the flat tensor arguments, in order.
        output_names: names of the flat output tensors (None for None outputs).
        output_structure: the returned structure, for packing.
        captures: placeholder name -> `CapturedVariable`, or -> the external
            tensor for captured non-variable tensors.
        layers: the Keras layers called during the trace.
        view_seconds: time spent building `op_graph`.
    """

    graph: tf.Graph
    op_graph: OpGraph
    arg_names: List[str]
    output_names: List[Optional[str]]
    output_structure: Any
    captures: Dict[str, Any]
    layers: List[Any] = field(default_factory=list)
    view_seconds: float = 0.0


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


def trace_microbatch(
    fn: Callable, mb_args: tuple, mb_kwargs: dict, *, extra_variables: Sequence[Any] = (), tf_function_kwargs: Optional[dict] = None
) -> Traced:
    """Traces `fn` for one micro-batch into a `Traced` (see `Traced`).

    Tensor leaves of the arguments become placeholders (in flatten order);
    everything else is baked into the trace, as `tf.function` does.
    """
    structure = (mb_args, mb_kwargs)
    leaves = tf.nest.flatten(structure)
    positions = [i for i, x in enumerate(leaves) if isinstance(x, tf.Tensor)]
    specs = [tf.TensorSpec(leaves[i].shape, leaves[i].dtype, name=f"arg{k}") for k, i in enumerate(positions)]

    def flat_fn(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        a, k = tf.nest.pack_sequence_as(structure, filled)
        return fn(*a, **k)

    kwargs = dict(tf_function_kwargs or {})
    kwargs.pop("input_signature", None)
    kwargs.pop("jit_compile", None)
    with recording() as records:
        concrete = tf.function(flat_fn, **kwargs).get_concrete_function(*specs)
    fg = concrete.graph
    record = next((r for r in records if r.graph is fg), None)
    layers = list(record.layers) if record is not None else []

    n_args = len(fg.inputs) - len(fg.internal_captures)
    arg_names = [t.op.name for t in fg.inputs[:n_args]]

    # Map captured resource handles back to their variables.
    keras_of = _keras_variables_of(layers)
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

    t_view = time.perf_counter()
    op_graph = from_tf_graph(
        fg,
        arg_ops=arg_names,
        captured_variables=captured_vars,
        layer_of=record.layer_name_of if record is not None else None,
        manual_partition_of=record.partition_of if record is not None else None,
    )
    view_seconds = time.perf_counter() - t_view
    outputs = tf.nest.flatten(fg.structured_outputs, expand_composites=True)
    output_names = [None if t is None else t.name for t in outputs]

    # A capture-free copy of the graph for inspection (see Traced.graph).
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(fg.as_graph_def(), name="")
    return Traced(graph, op_graph, arg_names, output_names, fg.structured_outputs, captures, layers, view_seconds)


def register_post_partition_hook(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Decorator: `fn()` runs once after the first partitioning of each step,
    before the first pipelined execution (e.g. to load a checkpoint into the
    moved variables).
    """
    state._STATE.post_partition_hooks.append(fn)
    return fn


class StepFunction:
    """A function decorated with `smp.step` (see the module doc)."""

    def __init__(
        self,
        fn: Callable,
        non_split_inputs: Optional[Sequence[str]] = None,
        input_split_axes: Optional[Mapping[str, int]] = None,
        input_signature: Optional[Sequence[Any]] = None,
        **tf_function_kwargs: Any,
    ) -> None:
        if not callable(fn):
            raise ValueError(f"smp.step expects a callable. Received: {fn!r}")
        self._fn = fn
        self._signature = inspect.signature(fn)
        self._non_split = list(non_split_inputs or [])
        self._split_axes = dict(input_split_axes or {})
        params = set(self._signature.parameters)
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in self._signature.parameters.values())
        for label, names in (("non_split_inputs", self._non_split), ("input_split_axes", list(self._split_axes))):
            unknown = [n for n in names if n not in params]
            if unknown and not has_var_kw:
                raise ValueError(
                    f"smp.step({label}=...) names {unknown}, which are not parameters of "
                    f"{getattr(fn, '__name__', fn)}{self._signature}. Valid names: {sorted(params)}."
                )
        self._input_signature = input_signature
        self._tf_kwargs = tf_function_kwargs
        self._lock = threading.RLock()
        self._compiled: Dict[Any, Any] = {}
        self._generation = -1
        self._eager_fn = None
        self._hooks_ran = False
        self.schedule = None
        self.last_plan: Optional[PartitionPlan] = None
        functools.update_wrapper(self, fn)

    # -- splitting -------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict, num_microbatches: int) -> List[Tuple[tuple, dict]]:
        parts = split_arguments(
            self._signature, args, kwargs, num_microbatches, self._non_split, self._split_axes
        )
        # numpy arrays become tensors so that they are traced, not baked in.
        def to_tensor(x):
            return tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x

        return [tf.nest.map_structure(to_tensor, p) for p in parts]

    # -- tracing and partitioning ------------------------------------------
    def _cache_key(self, mb: Tuple[tuple, dict]) -> Any:
        key = []
        for x in tf.nest.flatten(mb):
            if isinstance(x, tf.Tensor):
                key.append(("T", tuple(x.shape.as_list()) if x.shape.rank is not None else None, x.dtype.name))
            else:
                try:
                    hash(x)
                    key.append(("V", type(x).__name__, x))
                except TypeError:
                    key.append(("O", id(x)))
        return (repr(tf.nest.map_structure(lambda _: 0, mb)), tuple(key))

    def _check_generation(self) -> None:
        if self._generation != state.generation():
            self._compiled.clear()
            self._eager_fn = None
            self._generation = state.generation()

    def _trace_and_partition(self, mb: Tuple[tuple, dict]):
        cfg = state.config()
        topo = state.topology()
        t0 = time.perf_counter()
        from smp_tf.keras_model import live_models

        extra = [v for m in live_models() for v in m.variables]
        traced = trace_microbatch(self._fn, mb[0], mb[1], extra_variables=extra, tf_function_kwargs=self._tf_kwargs)
        t1 = time.perf_counter()
        assignment = assign_partitions(
            traced.op_graph,
            cfg.partitions,
            optimize=cfg.optimize,
            contiguous=cfg.contiguous,
            auto_partition=cfg.auto_partition,
            default_partition=cfg.default_partition or 0,
        )
        # Partitioning time: the graph view, the groups and the assignment.
        plan = PartitionPlan(
            traced.graph, traced.op_graph, assignment, cfg.partitions, topo.devices,
            traced.view_seconds + time.perf_counter() - t1,
        )
        plan.trace_seconds = t1 - t0 - traced.view_seconds
        plan.view_seconds = traced.view_seconds
        return traced, plan

    def get_plan(self, *args: Any, **kwargs: Any) -> PartitionPlan:
        """Traces and partitions the step for these arguments without running it.

        Returns:
            The `PartitionPlan` of the micro-batch step.
        """
        cfg = state.config()
        with self._lock:
            self._check_generation()
            mbs = self._split(args, kwargs, cfg.microbatches)
            key = self._cache_key(mbs[0])
            entry = self._compiled.get(key)
            if entry is not None:
                return entry.plan
            _, plan = self._trace_and_partition(mbs[0])
            return plan

    # -- running -------------------------------------------------------------
    def _compile(self, mbs: List[Tuple[tuple, dict]]):
        from smp_tf.lowering import CompiledStep

        key = self._cache_key(mbs[0])
        entry = self._compiled.get(key)
        if entry is None:
            traced, plan = self._trace_and_partition(mbs[0])
            cfg = state.config()
            from smp_tf.keras_model import live_models

            optimizers = [m.optimizer for m in live_models() if getattr(m, "optimizer", None) is not None]
            entry = CompiledStep(traced, plan, cfg, optimizers)
            self._compiled[key] = entry
            self.last_plan = plan
            if not self._hooks_ran:
                self._hooks_ran = True
                for hook in list(state._STATE.post_partition_hooks):
                    hook()
        self.schedule = entry.schedule
        return entry

    def _emit(self, args: tuple, kwargs: dict):
        """Emits the pipelined step into the current graph; returns StepOutputs."""
        cfg = state.config()
        mbs = self._split(args, kwargs, cfg.microbatches)
        with self._lock:
            self._check_generation()
            entry = self._compile(mbs)
        per_mb = entry.emit([tf.nest.flatten(mb) for mb in mbs])
        return tf.nest.map_structure(_step_output, *per_mb)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state.config()  # raises a clear error before smp.init
        if not tf.executing_eagerly():
            return self._emit(args, kwargs)
        with self._lock:
            self._check_generation()
            if self._eager_fn is None:
                # Library code needs no AutoGraph; the user's body is traced
                # with the user's own tf.function options in trace_microbatch.
                kw = {k: v for k, v in self._tf_kwargs.items() if k not in ("jit_compile", "autograph")}
                sig = self._input_signature

                def run(*a, **k):
                    outs = self._emit(a, k)
                    # StepOutputs are not tensors: return their values in a
                    # marked dict and rebuild them outside.
                    return tf.nest.map_structure(_mark, outs)

                self._eager_fn = tf.function(run, input_signature=sig, autograph=False, **kw)
        raw = self._eager_fn(*args, **kwargs)
        return _rebuild_step_outputs(raw)


_MARK = "__smp_step_output__"
# A fused StepOutput leaves an eager step's tf.function as its inputs under a
# key that also spells its FusedOp (a tf.function returns tensors, not Python
# objects): _FUSED_MARK + op_type|data_format|device.
_FUSED_MARK = "__smp_fused_step_output__"


def _step_output(*values: Any) -> StepOutput:
    """The StepOutput of one output from its per-micro-batch values."""
    from smp_tf.lowering import FusedValue

    if isinstance(values[0], FusedValue):
        return StepOutput._from_fused(values[0].op, [v.inputs for v in values])
    return StepOutput(list(values))


def _mark(so: StepOutput) -> Dict[str, Any]:
    if so._fused is not None and so._values is None:
        op = so._fused
        key = f"{_FUSED_MARK}{op.op_type}|{op.data_format}|{op.device}"
        return {key: [list(x) for x in so._fused_inputs]}
    return {_MARK: so.outputs}


def _rebuild_step_outputs(raw: Any) -> Any:
    """Inverse of the marking done by the eager wrapper."""
    if isinstance(raw, dict):
        if set(raw) == {_MARK}:
            return StepOutput(list(raw[_MARK]))
        if len(raw) == 1 and next(iter(raw)).startswith(_FUSED_MARK):
            key = next(iter(raw))
            op = FusedOp(*key[len(_FUSED_MARK):].split("|"))
            return StepOutput._from_fused(op, [tuple(x) for x in raw[key]])
        return {k: _rebuild_step_outputs(v) for k, v in raw.items()}
    if isinstance(raw, tuple) and hasattr(raw, "_fields"):
        return type(raw)(*[_rebuild_step_outputs(x) for x in raw])
    if isinstance(raw, (list, tuple)):
        return type(raw)(_rebuild_step_outputs(x) for x in raw)
    return raw


def step(
    fn: Optional[Callable] = None,
    *,
    non_split_inputs: Optional[Sequence[str]] = None,
    input_split_axes: Optional[Mapping[str, int]] = None,
    input_signature: Optional[Sequence[Any]] = None,
    **tf_function_kwargs: Any,
) -> Any:
    """Decorates a training step so that it runs pipelined over micro-batches.

    Usable as ``@smp.step`` or ``@smp.step(non_split_inputs=[...], ...)``.

    Args:
        fn: the step body, written for one micro-batch. It may use
            `tf.GradientTape`; `apply_gradients` belongs outside the step.
        non_split_inputs: parameter names passed whole to every micro-batch.
        input_split_axes: parameter name -> axis to split along (default 0).
        input_signature: as for `tf.function`, describing the full batch.
        **tf_function_kwargs: passed to `tf.function` (e.g. ``autograph``,
            ``reduce_retracing``).

    Returns:
        A `StepFunction`. Calling it returns the body's structure with every
        tensor replaced by a `StepOutput` holding the per-micro-batch values.
    """
    def wrap(f: Callable) -> StepFunction:
        return StepFunction(
            f,
            non_split_inputs=non_split_inputs,
            input_split_axes=input_split_axes,
            input_signature=input_signature,
            **tf_function_kwargs,
        )

    if fn is None:
        return wrap
    return wrap(fn)
