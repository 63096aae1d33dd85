"""Communication helpers: barriers and Python objects between processes.

As in the SageMaker library: `barrier`, `mp_barrier`, `dp_barrier`,
`broadcast`, `allgather`, `send`, `recv_from`, with the groups and rank
types of `CommGroup` and `RankType`. They run on TensorFlow's coordination
service (its barriers and key-value store), the runtime the collectives use,
and every wait is bounded by the config's ``dp_timeout``.

In smp_tf a process drives a whole pipeline replica, so the model-parallel
group of a process is the process itself (``MP_GROUP`` has one member,
``MP_RANK`` 0), and the data-parallel group is every process (``DP_GROUP``
equals ``WORLD``; ``DP_RANK`` equals ``WORLD_RANK``). With one process every
helper works locally.
"""

from __future__ import annotations

import base64
import collections
import enum
import itertools
import pickle
from typing import Any, Dict, List

from smp_tf import state

__all__ = [
    "CommGroup",
    "RankType",
    "barrier",
    "mp_barrier",
    "dp_barrier",
    "broadcast",
    "allgather",
    "send",
    "recv_from",
]


class CommGroup(enum.Enum):
    """A group of processes: every process, the model-parallel group of this
    process (itself), or the data-parallel group (every process)."""

    WORLD = 0
    MP_GROUP = 1
    DP_GROUP = 2


class RankType(enum.Enum):
    """How a rank is numbered: among all processes, within the model-parallel
    group (always 0), or within the data-parallel group (= world rank)."""

    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2


_counters: Dict[str, "itertools.count[int]"] = collections.defaultdict(itertools.count)
_local_mailbox: "collections.deque[Any]" = collections.deque()


def _check_group(group: Any) -> CommGroup:
    if not isinstance(group, CommGroup):
        raise ValueError(f"Expected a smp.CommGroup (WORLD, MP_GROUP or DP_GROUP). Received: group={group!r}")
    return group


def _distributed(group: CommGroup) -> bool:
    state.config()  # raises before smp.init
    return group != CommGroup.MP_GROUP and state.process_group() is not None


def _encode(obj: Any) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def _decode(text: str) -> Any:
    return pickle.loads(base64.b64decode(text.encode("ascii")))


def barrier(group: CommGroup = CommGroup.WORLD) -> None:
    """Waits until every process of `group` reached this barrier.

    Raises:
        ReplicaError: a process did not arrive within ``dp_timeout``.
    """
    group = _check_group(group)
    if _distributed(group):
        state.process_group().barrier(f"barrier/{group.name}/{next(_counters['barrier/' + group.name])}")


def mp_barrier() -> None:
    """A barrier of the model-parallel group (this process: returns at once)."""
    barrier(CommGroup.MP_GROUP)


def dp_barrier() -> None:
    """A barrier of the data-parallel group (every process)."""
    barrier(CommGroup.DP_GROUP)


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD) -> None:
    """Sends a picklable `obj` to every other process of `group`.

    Each of them receives it with ``smp.recv_from(sender_rank, smp.RankType.WORLD_RANK)``
    (or ``DP_RANK``), as in the SageMaker library.
    """
    group = _check_group(group)
    if not _distributed(group):
        return
    for r in range(state.size()):
        if r != state.rank():
            send(obj, r, RankType.WORLD_RANK)


def allgather(obj: Any, group: CommGroup = CommGroup.WORLD) -> List[Any]:
    """Every process's picklable `obj`, in rank order (every process of
    `group` must call it)."""
    group = _check_group(group)
    if not _distributed(group):
        return [obj]
    n = next(_counters["allgather/" + group.name])
    texts = state.process_group().allgather(f"allgather/{group.name}/{n}", _encode(obj))
    return [_decode(t) for t in texts]


def _world_rank(rank: int, rank_type: RankType) -> int:
    if not isinstance(rank_type, RankType):
        raise ValueError(f"Expected a smp.RankType. Received: rank_type={rank_type!r}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"Expected an int rank. Received: {rank!r}")
    if rank_type == RankType.MP_RANK:
        if rank != 0:
            raise ValueError(
                f"MP_RANK {rank} does not exist: a process drives its whole pipeline, so its model-parallel "
                "group has one member, MP_RANK 0 (itself)."
            )
        return state.rank()
    if not 0 <= rank < state.size():
        raise ValueError(f"Rank {rank} does not exist; there are {state.size()} processes (ranks 0..{state.size() - 1}).")
    return rank


def send(obj: Any, dest_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> None:
    """Sends a picklable `obj` to process `dest_rank` (numbered by `rank_type`)."""
    dest = _world_rank(dest_rank, rank_type)
    me = state.rank()
    if dest == me:
        _local_mailbox.append(obj)
        return
    n = next(_counters[f"send/{me}/{dest}"])
    state.process_group().put(f"p2p/{me}/{dest}/{n}", _encode(obj))


def recv_from(src_rank: int, rank_type: RankType = RankType.WORLD_RANK) -> Any:
    """Receives the next object `src_rank` sent to this process (waits for it,
    up to ``dp_timeout``)."""
    src = _world_rank(src_rank, rank_type)
    me = state.rank()
    if src == me:
        if not _local_mailbox:
            raise ValueError("No object was sent to this process by itself.")
        return _local_mailbox.popleft()
    n = next(_counters[f"recv/{src}/{me}"])
    pg = state.process_group()
    key = f"p2p/{src}/{me}/{n}"
    value = _decode(pg.get(key))
    pg.delete(key)
    return value
