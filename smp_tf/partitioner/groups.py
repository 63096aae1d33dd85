"""Colocation groups: sets of ops that must land on the same partition.

Rules (each one is a union in a union-find over op indices):

1. ops that take the handle of the same variable, and the ops that consume
   the value read from it (through ``Identity`` / ``Cast``), so that tied
   embeddings keep all their users together;
2. ops created by one Keras layer;
3. a gradient op and the forward op it differentiates, except the sums of
   gradient contributions (``AddN``): a sum goes where its terms come from
   (it follows the neighbours it exchanges most bytes with), so that when
   one partition computes every term it also adds them up, sends one tensor
   instead of several, and the graph optimiser sees the terms and their sum
   in one function, as in a single-device run;
4. TensorFlow's own colocation (``_class = ["loc:@other"]``) of forward ops;
5. ops *tied* together by the graph view: a while loop and the accumulators
   (and the gradient loop) its gradient added to it.

"Free" ops are left out of every group: ops that read nothing but constants
and step arguments (constants, shapes, argument placeholders). They cost
nothing to duplicate, so they follow the ops that consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from smp_tf.graph_view import OpGraph

__all__ = ["Groups", "free_ops", "colocation_groups"]


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        parent = self.parent
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            # Keep the older op as root so group ids follow creation order.
            if ra < rb:
                self.parent[rb] = ra
            else:
                self.parent[ra] = rb


def free_ops(graph: OpGraph) -> List[bool]:
    """Marks ops that depend only on constants and step arguments.

    An op is free when it is stateless, touches no variable, and all of its
    data inputs are free (step-argument placeholders are free: they are fed
    to whichever partition needs them).
    """
    free = [False] * len(graph.ops)
    for op in graph.ops:
        if op.kind == "arg":
            free[op.index] = True
            continue
        if op.stateful or op.variables:
            continue
        if op.kind == "capture":  # a captured constant tensor
            free[op.index] = True
            continue
        free[op.index] = all(free[graph.tensors[t].producer] for t in op.inputs)
    return free


@dataclass
class Groups:
    """The colocation groups of a graph.

    Attributes:
        group_of: op index -> group id, or -1 for free ops.
        members: group id -> op indices (creation order).
        free: op index -> is free.
        manual: group id -> partition requested with `smp.partition`.
    """

    group_of: List[int]
    members: List[List[int]]
    free: List[bool]
    manual: Dict[int, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.members)


_VALUE_PRESERVING = frozenset(["Identity", "Cast", "Snapshot"])


def _value_users(graph: OpGraph, read: int) -> List[int]:
    """Ops that consume the value of the variable read `read`, through Identity / Cast.

    Running them elsewhere would send the whole variable (and its gradient)
    across partitions every micro-batch.
    """
    out: List[int] = []
    stack = [read]
    while stack:
        k = stack.pop()
        for c in graph.consumer_ops(k):
            out.append(c)
            if graph.ops[c].type in _VALUE_PRESERVING:
                stack.append(c)
    return out


def _is_gradient_sum(op) -> bool:
    """The sum of the gradient contributions that reach one forward tensor."""
    return op.is_gradient and op.type == "AddN" and op.layer is None and not op.variables


def colocation_groups(graph: OpGraph, free: Optional[List[bool]] = None) -> Groups:
    """Computes the colocation groups of `graph` (see the module doc).

    Raises:
        ValueError: ops of one group were put in different `smp.partition`
            blocks.
    """
    n = len(graph.ops)
    free = free_ops(graph) if free is None else free
    uf = _UnionFind(n)
    first_user_of_var: Dict[str, int] = {}
    first_op_of_layer: Dict[str, int] = {}
    for op in graph.ops:
        i = op.index
        if free[i]:
            continue
        for v in op.variables:
            j = first_user_of_var.setdefault(v, i)
            uf.union(i, j)
        if op.layer is not None:
            j = first_op_of_layer.setdefault(op.layer, i)
            uf.union(i, j)
        if op.forward is not None and not free[op.forward] and not _is_gradient_sum(op):
            uf.union(i, op.forward)
        # Gradient ops are placed by rule 3. TensorFlow's own colocation of
        # them (tf.gradients colocates every gradient op with its forward op,
        # and chains every gradient sum to the loss) would glue the whole
        # backward pass into one group.
        for name in () if op.is_gradient else op.colocate_with:
            j = graph.op_index.get(name)
            if j is not None and not free[j]:
                uf.union(i, j)
        for j in op.tied:
            if not free[j]:
                uf.union(i, j)
        if op.type == "ReadVariableOp" and op.variables:
            for j in _value_users(graph, i):
                if not free[j]:
                    uf.union(i, j)

    group_of = [-1] * n
    members: List[List[int]] = []
    root_to_group: Dict[int, int] = {}
    for i in range(n):
        if free[i]:
            continue
        r = uf.find(i)
        g = root_to_group.get(r)
        if g is None:
            g = root_to_group[r] = len(members)
            members.append([])
        group_of[i] = g
        members[g].append(i)

    manual: Dict[int, int] = {}
    for g, ms in enumerate(members):
        requested = {}
        for i in ms:
            p = graph.ops[i].manual_partition
            if p is not None:
                requested.setdefault(p, graph.ops[i].name)
        if len(requested) > 1:
            why = sorted({v for i in ms for v in graph.ops[i].variables})[:3]
            layers = sorted({graph.ops[i].layer for i in ms if graph.ops[i].layer})[:3]
            raise ValueError(
                "Ops that must stay on one partition were placed in different "
                f"smp.partition blocks: {', '.join(f'{name!r} in partition {p}' for p, name in sorted(requested.items()))}. "
                f"They share variables {why} / layers {layers}. Put every use of a "
                "layer or variable inside the same smp.partition block."
            )
        if requested:
            manual[g] = next(iter(requested))
    return Groups(group_of, members, free, manual)
