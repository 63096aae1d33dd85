"""``"simple"``: GPipe (Huang et al., 2019).

Each device runs every forward action, then every backward action, each
group sorted by (wave, micro-batch). Every micro-batch's activations stay
alive until the backward phase: the peak is ``M`` micro-batches everywhere.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from smp_tf.schedules.base import register_schedule
from smp_tf.schedules.tasks import Action, TaskSpec, _num_devices


@register_schedule("simple")
def simple_order(tasks: Tuple[TaskSpec, ...], m: int) -> Dict[int, List[Action]]:
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
            group = [t for t in tasks if t.device == d and (t.key in late) == phase]
            order[d].extend(
                sorted((Action(t.partition, t.wave, mb) for t in group for mb in range(m)),
                       key=lambda a: (a.wave, a.microbatch, a.partition))
            )
    return order
