"""Pieces of a variable over the data-parallel replicas (plain Python).

Under ``shard_optimizer_state`` each of R replicas owns one piece of every
variable of its pipeline: the variable's elements in row-major order,
padded with zeros to a multiple of R, cut into R equal runs; replica r owns
run r. A flat cut divides every shape (a bias of 10 elements over 4
replicas: pieces of 3, the last one padded by 2), and an element-wise
optimizer update of a piece computes each element exactly as the update of
the whole variable does; the padding is zeros, which every built-in
element-wise update leaves zero.

Example, 10 elements over 4 replicas::

    elements  0 1 2 | 3 4 5 | 6 7 8 | 9 . .
    replica     0       1       2       3      (. = padding)

A gradient reduced to its pieces (`smp_tf.distributed.collectives`) is a
1-D tensor of `Piece.length` elements; `register` remembers which
variable's piece a tensor is, so that the optimizer update can tell a
piece from a whole gradient.

Under tensor parallelism a split variable's gradient is accumulated in its
pieces over the devices of its stage (`SplitGradient`): the tensor handed to
the optimizer is their concatenation, which the update of a split variable
never reads (it updates piece k with gradient piece k on device k), so
inside a ``tf.function`` the whole gradient is never made.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["Piece", "SplitGradient", "piece_length", "piece_bounds", "register", "piece_of", "register_split",
           "split_of", "forget_all"]


def piece_length(n: int, replicas: int) -> int:
    """Elements of each replica's piece of a variable of `n` elements (the
    last piece padded): ``ceil(n / replicas)``."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1. Received: replicas={replicas}")
    return -(-int(n) // int(replicas))


def piece_bounds(n: int, replicas: int, rank: int) -> Tuple[int, int]:
    """The elements ``[start, stop)`` of the variable that replica `rank`'s
    piece holds (``stop - start`` is less than `piece_length` for the
    padded last pieces, and may be 0)."""
    if not 0 <= rank < replicas:
        raise ValueError(f"rank must be in [0, {replicas}). Received: rank={rank}")
    k = piece_length(n, replicas)
    start = min(rank * k, n)
    return start, min(start + k, n)


@dataclass(frozen=True)
class Piece:
    """Replica `rank`'s piece of a variable of shape `shape` over `replicas`.

    Attributes:
        shape: the whole variable's shape.
        replicas: the data-parallel replicas the variable is divided over.
        rank: the replica owning this piece.
    """

    shape: Tuple[int, ...]
    replicas: int
    rank: int

    @property
    def size(self) -> int:
        """Elements of the whole variable."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def length(self) -> int:
        """Elements of the piece, padding included."""
        return piece_length(self.size, self.replicas)


@dataclass(frozen=True)
class SplitGradient:
    """A gradient held in pieces over the devices of a tensor-parallel stage.

    Attributes:
        axis: the dimension the pieces split.
        pieces: the pieces, piece k on device k of the stage.
    """

    axis: int
    pieces: Tuple[Any, ...]


# id(tensor) -> (tensor, Piece): the tensor is held so that its id stays its own
# until the registry forgets it (at the next emitted step).
_REGISTRY: Dict[int, Tuple[Any, Piece]] = {}
# id(tensor) -> (weak reference to it, SplitGradient): a split gradient is
# known as long as its tensor lives (dead entries go at the next
# registration).
_SPLIT: Dict[int, Tuple[Any, SplitGradient]] = {}


def register(tensor: Any, piece: Piece) -> Any:
    """Marks `tensor` as the reduced gradient piece `piece`; returns it."""
    _REGISTRY[id(tensor)] = (tensor, piece)
    return tensor


def piece_of(tensor: Any) -> Optional[Piece]:
    """The `Piece` that `tensor` was registered as, or None."""
    entry = _REGISTRY.get(id(tensor))
    return entry[1] if entry is not None and entry[0] is tensor else None


def register_split(tensor: Any, axis: int, pieces: Any) -> Any:
    """Marks `tensor` (the concatenation of `pieces` along `axis`) as a
    gradient held in those pieces; returns it."""
    for key in [k for k, (ref, _) in _SPLIT.items() if ref() is None]:
        del _SPLIT[key]
    _SPLIT[id(tensor)] = (weakref.ref(tensor), SplitGradient(int(axis), tuple(pieces)))
    return tensor


def split_of(tensor: Any) -> Optional[SplitGradient]:
    """The `SplitGradient` that `tensor` was registered as, or None."""
    entry = _SPLIT.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


def forget_all() -> None:
    """Forgets every registered piece of the data-parallel replicas (a new
    step is being emitted)."""
    _REGISTRY.clear()
