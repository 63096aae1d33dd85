"""What each device of the pipeline ran, and when: a measured timeline.

``with smp.profile(directory) as prof:`` records every pipelined step that
runs inside the block. A step traced while a profile is open times each of
its actions (one task of one micro-batch on one device) with
``tf.timestamp()`` on the action's device: the start once the action's
inputs are there and the device's previous action has finished, the end
once its outputs are computed. So the figures come from the runtime itself,
not from a model of it; they include the time an action waits for a
transfer only where that wait happens inside the action.

On exit the profile writes ``directory/timeline.json``, a Chrome trace (open
it in https://ui.perfetto.dev or ``chrome://tracing``; TensorBoard's profile
viewer reads the same format): one track per device, each action named as
in the schedule table (``F3``, ``B3``, ``FB3``). Where matplotlib is
installed it also writes ``directory/timeline.png``, a Gantt chart of one
step. `Timeline` holds the records and the figures derived from them: the
measured bubble (idle fraction of each device inside the step) and the
bubble the simulator predicts for the same schedule from the measured task
costs.

The pure part (`TaskRecord`, `Timeline`) is plain data; `profile` and
`emit_probes` are the runtime side.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from smp_tf.schedules.simulation import replay_makespan
from smp_tf.schedules.tasks import Action

__all__ = ["TaskRecord", "Timeline", "profile"]


@dataclass(frozen=True)
class TaskRecord:
    """One action of one measured step.

    Attributes:
        step: index of the step within the profile (0 is the first).
        device: the device that ran it (its number in the schedule).
        wave: the task's wave.
        microbatch: the micro-batch.
        name: its name in the schedule table (``F3``, ``B3``, ``FB3``...).
        start: start time in seconds (``tf.timestamp()``'s clock).
        end: end time in seconds.
        partition: the partition whose task it ran; None: the device's
            number (one partition per device).
    """

    step: int
    device: int
    wave: int
    microbatch: int
    name: str
    start: float
    end: float
    partition: Optional[int] = None

    def __post_init__(self) -> None:
        if self.partition is None:
            object.__setattr__(self, "partition", self.device)

    @property
    def duration(self) -> float:
        """``end - start`` in seconds."""
        return self.end - self.start


@dataclass
class Timeline:
    """The measured actions of the steps of a profile.

    Attributes:
        records: every action of every recorded step.
        schedule: the `Schedule` of the recorded steps (the last one seen
            when steps of several schedules were recorded), for the
            simulated bubble.
        device_names: device index -> the device's name.
    """

    records: List[TaskRecord] = field(default_factory=list)
    schedule: Any = None
    device_names: Dict[int, str] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        """Number of recorded steps."""
        return len({r.step for r in self.records})

    def step_records(self, step: int) -> List[TaskRecord]:
        """The actions of one step, by start time."""
        return sorted((r for r in self.records if r.step == step), key=lambda r: (r.start, r.device))

    def step_bubbles(self, step: int) -> Dict[int, float]:
        """Device -> its idle fraction inside `step`.

        The step spans from the first action's start to the last action's
        end over all devices; a device's idle time is that span less the
        time its actions ran.
        """
        recs = self.step_records(step)
        if not recs:
            raise ValueError(f"no recorded step {step}; recorded steps: {sorted({r.step for r in self.records})}")
        t0 = min(r.start for r in recs)
        span = max(r.end for r in recs) - t0
        out: Dict[int, float] = {}
        for d in sorted({r.device for r in recs}):
            busy = sum(r.duration for r in recs if r.device == d)
            out[d] = 1.0 - busy / span if span > 0 else 0.0
        return out

    def step_time(self, step: int) -> float:
        """Seconds from the first action's start to the last action's end."""
        recs = self.step_records(step)
        if not recs:
            raise ValueError(f"no recorded step {step}")
        return max(r.end for r in recs) - min(r.start for r in recs)

    def measured_bubble(self) -> float:
        """The pipeline's idle fraction, ``(D * span - busy) / (D * span)``
        over all devices, median over the recorded steps (the first step
        also counts: profile steps after a warm-up for steady figures)."""
        if not self.records:
            raise ValueError("the timeline has no records: no pipelined step ran inside the profile")
        per_step = []
        for s in sorted({r.step for r in self.records}):
            b = self.step_bubbles(s)
            per_step.append(sum(b.values()) / len(b))
        return statistics.median(per_step)

    def task_costs(self, statistic: str = "median") -> Dict[Tuple[int, int], float]:
        """``(partition, wave)`` -> duration of its actions (seconds).

        Args:
            statistic: ``"median"`` (default: robust to a slow first step,
                e.g. one that built the task functions) or ``"mean"`` (keeps
                each device's busy time, the sum of its actions' durations:
                where actions of a task run slower now and then, for example
                while another device shares the cores, the median
                understates it).
        """
        if statistic not in ("median", "mean"):
            raise ValueError(f"statistic must be 'median' or 'mean'. Received: {statistic!r}")
        reduce = statistics.median if statistic == "median" else statistics.mean
        by_task: Dict[Tuple[int, int], List[float]] = {}
        for r in self.records:
            by_task.setdefault((r.partition, r.wave), []).append(r.duration)
        return {k: reduce(v) for k, v in by_task.items()}

    def _deps(self) -> Dict[Tuple[int, int], Tuple[Tuple[int, int], ...]]:
        if self.schedule is None:
            raise ValueError("the timeline has no schedule: no pipelined step ran inside the profile")
        return {t.key: t.deps for t in self.schedule.tasks}

    def _device_queues(self, step: int) -> Dict[int, List[TaskRecord]]:
        """Device -> its records of step `step`, in the order they ran."""
        recs = self.step_records(step)
        if not recs:
            raise ValueError(f"no recorded step {step}; recorded steps: {sorted({r.step for r in self.records})}")
        queues: Dict[int, List[TaskRecord]] = {}
        for r in sorted(recs, key=lambda r: r.start):
            queues.setdefault(r.device, []).append(r)
        return queues

    def measured_gap(self) -> float:
        """Median time (seconds) from an action being ready to its start.

        An action is ready when its device's previous action of the step
        has ended and the actions it depends on (same micro-batch) have
        ended; the first action of a device with no dependency is left out.
        The gap is what the runtime takes between actions: dispatching the
        next call and handing it its inputs (a transfer, for an input from
        another device).
        """
        deps = self._deps()
        gaps = []
        for step in sorted({r.step for r in self.records}):
            queues = self._device_queues(step)
            end = {(r.partition, r.wave, r.microbatch): r.end for q in queues.values() for r in q}
            for q in queues.values():
                for k, r in enumerate(q):
                    waits = [q[k - 1].end] if k else []
                    waits += [end[(p, w, r.microbatch)] for p, w in deps.get((r.partition, r.wave), ())
                              if (p, w, r.microbatch) in end]
                    if waits:
                        gaps.append(max(0.0, r.start - max(waits)))
        if not gaps:
            raise ValueError("the timeline has no action that waited for another: no gap to measure")
        return statistics.median(gaps)

    def replayed_span(self, step: int) -> float:
        """Step `step`'s span if every action had started as soon as it was
        ready, each taking its own recorded duration (seconds).

        Against `step_time(step)` it tells what the time between actions
        costs; against `simulated()` what the spread of the durations does.
        """
        deps = self._deps()
        order, duration = {}, {}
        for d, q in self._device_queues(step).items():
            order[d] = [Action(r.partition, r.wave, r.microbatch) for r in q]
            duration.update(zip(order[d], (r.duration for r in q)))
        try:
            return replay_makespan(order, deps, duration)
        except ValueError:
            raise ValueError(f"step {step}: the recorded actions wait on each other in a cycle") from None

    def simulated(self, gap: float = 0.0, statistic: str = "median"):
        """The simulator's run of the recorded schedule with the measured
        task costs (a `Simulation`).

        Args:
            gap: seconds from an action being ready to its start (see
                `smp_tf.schedules.simulate`); 0 (default) counts dispatch and
                transfers as free, `measured_gap()` counts them as measured.
            statistic: how each task's cost is taken from its actions'
                durations (see `task_costs`).
        """
        if self.schedule is None:
            raise ValueError("the timeline has no schedule: no pipelined step ran inside the profile")
        return self.schedule.simulate(self.task_costs(statistic), gap=gap)

    def simulated_bubble(self) -> float:
        """The bubble the simulator predicts from the measured task costs."""
        return self.simulated().bubble

    def summary(self) -> str:
        """A short table: per device, busy and idle time of the median step,
        and the measured against the simulated bubble."""
        steps = sorted({r.step for r in self.records})
        if not steps:
            return "smp_tf timeline: no pipelined step ran inside the profile"
        times = {s: self.step_time(s) for s in steps}
        median_step = sorted(steps, key=lambda s: times[s])[len(steps) // 2]
        bubbles = self.step_bubbles(median_step)
        lines = [
            f"smp_tf timeline: {len(steps)} step(s); median step {times[median_step] * 1e3:.2f} ms "
            f"(step {median_step})",
            f"{'device':>6} {'busy ms':>9} {'idle':>7}  name",
        ]
        span = times[median_step]
        for d, b in bubbles.items():
            lines.append(f"{d:>6} {(1 - b) * span * 1e3:>9.2f} {b:>7.1%}  {self.device_names.get(d, '')}")
        lines.append(f"bubble: measured {self.measured_bubble():.1%}, simulated from measured task costs "
                     f"{self.simulated_bubble():.1%}")
        return "\n".join(lines)

    def chrome_trace(self) -> Dict[str, Any]:
        """The records as a Chrome trace (``traceEvents``; microseconds from
        the first recorded action): one thread per device, one complete
        event per action."""
        events: List[Dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "smp_tf pipeline"}}
        ]
        t0 = min((r.start for r in self.records), default=0.0)
        for d in sorted({r.device for r in self.records} | set(self.device_names)):
            label = f"device {d}" + (f" ({self.device_names[d]})" if d in self.device_names else "")
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": label}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d, "args": {"sort_index": d}})
        for r in sorted(self.records, key=lambda r: (r.start, r.device)):
            events.append({
                "name": r.name, "cat": r.name.rstrip("0123456789w") or "task", "ph": "X", "pid": 0, "tid": r.device,
                "ts": (r.start - t0) * 1e6, "dur": max(r.duration, 0.0) * 1e6,
                "args": {"step": r.step, "microbatch": r.microbatch, "partition": r.partition, "wave": r.wave},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, directory: str, png: bool = True) -> List[str]:
        """Writes ``timeline.json`` and, with matplotlib, ``timeline.png``.

        Returns:
            The paths written.
        """
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "timeline.json")
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        written = [path]
        if png and self.records:
            image = self.plot(os.path.join(directory, "timeline.png"))
            if image is not None:
                written.append(image)
        return written

    def plot(self, path: str, step: Optional[int] = None) -> Optional[str]:
        """A Gantt chart of one step (the median one by default) as a PNG.

        Returns:
            `path`, or None where matplotlib is not installed.
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        steps = sorted({r.step for r in self.records})
        if step is None:
            times = {s: self.step_time(s) for s in steps}
            step = sorted(steps, key=lambda s: times[s])[len(steps) // 2]
        recs = self.step_records(step)
        t0 = min(r.start for r in recs)
        devices = sorted({r.device for r in recs})
        colors = {"F": "#4c72b0", "B": "#dd8452", "FB": "#8172b2", "W": "#55a868"}
        fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(recs)), 0.6 * len(devices) + 1.2))
        for r in recs:
            kind = r.name.rstrip("0123456789w")
            ax.barh(r.device, r.duration * 1e3, left=(r.start - t0) * 1e3, height=0.8,
                    color=colors.get(kind, "#999999"), edgecolor="white")
            ax.text((r.start - t0 + r.duration / 2) * 1e3, r.device, r.name, ha="center", va="center", fontsize=7,
                    color="white")
        ax.set_yticks(devices)
        ax.set_yticklabels([f"device {d}" for d in devices])
        ax.invert_yaxis()
        ax.set_xlabel("ms from the step's first action")
        bubbles = self.step_bubbles(step)
        ax.set_title(f"step {step}: {self.step_time(step) * 1e3:.1f} ms, bubble "
                     f"{sum(bubbles.values()) / len(bubbles):.1%}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


# ---------------------------------------------------------------------------
# Runtime side
# ---------------------------------------------------------------------------
_LOCK = threading.Lock()
_ACTIVE: Optional["profile"] = None
#: Compiled-step metadata by id, for the records of its probes.
_STEPS: Dict[int, Tuple[Any, List[Tuple[int, int, int, str]], Dict[int, str]]] = {}


def recording() -> bool:
    """Whether a profile is open: steps traced now carry timing probes."""
    return _ACTIVE is not None


def register(
    schedule: Any, actions: Sequence[Tuple[int, int, int, int, str]], device_names: Mapping[int, str]
) -> int:
    """Registers the probes of one emitted step; returns its id.

    Args:
        schedule: the step's `Schedule`.
        actions: ``(device, partition, wave, microbatch, name)`` of every
            probed action, in emission order.
        device_names: device number -> device name.
    """
    with _LOCK:
        key = len(_STEPS)
        _STEPS[key] = (schedule, list(actions), dict(device_names))
    return key


def collect(key: int, stamps: Any) -> None:
    """Called by a step's probes with ``[n_actions, 2]`` start/end times."""
    prof = _ACTIVE
    if prof is None:
        return
    schedule, actions, names = _STEPS[key]
    values = stamps.numpy() if hasattr(stamps, "numpy") else stamps
    with _LOCK:
        step = prof._steps
        prof._steps += 1
        for (device, partition, wave, m, name), (start, end) in zip(actions, values):
            prof.timeline.records.append(TaskRecord(step, device, wave, m, name, float(start), float(end), partition))
        prof.timeline.schedule = schedule
        prof.timeline.device_names.update(names)


class profile:
    """Records the pipelined steps that run inside it; writes the timeline.

    ::

        with smp.profile("logs/timeline") as prof:
            for x, y in batches:
                train(x, y)
        print(prof.timeline.summary())

    Steps traced while the profile is open carry timing probes (a
    ``tf.function`` traced before it has none: trace, or first call, the
    training function inside the block; Keras ``fit``/``evaluate``/
    ``predict`` of a `smp_tf.DistributedModel` retrace by themselves). A
    probed step traced inside a profile keeps its probes afterwards, and
    they are recorded only while a profile is open.

    Args:
        directory: where ``timeline.json`` (and ``timeline.png``) go; None
            writes nothing.
        png: also write the PNG Gantt chart when matplotlib is installed.

    Attributes:
        timeline: the `Timeline` of the recorded steps.
        files: the paths written on exit.
    """

    def __init__(self, directory: Optional[str] = None, png: bool = True) -> None:
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"smp.profile(directory=...) takes a path or None, got {directory!r}")
        self.directory = None if directory is None else os.fspath(directory)
        self.png = bool(png)
        self.timeline = Timeline()
        self.files: List[str] = []
        self._steps = 0

    def __enter__(self) -> "profile":
        global _ACTIVE
        from tensorflow.python.framework import config as tf_config

        if tf_config.is_op_determinism_enabled():
            # TensorFlow's clock op refuses to run under op determinism.
            raise RuntimeError(
                "smp.profile times each action with tf.timestamp(), which TensorFlow refuses to run while op "
                "determinism is enabled (TF_DETERMINISTIC_OPS=1 or tf.config.experimental.enable_op_determinism()). "
                "Profile a run without op determinism."
            )
        with _LOCK:
            if _ACTIVE is not None:
                raise RuntimeError("smp.profile is already open; profiles do not nest. Close the other one first.")
            _ACTIVE = self
        _reset_keras_functions()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        with _LOCK:
            _ACTIVE = None
        _reset_keras_functions()
        if self.directory is not None:
            self.files = self.timeline.save(self.directory, png=self.png)


