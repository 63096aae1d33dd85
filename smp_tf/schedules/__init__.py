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

The package holds one module per role: `smp_tf.schedules.tasks` (task and
action values, chain task sets), `smp_tf.schedules.simulation` (timing,
tables, deadlock reports), `smp_tf.schedules.base` (`Schedule`, the
registry, `make_schedule`) and one module per builder (``interleaved``,
``simple``, ``zero_bubble``). `register_schedule` adds a builder; the
config's ``pipeline`` key accepts every registered name.
"""

from smp_tf.schedules.base import (
    Schedule,
    ScheduleBuilder,
    custom_schedule,
    make_schedule,
    register_schedule,
    schedule_builder,
    schedule_kinds,
    validate,
)
from smp_tf.schedules.simulation import ScheduleError, Simulation, simulate
from smp_tf.schedules.tasks import (
    Action,
    TaskKind,
    TaskSpec,
    chain_tasks,
    split_chain_tasks,
    virtual_chain_tasks,
)

# The built-in builders register themselves on import, in this order.
from smp_tf.schedules import interleaved as _interleaved  # noqa: E402,F401  isort: skip
from smp_tf.schedules import simple as _simple  # noqa: E402,F401  isort: skip
from smp_tf.schedules import zero_bubble as _zero_bubble  # noqa: E402,F401  isort: skip

__all__ = [
    "TaskKind",
    "TaskSpec",
    "Action",
    "Schedule",
    "ScheduleBuilder",
    "Simulation",
    "ScheduleError",
    "make_schedule",
    "custom_schedule",
    "register_schedule",
    "schedule_builder",
    "schedule_kinds",
    "simulate",
    "validate",
    "chain_tasks",
    "split_chain_tasks",
    "virtual_chain_tasks",
]
