"""Sharding rules: one small function per op family.

A rule reads an op (`OpInfo`: its type, attributes, static shapes and the
values of its constant inputs) and the specs its inputs arrive with, and
decides (`Decision`) the spec it needs of each input and the spec of each
output. Where an input arrives in another spec than the one needed, the
completion inserts a reshard. A rule returns None when it cannot run the
op sharded; the op then runs whole on replicated inputs (correct, slower)
and the report lists it.

Rules are registered per op type (`register_rule`), as PyTorch DTensor's
``_ops/`` and Paddle's ``spmd_rules/`` do: adding an op is adding a rule.
Most rules are one of a few patterns: element-wise with broadcasting, a
contraction written as an einsum equation (``MatMul``, ``BatchMatMulV2``,
``Einsum``, ``Conv2D`` and its gradients), a reduction, a reshape.

A rule may also say how a consumer would like its inputs laid out to
produce a given output spec (`back_rule`): the completion uses it to move a
split back through ops that would otherwise compute a whole tensor only to
split it.

Plain Python; no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from smp_tf.sharding.spec import ShardSpec

__all__ = [
    "OpInfo",
    "Decision",
    "register_rule",
    "rule_for",
    "back_rule_for",
    "UNARY",
    "BINARY",
    "SHAPE_OPS",
    "reshape_dim",
]

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


# ---------------------------------------------------------------- contractions


def _contraction(
    info: OpInfo,
    ins: Sequence[ShardSpec],
    letters: Sequence[str],
    out_letters: str,
    fixed: str = "",
    positions: Optional[Sequence[int]] = None,
) -> Optional[Decision]:
    """An einsum-like op: input ``i``'s dimensions are `letters[i]`, the
    output's `out_letters`. A letter split in some input stays split in the
    output, or, contracted away, leaves a partial sum. Letters in `fixed`
    (a convolution's spatial dimensions) are never split.

    `positions` are the data inputs the letters describe (the others, such
    as a convolution's ``input_sizes``, stay whole).
    """
    positions = list(range(len(letters))) if positions is None else list(positions)
    shapes = [info.input_shapes[p] for p in positions]
    specs = [ins[p] for p in positions]
    if any(s is None or len(s) != len(l) for s, l in zip(shapes, letters)):
        return None
    if any(len(set(l)) != len(l) for l in letters):
        return None  # a diagonal or trace
    sizes: Dict[str, int] = {}
    for sh, l in zip(shapes, letters):
        for c, n in zip(l, sh):
            if n is not None and n != 1:
                sizes[c] = n

    def whole() -> Decision:
        return Decision(tuple(_R(s) for s in info.input_shapes), _outs_like(info, _R))

    partial = [s.partial for s in specs]
    if any(partial):
        # Linear in each input: a partial sum times whole inputs is a partial sum.
        if sum(partial) == 1 and all(s.partial or s.is_replicated for s in specs):
            needs = list(_R(s) for s in info.input_shapes)
            for p, s in zip(positions, specs):
                needs[p] = s
            return Decision(tuple(needs), _outs_like(info, _P))
        specs = [(_R(sh) if s.partial else s) for s, sh in zip(specs, shapes)]
    # The letter to split: the first an input arrives split on. A contracted
    # letter leaves a partial sum, which changes the order of the sum: it
    # is taken only when every input that has it arrives split on it (a
    # row-parallel product, as the layouts asked); otherwise the split
    # input is gathered, which computes each element as one device does.
    letter = None
    for s, l in zip(specs, letters):
        d = s.split_dim
        if d is None or l[d] in fixed or sizes.get(l[d], 1) % info.t or sizes.get(l[d], 1) < info.t:
            continue
        c = l[d]
        if c not in out_letters and any(
            c in l2 and sh[l2.index(c)] not in (1, None) and s2.split_dim != l2.index(c)
            for s2, l2, sh in zip(specs, letters, shapes)
        ):
            continue
        letter = c
        break
    if letter is None:
        return whole()
    needs = list(_R(s) for s in info.input_shapes)
    for p, sh, l in zip(positions, shapes, letters):
        if letter in l and sh[l.index(letter)] not in (1, None):
            needs[p] = _S(sh, l.index(letter))
    if letter in out_letters:
        outs = tuple(_S(s, out_letters.index(letter)) if s is not None and len(s) == len(out_letters) else _R(s)
                     for s in info.output_shapes)
    else:
        outs = _outs_like(info, _P)
    return Decision(tuple(needs), outs)


@register_rule("MatMul")
def _matmul(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    a = "km" if info.attrs.get("transpose_a") else "mk"
    b = "nk" if info.attrs.get("transpose_b") else "kn"
    return _contraction(info, ins, [a, b], "mn")


_BATCH_LETTERS = "abcdefghij"


@register_rule("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
def _batch_matmul(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    sa, sb = info.input_shapes[:2]
    out = info.output_shapes[0] if info.output_shapes else None
    if sa is None or sb is None or out is None or len(out) < 2:
        return None
    nb = len(out) - 2
    batch = _BATCH_LETTERS[:nb]
    a = batch[nb - (len(sa) - 2):] + ("KM" if info.attrs.get("adj_x") else "MK")
    b = batch[nb - (len(sb) - 2):] + ("NK" if info.attrs.get("adj_y") else "KN")
    return _contraction(info, ins, [a, b], batch + "MN")


def parse_einsum(equation: str, ranks: Sequence[int]) -> Optional[Tuple[List[str], str]]:
    """The letters of each input and of the output of an einsum `equation`,
    with ``...`` expanded to upper-case letters aligned from the right;
    None if it cannot be read."""
    if "->" not in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    ell = max([r - len(x.replace("...", "")) for x, r in zip(terms, ranks) if "..." in x] or [0])
    fill = "ABCDEFGHIJ"[:ell]
    letters = []
    for x, r in zip(terms, ranks):
        if "..." in x:
            n = r - len(x.replace("...", ""))
            x = x.replace("...", fill[ell - n:])
        if len(x) != r:
            return None
        letters.append(x)
    out = out.replace("...", fill)
    return letters, out


@register_rule("Einsum")
def _einsum(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    ranks = [_rank(s) for s in info.input_shapes]
    if any(r < 0 for r in ranks):
        return None
    parsed = parse_einsum(str(info.attrs.get("equation", "")), ranks)
    if parsed is None:
        return None
    return _contraction(info, ins, *parsed)


# Convolutions (NHWC): the spatial dimensions h, w and the kernel's x, y are
# never split; batch, input channels (contracted) and output channels are.
@register_rule("Conv2D")
def _conv2d(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    if info.attrs.get("data_format", "NHWC") != "NHWC" or _rank(info.input_shapes[0]) != 4:
        return None
    return _contraction(info, ins, ["nhwc", "xyco"], "nhwo", fixed="hwxy")


@register_rule("Conv2DBackpropInput")
def _conv2d_backprop_input(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    if info.attrs.get("data_format", "NHWC") != "NHWC":
        return None
    return _contraction(info, ins, ["xyco", "nhwo"], "nhwc", fixed="hwxy", positions=[1, 2])


@register_rule("Conv2DBackpropFilter")
def _conv2d_backprop_filter(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    if info.attrs.get("data_format", "NHWC") != "NHWC":
        return None
    return _contraction(info, ins, ["nhwc", "nhwo"], "xyco", fixed="hwxy", positions=[0, 2])


# ------------------------------------------------------------------ reductions

_PARTIAL_REDUCTIONS = frozenset(["Sum", "Mean"])


@register_rule("Sum", "Mean", "Max", "Min", "Prod", "All", "Any")
def _reduction(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape = info.input_shapes[0]
    axes = info.const_inputs.get(1)
    if shape is None or axes is None:
        return None
    r = len(shape)
    axes = sorted({int(a) % r for a in (axes if isinstance(axes, (list, tuple)) else [axes])}) if r else []
    keep = bool(info.attrs.get("keep_dims", False))
    out = info.output_shapes[0]
    s = ins[0]
    axes_spec = _R(info.input_shapes[1]) if len(info.input_shapes) > 1 else None
    tail = (axes_spec,) if axes_spec is not None else ()
    if s.partial:
        if info.type in _PARTIAL_REDUCTIONS:
            return Decision((s,) + tail, (ShardSpec.partial_sum(_rank(out)),))
        return Decision((_R(shape),) + tail, (_R(out),))
    d = s.split_dim
    if d is None:
        return Decision((s,) + tail, (_R(out),))
    if d not in axes:
        od = d if keep else d - sum(a < d for a in axes)
        return Decision((s,) + tail, (_S(out, od),))
    if info.type == "Sum":
        return Decision((s,) + tail, (ShardSpec.partial_sum(_rank(out)),))
    # A mean, max or product over a split dimension needs it whole (a mean
    # of the pieces' means would round differently).
    return Decision((_R(shape),) + tail, (_R(out),))


# -------------------------------------------------------------- softmax family


def _softmax(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape = info.input_shapes[0]
    if shape is None:
        return None
    s = ins[0]
    d = s.split_dim
    if not s.partial and d is not None and d == len(shape) - 1 and info.type == "LogSoftmax":
        # Split over the normalised axis: each device's maximum and sum of
        # exponentials, reduced over the devices (`lower._split_log_softmax`).
        return Decision((s,), (s,), kind="split_log_softmax")
    if s.partial or d is None or d == len(shape) - 1:
        return Decision((_R(shape),), _outs_like(info, _R))  # the normalised axis must be whole
    return Decision((s,), (_S(info.output_shapes[0], d),))


register_rule("Softmax", "LogSoftmax",
              back=lambda info, out: None if out.split_dim in (None, len(out.dims) - 1) else (out,))(_softmax)


# ------------------------------------------------------------ reshape family


def reshape_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int, t: int) -> Optional[int]:
    """The output dimension that keeps a split of input dimension `dim`
    across a reshape from `in_shape` to `out_shape`, or None (the split
    cannot survive: reshard).

    Dimensions are grouped into runs with equal products. A dimension that
    is a group by itself on both sides maps to its partner. A merged group
    keeps the split when the split dimension leads it (the pieces stay
    contiguous blocks); a split group keeps it on its leading output piece
    when `t` divides that piece.
    """
    if any(d is None for d in in_shape) or any(d is None for d in out_shape):
        return None
    i = j = 0
    n_in, n_out = len(in_shape), len(out_shape)
    while i < n_in or j < n_out:
        gi, gj = [], []
        pi = pj = 1
        # Size-1 dimensions belong to no group.
        while i < n_in and in_shape[i] == 1:
            i += 1
        while j < n_out and out_shape[j] == 1:
            j += 1
        if i >= n_in or j >= n_out:
            break
        gi.append(i)
        pi *= in_shape[i]
        i += 1
        gj.append(j)
        pj *= out_shape[j]
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= n_in:
                    return None
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                if j >= n_out:
                    return None
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        gi = [k for k in gi if in_shape[k] != 1]
        gj = [k for k in gj if out_shape[k] != 1]
        if dim in gi:
            if gi[0] != dim:
                return None
            lead = gj[0]
            if len(gi) == 1 and len(gj) > 1:
                return lead if out_shape[lead] % t == 0 else None
            if len(gj) == 1:
                return lead
            # Both sides have several dimensions: the leading pieces must agree.
            return lead if in_shape[dim] == out_shape[lead] and out_shape[lead] % t == 0 else None
    return None


def _reshape_like(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape, out = info.input_shapes[0], info.output_shapes[0]
    if shape is None or out is None:
        return None
    rest = tuple(_R(s) for s in info.input_shapes[1:])
    s = ins[0]
    if s.partial:
        return Decision((s,) + rest, (ShardSpec.partial_sum(len(out)),))
    d = s.split_dim
    if d is None:
        return Decision((s,) + rest, (_R(out),))
    od = reshape_dim(shape, out, d, info.t)
    if od is None:
        return Decision((_R(shape),) + rest, (_R(out),))
    return Decision((s,) + rest, (_S(out, od),))


def _reshape_back(info: OpInfo, out: ShardSpec) -> Optional[Tuple[ShardSpec, ...]]:
    shape, out_shape = info.input_shapes[0], info.output_shapes[0]
    d = out.split_dim
    if shape is None or out_shape is None or d is None:
        return None
    back = reshape_dim(out_shape, shape, d, info.t)
    if back is None or reshape_dim(shape, out_shape, back, info.t) != d:
        return None
    return (_S(shape, back),) + tuple(_R(s) for s in info.input_shapes[1:])


register_rule("Reshape", "ExpandDims", "Squeeze", back=_reshape_back)(_reshape_like)


def _transpose(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    perm = info.const_inputs.get(1)
    shape, out = info.input_shapes[0], info.output_shapes[0]
    if perm is None or shape is None or out is None:
        return None
    perm = [int(p) % len(shape) for p in perm]
    s = ins[0]
    rest = tuple(_R(x) for x in info.input_shapes[1:])
    if s.partial:
        return Decision((s,) + rest, (ShardSpec.partial_sum(len(out)),))
    d = s.split_dim
    if d is None:
        return Decision((s,) + rest, (_R(out),))
    return Decision((s,) + rest, (_S(out, perm.index(d)),))


def _transpose_back(info: OpInfo, out: ShardSpec) -> Optional[Tuple[ShardSpec, ...]]:
    perm = info.const_inputs.get(1)
    d = out.split_dim
    if perm is None or d is None or info.input_shapes[0] is None:
        return None
    return (_S(info.input_shapes[0], int(perm[d]) % len(info.input_shapes[0])),) + tuple(
        _R(x) for x in info.input_shapes[1:])


register_rule("Transpose", back=_transpose_back)(_transpose)


# -------------------------------------------------------- shapes and variables

#: Ops that read only their input's shape: any layout in, a whole (static) value out.
SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])


@register_rule(*SHAPE_OPS)
def _shape(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    if any(s is None or any(d is None for d in s) for s in info.input_shapes):
        return None  # a shape known only when running: read it from the whole tensor
    return Decision(tuple(ins), _outs_like(info, _R))


@register_rule("ResourceGather")
def _resource_gather(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """A lookup in a table split by rows (vocabulary-parallel embedding):
    each device looks up the ids of its rows, zeroes the others, and the
    pieces' sum (an all-reduce in which one addend of each row is non-zero)
    is exact. The table's spec comes in as input 0's."""
    table = ins[0]
    ids = info.input_shapes[1] if len(info.input_shapes) > 1 else None
    out = info.output_shapes[0]
    if out is None or table.split_dim != 0 or ids is None:
        return None
    return Decision((table, _R(ids)), (ShardSpec.partial_sum(len(out)),), kind="masked_gather")


@register_rule("Tile")
def _tile(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """A split dimension that is not repeated stays split."""
    multiples = info.const_inputs.get(1)
    shape, out = info.input_shapes[0], info.output_shapes[0]
    if multiples is None or shape is None or out is None:
        return None
    s = ins[0]
    rest = tuple(_R(x) for x in info.input_shapes[1:])
    d = s.split_dim
    if s.partial or d is None or int(multiples[d]) != 1:
        return None
    return Decision((s,) + rest, (_S(out, d),))


@register_rule("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_softmax_cross_entropy(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """Cross-entropy of logits (N, V) against labels (N,).

    Rows split: each device computes its rows. Classes split
    (vocabulary-parallel, Megatron-LM's cross-entropy): each device takes
    the maximum and the sum of exponentials of its classes, their maximum
    and sum over the devices normalise, and the label's logit comes from
    the device that holds it; the logits are never gathered. The loss is
    whole, the gradient (softmax minus one-hot) stays split by classes.
    """
    feats, labels = info.input_shapes[:2]
    if feats is None or labels is None or len(feats) != 2:
        return None
    f = ins[0]
    if f.partial:
        return None
    d = f.split_dim
    if d == 0 and _splittable(feats, 0, info.t):
        return Decision((f, _S(labels, 0)), (_S(info.output_shapes[0], 0), f))
    if d == 1 and _splittable(feats, 1, info.t):
        return Decision((f, _R(labels)), (_R(info.output_shapes[0]), f), kind="vocab_cross_entropy")
    return None


@register_rule("SoftmaxCrossEntropyWithLogits")
def _softmax_cross_entropy(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """Cross-entropy of logits (N, V) against label weights (N, V) (what
    the sparse loss becomes under ``TF_DETERMINISTIC_OPS``: one-hot labels):
    as the sparse rule, the labels split with the logits."""
    feats, labels = info.input_shapes[:2]
    if feats is None or labels is None or len(feats) != 2 or len(labels) != 2 or ins[0].partial:
        return None
    d = ins[0].split_dim
    if d is None or not _splittable(feats, d, info.t) or labels[d] != feats[d]:
        return None
    split = _S(feats, d)
    if d == 0:
        return Decision((split, split), (_S(info.output_shapes[0], 0), split))
    return Decision((split, split), (_R(info.output_shapes[0]), split), kind="vocab_cross_entropy")


@register_rule("GatherV2")
def _gather(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """A lookup in a tensor split along the gathered axis (a vocabulary-split
    embedding table, log-probabilities split by classes): each device looks
    up the indices in its range, zeroes the others, and the pieces' sum is
    exact (one addend of each element is not zero). Only where the gathered
    axis is the first after the batch dimensions (``axis == batch_dims``)."""
    params, indices = info.input_shapes[:2]
    axis = info.const_inputs.get(2)
    batch_dims = int(info.attrs.get("batch_dims", 0) or 0)
    if params is None or indices is None or axis is None or ins[0].partial:
        return None
    axis = int(axis) % len(params)
    if ins[0].split_dim != axis or axis != batch_dims or any(s.split_dim is not None or s.partial for s in ins[1:]):
        return None
    return Decision((ins[0],) + tuple(_R(s) for s in info.input_shapes[1:]),
                    (_P(info.output_shapes[0]),), kind="masked_gather")
