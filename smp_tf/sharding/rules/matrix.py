"""Rules of contractions: products, einsums and convolutions, written as einsum equations."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from smp_tf.sharding.rules.base import (
    Decision, OpInfo, ShardSpec, _P, _R, _S, _outs_like, _rank, register_rule,
)

__all__ = ['parse_einsum']


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
