"""`smp.plan`: the whole configuration chosen for a step and a cluster.

The step is traced once per micro-batch size the candidates need (and once
more per tensor-parallel degree, sharded); `smp_tf.planner.search` predicts
every candidate's step time and every device's peak on the cluster and
ranks them. `Plan.measure` runs the best few for a few steps each and keeps
the fastest measured one. With ``probe=True`` the planner first runs two
candidates, the one that runs the most ops per step and the one device
alone, and fits the runtime's cost per op run and the share of its ops'
parallelism a device realizes to their measured steps (`Probe`), then
predicts every candidate again with them. The config key
``auto`` applies the best plan at a step's first call (`apply_auto`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import types
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import tensorflow as tf

from smp_tf.planner.resources import ResourceGraph
from smp_tf.planner.search import (
    HEADROOM,
    GraphInfo,
    interpolate_graph,
    PlanRow,
    SearchResult,
    Skipped,
    candidates,
    predict_time,
    scale_sharded,
    search,
)

__all__ = ["Plan", "Probe", "plan", "probe_row", "one_device_row", "fit_probe", "apply_auto", "profile_run",
           "time_step"]

#: Search dimensions `plan` accepts as keyword arguments (each a sequence of
#: values to try), passed to `smp_tf.planner.search.candidates`.
SEARCH_DIMENSIONS = ("partitions", "tensor_parallel_degrees", "replicas", "microbatches", "pipelines",
                     "virtual_stages", "recompute", "max_stages", "use_all")


@dataclasses.dataclass
class Probe:
    """What ``smp.plan(..., probe=True)`` measured of the step.

    Attributes:
        label: the candidate that runs the most ops (`probe_row`).
        config: its config.
        measured: its measured seconds per step (the least of the rounds'
            medians).
        predicted: its predicted seconds per step before the probe.
        ops_run: the ops it runs per step (`PlanRow.ops_run`).
        dispatch: the runtime's seconds per op run fitted to the two
            measured steps (the cluster's ``runtime["dispatch"]`` the plan
            was predicted again with).
        parallel: the share of a task's ops' parallelism a device
            realizes, fitted likewise (``runtime["parallel"]``; 1 when no
            one-device candidate fits).
        one_device: the one-device candidate (None when none fits).
        one_device_measured, one_device_predicted: its measured seconds
            per step, and its prediction before the probe.
        seconds: how long the probe took (compiles included).
    """

    label: str
    config: Dict[str, Any]
    measured: float
    predicted: float
    ops_run: int
    dispatch: float
    parallel: float
    one_device: Optional[str]
    one_device_measured: Optional[float]
    one_device_predicted: Optional[float]
    seconds: float

    def summary(self) -> str:
        """One line: what was measured against its prediction, and the
        figures fitted."""
        one = (f"{self.one_device} {self.one_device_measured * 1e3:.2f} ms (predicted "
               f"{self.one_device_predicted * 1e3:.2f}); " if self.one_device is not None else "")
        return (f"{self.label} measured {self.measured * 1e3:.2f} ms (predicted {self.predicted * 1e3:.2f}, "
                f"{self.ops_run} ops run), {one}fitted: dispatch {self.dispatch * 1e6:.2f} us per op run, "
                f"parallel share {self.parallel:.2f}")


def probe_row(rows: Sequence[PlanRow]) -> PlanRow:
    """The candidate a probe runs for the cost per op: of the fitting
    single-replica rows on more than one device (the cost shows where
    devices run at once; the one device alone is `one_device_row`'s), or
    of all fitting single-replica rows if none is, the one that runs the
    most ops per step (the most micro-batches, on the most tensor-parallel
    shards), of those the one with the fewest actions (the plainest
    schedule, the fewest costs beside the ops), then the fastest predicted.

    Raises:
        ValueError: no fitting single-replica row.
    """
    fitting = [r for r in rows if r.fits and r.replicas == 1]
    if not fitting:
        raise ValueError("No fitting single-replica candidate to probe: give more devices or memory.")
    several = [r for r in fitting if r.candidate.devices > 1] or fitting
    return max(several, key=lambda r: (r.ops_run, -len(r.task_seconds) * r.candidate.microbatches, -r.step_time))


def one_device_row(rows: Sequence[PlanRow]) -> Optional[PlanRow]:
    """The candidate a probe runs for the ops' parallelism: one device
    alone (one stage, ``t=1``, one replica), fitting; the fastest predicted
    of those (None when none fits)."""
    alone = [r for r in rows if r.fits and r.candidate.devices == 1]
    return min(alone, key=lambda r: r.step_time, default=None)


def fit_probe(predict: Callable[[PlanRow, float, float], float], many: PlanRow, many_measured: float,
              one: Optional[PlanRow], one_measured: Optional[float], rounds: int = 4) -> Tuple[float, float]:
    """(seconds per op run, share of the ops' parallelism) that make the
    predictions of the two probed rows their measured steps.

    `predict(row, dispatch, parallel)` predicts a row's step with those
    runtime figures. The share is fitted to the one-device row (which the
    ops' parallelism speeds up most, its device having the host's cores to
    itself), the cost per op to the row that runs the most ops, in turn
    (each moves the other row a little); a step faster than its prediction
    at no cost per op, or at the whole parallelism, gives 0 and 1. Without
    a one-device row the share stays 1.
    """
    dispatch, share = 0.0, 1.0
    for _ in range(rounds):
        if one is not None and one_measured is not None:
            # The prediction falls as the share grows: bisect on it.
            lo, hi = 0.0, 1.0
            if predict(one, dispatch, 1.0) >= one_measured:
                share = 1.0
            elif predict(one, dispatch, 0.0) <= one_measured:
                share = 0.0
            else:
                for _ in range(20):
                    mid = (lo + hi) / 2
                    if predict(one, dispatch, mid) > one_measured:
                        lo = mid
                    else:
                        hi = mid
                share = (lo + hi) / 2
        rest = predict(many, 0.0, share)
        dispatch = max(many_measured - rest, 0.0) / many.ops_run if many.ops_run else 0.0
        if one is None:
            break
    return dispatch, share


class Plan:
    """The ranked candidates of `smp.plan`.

    Attributes:
        rows: `PlanRow`s best first: those predicted to fit by predicted
            step time, then those predicted not to fit. Each has
            ``config`` (the dict for `smp.init`), ``step_time`` (predicted
            seconds per step), ``peak`` (predicted bytes per device),
            ``fits`` and, after `measure`, ``measured``.
        skipped: the candidates not ranked, each with its reason.
        cluster: the `ResourceGraph` planned for.
        search_seconds: the search's time (tracing included).
        trace_seconds: the part of it spent tracing the step.
        chosen: the row `measure` picked (None before).
        probe: what ``probe=True`` measured (a `Probe`; None without).
    """

    def __init__(self, result: SearchResult, cluster: ResourceGraph, step: Any, args: tuple, kwargs: dict,
                 trace_seconds: float, batch_size: int):
        self.rows: List[PlanRow] = result.rows
        self.skipped: List[Skipped] = result.skipped
        self.cluster = cluster
        self.search_seconds = result.seconds
        self.trace_seconds = trace_seconds
        self.evaluated = result.evaluated
        self.batch_size = batch_size
        self.chosen: Optional[PlanRow] = None
        self.probe: Optional[Probe] = None
        #: What `measure` measured of each row it ran (`smp_tf.planner.learn.Run`).
        self.runs: List[Any] = []
        self._step, self._args, self._kwargs = step, args, kwargs
        #: Tokens per sample when the inputs are sequences (`sequence_length`).
        self.sequence_length: Optional[int] = sequence_length(args, kwargs)
        speed = {d.name: d.flops.get("matmul", 0.0) for d in cluster.devices}
        for row in self.rows:
            used = {name for names in row.devices.values() for name in names}
            row.set_throughput(batch_size, self.sequence_length, sum(speed.get(n, 0.0) for n in used))

    @property
    def best(self) -> PlanRow:
        """The chosen row after `measure`, else the first row that fits.

        Raises:
            ValueError: no candidate is predicted to fit.
        """
        if self.chosen is not None:
            return self.chosen
        for row in self.rows:
            if row.fits:
                return row
        worst = min(self.rows, key=lambda r: r.max_peak, default=None)
        detail = "" if worst is None else (
            f" The smallest predicted peak is {worst.max_peak / 2**20:.1f} MiB ({worst.candidate.label()}).")
        raise ValueError("No candidate is predicted to fit the devices' memory." + detail +
                         " Give more devices, a smaller batch, or allow more partitions or recomputation.")

    def measure(self, k: int = 3, steps: int = 5, warmup: int = 2, profile: bool = True, rounds: int = 2) -> PlanRow:
        """Runs the best `k` fitting rows for a few steps each and picks the
        fastest measured one.

        Each row's config is given to `smp.init` (so this process needs the
        row's ``P * t`` devices; rows with several replicas need one process
        each and are passed over), the step runs `warmup` untimed and
        `steps` timed times on the planned arguments; that is one round.
        The rows are measured in `rounds` rounds, in alternating order, and
        ``row.measured`` is the least of a row's rounds' medians: a burst of
        other work on the machine (or the first compile of a process) slows
        one round, not all, and only ever slows. With `profile`, two more
        steps of each row's last round run inside `smp.profile` and their
        timeline is kept in ``plan.runs``, for `learned` (not under op
        determinism, where the profile's clock cannot run). The step's
        gradients are not applied; state the step itself writes (BatchNorm
        statistics) does change. Afterwards `smp.init` is left with the
        chosen row's config.

        Returns:
            The chosen row (also ``plan.chosen`` and ``plan.best``).
        """
        from smp_tf import state

        if k < 1 or steps < 1 or warmup < 0 or rounds < 1:
            raise ValueError(f"measure needs k >= 1, steps >= 1, warmup >= 0 and rounds >= 1. Received: k={k}, "
                             f"steps={steps}, warmup={warmup}, rounds={rounds}")
        if self._step is None:
            raise ValueError("This plan has no step to run (it was built from graphs): measure needs smp.plan's.")
        rows = [r for r in self.rows if r.fits and r.replicas == 1][:k]
        if not rows:
            raise ValueError("No fitting single-replica candidate to measure.")
        for n, row in _rounds(rows, rounds):
            state.init(row.config)
            t = time_step(self._step, self._args, self._kwargs, steps, warmup)
            row.measured = t if n == 0 else min(row.measured, t)
            if profile and n == rounds - 1:
                run = profile_run(row, self._step, self._args, self._kwargs)
                if run is not None:
                    self.runs.append(run)
        self.chosen = min(rows, key=lambda r: r.measured)
        state.init(self.chosen.config)
        return self.chosen

    def learned(self) -> ResourceGraph:
        """The cluster refined by what `measure` measured
        (`smp_tf.planner.learn.refine`): plan again on it
        (``smp.plan(..., cluster=plan.learned())``) for predictions from
        this machine's own steps.

        Raises:
            ValueError: nothing was measured yet.
        """
        from smp_tf.planner.learn import refine

        return refine(self.cluster, self.runs)

    def table(self, limit: int = 20) -> str:
        """The plan as a table: the best `limit` rows, then how many were
        skipped and for which reasons."""
        lines = [
            f"Plan: {len(self.cluster.devices)} device(s) on {len(self.cluster.hosts)} host(s), batch "
            f"{self.batch_size}; {self.evaluated} candidates predicted in {self.search_seconds:.1f} s "
            f"(tracing {self.trace_seconds:.1f} s); {sum(r.fits for r in self.rows)} fit",
            f"{'rank':>4}  {'P':>3} {'t':>2} {'R':>3} {'M':>4}  {'pipeline':<11} {'v':>2}  {'recompute':<9}  "
            f"{'shard':<6}  {'step ms':>9}  {'measured':>9}  {'samples/s':>10}  "
            + (f"{'tokens/s':>10}  " if self.sequence_length else "")
            + f"{'MFU':>6}  {'peak MiB':>9}  {'of MiB':>8}  fits",
        ]
        for n, row in enumerate(self.rows[:limit]):
            c = row.candidate
            cap = max(row.capacity.values(), default=0)
            measured = f"{row.measured * 1e3:9.2f}" if row.measured is not None else f"{'-':>9}"
            mark = " <" if row is self.chosen else ""
            lines.append(
                f"{n + 1:>4}  {c.partitions:>3} {c.tensor_parallel_degree:>2} {c.replicas:>3} {c.microbatches:>4}  "
                f"{c.pipeline:<11} {c.virtual_stages:>2}  {c.recompute:<9}  "
                f"{_sharding(c):<6}  {row.step_time * 1e3:9.2f}  {measured}  "
                f"{_rate(row.samples_per_second)}  "
                + (f"{_rate(row.tokens_per_second or 0.0)}  " if self.sequence_length else "")
                + f"{100 * row.mfu:5.1f}%  "
                f"{row.max_peak / 2**20:9.1f}  {(cap / 2**20 if cap else 0):8.0f}  {'yes' if row.fits else 'NO'}{mark}")
        if len(self.rows) > limit:
            lines.append(f"... {len(self.rows) - limit} more row(s) in plan.rows")
        if self.skipped:
            kinds: Dict[str, List[Skipped]] = {}
            for s in self.skipped:
                kinds.setdefault(s.kind, []).append(s)
            lines.append(f"skipped {len(self.skipped)} candidate(s) (plan.skipped):")
            for kind, items in sorted(kinds.items(), key=lambda x: -len(x[1])):
                lines.append(f"  {len(items):>5} {_KINDS.get(kind, kind)}; e.g. {items[0].candidate.label()}: "
                             f"{items[0].reason[:100]}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _rate(per_second: float) -> str:
    """A rate in 10 characters: 3 significant digits, k/M/G above 1000."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= scale:
            return f"{per_second / scale:9.3g}{unit}"
    return f"{per_second:10.3g}"

    def __repr__(self) -> str:
        best = next((r for r in self.rows if r.fits), None)
        return f"<Plan {len(self.rows)} rows, best {best.candidate.label() if best else None}>"


def sequence_length(args: tuple, kwargs: dict) -> Optional[int]:
    """The tokens per sample of a step's example arguments: the second
    dimension of the first integer argument of rank 2 (token ids), or None
    when no argument is one."""
    for leaf in tf.nest.flatten((args, kwargs)):
        shape = getattr(leaf, "shape", None)
        dtype = getattr(leaf, "dtype", None)
        if shape is None or dtype is None or len(shape) != 2:
            continue
        if tf.as_dtype(dtype).is_integer and shape[1] is not None:
            return int(shape[1])
    return None


#: How the table names each class of skipped candidates.
_KINDS = {
    "slower": "predicted slower than the ranked rows (memory not predicted)",
    "bound": "slower than the ranked rows by a lower bound of their time (not predicted)",
    "memory": "cannot fit (variables and optimizer state alone)",
    "devices": "need more devices than the cluster has",
    "batch": "batch not divisible",
    "trace": "tracing failed",
    "invalid": "not possible on this graph",
    "recompute": "recompute, shard_optimizer_state or sequence_parallel where the same candidate fits without "
                 "(they only add time)",
}


def time_step(step: Any, args: tuple, kwargs: dict, steps: int, warmup: int) -> float:
    """The median seconds of `steps` calls of `step` after `warmup` calls."""
    def run() -> None:
        out = step(*args, **kwargs)
        for leaf in tf.nest.flatten(out, expand_composites=True):
            if hasattr(leaf, "numpy"):
                leaf.numpy()
                break

    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_run(row: PlanRow, step: Any, args: tuple, kwargs: dict, steps: int = 2) -> Any:
    """Runs `steps` steps of the current config inside `smp.profile` and
    returns the `smp_tf.planner.learn.Run` of `row`: its tasks' measured
    durations, the gap between actions, the pipeline's span and (from
    ``row.measured``) the step's wall time. None under op determinism,
    where TensorFlow's clock op (which the profile reads) refuses to run."""
    from tensorflow.python.framework import config as tf_config

    from smp_tf.planner.learn import Run
    from smp_tf.profiling.timeline import profile

    if tf_config.is_op_determinism_enabled():
        return None

    with profile() as prof:
        for _ in range(steps):
            time_step(step, args, kwargs, 1, 0)
    tl = prof.timeline
    if not tl.records:
        return Run(row, {}, None, None, row.measured)
    numbers = sorted({r.step for r in tl.records})
    try:
        gap: Optional[float] = tl.measured_gap()
    except ValueError:  # one action per device: nothing waited
        gap = None
    return Run(row, tl.task_costs(), gap, statistics.median(tl.step_time(n) for n in numbers), row.measured)


# ---------------------------------------------------------------------------
# Tracing


class _Tracer:
    """The step's graph at each micro-batch size (and tensor-parallel
    degree) a candidate needs.

    The step is traced at two anchor sizes, the two largest needed; every
    other size is extrapolated from them
    (`smp_tf.planner.search.interpolate_graph`), or traced where that is
    not possible. (At the largest sizes a graph is most alike to others: at
    a micro-batch of 1 or 2 TensorFlow may fold a constant it keeps at 32,
    which costs nothing.) With ``t > 1`` only the larger anchor is
    sharded; every other size scales it as the unsharded graphs scale
    (`smp_tf.planner.search.scale_sharded`), or is sharded where that is
    not possible.
    """

    def __init__(self, step: Any, args: tuple, kwargs: dict, batch_size: int, layout_map: Any,
                 sizes: Sequence[int] = ()):
        self.step, self.args, self.kwargs, self.batch_size = step, args, kwargs, batch_size
        self.layout_map = layout_map
        self.seconds = 0.0
        self.traces = 0
        self._traced: Dict[int, Any] = {}
        self._infos: Dict[Tuple[int, int], GraphInfo] = {}
        sizes = sorted(set(sizes))
        self.anchors = (sizes[-2], sizes[-1]) if len(sizes) > 1 else None

    def _trace(self, b: int) -> Any:
        from smp_tf.trace import trace_microbatch

        traced = self._traced.get(b)
        if traced is None:
            mbs = self.step._split(self.args, self.kwargs, self.batch_size // b)
            traced = self._traced[b] = trace_microbatch(
                self.step._fn, mbs[0][0], mbs[0][1], shapes=self.step._trace_shapes(mbs),
                tf_function_kwargs=self.step._tf_kwargs)
            self.traces += 1
        return traced

    def _traced_info(self, b: int, t: int, sequence_parallel: bool = False) -> GraphInfo:
        traced = self._trace(b)
        if t == 1:
            return GraphInfo(traced.op_graph, [x for x in traced.output_tensors() if x is not None])
        from smp_tf.sharding.api import shard_step
        from smp_tf.sharding.lower import shard_of_ops

        cfg = types.SimpleNamespace(tensor_parallel_degree=t, layout_map=self.layout_map,
                                    sequence_parallel=sequence_parallel)
        sharded, shard_plan = shard_step(traced, cfg, None)
        return GraphInfo(sharded.op_graph, [x for x in sharded.output_tensors() if x is not None],
                         shard_of_ops(sharded.graph_def, sharded.op_graph), sorted(shard_plan.stored_split))

    def __call__(self, b: int, t: int, sequence_parallel: bool = False) -> GraphInfo:
        key = (b, t, True) if sequence_parallel else (b, t)
        if key in self._infos:
            return self._infos[key]
        t0 = time.perf_counter()
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            info = None
            if self.anchors is not None and t > 1 and b != self.anchors[1]:
                # Sharded once, at the larger anchor: the other sizes scale
                # it as the unsharded graphs scale (`scale_sharded`).
                hi = self(self.anchors[1], t, sequence_parallel)
                graph = scale_sharded(hi.graph, self(self.anchors[1], 1).graph, self(b, 1).graph)
                if graph is not None:
                    info = GraphInfo(graph, hi.outputs, hi.shard_of_op, hi.split_variables, structure=hi.graph)
            if info is None and sequence_parallel:
                info = self._traced_info(b, t, True)
            elif info is None and self.anchors is not None and b == self.anchors[0]:
                # The smaller anchor shares the larger one's split and tasks
                # when their ops are the same.
                lo, hi = self._traced_info(b, t), self(self.anchors[1], t)
                same = len(lo.graph.ops) == len(hi.graph.ops) and all(
                    x.name == y.name and x.type == y.type for x, y in zip(lo.graph.ops, hi.graph.ops))
                info = dataclasses.replace(lo, structure=hi.graph) if same and lo.outputs == hi.outputs else lo
            elif info is None and self.anchors is not None and b not in self.anchors:
                lo, hi = (self(a, t) for a in self.anchors)
                graph = interpolate_graph(lo.graph, self.anchors[0], hi.graph, self.anchors[1], b)
                if graph is not None and lo.outputs == hi.outputs and lo.shard_of_op == hi.shard_of_op:
                    info = GraphInfo(graph, lo.outputs, lo.shard_of_op, lo.split_variables, structure=hi.graph)
            if info is None:
                info = self._traced_info(b, t)
            self._infos[key] = info
            return info
        finally:
            self._depth -= 1
            if not self._depth:  # the anchors' own calls are inside this one
                self.seconds += time.perf_counter() - t0


def _sharding(c: Any) -> str:
    """The table's ``shard`` column: ``opt`` (the optimizer state over the
    replicas), ``seq`` (sequence parallelism), both, or ``-``."""
    return "+".join(n for n, on in (("opt", c.shard_optimizer_state), ("seq", c.sequence_parallel)) if on) or "-"


def _is_step(value: Any) -> bool:
    """Whether `value` is an `smp.step` function (`smp.StepFunction`; read by
    what it has, as `smp_tf.step_function` imports this module)."""
    return all(hasattr(value, a) for a in ("_split", "_fn", "_trace_shapes", "_tf_kwargs"))


def _batch_size(step: Any, args: tuple, kwargs: dict) -> int:
    """The batch of the arguments: the size of what the step splits."""
    if not _is_step(step):
        raise TypeError(f"smp.plan needs an `smp.step` function or a compiled smp.DistributedModel. "
                        f"Received: {step!r:.100}")
    one = step._split(args, kwargs, 1)[0]
    sizes = {int(x.shape[0]) for x in tf.nest.flatten(one) if isinstance(x, tf.Tensor) and x.shape.rank}
    if len(sizes) != 1:
        raise ValueError(f"smp.plan needs example arguments with one batch size; their leading sizes are "
                         f"{sorted(sizes)}.")
    return sizes.pop()


def _model_step(model: Any, x: Any, y: Any) -> Tuple[Any, tuple]:
    """The training step ``fit`` runs for a compiled `DistributedModel`, and
    its arguments for a batch ``(x, y)`` (`DistributedModel.training_step_of`)."""
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ValueError("smp.plan(model, x, y) needs a compiled model: call model.compile(optimizer=..., loss=...) "
                         "first.")
    return model.training_step_of(x, y)


def _cluster(cluster: Union[None, ResourceGraph, Mapping[str, Any], str]) -> ResourceGraph:
    if isinstance(cluster, ResourceGraph):
        return cluster
    if isinstance(cluster, Mapping):
        return ResourceGraph.from_dict(cluster)
    if isinstance(cluster, str):
        return ResourceGraph.from_json(cluster)
    if cluster is not None:
        raise TypeError(f"cluster must be a ResourceGraph, a dict or a JSON file's path. Received: {cluster!r:.100}")
    from smp_tf.planner import cluster as this_cluster

    return this_cluster()


def plan(
    target: Any,
    *args: Any,
    optimizer: Any = None,
    cluster: Union[None, ResourceGraph, Mapping[str, Any], str] = None,
    memory_budget: Optional[int] = None,
    keep: int = 24,
    config: Optional[Mapping[str, Any]] = None,
    headroom: float = HEADROOM,
    eager: Optional[bool] = None,
    probe: bool = False,
    **kwargs: Any,
) -> Plan:
    """Searches the configuration of a step for a cluster.

    ``smp.plan(train_step, x, y, optimizer=opt)`` for an `smp.step`
    function and its example arguments, or ``smp.plan(model, x, y)`` for a
    compiled `smp.DistributedModel` (the step ``fit`` runs). Searches
    ``partitions``, ``tensor_parallel_degree``, data-parallel replicas,
    ``microbatches``, ``pipeline``, ``virtual_stages`` and ``recompute``;
    for each candidate predicts the step time on the cluster and every
    device's peak, and ranks them (see `smp_tf.planner.search`).

    Args:
        target: an `smp.step` function, or a compiled `DistributedModel`.
        *args: the step's example arguments (one whole batch), or ``x, y``
            for a model.
        optimizer: the optimizer that applies the gradients (its state
            counts in every device's memory; default: the step's own, or
            Adam's two slots).
        cluster: the machines: a `ResourceGraph`, a dict or a JSON file's
            path (`ResourceGraph.from_dict`); None: `smp.cluster()` (the
            config's ``cluster``, or this process's devices, calibrated).
            A declared cluster, given here or by the config key, is searched
            with data-parallel replicas (each row's ``replicas`` processes
            to launch); this process's own devices with one replica unless
            ``replicas=[...]`` asks for more.
        memory_budget: bytes per device; lowers every device's memory.
        keep: how many fitting candidates get their memory predicted (the
            fastest by predicted time); the rest are listed as skipped.
        config: keys every row's config carries (e.g. ``optimize``); the
            current `smp.init` config's other keys by default.
        headroom: the share of each device's memory a plan leaves free
            (0.2: TensorFlow's allocator needs room beside the bytes in use;
            measured on the CPU allocator, a step whose in-use peak was
            1248 MiB ran out of memory under a 1536 MiB limit).
        eager: whether the step is called eagerly. Its outputs then leave
            the pipeline together, every micro-batch's gradients held until
            `StepOutput.accumulate` sums them (``M + 1`` times their bytes
            at the end of the step); inside a ``tf.function`` the running
            sum takes each as it arrives. Default: True for a step function
            (the safe side), False for a model (``fit`` runs in a
            ``tf.function``).
        probe: first run two candidates for a few steps in this process,
            the one that runs the most ops per step (`probe_row`) and the
            one device alone (`one_device_row`), fit the runtime's cost
            per op run (``runtime["dispatch"]``) and the share of the
            ops' parallelism a device realizes (``runtime["parallel"]``)
            to their measured steps (`fit_probe`, `Probe`), and predict
            every candidate again with them. This process needs the
            probed rows' devices (plan for this host, ``cluster=None``);
            as in `Plan.measure`, the step's gradients are not applied,
            and `smp.init` gets back the config it had.
        **kwargs: the step's keyword arguments, and search dimensions
            (``partitions=[2, 4]``, ``tensor_parallel_degrees``,
            ``replicas``, ``microbatches``, ``pipelines``,
            ``virtual_stages``, ``recompute``, ``max_stages``) that fix
            their values.

    Returns:
        The `Plan`; ``print(plan)`` shows its table, ``plan.best.config``
        is the dict for `smp.init`.
    """
    from smp_tf import state
    from smp_tf.memory import optimizer_slots
    from smp_tf.partitioner.plan import DEFAULT_SLOTS
    dims = {k: kwargs.pop(k) for k in list(kwargs) if k in SEARCH_DIMENSIONS}
    step, args, optimizer, eager = _step_of(target, args, kwargs, optimizer, eager)
    batch = _batch_size(step, args, kwargs)
    graph = _cluster(cluster)
    opt = optimizer if optimizer is not None else getattr(step, "optimizer", None)
    slots = DEFAULT_SLOTS if opt is None else optimizer_slots(opt)
    if config is None:
        config = _kept_keys(state.config().to_dict()) if state.is_initialized() else {}
    layout_map = (config or {}).get("layout_map")
    own_devices = cluster is None and not (state.is_initialized() and state.config().cluster is not None)
    if dims.get("replicas") is None and state.is_initialized() and own_devices:
        # This process's devices: data parallelism is a process per replica.
        # A declared cluster (the config key or `cluster=`) is searched with
        # replicas, each row saying how many processes to launch.
        dims["replicas"] = [1]
    cands, skipped = candidates(len(graph.devices), batch, **dims)
    tracer = _Tracer(step, args, kwargs, batch, layout_map,
                     sorted({batch // (c.replicas * c.microbatches) for c in cands}))
    if memory_budget is None and state.is_initialized() and own_devices:
        memory_budget = state.config().memory_budget

    # One cache for every search and prediction of this step on these
    # devices: the probe's figures do not enter what it keeps.
    cache: Dict[Any, Any] = {}

    def searched(cluster: ResourceGraph) -> Plan:
        result = search(tracer, batch, cluster, cands, slots=slots, memory_budget=memory_budget, fixed=config,
                        keep=keep, skipped=list(skipped), headroom=headroom, outputs_held=eager, cache=cache)
        return Plan(result, cluster, step, args, kwargs, tracer.seconds, batch)

    def predict(row: PlanRow, dispatch: float, parallel: float) -> float:
        cand = row.candidate
        info = tracer(batch // (cand.replicas * cand.microbatches), cand.tensor_parallel_degree,
                      cand.sequence_parallel)
        figures = graph.with_runtime(dispatch=dispatch, parallel=parallel)
        return predict_time(info, cand, figures, slots=slots, fixed=config, cache=cache)[0].step_time

    first = searched(graph)
    if not probe:
        return first
    found = _probe(first, step, args, kwargs, predict)
    again = searched(graph.with_runtime(dispatch=found.dispatch, parallel=found.parallel))
    again.probe = found
    return again


def _step_of(target: Any, args: tuple, kwargs: dict, optimizer: Any, eager: Optional[bool]
             ) -> Tuple[Any, tuple, Any, bool]:
    """(step, its arguments, the optimizer, eager) for `plan`'s target: an
    `smp.step` function as given, or a compiled model's ``fit`` step."""
    if not _is_step(target) and hasattr(target, "step_functions"):
        if len(args) != 2 or kwargs:
            raise ValueError("smp.plan(model, x, y): give the model's inputs and targets of one batch.")
        optimizer = optimizer if optimizer is not None else getattr(target, "optimizer", None)
        step, args = _model_step(target, *args)
        return step, args, optimizer, False if eager is None else eager
    return target, args, optimizer, True if eager is None else eager


def _rounds(rows: Sequence[PlanRow], rounds: int) -> Iterator[Tuple[int, PlanRow]]:
    """(round, row) for `rounds` rounds over `rows`, in alternating order (a
    burst of other work on the machine slows a round, not every row's)."""
    for n in range(rounds):
        for row in (rows if n % 2 == 0 else rows[::-1]):
            yield n, row


def _probe(first: Plan, step: Any, args: tuple, kwargs: dict, predict: Callable[[PlanRow, float, float], float],
           steps: int = 5, warmup: int = 2, rounds: int = 3) -> Probe:
    """Runs `probe_row` and `one_device_row` of `first` (`plan`'s
    ``probe``): `rounds` rounds in alternating order of `warmup` untimed
    and `steps` timed steps, a row's figure the least of its rounds'
    medians (a burst of other work on the machine only ever slows one);
    then `fit_probe`."""
    from smp_tf import state

    many = probe_row(first.rows)
    one = one_device_row(first.rows)
    if one is many:  # one row cannot give both figures: the share stays 1
        one = None
    rows = [many] + ([one] if one is not None else [])
    before = state.config().to_dict() if state.is_initialized() else None
    measured: Dict[int, float] = {}
    t0 = time.perf_counter()
    try:
        for _, row in _rounds(rows, rounds):
            state.init(row.config)
            t = time_step(step, args, kwargs, steps, warmup)
            measured[id(row)] = min(measured.get(id(row), t), t)
    finally:
        if before is not None:
            state.init(before)
    one_measured = measured[id(one)] if one is not None else None
    dispatch, share = fit_probe(predict, many, measured[id(many)], one, one_measured)
    return Probe(many.candidate.label(), dict(many.config), measured[id(many)], many.step_time, many.ops_run,
                 dispatch, share, one.candidate.label() if one is not None else None, one_measured,
                 one.step_time if one is not None else None, time.perf_counter() - t0)


#: Keys of the config the planner chooses (not carried from the current config).
_CHOSEN = ("partitions", "microbatches", "pipeline", "recompute", "virtual_stages", "tensor_parallel_degree", "auto",
           "pipeline_parallel_degree")


def _kept_keys(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """The keys of a config that every planned config keeps, at their
    non-default values."""
    from smp_tf.config import Config

    defaults = Config().to_dict()
    return {k: v for k, v in cfg.items() if k not in _CHOSEN and defaults.get(k) != v}


def apply_auto(step: Any, args: tuple, kwargs: dict, eager: bool = True) -> Optional[Plan]:
    """With the config key ``auto``, plans `step` on its first call's
    arguments and re-initialises smp_tf with the best row's config (the
    config's other keys kept); the plan is ``step.auto_plan``. Does nothing
    without ``auto``. `eager`: the call is eager (see `plan`)."""
    from smp_tf import state

    cfg = state.config()
    if not cfg.auto:
        return None
    if cfg.pipeline_processes > 1 or state.size() > 1:
        raise ValueError("The config key 'auto' plans for one process: it cannot be used with pipeline_processes or "
                         "several processes. Use smp.plan on the cluster and give its best config instead.")
    result = plan(step, *args, optimizer=step.optimizer, replicas=[1], eager=eager, **kwargs)
    best = result.best
    state.init({**best.config, "auto": False})
    step.auto_plan = result
    return result

