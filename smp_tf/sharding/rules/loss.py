"""Rules of the softmax family, the cross-entropies and lookups (vocabulary-parallel)."""

from __future__ import annotations

from typing import Optional, Sequence

from smp_tf.sharding.rules.base import (
    Decision, OpInfo, ShardSpec, _P, _R, _S, _outs_like, _splittable, register_rule,
)

__all__ = []


# -------------------------------------------------------------- softmax family


def _softmax(info: OpInfo, ins: Sequence[ShardSpec]) -> Optional[Decision]:
    shape = info.input_shapes[0]
    if shape is None:
        return None
    s = ins[0]
    d = s.split_dim
    if not s.partial and d is not None and d == len(shape) - 1 and info.type == "LogSoftmax":
        # Split over the normalised axis: each device's maximum and sum of
        # exponentials, reduced over the devices (`special._split_log_softmax`).
        return Decision((s,), (s,), kind="split_log_softmax")
    if s.partial or d is None or d == len(shape) - 1:
        return Decision((_R(shape),), _outs_like(info, _R))  # the normalised axis must be whole
    return Decision((s,), (_S(info.output_shapes[0], d),))


register_rule("Softmax", "LogSoftmax",
              back=lambda info, out: None if out.split_dim in (None, len(out.dims) - 1) else (out,))(_softmax)


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
