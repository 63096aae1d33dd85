"""Which process holds which stage of which replica (pure Python).

A job of ``size`` processes runs ``replicas = size / pipeline_processes``
pipelines of ``partitions`` stages. Each pipeline spans
``pipeline_processes`` (k) processes; the j-th process of a pipeline (its
``pp_rank``) holds the ``partitions / k`` consecutive stages
``j * partitions / k ...``, one device each. The first process of each
pipeline (``pp_rank`` 0) traces, partitions and drives its pipeline's
steps; the others serve their devices to it.

``placement_strategy`` decides which ranks form a pipeline. Launchers
number ranks host by host, so neighbouring ranks share a host:

* ``"cluster"``: a replica's processes are neighbours, rank
  ``replica * k + j``. A pipeline stays within a host as far as it can, and
  its boundary tensors (sent every micro-batch) cross the fewest links;
  the gradient all-reduce (once per step) crosses hosts.
* ``"spread"``: the processes holding the same stages of every replica are
  neighbours, rank ``j * replicas + replica``. The all-reduce of each
  stage's gradients stays within a host; the pipeline's boundaries cross.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["PipelineLayout"]

_STRATEGIES = ("cluster", "spread")


@dataclass(frozen=True)
class PipelineLayout:
    """The place of every stage of every replica in a job.

    Attributes:
        size: number of processes.
        partitions: stages of each pipeline.
        pipeline_processes: processes each pipeline spans.
        strategy: ``"cluster"`` or ``"spread"`` (module doc).

    Raises:
        ValueError: a count is not a positive integer, `size` is not a
            multiple of `pipeline_processes`, `partitions` is not a multiple
            of `pipeline_processes`, or `strategy` is unknown.
    """

    size: int
    partitions: int
    pipeline_processes: int = 1
    strategy: str = "cluster"

    def __post_init__(self) -> None:
        for name in ("size", "partitions", "pipeline_processes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineLayout.{name} must be a positive integer. Received: {name}={value!r}")
        if self.strategy not in _STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {', '.join(map(repr, _STRATEGIES))}. "
                f"Received: placement_strategy={self.strategy!r}"
            )
        k = self.pipeline_processes
        if self.size % k:
            raise ValueError(
                f"pipeline_processes={k} does not divide the {self.size} processes of the job into whole "
                f"pipelines. Start a multiple of {k} processes, or set pipeline_processes to a divisor of {self.size}."
            )
        if self.partitions % k:
            raise ValueError(
                f"partitions={self.partitions} cannot be shared evenly by pipeline_processes={k}. "
                "Use a number of partitions that is a multiple of pipeline_processes."
            )

    @property
    def replicas(self) -> int:
        """Number of pipelines (data-parallel replicas)."""
        return self.size // self.pipeline_processes

    @property
    def partitions_per_process(self) -> int:
        """Stages (and devices) each process holds."""
        return self.partitions // self.pipeline_processes

    def rank(self, replica: int, pp_rank: int) -> int:
        """The rank of the `pp_rank`-th process of pipeline `replica`."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}). Received: replica={replica}")
        if not 0 <= pp_rank < self.pipeline_processes:
            raise ValueError(f"pp_rank must be in [0, {self.pipeline_processes}). Received: pp_rank={pp_rank}")
        if self.strategy == "spread":
            return pp_rank * self.replicas + replica
        return replica * self.pipeline_processes + pp_rank

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}). Received: rank={rank!r}")

    def dp_rank(self, rank: int) -> int:
        """The replica (pipeline) `rank` belongs to."""
        self._check_rank(rank)
        if self.strategy == "spread":
            return rank % self.replicas
        return rank // self.pipeline_processes

    def pp_rank(self, rank: int) -> int:
        """The position of `rank` in its pipeline, in ``[0, pipeline_processes)``."""
        self._check_rank(rank)
        if self.strategy == "spread":
            return rank // self.replicas
        return rank % self.pipeline_processes

    def stages(self, rank: int) -> Tuple[int, ...]:
        """The stages (partitions) `rank` holds, in order."""
        n = self.partitions_per_process
        first = self.pp_rank(rank) * n
        return tuple(range(first, first + n))

    def driver(self, replica: int) -> int:
        """The rank that drives pipeline `replica` (it holds stage 0)."""
        return self.rank(replica, 0)

    def is_driver(self, rank: int) -> bool:
        """Whether `rank` traces and drives its pipeline."""
        return self.pp_rank(rank) == 0

    def pipeline(self, replica: int) -> Tuple[int, ...]:
        """The ranks of pipeline `replica`, in stage order."""
        return tuple(self.rank(replica, j) for j in range(self.pipeline_processes))

    def placement(self, replica: int) -> List[Tuple[int, int]]:
        """``(rank, local device index)`` of each stage of pipeline `replica`."""
        n = self.partitions_per_process
        return [(self.rank(replica, p // n), p % n) for p in range(self.partitions)]

    def stage_ranks(self, partition: int) -> Tuple[int, ...]:
        """The rank holding `partition` in each replica, in replica order
        (the processes whose gradients of that stage are all-reduced)."""
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition must be in [0, {self.partitions}). Received: partition={partition}")
        j = partition // self.partitions_per_process
        return tuple(self.rank(r, j) for r in range(self.replicas))
