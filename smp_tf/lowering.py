"""Lowering: the only place that builds the pipeline's TensorFlow ops.

`CompiledStep` holds everything built once per traced signature: the tasks,
the schedule, one concrete function per task (its ops placed on the
partition's device, variables captured from their new devices), and the
global emission order. `CompiledStep.emit` then writes one graph for a batch:
for every action of the schedule, in an order that respects both the data
dependencies and every device's action order, it calls the task's function
for that micro-batch on the partition's device. Each call is made under a
control dependency on the previous action of the same device, and the
tensors entering from other partitions pass through ``SMPInput`` ops created
under the same dependency; tensors leaving for other partitions pass through
``SMPOutput`` ops. Control dependencies on a function call hold back every op
of its body, so the device runs its actions exactly in schedule order.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import auto_control_deps as acd
from tensorflow.python.framework import auto_control_deps_utils as acd_utils
from tensorflow.python.framework import op_def_registry

from smp_tf.boundary import raw_input, raw_output
from smp_tf.config import Config
from smp_tf.memory import (
    MemoryReport, choose_recompute, device_kind, is_gradient_output, optimizer_slots, output_holds, predict_memory,
)
from smp_tf.partitioner.plan import DEFAULT_SLOTS, PartitionPlan
from smp_tf.placement import partition_of_device
from smp_tf.profiling import timeline
from smp_tf.rewrite import (
    FusedGradient,
    PreTransposed,
    build_tasks,
    fusable_gradients,
    pretranspose_graph_def,
    pretransposable_products,
    task_graph_def,
    task_specs,
)
from smp_tf.schedules import Action, Schedule, make_schedule, schedule_builder
from smp_tf.sharding import storage
from smp_tf.sharding.lower import place_shards
from smp_tf.step_output import FusedOp, SplitValue
from smp_tf.trace import CapturedShard, CapturedVariable, Traced, gc_paused

logger = logging.getLogger("smp_tf")

__all__ = ["CompiledStep", "FusedValue"]


def _task_body(sub, input_names, captured, outputs, captures, pins=()):
    """The Python body of a task function: imports the task's GraphDef.

    `pins` (tensor names) are the task's `Task.pinned` tensors:
    each gets a second reader, a one-element slice that the outputs carry
    along, so the graph optimiser sees as many readers as in the single-device
    graph. The slice runs as soon as the tensor exists and holds none of it.
    """
    # Inputs no node reads any more (a stashed variable read whose product
    # now reads the transposed copy) stay arguments but are not mapped:
    # import_graph_def rejects mappings for tensors nothing reads.
    read = {_tensor_name(x) for n in sub.node for x in n.input if not x.startswith("^")}
    summed = _summed_by_addn(sub)

    def body(*xs):
        fg = tf.compat.v1.get_default_graph()
        input_map = {
            name: _under_original_name(name, x, own_buffer=name in summed)
            for name, x in zip(input_names, xs)
            if name in read
        }
        for name in captured:
            cap = captures[name]
            if isinstance(cap, CapturedVariable):
                # Variables are captured from where they live now (after placement).
                internal = fg.capture(cap.variable.handle)
                _annotate_resource(internal, cap.variable)
            elif isinstance(cap, CapturedShard):
                # A piece of a variable whose storage is split (tensor parallelism).
                piece = cap.piece()
                internal = fg.capture(piece.handle)
                _annotate_resource(internal, piece)
            else:
                # A captured tensor stays an argument of the function, as in
                # a single-device run, named as there: the graph optimiser
                # neither folds it into the ops that read it (a small one is
                # captured as a constant that is also an input) nor orders
                # commutative inputs differently. `task_graph_def` leaves its
                # node out, so the name is free.
                internal = fg.capture(cap, name=name)
            input_map[f"{name}:0"] = internal
        outs = tf.graph_util.import_graph_def(sub, input_map=input_map, return_elements=outputs, name="")
        outs = list(outs)
        extra = [_pin(fg.get_tensor_by_name(name)) for name in pins]
        extra = [x for x in extra if x is not None]
        if extra and outs:
            # The slices must reach the outputs through data edges, or the
            # optimiser prunes them (or turns them into control edges, which
            # it does not count as readers). They cannot be outputs of their
            # own: a call's unused outputs are removed when the caller is
            # optimised; and the optimiser drops the unused inputs of an
            # IdentityN. An optional holding the outputs and the slices is
            # opaque to it and copies nothing; a call's outputs are ready
            # only when its whole body has run, so this delays nothing.
            carried = outs + extra
            optional = tf.raw_ops.OptionalFromValue(components=carried)
            outs = list(tf.raw_ops.OptionalGetValue(
                optional=optional,
                output_types=[x.dtype for x in carried],
                output_shapes=[x.shape for x in carried],
            ))[: len(outs)]
        # A call with no outputs gives the caller nothing to depend on: such
        # a task returns a constant as its handle. A task with outputs
        # returns nothing more, because an output that no caller reads makes
        # the graph optimiser specialise the function at each call site on
        # the first run (a copy of every task, optimised once more).
        return _returned(fg, outs if outs else [tf.constant(True)])

    return body


# Op type -> whether it is stateful in the sense of `_must_run` (None: not a
# registered op, such as a call of a function by name). Depends on the type
# alone, so it is looked up once per type for all task functions.
_STATEFUL_TYPES: Dict[str, Optional[bool]] = {}


def _must_run(op: tf.Operation) -> bool:
    """Whether `op` must run even when no output needs it: the rule of
    TensorFlow's automatic control dependencies (`ops_which_must_run`)."""
    kind = op.type
    if kind not in _STATEFUL_TYPES:
        _STATEFUL_TYPES[kind] = None if op_def_registry.get(kind) is None else acd.op_is_stateful(op)
    stateful = _STATEFUL_TYPES[kind]
    if stateful is None or kind in acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS:
        return True
    # A variable read must run only if something reads its value.
    return stateful and (kind not in acd_utils.RESOURCE_READ_OPS or any(out.consumers() for out in op.outputs))