def _reset_keras_functions() -> None:
    """Makes every `DistributedModel` retrace its Keras functions, so that
    ``fit`` inside a profile carries probes and outside it does not."""
    # The registry of `DistributedModel`s lives with the placement, which
    # the Keras model imports (not the other way round).
    from smp_tf import placement

    for m in placement.live_models():
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)


#: device -> a variable that only anchors that device's probes (see `emit_probe`).
_ANCHORS: Dict[str, Any] = {}
_PROBE_FN: Any = None


def emit_probe(deps: Sequence[Any], device: str):
    """A ``tf.timestamp()`` on `device` that runs after `deps`.

    Inside a ``tf.function``, TensorFlow's automatic control dependencies
    chain every stateful op that takes no resource (``Timestamp`` is one)
    in program order, across devices: raw timestamps would make the devices
    take turns. So the clock is read in a small function that takes a
    device-local resource it never touches: a read of that resource, which
    nothing writes, is ordered with nothing.
    """
    import tensorflow as tf

    global _PROBE_FN
    if _PROBE_FN is None:
        @tf.function(input_signature=[tf.TensorSpec([], tf.resource)], autograph=False)
        def probe(anchor):
            del anchor
            return tf.timestamp()

        _PROBE_FN = probe
    anchor = _ANCHORS.get(device)
    if anchor is None:
        with tf.init_scope(), tf.device(device):
            anchor = _ANCHORS[device] = tf.Variable(0.0, trainable=False, name="smp_timeline_anchor")
    with tf.device(device), tf.control_dependencies([d for d in deps if d is not None]):
        return _PROBE_FN(anchor.handle)


def emit_collect(key: int, starts: Sequence[Any], ends: Sequence[Any]) -> Any:
    """Sends every action's times to `collect` once per step."""
    import tensorflow as tf

    stamps = tf.stack([tf.stack([s, e]) for s, e in zip(starts, ends)])
    return tf.py_function(lambda t: collect(key, t) or 0, [stamps], tf.int32, name="smp_timeline")
