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

import contextlib
import dataclasses
import functools
import inspect
import threading
import time
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from smp_tf import placement, state
from smp_tf.profiling import timeline
from smp_tf.memory import optimizer_slots, predict_assignment, refine_memory_split, stage_multipliers
from smp_tf.lowering import CompiledStep, FusedValue, cpu_kernels_allocate_scratch
from smp_tf.partitioner.plan import DEFAULT_SLOTS, PartitionPlan, assign_partitions
from smp_tf.split import check_split_sizes, split_arguments
from smp_tf.step_output import FusedOp, SplitValue, StepOutput
from smp_tf.schedules import schedule_builder
from smp_tf.trace import Traced, trace_microbatch

__all__ = ["step", "StepFunction", "register_post_partition_hook"]


def register_post_partition_hook(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Decorator: `fn()` runs after the model is first partitioned and its
    variables are placed, before the first pipelined execution (e.g. to load
    a checkpoint into the placed variables).

    It runs once per `smp.init`: after the first partitioning of the first
    step called since then (a later `smp.init` runs it again). It runs
    eagerly, also when the step is first called inside a `tf.function`, so
    its ops never become part of a traced step.
    """
    if not callable(fn):
        raise ValueError(f"register_post_partition_hook expects a callable. Received: {fn!r}")
    state._STATE.post_partition_hooks.append(fn)
    return fn


def _config_key() -> tuple:
    """What a compiled step depends on: the config but its schedule kind
    (only whether its backward tasks are split into B and W, which
    ``zero_bubble`` needs), and the devices. With ``optimize="memory"`` or a
    memory budget, what is compiled depends on how many micro-batches each
    stage keeps alive under the schedule (the split; what is recomputed to
    fit the budget), so the schedule kind is part of the key."""
    cfg = state.config()
    fields = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "pipeline")
    by_memory = cfg.optimize == "memory" or _memory_budget(cfg) is not None
    schedule = cfg.pipeline if by_memory else schedule_builder(cfg.pipeline).split_weight
    return fields + (schedule, tuple(state.topology().devices))


#: Boundary moves at most when ``optimize="memory"`` settles its split on the
#: predicted peaks (`smp_tf.memory.refine_memory_split`); each costs one
#: prediction of the tasks and schedule.
MEMORY_SPLIT_MOVES = 8


def stage_devices(cfg: Any, devices: Sequence[str]) -> List[str]:
    """The device of each partition: with ``virtual_stages`` v, partition
    (chunk) ``c`` of ``partitions * v`` runs on ``devices[c % partitions]``."""
    return [devices[c % cfg.partitions] for c in range(cfg.num_stages)]


def _memory_budget(cfg: Any) -> Any:
    """``memory_budget``, or on GPUs split into logical GPUs with memory
    limits, the smallest limit. With a declared ``cluster`` whose devices
    give their memory, each device's own: device -> bytes (the smaller of
    its memory and ``memory_budget``), the cluster's devices taken in the
    order this process's devices are (`Topology.all_devices`)."""
    if cfg.cluster is not None:
        from smp_tf.planner import resource_graph_of

        declared = resource_graph_of(cfg.cluster).devices
        own = {}
        for local, device in zip(state.topology().all_devices(), declared):
            limits = [x for x in (device.memory, cfg.memory_budget) if x]
            if limits:
                own[local] = min(limits)
        if own:
            return own
    if cfg.memory_budget is not None:
        return cfg.memory_budget
    if state.topology().kind != "GPU":
        return None
    limits = []
    for gpu in tf.config.list_physical_devices("GPU"):
        for logical in tf.config.get_logical_device_configuration(gpu) or []:
            if logical.memory_limit:
                limits.append(int(logical.memory_limit) * 2**20)
    return min(limits) if limits else None


def _device_capacities(cfg: Any) -> Optional[Dict[Tuple[int, int], float]]:
    """(device number, device within the stage) -> its bytes, when every
    device has its own (`_memory_budget` from a declared cluster)."""
    budget = _memory_budget(cfg)
    if not isinstance(budget, dict):
        return None
    groups = state.topology().stage_groups()
    out = {(d, k): float(budget[name]) for d, g in enumerate(groups) for k, name in enumerate(g) if name in budget}
    return out if len(out) == sum(len(g) for g in groups) else None


