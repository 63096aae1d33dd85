"""Tasks and actions: what a schedule orders.

A `TaskSpec` is the scheduling view of one task (the ops of one partition in
one wave); an `Action` runs one task for one micro-batch. `chain_tasks`,
`split_chain_tasks` and `virtual_chain_tasks` build the task sets of plain
chains, for simulations and tests.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

TaskKey = Tuple[int, int]


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as a partition index is always a bug.
    return isinstance(x, int) and not isinstance(x, bool)


class TaskKind(enum.Enum):
    """What a task computes; the value is its label in schedule tables.

    * ``FORWARD`` (``F``): forward ops only.
    * ``BACKWARD`` (``B``): gradient ops: the gradients of the task's inputs,
      which the previous stage waits for, and, unless split off into a W
      task, the weight gradients.
    * ``WEIGHT`` (``W``): the part of a backward that leads only to weight
      gradients, split from its B task (``zero_bubble`` runs it in a bubble).
    * ``FUSED`` (``FB``): forward and backward in one task (the last stage
      of a chain, where the backward follows the forward at once).
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    FUSED = "FB"

    def __str__(self) -> str:
        return self.value

    @property
    def backward(self) -> bool:
        """The task holds gradient ops (every kind but ``FORWARD``)."""
        return self is not TaskKind.FORWARD


class KindFlags:
    """``backward``, ``fused`` and ``weight``, read from ``self.kind`` (a
    `TaskKind`); shared by `TaskSpec` and the lowering's tasks."""

    kind: TaskKind

    @property
    def backward(self) -> bool:
        """The task holds gradient ops (``B``, ``W`` and ``FB``)."""
        return self.kind.backward

    @property
    def fused(self) -> bool:
        """Forward and backward in one task (``FB``)."""
        return self.kind is TaskKind.FUSED

    @property
    def weight(self) -> bool:
        """A weight-gradient task (``W``)."""
        return self.kind is TaskKind.WEIGHT


@dataclass(frozen=True)
class TaskSpec(KindFlags):
    """One task: the ops of one partition at one wave, for any micro-batch.

    Attributes:
        partition: the partition that owns the task's ops.
        wave: number of partition boundaries on the longest path into the task.
        deps: ``(partition, wave)`` of the tasks this one needs, same micro-batch.
        cost: abstract cost, used by simulations and by the list-scheduling
            builders to decide which action becomes ready first.
        kind: a `TaskKind` (or its label, ``"F"``, ``"B"``, ``"W"``, ``"FB"``).
        device: the device that runs the task; defaults to ``partition``.
            With ``virtual_stages`` v, partition (chunk) ``c`` runs on device
            ``c % P`` and a device runs the tasks of v partitions.

    Raises:
        ValueError: negative or non-integer partition/wave/device, a
            negative or non-finite cost, a malformed or self dependency, or
            an unknown kind.
    """

    partition: int
    wave: int
    deps: Tuple[TaskKey, ...] = ()
    cost: float = 1.0
    kind: TaskKind = TaskKind.FORWARD
    device: Optional[int] = None

    def __post_init__(self) -> None:
        if not _is_int(self.partition) or self.partition < 0:
            raise ValueError(f"TaskSpec partition must be an int >= 0, got {self.partition!r}")
        if not _is_int(self.wave) or self.wave < 0:
            raise ValueError(f"TaskSpec wave must be an int >= 0, got {self.wave!r}")
        device = self.partition if self.device is None else self.device
        if not _is_int(device) or device < 0:
            raise ValueError(f"TaskSpec device must be an int >= 0 or None, got {self.device!r}")
        try:
            kind = TaskKind(self.kind)
        except ValueError:
            labels = ", ".join(repr(k.value) for k in TaskKind)
            raise ValueError(
                f"TaskSpec ({self.partition}, {self.wave}) has kind {self.kind!r}; expected a TaskKind or one of "
                f"{labels}"
            ) from None
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
        # Normalise so equal tasks compare and hash equal whatever was passed.
        object.__setattr__(self, "deps", tuple(dict.fromkeys(deps)))
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "device", device)

    @property
    def key(self) -> TaskKey:
        """``(partition, wave)``."""
        return (self.partition, self.wave)

    @property
    def label(self) -> str:
        """``"F"``, ``"B"``, ``"W"`` or ``"FB"`` (the kind's value)."""
        return self.kind.value



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
        count[(t.device, t.label)] = count.get((t.device, t.label), 0) + 1
    return {
        t.key: (t.label, f"w{t.wave}" if count[(t.device, t.label)] > 1 else "")
        for t in tasks
    }


def _name(a: Action, names: Dict[TaskKey, Tuple[str, str]]) -> str:
    label, suffix = names.get(a.task, ("?", f"w{a.wave}"))
    return f"{label}{a.microbatch}{suffix}"


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
    return 1 + max(t.device for t in tasks)


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
            TaskSpec(p, 2 * p_last - p, deps=(nxt, (p, p)), cost=backward_cost, kind=TaskKind.BACKWARD)
        )
    tasks.append(
        TaskSpec(
            p_last,
            p_last,
            deps=((p_last - 1, p_last - 1),) if p_last > 0 else (),
            cost=forward_cost + backward_cost,
            kind=TaskKind.FUSED,
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
            tasks.append(TaskSpec(p, 2 * last + 1 + p, deps=(t.key,), cost=weight_grad_cost,
                                  kind=TaskKind.WEIGHT))
    return sorted(tasks, key=lambda t: t.key)



def virtual_chain_tasks(
    num_devices: int,
    virtual_stages: int,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
) -> List[TaskSpec]:
    """The task set of a chain cut into ``num_devices * virtual_stages``
    chunks, chunk ``c`` on device ``c % num_devices`` (Megatron-LM's
    interleaved layout).

    Each chunk is `chain_tasks`' stage with ``1 / virtual_stages`` of the
    costs, so the work per device is that of `chain_tasks(num_devices)`.

    Raises:
        ValueError: ``num_devices < 1``, ``virtual_stages < 1`` or a bad cost.
    """
    if not _is_int(num_devices) or num_devices < 1:
        raise ValueError(f"num_devices must be an int >= 1, got {num_devices!r}")
    if not _is_int(virtual_stages) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be an int >= 1, got {virtual_stages!r}")
    chain = chain_tasks(num_devices * virtual_stages, forward_cost / virtual_stages, backward_cost / virtual_stages)
    return [dataclasses.replace(t, device=t.partition % num_devices) for t in chain]
