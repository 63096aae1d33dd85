"""The registry of sharding rules and what every rule shares: `OpInfo`,
`Decision`, `register_rule`, and the spec helpers of the rule modules.

Plain Python; no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from smp_tf.sharding.spec import ShardSpec

__all__ = ["OpInfo", "Decision", "Shape", "ShardSpec", "register_rule", "rule_for", "back_rule_for"]

Shape = Optional[Tuple[Optional[int], ...]]


@dataclass(frozen=True)
class OpInfo:
    """What a rule reads of an op.

    Attributes:
        name: the op's name.
        type: its type (``"MatMul"``).
        attrs: its attributes as plain values (``{"transpose_a": False}``).
        input_shapes: static shape of each data input (None: unknown rank).
        output_shapes: static shape of each output.
        const_inputs: position -> value (a list or a number) of the inputs
            that are constants (a reduction's axes, a transpose's
            permutation).
        t: the tensor-parallel degree.
    """

    name: str
    type: str
    attrs: Mapping[str, Any] = field(default_factory=dict)
    input_shapes: Tuple[Shape, ...] = ()
    output_shapes: Tuple[Shape, ...] = ()
    const_inputs: Mapping[int, Any] = field(default_factory=dict)
    t: int = 2


@dataclass(frozen=True)
class Decision:
    """A rule's answer: the spec needed of each input, and each output's.

    Attributes:
        inputs: per data input, the spec it must be in.
        outputs: per output, its spec.
        kind: how the sharded op is computed: ``"local"`` (each device runs
            the op on its pieces) or the name of a special lowering
            (``"masked_gather"``: a lookup in a vocabulary-split table).
    """

    inputs: Tuple[ShardSpec, ...]
    outputs: Tuple[ShardSpec, ...]
    kind: str = "local"


Rule = Callable[[OpInfo, Sequence[ShardSpec]], Optional[Decision]]
BackRule = Callable[[OpInfo, ShardSpec], Optional[Tuple[ShardSpec, ...]]]

_RULES: Dict[str, Rule] = {}
_BACK_RULES: Dict[str, BackRule] = {}


def register_rule(*op_types: str, back: Optional[BackRule] = None) -> Callable[[Rule], Rule]:
    """Decorator: `fn` decides the sharding of ops of `op_types`."""

    def deco(fn: Rule) -> Rule:
        for t in op_types:
            _RULES[t] = fn
            if back is not None:
                _BACK_RULES[t] = back
        return fn

    return deco


def rule_for(op_type: str) -> Optional[Rule]:
    """The rule registered for `op_type`, or None."""
    return _RULES.get(op_type)


def back_rule_for(op_type: str) -> Optional[BackRule]:
    """The back rule registered for `op_type`, or None."""
    return _BACK_RULES.get(op_type)


def _rank(shape: Shape) -> int:
    return -1 if shape is None else len(shape)


def _R(shape: Shape) -> ShardSpec:
    return ShardSpec.replicated(max(_rank(shape), 0))


def _S(shape: Shape, dim: int) -> ShardSpec:
    return ShardSpec.split(len(shape), dim)


def _splittable(shape: Shape, dim: int, t: int) -> bool:
    return shape is not None and 0 <= dim < len(shape) and shape[dim] is not None and shape[dim] % t == 0 and shape[dim] >= t


def _P(shape: Shape) -> ShardSpec:
    return ShardSpec.partial_sum(max(_rank(shape), 0))


def _outs_like(info: OpInfo, spec_of: Callable[[Shape], ShardSpec]) -> Tuple[ShardSpec, ...]:
    return tuple(spec_of(s) for s in info.output_shapes)
