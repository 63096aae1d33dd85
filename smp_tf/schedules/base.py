"""`Schedule`, the registry of schedule builders, and `make_schedule`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from smp_tf.schedules.simulation import (
    Simulation,
    _normalize_order,
    _render,
    _run,
    _stuck_table,
    simulate,
)
from smp_tf.schedules.tasks import (
    Action,
    TaskKey,
    TaskSpec,
    _check_num_microbatches,
    _check_tasks,
    _display_prefixes,
    _name,
    _num_devices,
)

#: A builder: (tasks sorted by (partition, wave), M) -> device -> actions.
Builder = Callable[[Tuple[TaskSpec, ...], int], Dict[int, List[Action]]]


@dataclass(frozen=True)
class ScheduleBuilder:
    """A registered schedule kind.

    Attributes:
        name: the kind, as the config's ``pipeline`` key names it.
        build: ``(tasks, num_microbatches) -> {device: [Action, ...]}``; the
            tasks are checked and sorted by ``(partition, wave)``.
        split_weight: the schedule wants every backward split into B and W
            tasks (``build_tasks(split_weight=True)``).
    """

    name: str
    build: Builder
    split_weight: bool = False


_REGISTRY: Dict[str, ScheduleBuilder] = {}


def register_schedule(name: str, *, split_weight: bool = False) -> Callable[[Builder], Builder]:
    """Registers a schedule builder under `name` (a decorator).

    The config's ``pipeline`` key accepts every registered name, and
    `make_schedule` builds with it; the order it returns is validated (every
    action once, on its task's device, no deadlock) before it is used.

    Args:
        name: the kind; not ``"custom"`` and not already registered.
        split_weight: the builder schedules W tasks (see `ScheduleBuilder`).

    Raises:
        ValueError: a bad or taken name.
    """
    if not isinstance(name, str) or not name.isidentifier() or name == "custom":
        raise ValueError(f"schedule name must be an identifier other than 'custom', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"schedule {name!r} is already registered")

    def decorator(build: Builder) -> Builder:
        _REGISTRY[name] = ScheduleBuilder(name, build, split_weight)
        return build

    return decorator


def schedule_kinds() -> Tuple[str, ...]:
    """The registered schedule kinds, in registration order."""
    return tuple(_REGISTRY)


def schedule_builder(kind: str) -> ScheduleBuilder:
    """The registered builder of `kind`.

    Raises:
        ValueError: `kind` is not registered (``"custom"`` needs
            `custom_schedule`).
    """
    if kind == "custom":
        raise ValueError("kind 'custom' needs an explicit order; use custom_schedule()")
    builder = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if builder is None:
        names = ", ".join(repr(k) for k in _REGISTRY)
        raise ValueError(f"unknown schedule kind {kind!r}; expected one of {names}")
    return builder


@dataclass(frozen=True, repr=False)
class Schedule:
    """Per-device action orders for one training step.

    Attributes:
        kind: the builder's name (`schedule_kinds`) or ``"custom"``.
        num_microbatches: number of micro-batches ``M``.
        tasks: the task set, sorted by ``(partition, wave)``.
        order: device -> its actions, in run order (a device runs the
            tasks whose `TaskSpec.device` it is).

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

    def simulate(self, costs: Optional[Mapping[TaskKey, float]] = None, gap: float = 0.0) -> Simulation:
        """Simulates this schedule (see `simulate`).

        Args:
            costs: optional ``(partition, wave) -> cost`` overriding task costs.
            gap: time from an action being ready to its start (default 0).

        Returns:
            The `Simulation`.

        Raises:
            ScheduleError: the schedule deadlocks.
            ValueError: the schedule or costs are invalid.
        """
        return simulate(self.order, self.tasks, self.num_microbatches, costs, gap)

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
        run = _run(order, deps, lambda a: 1.0)
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

    Every (task, micro-batch) must appear exactly once, on the task's
    device, no action may name an unknown task, and the orders
    must not deadlock (checked by one simulation).

    Args:
        schedule: the schedule to check.

    Raises:
        ValueError: an invalid kind, micro-batch count, task set, or a
            missing, duplicate, misplaced or unknown action.
        ScheduleError: the orders deadlock; the message holds the table with
            the stuck actions marked.
    """
    kinds = schedule_kinds() + ("custom",)
    if schedule.kind not in kinds:
        raise ValueError(f"schedule kind {schedule.kind!r} is not one of {kinds}")
    schedule.simulate()


def make_schedule(tasks: Sequence[TaskSpec], num_microbatches: int, kind: str) -> Schedule:
    """Builds and validates a schedule of a registered kind.

    Args:
        tasks: the task set (at least one task; dependencies must be acyclic).
        num_microbatches: number of micro-batches ``M >= 1``.
        kind: a registered kind (`schedule_kinds`): ``"simple"`` (GPipe),
            ``"interleaved"`` (1F1B) or ``"zero_bubble"`` (ZB-H1), each
            described in its module of `smp_tf.schedules`.

    Returns:
        The `Schedule`, with an (possibly empty) order for every device
        ``0 .. D-1``.

    Raises:
        ValueError: unknown kind (``"custom"`` needs `custom_schedule`), bad
            ``num_microbatches`` or tasks.
        ScheduleError: the order deadlocks (``"simple"`` with a forward task
            that depends on a backward task, or dependencies on higher waves).
    """
    builder = schedule_builder(kind)
    num_microbatches = _check_num_microbatches(num_microbatches)
    tasks = _check_tasks(tasks)
    order = {d: [] for d in range(_num_devices(tasks))}
    order.update(builder.build(tasks, num_microbatches))
    schedule = Schedule(kind, num_microbatches, tasks, dict(sorted(order.items())))
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