def _memory_split(assign: Callable[..., List[int]], traced: Traced, shard_plan: Any, cfg: Any, recompute: str,
                  slots: float) -> List[int]:
    """The ``optimize="memory"`` split settled on predicted peaks
    (`refine_memory_split`): boundary buffers and each stage's largest task
    are known only once the tasks exist, so it splits again with them as
    fixed bytes. The split is made once for every way the step is called:
    on the running sum's figure (``outputs_held=False``)."""
    outputs = [t for t in traced.output_tensors() if t is not None]
    # With virtual stages a device holds several chunks: the split
    # balances the devices' sums of their chunks' peaks.
    device_of = [c % cfg.partitions for c in range(cfg.num_stages)] if cfg.virtual_stages > 1 else None
    scratch = cpu_kernels_allocate_scratch()
    # With tensor parallelism each device of a stage counts on its own.
    sharding = {}
    if shard_plan is not None:
        from smp_tf.sharding.lower import shard_of_ops

        sharding = dict(shard_of_op=shard_of_ops(traced.graph_def, traced.op_graph),
                        tensor_degree=cfg.tensor_parallel_degree,
                        split_variables=sorted(shard_plan.stored_split))
    return refine_memory_split(
        assign,
        lambda parts: predict_assignment(
            traced.op_graph, parts, outputs, num_partitions=cfg.num_stages, num_microbatches=cfg.microbatches,
            kind=cfg.pipeline, recompute=recompute, slots=slots, device_of_partition=device_of,
            cpu_kernel_scratch=scratch, outputs_held=False, **sharding,
        ),
        moves=MEMORY_SPLIT_MOVES,
        device_of_partition=device_of,
        capacity=_device_capacities(cfg),
    )


def _stage_resources(cfg: Any, graph: Any) -> Tuple[Any, Optional[List[Any]], Optional[List[float]]]:
    """The declared cluster, the device of each stage and its speed on
    `graph`'s mix of work, when the config has a ``cluster``; Nones otherwise."""
    if cfg.cluster is None:
        return None, None, None
    from smp_tf.planner import resource_graph_of
    from smp_tf.planner.resources import effective_speeds, graph_flops_by_class, stage_devices

    cluster = resource_graph_of(cfg.cluster)
    devices = stage_devices(cluster, cfg.num_stages, cfg.partitions)
    mix = graph_flops_by_class([op.type for op in graph.ops], [op.flops for op in graph.ops])
    return cluster, devices, effective_speeds(devices, mix)


def _split_storage(plan: PartitionPlan) -> Tuple[Dict[str, int], Optional[List[List[str]]]]:
    """What `placement.place_variables` splits: variable key -> dimension,
    and each partition's stage devices (tensor parallelism)."""
    shard_plan = getattr(plan, "shard_plan", None)
    if shard_plan is None or not shard_plan.stored_split:
        return {}, None
    return dict(shard_plan.stored_split), [list(d) for d in plan.tensor_devices]


def _run_post_partition_hooks() -> None:
    """Runs the registered hooks once per `smp.init`, eagerly."""
    st = state._STATE
    if st.hooks_generation == state.generation():
        return
    st.hooks_generation = state.generation()
    with tf.init_scope():
        for hook in list(st.post_partition_hooks):
            hook()


_TRAINABLE_WRITE_HELP = """Optimizer updates belong outside the step: the step computes the gradients of
one micro-batch, smp_tf accumulates them over the micro-batches, and the
optimizer applies the accumulated gradient once per batch:

    @smp.step
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train(x, y):
        loss, grads = train_step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()"""


