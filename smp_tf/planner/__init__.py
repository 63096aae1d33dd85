"""Planning for the machines a job runs on.

* `resources` — `ResourceGraph`: hosts, devices (kind, memory, speed per
  cost class, per-op overhead) and links (bandwidth, latency); plain Python.
* `calibrate` — this host's graph, measured by a short calibration and
  cached.
* `mapping` — which devices run which stage of which replica (exact for
  small clusters, a stated heuristic beyond); plain Python.

`smp.cluster()` returns the graph a job plans for.
"""

from __future__ import annotations

import functools
from typing import Optional

from smp_tf.planner.resources import ResourceGraph

__all__ = ["cluster", "ResourceGraph"]


def cluster(refresh: bool = False, budget_s: float = 10.0) -> ResourceGraph:
    """The resource graph of the cluster this process plans for.

    With the config key ``cluster`` (a dict or the path of a JSON file, see
    `ResourceGraph.from_dict`), that graph: machines you describe, which
    need not be these. Otherwise this host's devices as `smp.init` set them
    up (or every logical device TensorFlow has, before `smp.init`), measured
    by a short calibration (`smp_tf.planner.calibrate`) and cached.

    Args:
        refresh: measure again even when the calibration is cached.
        budget_s: the calibration's time budget in seconds.

    Returns:
        A `ResourceGraph`; ``print(graph)`` shows its table.
    """
    from smp_tf import state

    given: Optional[str] = state.config().cluster if state.is_initialized() else None
    if given is not None:
        return resource_graph_of(given)
    from smp_tf.planner.calibrate import local_cluster

    return local_cluster(refresh=refresh, budget_s=budget_s)


@functools.lru_cache(maxsize=8)
def resource_graph_of(value: str) -> ResourceGraph:
    """The graph of the config key ``cluster`` (JSON text or a file's path),
    parsed once per value: every step call's compile key reads it."""
    import json

    if value.lstrip().startswith("{"):
        return ResourceGraph.from_dict(json.loads(value))
    return ResourceGraph.from_json(value)
