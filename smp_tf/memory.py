"""The memory model: each partition's predicted peak, before anything runs.

Pure Python over the graph view, the tasks, and a simulation of the
schedule. A partition's memory has two parts:

* **static**, held for the whole step: its ``variables`` and the
  ``optimizer`` slots of its trainable variables (Adam 2x, SGD with momentum
  1x, plain SGD 0x; `optimizer_slots`).
* **dynamic**, followed through the simulated schedule:

  - ``gradients``: every micro-batch's value of each gradient the step
    returns, from the end of the task that makes it to the end of the step
    (a `StepOutput` holds all ``M`` values until `StepOutput.accumulate`
    sums them), and at the end their sum;

  - ``activations``: tensors a task keeps for a later task of the same
    partition (its backward), from the end of the task that makes them to
    the end of the last task that reads them, one copy per micro-batch the
    schedule keeps alive there (1F1B keeps at most ``P - p`` on stage ``p``,
    GPipe all ``M``); tensors received from another partition and read by
    more than one of its tasks (a stage's inputs, read again by its
    backward) count here too;
  - ``buffers``: tensors sent to another partition, from the end of the
    producing task to the end of the task that reads them, the received
    copies of tensors read once, and the step's other outputs (a loss, a
    prediction), every micro-batch's value until the end of the step;
  - ``transient``: while a task runs, the peak of the tensors it makes and
    frees itself (found by running its ops in order, with outputs that
    alias an input, such as a ``Reshape`` or a variable read, taking no new
    memory, and element-wise ops writing into an input they read last).

``total`` is the static part plus the highest the dynamic part gets; the
``gradients``, ``activations``, ``buffers`` and ``transient`` columns are
their values at that moment. A step called eagerly adds ``rounding``: the
allocator's chunks around values that outlive the call
(`EAGER_ROUNDING`). Recomputation (`rewrite.recomputable_ops`) changes which
tensors a partition keeps, so it shows in ``activations`` (smaller) and in
``transient`` (a backward task holds the forward it recomputes).

`process_peak` is the figure comparable with one allocator shared by all
devices (logical CPU devices): every tensor counted once, on the sending
side, summed over partitions at each moment of the simulated step.

Kernel scratch is predicted where its size is known: the im2col buffers of
TensorFlow's CPU convolution gradients (`kernel_scratch`) and the buffer of
XLA's CPU filter gradient of a depthwise convolution written as a grouped
one (`compiled_scratch`). What the model does not see: other kernel
scratch (cuDNN's, oneDNN's), the runtime's own allocations, allocator
fragmentation inside a ``tf.function`` (measured small there), and
timing that differs from the simulation (a real device may start a
micro-batch's forward earlier than the simulated costs say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from smp_tf.graph_view import OpGraph, OpNode
from smp_tf.rewrite import Task
from smp_tf.schedules import Action, Simulation

__all__ = [
    "PartitionMemory",
    "MemoryReport",
    "MemoryBudgetError",
    "predict_memory",
    "predict_assignment",
    "is_gradient_output",
    "output_holds",
    "refine_memory_split",
    "storage_bytes",
    "task_workspace",
    "kernel_scratch",
    "compiled_scratch",
    "ALLOCATION_GRANULE",
    "is_view",
    "optimizer_slots",
    "format_bytes",
    "stage_multipliers",
    "choose_recompute",
]

#: Ops whose output is (a view of) their input: no new memory.
ALIASING = frozenset(
    """Identity IdentityN Reshape Squeeze ExpandDims StopGradient PreventGradient EnsureShape
    Snapshot ReadVariableOp Bitcast""".split()
)
#: Element-wise ops that write their output into an input buffer of the same
#: size when nothing else reads that input (TensorFlow's
#: ``forward_input_or_allocate_output``).
IN_PLACE = frozenset(
    """Add AddV2 Sub Mul RealDiv Div DivNoNan Maximum Minimum Neg Relu Relu6 Elu Selu Sigmoid Tanh
    Exp Log Log1p Sqrt Rsqrt Square Pow Erf Softplus LeakyRelu BiasAdd ReluGrad Relu6Grad EluGrad
    SeluGrad SigmoidGrad TanhGrad LeakyReluGrad SquaredDifference AddN Select SelectV2 Abs Sign
    Reciprocal Inv Floor Ceil Round""".split()
)
#: Ops whose outputs live outside the step's dynamic memory (constants,
#: arguments, captured handles).
_NOT_ALLOCATED = frozenset(["Const", "Placeholder", "VarHandleOp", "_Arg"])

#: TensorFlow's CPU convolution gradients lower to matrix products over an
#: im2col buffer that they allocate while they run
#: (``Conv2DCustomBackpropFilterOp``/``...InputOp``): the filter gradient
#: takes as many images as fit a 30 MiB working set (its "L3 cache" target),
#: the input gradient one image at a time.
CONV_WORKING_SET = 30 << 20
_CONV_GRADIENTS = ("Conv2DBackpropFilter", "Conv2DBackpropInput")


#: A step called eagerly: the share of its dynamic peak added for the BFC
#: allocator's chunk rounding. Every micro-batch's outputs outlive the
#: call, and each is allocated while the backward frees activations of
#: other sizes; the allocator hands a request a whole free chunk of up to
#: twice its size. The model counts what the tensors ask for (0.92 to 1.05
#: of the allocator's requested bytes on a Llama, ConvNeXtTiny,
#: EfficientNetV2B0 and ResNet50); the allocator's counter exceeded the
#: prediction by 3% (ConvNeXtTiny) to 16% (Llama, 2 partitions) of the
#: predicted dynamic peak (``benchmarks/memory/ratios.py``, ``EAGER``
#: against ``EAGER_REQUESTED``). Inside a ``tf.function`` the running sum
#: adds in place and the same steps measure at most 3% above the
#: prediction, so nothing is added there.
EAGER_ROUNDING = 0.125


def kernel_scratch(graph: OpGraph, op: OpNode) -> int:
    """Bytes an op allocates for itself while it runs and frees before it
    returns: the im2col buffer of a 2-D convolution's gradients (channels
    last, as Keras lays them out on CPUs); 0 for every other op.

    The formulas are those of TensorFlow's CPU kernels; on GPUs cuDNN picks
    its own workspace, which this does not see (`predict_memory` leaves the
    figure out for partitions on GPUs).
    """
    if op.type not in _CONV_GRADIENTS or len(op.inputs) < 3 or not op.outputs:
        return 0
    grad = graph.tensors[op.inputs[2]]
    if op.type == "Conv2DBackpropFilter":
        filt = graph.tensors[op.outputs[0]].shape
    else:
        filt = graph.tensors[op.inputs[1]].shape
    shapes = (grad.shape, filt)
    if any(s is None or len(s) != 4 or any(d is None for d in s) for s in shapes):
        return 0
    itemsize = grad.bytes // max(1, grad.elements)
    out_image = grad.shape[1] * grad.shape[2]
    filter_total = filt[0] * filt[1] * filt[2]
    col_image = out_image * filter_total  # one image's im2col rows
    if op.type == "Conv2DBackpropInput":
        return _granules(col_image * itemsize)
    work_unit = col_image + out_image * filt[3] + filter_total * filt[3]
    shard = -(-(CONV_WORKING_SET // itemsize) // work_unit)
    return _granules(shard * col_image * itemsize)


def compiled_scratch(graph: OpGraph, op: OpNode) -> int:
    """Bytes an XLA-compiled call (`OpNode.compiled`) allocates for itself
    on a CPU, beyond its outputs: the filter gradient of a depthwise
    convolution written as a grouped one; 0 for every other op.

    Keras runs a grouped ``Conv2D`` (``groups > 1``: ConvNeXt's depthwise
    convolutions are ``Conv2D(C, groups=C)``) on TensorFlow as a function
    XLA compiles, and its gradient with it. XLA's CPU compiler has no
    grouped filter gradient: where there is one group per input and per
    output channel, it computes the dense ``K x K x C x C`` filter gradient
    and a mask of the same shape that picks its diagonal
    (``ConvolutionGroupConverter``), one temporary buffer of twice those
    bytes for the call. On ConvNeXtTiny's last stage (K=7, C=768) that is
    220.5 MiB, against 147 KiB of filter gradient.

    Recognised from the call's shapes: an output of shape ``(K, K, 1, C)``
    (the filter gradient) and an input ``(N, H, W, C)`` (the image), with
    ``C > 1``. Other group counts (several channels per group, or a channel
    multiplier) take other paths through XLA, whose temporaries this does
    not predict (they measure below one filter's bytes).
    """
    if not (op.compiled and op.is_gradient):
        return 0  # the forward call returns the filter too: not a gradient
    inputs = [tuple(graph.tensors[t].shape) for t in op.inputs
              if _known(graph.tensors[t].shape) and len(graph.tensors[t].shape) == 4]
    total = 0
    for t in op.outputs:
        info = graph.tensors[t]
        shape = info.shape
        if not (_known(shape) and len(shape) == 4 and shape[2] == 1 and shape[3] > 1):
            continue
        # The image: a 4-D input with C channels that is not the filter.
        if any(s[-1] == shape[3] and s != tuple(shape) for s in inputs):
            itemsize = info.bytes // max(1, info.elements)
            total += _granules(2 * shape[0] * shape[1] * shape[3] * shape[3] * itemsize)
    return total


_FIELDS = ("variables", "optimizer", "gradients", "activations", "buffers", "transient")


class MemoryBudgetError(ValueError):
    """A layout's predicted peak does not fit `memory_budget` on some device."""


def optimizer_slots(optimizer: object) -> float:
    """Optimizer state per byte of trainable variable.

    Adam-like optimizers keep two slots (AdamW, Adamax, Nadam, LAMB, ...),
    RMSprop one (two with momentum), Adagrad and Adadelta one (Adadelta
    two), SGD one with momentum and none without; an unknown optimizer is
    assumed to keep two. None (no optimizer known) keeps none.
    """
    if optimizer is None:
        return 0.0
    name = type(optimizer).__name__.lower()
    if name in ("sgd",):
        return 1.0 if float(getattr(optimizer, "momentum", 0.0) or 0.0) > 0 else 0.0
    if name == "rmsprop":
        return 2.0 if float(getattr(optimizer, "momentum", 0.0) or 0.0) > 0 else 1.0
    if name in ("adagrad", "ftrl"):
        return 1.0 if name == "adagrad" else 2.0
    if name == "adadelta":
        return 2.0
    if name == "lion":
        return 1.0
    if "lossscale" in name:
        return optimizer_slots(getattr(optimizer, "inner_optimizer", None))
    return 2.0


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class PartitionMemory:
    """One partition's predicted peak, in bytes (see the module doc).

    Attributes:
        partition: the partition.
        device: its device.
        variables, optimizer: the static part.
        gradients, activations, buffers, transient: the dynamic part at
            its peak.
        rounding: a step called eagerly: the allocator's chunk rounding,
            `EAGER_ROUNDING` of the dynamic part (0 otherwise).
        total: the predicted peak.
        recompute: the partition's recompute mode.
        measured: the measured peak where a measurement exists (None
            otherwise); see `MemoryReport.method`.
        shard: with tensor parallelism, in `MemoryReport.devices`: the
            device's index in its partition's stage (None in the
            per-partition rows).
    """

    partition: int
    device: str = ""
    variables: int = 0
    optimizer: int = 0
    gradients: int = 0
    activations: int = 0
    buffers: int = 0
    transient: int = 0
    rounding: int = 0
    total: int = 0
    recompute: str = "never"
    measured: Optional[int] = None
    shard: Optional[int] = None


def _process_of(device: str) -> str:
    """The process a device name belongs to, as ``/job:NAME/task:N``
    (``/job:localhost/task:0`` for a name without them, a device of this
    process)."""
    job, task = "localhost", "0"
    for part in device.split("/"):
        if part.startswith("job:"):
            job = part[4:]
        elif part.startswith("task:"):
            task = part[5:]
    return f"/job:{job}/task:{task}"


def _processes(devices: Iterable[str]) -> List[str]:
    """The processes of `devices`, in order of first appearance."""
    return list(dict.fromkeys(_process_of(d) for d in devices))


def _one_allocator(devices: Sequence[str]) -> bool:
    """Whether all of `devices` draw on one allocator: logical CPU devices
    of one process do (so a peak of all partitions together is what that
    allocator sees); GPUs and the devices of several processes do not. True
    where a device is not known."""
    if not devices or not all(devices):
        return True
    return {device_kind(d) for d in devices} == {"CPU"} and len(_processes(devices)) == 1


def device_kind(device: str) -> str:
    """``"CPU"`` for ``/job:w/task:1/device:CPU:0``, ``/device:CPU:1``,
    ``/cpu:0`` or ``CPU:0``; ``"GPU"`` likewise."""
    last = device.rsplit("/", 1)[-1]
    if last.lower().startswith("device:"):
        last = last[len("device:"):]
    return last.split(":")[0].upper()


def _device_of(r: "PartitionMemory") -> str:
    """The device a row counts against: its device, or the partition itself
    where no device is known (one partition per device)."""
    return r.device or f"partition {r.partition}"


@dataclass
class MemoryReport:
    """The memory of every partition of a compiled step.

    Attributes:
        partitions: one `PartitionMemory` per partition.
        devices: with tensor parallelism, one row per device of every
            stage (``partition``, ``shard``, ``device``): the variables,
            the optimizer state and the gradients on device 0 of the stage,
            each device's own activations, buffers and transient peak.
            Empty without. `device_totals` (and so ``memory_budget``) reads
            these rows where there are any.
        process_peak: the predicted peak of all partitions together, each
            tensor counted once (what one shared allocator sees).
        measured_process_peak: the measured peak of one shared allocator
            (logical CPU devices with ``TF_CPU_ALLOCATOR_USE_BFC=true``).
        method: how ``measured`` was obtained, in words.
        budget: the configured ``memory_budget`` (None: none), or each
            device's own (a mapping device -> bytes, from a declared
            ``cluster``'s memory).
        schedule: the schedule kind and micro-batch count it was predicted for.
    """

    partitions: List[PartitionMemory]
    devices: List[PartitionMemory] = field(default_factory=list)
    process_peak: int = 0
    measured_process_peak: Optional[int] = None
    method: str = ""
    budget: Any = None
    schedule: str = ""

    def __getitem__(self, p: int) -> PartitionMemory:
        return self.partitions[p]

    def __iter__(self):
        return iter(self.partitions)

    def __len__(self) -> int:
        return len(self.partitions)

    @property
    def peak(self) -> int:
        """The largest predicted partition peak."""
        return max((r.total for r in self.partitions), default=0)

    def device_totals(self) -> Dict[str, int]:
        """Device -> the sum of its partitions' predicted peaks. With
        ``virtual_stages`` a device holds several partitions; their peaks
        need not coincide, so the sum is an upper bound of the device's. A row
        without a device counts as a device of its own (``"partition N"``)."""
        out: Dict[str, int] = {}
        # With tensor parallelism, each device of a stage by its own row.
        for r in self.devices or self.partitions:
            out[_device_of(r)] = out.get(_device_of(r), 0) + r.total
        return out

    def table(self) -> str:
        """The report as a table (one row per partition)."""
        head = f"Memory per partition ({self.schedule})" if self.schedule else "Memory per partition"
        if self.budget is not None:
            head += f", budget {format_budget(self.budget)}"
        cols = ("variables", "optimizer", "gradients", "activations", "buffers", "transient", "total", "measured")
        # Devices of other processes (`pipeline_processes`) carry their job
        # and task, longer than a local device's name.
        width = max([16] + [len(r.device) for r in self.partitions])
        lines = [
            head,
            f"{'part':>4}  {'device':<{width}} {'recompute':<9} " + " ".join(f"{c:>11}" for c in cols),
        ]
        for r in self.partitions:
            cells = [format_bytes(getattr(r, c)) for c in cols[:-1]]
            cells.append("-" if r.measured is None else format_bytes(r.measured))
            lines.append(
                f"{r.partition:>4}  {r.device:<{width}} {r.recompute:<9} " + " ".join(f"{c:>11}" for c in cells)
            )
        if any(r.rounding for r in self.partitions):
            lines.append("called eagerly: each total adds the allocator's chunk rounding of the step's own bytes ("
                         + ", ".join(f"{r.partition}: {format_bytes(r.rounding)}" for r in self.partitions)
                         + f"; {EAGER_ROUNDING:.1%} of the dynamic part)")
        totals = self.device_totals()
        if len(totals) < len(self.devices or self.partitions):
            lines.append("per device, sum of its partitions' peaks (an upper bound): " + ", ".join(
                f"{d or '-'} {format_bytes(b)}" for d, b in totals.items()))
        devices = [r.device for r in self.partitions]
        if self.measured_process_peak is not None or _one_allocator(devices):
            line = f"all partitions, one allocator: predicted {format_bytes(self.process_peak)}"
            if self.measured_process_peak is not None:
                ratio = self.measured_process_peak / self.process_peak if self.process_peak else float("nan")
                line += f", measured {format_bytes(self.measured_process_peak)} ({ratio:.2f}x)"
            lines.append(line)
        else:
            per_process: Dict[str, int] = {}
            for r in self.partitions:
                key = _process_of(r.device)
                per_process[key] = per_process.get(key, 0) + r.total
            if len(per_process) > 1:  # a pipeline across processes: each has its own allocator
                lines.append("per process, sum of its partitions' peaks (an upper bound): " + ", ".join(
                    f"{k} {format_bytes(b)}" for k, b in per_process.items()))
        if self.devices:
            lines.append("per device of each stage (tensor parallelism):")
            for r in self.devices:
                cells = [format_bytes(getattr(r, c)) for c in cols[:-1]]
                lines.append(f"{r.partition:>4}.{r.shard:<1} {r.device:<{width}} {'':<9} "
                             + " ".join(f"{c:>11}" for c in cells))
        if self.method:
            lines.append(f"measured: {self.method}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return self.table()


#: Matrix products whose operands TensorFlow's graph optimiser may take
#: transposed (``transpose_a``/``adj_x`` and their counterparts).
_MATMULS = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"])


def _known(shape: Any) -> bool:
    return shape is not None and all(d is not None for d in shape)


def is_view(graph: OpGraph, op: OpNode) -> bool:
    """Whether `op` allocates nothing of its own: its outputs share its first
    input's buffer.

    The `ALIASING` ops, and two kinds of ``Transpose`` that the runtime
    never materialises:

    * one that can only move dimensions of size 1: TensorFlow's kernel hands
      out its input's buffer under the new shape. Gradients build such
      transposes from permutations computed at run time (the gradient of a
      ``gather`` with ``batch_dims``), so the permutation is read from the
      shapes: when the dimensions larger than 1 have distinct sizes and
      appear in the same order in the input and the output, no permutation
      but one that keeps them in place gives that output;
    * a transpose of the last two dimensions read only by matrix products:
      the graph optimiser folds it into them (``transpose_b=True``), as for
      a tied embedding used as the output projection.
    """
    if op.type in ALIASING:
        return bool(op.inputs)
    if op.type != "Transpose" or not op.inputs or len(op.outputs) != 1:
        return False
    src, dst = graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape
    if not _known(src) or not _known(dst) or len(src) != len(dst):
        return False
    big = [d for d in src if d != 1]
    if big == [d for d in dst if d != 1] and len(set(big)) == len(big):
        return True
    out = graph.tensors[op.outputs[0]]
    inner = (len(src) == 2 or len(set(src)) == len(src)) and tuple(dst) == tuple(src[:-2]) + (src[-1], src[-2])
    return (inner and not out.dtype.startswith("complex") and bool(out.consumers)
            and all(graph.ops[c].type in _MATMULS and out.id in graph.ops[c].inputs[:2] for c in out.consumers))


#: TensorFlow's BFC allocator hands out multiples of 256 bytes
#: (``kMinAllocationSize``): many small tensors take more than their sizes.
ALLOCATION_GRANULE = 256


def _granules(nbytes: int) -> int:
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def storage_bytes(graph: OpGraph) -> List[int]:
    """Bytes of new memory each tensor takes.

    0 for tensors that alias a variable (a ``ReadVariableOp`` and views of
    it), constants, step arguments and captures; the tensor's bytes
    otherwise (a view of an activation keeps that activation alive, so it
    counts its size), rounded up to `ALLOCATION_GRANULE` as TensorFlow's
    BFC allocator (GPUs, and CPUs with ``TF_CPU_ALLOCATOR_USE_BFC``) does.
    """
    out = [_granules(t.bytes) for t in graph.tensors]
    for op in graph.ops:  # topological order: a view's source is done first
        if op.kind != "op" or op.type in _NOT_ALLOCATED or op.type == "ReadVariableOp":
            for t in op.outputs:
                out[t] = 0
        elif is_view(graph, op) and out[op.inputs[0]] == 0:
            for t in op.outputs:
                out[t] = 0
    return out


def task_workspace(
    graph: OpGraph, task: Task, storage: Optional[Sequence[int]] = None, cpu_scratch: bool = True,
    on_cpu: bool = True,
) -> int:
    """Peak bytes a task allocates while it runs (its outputs included).

    The ops (members, copies and recomputed ops) run in graph order; a
    tensor is freed after its last reader in the task, unless the task
    returns it; a view allocates nothing and keeps its source alive; an
    element-wise op writes into an input of the same size that it reads
    last (`IN_PLACE`); an op's own scratch (`kernel_scratch`, the figures
    of TensorFlow's CPU kernels; ``cpu_scratch=False`` leaves it out, as for
    a GPU) adds to the peak while it runs, and so does the temporary buffer
    of an XLA-compiled call on a CPU (`compiled_scratch`; ``on_cpu=False``
    leaves it out). Inputs from other tasks are not counted (they are held
    by their producer).
    """
    storage = storage_bytes(graph) if storage is None else storage
    ops = sorted(set(task.members) | set(task.copies) | set(task.recomputed))
    in_task = set(ops)
    outputs = set(task.outputs)
    # Buffer of each tensor: views share their source's buffer.
    buffer: Dict[int, int] = {}
    last_use: Dict[int, int] = {}
    for i in ops:
        op = graph.ops[i]
        for t in op.inputs:
            b = buffer.get(t, t)
            last_use[b] = i
        if is_view(graph, op):
            for k, t in enumerate(op.outputs):
                x = op.inputs[k] if op.type == "IdentityN" and k < len(op.inputs) else op.inputs[0]
                buffer[t] = buffer.get(x, x)
    pinned = {buffer.get(t, t) for t in outputs}
    # A convolution's input and filter gradients read the same incoming
    # gradient and nothing of each other: the runtime's inter-op threads run
    # them side by side, so their scratch buffers add.
    # `scratch`: op -> the scratch live while it runs.
    by_gradient: Dict[int, List[int]] = {}
    own: Dict[int, int] = {}
    for i in ops if cpu_scratch else ():
        own[i] = kernel_scratch(graph, graph.ops[i])
        if own[i]:
            by_gradient.setdefault(graph.ops[i].inputs[2], []).append(i)
    scratch = {i: sum(own[j] for j in group) for group in by_gradient.values() for i in group}
    for i in ops if on_cpu else ():
        extra = compiled_scratch(graph, graph.ops[i])
        if extra:
            scratch[i] = scratch.get(i, 0) + extra
    live = 0
    peak = 0
    size: Dict[int, int] = {}
    for i in ops:
        op = graph.ops[i]
        produced = 0
        reused = None
        if op.type in IN_PLACE and op.outputs:
            need = storage[op.outputs[0]]
            for t in op.inputs:
                b = buffer.get(t, t)
                if (b in size and size[b] == need and need > 0 and last_use.get(b) == i
                        and b not in pinned and graph.tensors[b].producer in in_task):
                    reused = b
                    break
        for t in op.outputs:
            if buffer.get(t, t) != t:
                continue  # a view
            if reused is not None and t == op.outputs[0]:
                size[t] = size.pop(reused)
                if last_use.get(reused) == i:
                    last_use.pop(reused, None)
                continue
            size[t] = storage[t]
            produced += storage[t]
        live += produced
        peak = max(peak, live + scratch.get(i, 0))
        for t in set(op.inputs):
            b = buffer.get(t, t)
            if last_use.get(b) == i and b in size and b not in pinned:
                live -= size.pop(b)
        for t in op.outputs:  # made and never read: freed at once
            b = buffer.get(t, t)
            if b == t and b not in last_use and b not in pinned and b in size:
                live -= size.pop(b)
    return peak


@dataclass
class _Interval:
    start: float
    end: float
    nbytes: int
    kind: str  # "activations", "buffers" or "transient"


def _peak(intervals: Iterable[_Interval]) -> Tuple[int, Dict[str, int]]:
    """The largest sum of overlapping intervals, and its parts by kind."""
    events = []
    for k, iv in enumerate(intervals):
        if iv.nbytes <= 0 or iv.end < iv.start:
            continue
        events.append((iv.start, 1, k, iv))
        events.append((iv.end, 0, k, iv))
    # Frees before allocations at the same moment: a buffer released when a
    # task ends is available to the task that starts then.
    events.sort(key=lambda e: (e[0], e[1]))
    live = {"gradients": 0, "activations": 0, "buffers": 0, "transient": 0}
    best, best_parts = 0, dict(live)
    i = 0
    while i < len(events):
        t = events[i][0]
        while i < len(events) and events[i][0] == t:
            _, up, _, iv = events[i]
            live[iv.kind] += iv.nbytes if up else -iv.nbytes
            i += 1
        total = sum(live.values())
        if total > best:
            best, best_parts = total, dict(live)
    return best, best_parts


def predict_memory(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    tasks: Sequence[Task],
    simulation: Simulation,
    *,
    num_partitions: int,
    partition_of_variable: Mapping[str, int],
    gradient_bytes: Mapping[int, int],
    slots: float = 0.0,
    optimizer_bytes: Optional[Mapping[int, int]] = None,
    recompute: Sequence[str] = (),
    devices: Sequence[str] = (),
    budget: Any = None,
    workspace: Optional[Mapping[Tuple[int, int], int]] = None,
    cpu_kernel_scratch: bool = True,
    shard_of_op: Optional[Sequence[int]] = None,
    stage_devices: Optional[Sequence[Sequence[str]]] = None,
    split_variables: Sequence[str] = (),
    held_outputs: Optional[Mapping[int, str]] = None,
    combined_bytes: Optional[Mapping[int, int]] = None,
    gradient_shards: Optional[Mapping[int, Mapping[int, int]]] = None,
) -> MemoryReport:
    """Predicts every partition's peak under a simulated schedule.

    Args:
        graph: the traced graph.
        partition_of_op: partition of each op.
        tasks: the tasks (`rewrite.build_tasks`), with the recomputation
            they were built with.
        simulation: the schedule's simulation (start and end of every action).
        num_partitions: number of partitions.
        partition_of_variable: variable key -> partition.
        gradient_bytes: partition -> bytes of the gradients the step returns
            from it (summed over micro-batches by `StepOutput.accumulate`);
            used as a static running sum plus one micro-batch's gradient
            only where `held_outputs` is None.
        slots: optimizer slots per byte of trainable variable
            (`optimizer_slots`), used where `optimizer_bytes` is None.
        optimizer_bytes: partition -> bytes of optimizer state that exists.
        recompute: each partition's recompute mode (for the report).
        devices: device of each partition (for the report; a GPU's tasks
            leave out the CPU kernels' scratch, see `task_workspace`).
        budget: the memory budget (for the report).
        workspace: (partition, wave) -> a task's peak to use instead of
            `task_workspace` (e.g. measured).
        cpu_kernel_scratch: whether the convolution gradients of partitions
            on CPUs allocate `kernel_scratch` (TensorFlow's own CPU kernels);
            False where oneDNN's kernels run them, which keep their
            scratch outside TensorFlow's allocator.
        shard_of_op: with tensor parallelism, the device of each op within
            its partition's stage (0 for what is not split); the report
            then also has a row per device (`MemoryReport.devices`).
        stage_devices: the devices of each partition's stage.
        split_variables: keys of the variables whose storage is split over
            their stage's devices (`smp_tf.sharding.storage`): each device
            holds its share of them and of their optimizer state.
        held_outputs: task output -> ``"gradients"`` or ``"buffers"``: the
            step's outputs, each micro-batch's value held from the end of
            the task that makes it to the end of the step (`output_holds`).
        combined_bytes: partition -> bytes made at the end of the step from
            the held values (the gradients' sums).
        gradient_shards: with tensor parallelism, partition -> device of its
            stage -> bytes of the gradients made there (a gradient returned
            in pieces, `smp_tf.step_output.SplitValue`, has piece k on
            device k); the running sums and the sums of `combined_bytes`
            are divided alike. None: every gradient on device 0.

    Returns:
        The `MemoryReport` (``measured`` unset).
    """
    num_mb = 1 + max((a.microbatch for a in simulation.start), default=0)
    rows = [
        PartitionMemory(
            p,
            device=devices[p] if p < len(devices) else "",
            recompute=recompute[p] if p < len(recompute) else "never",
        )
        for p in range(num_partitions)
    ]
    for v, p in partition_of_variable.items():
        nbytes = graph.variable_bytes.get(v, 0)
        rows[p].variables += nbytes
        if optimizer_bytes is None and graph.trainable.get(v, True):
            rows[p].optimizer += int(round(slots * nbytes))
    if optimizer_bytes is not None:
        for p, nbytes in optimizer_bytes.items():
            rows[p].optimizer += int(nbytes)
    static_gradients = [0] * num_partitions
    if held_outputs is None:
        for p, nbytes in gradient_bytes.items():
            # The running sum, and one micro-batch's gradient being added to it.
            static_gradients[p] += int(nbytes) * (2 if num_mb > 1 else 1)

    storage = storage_bytes(graph)
    # The kernel scratch `kernel_scratch` predicts is that of TensorFlow's
    # CPU kernels: not counted on GPUs, whose kernels choose their own, nor
    # where oneDNN's CPU kernels run the convolutions.
    on_gpu = {p for p, d in enumerate(devices) if str(d).rsplit("device:", 1)[-1].upper().startswith("GPU")}
    workspace = {t.key: (workspace[t.key] if workspace and t.key in workspace
                         else task_workspace(graph, t, storage,
                                             cpu_scratch=cpu_kernel_scratch and t.partition not in on_gpu,
                                             on_cpu=t.partition not in on_gpu))
                 for t in tasks}
    # With tensor parallelism, each task's transient peak per device of its stage.
    shard_workspace = (_shard_workspaces(graph, tasks, storage, shard_of_op, cpu_kernel_scratch, on_gpu)
                       if shard_of_op is not None else {})
    # Each device's fraction of its partition's gradients.
    fraction: Dict[int, Dict[int, float]] = {}
    for p, per in (gradient_shards or {}).items():
        total = sum(per.values())
        if total:
            fraction[p] = {k: nbytes / total for k, nbytes in per.items()}
    per_device, per_shard, process = _schedule_intervals(
        graph, tasks, simulation, storage, workspace, num_partitions, shard_of_op, shard_workspace,
        held_outputs or {}, combined_bytes or {}, fraction)
    rounding = EAGER_ROUNDING if held_outputs is not None else 0.0
    for p in range(num_partitions):
        peak, parts = _peak(per_device[p])
        r = rows[p]
        r.gradients = static_gradients[p] + parts["gradients"]
        r.activations, r.buffers, r.transient = parts["activations"], parts["buffers"], parts["transient"]
        r.rounding = int(round(rounding * peak))
        r.total = r.variables + r.optimizer + static_gradients[p] + peak + r.rounding
    static = sum(r.variables + r.optimizer for r in rows) + sum(static_gradients)
    dynamic = _peak(process)[0]
    process_peak = static + dynamic + int(round(rounding * dynamic))
    device_rows = []
    if shard_of_op is not None and stage_devices:
        shares = _split_shares(graph, rows, partition_of_variable, split_variables)
        device_rows = _device_rows(rows, per_shard, stage_devices, shares, static_gradients, rounding, fraction)
    return MemoryReport(rows, devices=device_rows, process_peak=process_peak, budget=budget)


def _schedule_intervals(
    graph: OpGraph,
    tasks: Sequence[Task],
    simulation: Simulation,
    storage: Sequence[int],
    workspace: Mapping[Tuple[int, int], int],
    num_partitions: int,
    shard_of_op: Optional[Sequence[int]],
    shard_workspace: Mapping[Tuple[int, int], Mapping[int, int]],
    held_outputs: Mapping[int, str],
    combined_bytes: Mapping[int, int],
    fraction: Optional[Mapping[int, Mapping[int, float]]] = None,
) -> Tuple[Dict[int, List[_Interval]], Dict[Tuple[int, int], List[_Interval]], List[_Interval]]:
    """When each tensor is alive under the simulated schedule: per
    partition, per device of a stage (with tensor parallelism, keyed by
    ``(partition, shard)``), and for the whole process.

    Each action allocates its task's transient peak while it runs; each
    task output lives on its partition from the end of the action to the
    end of its last reader, and as a received copy on every other
    partition that reads it while those readers run. A step output
    (`held_outputs`) lives from the end of its action to the end of the
    step, when the values combined from them (`combined_bytes`) are made
    while they are all still held, divided over the devices of a stage as
    its gradients are (`fraction`: partition -> device -> share; None:
    all on device 0)."""
    fraction = fraction or {}
    start, end = simulation.start, simulation.end
    # The end of the step, and a moment after it for what is made there.
    finish = max(end.values(), default=0.0)
    after = finish + 1.0
    by_key = {t.key: t for t in tasks}
    readers: Dict[int, List[Task]] = {}
    for t in tasks:
        for x in t.inputs:
            readers.setdefault(x, []).append(t)
    per_device: Dict[int, List[_Interval]] = {p: [] for p in range(num_partitions)}
    per_shard: Dict[Tuple[int, int], List[_Interval]] = {}
    process: List[_Interval] = []

    def shard_of(x: int) -> int:
        return shard_of_op[graph.tensors[x].producer] if shard_of_op is not None else 0

    def own(p: int, k: int, iv: _Interval) -> None:
        # What partition `p` makes (on device `k` of its stage): counted once
        # in the process.
        per_device[p].append(iv)
        process.append(iv)
        per_shard.setdefault((p, k), []).append(iv)

    for action in start:
        task = by_key[action.task]
        m = action.microbatch
        p = task.partition
        iv = _Interval(start[action], end[action], workspace[task.key], "transient")
        per_device[p].append(iv)
        process.append(iv)
        for k, nbytes in shard_workspace.get(task.key, {}).items():
            per_shard.setdefault((p, k), []).append(_Interval(start[action], end[action], nbytes, "transient"))
        for x in task.outputs:
            nbytes = storage[x]
            users = readers.get(x, [])
            held = held_outputs.get(x)
            if held is not None and nbytes:
                # Where the step's output is made: whole on the stage's
                # first device, or a gradient's piece on its own device.
                own(p, shard_of(x), _Interval(end[action], after, nbytes, held))
            if not users:
                continue
            if nbytes and held is None:
                ends = [end[Action(u.partition, u.wave, m)] for u in users]
                kept = any(u.partition == p for u in users)
                own(p, shard_of(x), _Interval(end[action], max(ends), nbytes, "activations" if kept else "buffers"))
            # The received copy on every other partition that reads it; a
            # variable's value (a tied weight used on another stage) takes no
            # memory where it is read, but its copy does.
            copy_bytes = nbytes or _granules(graph.tensors[x].bytes)
            for q in sorted({u.partition for u in users} - {p}):
                mine = [u for u in users if u.partition == q]
                acts = [Action(u.partition, u.wave, m) for u in mine]
                kind = "activations" if len(mine) > 1 else "buffers"
                iv = _Interval(min(start[a] for a in acts), max(end[a] for a in acts), copy_bytes, kind)
                per_device[q].append(iv)
                per_shard.setdefault((q, shard_of(x)), []).append(iv)
    for p, nbytes in combined_bytes.items():
        for k, share in sorted((fraction.get(p) or {0: 1.0}).items()):
            iv = _Interval(finish, after, int(round(nbytes * share)), "gradients")
            per_shard.setdefault((p, k), []).append(iv)
        iv = _Interval(finish, after, int(nbytes), "gradients")
        per_device[p].append(iv)
        process.append(iv)
    return per_device, per_shard, process


def _split_shares(graph: OpGraph, rows: Sequence[PartitionMemory], partition_of_variable: Mapping[str, int],
                  split_variables: Sequence[str]) -> Dict[int, Tuple[int, int]]:
    """Partition -> (variable bytes, optimizer bytes) stored split over its
    stage. The optimizer's share is its state in proportion to the split
    trainable bytes (slots have their variable's shape)."""
    split = set(split_variables)
    out: Dict[int, Tuple[int, int]] = {}
    for p, r in enumerate(rows):
        keys = [v for v, q in partition_of_variable.items() if q == p]
        trainable = sum(graph.variable_bytes.get(v, 0) for v in keys if graph.trainable.get(v, True))
        mine = [v for v in keys if v in split]
        nbytes = sum(graph.variable_bytes.get(v, 0) for v in mine)
        trained = sum(graph.variable_bytes.get(v, 0) for v in mine if graph.trainable.get(v, True))
        optimizer = int(round(r.optimizer * trained / trainable)) if trainable else 0
        if nbytes:
            out[p] = (nbytes, optimizer)
    return out


def _device_rows(rows: Sequence[PartitionMemory], per_shard: Mapping[Tuple[int, int], List[_Interval]],
                 stage_devices: Sequence[Sequence[str]],
                 shares: Mapping[int, Tuple[int, int]], static_gradients: Sequence[int],
                 rounding: float = 0.0,
                 fraction: Optional[Mapping[int, Mapping[int, float]]] = None) -> List[PartitionMemory]:
    """One row per device of every stage: each device's share of the
    variables stored split and of their optimizer state; the other
    variables and their state on device 0 of the stage; each device's
    share of the gradients' running sums (`fraction`, all on device 0 where
    a partition has none); each device's own intervals (the gradients where
    they are made) at its peak, and `rounding` of that peak
    (`EAGER_ROUNDING` for a step called eagerly)."""
    fraction = fraction or {}
    out: List[PartitionMemory] = []
    for p, r in enumerate(rows):
        t = len(stage_devices[p])
        split_vars, split_opt = shares.get(p, (0, 0))
        for k, device in enumerate(stage_devices[p]):
            d = PartitionMemory(p, device=device, recompute=r.recompute, shard=k)
            d.variables, d.optimizer = split_vars // t, split_opt // t
            if k == 0:
                d.variables += r.variables - split_vars
                d.optimizer += r.optimizer - split_opt
            static = int(round(static_gradients[p] * (fraction.get(p) or {0: 1.0}).get(k, 0.0)))
            peak, parts = _peak(per_shard.get((p, k), []))
            d.gradients = static + parts["gradients"]
            d.activations, d.buffers, d.transient = parts["activations"], parts["buffers"], parts["transient"]
            d.rounding = int(round(rounding * peak))
            d.total = d.variables + d.optimizer + static + peak + d.rounding
            out.append(d)
    return out


def _shard_workspaces(graph: OpGraph, tasks: Sequence[Task], storage: Sequence[int], shard_of_op: Sequence[int],
                      cpu_scratch: bool, on_gpu: set) -> Dict[Tuple[int, int], Dict[int, int]]:
    """task key -> shard -> the transient peak of the task's ops on that
    device of its stage (`task_workspace` of those ops alone; what they read
    from another device of the stage counts as received there)."""
    out: Dict[Tuple[int, int], Dict[int, int]] = {}
    for task in tasks:
        ops = set(task.members) | set(task.copies) | set(task.recomputed)
        peaks: Dict[int, int] = {}
        for k in sorted({shard_of_op[i] for i in ops}):
            mine = {i for i in ops if shard_of_op[i] == k}
            # Its outputs: what the task returns, and what the task's ops
            # on the stage's other devices read.
            outputs = [x for op in mine for x in graph.ops[op].outputs
                       if x in task.outputs or any(c in ops and c not in mine for c in graph.tensors[x].consumers)]
            sub = replace(task, members=[i for i in task.members if i in mine],
                          copies=[i for i in task.copies if i in mine],
                          recomputed=[i for i in task.recomputed if i in mine], outputs=outputs)
            received = sum(storage[x] for op in mine for x in graph.ops[op].inputs
                           if graph.tensors[x].producer in ops and graph.tensors[x].producer not in mine)
            scratch = cpu_scratch and task.partition not in on_gpu
            peaks[k] = task_workspace(graph, sub, storage, cpu_scratch=scratch,
                                      on_cpu=task.partition not in on_gpu) + received
        out[task.key] = peaks
    return out


def is_gradient_output(graph: OpGraph, op: int, tensor: int) -> bool:
    """Whether step output `tensor`, made by `op`, is a gradient (summed over
    micro-batches, counted in ``gradients``): a floating-point output of a
    gradient op."""
    o = graph.ops[op]
    return o.is_gradient and o.kind == "op" and graph.tensors[tensor].dtype.startswith(
        ("float", "bfloat", "half", "double"))


def gradient_bytes_by_partition(graph: OpGraph, partition_of_op: Sequence[int],
                                output_tensors: Iterable[int]) -> Dict[int, int]:
    """Partition -> bytes of the gradients among `output_tensors` (the
    floating-point outputs of gradient ops) its ops produce."""
    out: Dict[int, int] = {}
    for t in set(output_tensors):
        producer = graph.tensors[t].producer
        if is_gradient_output(graph, producer, t):
            p = partition_of_op[producer]
            out[p] = out.get(p, 0) + graph.tensors[t].bytes
    return out


def output_holds(graph: OpGraph, partition_of_op: Sequence[int],
                 output_tensors: Iterable[int]) -> Tuple[Dict[int, str], Dict[int, int]]:
    """What the step's outputs hold (`predict_memory`'s `held_outputs` and
    `combined_bytes`): each output, a gradient (`is_gradient_output`) or
    another output (``"buffers"``), held for every micro-batch until the
    end of the step; and per partition the bytes of the gradients' sums
    `StepOutput.accumulate` makes there."""
    held: Dict[int, str] = {}
    for t in set(output_tensors):
        producer = graph.tensors[t].producer
        held[t] = "gradients" if is_gradient_output(graph, producer, t) else "buffers"
    return held, gradient_bytes_by_partition(graph, partition_of_op, output_tensors)


def predict_assignment(
    graph: OpGraph,
    partition_of_op: Sequence[int],
    output_tensors: Sequence[int],
    *,
    num_partitions: int,
    num_microbatches: int,
    kind: str,
    recompute: str = "never",
    slots: float = 0.0,
    device_of_partition: Optional[Sequence[int]] = None,
    cpu_kernel_scratch: bool = True,
    shard_of_op: Optional[Sequence[int]] = None,
    tensor_degree: int = 1,
    split_variables: Sequence[str] = (),
    tasks: Optional[Sequence[Task]] = None,
    outputs_held: bool = True,
) -> MemoryReport:
    """`predict_memory` for an assignment, before any lowering.

    Cuts the tasks (`rewrite.build_tasks`), simulates the schedule with unit
    costs and predicts every partition's peak, counting `slots` optimizer
    slots per trainable byte and, as gradients, the floating-point outputs
    of gradient ops among `output_tensors`. `device_of_partition` maps each
    partition to its device number (``virtual_stages``); None: one
    partition per device. `cpu_kernel_scratch` as for `predict_memory`.
    With tensor parallelism (`tensor_degree` devices per stage,
    `shard_of_op` and `split_variables` as for `predict_memory`) the report
    also has its rows per device. `tasks`: the tasks of this assignment
    when the caller has already cut them (with the same `recompute` and
    the schedule's split of the backward). `outputs_held`: the step is
    called eagerly, so every micro-batch's outputs are held until the end
    of the step (`output_holds`); False: called inside a ``tf.function``,
    where `StepOutput.accumulate`'s running sum takes each gradient as it
    arrives (the sum and one gradient).
    """
    from smp_tf.rewrite import build_tasks, task_specs
    from smp_tf.schedules import make_schedule, schedule_builder

    if tasks is None:
        tasks = build_tasks(graph, partition_of_op, sorted(set(output_tensors)), recompute=recompute,
                            split_weight=schedule_builder(kind).split_weight)
    simulation = make_schedule(task_specs(tasks, device_of_partition), num_microbatches, kind).simulate()
    partition_of_variable: Dict[str, int] = {}
    for op, p in zip(graph.ops, partition_of_op):
        for v in op.variables:
            partition_of_variable.setdefault(v, p)
    held, gradient_bytes = output_holds(graph, partition_of_op, output_tensors)
    return predict_memory(
        graph, partition_of_op, tasks, simulation,
        num_partitions=num_partitions,
        partition_of_variable=partition_of_variable,
        gradient_bytes=gradient_bytes,
        held_outputs=held if outputs_held else None,
        combined_bytes=gradient_bytes if outputs_held else None,
        slots=slots,
        cpu_kernel_scratch=cpu_kernel_scratch,
        shard_of_op=shard_of_op if tensor_degree > 1 else None,
        stage_devices=[[f"{p}.{k}" for k in range(tensor_degree)] for p in range(num_partitions)],
        split_variables=split_variables,
    )


def refine_memory_split(
    assign: Callable[..., List[int]],
    predict: Callable[[Sequence[int]], MemoryReport],
    rounds: int = 3,
    moves: int = 0,
    device_of_partition: Optional[Sequence[int]] = None,
    capacity: Optional[Mapping[Tuple[int, int], float]] = None,
) -> List[int]:
    """A contiguous memory split that also balances what it cannot model per unit.

    The split (`assign`, given each stage's fixed bytes) balances what
    scales with the units a stage holds: variables, optimizer slots,
    gradient sums and activations times the micro-batches the schedule
    keeps. A stage's boundary buffers and the transient workspace of its
    largest task (on the last stage: the logits and their gradient) are
    only known once the tasks exist, so each round predicts the split's
    peaks (`predict`), hands their ``buffers + transient`` back to the
    split as that stage's fixed bytes, and splits again, stopping early
    when a round changes nothing.

    Then, with `moves`, up to that many boundary moves on the predicted
    peaks themselves: a partition of the worst device gives its first unit
    to the previous partition or its last unit to the next
    (``assign(overheads, shifts)``, shifts of the interior boundaries in
    units), whichever lowers the worst device's figure most, until none
    does. The per-unit model is an estimate; this settles what it gets
    wrong by less than one unit.

    A device's figure is its partition's peak, or with
    `device_of_partition` (``virtual_stages``: several partitions per
    device) the sum of its partitions' peaks, the upper bound that
    ``memory_budget`` checks. With tensor parallelism (reports with rows
    per device, `MemoryReport.devices`) each device of a stage counts on
    its own.

    Returns the assignment with the lowest worst device seen (the first on
    ties).

    Args:
        assign: ``(overheads, shifts=None)`` -> partition of each op;
            overheads None: none.
        predict: partition of each op -> its `MemoryReport`.
        rounds: how many times at most to split again.
        moves: how many boundary moves at most (0: none).
        device_of_partition: the device number of each partition; None:
            one partition per device.
        capacity: (device number, device within the stage) -> the device's
            memory (declared devices of unequal memory): each device's
            figure is then its share of its memory, so a device with
            three times the memory gets about three times the bytes.
    """

    def device(p: int) -> int:
        return p if device_of_partition is None else device_of_partition[p]

    def loads(report: MemoryReport) -> Dict[Tuple[int, int], float]:
        """(device, device within the stage) -> its figure."""
        out: Dict[Tuple[int, int], float] = {}
        for r in report.devices or report.partitions:
            key = (device(r.partition), r.shard or 0)
            out[key] = out.get(key, 0) + r.total
        if capacity:
            out = {k: v / capacity[k] if capacity.get(k) else v for k, v in out.items()}
        return out

    def worst(report: MemoryReport) -> float:
        return max(loads(report).values(), default=0)

    current = assign(None)
    report = predict(current)
    best, best_peak, best_report, best_overheads = current, worst(report), report, None
    for _ in range(rounds):
        overheads = [r.buffers + r.transient for r in report.partitions]
        nxt = assign(overheads)
        if nxt == current:
            break
        current = nxt
        report = predict(current)
        if worst(report) < best_peak:
            best, best_peak, best_report, best_overheads = current, worst(report), report, overheads
    count = len(best_report.partitions)
    shifts = [0] * max(0, count - 1)
    for _ in range(moves):
        device_loads = loads(best_report)
        d = max(device_loads, key=device_loads.get)[0]
        mine = [p for p in range(count) if device(p) == d]
        tried = []
        for p in mine:
            if p > 0:
                tried.append(shifts[:p - 1] + [shifts[p - 1] + 1] + shifts[p:])
            if p + 1 < count:
                tried.append(shifts[:p] + [shifts[p] - 1] + shifts[p + 1:])
        found = None
        for cand in tried:
            nxt = assign(best_overheads, cand)
            if nxt == best:
                continue
            rep = predict(nxt)
            if worst(rep) < best_peak and (found is None or worst(rep) < worst(found[2])):
                found = (cand, nxt, rep)
        if found is None:
            break
        shifts, best, best_report = found
        best_peak = worst(best_report)
    return best


def stage_multipliers(
    num_partitions: int, num_microbatches: int, kind: str, num_devices: Optional[int] = None,
) -> List[float]:
    """Micro-batches whose activations stage ``p`` of a chain keeps at once.

    With `num_devices` below `num_partitions` (``virtual_stages``: chunk
    ``c`` on device ``c % num_devices``) the figure of each chunk comes from
    the schedule itself, simulated on a chain of chunks of equal cost: the
    most micro-batches that chunk holds at once (from its first action on
    a micro-batch to its last).

    Under ``interleaved`` (1F1B) stage ``p`` keeps at most ``P - p``
    (fewer when there are fewer micro-batches); under ``simple`` (GPipe)
    every stage before the last keeps all ``M``. The last stage runs forward
    and backward in one task, so it keeps one micro-batch's, while that
    task runs. Under ``zero_bubble`` (ZB-H1) a micro-batch stays until its
    W has run and stage ``p`` holds back ``p`` W actions, so every stage
    keeps up to ``min(P, M)``, the last one included (its W actions read
    what its fused task computed); a micro-batch waiting for its W keeps
    only what W reads, so this errs high, and `refine_memory_split` settles
    the split on the predicted peaks.
    """
    P, M = num_partitions, num_microbatches
    if num_devices is not None and num_devices < P:
        return _simulated_multipliers(num_devices, P // num_devices, M, kind)
    if kind == "simple":
        keep = [float(M)] * P
    elif kind == "zero_bubble":
        return [float(min(P, M))] * P
    else:
        keep = [float(min(P - p, M)) for p in range(P)]
    if P:
        keep[-1] = 1.0
    return keep


def _simulated_multipliers(num_devices: int, virtual_stages: int, num_microbatches: int, kind: str) -> List[float]:
    """`stage_multipliers` of a chain of ``num_devices * virtual_stages``
    chunks, read off the simulated schedule."""
    from smp_tf.schedules import make_schedule, schedule_builder, split_chain_tasks, virtual_chain_tasks

    D, v = num_devices, virtual_stages
    if schedule_builder(kind).split_weight:
        tasks = [replace(t, device=t.partition % D) for t in split_chain_tasks(D * v, 1 / v, 1 / v, 1 / v)]
    else:
        tasks = virtual_chain_tasks(D, v)
    sim = make_schedule(tasks, num_microbatches, kind).simulate()
    spans: Dict[int, Dict[int, List[float]]] = {}
    for a, t0 in sim.start.items():
        span = spans.setdefault(a.partition, {}).setdefault(a.microbatch, [math.inf, -math.inf])
        span[0] = min(span[0], t0)
        span[1] = max(span[1], sim.end[a])
    keep = []
    for c in range(D * v):
        intervals = list(spans.get(c, {}).values())
        # Live from its first action's start until its last action's end.
        keep.append(float(max((sum(1 for s0, e0 in intervals if s0 <= s1 < e0) for s1, _ in intervals), default=1)))
    return keep


#: The recompute modes `choose_recompute` tries, from the fastest.
_ESCALATION = ("never", "selective", "full")


def budget_of(budget: Any, device: str) -> Optional[int]:
    """A device's bytes under `budget`: one figure for every device, or a
    mapping device -> bytes (each device's own capacity; a device it does
    not name has no limit)."""
    if budget is None or isinstance(budget, int):
        return budget
    return budget.get(device)


def _over(budget: Any, device: str, load: int) -> bool:
    limit = budget_of(budget, device)
    return limit is not None and load > limit


def format_budget(budget: Any) -> str:
    """A budget for messages and reports."""
    if isinstance(budget, int):
        return f"{format_bytes(budget)} per device"
    return "per device " + ", ".join(f"{d} {format_bytes(n)}" for d, n in budget.items())


def choose_recompute(
    predict: Callable[[Sequence[str]], MemoryReport],
    num_partitions: int,
    requested: str,
    budget: Any,
) -> Tuple[List[str], MemoryReport]:
    """Each partition's recompute mode, and the report it gives.

    A device fits when the sum of its partitions' predicted peaks is within
    `budget`: with one partition per device that is the partition's peak;
    with ``virtual_stages`` the sum is an upper bound of the device's peak
    (its partitions' peaks need not coincide), so the check errs safe.

    With ``requested="auto"`` every partition starts at ``"never"``, and the
    partitions of a device over `budget` move to ``"selective"``, then
    ``"full"``, until every device fits; where ``"selective"`` does not
    lower a partition's peak it tries ``"full"``, and a partition whose
    peak neither lowers (the last stage) stays where it is. Any other mode
    is used everywhere. With a budget, the result must fit.

    Args:
        predict: recompute mode per partition -> the predicted report.
        num_partitions: number of partitions.
        requested: the configured ``recompute``.
        budget: bytes per device, a mapping device -> bytes (each
            device's own capacity, `budget_of`), or None.

    Returns:
        (modes, report).

    Raises:
        MemoryBudgetError: some device does not fit `budget`; the message
            names every partition's predicted peak (and each device's sum,
            where a device holds several) and what would help.
    """
    if requested == "auto":
        modes = ["never"] * num_partitions
    else:
        modes = [requested] * num_partitions
    report = predict(modes)
    if budget is None:
        return modes, report
    # A partition whose peak a step up does not lower tries the step after
    # it (selective keeps every product's output: on a model of products
    # only it keeps what never keeps, and only full helps); one whose peak
    # full does not lower either (the last stage, whose forward and
    # backward run in one task, keeps nothing between tasks) stays where it
    # was: recomputing there would only cost time.
    stuck: set = set()
    skip: Dict[int, int] = {}  # partition -> index in _ESCALATION of the mode to try next

    def next_mode(p: int) -> Optional[int]:
        i = skip.get(p, _ESCALATION.index(modes[p]) + 1)
        return i if i < len(_ESCALATION) else None

    while requested == "auto":
        loads = report.device_totals()
        over = [
            r.partition for r in report
            if _over(budget, _device_of(r), loads[_device_of(r)]) and r.partition not in stuck
            and next_mode(r.partition) is not None
        ]
        if not over:
            break
        before = {r.partition: r.total for r in report}
        tried = list(modes)
        for p in over:
            tried[p] = _ESCALATION[next_mode(p)]
        attempt = predict(tried)
        useless = [p for p in over if attempt[p].total >= before[p]]
        for p in over:
            skip.pop(p, None)
        for p in useless:
            step_up = _ESCALATION.index(tried[p]) + 1
            if step_up < len(_ESCALATION):
                skip[p] = step_up
            else:
                stuck.add(p)
        if len(useless) == len(over):
            report = predict(modes)  # predict() may keep state: leave it at `modes`
            continue
        for p in useless:
            tried[p] = modes[p]
        modes = tried
        report = predict(modes) if useless else attempt
    if any(_over(budget, d, load) for d, load in report.device_totals().items()):
        raise MemoryBudgetError(_budget_message(report, budget, requested, predict, modes))
    return modes, report


def _budget_message(report: MemoryReport, budget: Any, requested: str, predict, modes: Sequence[str]) -> str:
    loads = report.device_totals()
    shared = len(loads) < len(report.partitions)
    rows = ", ".join(
        f"partition {r.partition} {format_bytes(r.total)} (activations {format_bytes(r.activations)}, "
        f"recompute={r.recompute!r})" + (" OVER" if _over(budget, _device_of(r), loads[_device_of(r)])
                                         and not shared else "")
        for r in report
    )
    if shared or report.devices:
        # Several partitions per device (virtual stages), or several devices
        # per partition (tensor parallelism): the budget holds per device.
        rows += (". Per device, the sum of its partitions: " if shared else ". Per device: ") + ", ".join(
            f"{d} {format_bytes(n)}" + (" OVER" if _over(budget, d, n) else "") for d, n in loads.items()
        )
    hints = []
    if any(m != "full" for m in modes):
        full = predict(["full"] * len(modes))
        fits = not any(_over(budget, d, n) for d, n in full.device_totals().items())
        full_peak = max(full.device_totals().values(), default=0)
        verdict = "fits" if fits else "still does not fit"
        what = "largest device sum" if shared else "largest peak"
        hints.append(f"recompute='full' (predicted {what} {format_bytes(full_peak)}: {verdict})")
        if requested != "auto":
            hints.append("recompute='auto' (recompute only where needed)")
    hints.append("more partitions (fewer variables and activations per device)")
    if shared:
        hints.append("fewer virtual_stages (each chunk on a device keeps its own micro-batches in flight)")
    if report.schedule.startswith("simple"):
        hints.append("pipeline='interleaved' (stage p keeps at most P - p micro-batches, not all)")
    if not shared:
        hints.append("optimize='memory' (balance the predicted peak)")
    what = (f"memory_budget={budget} ({format_budget(budget)})" if isinstance(budget, int)
            else f"the devices' memory ({format_budget(budget)})")
    return (
        f"The step does not fit {what} under "
        f"{report.schedule or 'this schedule'}. Predicted peaks: {rows}. The smallest changes that "
        f"may fit: {'; '.join(hints)}. "
        + ("Or raise memory_budget." if isinstance(budget, int) else "Or declare more memory (or raise memory_budget).")
    )


def with_measurements(report: MemoryReport, measured: Mapping[int, int], method: str,
                      process: Optional[int] = None) -> MemoryReport:
    """A copy of `report` with measured figures filled in."""
    rows = [replace(r, measured=measured.get(r.partition)) for r in report.partitions]
    return replace(report, partitions=rows, method=method, measured_process_peak=process)
