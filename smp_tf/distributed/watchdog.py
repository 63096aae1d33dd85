"""Stops every replica when one stops joining the collectives.

The coordination service's heartbeats catch a replica that died or whose
process hangs. A replica that is alive but never reaches the next step (a
data loader that hangs, a deadlock in Python) still sends heartbeats, and
the others would wait in the step's all-reduce forever. So every
data-parallel step publishes, as it starts, its number in the coordination
service's store (a small callback ahead of the step's first collective),
and a watchdog thread looks, once a second, at how long this replica has
been inside its current step. Past ``dp_timeout`` seconds, the replicas that
have not started that step are the stalled ones: the watchdog aborts the
collectives of every replica with an error that names them.

The first step of each process is not watched: it traces and partitions the
model, which can take longer than the timeout on one replica than another.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

logger = logging.getLogger("smp_tf")

__all__ = ["Watchdog", "watchdog"]


class Watchdog:
    """Per process: the step this replica is in, and the thread that watches it.

    Args:
        group: the `ProcessGroup`.
        timeout: seconds a step may wait for the others.
    """

    def __init__(self, group: object, timeout: float) -> None:
        self.group = group
        self.timeout = float(timeout)
        self.step = 0
        self.started: Optional[float] = None
        self.lock = threading.Lock()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="smp_tf-watchdog", daemon=True)
        self._thread.start()

    def step_started(self) -> None:
        """Called as a data-parallel step starts (from inside the graph)."""
        with self.lock:
            self.step += 1
            self.started = time.monotonic()
            step = self.step
        try:
            # One key per step (the store does not overwrite keys); the key
            # of two steps ago is no longer needed.
            self.group.put(f"progress/{self.group.rank}/{step}", "1")
            if step > 2:
                self.group.delete(f"progress/{self.group.rank}/{step - 2}")
        except Exception:  # noqa: BLE001 - the cluster is failing; the step will say why
            pass

    def step_finished(self) -> None:
        with self.lock:
            self.started = None

    def behind(self, step: int) -> List[int]:
        """The ranks that have not started `step`."""
        from tensorflow.python.eager import context

        out = []
        for r in range(self.group.size):
            if r == self.group.rank:
                continue
            try:
                context.context().get_config_key_value(f"smp_tf/progress/{r}/{step}", 1000)
            except Exception:  # noqa: BLE001 - not published within a second: not started
                out.append(r)
        return out

    def _watch(self) -> None:
        while not self.fired:
            time.sleep(1.0)
            with self.lock:
                started, step = self.started, self.step
            if started is None or step < 2 or time.monotonic() - started < self.timeout:
                continue
            stalled = self.behind(step)
            if not stalled:
                continue
            self.fired = True
            message = (
                f"smp_tf: rank {self.group.rank} waited more than {self.timeout:.0f} s (dp_timeout) in "
                f"data-parallel step {step}; rank(s) {stalled} have not started it (stalled or stopped "
                "joining the collectives)"
            )
            logger.error(message)
            self.group.report_error(message)
            try:
                from tensorflow.python.eager import context

                context.context().abort_collective_ops(10, message)  # ABORTED
            except Exception:  # noqa: BLE001
                pass


_WATCHDOG: Optional[Watchdog] = None


def watchdog() -> Optional[Watchdog]:
    """The process's watchdog (created with the first data-parallel step)."""
    global _WATCHDOG
    # The group `smp.init` joined (the one `state.process_group()` returns),
    # read from the runtime so that this module does not import the state.
    from smp_tf.distributed import runtime

    group = runtime.group()
    if group is None or not getattr(group, "coordinated", True):
        # Drivers of pipelines that span processes: their stage watchdog
        # (`remote`) watches every process of the job instead.
        return None
    if _WATCHDOG is None or _WATCHDOG.group is not group:
        _WATCHDOG = Watchdog(group, group.timeout)
    return _WATCHDOG


def step_marker():
    """An op that tells the watchdog a data-parallel step starts; the step's
    first collectives run after it."""
    import tensorflow as tf

    dog = watchdog()
    if dog is None:
        return None

    def mark():
        dog.step_started()
        return 0

    with tf.device("/device:CPU:0"):
        return tf.py_function(mark, [], tf.int32, name="smp_tf_step_started")
