"""Measuring a step's memory, next to what `smp_tf.memory` predicts.

* **GPUs**: each partition has its own device and allocator; its peak is
  read with ``tf.config.experimental.get_memory_info`` after resetting it
  before the step. That is the ``measured`` column.
* **Logical CPU devices** share one allocator, so no per-device figure
  exists. With ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the environment before
  TensorFlow starts, the allocator counts bytes, and two real figures are
  taken: the process-wide peak of the step (compared with the predicted
  peak of all partitions together, `MemoryReport.process_peak`), and each
  task's own peak, measured by running its function alone on inputs of its
  shapes with its ops run one at a time (TensorFlow's single-threaded
  executor: the default one runs independent ops side by side in an order
  that changes from run to run and with the machine's load, and the peak
  moves with it; a task the single-threaded executor cannot run is run
  under the default one, the median of `TASK_RUNS` runs), and counting the
  bytes its ops requested from the allocator (`_peak_of`). The
  ``measured`` column is then the partition's peak computed
  from the measured task peaks instead of the predicted ones (the kept
  tensors have their static sizes, which are exact; a task that reads a
  loop's accumulators keeps its predicted peak, as its inputs cannot be
  made up). Without the BFC
  allocator nothing is measured on CPUs and the report says so.

The measured step is the usual training step: the pipeline and, for every
output, `StepOutput.accumulate`, as a `tf.function`.
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Tuple

import tensorflow as tf

from smp_tf.memory import ALLOCATION_GRANULE, MemoryReport, with_measurements

__all__ = ["measure_step_memory", "cpu_allocator_counts_bytes", "requested_peak"]

#: How many times a task the single-threaded executor cannot run is run
#: under the default one; its measured peak is the median.
TASK_RUNS = 3

#: The environment variable that makes TensorFlow's CPU allocator count bytes.
BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def cpu_allocator_counts_bytes() -> bool:
    """Whether ``get_memory_info`` counts bytes for CPU devices in this process
    (``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow started)."""
    if os.environ.get(BFC_ENV, "").lower() not in ("1", "true"):
        return False
    try:
        tf.config.experimental.get_memory_info("CPU:0")
        return True
    except (ValueError, tf.errors.OpError, RuntimeError):
        return False


def _allocator_peak(fn, device: str = "CPU:0") -> int:
    """Peak bytes above the current allocation while `fn` runs, as the
    allocator counts them (the chunks it handed out)."""
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    fn()
    return tf.config.experimental.get_memory_info(device)["peak"] - before


def requested_peak(events: Iterable[Tuple[int, bool, int]]) -> int:
    """The peak of the bytes in use over a run's allocations, each counted
    as its request rounded up to the allocator's granule.

    Args:
        events: ``(time, is_allocation, requested_bytes)`` for every
            allocation and deallocation of the run, in any order.

    Returns:
        The largest sum of the live allocations, above what was in use
        before the run (0 if nothing was allocated).
    """
    live = peak = 0
    # At one instant, frees first: a buffer released as another is taken
    # is not live at the same time as it.
    for _, is_allocation, nbytes in sorted(events, key=lambda e: (e[0], e[1])):
        granules = -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE
        live += granules if is_allocation else -granules
        peak = max(peak, live)
    return peak


def _allocation_events(logdir: str) -> Optional[List[Tuple[int, bool, int]]]:
    """The allocator's events in the profile written under `logdir`."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        return None
    files = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    if len(files) != 1:
        return None
    space = xplane_pb2.XSpace()
    with open(files[0], "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        kinds = {k: m.name for k, m in plane.event_metadata.items()
                 if m.name in ("MemoryAllocation", "MemoryDeallocation")}
        requested = [k for k, m in plane.stat_metadata.items() if m.name == "requested_bytes"]
        if not kinds or not requested:
            continue
        for line in plane.lines:
            for ev in line.events:
                kind = kinds.get(ev.metadata_id)
                if kind is None:
                    continue
                nbytes = next((s.int64_value or s.uint64_value for s in ev.stats if s.metadata_id == requested[0]), 0)
                events.append((line.timestamp_ns * 1000 + ev.offset_ps, kind == "MemoryAllocation", nbytes))
    return events


def _peak_of(fn, device: str = "CPU:0") -> int:
    """Peak bytes above the current allocation while `fn` runs.

    Read from the allocator's own events (TensorFlow's profiler records
    every allocation with its requested size): the peak of the requests,
    each rounded up to the allocator's 256-byte granule. The allocator's
    peak counter counts the chunks it handed out instead, and a request
    may get a free chunk of up to twice its size, depending on which free
    chunks earlier work in the process left: the same task's peak then
    moves by up to a seventh between processes. Where the profiler cannot
    run (another profile is open) the allocator's counter is read.
    """
    with tempfile.TemporaryDirectory() as logdir:
        try:
            tf.profiler.experimental.start(
                logdir,
                tf.profiler.experimental.ProfilerOptions(
                    host_tracer_level=2, python_tracer_level=0, device_tracer_level=0
                ),
            )
        except (tf.errors.OpError, RuntimeError, ValueError):
            return _allocator_peak(fn, device)
        try:
            fn()
        finally:
            tf.profiler.experimental.stop()
        events = _allocation_events(logdir)
    if not events:
        return _allocator_peak(fn, device)
    return requested_peak(events)


