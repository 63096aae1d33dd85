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

The rules live one module per op family: `pointwise` (element-wise ops,
bias additions), `matrix` (products, einsums, convolutions), `shape`
(reductions, reshapes, transposes, tiles, shape reads) and `loss` (the
softmax family, cross-entropies, lookups); `base` holds the registry.

Plain Python; no TensorFlow.
"""

from smp_tf.sharding.rules.base import Decision, OpInfo, back_rule_for, register_rule, rule_for
# Importing a rule module registers its rules.
from smp_tf.sharding.rules import loss, matrix, pointwise, shape  # noqa: F401  (registers the rules)
from smp_tf.sharding.rules.matrix import parse_einsum
from smp_tf.sharding.rules.pointwise import BINARY, UNARY
from smp_tf.sharding.rules.shape import SHAPE_OPS, reshape_dim

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
    "parse_einsum",
]