def _check_no_trainable_writes(traced: Traced) -> None:
    """Raises if the step body writes a trainable variable (an optimizer
    update inside the step would run once per micro-batch, in an order that
    depends on the schedule)."""
    g = traced.op_graph
    bad = [(op, v) for op in g.ops for v in op.writes if g.trainable.get(v, False)]
    if bad:
        names = sorted({v for _, v in bad})
        ops = [f"{op.name} ({op.type})" for op, _ in bad[:3]]
        raise ValueError(
            f"The smp.step body writes trainable variable(s) {names[:5]} (ops {ops}), for example "
            f"with optimizer.apply_gradients or variable.assign_sub. {_TRAINABLE_WRITE_HELP}"
        )


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
        #: The eager call's tf.function, with and without timing probes.
        self._eager_fns: Dict[bool, Any] = {}
        # Whether the step is being traced for an eager call (`_emit` inside
        # the eager wrapper): its outputs are then held to the end of the step.
        self._eager_trace = False
        self.schedule = None
        #: The `smp.Plan` the config key ``auto`` chose this step's config from.
        self.auto_plan = None
        self.last_plan: Optional[PartitionPlan] = None
        self.last_compiled: Optional[CompiledStep] = None
        #: The optimizer that applies this step's gradients, if known: its
        #: state counts in the memory report and against ``memory_budget``
        #: (set it with ``train_step.optimizer = optimizer``; Keras ``fit``
        #: sets it). Unknown, the budget check assumes Adam's two slots.
        self.optimizer: Any = None
        # With data parallelism, `accumulate()` of the gradients averages over
        # the replicas (Keras's fit turns this off and reduces by itself).
        self.reduce_over_replicas = True
        functools.update_wrapper(self, fn)

    def __get__(self, instance: Any, owner: Optional[type] = None) -> "StepFunction":
        """`smp.step` on a method: the step bound to one instance.

        ``self.grads(x, y)`` inside a class (a `DistributedModel`
        subclass's ``train_step``, a trainer) runs the step with ``self``
        bound, as for any method. Each instance gets its own `StepFunction`,
        with its own compiled steps, ``last_plan`` and ``schedule``: made on
        first access, kept in the instance's ``__dict__``. Through the class
        (``Model.grads``) the step is returned unbound.
        """
        if instance is None:
            return self
        name = getattr(self, "__name__", type(self._fn).__name__)
        key = f"_smp_tf_step_{name}_{id(self):x}"
        try:
            attributes = vars(instance)
        except TypeError:
            raise TypeError(
                f"smp.step on method {owner.__name__ if owner else type(instance).__name__}.{name}: "
                f"instances of {type(instance).__name__} have no __dict__ to keep their bound step in "
                "(a class with __slots__). Decorate a function instead, or add '__dict__' to __slots__."
            ) from None
        bound = attributes.get(key)
        if bound is None:
            with self._lock:
                bound = attributes.get(key)
                if bound is None:
                    bound = StepFunction(
                        types.MethodType(self._fn, instance),
                        non_split_inputs=self._non_split,
                        input_split_axes=self._split_axes,
                        input_signature=self._input_signature,
                        **self._tf_kwargs,
                    )
                    bound.optimizer = self.optimizer
                    bound.reduce_over_replicas = self.reduce_over_replicas
                    # Set through __dict__: Keras tracks attributes set normally.
                    attributes[key] = bound
        return bound

    # -- splitting -------------------------------------------------------
    def _split(self, args: tuple, kwargs: dict, num_microbatches: int, uneven: bool = False) -> List[Tuple[tuple, dict]]:
        from smp_tf.distributed import remote

        device = remote.first_stage_device()
        with tf.device(device) if device is not None else contextlib.nullcontext():
            parts = split_arguments(
                self._signature, args, kwargs, num_microbatches, self._non_split, self._split_axes, uneven=uneven
            )
        # numpy arrays become tensors so that they are traced, not baked in.
        def to_tensor(x):
            return tf.convert_to_tensor(x) if isinstance(x, np.ndarray) else x

        return [tf.nest.map_structure(to_tensor, p) for p in parts]

    # -- tracing and partitioning ------------------------------------------
    @staticmethod
    def _trace_shapes(mbs: List[Tuple[tuple, dict]]) -> List[tf.TensorShape]:
        """The shape each tensor argument is traced with: the most specific
        shape of all micro-batches (sizes differ after an uneven split)."""
        leaves = [[x for x in tf.nest.flatten(mb) if isinstance(x, tf.Tensor)] for mb in mbs]
        shapes = []
        for column in zip(*leaves):
            shape = column[0].shape
            for t in column[1:]:
                shape = shape.most_specific_common_supertype([t.shape]) if shape != t.shape else shape
            shapes.append(shape)
        return shapes

    def _cache_key(self, mbs: List[Tuple[tuple, dict]]) -> Any:
        shapes = iter(self._trace_shapes(mbs))
        key = []
        for x in tf.nest.flatten(mbs[0]):
            if isinstance(x, tf.Tensor):
                shape = next(shapes)
                key.append(("T", tuple(shape.as_list()) if shape.rank is not None else None, x.dtype.name))
            else:
                try:
                    hash(x)
                    key.append(("V", type(x).__name__, x))
                except TypeError:
                    key.append(("O", id(x)))
        return (repr(tf.nest.map_structure(lambda _: 0, mbs[0])), tuple(key))

    def _check_generation(self) -> None:
        """After `smp.init`, keeps only what was compiled for the same config
        (except the schedule kind, which `_compile` changes without a retrace,
        unless memory decides the split or the recomputation)."""
        if self._generation != state.generation():
            key = _config_key()
            self._compiled = {k: v for k, v in self._compiled.items() if k[1] == key}
            self._eager_fns = {}
            self._generation = state.generation()

    def _trace_and_partition(self, mbs: List[Tuple[tuple, dict]]):
        cfg = state.config()
        topo = state.topology()
        t0 = time.perf_counter()
        traced = trace_microbatch(
            self._fn, mbs[0][0], mbs[0][1], shapes=self._trace_shapes(mbs), tf_function_kwargs=self._tf_kwargs
        )
        _check_no_trainable_writes(traced)
        shard_plan = None
        if cfg.tensor_parallel_degree > 1:
            from smp_tf.sharding.api import shard_step

            traced, shard_plan = shard_step(traced, cfg, state.generation())
        t1 = time.perf_counter()
        devices = stage_devices(cfg, topo.devices)
        pinned = placement.pinned_partitions(traced.captures, devices)
        slots = DEFAULT_SLOTS if self.optimizer is None else optimizer_slots(self.optimizer)
        recompute = "never" if cfg.recompute == "auto" else cfg.recompute
        multipliers = stage_multipliers(cfg.num_stages, cfg.microbatches, cfg.pipeline, num_devices=cfg.partitions)
        # Declared devices (config key "cluster"): each stage's device speed
        # on this graph's mix of products, convolutions and the rest.
        cluster, stage_resources, speeds = _stage_resources(cfg, traced.op_graph)

        def assign(overheads: Optional[Sequence[float]] = None, shifts: Optional[Sequence[int]] = None) -> List[int]:
            return assign_partitions(
                traced.op_graph,
                cfg.num_stages,
                optimize=cfg.optimize,
                # optimize="memory": a stage's activations count as often as the
                # schedule keeps micro-batches alive there.
                stage_multipliers=multipliers,
                recompute=recompute,
                # The optimizer's state per trainable byte when the step knows
                # its optimizer; otherwise Adam's two slots.
                slots=slots,
                contiguous=cfg.contiguous,
                auto_partition=cfg.auto_partition,
                default_partition=cfg.default_partition or 0,
                # Variables placed by an earlier step since smp.init stay; their
                # ops go where they live.
                pinned=pinned,
                stage_overheads=overheads,
                bound_shifts=shifts,
                stage_speeds=speeds,
            )

        if cfg.optimize == "memory" and cfg.contiguous and cfg.auto_partition and cfg.num_stages > 1 and not pinned:
            assignment = _memory_split(assign, traced, shard_plan, cfg, recompute, slots)
        else:
            assignment = assign()
        # Partitioning time: the graph view, the groups and the assignment.
        plan = PartitionPlan(
            lambda: traced.graph, traced.op_graph, assignment, cfg.num_stages, devices,
            traced.view_seconds + time.perf_counter() - t1,
        )
        plan.stage_resources, plan.cluster = stage_resources, cluster
        plan.trace_seconds = t1 - t0 - traced.view_seconds
        plan.view_seconds = traced.view_seconds
        plan.shard_plan = shard_plan
        if shard_plan is not None:
            from smp_tf.sharding.lower import shard_of_ops

            plan.tensor_devices = [topo.stage_devices(c % cfg.partitions) for c in range(cfg.num_stages)]
            plan.shard_of_op = shard_of_ops(traced.graph_def, traced.op_graph)
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
            entry = self._compiled.get((self._cache_key(mbs), _config_key()))
            if entry is not None:
                return entry.plan
            _, plan = self._trace_and_partition(mbs)
            return plan

    # -- running -------------------------------------------------------------
    def _compile(self, mbs: List[Tuple[tuple, dict]]):
        """The compiled step for these micro-batches: traced, partitioned and
        lowered once per signature and config; scheduled once per schedule
        kind and micro-batch count."""
        cfg = state.config()
        key = (self._cache_key(mbs), _config_key())
        entry = self._compiled.get(key)
        if entry is not None and entry.generation != state.generation():
            # Compiled under an earlier smp.init with the same config: reuse
            # it if the variables may stay where its plan put them.
            pins = placement.pinned_partitions(entry.traced.captures, entry.plan.devices)
            planned = entry.plan.partition_of_variable()
            if any(planned.get(k, p) != p for k, p in pins.items()):
                entry = None
            else:
                entry.variable_devices = placement.place_variables(
                    entry.traced.captures, planned, entry.plan.devices, *_split_storage(entry.plan))
                _run_post_partition_hooks()
                entry.generation = state.generation()
        if entry is None:
            traced, plan = self._trace_and_partition(mbs)
            variable_devices = placement.place_variables(
                traced.captures, plan.partition_of_variable(), plan.devices, *_split_storage(plan)
            )
            _run_post_partition_hooks()
            entry = CompiledStep(traced, plan, cfg, optimizer=self.optimizer, budget=_memory_budget(cfg),
                                 outputs_held=self._eager_trace)
            entry.variable_devices = variable_devices
            entry.generation = state.generation()
            self._compiled[key] = entry
        entry.outputs_held = entry.outputs_held or self._eager_trace
        entry.plan.data_shards = state.dp_size() if cfg.shard_optimizer_state else 1
        self.last_plan = entry.plan
        scheduled = entry.scheduled(cfg.pipeline, len(mbs))
        if len(mbs) == cfg.microbatches or self.schedule is None:
            # The schedule of the configured micro-batch count (not of a
            # short batch's one-micro-batch pipeline).
            self.schedule = scheduled.schedule
        return scheduled

    def _emit(
        self, args: tuple, kwargs: dict, num_microbatches: Optional[int] = None, uneven: bool = False
    ):
        """Emits the pipelined step into the current graph; returns StepOutputs.

        Args:
            args, kwargs: the call's arguments.
            num_microbatches: split into this many micro-batches instead of
                the config's (the step is traced, partitioned and lowered
                once for all counts).
            uneven: allow batch sizes that are not multiples of the count
                (micro-batches then differ in size by at most one row; the
                caller makes sure none is empty).
        """
        if state.config().auto:
            self._plan_auto(args, kwargs, eager=self._eager_trace)
        cfg = state.config()
        m = cfg.microbatches if num_microbatches is None else num_microbatches
        mbs = self._split(args, kwargs, m, uneven=uneven)
        with self._lock:
            self._check_generation()
            entry = self._compile(mbs)
        per_mb = entry.emit([tf.nest.flatten(mb) for mb in mbs])
        outputs = tf.nest.map_structure(_step_output, *per_mb)
        if m == cfg.microbatches or self.last_compiled is None:
            # The step of the configured micro-batch count (not a short
            # batch's one-micro-batch pipeline) is the one reports describe.
            self.last_compiled = entry
        if self.reduce_over_replicas and state.data_parallel():
            self._average_over_replicas(entry, outputs)
        return outputs

    def _average_over_replicas(self, entry: CompiledStep, outputs: Any) -> None:
        """Data parallelism: the step's gradient outputs are averaged over the
        replicas by `StepOutput.accumulate`, and the state the step writes
        (BatchNorm statistics) is averaged right after the pipeline."""
        from smp_tf.distributed import collectives

        graph = tf.compat.v1.get_default_graph()
        # Names this emission alike on every rank: the step's name and how
        # many steps this graph emitted before.
        count = getattr(graph, "_smp_tf_emissions", 0)
        graph._smp_tf_emissions = count + 1
        site = f"{getattr(self._fn, '__qualname__', 'step')}/{count}"
        cfg = state.config()
        if cfg.shard_optimizer_state:
            from smp_tf.sharding import optimizer_state

            optimizer_state.begin_step()
        raise_if_uneven = cfg.raises_on_uneven_inputs
        plan = collectives._Plan()
        state_vars = entry.written_state()
        if state_vars:
            collectives.sync_state(
                [v for v, _ in state_vars], [p for _, p in state_vars], entry.devices,
                entry.last_ops, site, plan, raise_if_uneven,
            )
        flat = tf.nest.flatten(outputs)
        # One StepOutput per returned value; a composite value (IndexedSlices)
        # is several flat outputs of the trace: take its first component.
        expanded = entry.output_info()
        info, position = [], 0
        for leaf in tf.nest.flatten(entry.traced.output_structure):
            info.append(expanded[position] if position < len(expanded) else None)
            position += max(1, len(tf.nest.flatten(leaf, expand_composites=True)))
        members = [k for k, i in enumerate(info) if i is not None and i[0] and isinstance(flat[k], StepOutput)]
        if not members:
            return
        reducer = collectives.GradientReducer(
            local_values={k: flat[k]._local_accumulate for k in members},
            members=members,
            partition_of={k: info[k][1] for k in members},
            devices=entry.devices,
            nbytes={k: info[k][2] for k in members},
            dtypes={k: _dtype_of(flat[k]) for k in members},
            site=site,
            raise_if_uneven=raise_if_uneven,
            plan=plan,
            after_pipeline=list(entry.device_last_ops.values()),
            scatter=cfg.shard_optimizer_state,
        )
        for k in members:
            flat[k]._replicas = (reducer, k)

    def _plan_auto(self, args: tuple, kwargs: dict, eager: bool) -> None:
        """The config key ``auto``: plans this step on these arguments and
        re-initialises with the best plan (`smp_tf.planner.plan.apply_auto`)."""
        from smp_tf.planner.plan import apply_auto

        with self._lock:
            if state.config().auto:
                apply_auto(self, args, kwargs, eager=eager)

    def memory_report(self, optimizer: Any = None, outputs_held: Optional[bool] = None) -> Any:
        """The predicted memory of every partition for the last compiled step.

        Available after the first call. Each row (`smp_tf.memory.PartitionMemory`)
        has the fields ``variables``, ``optimizer``, ``gradients``,
        ``activations``, ``buffers``, ``transient``, ``total`` and
        ``measured`` (bytes); printing the report gives a table.

        Args:
            optimizer: the optimizer that applies the gradients (its state is
                counted; None counts none).
            outputs_held: whether every micro-batch's outputs are held until
                the end of the step, as when the step is called eagerly
                (False: called inside a ``tf.function``, where the running
                sum takes each gradient as it arrives). None: as the step
                has been called (held once it was called eagerly).

        Returns:
            A `smp_tf.memory.MemoryReport`.

        Raises:
            RuntimeError: the step has not been called yet.
        """
        entry = getattr(self, "last_compiled", None)
        if entry is None:
            raise RuntimeError(
                "memory_report() needs a compiled step: call the step function once first "
                "(or use measure_memory(*args), which runs one step)."
            )
        return entry.memory_report(self.optimizer if optimizer is None else optimizer, budget=entry.budget,
                                   outputs_held=outputs_held)

    def measure_memory(self, *args: Any, optimizer: Any = None, **kwargs: Any) -> Any:
        """Runs one step on these arguments and measures its memory.

        On GPUs every partition's peak is measured on its own device. On
        logical CPU devices (one shared allocator) the process-wide peak and
        each task's own peak are measured when ``TF_CPU_ALLOCATOR_USE_BFC=true``
        was set before TensorFlow started (see `smp_tf.profiling.memory`).

        Args:
            *args, **kwargs: the arguments of one step.
            optimizer: the optimizer that applies the gradients.

        Returns:
            The `smp_tf.memory.MemoryReport` with ``measured`` filled in where
            a measurement exists.
        """
        from smp_tf.profiling.memory import measure_step_memory

        return measure_step_memory(self, args, kwargs, self.optimizer if optimizer is None else optimizer)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cfg = state.config()  # raises a clear error before smp.init
        if cfg.auto:
            self._plan_auto(args, kwargs, eager=tf.executing_eagerly())
            cfg = state.config()
        if not tf.executing_eagerly():
            return self._emit(args, kwargs)
        # Eager values have known sizes; check them here, where a bad size
        # gets the clear error, not a run-time failure inside the graph (an
        # input_signature may leave the batch size unknown to the trace).
        check_split_sizes(self._signature, args, kwargs, cfg.microbatches, self._non_split, self._split_axes)
        with self._lock:
            self._check_generation()
            probing = timeline.recording()
            if probing not in self._eager_fns:
                # Library code needs no AutoGraph; the user's body is traced
                # with the user's own tf.function options in trace_microbatch.
                kw = {k: v for k, v in self._tf_kwargs.items() if k not in ("jit_compile", "autograph")}
                sig = self._input_signature

                def run(*a, **k):
                    # The outputs of every micro-batch leave this function
                    # together: the memory model holds them to the end.
                    self._eager_trace = True
                    try:
                        outs = self._emit(a, k)
                    finally:
                        self._eager_trace = False
                    # StepOutputs are not tensors: return their values in a
                    # marked dict and rebuild them outside.
                    return tf.nest.map_structure(_mark, outs)

                self._eager_fns[probing] = tf.function(run, input_signature=sig, autograph=False, **kw)
            fn = self._eager_fns[probing]
        raw = fn(*args, **kwargs)
        return _rebuild_step_outputs(raw)


