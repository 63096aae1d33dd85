"""The cost model learns from the run: a cluster refined by measured steps.

Plain Python. A `Run` is what was predicted for one configuration (its
`PlanRow`) next to what `smp.profile` and a clock measured when it ran
(each task's duration, the gap between actions, the step's wall time).
`refine` turns runs into a new `ResourceGraph`:

* **device speed and per-op cost.** For the devices of each host and kind
  (the same cores, for logical devices), every task the profile measured
  is taken back to one device alone on one core (divided by how much the
  simulation stretched or, its ops running side by side, shrank it) and,
  less its predicted transfers and dispatch, fitted by least squares as
  ``slowdown * work + per_op * ops`` (`fit`): ``work`` the predicted
  seconds of its operations, ``ops`` the ops it runs. The profile gives
  each host's slowdown relative to the others'; the steps' wall-clock
  times give the level (a profile's probes slow its steps down: 1.6 times
  at ``t=2`` on logical CPU devices): every fitted slowdown and per-op
  cost is scaled by one factor, chosen so that the runs' steps, as the
  fitted figures would predict them, are what the clock measured (the
  median over runs; `_level`). The
  devices' speeds in every cost class and their streaming bandwidth are
  divided by their host's slowdown; their per-op overhead becomes the
  fitted one, scaled alike. A host and kind that ran nothing keeps its
  figures.
* **runtime.** ``action``: the median measured time from an action being
  ready to its start (`Timeline.measured_gap`).

Several runs are pooled (each device's ratio over all its tasks of all
runs; the runtime figures' medians). A second plan on the refined cluster
predicts from what this machine did, not from the calibration's small
kernels.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from smp_tf.planner.resources import COST_CLASSES, Device, ResourceGraph

__all__ = ["Run", "fit", "refine"]


@dataclass
class Run:
    """One configuration's prediction and measurement.

    Attributes:
        row: the `PlanRow` predicted for it (its ``devices``,
            ``task_elapsed`` and ``times``).
        task_seconds: ``(partition, wave)`` -> the measured seconds of one
            action (`Timeline.task_costs`).
        gap: the measured median gap between actions (seconds; None: not
            measured, e.g. one partition).
        span: the measured median span of the pipeline (seconds).
        step: the measured median wall time of a step (seconds).
    """

    row: Any
    task_seconds: Dict[Any, float]
    gap: Optional[float]
    span: Optional[float]
    step: Optional[float]


def _run_samples(run: Run, cluster: ResourceGraph) -> List[Tuple[Tuple[str, str], float, float, float]]:
    """Per measured task of `run`: (its device's host and kind, its predicted
    seconds of operations, its ops, its measured seconds less its predicted
    transfers and dispatch), each taken back to one device alone on one
    core (divided by how much the simulation stretched or, running its ops
    side by side on several cores, shrank the task)."""
    out = []
    P = run.row.candidate.partitions
    for key, seconds in run.task_seconds.items():
        key = tuple(key)
        parts = run.row.task_parts.get(key)
        alone = run.row.task_seconds.get(key)
        elapsed = run.row.task_elapsed.get(key)
        if parts is None or not alone or elapsed is None:
            continue
        stretch = elapsed / alone
        work, ops, fixed = parts
        d = cluster.device(run.row.devices[(0, key[0] % P)][0])
        out.append(((d.host, d.kind), work, float(ops), seconds / stretch - fixed))
    return out


def _samples(per_run: Sequence[List[Tuple[Tuple[str, str], float, float, float]]]
             ) -> Dict[Tuple[str, str], List[Tuple[float, float, float]]]:
    """(host, kind) -> (work, ops, measured) of every measured task of the
    runs (each run's `_run_samples`)."""
    out: Dict[Tuple[str, str], List[Tuple[float, float, float]]] = {}
    for samples in per_run:
        for group, work, ops, measured in samples:
            out.setdefault(group, []).append((work, ops, measured))
    return out


#: The largest per-op cost (seconds) a fit may give besides 20 times the
#: calibrated one: TensorFlow's executor spends microseconds per op, not
#: milliseconds.
PLAUSIBLE_PER_OP = 50e-6


def fit(samples: Sequence[Tuple[float, float, float]], overhead: float) -> Tuple[float, float]:
    """(slowdown of the operations, seconds per op) that best explain the
    samples ``(work, ops, measured)`` as ``slowdown * work + per_op * ops``
    (least squares); where that gives an implausible figure (a slowdown
    outside 0.25 to 4, a negative per-op cost or one above
    `PLAUSIBLE_PER_OP` plus 20 times `overhead`), the per-op overhead
    stays `overhead` and the slowdown is fitted alone."""
    sww = sum(w * w for w, _, _ in samples)
    soo = sum(o * o for _, o, _ in samples)
    swo = sum(w * o for w, o, _ in samples)
    swm = sum(w * m for w, _, m in samples)
    som = sum(o * m for _, o, m in samples)
    det = sww * soo - swo * swo
    if det > 1e-9 * sww * soo > 0:
        a = (swm * soo - som * swo) / det
        b = (som * sww - swm * swo) / det
        # Where work and op counts go together (few, similar tasks) the two
        # figures trade against each other: keep a fit only if it is plausible.
        if 0.25 <= a <= 4.0 and 0 <= b <= PLAUSIBLE_PER_OP + 20 * overhead:
            return a, b
    left = [(w, m - overhead * o) for w, o, m in samples]
    sw = sum(w * w for w, _ in left)
    a = sum(w * m for w, m in left) / sw if sw > 0 else 1.0
    return max(a, 1e-3), overhead


def _scaled(d: Device, slowdown: float, overhead: float) -> Device:
    return dataclasses.replace(
        d, flops={c: d.flops[c] / slowdown for c in COST_CLASSES}, overhead=overhead,
        bandwidth=d.bandwidth / slowdown if d.bandwidth else 0.0,
        # The fitted work counts these op types at their own speeds too.
        ops={t: v / slowdown for t, v in d.ops.items()})


def _level(runs: Sequence[Run], per_run: Sequence[List[Tuple[Tuple[str, str], float, float, float]]],
           fitted: Mapping[Tuple[str, str], Tuple[float, float]],
           overhead: Mapping[Tuple[str, str], float]) -> Optional[float]:
    """The factor on the fitted figures that makes the runs' steps what the
    clock measured: per run, (measured step - the runtime's cost of a step)
    over the predicted pipeline and update (what scales with the devices'
    speed) times how much the fitted figures change the run's tasks
    (``slowdown * work + per_op * ops`` over ``work + overhead * ops``,
    summed over them); the median over runs. None when no run has a
    measured step.

    A fit that puts more of a task's time on its ops and less on its
    operations changes what a candidate with more or fewer ops takes, not
    what these runs took: the level is set on the fitted figures together,
    not on the slowdown alone."""
    # The update is element-wise work without a per-op part: it scales with
    # the slowdown alone.
    slowdown = statistics.median(a for a, _ in fitted.values()) if fitted else 1.0
    ratios = []
    for r, samples in zip(runs, per_run):
        pipeline, update = r.row.times.get("pipeline", 0.0), r.row.times.get("update", 0.0)
        if not r.step or pipeline + update <= 0:
            continue
        was = now = fixed = 0.0
        for group, work, ops, _ in samples:
            if group in fitted:
                a, b = fitted[group]
                now += a * work + b * ops
                was += work + overhead[group] * ops
        for key in r.task_seconds:
            parts = r.row.task_parts.get(tuple(key))
            fixed += parts[2] if parts else 0.0
        if was <= 0 or now <= 0:
            continue
        # The share of the predicted pipeline the devices' figures scale
        # (the tasks' transfers and dispatch do not), and its part measured.
        scaled = pipeline * was / (was + fixed)
        measured = (r.step - r.row.times.get("step", 0.0) - r.row.times.get("allreduce", 0.0)
                    - r.row.times.get("dispatch", 0.0) - (pipeline - scaled))
        fitted_prediction = scaled * now / was + update * slowdown
        ratios.append(max(measured, 0.25 * (scaled + update)) / fitted_prediction)
    return statistics.median(ratios) if ratios else None


def refine(cluster: ResourceGraph, runs: Sequence[Run]) -> ResourceGraph:
    """The cluster with speeds and runtime costs learned from `runs` (module doc).

    Raises:
        ValueError: no run measured a task of a device of `cluster`.
    """
    if not runs:
        raise ValueError("refine needs at least one measured run (plan.measure records them).")
    # Each run's tasks taken back to one device alone, once: the fit and the
    # level both read them.
    per_run = [_run_samples(r, cluster) for r in runs]
    samples = _samples(per_run)
    if not samples:
        raise ValueError("No measured task belongs to a device of the cluster: profile a run of this plan.")
    overhead = {group: statistics.median(d.overhead for d in cluster.devices if (d.host, d.kind) == group)
                for group in samples}
    fitted = {group: fit(s, overhead[group]) for group, s in samples.items()}
    # The profile gives each host's speed relative to the others; the steps'
    # wall-clock times give the level (a profile's probes slow its steps).
    level = _level(runs, per_run, fitted, overhead)
    if level is not None:
        fitted = {g: (a * level, b * level) for g, (a, b) in fitted.items()}
    devices: List[Device] = []
    for d in cluster.devices:
        slowdown, per_op = fitted.get((d.host, d.kind), (1.0, d.overhead))
        devices.append(_scaled(d, slowdown, per_op))
    runtime = dict(cluster.runtime)
    gaps = [r.gap for r in runs if r.gap is not None]
    if gaps:
        runtime["action"] = statistics.median(gaps)
    return ResourceGraph(devices, dict(cluster.links), dict(cluster.pairs), source="learned", seconds=0.0,
                         cores=dict(cluster.cores), runtime=runtime)
