"""Uneven inputs across replicas: `smp.join`.

When one replica's data ends before the others', the others' next step
waits for it in the gradient all-reduce. Inside ``with smp.join():`` a
replica that finished keeps joining those collectives, contributing nothing
(zero weight), until every replica has finished; the average is over the
replicas that still had data. Then every replica takes the variables of a
replica that finished last (it applied every update), so that all end with
identical weights.

Equivalent sequential description, for replicas with ``n_r`` batches::

    for step in range(max(n_r)):
        running = [r for r in replicas if step < n_r]
        g = mean over r in running of the gradient of replica r's batch
        every running replica applies g
    every replica ends with the variables of a replica with n_r == max(n_r)

With ``uneven_inputs="raise"`` every replica raises at the first step in
which one of them has no data.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from smp_tf import state
from smp_tf.distributed import collectives
from smp_tf.distributed.runtime import ReplicaError

logger = logging.getLogger("smp_tf")

__all__ = ["join", "finish_uneven"]

_JOINS = itertools.count()


def _variables_to_sync() -> List[Any]:
    """Every variable of the live DistributedModels and Keras optimizers, in
    an order that is the same on every rank."""
    from smp_tf.placement import known_optimizers, live_models

    seen, out = set(), []
    for model in sorted(live_models(), key=lambda m: m.name):
        for v in sorted(model.variables, key=lambda v: v.path):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            for v in optimizer.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
    for optimizer in sorted(known_optimizers(), key=lambda o: o.name):
        for v in optimizer.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def _partition_of(variable: Any, devices: Sequence[str]) -> int:
    from smp_tf.placement import partition_of_device

    return partition_of_device(getattr(getattr(variable, "value", variable), "device", ""), devices)


def _uneven_message(rank: int, running: str) -> str:
    return (
        f"smp_tf: rank {rank} ran out of data while {running} replica(s) still had data (uneven inputs, "
        "and uneven_inputs='raise'). Give every replica the same number of batches, or use "
        "uneven_inputs='join'."
    )


def finish_uneven(raise_if_uneven: bool, variables: Optional[Callable[[], List[Any]]] = None) -> int:
    """Joins the other replicas' remaining steps, then equalises the variables.

    Called by a replica whose data ended (every replica calls it once at the
    end of the loop; those that finished together pass through at once).

    Args:
        raise_if_uneven: raise instead of joining when others still have data.
        variables: the variables to equalise (default: those of the live
            DistributedModels and Keras optimizers).

    Returns:
        How many steps of the others this replica joined.

    Raises:
        ReplicaError: with `raise_if_uneven`, when another replica still had data.
    """
    group = state.process_group()
    if group is None or not state.data_parallel():
        return 0
    n = next(_JOINS)
    plan = collectives.last_plan()
    joined = 0
    if plan:
        shadow = collectives.replay(plan)
        while True:
            try:
                running = float(shadow())
            except tf.errors.OpError as e:
                if not raise_if_uneven:
                    raise
                # A replica that still had data ran its step, saw that this
                # one contributed nothing and stopped the collectives before
                # this replica's shadow step finished: the same situation.
                raise ReplicaError(_uneven_message(group.rank, "other")) from e
            if running == 0:
                break
            if raise_if_uneven:
                message = _uneven_message(group.rank, str(int(running)))
                group.report_error(message)
                raise ReplicaError(message)
            joined += 1
    # The replicas that joined the fewest steps finished last: every update
    # was applied there. The lowest such rank gives its variables.
    counts = [int(c) for c in group.allgather(f"join/{n}", str(joined))]
    if max(counts) > 0:
        root = counts.index(min(counts))
        vs = (variables or _variables_to_sync)()
        devices = state.topology().devices
        collectives.broadcast_variables(vs, [_partition_of(v, devices) for v in vs], devices, f"join/{n}", root=root)
        logger.info("smp_tf: rank %d joined %d steps of the others; variables from rank %d", group.rank, joined, root)
    group.barrier(f"join/{n}")
    return joined


class join(contextlib.ContextDecorator):
    """Lets replicas with different amounts of data finish together.

    ::

        with smp.join():
            for x, y in my_shard:          # replicas may have different numbers of batches
                train_on_batch(x, y)       # calls a @smp.step; accumulate() averages over replicas

    Inside the block, a replica whose loop ended first keeps joining the
    gradient all-reduces of the others' remaining steps, contributing
    nothing: each step averages over the replicas that still had data. When
    all are done, every replica takes the variables (model and optimizer) of
    a replica that finished last, so all end identical. Each iteration of
    the loop must run one training step (the one traced last), and every
    replica at least one. Without data parallelism the block does nothing.

    Args:
        uneven_inputs: ``"join"`` (the default: the config's
            ``uneven_inputs``) or ``"raise"``: raise on every replica at the
            first step in which one has no data.

    Raises:
        ValueError: `uneven_inputs` is not ``"join"`` or ``"raise"``.
    """

    def __init__(self, uneven_inputs: Optional[str] = None) -> None:
        if uneven_inputs not in (None, "join", "raise"):
            raise ValueError(f"smp.join(uneven_inputs=...) must be 'join' or 'raise'. Received: {uneven_inputs!r}")
        self.uneven_inputs = uneven_inputs
        self.joined_steps = 0

    def __enter__(self) -> "join":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not state.is_initialized() or not state.data_parallel():
            return False
        if exc is not None:
            if not isinstance(exc, ReplicaError):
                # The others would wait for this replica: make them stop now.
                state.process_group().report_error(
                    f"smp_tf: rank {state.rank()} failed inside smp.join: {type(exc).__name__}: {exc}"
                )
            return False
        cfg = state.config()
        mode = self.uneven_inputs or cfg.uneven_inputs
        # Under shard_optimizer_state each replica owns a piece of the
        # optimizer state: the others cannot update without it.
        self.joined_steps = finish_uneven(mode == "raise" or cfg.shard_optimizer_state)
        return False