def _returned(fg, outs: List[tf.Tensor]) -> List[tf.Tensor]:
    """The task function's returns, with the structure TensorFlow's automatic
    control dependencies give a function, built here without that pass.

    Task functions are traced with the pass off (``_disable_acd``): it walks
    every op's resource inputs (a third of building the task functions), and
    what it orders is ordered already, since the imported task keeps the
    control edges the pass made when the micro-batch step was traced. What it
    also does is made here alike: each output is returned through an
    identity that waits (through one ``NoOp``) for the ops that must run,
    and those ops are the function's control outputs, which TensorFlow runs
    even when no output reads them (a BatchNorm statistic's update).
    """
    must_run = [op for op in fg.get_operations() if _must_run(op)]
    returned = [tf.identity(x) for x in outs]
    if must_run:
        done = tf.no_op()
        done._add_control_inputs(must_run)
        for r in returned:
            r.op._add_control_inputs([done])
    fg.control_outputs.extend(must_run)
    return returned


def _pin(x: tf.Tensor) -> Optional[tf.Tensor]:
    """A reader of `x` that costs nothing and keeps nothing of it alive."""
    if not x.shape.is_fully_defined():
        return None
    shape = x.shape.as_list()
    if len(shape) == 0 or 0 in shape:
        return tf.identity(x)  # a scalar or an empty tensor: nothing to hold
    r = len(shape)
    return tf.strided_slice(x, [0] * r, [1] * r, shrink_axis_mask=(1 << r) - 1)


def _tensor_name(node_input: str) -> str:
    """A NodeDef data input (``"op"`` or ``"op:1"``) as a tensor name."""
    return node_input if ":" in node_input else f"{node_input}:0"


def _summed_by_addn(graph_def) -> set:
    """Names of the tensors that an ``AddN`` of three or more terms reads.

    TensorFlow's ``AddN`` kernel accumulates into the first of its input
    buffers that nothing else holds, and moves that input to the front of
    the sum. In a single-device run, a gradient term produced by the same
    function is such a buffer; a task function's argument never is (its
    caller holds it), so without a copy the kernel would add the terms in
    another order and round differently. (With two terms the order does not
    change the result.)
    """
    summed = set()
    for node in graph_def.node:
        terms = [x for x in node.input if not x.startswith("^")]
        if node.op == "AddN" and len(terms) >= 3:
            summed.update(_tensor_name(x) for x in terms)
    return summed


def _under_original_name(tensor_name: str, arg: tf.Tensor, own_buffer: bool = False) -> tf.Tensor:
    """`arg` (a task function's argument) forwarded by an op named like the
    producer of `tensor_name` in the traced graph.

    The graph optimiser's rewrites depend on node names: it sorts the inputs
    of commutative ops by name, and a reassociation such as
    ``(x * y) * c -> x * (y * c)`` then pairs the constant with whichever
    operand sorts last. An argument is named after the function's signature
    (``xs_3``), so without this the optimiser would pair differently from a
    single-device run, where the same tensor comes from a node with its
    original name, and the float results would round differently.
    """
    op_name, _, port = tensor_name.rpartition(":")
    index = int(port)
    if own_buffer:
        # A copy the task owns, as the single-device function owns the
        # tensor it computed (see `_summed_by_addn`). DeepCopy is stateful,
        # so the optimiser neither removes nor folds it.
        arg = tf.raw_ops.DeepCopy(x=arg, name=f"{op_name}/smp_owned" if index else op_name)
        if index == 0:
            return arg
    # An IdentityN with at least two outputs: consumers then read
    # "<op>:<index>" as in the traced graph, and unlike an Identity (or an
    # IdentityN of one input) the optimiser's pruner does not remove it as
    # trivial before the name-dependent rewrites run.
    if index == 0:
        return tf.ensure_shape(arg, arg.shape, name=op_name)
    return tf.identity_n([arg] * max(2, index + 1), name=op_name)[index]


