"""Reshards: the collective steps that take a tensor from one layout to another.

=========  =========  ===============================  ==========================
from       to         steps                            bytes each device receives
=========  =========  ===============================  ==========================
``R``      ``S(d)``   split (local slice)              0
``S(d)``   ``R``      all-gather                       (t-1)/t of the tensor
``P``      ``R``      all-reduce                       2 (t-1)/t of the tensor
``P``      ``S(d)``   reduce-scatter                   (t-1)/t of the tensor
``S(d)``   ``S(e)``   all-gather, then split           (t-1)/t of the tensor
=========  =========  ===============================  ==========================

The byte counts are those of a ring (the lower bound any all-reduce
reaches on a bandwidth-bound link); the pieces of a partial sum are added
in device order, ``((p0 + p1) + p2) + ...``, so that a run repeats itself
bit for bit. Plain Python.
"""

from __future__ import annotations

from typing import Tuple

from smp_tf.sharding.spec import ShardSpec

__all__ = ["reshard_steps", "reshard_bytes"]


def reshard_steps(src: ShardSpec, dst: ShardSpec) -> Tuple[str, ...]:
    """The steps from layout `src` to `dst` (see the module table).

    Raises:
        ValueError: for a partial sum as the target (no op needs one of a
            whole tensor) or specs of different ranks.
    """
    if src == dst:
        return ()
    if dst.partial:
        raise ValueError(f"No reshard makes a partial sum: from {src} to {dst}.")
    if src.rank != dst.rank:
        raise ValueError(f"Cannot reshard between ranks {src.rank} and {dst.rank} ({src} -> {dst}).")
    if src.partial:
        return ("all_reduce",) if dst.is_replicated else ("reduce_scatter",)
    if src.is_replicated:
        return ("split",)
    if dst.is_replicated:
        return ("all_gather",)
    return ("all_gather", "split")


def reshard_bytes(src: ShardSpec, dst: ShardSpec, nbytes: int, t: int) -> float:
    """Bytes each device receives to reshard a tensor of `nbytes` bytes
    (ring algorithms; see the module table)."""
    if t <= 1:
        return 0.0
    per = {"split": 0.0, "all_gather": (t - 1) / t, "all_reduce": 2 * (t - 1) / t, "reduce_scatter": (t - 1) / t}
    return float(sum(per[s] for s in reshard_steps(src, dst)) * nbytes)
