"""``"interleaved"``: 1F1B (PipeDream-Flush), and Megatron-LM's interleaved
1F1B when devices hold several partitions (``virtual_stages``).

For a plain chain the classic order is written out (`classic_1f1b_order`);
every other task set, skip connections and virtual stages included, is list
scheduled on the task costs (`list_order`).
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Set, Tuple

from smp_tf.schedules.base import register_schedule
from smp_tf.schedules.simulation import ScheduleError
from smp_tf.schedules.tasks import Action, TaskKey, TaskSpec, _num_devices, chain_tasks, virtual_chain_tasks


def _shape(tasks) -> List[tuple]:
    """Each task's key, kind, device and every task it waits for, directly or
    not: two task sets of one shape admit the same orders. (A traced chain's
    backward also reads the previous stage's forward output directly, a
    dependency the chain implies anyway.)"""
    by_key = {t.key: t for t in tasks}
    ancestors: Dict[TaskKey, frozenset] = {}

    def up(k: TaskKey) -> frozenset:
        if k not in ancestors:
            deps = by_key[k].deps
            ancestors[k] = frozenset(deps).union(*(up(d) for d in deps))
        return ancestors[k]

    return sorted((t.key, up(t.key), t.kind, t.device) for t in tasks)


def is_chain(tasks: Tuple[TaskSpec, ...]) -> bool:
    """Whether `tasks` has the shape of `chain_tasks` of some P (one
    partition per device), whatever the costs."""
    return _shape(tasks) == _shape(chain_tasks(_num_devices(tasks)))


def classic_1f1b_order(num_stages: int, m: int) -> Dict[int, List[Action]]:
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


def is_virtual_chain(tasks: Tuple[TaskSpec, ...]) -> bool:
    """Whether `tasks` has the shape of `virtual_chain_tasks` of some D and
    v > 1, whatever the costs."""
    num_dev = _num_devices(tasks)
    chunks = len({t.partition for t in tasks})
    if chunks <= num_dev or chunks % num_dev:
        return False

    return _shape(tasks) == _shape(virtual_chain_tasks(num_dev, chunks // num_dev))


def megatron_interleaved_order(num_devices: int, virtual_stages: int, m: int) -> Dict[int, List[Action]]:
    """Megatron-LM's interleaved 1F1B order of `virtual_chain_tasks`
    (Narayanan et al., SC 2021); needs ``M`` to be a multiple of the number
    of devices ``D``.

    Device ``d`` holds chunks ``d, d + D, ...``. Its k-th forward runs chunk
    ``(k mod Dv) div D`` for micro-batch ``(k div Dv) D + k mod D``: groups
    of D micro-batches pass through its chunks depth first; backwards run
    the chunks in reverse. It runs ``2 (D - 1 - d) + (v - 1) D`` warm-up
    forwards, then forward/backward pairs, then the cool-down backwards. On
    the last device the forward of the last chunk is always followed at once
    by its backward: that pair is the fused task.
    """
    D, v = num_devices, virtual_stages
    total = m * v
    last = D * v - 1

    def mb(k: int) -> int:
        return (k // (D * v)) * D + k % D

    def chunk(k: int, forward: bool) -> int:
        j = (k % (D * v)) // D
        return j if forward else v - 1 - j

    order: Dict[int, List[Action]] = {}
    for d in range(D):
        fwd, bwd = [], []
        for k in range(total):
            p = chunk(k, True) * D + d
            fwd.append(Action(p, p, mb(k)))
            p = chunk(k, False) * D + d
            bwd.append(None if p == last else Action(p, 2 * last - p, mb(k)))
        warm = min(2 * (D - 1 - d) + (v - 1) * D, total)
        seq = fwd[:warm]
        for i in range(total - warm):
            seq += [fwd[warm + i], bwd[i]]
        seq += bwd[total - warm:]
        # The fused last chunk has no separate backward.
        order[d] = [a for a in seq if a is not None]
    return order


def in_flight_limits(tasks: Tuple[TaskSpec, ...]) -> Dict[int, int]:
    """Device -> how many (partition, micro-batch) pairs it may hold in flight.

    With one partition per device, device ``d`` of ``D`` holds ``D - d``
    micro-batches: its activations must live until the backward comes back
    through the ``D - 1 - d`` later stages, and ``D - d`` in flight is just
    enough to stay busy meanwhile (1F1B). With ``v`` partitions per device
    it is Megatron-LM's interleaved warm-up plus one, ``2 (D - 1 - d) +
    (v - 1) D + 1`` partition-micro-batches, each holding ``1 / v`` of the
    device's activations.
    """
    num_dev = _num_devices(tasks)
    per_device = max(len({t.partition for t in tasks if t.device == d}) for d in range(num_dev))
    if per_device <= 1:
        return {d: num_dev - d for d in range(num_dev)}
    return {d: 2 * (num_dev - 1 - d) + (per_device - 1) * num_dev + 1 for d in range(num_dev)}


def list_order(tasks: Tuple[TaskSpec, ...], m: int, defer_weight: bool = False) -> Dict[int, List[Action]]:
    """1F1B by list scheduling on the task costs.

    Whenever a device is idle it starts, among its ready actions, a backward
    one first: finishing a micro-batch frees its activations. Otherwise a
    forward one, but a (partition, micro-batch) pair not yet in flight on
    its device may only start while fewer than the device's limit
    (`in_flight_limits`) are. For a chain with balanced stage costs this
    yields the classic 1F1B order (``min(P-1-p, M)`` warm-up forwards, then
    forward/backward pairs, then the cool-down backwards).

    Among ready actions of one kind the lowest micro-batch goes first (then
    the lowest wave). When a device holds several partitions (virtual
    stages) micro-batches go in groups of ``D`` (the number of devices), and
    within a group the lowest wave goes first: a group passes through a
    device's first chunk, then its second, ..., depth first, as in
    Megatron-LM's interleaved schedule.

    With `defer_weight`, weight (``W``) actions come last: a device runs one
    only when no B and no allowed F action is ready, so they fill what would
    be bubbles; a micro-batch stays in flight until its W is done, so the
    in-flight limits hold (``zero_bubble``). The exception is the device
    that computes the loss (holds a fused task): there a ready W goes before
    a forward, so its micro-batches leave flight at once and the forwards
    it lets through reach the loss no later (in the simulator this halves
    the bubble of ``virtual_stages: 2`` at P=8, M=32, and changes nothing on
    plain chains).

    When nothing can start and nothing runs while work remains, the lowest
    device with a ready forward action starts it beyond its limit, so the
    build always completes. The start order on each device is the schedule.
    """
    num_dev = _num_devices(tasks)
    by_key = {t.key: t for t in tasks}
    users: Dict[TaskKey, List[TaskKey]] = {k: [] for k in by_key}
    for t in tasks:
        for d in t.deps:
            users[d].append(t.key)
    tasks_of_partition: Dict[int, int] = {}
    for t in tasks:
        tasks_of_partition[t.partition] = tasks_of_partition.get(t.partition, 0) + 1
    virtual = len(tasks_of_partition) > num_dev
    group = num_dev if virtual else 1
    # Unfinished dependencies of each (task, micro-batch).
    waiting = {(t.key, mb): len(t.deps) for t in tasks for mb in range(m)}
    # Ready actions per device, one list per kind (backward, deferred
    # weight, forward), each in the order its actions became ready: `pick`
    # runs for every idle device at every step of the build, and reads one
    # list instead of sorting all of a device's ready actions by kind.
    deferred_keys = {k for k, t in by_key.items() if defer_weight and t.weight}
    kind_of = {k: ("W" if k in deferred_keys else "B" if t.backward else "F") for k, t in by_key.items()}
    ready: Dict[str, Dict[int, List[Action]]] = {c: {d: [] for d in range(num_dev)} for c in "BWF"}
    for t in tasks:
        if not t.deps:
            ready[kind_of[t.key]][t.device].extend(Action(t.partition, t.wave, mb) for mb in range(m))
    ready_b, ready_w, ready_f = ready["B"], ready["W"], ready["F"]

    def any_ready(d: int) -> bool:
        return bool(ready_b[d] or ready_w[d] or ready_f[d])

    left = {(p, mb): n for p, n in tasks_of_partition.items() for mb in range(m)}
    inflight: Dict[int, Set[Tuple[int, int]]] = {d: set() for d in range(num_dev)}
    limit = in_flight_limits(tasks)
    busy = {d: False for d in range(num_dev)}
    order: Dict[int, List[Action]] = {d: [] for d in range(num_dev)}
    events: List[Tuple[float, int, Action]] = []
    seq = 0
    now = 0.0
    remaining = len(tasks) * m

    def priority(a: Action) -> Tuple[int, int, int]:
        return (a.microbatch // group, a.wave, a.microbatch)

    loss_devices = {t.device for t in tasks if t.fused}

    def pick(d: int, relax: bool) -> Optional[Action]:
        bwd = ready_b[d]
        if bwd:
            return min(bwd, key=priority)
        deferred = ready_w[d]
        if deferred and d in loss_devices:
            return min(deferred, key=priority)
        held = inflight[d]
        room = relax or len(held) < limit[d]
        fwd = ready_f[d] if room else [a for a in ready_f[d] if (a.partition, a.microbatch) in held]
        if fwd:
            return min(fwd, key=priority)
        # W actions wait for a gap: nothing on the critical path is ready.
        return min(deferred, key=priority) if deferred else None

    def begin(d: int, a: Action) -> None:
        nonlocal seq
        ready[kind_of[(a.partition, a.wave)]][d].remove(a)
        order[d].append(a)
        inflight[d].add((a.partition, a.microbatch))
        busy[d] = True
        heapq.heappush(events, (now + by_key[a.task].cost, seq, a))
        seq += 1

    while remaining:
        for d in range(num_dev):
            # Nothing ready: nothing to pick.
            if not busy[d] and any_ready(d):
                a = pick(d, relax=False)
                if a is not None:
                    begin(d, a)
        if not events:
            for d in range(num_dev):
                a = pick(d, relax=True) if any_ready(d) else None
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
            d = by_key[a.task].device
            busy[d] = False
            remaining -= 1
            left[(a.partition, a.microbatch)] -= 1
            if left[(a.partition, a.microbatch)] == 0:
                inflight[d].discard((a.partition, a.microbatch))
            for u in users[a.task]:
                waiting[(u, a.microbatch)] -= 1
                if waiting[(u, a.microbatch)] == 0:
                    ready[kind_of[u]][by_key[u].device].append(Action(u[0], u[1], a.microbatch))
    return order


@register_schedule("interleaved")
def interleaved_order(tasks: Tuple[TaskSpec, ...], m: int) -> Dict[int, List[Action]]:
    """1F1B: the classic order for a plain chain, Megatron-LM's interleaved
    order for a chain cut into virtual stages (when ``M`` is a multiple of
    the number of devices), `list_order` for any other task set."""
    if is_chain(tasks):
        return classic_1f1b_order(_num_devices(tasks), m)
    num_dev = _num_devices(tasks)
    if m % num_dev == 0 and is_virtual_chain(tasks):
        return megatron_interleaved_order(num_dev, len({t.partition for t in tasks}) // num_dev, m)
    return list_order(tasks, m)