def _annotate_resource(placeholder: tf.Tensor, variable: Any) -> None:
    """Tells the task function's graph optimiser the dtype and shape of the
    variable behind a captured handle.

    A function called eagerly gets them from the runtime (``_handle_dtypes``
    and ``_handle_shapes`` on its resource arguments); a task function is
    called from inside a graph and would not, so grappler would rewrite it
    with less shape information than a single-device run has, and round
    differently (for example it folds additions into ``AddN`` only where
    shapes are known).
    """
    from tensorflow.core.framework import attr_value_pb2

    dtypes = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=[variable.dtype.as_datatype_enum]))
    shapes = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(shape=[variable.shape.as_proto()]))
    placeholder.op._set_attr("_handle_dtypes", dtypes)
    placeholder.op._set_attr("_handle_shapes", shapes)


def cpu_kernels_allocate_scratch() -> bool:
    """Whether TensorFlow's own CPU kernels run the convolution gradients,
    allocating the scratch `smp_tf.memory.kernel_scratch` predicts through
    TensorFlow's allocator. Where oneDNN's kernels replace them (TensorFlow
    enables oneDNN by default on CPUs with AVX-512 VNNI or BF16 and the
    like; ``TF_ENABLE_ONEDNN_OPTS`` decides), their scratch stays outside
    it."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return not _pywrap_util_port.IsMklEnabled()
    except (ImportError, AttributeError):  # not in this TensorFlow build
        return True


def _transposed_name(read_name: str) -> str:
    return f"smp_transposed/{read_name}"


class FusedValue:
    """One micro-batch's share of a fused output: the inputs of its op."""

    __slots__ = ("op", "inputs")

    def __init__(self, op: FusedOp, inputs: Tuple[tf.Tensor, ...]) -> None:
        self.op = op
        self.inputs = inputs


#: The op types of a function call in a graph.
_CALL_OP_TYPES = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


@contextlib.contextmanager
def calls_without_body_shape_inference(graph: tf.Graph) -> Iterator[None]:
    """Call ops created in `graph` inside the block skip shape inference
    through the called function's body.

    When it adds a call op to a graph, TensorFlow infers the call's output
    shapes by running shape inference over every op of the called function,
    at every call. A task function is called once per micro-batch, so this
    walks each task's body M times while the step is emitted (almost half
    the emission of a small transformer at P=3, M=8). It adds nothing here: the
    call's outputs get the function's output shapes right after (as
    `ConcreteFunction` does for every call). TensorFlow's shape refiner skips
    the body of a call node that carries ``_disable_call_shape_inference``;
    TensorFlow's call path sets no attributes of its own, so the graph's
    `create_op` adds it to the call ops made inside the block.
    """
    create_op = graph.create_op
    if tf.executing_eagerly() or getattr(create_op, "__func__", None) is not type(graph).create_op:
        yield  # eager, or inside such a block already
        return
    flag = attr_value_pb2.AttrValue(b=True)

    def create_call_op(op_type, inputs, dtypes=None, input_types=None, name=None, attrs=None, *args, **kwargs):
        if op_type in _CALL_OP_TYPES:
            attrs = {**(attrs or {}), "_disable_call_shape_inference": flag}
        return create_op(op_type, inputs, dtypes, input_types, name, attrs, *args, **kwargs)

    graph.create_op = create_call_op
    try:
        yield
    finally:
        del graph.create_op


def _optimizer_state_divided_over() -> int:
    """The replicas each optimizer slot is divided over: R under
    ``shard_optimizer_state``, else 1."""
    from smp_tf import state

    if state.is_initialized() and state.config().shard_optimizer_state:
        return state.dp_size()
    return 1


