"""Colocation groups: sets of ops that must land on the same partition.

Rules (each one is a union in a union-find over op indices):

1. ops that take the handle of the same variable, and the ops that consume
   the value read from it (through ``Identity`` / ``Cast``), so that a
   layer's weights are not sent across partitions every micro-batch;
2. ops created by one call of a Keras layer, except the *glue* of a
   composite layer (the ops its call creates directly, between the calls of
   its own sublayers: residual additions, a gating product, masks), which,
   like the glue in a model's ``call``, goes wherever its neighbours are;
3. a gradient op and the forward op it differentiates, except the sums of
   gradient contributions (``AddN``): a sum goes where its terms come from
   (it follows the neighbours it exchanges most bytes with), so that when
   one partition computes every term it also adds them up, sends one tensor
   instead of several, and the graph optimiser sees the terms and their sum
   in one function, as in a single-device run;
4. TensorFlow's own colocation (``_class = ["loc:@other"]``) of forward ops;
5. ops *tied* together by the graph view: a while loop and the accumulators
   (and the gradient loop) its gradient added to it;
6. an element-wise arithmetic op (``Mul``, ``AddV2``, ``RealDiv``, ...) on
   floating-point values and the only op that reads its output, when that
   op is element-wise arithmetic too. In the single-device graph
   TensorFlow's graph optimiser reassociates such a chain (``(a * b) * c``
   becomes ``a * (b * c)`` when ``c`` is a constant, as in a dropout after
   a gated product) and the result rounds differently; across a partition
   boundary it could not, and the pipelined step would not compute what one
   device computes. Unless the user put the two ops in different
   `smp.partition` blocks.

A *second use* of a variable is the exception to rule 1: a read made in
another layer call than the variable's first use (a tied embedding used
again as the output projection, a layer called twice), or made outside
layers when the model differentiates through it (a tied projection written
in a subclassed model's ``call``; the optimizer's reads are not). The read
stays with its variable, but the ops that use its value join it only when
the variable is larger than the activations those ops exchange with the
rest of the model. Otherwise, or when the user put that use in another
`smp.partition` block than the variable's, they form a group of their own
that the partitioner places like any other, and the variable's value (and
its gradient) crosses partitions instead: an output projection then runs
on the last stage, next to its loss, instead of sending the hidden state
back to the first stage and the logits forward again.

A *second update* is the same for a layer's state: a later call's update
(its reads, the arithmetic that computes the new value from the old one,
and the write; a dropout's seed advanced, a shared batch normalisation's
moving averages) stays with the variable, while the rest of that call is
placed like any other (`second_updates`).

"Free" ops are left out of every group: ops that read nothing but constants
and step arguments (constants, shapes, argument placeholders). They cost
nothing to duplicate, so they follow the ops that consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from smp_tf.graph_view import OpGraph, free_op_flags

__all__ = [
    "ROUNDING_DTYPES", "Groups", "arithmetic_chains", "free_ops", "second_uses", "second_updates", "colocation_groups",
]


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
    return free_op_flags(graph.ops, graph.tensors)


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


def _site(op) -> Optional[str]:
    """The layer call that created `op` (its layer when calls are unknown)."""
    return op.call if op.call is not None else op.layer


def second_uses(graph: OpGraph, free: Optional[List[bool]] = None) -> Dict[int, str]:
    """Reads that are a second use of their variable (see the module doc).

    Returns:
        read op index -> variable key, for every ``ReadVariableOp`` made in
        another layer call than the variable's first use, or made outside
        layers when the first use was in one and its value reaches an op
        that has a gradient (the optimizer's own reads are outside layers,
        and no gradient flows through them: never second uses).
    """
    free = free_ops(graph) if free is None else free
    differentiated = {op.forward for op in graph.ops if op.forward is not None}
    home = _home_sites(graph, free)
    out: Dict[int, str] = {}
    for op in _forward_uses(graph, free):
        if op.type != "ReadVariableOp" or len(op.variables) != 1:
            continue
        v = op.variables[0]
        site = _site(op)
        if site == home[v]:
            continue
        # Outside layers, only a read the model differentiates through is a
        # use of the model's (the optimizer's reads are outside layers too).
        if site is not None or any(u in differentiated for u in _value_users(graph, op.index)):
            out[op.index] = v
    return out


def _forward_uses(graph: OpGraph, free: List[bool]):
    """The forward ops that may use a variable (a captured handle is the
    variable itself, not a use of it)."""
    return (op for op in graph.ops if not (free[op.index] or op.is_gradient or op.kind != "op"))


def _home_sites(graph: OpGraph, free: List[bool]) -> Dict[str, Optional[str]]:
    """Variable key -> the layer call (site) of its first use."""
    home: Dict[str, Optional[str]] = {}
    for op in _forward_uses(graph, free):
        for v in op.variables:
            home.setdefault(v, _site(op))
    return home


#: Ops that write a resource variable's value.
_RESOURCE_WRITES = frozenset(["AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"])


def second_updates(
    graph: OpGraph, free: Optional[List[bool]] = None, chains: Optional[List[Tuple[int, int]]] = None
) -> Dict[int, str]:
    """State updates made in another layer call than the variable's first use.

    A layer called twice updates its state twice: a dropout's seed
    generator advances its seed, a shared batch normalisation moves its
    averages. The write must run where the variable lives, and so must the
    ops that compute the new value from the variable's old one (the seed
    plus one, the old average times the momentum): they form a chain from
    the call's reads of the variable to its write. The rest of the call
    (the random mask, the normalisation) is free to run elsewhere, and only
    the small values it reads from that chain (the seed, the batch's
    mean) cross partitions.

    Args:
        graph: the traced graph.
        free: `free_ops` of the graph, if already computed.
        chains: `arithmetic_chains` of the graph, if already computed.

    Returns:
        op index -> variable key, for every such write and every op of its
        chain (the reads are `second_uses`).
    """
    free = free_ops(graph) if free is None else free
    home = _home_sites(graph, free)
    out: Dict[int, str] = {}
    feeders: Optional[Dict[int, List[int]]] = None
    for op in _forward_uses(graph, free):
        if op.type not in _RESOURCE_WRITES or len(op.variables) != 1:
            continue
        v, site = op.variables[0], _site(op)
        if site == home[v]:
            continue
        out[op.index] = v
        # The write's ancestors in its own call, back to the call's reads of v.
        ancestors, stack = set(), [op.index]
        while stack:
            for t in graph.ops[stack.pop()].inputs:
                k = graph.tensors[t].producer
                up = graph.ops[k]
                if k in ancestors or free[k] or up.is_gradient or up.kind != "op" or _site(up) != site:
                    continue
                ancestors.add(k)
                if tuple(up.variables) != (v,):
                    stack.append(k)
        # Of those, the ones computed from a read of v.
        chain: set = set()
        for k in sorted(ancestors):
            up = graph.ops[k]
            if tuple(up.variables) == (v,) or any(graph.tensors[t].producer in chain for t in up.inputs):
                chain.add(k)
        # And the arithmetic that only feeds it (the batch's mean times
        # `1 - momentum`): rule 6 keeps such a pair together, and it
        # belongs with the update rather than pulling the call along.
        if feeders is None:
            feeders = {}
            for a, b in arithmetic_chains(graph, free) if chains is None else chains:
                feeders.setdefault(b, []).append(a)
        stack = list(chain)
        while stack:
            for a in feeders.get(stack.pop(), ()):
                if a not in chain and _site(graph.ops[a]) == site:
                    chain.add(a)
                    stack.append(a)
        for k in chain:
            if graph.ops[k].type != "ReadVariableOp":
                out[k] = v
    return out


def _forward_exchange(graph: OpGraph, in_group: List[bool], skip: set) -> int:
    """Bytes of forward tensors that cross the boundary of a set of ops.

    Each of them has a gradient of its size crossing back, so this is half
    of what the set exchanges per micro-batch.
    """
    total = 0
    for t in graph.tensors:
        if t.id in skip or graph.ops[t.producer].is_gradient:
            continue
        inside = in_group[t.producer]
        if any(in_group[c] != inside for c in t.consumers):
            total += t.bytes
    return total


#: Element-wise arithmetic that TensorFlow's graph optimiser folds,
#: reorders or reassociates when one op is the only reader of the other
#: (constant push-down, hoisting, add chains, broadcast minimisation).
ELEMENTWISE_ARITHMETIC = frozenset([
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "Neg", "Reciprocal", "Sqrt", "Rsqrt",
    "Square", "SquaredDifference", "Pow", "BiasAdd",
])
#: Prefixes of the dtype names whose arithmetic rounds (``float16``,
#: ``bfloat16``, ``complex64``, ...), so that a rewrite can change values.
ROUNDING_DTYPES = ("float", "bfloat", "complex")


def arithmetic_chains(graph: OpGraph, free: Optional[List[bool]] = None) -> List[Tuple[int, int]]:
    """The (producer, reader) pairs that rule 6 joins (see the module doc).

    A pair is an element-wise arithmetic op with a floating-point output
    and the one op that reads that output, itself element-wise arithmetic.
    Free ops and the sums of gradient contributions (rule 3's exception)
    take no part.
    """
    free = free_ops(graph) if free is None else free
    pairs = []
    for t in graph.tensors:
        producer = graph.ops[t.producer]
        if free[producer.index] or producer.type not in ELEMENTWISE_ARITHMETIC or _is_gradient_sum(producer):
            continue
        if not t.dtype.startswith(ROUNDING_DTYPES):
            continue
        readers = set(t.consumers)
        if len(readers) != 1:
            continue
        reader = graph.ops[next(iter(readers))]
        if free[reader.index] or reader.type not in ELEMENTWISE_ARITHMETIC or _is_gradient_sum(reader):
            continue
        pairs.append((producer.index, reader.index))
    return pairs


def colocation_groups(graph: OpGraph, free: Optional[List[bool]] = None) -> Groups:
    """Computes the colocation groups of `graph` (see the module doc).

    Raises:
        ValueError: ops of one group were put in different `smp.partition`
            blocks.
    """
    n = len(graph.ops)
    free = free_ops(graph) if free is None else free
    uf = _UnionFind(n)
    second = second_uses(graph, free)
    chains = arithmetic_chains(graph, free)
    updates = second_updates(graph, free, chains)
    # Ops that go with their variable rather than with the call that made them.
    follows = {**second, **updates}
    first_user_of_var: Dict[str, int] = {}
    first_op_of_call: Dict[str, int] = {}
    for op in graph.ops:
        i = op.index
        if free[i]:
            continue
        for v in op.variables:
            j = first_user_of_var.setdefault(v, i)
            uf.union(i, j)
        site = _site(op)
        # A second use's read, and a second update of the variable's state,
        # belong to the variable, not to the call they were made in (that
        # call may run on another partition).
        # A composite layer's glue is not joined: like a model's, it spans
        # the calls of the layer's sublayers, which may land on different
        # partitions, and joined it would pull them back and forth.
        if site is not None and i not in follows and not op.glue:
            j = first_op_of_call.setdefault(site, i)
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
        if op.type == "ReadVariableOp" and op.variables and i not in second:
            for j in _value_users(graph, i):
                if not free[j]:
                    uf.union(i, j)

    for i, v in updates.items():
        uf.union(i, first_user_of_var[v])

    # The smp.partition blocks of each group's ops (the ops that follow
    # their variable aside), by root, kept up to date by `join`.
    requested: Dict[int, set] = {}
    for op in graph.ops:
        if op.manual_partition is not None and not free[op.index] and op.index not in follows:
            requested.setdefault(uf.find(op.index), set()).add(op.manual_partition)

    def apart(ra: int, rb: int) -> bool:
        """Whether the groups of roots `ra` and `rb` were put in different blocks."""
        wants_a, wants_b = requested.get(ra), requested.get(rb)
        return bool(wants_a and wants_b and wants_a != wants_b)

    def join(a: int, b: int) -> None:
        """Joins the groups of `a` and `b` unless they were put in different blocks."""
        ra, rb = uf.find(a), uf.find(b)
        if ra == rb or apart(ra, rb):
            return
        wants_a, wants_b = requested.pop(ra, set()), requested.pop(rb, set())
        uf.union(a, b)
        if wants_a | wants_b:
            requested[uf.find(a)] = wants_a | wants_b

    # Rule 6, once rules 1 to 5 have made the groups.
    for a, b in chains:
        join(a, b)

    # Second uses, once every other rule has joined what it joins: the users
    # of the value stay with the variable only when moving the variable
    # would cost more bytes than moving the activations around them.
    for r, v in second.items():
        chain = {r}
        users = []
        for j in _value_users(graph, r):
            if graph.ops[j].type in _VALUE_PRESERVING:
                chain.add(j)
            if not free[j]:
                users.append(j)
        skip = {t for k in chain for t in graph.ops[k].outputs}
        for root in dict.fromkeys(uf.find(j) for j in users):
            if root == uf.find(r):
                continue
            if apart(uf.find(r), root):
                continue  # the user put this use in another smp.partition block
            in_group = [uf.find(k) == root for k in range(n)]
            if graph.variable_bytes.get(v, 0) > _forward_exchange(graph, in_group, skip):
                join(r, root)

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
            if i in second and any(group_of[j] != g or j in updates for j in _value_users(graph, i) if not free[j]):
                continue  # a read for a use elsewhere, or for an update, follows its variable
            if i in updates:
                continue  # so does the update of its state by a later call
            p = graph.ops[i].manual_partition
            if p is not None:
                requested.setdefault(p, graph.ops[i].name)
        if len(requested) > 1:
            why = sorted({v for i in ms for v in graph.ops[i].variables})[:3]
            layers = sorted({graph.ops[i].layer for i in ms if graph.ops[i].layer})[:3]
            raise ValueError(
                "Ops that must stay on one partition were placed in different "
                f"smp.partition blocks: {', '.join(f'{name!r} in partition {p}' for p, name in sorted(requested.items()))}. "
                f"They share variables {why} / layers {layers}. Put one layer call, "
                "and a variable's first use, inside one smp.partition block (a later call of "
                "a layer may go in another block)."
            )
        if requested:
            manual[g] = next(iter(requested))
    return Groups(group_of, members, free, manual)
