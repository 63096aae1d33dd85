"""Rules of element-wise ops (with broadcasting) and bias additions."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from smp_tf.sharding.rules.base import (
    Decision, OpInfo, Shape, ShardSpec, _P, _R, _S, _outs_like, _splittable, register_rule,
)

__all__ = ['UNARY', 'BINARY']


# ---------------------------------------------------------------- element-wise

#: One input, output of the same shape, each element from its own input element.
UNARY = frozenset(
    """Identity Snapshot StopGradient PreventGradient Relu Relu6 Elu Selu LeakyRelu Gelu Erf Erfc
    Tanh Sigmoid Exp Expm1 Log Log1p Sqrt Rsqrt Square Abs Neg Sign Softplus Softsign Sin Cos
    Floor Ceil Round Reciprocal Inv Cast IsFinite IsNan LogicalNot ZerosLike OnesLike Mish Swish
    CheckNumerics""".split()
)
#: Element-wise ops of several inputs, with broadcasting.
BINARY = frozenset(
    """Add AddV2 Sub Mul RealDiv Div DivNoNan MulNoNan Maximum Minimum Pow SquaredDifference
    Greater GreaterEqual Less LessEqual Equal NotEqual LogicalAnd LogicalOr FloorDiv FloorMod
    ReluGrad Relu6Grad EluGrad SeluGrad LeakyReluGrad TanhGrad SigmoidGrad SqrtGrad RsqrtGrad
    SoftplusGrad SoftsignGrad ReciprocalGrad InvGrad AddN Select SelectV2""".split()
)
# Ops linear in their inputs: a partial sum in, a partial sum out (with the
# other inputs whole where a product needs them so).
_LINEAR_UNARY = frozenset("Identity Snapshot StopGradient PreventGradient Neg".split())
_SUMS = frozenset("Add AddV2 Sub AddN".split())


def _aligned(shape: Shape, out_rank: int, out_dim: int) -> Optional[int]:
    """The dimension of an input of `shape` that broadcasts onto output
    dimension `out_dim` (aligned from the right); None if it has none."""
    d = out_dim - (out_rank - len(shape))
    return d if 0 <= d < len(shape) else None


def _elementwise(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    out_shape = info.output_shapes[0] if info.output_shapes else None
    if out_shape is None or any(s is None for s in info.input_shapes):
        return None
    r = len(out_shape)
    if any(s.partial for s in ins):
        partial = [s.partial for s in ins]
        linear = (
            (info.type in _LINEAR_UNARY and len(ins) == 1)
            or (info.type in _SUMS and all(partial))
            or (info.type in ("Mul", "MulNoNan") and sum(partial) == 1 and all(s.is_replicated or s.partial for s in ins))
            or (info.type in ("RealDiv", "Div", "DivNoNan") and partial[0] and not any(partial[1:])
                and all(s.is_replicated for s in ins[1:]))
        )
        if linear:
            return Decision(tuple(s if s.partial else _R(sh) for s, sh in zip(ins, info.input_shapes)),
                            _outs_like(info, _P))
        ins = [(_R(sh) if s.partial else s) for s, sh in zip(ins, info.input_shapes)]
    # The output dimension to split: the first input split on a dimension
    # that is not broadcast.
    out_dim = None
    for s, sh in zip(ins, info.input_shapes):
        d = s.split_dim
        if d is not None and sh[d] != 1:
            out_dim = d + (r - len(sh))
            break
    if out_dim is None or not _splittable(out_shape, out_dim, info.t):
        return Decision(tuple(_R(sh) for sh in info.input_shapes), _outs_like(info, _R))
    return _elementwise_split(info, out_dim)


def _elementwise_split(info: OpInfo, out_dim: int) -> Decision:
    out_shape = info.output_shapes[0]
    r = len(out_shape)
    needs = []
    for sh in info.input_shapes:
        d = _aligned(sh, r, out_dim)
        needs.append(_R(sh) if d is None or sh[d] == 1 else _S(sh, d))
    return Decision(tuple(needs), tuple(_S(s, out_dim) if s is not None and len(s) == r else _R(s) for s in info.output_shapes))


def _elementwise_back(info: OpInfo, out: ShardSpec) -> Optional[Tuple[ShardSpec, ...]]:
    out_shape = info.output_shapes[0] if info.output_shapes else None
    d = out.split_dim
    if out_shape is None or d is None or any(s is None for s in info.input_shapes):
        return None
    return _elementwise_split(info, d).inputs


for _t in UNARY | BINARY:
    register_rule(_t, back=_elementwise_back)(_elementwise)


@register_rule("IdentityN")
def _identity_n(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """Output i is input i (``tf.custom_gradient`` wraps its results in
    one, as Keras's silu does): every layout passes through, partial sums
    too."""
    return Decision(tuple(ins), tuple(ins))


# ------------------------------------------------------------------- bias add


def _bias_add(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    value, bias = info.input_shapes[:2]
    if value is None or bias is None or info.attrs.get("data_format", "NHWC") not in ("NHWC", "N...C"):
        return None
    v, b = ins[0], ins[1]
    if v.partial or b.partial:
        if v.partial and b.partial:
            return Decision((v, b), (v,))  # a sum of two partial sums
        v, b = _R(value) if v.partial else v, _R(bias) if b.partial else b
    last = len(value) - 1
    d = v.split_dim
    if d is None and b.split_dim == 0:
        d = last
    if d is None or not _splittable(value, d, info.t):
        return Decision((_R(value), _R(bias)), (_R(value),))
    return Decision((_S(value, d), _S(bias, 0) if d == last else _R(bias)), (_S(value, d),))


def _bias_add_back(info: OpInfo, out: ShardSpec) -> Optional[Tuple[ShardSpec, ...]]:
    value, bias = info.input_shapes[:2]
    d = out.split_dim
    if value is None or d is None:
        return None
    return (_S(value, d), _S(bias, 0) if d == len(value) - 1 else _R(bias))


register_rule("BiasAdd", back=_bias_add_back)(_bias_add)


@register_rule("BiasAddGrad")
def _bias_add_grad(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    value = info.input_shapes[0]
    out = info.output_shapes[0]
    if value is None or out is None:
        return None
    s = ins[0]
    if s.partial:
        return Decision((s,), (ShardSpec.partial_sum(1),))
    d = s.split_dim
    if d is None:
        return Decision((s,), (_R(out),))
    if d == len(value) - 1:
        return Decision((s,), (_S(out, 0),))
    return Decision((s,), (ShardSpec.partial_sum(1),))  # a sum over a split batch dimension
