"""Rules of reductions, reshapes, transposes, tiles, splits, concatenations and shape reads."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from smp_tf.sharding.rules.base import (
    Decision, OpInfo, ShardSpec, _R, _S, _outs_like, _rank, _splittable, register_rule,
)

__all__ = ['reshape_dim', 'SHAPE_OPS']


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


# ------------------------------------------------------- splits and concatenations


def _axis(value, rank: int) -> Optional[int]:
    if value is None or isinstance(value, (list, tuple)) or rank <= 0:
        return None
    return int(value) % rank


@register_rule("Split")
def _split(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """``Split(axis, value)`` along a whole dimension: every piece keeps the
    value's split (rotary embeddings split the head size of split heads)."""
    shape = info.input_shapes[1]
    axis = _axis(info.const_inputs.get(0), _rank(shape))
    s = ins[1]
    if axis is None or s.partial or s.split_dim is None or s.split_dim == axis:
        return None
    return Decision((_R(info.input_shapes[0]), s), tuple(_S(o, s.split_dim) for o in info.output_shapes))


@register_rule("SplitV")
def _split_v(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape = info.input_shapes[0]
    axis = _axis(info.const_inputs.get(2), _rank(shape))
    s = ins[0]
    if axis is None or s.partial or s.split_dim is None or s.split_dim == axis:
        return None
    return Decision((s, _R(info.input_shapes[1]), _R(info.input_shapes[2])),
                    tuple(_S(o, s.split_dim) for o in info.output_shapes))


@register_rule("ConcatV2")
def _concat(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    """A concatenation along a whole dimension of values split on another:
    the output keeps the split, every value split the same way (a whole
    one is split for it)."""
    values = ins[:-1]
    out = info.output_shapes[0]
    axis = _axis(info.const_inputs.get(len(ins) - 1), _rank(out))
    dims = {v.split_dim for v in values if v.split_dim is not None}
    if axis is None or any(v.partial for v in values) or len(dims) != 1:
        return None
    d = dims.pop()
    if d == axis or not all(_splittable(x, d, info.t) for x in info.input_shapes[:-1]):
        return None
    return Decision(tuple(_S(x, d) for x in info.input_shapes[:-1]) + (_R(info.input_shapes[-1]),), (_S(out, d),))


@register_rule("Unpack")
def _unpack(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape = info.input_shapes[0]
    axis = _axis(info.attrs.get("axis"), _rank(shape))
    s = ins[0]
    if axis is None or s.partial or s.split_dim is None or s.split_dim == axis:
        return None
    d = s.split_dim - (axis < s.split_dim)
    return Decision((s,), tuple(_S(o, d) for o in info.output_shapes))


@register_rule("Pack")
def _pack(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    out = info.output_shapes[0]
    axis = _axis(info.attrs.get("axis"), _rank(out))
    dims = {v.split_dim for v in ins if v.split_dim is not None}
    if axis is None or any(v.partial for v in ins) or len(dims) != 1:
        return None
    d = dims.pop()
    if not all(_splittable(x, d, info.t) for x in info.input_shapes):
        return None
    return Decision(tuple(_S(x, d) for x in info.input_shapes), (_S(out, d + (axis <= d)),))


# -------------------------------------------------------- shapes and variables

#: Ops that read only their input's shape: any layout in, a whole (static) value out.
SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])


@register_rule(*SHAPE_OPS)
def _shape(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    if any(s is None or any(d is None for d in s) for s in info.input_shapes):
        return None  # a shape known only when running: read it from the whole tensor
    return Decision(tuple(ins), _outs_like(info, _R))
