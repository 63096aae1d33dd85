"""Simulating per-device orders: times, bubble, live micro-batches, and the
tables and deadlock reports built from them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from smp_tf.schedules.tasks import (
    Action,
    TaskKey,
    TaskSpec,
    _check_num_microbatches,
    _check_tasks,
    _display_prefixes,
    _is_int,
    _name,
)

# Tables are for people; past this many queued actions per device a deadlock
# report only says how many more there are.
_STUCK_SHOWN = 3


class ScheduleError(ValueError):
    """A schedule cannot run: its per-device orders deadlock.

    Attributes:
        table: the device x slot table with the stuck actions marked ``[..]``.
        stuck: device -> the action it is stuck at.
    """

    def __init__(self, message: str, table: str = "", stuck: Optional[Dict[int, "Action"]] = None):
        super().__init__(message)
        self.table = table
        self.stuck = dict(stuck or {})


def _normalize_order(
    order: Union[Mapping[int, Sequence[Union[Action, str]]], Sequence[Sequence[Union[Action, str]]]],
) -> Dict[int, List[Action]]:
    """Turns an order (mapping or list indexed by device; Actions or short strings)
    into ``{device: [Action, ...]}``."""
    if isinstance(order, Mapping):
        items = list(order.items())
    elif isinstance(order, (list, tuple)):
        items = list(enumerate(order))
    else:
        raise ValueError(f"order must map device -> list of actions, got {type(order).__name__}")
    out: Dict[int, List[Action]] = {}
    for dev, acts in items:
        if not _is_int(dev) or dev < 0:
            raise ValueError(f"order has device key {dev!r}; expected an int >= 0")
        lst = []
        for a in acts:
            if isinstance(a, str):
                a = Action.from_str(a)
            if not isinstance(a, Action):
                raise ValueError(f"order[{dev}] holds {a!r}; expected Action or e.g. 'p0w1m3'")
            lst.append(a)
        out[dev] = lst
    return out


def _check_order(
    order: Mapping[int, Sequence[Action]], tasks: Tuple[TaskSpec, ...], num_microbatches: int
) -> None:
    """Every (task, micro-batch) exactly once, on its own device.

    Raises:
        ValueError: naming the first offending action.
    """
    device_of = {t.key: t.device for t in tasks}
    seen: Dict[Action, int] = {}
    for dev in sorted(order):
        for a in order[dev]:
            if a.task not in device_of:
                raise ValueError(f"action {a} on device {dev} runs unknown task {a.task}")
            if device_of[a.task] != dev:
                raise ValueError(
                    f"action {a} is on device {dev}, but task {a.task} belongs to device {device_of[a.task]}"
                )
            if not 0 <= a.microbatch < num_microbatches:
                raise ValueError(
                    f"action {a} on device {dev} has microbatch {a.microbatch}, "
                    f"outside 0..{num_microbatches - 1}"
                )
            if a in seen:
                raise ValueError(f"action {a} appears more than once on device {dev}")
            seen[a] = dev
    missing = [
        Action(t.partition, t.wave, m)
        for t in tasks
        for m in range(num_microbatches)
        if Action(t.partition, t.wave, m) not in seen
    ]
    if missing:
        shown = ", ".join(str(a) for a in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"order is missing action(s) {shown}{more}")


def _task_costs(
    tasks: Tuple[TaskSpec, ...], costs: Optional[Mapping[TaskKey, float]]
) -> Dict[TaskKey, float]:
    out = {t.key: t.cost for t in tasks}
    for k, c in (costs or {}).items():
        k = tuple(k)
        if k not in out:
            raise ValueError(f"costs has unknown task {k}")
        try:
            c = float(c)
        except (TypeError, ValueError):
            raise ValueError(f"cost of task {k} must be a number, got {c!r}") from None
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of task {k} must be finite and >= 0, got {c!r}")
        out[k] = c
    return out


# ---------------------------------------------------------------------------
# Simulation


@dataclass(frozen=True, repr=False)
class Simulation:
    """Timing of a schedule under given task costs (communication is free).

    Attributes:
        makespan: end of the last action.
        start: action -> start time.
        end: action -> end time.
        busy: device -> total cost of its actions.
        bubble: idle fraction ``(D * makespan - work) / (D * makespan)`` over
            the ``D`` devices that run at least one action.
        peak_live: device -> the largest number of micro-batches that were
            live at once on it: their first action on the device has started
            and their last one has not finished (a proxy for stored
            activations).
        peak_activations: device -> the most activations it held at once, in
            units of one micro-batch's activations of the device's whole
            share of the model: a (partition, micro-batch) pair is live from
            its first action to its last, and counts ``1 / v`` on a device
            holding ``v`` partitions. With one partition per device it is
            `peak_live`.
        order: the simulated per-device orders.
        tasks: the task set.
    """

    makespan: float
    start: Dict[Action, float]
    end: Dict[Action, float]
    busy: Dict[int, float]
    bubble: float
    peak_live: Dict[int, int]
    order: Dict[int, List[Action]] = field(default_factory=dict)
    tasks: Tuple[TaskSpec, ...] = ()
    peak_activations: Dict[int, float] = field(default_factory=dict)

    def __repr__(self) -> str:
        # The start/end maps hold every action; a summary is what people read.
        return (
            f"Simulation(makespan={self.makespan:g}, bubble={self.bubble:.4f}, "
            f"busy={self.busy}, peak_live={self.peak_live})"
        )

    def table(self) -> str:
        """Device x time table of this simulation.

        When every start and end time is a small integer, column ``k`` is the
        time ``[k, k+1)``; otherwise the columns are the intervals between
        consecutive start/end times and the header gives their start time. An
        action longer than one column shows its name in its first column and
        ``-`` in the others; ``.`` is idle. Zero-cost actions take no column.
        """
        times = sorted({t for t in self.start.values()} | {t for t in self.end.values()} | {0.0})
        # Unit columns only while they stay few: costs such as flop counts
        # are integers too, and a column per flop is no table.
        integral = all(abs(t - round(t)) < 1e-9 for t in times) and self.makespan <= 4 * len(times)
        if integral:
            edges = [float(k) for k in range(int(round(self.makespan)) + 1)]
            header = [str(k) for k in range(len(edges) - 1)]
        else:
            edges = times
            header = [f"{t:.4g}" for t in edges[:-1]]
        names = _display_prefixes(self.tasks)
        devices = sorted(self.order)
        rows: Dict[int, List[str]] = {}
        for dev in devices:
            cells = ["."] * (len(edges) - 1)
            for a in self.order[dev]:
                s, e = self.start[a], self.end[a]
                first = True
                for i in range(len(edges) - 1):
                    lo, hi = edges[i], edges[i + 1]
                    # A column belongs to the action running through its middle.
                    mid = (lo + hi) / 2
                    if s <= mid < e:
                        cells[i] = _name(a, names) if first else "-"
                        first = False
            rows[dev] = cells
        return _render(header, rows)


def _render(header: List[str], rows: Mapping[int, List[str]], label: str = "slot") -> str:
    """Aligns a table: a header row, then ``dev{d}`` rows of cells."""
    # Per-column widths keep wide tables (P = 8, M = 16) as narrow as the
    # cells in each column allow.
    widths = [
        max([len(h)] + [len(r[i]) for r in rows.values() if i < len(r)]) for i, h in enumerate(header)
    ]
    row_labels = {d: f"dev{d}" for d in rows}
    lw = max([len(label)] + [len(s) for s in row_labels.values()])
    lines = [label.ljust(lw) + "".join(" " + h.rjust(w) for h, w in zip(header, widths))]
    for d in sorted(rows):
        lines.append(row_labels[d].ljust(lw) + "".join(" " + c.rjust(w) for c, w in zip(rows[d], widths)))
    return "\n".join(line.rstrip() for line in lines)


@dataclass
class _RunResult:
    start: Dict[Action, float]
    end: Dict[Action, float]
    pos: Dict[int, int]  # device -> index of its first action not started
    deadlocked: bool


def _run(
    order: Mapping[int, Sequence[Action]],
    deps: Mapping[TaskKey, Tuple[TaskKey, ...]],
    cost: Callable[[Action], float],
    gap: float = 0.0,
) -> _RunResult:
    """Simulates the per-device orders, stopping (not raising) at a deadlock.

    With fixed per-device orders, an action's start is the longest path to it
    through "previous action on the device" and "dependency" edges, so the
    actions can be placed in any order that respects those edges: repeatedly
    start every device's next action whose dependencies have all been placed.
    The times equal those of an event-driven run; a round that places nothing
    while actions remain is a deadlock. `cost(action)` is the action's
    duration. An action that waits for anything (an earlier action of its
    device or a dependency) starts `gap` after it is ready.
    """
    start: Dict[Action, float] = {}
    end: Dict[Action, float] = {}
    pos = {d: 0 for d in order}
    free = {d: 0.0 for d in order}
    remaining = sum(len(v) for v in order.values())
    while remaining:
        progressed = False
        for d in sorted(order):
            acts = order[d]
            while pos[d] < len(acts):
                a = acts[pos[d]]
                dep_ends = []
                for dk in deps[a.task]:
                    e = end.get(Action(dk[0], dk[1], a.microbatch))
                    if e is None:
                        break
                    dep_ends.append(e)
                else:
                    s = max([free[d]] + dep_ends)
                    if gap and (pos[d] or dep_ends):
                        s += gap
                    start[a] = s
                    end[a] = free[d] = s + cost(a)
                    pos[d] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            return _RunResult(start, end, pos, True)
    return _RunResult(start, end, pos, False)


def replay_makespan(
    order: Mapping[int, Sequence[Action]],
    deps: Mapping[TaskKey, Tuple[TaskKey, ...]],
    duration: Mapping[Action, float],
) -> float:
    """The makespan of fixed per-device orders in which every action has its
    own duration (a recorded run, for example) and starts as soon as it is
    ready.

    Raises:
        ValueError: the orders wait on each other in a cycle.
    """
    run = _run(order, deps, duration.__getitem__)
    if run.deadlocked:
        raise ValueError("the actions wait on each other in a cycle")
    return max(run.end.values(), default=0.0)


def _peak_live(order: Mapping[int, Sequence[Action]], start, end, per_partition: bool = False) -> Dict[int, float]:
    """Device -> the most micro-batches live at once on it, or with
    `per_partition` the most (partition, micro-batch) pairs, each counting
    ``1 / v`` on a device holding ``v`` partitions."""
    peak: Dict[int, float] = {}
    for d, acts in order.items():
        first: Dict[object, float] = {}
        last: Dict[object, float] = {}
        for a in acts:
            m = (a.partition, a.microbatch) if per_partition else a.microbatch
            first[m] = min(first.get(m, math.inf), start[a])
            last[m] = max(last.get(m, -math.inf), end[a])
        best = 0
        # The count only rises when a micro-batch starts, so checking at each
        # first start finds the maximum. A micro-batch whose last action ends
        # exactly then has finished and is not counted.
        for m, t in first.items():
            live = sum(1 for n, f in first.items() if n == m or (f <= t and last[n] > t))
            best = max(best, live)
        share = max(1, len({a.partition for a in acts}))
        peak[d] = best / share if per_partition else best
    return peak


def _deadlock_error(
    order: Mapping[int, Sequence[Action]],
    tasks: Tuple[TaskSpec, ...],
    run: _RunResult,
    what: str = "schedule",
) -> ScheduleError:
    """Builds the error for a run that stopped at a deadlock."""
    table, stuck = _stuck_table(order, tasks, run)
    names = _display_prefixes(tasks)
    by_key = {t.key: t for t in tasks}
    where = {a: (d, i) for d, acts in order.items() for i, a in enumerate(acts)}
    reasons = []
    for d in sorted(stuck):
        a = stuck[d]
        missing = [
            Action(k[0], k[1], a.microbatch)
            for k in by_key[a.task].deps
            if Action(k[0], k[1], a.microbatch) not in run.end
        ]
        parts = []
        for dep in missing:
            qd, _ = where[dep]
            head = order[qd][run.pos[qd]]
            if qd == d:
                parts.append(f"{_name(dep, names)} ({dep}), which comes later in device {d}'s own order")
            elif head == dep:
                parts.append(f"{_name(dep, names)} ({dep}) on device {qd}, itself stuck")
            else:
                parts.append(
                    f"{_name(dep, names)} ({dep}) on device {qd}, which device {qd} only runs "
                    f"after its own stuck action {_name(head, names)} ({head})"
                )
        reasons.append(
            f"device {d} is stuck at {_name(a, names)} ({a}): it needs " + "; and ".join(parts) + "."
        )
    msg = (
        f"The {what} deadlocks: no device can start its next action.\n"
        + "\n".join(reasons)
        + "\nStuck actions are marked [..] (after '|': actions not started, in order):\n"
        + table
    )
    return ScheduleError(msg, table=table, stuck=stuck)


def _stuck_table(
    order: Mapping[int, Sequence[Action]], tasks: Tuple[TaskSpec, ...], run: _RunResult
) -> Tuple[str, Dict[int, Action]]:
    """Table of the placed actions, then '|' and each device's unplaced queue
    with its head (the action it is stuck at) marked ``[..]``."""
    names = _display_prefixes(tasks)
    n_slots = int(round(max(run.end.values(), default=0.0)))
    header = [str(k) for k in range(n_slots)]
    rows: Dict[int, List[str]] = {}
    stuck: Dict[int, Action] = {}
    for d in sorted(order):
        cells = ["."] * n_slots
        for a in order[d][: run.pos[d]]:
            cells[int(round(run.start[a]))] = _name(a, names)
        rows[d] = cells
    tails: Dict[int, str] = {}
    for d in sorted(order):
        rest = order[d][run.pos[d]:]
        if rest:
            stuck[d] = rest[0]
            shown = [f"[{_name(rest[0], names)}]"] + [_name(a, names) for a in rest[1:_STUCK_SHOWN]]
            if len(rest) > _STUCK_SHOWN:
                shown.append(f"+{len(rest) - _STUCK_SHOWN} more")
            tails[d] = " ".join(shown)
        else:
            tails[d] = "(done)"
    body = _render(header, rows).split("\n")
    width = max(len(line) for line in body)
    lines = [body[0].ljust(width) + " |"]
    for line, d in zip(body[1:], sorted(order)):
        lines.append(line.ljust(width) + " | " + tails[d])
    return "\n".join(line.rstrip() for line in lines), stuck


def simulate(
    schedule_order: Union[Mapping[int, Sequence[Union[Action, str]]], Sequence[Sequence[Union[Action, str]]]],
    tasks: Sequence[TaskSpec],
    num_microbatches: int,
    costs: Optional[Mapping[TaskKey, float]] = None,
    gap: float = 0.0,
) -> Simulation:
    """Simulates per-device orders.

    Each device runs its list in order; an action starts at the later of the
    device becoming free and the end of its dependencies (same micro-batch),
    plus `gap` if it waited for either.

    Args:
        schedule_order: device -> ordered actions (Actions or ``"p0w1m3"``).
        tasks: the task set.
        num_microbatches: number of micro-batches ``M``.
        costs: optional ``(partition, wave) -> cost`` overriding task costs.
        gap: the time from an action being ready (its device free, its
            inputs there) to its start: what the runtime takes to dispatch
            it and to hand it its inputs, in the unit of the costs (default
            0: both free). The device is idle during it.

    Returns:
        The `Simulation`.

    Raises:
        ValueError: invalid tasks, costs or order (missing, duplicate or
            misplaced actions).
        ScheduleError: the order deadlocks.
    """
    tasks = _check_tasks(tasks)
    num_microbatches = _check_num_microbatches(num_microbatches)
    order = _normalize_order(schedule_order)
    _check_order(order, tasks, num_microbatches)
    cost = _task_costs(tasks, costs)
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap) or gap < 0:
        raise ValueError(f"gap must be a finite number >= 0. Received: {gap!r}")
    deps = {t.key: t.deps for t in tasks}
    run = _run(order, deps, lambda a: cost[a.task], float(gap))
    if run.deadlocked:
        raise _deadlock_error(order, tasks, _run(order, deps, lambda a: 1.0))
    makespan = max(run.end.values(), default=0.0)
    busy = {d: sum(cost[a.task] for a in acts) for d, acts in order.items()}
    active = [d for d, acts in order.items() if acts]
    total = sum(busy.values())
    span = len(active) * makespan
    bubble = (span - total) / span if span > 0 else 0.0
    return Simulation(
        makespan=makespan,
        start=run.start,
        end=run.end,
        busy=busy,
        bubble=bubble,
        peak_live=_peak_live(order, run.start, run.end),
        order={d: list(v) for d, v in order.items()},
        tasks=tasks,
        peak_activations=_peak_live(order, run.start, run.end, per_partition=True),
    )


