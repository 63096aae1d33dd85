"""The cost model learns from the run: a cluster refined by measured steps.

Plain Python. A `Run` is what was predicted for one configuration (its
`PlanRow`) next to what `smp.profile` and a clock measured when it ran
(each task's duration, the gap between actions, the step's wall time).
`refine` turns runs into a new `ResourceGraph`:

* **device speed.** For every device that ran tasks, the ratio of the
  measured to the predicted seconds of those tasks (summed over the tasks,
  so long tasks weigh more; predicted as the simulation ran them, so a
  device slowed by sharing cores is not counted slow twice). The device's
  speed in every cost class and its streaming bandwidth are divided by
  that ratio, its per-op overhead multiplied. A device of a host that ran
  nothing takes the median ratio of its host's devices of its kind.
* **runtime.** ``action``: the median measured time from an action being
  ready to its start (`Timeline.measured_gap`). ``step``: the measured
  wall time of a step less its pipeline's measured span and the predicted
  optimizer update: what the runtime spends outside the pipeline.

Several runs are pooled (each device's ratio over all its tasks of all
runs; the runtime figures' medians). A second plan on the refined cluster
predicts from what this machine did, not from the calibration's small
kernels.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from smp_tf.planner.resources import COST_CLASSES, Device, ResourceGraph

__all__ = ["Run", "refine"]


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


def device_ratios(runs: Sequence[Run], action: float = 0.0) -> Dict[str, float]:
    """Device name -> measured / predicted seconds of its tasks (module doc);
    `action`: the runtime's cost per action the prediction included, which
    a measured task does not (it is the gap before it)."""
    measured: Dict[str, float] = {}
    predicted: Dict[str, float] = {}
    for run in runs:
        P = run.row.candidate.partitions
        for key, seconds in run.task_seconds.items():
            expected = run.row.task_elapsed.get(tuple(key))
            if expected is None:
                continue
            # The runtime's own cost per action is learned apart.
            expected = max(expected - action, 1e-12)
            for name in run.row.devices[(0, key[0] % P)]:
                measured[name] = measured.get(name, 0.0) + seconds
                predicted[name] = predicted.get(name, 0.0) + expected
    return {n: measured[n] / predicted[n] for n in measured if predicted[n] > 0}


def _scaled(d: Device, ratio: float) -> Device:
    return dataclasses.replace(
        d, flops={c: d.flops[c] / ratio for c in COST_CLASSES}, overhead=d.overhead * ratio,
        bandwidth=d.bandwidth / ratio if d.bandwidth else 0.0)


def refine(cluster: ResourceGraph, runs: Sequence[Run]) -> ResourceGraph:
    """The cluster with speeds and runtime costs learned from `runs` (module doc).

    Raises:
        ValueError: no run measured a task of a device of `cluster`.
    """
    if not runs:
        raise ValueError("refine needs at least one measured run (plan.measure records them).")
    ratios = device_ratios(runs, cluster.runtime.get("action", 0.0))
    if not ratios:
        raise ValueError("No measured task belongs to a device of the cluster: profile a run of this plan.")
    devices: List[Device] = []
    for d in cluster.devices:
        ratio = ratios.get(d.name)
        if ratio is None:
            peers = [r for n, r in ratios.items() if cluster.device(n).host == d.host and cluster.device(n).kind == d.kind]
            ratio = statistics.median(peers) if peers else 1.0
        devices.append(_scaled(d, ratio))
    runtime = dict(cluster.runtime)
    gaps = [r.gap for r in runs if r.gap is not None]
    if gaps:
        runtime["action"] = statistics.median(gaps)
    outside = [max(r.step - r.span - r.row.times.get("update", 0.0), 0.0)
               for r in runs if r.step is not None and r.span is not None]
    if outside:
        runtime["step"] = statistics.median(outside)
    return ResourceGraph(devices, dict(cluster.links), dict(cluster.pairs), source="learned", seconds=0.0,
                         cores=dict(cluster.cores), runtime=runtime)
