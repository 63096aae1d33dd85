"""``"zero_bubble"``: ZB-H1 of Qi et al. (ICLR 2024).

Every backward with weight-gradient work is split into B (what the previous
stage waits for) and W (only weight gradients; ``build_tasks(split_weight=
True)``).

For a chain (one partition per device, each stage a forward, at most one B
and at most one W, the last stage a fused FB and at most one W) the paper's
order is written out (`zb_h1_order`): 1F1B's warm-up, then forward/B pairs,
stage ``p`` holding back its first ``p`` W actions and running each later W
right after a B, the held-back ones at the end, where the later stages
would otherwise wait for the backward to reach the first. Its bubble is
``(P-1)(F+B-W)`` stage-times against 1F1B's ``(P-1)(F+B+W)``, and no device
holds more micro-batches than 1F1B's first stage (``P``).

Every other task set (skip connections, ``virtual_stages``) is list
scheduled (`list_order` with W actions last in priority): a device runs a
W action only when no B and no allowed F action is ready, so W actions fill
what would be bubbles (with several partitions per device, in the manner
of ZB-V). Without W tasks it is the interleaved list schedule.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from smp_tf.schedules.base import register_schedule
from smp_tf.schedules.interleaved import list_order
from smp_tf.schedules.tasks import Action, TaskKey, TaskKind, TaskSpec, _num_devices

#: stage -> kind -> its task, for a chain split into B and W tasks.
SplitChain = Dict[int, Dict[TaskKind, TaskSpec]]


def split_chain_stages(tasks: Tuple[TaskSpec, ...]) -> Optional[SplitChain]:
    """The stages of `tasks` when it is a chain split into B and W tasks,
    else None.

    A split chain has one partition per device; stage ``p < P-1`` has a
    forward, at most one B and at most one W task, the last stage a fused FB
    and at most one W; at least one W exists; and every task waits only for
    tasks that a chain runs before it: a forward for earlier forwards, FB
    for the forwards, a B for the forwards, FB and the B of later stages, a
    W for what its stage's B may wait for and that B. A traced chain fits
    (its first stage usually has no B: it sends nothing upstream), and so
    does `split_chain_tasks`.
    """
    num_dev = _num_devices(tasks)
    last = num_dev - 1
    stages: SplitChain = {d: {} for d in range(num_dev)}
    for t in tasks:
        if t.device != t.partition or t.kind in stages[t.partition]:
            return None
        stages[t.partition][t.kind] = t
    if not any(TaskKind.WEIGHT in s for s in stages.values()):
        return None
    role: Dict[TaskKey, Tuple[TaskKind, int]] = {}
    for p, s in stages.items():
        main = TaskKind.FUSED if p == last else TaskKind.FORWARD
        allowed = {main, TaskKind.WEIGHT} | ({TaskKind.BACKWARD} if p < last else set())
        if main not in s or set(s) - allowed:
            return None
        role.update((t.key, (k, p)) for k, t in s.items())

    def may_wait(kind: TaskKind, p: int, dep: Tuple[TaskKind, int]) -> bool:
        dk, q = dep
        forwardish = dk is TaskKind.FORWARD or dk is TaskKind.FUSED
        if kind is TaskKind.FORWARD or kind is TaskKind.FUSED:
            return dk is TaskKind.FORWARD and q < p
        if kind is TaskKind.BACKWARD:
            return forwardish or (dk is TaskKind.BACKWARD and q > p)
        # W: what its stage's B may wait for, and that B.
        return forwardish or (dk is TaskKind.BACKWARD and q >= p)

    for t in tasks:
        kind, p = role[t.key]
        if not all(may_wait(kind, p, role[d]) for d in t.deps):
            return None
    return stages


def zb_h1_order(stages: SplitChain, m: int) -> Dict[int, List[Action]]:
    """The ZB-H1 order of a split chain (`split_chain_stages`), ``M = m``.

    Stage ``p`` runs ``min(P-1-p, M)`` warm-up forwards, then for each
    micro-batch ``k`` the next forward (while any is left) and B of ``k``,
    followed by the oldest W not yet run once ``k >= p``; the W actions held
    back run last. The last stage's FB stands for its forward and B. A stage
    without a B or W task skips those actions.
    """
    last = len(stages) - 1
    order: Dict[int, List[Action]] = {}
    for p, s in stages.items():

        def act(kind: TaskKind, i: int) -> List[Action]:
            t = s.get(kind)
            return [Action(t.partition, t.wave, i)] if t is not None else []

        forward = TaskKind.FUSED if p == last else TaskKind.FORWARD
        warm = min(last - p, m)
        seq: List[Action] = []
        for i in range(warm):
            seq += act(forward, i)
        weights = 0
        for k in range(m):
            if warm + k < m:
                seq += act(forward, warm + k)
            seq += act(TaskKind.BACKWARD, k)
            if k >= p:
                seq += act(TaskKind.WEIGHT, weights)
                weights += 1
        for i in range(weights, m):
            seq += act(TaskKind.WEIGHT, i)
        order[p] = seq
    return order


@register_schedule("zero_bubble", split_weight=True)
def zero_bubble_order(tasks: Tuple[TaskSpec, ...], m: int) -> Dict[int, List[Action]]:
    """ZB-H1 for a split chain, else `list_order` with W actions deferred
    into the bubbles."""
    stages = split_chain_stages(tasks)
    if stages is not None:
        return zb_h1_order(stages, m)
    return list_order(tasks, m, defer_weight=True)