class CompiledStep:
    """Everything built once per traced signature (see the module doc).

    Attributes:
        tasks: the tasks, in (wave, partition) order.
        schedule: the validated `Schedule`.
        simulation: its simulation on the tasks' estimated costs.
        plan: the `PartitionPlan`.
        fused: flat output position -> (`FusedGradient`, `FusedOp`) for the
            outputs computed after the pipeline (``fuse_weight_gradients``).
    """

    def __init__(
        self,
        traced: Traced,
        plan: PartitionPlan,
        cfg: Config,
        recompute: Optional[Sequence[str]] = None,
        optimizer: Any = None,
        budget: Any = None,
        outputs_held: bool = False,
    ) -> None:
        """
        Args:
            traced: the traced micro-batch step.
            plan: its partitioning.
            cfg: the configuration.
            recompute: the recompute mode of each partition (one of
                `RECOMPUTE_MODES`); None: chosen from ``cfg.recompute`` and
                `budget` (`smp_tf.memory.choose_recompute`).
            optimizer: the optimizer that applies the gradients, if known
                (unknown, the budget check counts Adam's two slots).
            budget: bytes per device, or device -> bytes (each device's own; None: no limit).
            outputs_held: the step is called eagerly (see `memory_report`).

        Raises:
            MemoryBudgetError: the layout does not fit `budget`.
        """
        self.traced = traced
        self.plan = plan
        self.outputs_held = outputs_held
        self.num_microbatches = cfg.microbatches
        g = plan.op_graph
        self.output_tensors: List[Optional[int]] = traced.output_tensors()
        self.devices = list(plan.devices)
        # Outputs computed once over all micro-batches after the pipeline
        # (opt-in: their inputs stay alive for every micro-batch).
        self.fused: Dict[int, Tuple[FusedGradient, FusedOp]] = {}
        # Gradients returned in pieces over a tensor-parallel stage: flat
        # output -> (split dimension, the pieces' tensors); the output's own
        # tensor is piece 0.
        self.split_outputs: Dict[int, Tuple[int, List[int]]] = traced.split_output_tensors()
        if cfg.fuse_weight_gradients:
            for f in fusable_gradients(g, self.output_tensors, self._attrs_of):
                if f.output in self.split_outputs:
                    continue  # one piece's product is not the gradient's
                op = self.traced.graph.get_operation_by_name(g.ops[f.op].name)
                data_format = op.get_attr("data_format").decode() if op.type == "BiasAddGrad" else "NHWC"
                device = self.devices[plan.partition_of_op[f.op]]
                self.fused[f.output] = (f, FusedOp(op.type, data_format, device))
        task_outputs = [t for k, t in enumerate(self.output_tensors) if t is not None and k not in self.fused]
        task_outputs += [t for f, _ in self.fused.values() for t in f.inputs]
        task_outputs += [t for _, pieces in self.split_outputs.values() for t in pieces[1:]]
        removed = [i for f, _ in self.fused.values() for i in f.removed]
        outputs = sorted(set(task_outputs))
        self.budget = budget
        # The tasks' functions (built last) and their peaks on the graphs
        # Grappler makes of them (`_rewritten_workspaces`, on demand).
        self._functions: Dict[Tuple[int, int], Any] = {}
        self._rewritten: Optional[Dict[Tuple[int, int], int]] = None

        def cut(modes: Sequence[str]) -> None:
            self.recompute = list(modes)
            self.tasks = build_tasks(
                g, plan.partition_of_op, outputs, exclude=removed, recompute=self.recompute,
                split_weight=schedule_builder(cfg.pipeline).split_weight,
            )
            self._task_by_key = {t.key: t for t in self.tasks}
            self._set_schedule(cfg.pipeline)

        if recompute is not None:
            cut(recompute)
        elif budget is None:
            # Nothing to fit: "auto" recomputes nothing, and no prediction is needed.
            cut(["never" if cfg.recompute == "auto" else cfg.recompute] * plan.num_partitions)
        else:
            def predict(modes: Sequence[str]) -> MemoryReport:
                cut(modes)
                return self.memory_report(optimizer, budget=budget, slots=None if optimizer is not None else DEFAULT_SLOTS)

            modes, _ = choose_recompute(predict, plan.num_partitions, cfg.recompute, self.budget)
            if modes != self.recompute:
                cut(modes)
        # Tensors some task on another partition reads: they leave through an SMPOutput.
        self._sent_tensors = {
            tin for t in self.tasks for tin in t.inputs if t.producer_of_input[tin][0] != t.partition
        }
        self._arg_index = {name: i for i, name in enumerate(traced.arg_names)}
        # Products that read a variable transposed get it transposed once
        # per step instead (opt-in: one transposed copy lives during the step).
        self.pretransposed: Dict[int, PreTransposed] = {}
        if cfg.pretranspose_weights:
            for p in pretransposable_products(g, self._attrs_of):
                info = g.tensors[g.ops[p.read].outputs[0]]
                known = info.shape is not None and len(info.shape) == 2 and None not in info.shape
                if known and isinstance(traced.captures.get(g.ops[p.capture].name), CapturedVariable):
                    self.pretransposed[p.op] = p
        self._functions = self._build_functions()

    def _set_schedule(self, kind: str) -> None:
        specs = task_specs(self.tasks, self.plan.device_index)
        # make_schedule validates the order (one simulation); this one is kept.
        self.schedule: Schedule = make_schedule(specs, self.num_microbatches, kind)
        self.simulation = self.schedule.simulate()
        # Emit in simulated start order: it respects dependencies and every
        # device's order, so each control dependency points at an op that
        # already exists.
        self.emit_order: List[Action] = sorted(
            self.simulation.start, key=lambda a: (self.simulation.start[a], a.partition, a.wave, a.microbatch)
        )

    def scheduled(self, kind: str, num_microbatches: int) -> "CompiledStep":
        """The same tasks and task functions under a schedule of another kind
        or another number of micro-batches (cached).

        Only the actions and their order differ, so nothing is traced,
        partitioned or optimised again.
        """
        if (kind, num_microbatches) == (self.schedule.kind, self.num_microbatches):
            return self
        variants = self.__dict__.setdefault("_variants", {})
        other = variants.get((kind, num_microbatches))
        if other is None:
            other = copy.copy(self)
            other.num_microbatches = num_microbatches
            other._set_schedule(kind)
            other._variants = variants
            variants[(kind, num_microbatches)] = other
        return other

    def _attrs_of(self, index: int) -> Dict[str, Any]:
        op = self.traced.graph.get_operation_by_name(self.plan.op_graph.ops[index].name)
        out = {}
        for name in ("transpose_a", "transpose_b"):
            try:
                out[name] = op.get_attr(name)
            except ValueError:
                pass
        return out

    # -- task functions ------------------------------------------------------
    def _build_functions(self) -> Dict[Tuple[int, int], Any]:
        g = self.plan.op_graph
        graph_def = self.traced.graph_def
        nodes = {n.name: n for n in graph_def.node}
        functions = {}
        # Tracing and importing the tasks allocates many objects (see gc_paused).
        with gc_paused():
            for task in self.tasks:
                functions[task.key] = self._build_function(task, g, graph_def, nodes)
        return functions

    def _build_function(self, task, g, graph_def, nodes) -> Any:
        """The concrete function of one task, on its partition's device."""
        device = self.devices[task.partition]
        # No device on the nodes: the ops run on their call's device, where
        # every node of the task belongs, and the importer does not enter a
        # device scope for every op (a fifth of the import on BERT).
        sub = task_graph_def(graph_def, g, task, "", nodes)
        if self.plan.tensor_devices:
            # Tensor parallelism: each shard's copy runs on its device of the stage.
            place_shards(sub, self.plan.tensor_devices[task.partition])
        in_specs = []
        for t in task.inputs:
            info = g.tensors[t]
            in_specs.append(tf.TensorSpec(info.shape, tf.as_dtype(info.dtype)))
        args = [g.ops[i].name for i in task.copies if g.ops[i].kind == "arg"]
        for name in args:
            info = g.tensors[g.ops[g.op_index[name]].outputs[0]]
            in_specs.append(tf.TensorSpec(info.shape, tf.as_dtype(info.dtype)))
        captured = [g.ops[i].name for i in task.copies if g.ops[i].kind == "capture"]
        outputs = [g.tensor_name(t) for t in task.outputs]
        input_names = [g.tensor_name(t) for t in task.inputs] + [f"{a}:0" for a in args]
        task.transposed_reads = sorted({self.pretransposed[i].read for i in task.members if i in self.pretransposed})
        if task.transposed_reads:
            products = {
                g.ops[i].name: _transposed_name(g.ops[self.pretransposed[i].read].name)
                for i in task.members if i in self.pretransposed
            }
            placeholders = {}
            for r in task.transposed_reads:
                info = g.tensors[g.ops[r].outputs[0]]
                shape = list(reversed(info.shape))
                dtype = tf.as_dtype(info.dtype)
                placeholders[_transposed_name(g.ops[r].name)] = (dtype.as_datatype_enum, shape)
                in_specs.append(tf.TensorSpec(shape, dtype))
                input_names.append(f"{_transposed_name(g.ops[r].name)}:0")
            pretranspose_graph_def(sub, products, placeholders)
        pins = [g.tensor_name(t) for t in task.pinned]
        body = _task_body(sub, input_names, captured, outputs, self.traced.captures, pins)
        # Task functions stay calls (not inlined): the graph optimiser
        # then works on each task once instead of on M copies, and a
        # call waits for its control dependencies before any op of its
        # body runs. Traced without automatic control dependencies: the
        # body makes what the pass would add (see `_returned`).
        fn = tf.function(body, autograph=False, experimental_attributes={"_noinline": True, "_disable_acd": True})
        with tf.device(device):
            concrete = fn.get_concrete_function(*in_specs)
        task.arg_names = args
        return concrete

    # -- emission ------------------------------------------------------------
    def emit(self, flat_microbatches: Sequence[Sequence[Any]]) -> List[Any]:
        """Writes the pipelined step into the current graph.

        Args:
            flat_microbatches: for each micro-batch, the flattened leaves of its
                (args, kwargs), in the layout of the trace.

        Returns:
            For each micro-batch, the step's output structure; a fused output
            is a `FusedValue` holding that micro-batch's inputs of its op.
        """
        g = self.plan.op_graph
        M = self.num_microbatches
        if len(flat_microbatches) != M:
            raise ValueError(f"Expected {M} micro-batches, got {len(flat_microbatches)}.")
        arg_values = []
        for leaves in flat_microbatches:
            tensors = [x for x in leaves if isinstance(x, tf.Tensor)]
            arg_values.append(tensors)
        raw: Dict[Tuple[int, int], tf.Tensor] = {}
        sent: Dict[Tuple[int, int], tf.Tensor] = {}
        # Variables read transposed, transposed once for the whole step on
        # the partition that reads them; free of control dependencies, they
        # run as soon as the step starts.
        capture_of_read = {p.read: p.capture for p in self.pretransposed.values()}
        transposed: Dict[Tuple[int, int], tf.Tensor] = {}
        for task in self.tasks:
            for r in task.transposed_reads:
                if (task.partition, r) not in transposed:
                    var = self.traced.captures[g.ops[capture_of_read[r]].name].variable
                    with tf.name_scope(f"smp/p{task.partition}/transposed"), tf.device(self.devices[task.partition]):
                        transposed[(task.partition, r)] = tf.transpose(var.read_value())
        # A tensor crosses to a partition once per micro-batch: later tasks
        # of that partition (e.g. its backward) reuse the received copy.
        received: Dict[Tuple[int, int, int], tf.Tensor] = {}
        last: Dict[int, Any] = {}
        # Under `smp.profile`, each action is timed on its device (see
        # `smp_tf.profiling.timeline`).
        probing = timeline.recording()
        starts: List[tf.Tensor] = []
        ends: List[tf.Tensor] = []
        # The task calls made here skip shape inference through their bodies.
        with calls_without_body_shape_inference(tf.compat.v1.get_default_graph()):
            for action in self.emit_order:
                task = self._task_by_key[(action.partition, action.wave)]
                m = action.microbatch
                device = self.devices[task.partition]
                # A device runs its actions in schedule order, whichever of its
                # partitions (virtual stages) they belong to.
                dev_index = self.plan.device_index[task.partition]
                prev = last.get(dev_index)
                deps = [prev] if prev is not None else []
                scope = f"smp/mb{m}/p{task.partition}w{task.wave}"
                with tf.name_scope(scope), tf.device(device), tf.control_dependencies(deps):
                    inputs = []
                    for t in task.inputs:
                        if task.producer_of_input[t][0] != task.partition:
                            key = (m, t, task.partition)
                            if key not in received:
                                received[key] = raw_input(sent[(m, t)])
                            inputs.append(received[key])
                        else:
                            inputs.append(raw[(m, t)])
                    for name in task.arg_names:
                        inputs.append(arg_values[m][self._arg_index[name]])
                    for r in task.transposed_reads:
                        inputs.append(transposed[(task.partition, r)])
                    if probing:
                        # Starts once the inputs are there and the device's
                        # previous action is done; the call waits for it.
                        starts.append(timeline.emit_probe([x for x in inputs if isinstance(x, tf.Tensor)], device))
                    with tf.control_dependencies(starts[-1:] if probing else []):
                        outs = self._functions[task.key](*inputs)
                    if probing:
                        ends.append(timeline.emit_probe(list(outs), device))
                # Eagerly (Keras's run_eagerly) the actions simply run one after
                # another in this order; in a graph the next action of the
                # device waits for this call.
                done = ends[-1] if probing else outs[-1]
                # Probing, the device's next action also waits for this one's end
                # probe, so that the two never overlap in the record.
                last[dev_index] = done if tf.executing_eagerly() else done.op
                with tf.name_scope(scope), tf.device(device):
                    for t, value in zip(task.outputs, outs):
                        raw[(m, t)] = value
                        if t in self._sent_tensors:
                            sent[(m, t)] = raw_output(value)
        # Device -> its last action: what runs after the pipeline waits on it.
        self.device_last_ops = dict(last)
        if probing:
            index = self.plan.device_index
            actions = [(index[a.partition], a.partition, a.wave, a.microbatch, self.schedule.display(a))
                       for a in self.emit_order]
            key = timeline.register(self.schedule, actions, {index[p]: d for p, d in enumerate(self.devices)})
            timeline.emit_collect(key, starts, ends)
        results = []
        for m in range(M):
            flat = []
            for k, t in enumerate(self.output_tensors):
                if k in self.fused:
                    f, op = self.fused[k]
                    part = self.plan.partition_of_op[f.op]
                    # An input that came from another partition is taken as
                    # received there, not fetched again from its producer.
                    inputs = tuple(
                        received[(m, x, part)] if (m, x, part) in received
                        else self._output_value(raw, arg_values[m], m, x)
                        for x in f.inputs
                    )
                    flat.append(FusedValue(op, inputs))
                elif k in self.split_outputs:
                    dim, pieces = self.split_outputs[k]
                    stage = self.plan.tensor_devices[self.plan.partition_of_op[g.tensors[pieces[0]].producer]]
                    flat.append(SplitValue(dim, [self._output_value(raw, arg_values[m], m, x) for x in pieces],
                                           [stage[self.plan.shard_of_op[g.tensors[x].producer]] for x in pieces]))
                else:
                    flat.append(None if t is None else self._output_value(raw, arg_values[m], m, t))
            results.append(tf.nest.pack_sequence_as(self.traced.output_structure, flat, expand_composites=True))
        return results

    @property
    def last_ops(self) -> Dict[int, Any]:
        """Partition -> the last action of its device in the last emission
        (with virtual stages, the partitions of a device share it)."""
        index = self.plan.device_index
        return {p: self.device_last_ops[d] for p, d in enumerate(index) if d in self.device_last_ops}

    def memory_report(
        self,
        optimizer: Any = None,
        budget: Any = None,
        workspace: Optional[Dict[Tuple[int, int], int]] = None,
        slots: Optional[float] = None,
        outputs_held: Optional[bool] = None,
    ) -> MemoryReport:
        """The predicted memory of every partition under this schedule.

        Args:
            optimizer: the optimizer that applies the step's gradients: its
                existing state is counted, or its slots per variable
                (`optimizer_slots`) when it has none yet. None: no optimizer
                state.
            budget: the memory budget to show.
            workspace: task key -> its peak, replacing the predicted one.
            slots: optimizer slots per variable byte, overriding `optimizer`'s.
            outputs_held: whether every micro-batch's outputs are held
                until the end of the step, as when the step is called
                eagerly (its values leave the pipeline's function together);
                False: called inside a ``tf.function``, where
                `StepOutput.accumulate`'s running sum takes each gradient as
                it arrives. None: `outputs_held` (True once the step was
                called eagerly).
        """
        g = self.plan.op_graph
        gradient_bytes: Dict[int, int] = {}
        # Where on its stage each partition's gradients are made: a gradient
        # returned in pieces has piece k on device k, the others are whole
        # on device 0.
        gradient_shards: Dict[int, Dict[int, int]] = {}
        for k, info in enumerate(self.output_info()):
            if info is None or not info[0]:
                continue
            gradient_bytes[info[1]] = gradient_bytes.get(info[1], 0) + info[2]
            if self.plan.shard_of_op is None:
                continue
            per = gradient_shards.setdefault(info[1], {})
            for x in (self.split_outputs[k][1] if k in self.split_outputs else [self.output_tensors[k]]):
                shard = self.plan.shard_of_op[g.tensors[x].producer] if k in self.split_outputs else 0
                per[shard] = per.get(shard, 0) + g.tensors[x].bytes
        held, combined = self._output_holds()
        if not (self.outputs_held if outputs_held is None else outputs_held):
            held, combined = None, None
        if workspace is None:
            workspace = self._rewritten_workspaces()
        slots = optimizer_slots(optimizer) if slots is None else slots
        replicas = _optimizer_state_divided_over()
        report = predict_memory(
            g, self.plan.partition_of_op, self.tasks, self.simulation,
            num_partitions=self.plan.num_partitions,
            partition_of_variable=self.plan.partition_of_variable(),
            gradient_bytes=gradient_bytes,
            held_outputs=held,
            combined_bytes=combined,
            # Under shard_optimizer_state a replica keeps 1/R of each slot.
            slots=slots / replicas,
            optimizer_bytes=self._optimizer_bytes(optimizer),
            recompute=self.recompute,
            devices=self.devices,
            budget=budget,
            workspace=workspace,
            cpu_kernel_scratch=cpu_kernels_allocate_scratch(),
            shard_of_op=self.plan.shard_of_op,
            stage_devices=self.plan.tensor_devices,
            split_variables=sorted(self.plan.shard_plan.stored_split) if self.plan.shard_plan is not None else (),
            gradient_shards=gradient_shards,
        )
        report.schedule = f"{self.schedule.kind}, {self.num_microbatches} micro-batches"
        return report

    def _rewritten_workspaces(self) -> Optional[Dict[Tuple[int, int], int]]:
        """Each task's peak on the graph TensorFlow runs: its function after
        Grappler (`smp_tf.rewritten`), once the functions exist (not while
        the compile chooses what to recompute); a task whose rewritten
        graph cannot be read keeps its traced prediction. Not with tensor
        parallelism, whose devices' shares are predicted on the traced
        graph."""
        if not self._functions or self.plan.shard_of_op is not None:
            return None
        if self._rewritten is None:
            from smp_tf.rewritten import rewritten_workspace

            cpu_scratch = cpu_kernels_allocate_scratch()
            self._rewritten = {}
            for task in self.tasks:
                on_gpu = task.partition < len(self.devices) and device_kind(str(self.devices[task.partition])) == "GPU"
                peak = rewritten_workspace(self._functions[task.key], task.partition, task.wave,
                                           cpu_scratch=cpu_scratch and not on_gpu, on_cpu=not on_gpu)
                if peak is not None:
                    self._rewritten[task.key] = peak
        return dict(self._rewritten) or None

    def _output_holds(self) -> Tuple[Dict[int, str], Dict[int, int]]:
        """`smp_tf.memory.output_holds` of the step's outputs; a fused output
        holds its op's inputs for every micro-batch instead, and at the end
        their concatenation and the op's result (`StepOutput.accumulate`)."""
        g = self.plan.op_graph
        plain = [t for k, t in enumerate(self.output_tensors) if t is not None and k not in self.fused]
        plain += [t for _, pieces in self.split_outputs.values() for t in pieces[1:]]
        held, combined = output_holds(g, self.plan.partition_of_op, plain)
        for f, _ in self.fused.values():
            p = self.plan.partition_of_op[f.op]
            for x in f.inputs:
                held[x] = "gradients"
            made = self.num_microbatches * sum(g.tensors[x].bytes for x in f.inputs)
            made += sum(g.tensors[x].bytes for x in g.ops[f.op].outputs)
            combined[p] = combined.get(p, 0) + made
        return held, combined

    def _optimizer_bytes(self, optimizer: Any) -> Optional[Dict[int, int]]:
        """Partition -> bytes of the optimizer state that exists (None when
        the optimizer has no state yet: it is predicted from its slots)."""
        variables = list(getattr(optimizer, "variables", None) or [])
        if not variables:
            return None
        out: Dict[int, int] = {}
        for v in variables:
            # A slot divided over the replicas holds its piece here.
            piece = storage.local_piece_of(v if isinstance(v, tf.Variable) else getattr(v, "value", v))
            shape = tf.TensorShape((v if piece is None else piece).shape)
            if not shape.is_fully_defined() or shape.num_elements() <= 1:
                continue  # iteration counters and the like
            part = partition_of_device(getattr(getattr(v, "value", v), "device", ""), self.devices)
            out[part] = out.get(part, 0) + shape.num_elements() * tf.as_dtype(v.dtype).size
        return out or None

    def output_info(self) -> List[Optional[Tuple[bool, int, int]]]:
        """Per flat output: (is a gradient, partition, bytes), None for None outputs."""
        g = self.plan.op_graph
        info: List[Optional[Tuple[bool, int, int]]] = []
        for k, t in enumerate(self.output_tensors):
            if t is None:
                info.append(None)
                continue
            producer = self.fused[k][0].op if k in self.fused else g.tensors[t].producer
            pieces = self.split_outputs[k][1] if k in self.split_outputs else [t]
            info.append((is_gradient_output(g, producer, t), self.plan.partition_of_op[producer],
                         sum(g.tensors[x].bytes for x in pieces)))
        return info

    def written_state(self) -> List[Tuple[Any, int]]:
        """(variable, partition) of the float variables the step writes that are not trained."""
        g = self.plan.op_graph
        written = {v for op in g.ops for v in op.writes if not g.trainable.get(v, True)}
        part = self.plan.partition_of_variable()
        out = []
        for cap in self.traced.captures.values():
            if isinstance(cap, CapturedVariable) and cap.key in written and cap.variable.dtype.is_floating:
                out.append((cap.variable, part[cap.key]))
        return out

    def _output_value(self, raw, args, m: int, t: int) -> tf.Tensor:
        """A step output: a task's output, or a step argument returned as is."""
        value = raw.get((m, t))
        if value is not None:
            return value
        op = self.plan.op_graph.ops[self.plan.op_graph.tensors[t].producer]
        return args[self._arg_index[op.name]]
