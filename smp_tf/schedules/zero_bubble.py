"""``"zero_bubble"``: ZB-H1 of Qi et al. (ICLR 2024), by list scheduling.

Every backward with weight-gradient work is split into B (what the previous
stage waits for) and W (only weight gradients; ``build_tasks(split_weight=
True)``). The schedule is 1F1B's list schedule with the W actions last in
priority: a device runs a W action only when no B and no allowed F action
is ready, so W actions fill what would be bubbles. A micro-batch stays in
flight until its W is done, so a device holds no more micro-batches than
under 1F1B. With several partitions per device (``virtual_stages``) the W
actions fill the bubbles of the interleaved schedule (in the manner of
ZB-V). Without W tasks it is the interleaved list schedule.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from smp_tf.schedules.base import register_schedule
from smp_tf.schedules.interleaved import list_order
from smp_tf.schedules.tasks import Action, TaskSpec


@register_schedule("zero_bubble", split_weight=True)
def zero_bubble_order(tasks: Tuple[TaskSpec, ...], m: int) -> Dict[int, List[Action]]:
    """`list_order` with W actions deferred into the bubbles."""
    return list_order(tasks, m, defer_weight=True)