def _sequential_peak(fn: Any, inputs: list) -> Optional[int]:
    """The peak of `fn` with its ops run one at a time (TensorFlow's
    single-threaded executor), or None where that executor cannot run it.

    The default executor runs a task's independent ops side by side on the
    inter-op threads, in an order that changes from run to run and with the
    load of the machine, and the peak moves with it (by a tenth or more on
    a small task). One op at a time gives the same figure on every run in
    a process.
    """

    def one_at_a_time():
        # An eager call of a function takes its executor from the context.
        with tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR"):
            return fn(*inputs)

    try:
        one_at_a_time()  # warm: the first call builds the kernels
    except (tf.errors.OpError, ValueError, TypeError, NotImplementedError):
        return None
    return _peak_of(one_at_a_time)


def _concurrent_peak(fn: Any, inputs: list) -> int:
    """The median peak of `TASK_RUNS` runs of `fn` under the default executor."""
    fn(*inputs)  # warm: the first call builds the kernels
    peaks = sorted(_peak_of(lambda: fn(*inputs)) for _ in range(TASK_RUNS))
    return peaks[len(peaks) // 2]


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    shape = [1 if d is None else d for d in spec.shape.as_list()]
    return tf.zeros(shape, spec.dtype)


def measure_step_memory(step_fn: Any, args: tuple, kwargs: dict, optimizer: Any = None) -> MemoryReport:
    """Runs one step of `step_fn` and measures its memory (see the module doc).

    Args:
        step_fn: an `smp.step` function.
        args, kwargs: the arguments of one step.
        optimizer: the optimizer, for the predicted optimizer state.

    Returns:
        The step's `MemoryReport` with the measured figures.
    """
    from smp_tf import state
    from smp_tf.step_output import StepOutput

    @tf.function(autograph=False)
    def run(*a, **k):
        outs = step_fn(*a, **k)
        return [o.accumulate() if isinstance(o, StepOutput) else o for o in tf.nest.flatten(outs)]

    run(*args, **kwargs)  # compile, place variables, build the functions
    entry = step_fn.last_compiled
    budget = entry.budget
    report = entry.memory_report(optimizer, budget=budget)
    topo = state.topology()
    if topo.kind == "GPU":
        for d in entry.devices:
            tf.config.experimental.reset_memory_stats(d)
        run(*args, **kwargs)
        measured = {p: tf.config.experimental.get_memory_info(d)["peak"] for p, d in enumerate(entry.devices)}
        return with_measurements(report, measured, "peak of each partition's GPU allocator during one step")
    if not cpu_allocator_counts_bytes():
        report.method = (
            f"nothing (logical CPU devices share one allocator, which counts bytes only with "
            f"{BFC_ENV}=true set before TensorFlow starts)"
        )
        return report
    tf.config.experimental.reset_memory_stats("CPU:0")
    run(*args, **kwargs)
    process = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    # Each task alone, on inputs of its shapes: its own peak. The state the
    # tasks write (seeds, BatchNorm statistics) is put back afterwards.
    written = {v for op in entry.plan.op_graph.ops for v in op.writes}
    state_vars = [c.variable for c in entry.traced.captures.values()
                  if getattr(c, "key", None) in written and hasattr(c, "variable")]
    saved = [v.read_value() for v in state_vars]
    workspace: Dict[tuple, int] = {}
    concurrent = 0
    for task in entry.tasks:
        fn = entry._functions[task.key]
        specs = fn.structured_input_signature[0]
        if any(s.dtype in (tf.variant, tf.resource, tf.string) for s in specs):
            continue  # a loop's accumulators cannot be made up: keep the prediction
        inputs = [_zeros(s) for s in specs]
        with tf.device(entry.devices[task.partition]):
            peak = _sequential_peak(fn, inputs)
            if peak is None:
                concurrent += 1
                peak = _concurrent_peak(fn, inputs)
        workspace[task.key] = peak
    for v, value in zip(state_vars, saved):
        v.assign(value)
    composed = entry.memory_report(optimizer, budget=budget, workspace=workspace)
    measured = {r.partition: r.total for r in composed.partitions}
    method = (
        "logical CPU devices share one allocator: the process-wide peak of one step, and per "
        "partition its peak with each task's measured peak (each task run alone, its ops one at a time"
        + (f"; {concurrent} task(s) under the default executor, median of {TASK_RUNS} runs)" if concurrent else ")")
    )
    return with_measurements(report, measured, method, process=process)
