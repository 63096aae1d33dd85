"""Pipeline schedules: which device runs which task for which micro-batch, when.

A traced training step (forward + loss + backward of one micro-batch) is cut
into partitions, one per device. The ops of a partition are grouped into
**tasks** keyed by ``(partition, wave)``: the wave of an op is the number of
partition boundaries on the longest path into it. A plain chain of ``P``
stages gives, on stage ``p < P - 1``, a forward task (wave ``p``) and a
backward task (wave ``2P - 2 - p``), and on the last stage one fused
forward+backward task (wave ``P - 1``). Skip connections give a partition
several tasks. A task depends on other tasks of the same micro-batch.

An **action** ``(partition, wave, microbatch)`` runs one task for one
micro-batch. A `Schedule` is a value: for each device, the ordered list of its
actions. The runtime runs every device's list strictly in order, each action
waiting for its dependencies; nothing else is decided at run time.

Two schedules are built by `make_schedule`:

* ``"simple"`` (GPipe): every forward action, then every backward action.
* ``"interleaved"`` (1F1B): backward actions as early as possible, and stage
  ``p`` keeps at most ``P - p`` micro-batches in flight.

Clock tables (`Schedule.table`) for a chain of ``P = 3`` stages and ``M = 4``
micro-batches, one time slot per action: ``F``/``B`` forward/backward and
``FB`` the fused forward+backward of the last stage, followed by the
micro-batch; ``.`` is idle::

    simple
    slot  0  1   2   3   4   5  6  7  8  9
    dev0 F0 F1  F2  F3   .   . B0 B1 B2 B3
    dev1  . F0  F1  F2  F3  B0 B1 B2 B3  .
    dev2  .  . FB0 FB1 FB2 FB3  .  .  .  .

    interleaved
    slot  0  1   2   3  4   5  6   7  8  9
    dev0 F0 F1  F2   . B0  F3 B1   . B2 B3
    dev1  . F0  F1  B0 F2  B1 F3  B2 B3  .
    dev2  .  . FB0 FB1  . FB2  . FB3  .  .

Deadlock is a property of the per-device orders plus the dependencies, not of
the costs: an order that completes in one simulation completes for any
costs. `validate` simulates once and raises `ScheduleError`, with the table
and the stuck actions marked, when an order cannot complete.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "TaskSpec",
    "Action",
    "Schedule",
    "Simulation",
    "ScheduleError",
    "KINDS",
    "split_chain_tasks",
    "make_schedule",
    "custom_schedule",
    "simulate",
    "validate",
    "chain_tasks",
]

TaskKey = Tuple[int, int]

#: Schedule kinds. ``"custom"`` is an order written by hand (`custom_schedule`).
KINDS = ("simple", "interleaved", "zero_bubble", "custom")

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


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as a partition index is always a bug.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TaskSpec:
    """One task: the ops of one partition at one wave, for any micro-batch.

    Attributes:
        partition: the partition (== device) that runs the task.
        wave: number of partition boundaries on the longest path into the task.
        deps: ``(partition, wave)`` of the tasks this one needs, same micro-batch.
        cost: abstract cost, used by simulations and by the ``interleaved``
            builder to decide which action becomes ready first.
        backward: the task holds gradient ops (``B`` and fused ``FB`` tasks).
        fused: forward and backward in one task (the last stage of a chain).
        weight: a W task: the part of a backward that leads only to weight
            gradients, split from its B task so that it can wait (the
            ``zero_bubble`` schedule runs it in a bubble).

    Raises:
        ValueError: negative or non-integer partition/wave, a negative or
            non-finite cost, a malformed or self dependency, or ``fused``
            without ``backward``.
    """

    partition: int
    wave: int
    deps: Tuple[TaskKey, ...] = ()
    cost: float = 1.0
    backward: bool = False
    fused: bool = False
    weight: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.partition) or self.partition < 0:
            raise ValueError(f"TaskSpec partition must be an int >= 0, got {self.partition!r}")
        if not _is_int(self.wave) or self.wave < 0:
            raise ValueError(f"TaskSpec wave must be an int >= 0, got {self.wave!r}")
        try:
            cost = float(self.cost)
        except (TypeError, ValueError):
            raise ValueError(f"TaskSpec cost must be a number, got {self.cost!r}") from None
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"TaskSpec cost must be finite and >= 0, got {self.cost!r}")
        deps = []
        for d in self.deps:
            if (
                not isinstance(d, (tuple, list))
                or len(d) != 2
                or not all(_is_int(x) and x >= 0 for x in d)
            ):
                raise ValueError(
                    f"TaskSpec ({self.partition}, {self.wave}) has dependency {d!r}; "
                    "expected a (partition, wave) pair of ints >= 0"
                )
            deps.append((d[0], d[1]))
        if (self.partition, self.wave) in deps:
            raise ValueError(f"TaskSpec ({self.partition}, {self.wave}) depends on itself")
        if self.weight and (self.fused or not self.backward):
            raise ValueError(
                f"TaskSpec ({self.partition}, {self.wave}) is a weight task, so it needs backward=True and "
                "fused=False"
            )
        if self.fused and not self.backward:
            raise ValueError(
                f"TaskSpec ({self.partition}, {self.wave}) is fused but not backward; "
                "a fused task holds gradient ops, so it needs backward=True"
            )
        # Normalise so equal tasks compare and hash equal whatever was passed.
        object.__setattr__(self, "deps", tuple(dict.fromkeys(deps)))
        object.__setattr__(self, "cost", cost)

    @property
    def key(self) -> TaskKey:
        """``(partition, wave)``."""
        return (self.partition, self.wave)

    @property
    def label(self) -> str:
        """``"F"`` (forward), ``"B"`` (backward), ``"FB"`` (fused) or ``"W"``
        (weight gradients)."""
        if self.weight:
            return "W"
        if self.fused:
            return "FB"
        return "B" if self.backward else "F"


_ACTION_RE = re.compile(r"^p(\d+)w(\d+)m(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """Run task ``(partition, wave)`` for micro-batch ``microbatch``.

    ``str(action)`` is the short form ``p{partition}w{wave}m{microbatch}``, e.g.
    ``p0w6m3``; `Action.from_str` parses it back. Tables use the display form
    (`Action.display`): the task label and the micro-batch, e.g. ``F3``,
    ``B3``, ``FB3``, with ``w{wave}`` appended (``F3w2``) when the device has
    more than one task with that label.
    """

    partition: int
    wave: int
    microbatch: int

    def __str__(self) -> str:
        return f"p{self.partition}w{self.wave}m{self.microbatch}"

    @property
    def task(self) -> TaskKey:
        """``(partition, wave)`` of the task this action runs."""
        return (self.partition, self.wave)

    @classmethod
    def from_str(cls, text: str) -> "Action":
        """Parses the short form ``p{partition}w{wave}m{microbatch}``.

        Raises:
            ValueError: `text` is not in that form.
        """
        m = _ACTION_RE.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"Cannot parse action {text!r}; expected e.g. 'p0w1m3'")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)))

    def display(self, tasks: Iterable[TaskSpec]) -> str:
        """The table form: ``F3`` / ``B3`` / ``FB3``, or ``F3w2`` when ambiguous.

        Args:
            tasks: the task set; decides the label and whether the device has
                several tasks with the same label.
        """
        return _name(self, _display_prefixes(tasks))


def _display_prefixes(tasks: Iterable[TaskSpec]) -> Dict[TaskKey, Tuple[str, str]]:
    """(partition, wave) -> (label, suffix) for `Action.display`."""
    tasks = list(tasks)
    count: Dict[Tuple[int, str], int] = {}
    for t in tasks:
        count[(t.partition, t.label)] = count.get((t.partition, t.label), 0) + 1
    return {
        t.key: (t.label, f"w{t.wave}" if count[(t.partition, t.label)] > 1 else "")
        for t in tasks
    }


def _check_num_microbatches(num_microbatches: object) -> int:
    if not _is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    return num_microbatches


def _check_tasks(tasks: Sequence[TaskSpec]) -> Tuple[TaskSpec, ...]:
    """Checks a task set and returns it sorted by (partition, wave).

    Raises:
        ValueError: empty, not TaskSpecs, duplicate keys, unknown dependencies
            or a dependency cycle.
    """
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError("tasks is empty; a schedule needs at least one TaskSpec")
    by_key: Dict[TaskKey, TaskSpec] = {}
    for t in tasks:
        if not isinstance(t, TaskSpec):
            raise ValueError(f"tasks must hold TaskSpec values, got {t!r}")
        if t.key in by_key:
            raise ValueError(f"duplicate task (partition, wave) = {t.key}")
        by_key[t.key] = t
    for t in tasks:
        for d in t.deps:
            if d not in by_key:
                raise ValueError(f"task {t.key} depends on unknown task {d}")
    # Kahn's algorithm; whatever is left over lies on (or behind) a cycle, which
    # no order of actions could ever run.
    indeg = {k: len(t.deps) for k, t in by_key.items()}
    users: Dict[TaskKey, List[TaskKey]] = {k: [] for k in by_key}
    for t in tasks:
        for d in t.deps:
            users[d].append(t.key)
    queue = [k for k, n in indeg.items() if n == 0]
    seen = 0
    while queue:
        k = queue.pop()
        seen += 1
        for u in users[k]:
            indeg[u] -= 1
            if indeg[u] == 0:
                queue.append(u)
    if seen != len(by_key):
        cyclic = sorted(k for k, n in indeg.items() if n > 0)
        raise ValueError(f"task dependencies form a cycle through tasks {cyclic}")
    return tuple(sorted(tasks, key=lambda t: t.key))


def _num_devices(tasks: Sequence[TaskSpec]) -> int:
    return 1 + max(t.partition for t in tasks)


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
    keys = {t.key for t in tasks}
    seen: Dict[Action, int] = {}
    for dev in sorted(order):
        for a in order[dev]:
            if a.task not in keys:
                raise ValueError(f"action {a} on device {dev} runs unknown task {a.task}")
            if a.partition != dev:
                raise ValueError(
                    f"action {a} is on device {dev}, but task {a.task} belongs to device {a.partition}"
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


def _name(a: Action, names: Mapping[TaskKey, Tuple[str, str]]) -> str:
    label, suffix = names.get(a.task, ("?", f"w{a.wave}"))
    return f"{label}{a.microbatch}{suffix}"


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
    cost: Mapping[TaskKey, float],
) -> _RunResult:
    """Simulates the per-device orders, stopping (not raising) at a deadlock.

    With fixed per-device orders, an action's start is the longest path to it
    through "previous action on the device" and "dependency" edges, so the
    actions can be placed in any order that respects those edges: repeatedly
    start every device's next action whose dependencies have all been placed.
    The times equal those of an event-driven run; a round that places nothing
    while actions remain is a deadlock.
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
                    start[a] = s
                    end[a] = free[d] = s + cost[a.task]
                    pos[d] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            return _RunResult(start, end, pos, True)
    return _RunResult(start, end, pos, False)


