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
  bytes its ops requested from the allocator (`AllocationRecorder`). The
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
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import tensorflow as tf

from smp_tf.memory import MemoryReport, _granules, with_measurements

__all__ = ["measure_step_memory", "cpu_allocator_counts_bytes", "requested_peak", "AllocationRecorder"]

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
        live += _granules(nbytes) if is_allocation else -_granules(nbytes)
        peak = max(peak, live)
    return peak


#: Whether a task's peak counts the bytes its ops requested (from the
#: allocator's events, see `AllocationRecorder`) rather than the
#: allocator's own peak counter.
COUNT_REQUESTS = True

# Names of the trace annotations around the measured runs.
_RUN_MARK = "smp_tf_memory_run:"


class AllocationRecorder:
    """Runs functions under one TensorFlow profile and gives each run's peak.

    TensorFlow's profiler records every allocation of the BFC allocator
    with the bytes requested. A run's peak is the largest sum of its live
    requests, each rounded up to the allocator's 256-byte granule
    (`requested_peak`). The allocator's own peak counter counts the chunks
    it handed out instead, and a request may get a free chunk of up to
    twice its size, depending on which free chunks earlier work in the
    process left: the same task's peak then moves by up to a seventh
    between processes. One profile covers all the runs (each start and
    stop of a profile writes a few lines to TensorFlow's log); each run is
    marked by a trace annotation, and the allocations inside its span are
    its own.

    Where the profiler cannot run (another profile is open, or
    `COUNT_REQUESTS` is off) a run's peak is read from the allocator's
    counter at once.

    Usage::

        with AllocationRecorder() as rec:
            now = rec.run("a", fn)   # an int (the counter), or None
        peak = now if now is not None else rec.peaks["a"]
    """

    def __init__(self) -> None:
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self._labels: List[str] = []
        self.peaks: Dict[str, int] = {}

    def __enter__(self) -> "AllocationRecorder":
        if not COUNT_REQUESTS:
            return self
        self._dir = tempfile.TemporaryDirectory()
        try:
            tf.profiler.experimental.start(
                self._dir.name,
                tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                         device_tracer_level=0),
            )
        except (tf.errors.OpError, RuntimeError, ValueError):
            self._dir.cleanup()
            self._dir = None
        return self

    def run(self, label: str, fn: Callable[[], Any]) -> Optional[int]:
        """Runs `fn`; returns its peak now if no profile records it, else None
        (its peak is in ``peaks[label]`` after the block)."""
        if self._dir is None:
            return _allocator_peak(fn)
        with tf.profiler.experimental.Trace(_RUN_MARK + label):
            fn()
        self._labels.append(label)
        return None

    def __exit__(self, *exc: Any) -> None:
        if self._dir is None:
            return
        try:
            tf.profiler.experimental.stop()
            if exc[0] is None:
                self.peaks = _peaks_by_run(self._dir.name)
                missing = [label for label in self._labels if label not in self.peaks]
                if missing:
                    raise RuntimeError(
                        f"The profile of the memory measurement has no record of the runs {missing[:3]}; set "
                        f"smp_tf.profiling.memory.COUNT_REQUESTS = False to read the allocator's counter instead."
                    )
        finally:
            self._dir.cleanup()


def _peaks_by_run(logdir: str) -> Dict[str, int]:
    """label -> the peak of the requests made inside the run so marked."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    spans: Dict[str, Tuple[int, int]] = {}
    events: List[Tuple[int, bool, int]] = []
    for path in glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = {k: m.name for k, m in plane.event_metadata.items()}
            requested = next((k for k, m in plane.stat_metadata.items() if m.name == "requested_bytes"), None)
            for line in plane.lines:
                for ev in line.events:
                    name = names.get(ev.metadata_id, "")
                    at = line.timestamp_ns * 1000 + ev.offset_ps
                    if name.startswith(_RUN_MARK):
                        spans[name[len(_RUN_MARK):]] = (at, at + ev.duration_ps)
                    elif name in ("MemoryAllocation", "MemoryDeallocation") and requested is not None:
                        nbytes = next((s.int64_value or s.uint64_value for s in ev.stats
                                       if s.metadata_id == requested), 0)
                        events.append((at, name == "MemoryAllocation", nbytes))
    return {label: requested_peak([e for e in events if start <= e[0] <= end])
            for label, (start, end) in spans.items()}


def _one_at_a_time(fn: Any, inputs: list) -> Optional[Callable[[], Any]]:
    """`fn` on `inputs` with its ops run one at a time (TensorFlow's
    single-threaded executor), warmed up; None where that executor cannot
    run it.

    The default executor runs a task's independent ops side by side on the
    inter-op threads, in an order that changes from run to run and with the
    load of the machine, and the peak moves with it (by a tenth or more on
    a small task). One op at a time gives the same figure on every run.
    """

    def run():
        # An eager call of a function takes its executor from the context.
        with tf.experimental.function_executor_type("SINGLE_THREADED_EXECUTOR"):
            return fn(*inputs)

    try:
        run()  # warm: the first call builds the kernels
    except (tf.errors.OpError, ValueError, TypeError, NotImplementedError):
        return None
    return run


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
    # `run` is a tf.function: the running sum takes each gradient as it comes.
    report = entry.memory_report(optimizer, budget=budget, outputs_held=False)
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
    # Task -> (label, peak now or None: read from the recorder after) of each run.
    runs: Dict[tuple, List[Tuple[str, Optional[int]]]] = {}
    concurrent = 0
    with AllocationRecorder() as recorder:
        for task in entry.tasks:
            fn = entry._functions[task.key]
            specs = fn.structured_input_signature[0]
            if any(s.dtype in (tf.variant, tf.resource, tf.string) for s in specs):
                continue  # a loop's accumulators cannot be made up: keep the prediction
            inputs = [_zeros(s) for s in specs]
            labels = ["{}_{}_{}".format(*task.key, r) for r in range(TASK_RUNS)]
            with tf.device(entry.devices[task.partition]):
                run = _one_at_a_time(fn, inputs)
                if run is not None:
                    runs[task.key] = [(labels[0], recorder.run(labels[0], run))]
                else:
                    # Under the default executor: the median of TASK_RUNS runs.
                    concurrent += 1
                    fn(*inputs)  # warm: the first call builds the kernels
                    runs[task.key] = [(label, recorder.run(label, lambda: fn(*inputs))) for label in labels]
    workspace: Dict[tuple, int] = {}
    for key, measured in runs.items():
        peaks = sorted(recorder.peaks[label] if now is None else now for label, now in measured)
        workspace[key] = peaks[len(peaks) // 2]
    for v, value in zip(state_vars, saved):
        v.assign(value)
    composed = entry.memory_report(optimizer, budget=budget, workspace=workspace, outputs_held=False)
    measured = {r.partition: r.total for r in composed.partitions}
    method = (
        "logical CPU devices share one allocator: the process-wide peak of one step, and per "
        "partition its peak with each task's measured peak (each task run alone, its ops one at a time"
        + (f"; {concurrent} task(s) under the default executor, median of {TASK_RUNS} runs)" if concurrent else ")")
    )
    return with_measurements(report, measured, method, process=process)