_MARK = "__smp_step_output__"
# A fused StepOutput leaves an eager step's tf.function as its inputs under a
# key that also spells its FusedOp (a tf.function returns tensors, not Python
# objects): _FUSED_MARK + op_type|data_format|device.
_FUSED_MARK = "__smp_fused_step_output__"
# A StepOutput of gradients returned in pieces leaves it as its pieces under
# a key that also spells the axis they split and their devices:
# _SPLIT_MARK + axis|device 0|device 1|...
_SPLIT_MARK = "__smp_split_step_output__"


def _dtype_of(so: StepOutput) -> tf.DType:
    if so._fused is not None:
        return tf.as_dtype(so._fused_inputs[0][0].dtype)
    value = next(v for v in so._values if v is not None) if any(v is not None for v in so._values) else None
    return tf.float32 if value is None else tf.as_dtype(value.dtype)


def _step_output(*values: Any) -> StepOutput:
    """The StepOutput of one output from its per-micro-batch values."""
    if isinstance(values[0], FusedValue):
        return StepOutput._from_fused(values[0].op, [v.inputs for v in values])
    return StepOutput(list(values))


def _mark(so: StepOutput) -> Dict[str, Any]:
    if so._fused is not None and so._values is None:
        op = so._fused
        key = f"{_FUSED_MARK}{op.op_type}|{op.data_format}|{op.device}"
        return {key: [list(x) for x in so._fused_inputs]}
    if so._values and all(isinstance(v, SplitValue) for v in so._values):
        first = so._values[0]
        return {f"{_SPLIT_MARK}{first.axis}|{'|'.join(first.devices)}": [list(v.pieces) for v in so._values]}
    return {_MARK: so.outputs}


def _rebuild_step_outputs(raw: Any) -> Any:
    """Inverse of the marking done by the eager wrapper."""
    if isinstance(raw, dict):
        if set(raw) == {_MARK}:
            return StepOutput(list(raw[_MARK]))
        if len(raw) == 1 and next(iter(raw)).startswith(_SPLIT_MARK):
            key = next(iter(raw))
            axis, *devices = key[len(_SPLIT_MARK):].split("|")
            return StepOutput([SplitValue(int(axis), pieces, devices) for pieces in raw[key]])
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