def _peak_live(order: Mapping[int, Sequence[Action]], start, end) -> Dict[int, int]:
    peak: Dict[int, int] = {}
    for d, acts in order.items():
        first: Dict[int, float] = {}
        last: Dict[int, float] = {}
        for a in acts:
            m = a.microbatch
            first[m] = min(first.get(m, math.inf), start[a])
            last[m] = max(last.get(m, -math.inf), end[a])
        best = 0
        # The count only rises when a micro-batch starts, so checking at each
        # first start finds the maximum. A micro-batch whose last action ends
        # exactly then has finished and is not counted.
        for m, t in first.items():
            live = sum(1 for n, f in first.items() if n == m or (f <= t and last[n] > t))
            best = max(best, live)
        peak[d] = best
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
) -> Simulation:
    """Simulates per-device orders.

    Each device runs its list in order; an action starts at the later of the
    device becoming free and the end of its dependencies (same micro-batch).

    Args:
        schedule_order: device -> ordered actions (Actions or ``"p0w1m3"``).
        tasks: the task set.
        num_microbatches: number of micro-batches ``M``.
        costs: optional ``(partition, wave) -> cost`` overriding task costs.

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
    deps = {t.key: t.deps for t in tasks}
    run = _run(order, deps, cost)
    if run.deadlocked:
        raise _deadlock_error(order, tasks, _run(order, deps, {k: 1.0 for k in cost}))
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
    )


# ---------------------------------------------------------------------------
# Schedules


@dataclass(frozen=True, repr=False)
class Schedule:
    """Per-device action orders for one training step.

    Attributes:
        kind: ``"simple"``, ``"interleaved"`` or ``"custom"``.
        num_microbatches: number of micro-batches ``M``.
        tasks: the task set, sorted by ``(partition, wave)``.
        order: device (== partition) -> its actions, in run order.

    ``str(schedule)`` is `table`. Build schedules with `make_schedule` or
    `custom_schedule`, which validate them; a `Schedule` built directly is not
    checked until `validate`.
    """

    kind: str
    num_microbatches: int
    tasks: Tuple[TaskSpec, ...]
    order: Dict[int, List[Action]]

    # A dict field makes the default hash fail; say so plainly.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Schedule(kind={self.kind!r}, num_microbatches={self.num_microbatches}, "
            f"devices={len(self.order)}, tasks={len(self.tasks)})"
        )

    @property
    def num_devices(self) -> int:
        """Number of devices: one more than the largest partition index."""
        return _num_devices(self.tasks)

    def task(self, key: TaskKey) -> TaskSpec:
        """The TaskSpec with ``(partition, wave) == key``.

        Raises:
            ValueError: no such task.
        """
        for t in self.tasks:
            if t.key == tuple(key):
                return t
        raise ValueError(f"schedule has no task {tuple(key)}")

    def display(self, action: Action) -> str:
        """Table form of `action` (``F3``, ``B3``, ``FB3`` or ``F3w2``)."""
        return _name(action, self._names)

    @cached_property
    def _names(self) -> Dict[TaskKey, Tuple[str, str]]:
        return _display_prefixes(self.tasks)

    def simulate(self, costs: Optional[Mapping[TaskKey, float]] = None) -> Simulation:
        """Simulates this schedule (see `simulate`).

        Args:
            costs: optional ``(partition, wave) -> cost`` overriding task costs.

        Returns:
            The `Simulation`.

        Raises:
            ScheduleError: the schedule deadlocks.
            ValueError: the schedule or costs are invalid.
        """
        return simulate(self.order, self.tasks, self.num_microbatches, costs)

    def table(self) -> str:
        """Device x time-slot table, every action one slot (clock cycles).

        Actions are placed by a simulation where every action costs 1, so
        column ``k`` is the ``k``-th clock cycle and a cell is the action a
        device runs in it: ``F3`` / ``B3`` / ``FB3`` (forward / backward /
        fused forward+backward of micro-batch 3; ``F3w2`` when the device has
        several forward tasks), ``.`` for idle. For a schedule that deadlocks
        the placed actions are followed by ``|`` and each device's remaining
        queue, the action it is stuck at marked ``[..]``. Use
        ``simulate().table()`` for the times under the task costs.
        """
        order = _normalize_order(self.order)
        deps = {t.key: t.deps for t in self.tasks}
        unknown = [a for acts in order.values() for a in acts if a.task not in deps]
        if unknown:
            raise ValueError(f"action {unknown[0]} runs unknown task {unknown[0].task}")
        run = _run(order, deps, {k: 1.0 for k in deps})
        if run.deadlocked:
            return _stuck_table(order, self.tasks, run)[0]
        n_slots = int(round(max(run.end.values(), default=0.0)))
        rows = {}
        for d in sorted(order):
            cells = ["."] * n_slots
            for a in order[d]:
                cells[int(round(run.start[a]))] = self.display(a)
            rows[d] = cells
        return _render([str(k) for k in range(n_slots)], rows)

    def __str__(self) -> str:
        return self.table()


def validate(schedule: Schedule) -> None:
    """Checks that `schedule` can run.

    Every (task, micro-batch) must appear exactly once, on the device equal to
    the task's partition, no action may name an unknown task, and the orders
    must not deadlock (checked by one simulation).

    Args:
        schedule: the schedule to check.

    Raises:
        ValueError: an invalid kind, micro-batch count, task set, or a
            missing, duplicate, misplaced or unknown action.
        ScheduleError: the orders deadlock; the message holds the table with
            the stuck actions marked.
    """
    if schedule.kind not in KINDS:
        raise ValueError(f"schedule kind {schedule.kind!r} is not one of {KINDS}")
    schedule.simulate()


def make_schedule(tasks: Sequence[TaskSpec], num_microbatches: int, kind: str) -> Schedule:
    """Builds and validates a schedule.

    Args:
        tasks: the task set (at least one task; dependencies must be acyclic).
        num_microbatches: number of micro-batches ``M >= 1``.
        kind: ``"simple"`` (GPipe), ``"interleaved"`` (1F1B) or
            ``"zero_bubble"`` (ZB-H1).

    ``"simple"``: on each device every forward action sorted by (wave,
    micro-batch), then every backward (and fused) action likewise.
    ``"interleaved"``: for a plain chain (`chain_tasks` of any costs) the
    classic 1F1B order; for any other task set a list schedule on the task
    costs that runs backward actions as soon as they are ready and lets
    device ``p`` hold at most ``P - p`` micro-batches in flight.
    ``"zero_bubble"``: the same list schedule, with the weight (``W``)
    tasks last in priority: a device runs a W action only when no B and no
    allowed F action is ready, so W actions fill what would be bubbles; a
    micro-batch stays in flight until its W is done, so a device holds no
    more micro-batches than under 1F1B (ZB-H1 of Qi et al., ICLR 2024).
    Without W tasks it is the interleaved list schedule.

    Returns:
        The `Schedule`, with an (possibly empty) order for every device
        ``0 .. P-1``.

    Raises:
        ValueError: unknown kind (``"custom"`` needs `custom_schedule`), bad
            ``num_microbatches`` or tasks.
        ScheduleError: the order deadlocks (``"simple"`` with a forward task
            that depends on a backward task, or dependencies on higher waves).
    """
    if kind == "custom":
        raise ValueError("kind 'custom' needs an explicit order; use custom_schedule()")
    if kind not in ("simple", "interleaved", "zero_bubble"):
        raise ValueError(f"unknown schedule kind {kind!r}; expected 'simple', 'interleaved' or 'zero_bubble'")
    num_microbatches = _check_num_microbatches(num_microbatches)
    tasks = _check_tasks(tasks)
    if kind == "simple":
        order = _simple_order(tasks, num_microbatches)
    elif kind == "zero_bubble":
        order = _interleaved_order(tasks, num_microbatches, defer_weight=True)
    elif _is_chain(tasks):
        order = _classic_1f1b_order(_num_devices(tasks), num_microbatches)
    else:
        order = _interleaved_order(tasks, num_microbatches)
    schedule = Schedule(kind, num_microbatches, tasks, order)
    validate(schedule)
    return schedule


def custom_schedule(
    tasks: Sequence[TaskSpec],
    num_microbatches: int,
    order: Union[Mapping[int, Sequence[Union[Action, str]]], Sequence[Sequence[Union[Action, str]]]],
) -> Schedule:
    """Wraps a hand-written order as a validated ``"custom"`` schedule.

    Args:
        tasks: the task set.
        num_microbatches: number of micro-batches.
        order: device -> actions (Actions or short strings like ``"p0w1m3"``),
            as a mapping or a list indexed by device.

    Returns:
        The `Schedule`; devices without actions get an empty list.

    Raises:
        ValueError: invalid input (see `validate`).
        ScheduleError: the order deadlocks.
    """
    tasks = _check_tasks(tasks)
    num_microbatches = _check_num_microbatches(num_microbatches)
    norm = _normalize_order(order)
    full = {d: [] for d in range(_num_devices(tasks))}
    full.update(norm)
    schedule = Schedule("custom", num_microbatches, tasks, dict(sorted(full.items())))
    validate(schedule)
    return schedule


def _simple_order(tasks: Tuple[TaskSpec, ...], m: int) -> Dict[int, List[Action]]:
    """GPipe: all forward actions by (wave, micro-batch), then all backward ones.

    A forward task that needs a backward (or fused) task, directly or through
    other tasks (e.g. a metric computed on another device from the loss),
    runs in the backward phase: it cannot run before the backward phase
    starts. Then (phase, wave) increases along every dependency, because a
    dependency always has a lower wave, so each device's order follows every
    dependency and cannot deadlock.
    """
    late = {t.key for t in tasks if t.backward}
    changed = True
    while changed:  # propagate "needs a backward task" to a fixed point
        changed = False
        for t in tasks:
            if t.key not in late and any(d in late for d in t.deps):
                late.add(t.key)
                changed = True
    order: Dict[int, List[Action]] = {d: [] for d in range(_num_devices(tasks))}
    for d in order:
        for phase in (False, True):
            group = [t for t in tasks if t.partition == d and (t.key in late) == phase]
            # Action sorts by (partition, wave, microbatch): one device, so by
            # (wave, microbatch).
            order[d].extend(sorted(Action(t.partition, t.wave, mb) for t in group for mb in range(m)))
    return order


def _is_chain(tasks: Tuple[TaskSpec, ...]) -> bool:
    """Whether `tasks` is `chain_tasks` of some P, whatever the costs."""
    def shape(ts):
        return sorted((t.key, frozenset(t.deps), t.backward, t.fused) for t in ts)

    return shape(tasks) == shape(chain_tasks(_num_devices(tasks)))


def _classic_1f1b_order(num_stages: int, m: int) -> Dict[int, List[Action]]:
    """The classic 1F1B order of a chain (PipeDream-Flush).

    Stage ``p`` runs ``min(P-1-p, M)`` warm-up forwards, then forward/backward
    pairs, then the cool-down backwards; the last stage runs its fused tasks.
    The list scheduler yields exactly this for balanced stage costs; writing
    it out keeps the order of a chain independent of cost estimates, which
    are rough and only ever shift it by a slot or two.
    """
    last = num_stages - 1
    order: Dict[int, List[Action]] = {last: [Action(last, last, i) for i in range(m)]}
    for p in range(last):
        fwd = [Action(p, p, i) for i in range(m)]
        bwd = [Action(p, 2 * last - p, i) for i in range(m)]
        warm = min(last - p, m)
        seq = fwd[:warm]
        for i in range(m - warm):
            seq += [fwd[warm + i], bwd[i]]
        order[p] = seq + bwd[m - warm:]
    return dict(sorted(order.items()))


def _interleaved_order(tasks: Tuple[TaskSpec, ...], m: int, defer_weight: bool = False) -> Dict[int, List[Action]]:
    """1F1B by list scheduling on the task costs.

    Whenever a device is idle it starts, among its ready actions, a backward
    one first (lowest micro-batch, then wave): finishing a micro-batch frees
    its activations. Otherwise a forward one with the lowest micro-batch
    (then wave), but a micro-batch not yet in flight on device ``p`` may only
    start while fewer than ``P - p`` are: stage ``p`` must hold activations
    until the backward comes back through the ``P - 1 - p`` later stages, and
    ``P - p`` in flight is just enough to keep it busy meanwhile. For a chain
    with balanced stage costs this yields the classic 1F1B order (``min(P-1-p, M)`` warm-up forwards,
    then forward/backward pairs, then the cool-down backwards).

    `make_schedule` writes the order of a plain chain out directly
    (`_classic_1f1b_order`); this builder serves every other task set.

    When nothing can start and nothing runs while work remains, the lowest
    device with a ready forward action starts
    it beyond its limit, so the build always completes. The start order on
    each device is the schedule.
    """
    num_dev = _num_devices(tasks)
    by_key = {t.key: t for t in tasks}
    users: Dict[TaskKey, List[TaskKey]] = {k: [] for k in by_key}
    for t in tasks:
        for d in t.deps:
            users[d].append(t.key)
    tasks_on = {d: [t for t in tasks if t.partition == d] for d in range(num_dev)}
    # Unfinished dependencies of each (task, micro-batch).
    waiting = {(t.key, mb): len(t.deps) for t in tasks for mb in range(m)}
    ready: Dict[int, List[Action]] = {d: [] for d in range(num_dev)}
    for t in tasks:
        if not t.deps:
            ready[t.partition].extend(Action(t.partition, t.wave, mb) for mb in range(m))
    left = {(d, mb): len(tasks_on[d]) for d in range(num_dev) for mb in range(m)}
    inflight: Dict[int, set] = {d: set() for d in range(num_dev)}
    limit = {d: num_dev - d for d in range(num_dev)}
    busy = {d: False for d in range(num_dev)}
    order: Dict[int, List[Action]] = {d: [] for d in range(num_dev)}
    events: List[Tuple[float, int, Action]] = []
    seq = 0
    now = 0.0
    remaining = len(tasks) * m

    def pick(d: int, relax: bool) -> Optional[Action]:
        cands = ready[d]
        deferred = [a for a in cands if defer_weight and by_key[a.task].weight]
        bwd = [a for a in cands if by_key[a.task].backward and not (defer_weight and by_key[a.task].weight)]
        if bwd:
            return min(bwd, key=lambda a: (a.microbatch, a.wave))
        fwd = [
            a
            for a in cands
            if not by_key[a.task].backward
            and (relax or a.microbatch in inflight[d] or len(inflight[d]) < limit[d])
        ]
        if fwd:
            return min(fwd, key=lambda a: (a.microbatch, a.wave))
        # W actions wait for a gap: nothing on the critical path is ready.
        return min(deferred, key=lambda a: (a.microbatch, a.wave)) if deferred else None

    def begin(d: int, a: Action) -> None:
        nonlocal seq
        ready[d].remove(a)
        order[d].append(a)
        inflight[d].add(a.microbatch)
        busy[d] = True
        heapq.heappush(events, (now + by_key[a.task].cost, seq, a))
        seq += 1

    while remaining:
        for d in range(num_dev):
            if not busy[d]:
                a = pick(d, relax=False)
                if a is not None:
                    begin(d, a)
        if not events:
            for d in range(num_dev):
                a = pick(d, relax=True)
                if a is not None:
                    begin(d, a)
                    break
            else:
                # Unreachable for an acyclic task set (checked by _check_tasks).
                raise ScheduleError("interleaved build found no action to start")
        # Finish everything ending at the earliest end time before deciding
        # again, so devices freed at the same instant see the same state.
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, a = heapq.heappop(events)
            d = a.partition
            busy[d] = False
            remaining -= 1
            left[(d, a.microbatch)] -= 1
            if left[(d, a.microbatch)] == 0:
                inflight[d].discard(a.microbatch)
            for u in users[a.task]:
                waiting[(u, a.microbatch)] -= 1
                if waiting[(u, a.microbatch)] == 0:
                    ready[u[0]].append(Action(u[0], u[1], a.microbatch))
    return order


def chain_tasks(
    num_stages: int, forward_cost: float = 1.0, backward_cost: float = 2.0
) -> List[TaskSpec]:
    """The task set of a plain chain pipeline of `num_stages` stages.

    Stage ``p < P-1`` has a forward task at wave ``p`` (needing the forward of
    stage ``p-1``) and a backward task at wave ``2P-2-p`` (needing the
    backward of stage ``p+1``, or the fused task, and its own forward). The
    last stage has one fused forward+backward task at wave ``P-1`` costing
    ``forward_cost + backward_cost``. For ``P = 1`` that is the only task.

    Args:
        num_stages: ``P >= 1``.
        forward_cost: cost of each forward task.
        backward_cost: cost of each backward task.

    Returns:
        The tasks, sorted by (partition, wave).

    Raises:
        ValueError: ``num_stages < 1`` or a bad cost.
    """
    if not _is_int(num_stages) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    p_last = num_stages - 1
    tasks = []
    for p in range(p_last):
        tasks.append(
            TaskSpec(p, p, deps=((p - 1, p - 1),) if p > 0 else (), cost=forward_cost)
        )
        # The backward of stage p is fed by the stage after it: the fused task
        # when that is the last stage, else its backward at wave 2P-3-p.
        nxt = (p + 1, p_last) if p + 1 == p_last else (p + 1, 2 * p_last - p - 1)
        tasks.append(
            TaskSpec(p, 2 * p_last - p, deps=(nxt, (p, p)), cost=backward_cost, backward=True)
        )
    tasks.append(
        TaskSpec(
            p_last,
            p_last,
            deps=((p_last - 1, p_last - 1),) if p_last > 0 else (),
            cost=forward_cost + backward_cost,
            backward=True,
            fused=True,
        )
    )
    return sorted(tasks, key=lambda t: t.key)


def split_chain_tasks(
    num_stages: int,
    forward_cost: float = 1.0,
    input_grad_cost: float = 1.0,
    weight_grad_cost: float = 1.0,
    split_last: bool = True,
) -> List[TaskSpec]:
    """`chain_tasks` with every backward split into B and W, for the
    ``zero_bubble`` schedule.

    Stage ``p < P-1`` has F at wave ``p``, B at wave ``2P-2-p`` and W at
    wave ``2P-1+p`` (needing its B); the last stage has the fused FB at wave
    ``P-1`` (costing F + B) and its W, or with ``split_last=False`` one
    fused task costing F + B + W (what ``build_tasks(split_weight=True)``
    makes of a chain: it leaves fused tasks whole).

    Raises:
        ValueError: ``num_stages < 1`` or a bad cost.
    """
    # The chain's tasks, with W added after each backward (B costing
    # input_grad_cost; the fused task F + B, or F + B + W when kept whole).
    chain = chain_tasks(num_stages, forward_cost, input_grad_cost)  # validates the arguments
    last = num_stages - 1
    tasks = []
    for t in chain:
        if t.fused and not split_last:
            tasks.append(dataclasses.replace(t, cost=t.cost + weight_grad_cost))
            continue
        tasks.append(t)
        if t.backward:
            p = t.partition
            tasks.append(TaskSpec(p, 2 * last + 1 + p, deps=(t.key,), cost=weight_grad_cost, backward=True, weight=True))
    return sorted(tasks, key=lambda t: t.key)
