"""Shard specs: how one tensor is laid out over a stage's ``t`` devices.

A stage of the pipeline owns ``t`` devices (``tensor_parallel_degree``),
the mesh axis ``"tensor"``. A tensor on them is, per dimension, either whole
(``None``) or split into ``t`` equal contiguous pieces (``"tensor"``); at
most one dimension is split, since there is one axis to split over. A
tensor can also be a *partial sum*: each device holds an addend and the
value is their sum (what a product over a split contracted dimension
leaves before its all-reduce).

===============  ==========================  ===============================
spec             short form                  device ``k`` holds
===============  ==========================  ===============================
``(None, None)``  ``R``                      the whole tensor
``("tensor", None)``  ``S(0)``               rows ``k*n/t .. (k+1)*n/t``
``(None, "tensor")``  ``S(1)``               that slice of the columns
partial          ``P``                       an addend of the whole tensor
===============  ==========================  ===============================

This module is plain Python (no TensorFlow).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

__all__ = ["TENSOR", "ShardSpec", "parse_spec", "check_divisible"]

#: The one mesh axis a stage's devices form.
TENSOR = "tensor"


@dataclass(frozen=True)
class ShardSpec:
    """The layout of one tensor over a stage's devices (see the module doc).

    Attributes:
        dims: per dimension, ``"tensor"`` (split over the devices) or None
            (whole). Empty for a scalar or a tensor of unknown rank.
        partial: each device holds an addend; the value is their sum.
    """

    dims: Tuple[Optional[str], ...] = ()
    partial: bool = False

    def __post_init__(self) -> None:
        if sum(d == TENSOR for d in self.dims) > 1:
            raise ValueError(f"At most one dimension can be split over the 'tensor' axis. Received: {self.dims}")
        if self.partial and self.split_dim is not None:
            raise ValueError(f"A partial sum is not also split. Received: dims={self.dims}, partial=True")

    @classmethod
    def replicated(cls, rank: int) -> "ShardSpec":
        """Whole on every device."""
        return cls((None,) * max(rank, 0))

    @classmethod
    def split(cls, rank: int, dim: int) -> "ShardSpec":
        """Split along dimension `dim` (negative counts from the end)."""
        if not -rank <= dim < rank:
            raise ValueError(f"Dimension {dim} does not exist in a tensor of rank {rank}.")
        dims = [None] * rank
        dims[dim % rank] = TENSOR
        return cls(tuple(dims))

    @classmethod
    def partial_sum(cls, rank: int) -> "ShardSpec":
        """An addend per device."""
        return cls((None,) * max(rank, 0), partial=True)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def split_dim(self) -> Optional[int]:
        """The split dimension, or None."""
        for i, d in enumerate(self.dims):
            if d == TENSOR:
                return i
        return None

    @property
    def is_replicated(self) -> bool:
        """Whole on every device (neither split nor partial)."""
        return not self.partial and self.split_dim is None

    def __str__(self) -> str:
        if self.partial:
            return "P"
        d = self.split_dim
        return "R" if d is None else f"S({d})"


def parse_spec(value: Any, *, rank: Optional[int] = None, what: str = "spec") -> ShardSpec:
    """A `ShardSpec` from what a user writes: a tuple or list of
    ``"tensor"``/None per dimension, or a `ShardSpec`.

    Raises:
        ValueError: an axis other than ``"tensor"``, several split
            dimensions, or (with `rank`) a spec of another rank.
    """
    if isinstance(value, ShardSpec):
        spec = value
    else:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(
                f"A shard spec is a tuple with one entry per dimension, each 'tensor' or None. "
                f"Received {what}: {value!r}"
            )
        bad = [d for d in value if d is not None and d != TENSOR]
        if bad:
            raise ValueError(
                f"The only mesh axis a tensor dimension can be split over is 'tensor' "
                f"(tensor_parallel_degree); the data and pipeline axes are not sharding axes. "
                f"Received {what}: {tuple(value)!r} with axis {bad[0]!r}."
            )
        if sum(d == TENSOR for d in value) > 1:
            raise ValueError(f"At most one dimension can be split over 'tensor'. Received {what}: {tuple(value)!r}")
        spec = ShardSpec(tuple(value))
    if rank is not None and spec.rank != rank:
        raise ValueError(
            f"The {what} {spec.dims!r} has {spec.rank} entries but the tensor has rank {rank}: "
            f"give one entry ('tensor' or None) per dimension."
        )
    return spec


def check_divisible(spec: ShardSpec, shape: Sequence[Optional[int]], t: int, name: str) -> None:
    """Raises if `spec` splits a dimension of `shape` that `t` does not divide.

    Raises:
        ValueError: naming the tensor or variable, its shape, the dimension
            and `t`.
    """
    d = spec.split_dim
    if d is None or t <= 1:
        return
    size = shape[d]
    if size is not None and size % t:
        raise ValueError(
            f"{name} of shape {tuple(shape)} cannot be split over tensor_parallel_degree={t}: "
            f"dimension {d} has size {size}, which {t} does not divide. Choose a degree that "
            f"divides it, or leave that dimension whole (None)."
        )
