"""Tests for smp_tf.partitioner.groups and smp_tf.partitioner.plan.

Each test builds a few ops by hand with `OpGraph.from_spec` (one output
tensor per op) and explains the expected answer before asserting it.
"""

from __future__ import annotations

import pytest

from smp_tf.graph_view import OpGraph
from smp_tf.partitioner.groups import colocation_groups, free_ops, second_updates, second_uses


def _names(graph, indices):
    return sorted(graph.ops[i].name for i in indices)


def _same_group(groups, graph, *names):
    ids = {groups.group_of[graph.op_index[n]] for n in names}
    return len(ids) == 1 and -1 not in ids


# --------------------------------------------------------------------------
# free_ops
# --------------------------------------------------------------------------


def test_free_ops_are_constants_arguments_and_what_they_compute():
    g = OpGraph.from_spec(
        [
            {"name": "x", "type": "Placeholder", "kind": "arg"},
            {"name": "c", "type": "Const"},
            {"name": "shape", "type": "Shape", "inputs": ["x"]},
            {"name": "scaled", "type": "Mul", "inputs": ["x", "c"]},
            {"name": "captured_const", "type": "Placeholder", "kind": "capture"},
            {"name": "h", "type": "Placeholder", "kind": "capture", "variables": ["w"]},
            {"name": "read", "type": "ReadVariableOp", "inputs": ["h"], "variables": ["w"]},
            {"name": "mm", "type": "MatMul", "inputs": ["scaled", "read"]},
            {"name": "rng", "type": "RandomUniform", "inputs": ["shape"], "stateful": True},
            {"name": "dropout", "type": "Mul", "inputs": ["x", "rng"]},
        ]
    )
    free = free_ops(g)
    # Free: the argument x, the constant c, ops computed only from them
    # (shape of x, x*c), and a captured (non-variable) tensor.
    assert _names(g, [i for i, f in enumerate(free) if f]) == sorted(
        ["x", "c", "shape", "scaled", "captured_const"]
    )
    # Not free: the captured variable handle and its read (they touch a
    # variable), the matmul reading the variable, the stateful RNG op even
    # though its only input is free, and the op computed from the RNG.
    for name in ["h", "read", "mm", "rng", "dropout"]:
        assert not free[g.op_index[name]], name


# --------------------------------------------------------------------------
# colocation_groups: the union rules one at a time
# --------------------------------------------------------------------------


def test_tied_variable_puts_two_layers_in_one_group():
    # "encoder" and "decoder" are different layers but both read the tied
    # embedding "emb": rule 1 joins every op that touches it, and rule 2
    # then drags in the rest of each layer. "head" touches neither: alone.
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "enc/read", "variables": ["emb"], "layer": "encoder"},
            {"name": "enc/gather", "inputs": ["x", "enc/read"], "layer": "encoder"},
            {"name": "head/mm", "inputs": ["enc/gather"], "layer": "head", "variables": ["w_head"]},
            {"name": "dec/read", "variables": ["emb"], "layer": "decoder"},
            {"name": "dec/mm", "inputs": ["head/mm", "dec/read"], "layer": "decoder"},
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "enc/read", "enc/gather", "dec/read", "dec/mm")
    assert not _same_group(groups, g, "enc/read", "head/mm")
    # Two groups: {encoder+decoder} (first op enc/read) then {head}; group
    # ids follow the first op, so the tied group is 0; x is free (-1).
    assert len(groups) == 2
    assert groups.group_of[g.op_index["enc/read"]] == 0
    assert groups.group_of[g.op_index["head/mm"]] == 1
    assert groups.group_of[g.op_index["x"]] == -1
    assert _names(g, groups.members[0]) == sorted(["enc/read", "enc/gather", "dec/read", "dec/mm"])


def _tied_lm(emb_bytes: int, act_bytes: int = 64, head_block=None, emb_block=None):
    """An embedding, one block, and the embedding used again as the output projection.

    Gradient ops make the projection's read a second use; ``opt/read`` is the
    optimizer's read (nothing differentiates through it).
    """
    return OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "emb/h", "kind": "capture", "variables": ["emb"]},
            {"name": "emb/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"],
             "layer": "emb", "call": "emb@1", "manual_partition": emb_block},
            {"name": "emb/gather", "inputs": ["emb/read", "x"], "layer": "emb", "call": "emb@1",
             "bytes": act_bytes, "manual_partition": emb_block},
            {"name": "block/mm", "inputs": ["emb/gather"], "layer": "block", "call": "block@2", "bytes": act_bytes},
            {"name": "head/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"],
             "layer": "emb", "call": "emb@3", "manual_partition": head_block},
            {"name": "head/t", "type": "Identity", "inputs": ["head/read"], "layer": "emb", "call": "emb@3",
             "manual_partition": head_block},
            {"name": "head/mm", "type": "MatMul", "inputs": ["block/mm", "head/t"], "layer": "emb",
             "call": "emb@3", "bytes": act_bytes, "manual_partition": head_block},
            {"name": "loss", "inputs": ["head/mm"]},
            {"name": "grad/loss", "inputs": ["loss"], "forward": "loss"},
            {"name": "grad/head_w", "inputs": ["grad/loss", "block/mm"], "forward": "head/mm", "bytes": emb_bytes},
            {"name": "grad/head_x", "inputs": ["grad/loss", "head/t"], "forward": "head/mm", "bytes": act_bytes},
            {"name": "grad/block", "inputs": ["grad/head_x"], "forward": "block/mm"},
            {"name": "grad/gather", "inputs": ["grad/block"], "forward": "emb/gather", "bytes": emb_bytes},
            {"name": "grad/sum", "type": "AddN", "inputs": ["grad/gather", "grad/head_w"], "is_gradient": True,
             "bytes": emb_bytes},
            {"name": "opt/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"]},
            {"name": "opt/new", "type": "Sub", "inputs": ["opt/read", "grad/sum"], "bytes": emb_bytes},
            {"name": "opt/assign", "type": "AssignVariableOp", "inputs": ["emb/h", "opt/new"], "writes": ["emb"]},
        ],
        variable_bytes={"emb": emb_bytes},
    )


def test_a_second_use_of_a_small_variable_is_a_group_of_its_own():
    # The projection's value users exchange 64 + 64 bytes of activations
    # with the model (block/mm in, head/mm out); the 32-byte embedding is
    # cheaper to send, so the projection is free to run elsewhere. Its read
    # stays with the variable, and so does the optimizer's (not a second use).
    g = _tied_lm(emb_bytes=32)
    assert {g.ops[i].name for i in second_uses(g)} == {"head/read"}
    groups = colocation_groups(g)
    assert _same_group(groups, g, "emb/read", "emb/gather", "head/read", "opt/read", "opt/new", "opt/assign")
    assert _same_group(groups, g, "head/t", "head/mm", "grad/head_w", "grad/head_x")
    assert not _same_group(groups, g, "head/read", "head/mm")


def test_a_second_use_of_a_large_variable_stays_with_it():
    # A 1000-byte embedding costs more to send than the 128 bytes of
    # activations around the projection: the projection stays with it.
    g = _tied_lm(emb_bytes=1000)
    groups = colocation_groups(g)
    assert _same_group(groups, g, "emb/read", "emb/gather", "head/read", "head/t", "head/mm", "grad/head_w")


def test_a_second_use_in_another_block_is_honoured_even_for_a_large_variable():
    g = _tied_lm(emb_bytes=1000, emb_block=0, head_block=1)
    groups = colocation_groups(g)
    assert not _same_group(groups, g, "head/read", "head/mm")
    assert groups.manual[groups.group_of[g.op_index["emb/read"]]] == 0
    assert groups.manual[groups.group_of[g.op_index["head/mm"]]] == 1


def test_a_read_outside_layers_is_a_second_use_only_when_differentiated():
    # No gradient ops: a read in model glue (an inference-only projection,
    # or an optimizer-like update) is not a second use and keeps today's
    # grouping; the second call of the layer is one whatever the step does.
    g = OpGraph.from_spec(
        [
            {"name": "emb/h", "kind": "capture", "variables": ["emb"]},
            {"name": "emb/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"],
             "layer": "emb", "call": "emb@1"},
            {"name": "glue/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"]},
            {"name": "glue/mm", "inputs": ["emb/read", "glue/read"], "bytes": 1 << 20},
            {"name": "call2/read", "type": "ReadVariableOp", "inputs": ["emb/h"], "variables": ["emb"],
             "layer": "emb", "call": "emb@2"},
            {"name": "call2/mm", "inputs": ["glue/mm", "call2/read"], "layer": "emb", "call": "emb@2",
             "bytes": 1 << 20},
        ]
    )
    assert {g.ops[i].name for i in second_uses(g)} == {"call2/read"}
    groups = colocation_groups(g)
    assert _same_group(groups, g, "emb/read", "glue/read", "glue/mm", "call2/read")
    assert not _same_group(groups, g, "call2/read", "call2/mm")


def _dropout_called_twice(first_block=None, second_block=None):
    """A dropout layer called twice: each call reads its seed generator's
    state, advances it (read, add one, assign) and draws a mask from the
    seed it read. The second call runs on activations of another layer."""
    def call(n, x, block):
        site = {"layer": "drop", "call": f"drop@{n}", "manual_partition": block}
        return [
            {"name": f"c{n}/read", "type": "ReadVariableOp", "inputs": ["seed/h"], "variables": ["seed"], **site},
            {"name": f"c{n}/plus_one", "type": "AddV2", "inputs": [f"c{n}/read"], "dtype": "int64", **site},
            {"name": f"c{n}/assign", "type": "AssignVariableOp", "inputs": ["seed/h", f"c{n}/plus_one"],
             "variables": ["seed"], "writes": ["seed"], **site},
            {"name": f"c{n}/mask", "type": "StatelessRandomUniformV2", "inputs": [f"c{n}/read"], **site},
            {"name": f"c{n}/apply", "type": "Mul", "inputs": [x, f"c{n}/mask"], "bytes": 1 << 16, **site},
        ]
    return OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "seed/h", "kind": "capture", "variables": ["seed"]},
            {"name": "a", "type": "MatMul", "inputs": ["x"], "layer": "a", "stateful": True, "bytes": 1 << 16,
             "manual_partition": first_block},
            *call(1, "a", first_block),
            {"name": "b", "type": "MatMul", "inputs": ["c1/apply"], "layer": "b", "bytes": 1 << 16,
             "manual_partition": second_block},
            *call(2, "b", second_block),
        ]
    )


def test_a_later_call_updates_the_state_where_it_lives_and_draws_with_its_neighbours():
    # The second call's read, increment and write of the seed go with the
    # seed (they must run where it lives); its mask and product are free
    # to follow the layer b it reads (only the 16-byte seed would cross).
    g = _dropout_called_twice()
    assert _names(g, second_updates(g)) == ["c2/assign", "c2/plus_one"]
    groups = colocation_groups(g)
    assert _same_group(groups, g, "c1/read", "c1/assign", "c2/read", "c2/plus_one", "c2/assign")
    assert _same_group(groups, g, "c2/mask", "c2/apply")
    assert not _same_group(groups, g, "c2/read", "c2/apply")
    # The first call is one group with its state, as any layer call.
    assert _same_group(groups, g, "c1/read", "c1/plus_one", "c1/mask", "c1/apply")


def test_a_layer_with_state_may_be_called_again_in_another_block():
    # Calling one Dropout in two smp.partition blocks used to be refused:
    # the second call's state update tied it to the first block.
    g = _dropout_called_twice(first_block=0, second_block=1)
    groups = colocation_groups(g)
    assert groups.manual[groups.group_of[g.op_index["c2/assign"]]] == 0
    assert groups.manual[groups.group_of[g.op_index["c2/apply"]]] == 1


def test_shared_variable_alone_joins_ops_without_layers():
    # No layers at all: two reads of one variable are joined by rule 1 only.
    g = OpGraph.from_spec(
        [
            {"name": "r1", "variables": ["v"]},
            {"name": "a", "inputs": ["r1"]},
            {"name": "r2", "variables": ["v"]},
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "r1", "r2")
    # "a" shares no variable, layer, forward op or colocation: its own group.
    assert not _same_group(groups, g, "r1", "a")
    assert len(groups) == 2


def test_one_layer_is_one_group():
    # (Ops without inputs are made stateful so that they are not free.)
    # Ops of one layer with no shared variable are joined by rule 2; a
    # second layer stays apart even though it reads the first one's output.
    g = OpGraph.from_spec(
        [
            {"name": "L0/a", "layer": "L0", "stateful": True},
            {"name": "L0/b", "inputs": ["L0/a"], "layer": "L0"},
            {"name": "L1/a", "inputs": ["L0/b"], "layer": "L1"},
            {"name": "L0/c", "layer": "L0", "stateful": True},  # disconnected, same layer
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "L0/a", "L0/b", "L0/c")
    assert not _same_group(groups, g, "L0/a", "L1/a")
    assert len(groups) == 2


def test_gradient_op_joins_its_forward_op():
    # f1's gradient reads only g2 (another gradient) but rule 3 puts it with f1.
    g = OpGraph.from_spec(
        [
            {"name": "f1", "stateful": True},
            {"name": "f2", "inputs": ["f1"]},
            {"name": "g2", "inputs": ["f2"], "forward": "f2"},
            {"name": "g1", "inputs": ["g2"], "forward": "f1"},
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "f1", "g1")
    assert _same_group(groups, g, "f2", "g2")
    assert not _same_group(groups, g, "f1", "f2")


def test_gradient_of_a_free_forward_op_is_not_joined_to_it():
    # The forward op "c" is a constant (free); free ops are in no group, so
    # its gradient "gc" (not free: it reads a stateful op) forms its own group.
    g = OpGraph.from_spec(
        [
            {"name": "c", "type": "Const"},
            {"name": "s", "stateful": True},
            {"name": "gc", "inputs": ["s"], "forward": "c"},
        ]
    )
    groups = colocation_groups(g)
    assert groups.group_of[g.op_index["c"]] == -1
    assert groups.group_of[g.op_index["gc"]] >= 0
    assert not _same_group(groups, g, "s", "gc")


def test_colocate_with_joins_ops():
    # z asks to be colocated with y (TensorFlow's _class): rule 4.
    # Unknown names in colocate_with are ignored.
    g = OpGraph.from_spec(
        [
            {"name": "y", "stateful": True},
            {"name": "other", "stateful": True},
            {"name": "z", "inputs": ["other"], "colocate_with": ["y", "not_in_graph"]},
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "y", "z")
    assert not _same_group(groups, g, "y", "other")


def test_union_rules_are_transitive():
    # a~b by variable v, b~c by layer L, c~d by colocation, e grad of d:
    # all five in one group, although a and e have nothing in common.
    g = OpGraph.from_spec(
        [
            {"name": "a", "variables": ["v"]},
            {"name": "b", "variables": ["v"], "layer": "L"},
            {"name": "c", "layer": "L", "stateful": True},
            {"name": "d", "colocate_with": ["c"], "stateful": True},
            {"name": "e", "inputs": ["d"], "forward": "d"},
            {"name": "lonely", "stateful": True},
        ]
    )
    groups = colocation_groups(g)
    assert _same_group(groups, g, "a", "b", "c", "d", "e")
    assert len(groups) == 2


def test_manual_partition_is_recorded_per_group():
    # One op of layer L asks for partition 1; the group inherits it.
    g = OpGraph.from_spec(
        [
            {"name": "L/a", "layer": "L", "manual_partition": 1, "stateful": True},
            {"name": "L/b", "layer": "L", "stateful": True},
            {"name": "M/a", "layer": "M", "stateful": True},
        ]
    )
    groups = colocation_groups(g)
    gl = groups.group_of[g.op_index["L/a"]]
    assert gl >= 0 and _same_group(groups, g, "L/a", "L/b")
    # Only L's group has a manual partition; M's has none.
    assert groups.manual == {gl: 1}


def test_manual_partition_conflict_in_one_group_raises_naming_both_ops():
    # enc and dec share the tied variable "emb" (one group), but the user put
    # enc in smp.partition(0) and dec in smp.partition(1): impossible.
    g = OpGraph.from_spec(
        [
            {"name": "enc/read", "variables": ["emb"], "manual_partition": 0},
            {"name": "dec/read", "variables": ["emb"], "manual_partition": 1},
        ]
    )
    with pytest.raises(ValueError) as info:
        colocation_groups(g)
    msg = str(info.value)
    assert "'enc/read' in partition 0" in msg
    assert "'dec/read' in partition 1" in msg
    assert "emb" in msg


def test_the_glue_of_a_composite_layer_goes_with_its_neighbours():
    # A block layer (call "B@1") calls two sublayers and creates glue
    # between them: a product of the first sublayer's outputs and, after
    # the second sublayer, a residual addition. Rule 2 joins the ops of
    # one call, but not the glue: joined, the product and the addition
    # would pull each other (and the sublayers between them) onto one
    # partition; apart, each follows its neighbours.
    g = OpGraph.from_spec(
        [
            {"name": "x", "type": "Placeholder", "kind": "arg"},
            {"name": "A/f", "inputs": ["x"], "variables": ["wa"], "layer": "A", "call": "A@2"},
            {"name": "B/gate", "type": "Relu", "inputs": ["A/f"], "layer": "B", "call": "B@1", "glue": True},
            {"name": "C/f", "inputs": ["B/gate"], "variables": ["wc"], "layer": "C", "call": "C@3"},
            {"name": "B/residual", "type": "Maximum", "inputs": ["x", "C/f"], "layer": "B", "call": "B@1",
             "glue": True},
            {"name": "D/leaf1", "inputs": ["B/residual"], "layer": "D", "call": "D@4"},
            {"name": "D/leaf2", "inputs": ["D/leaf1"], "layer": "D", "call": "D@4"},
        ]
    )
    groups = colocation_groups(g)
    assert not _same_group(groups, g, "B/gate", "B/residual")
    # The ops of a leaf layer's call are one group, as before.
    assert _same_group(groups, g, "D/leaf1", "D/leaf2")


def _gated_product(reader_type="Mul", dtype="float32", extra_reader=False, manual=(None, None)):
    """Two layers' outputs a and b, their product m (no layer, as in a
    subclassed model's call) and m's reader d in a third layer."""
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg"},
        {"name": "A/f", "inputs": ["x"], "variables": ["wa"], "layer": "A", "call": "A@1"},
        {"name": "B/f", "inputs": ["x"], "variables": ["wb"], "layer": "B", "call": "B@2"},
        {"name": "m", "type": "Mul", "inputs": ["A/f", "B/f"], "dtype": dtype, "manual_partition": manual[0]},
        {"name": "c", "type": "Const"},
        {"name": "D/d", "type": reader_type, "inputs": ["m", "c"], "layer": "D", "call": "D@3",
         "manual_partition": manual[1]},
        {"name": "D/rng", "inputs": ["D/d"], "layer": "D", "call": "D@3", "stateful": True},
    ]
    if extra_reader:
        spec.append({"name": "E/f", "inputs": ["m"], "layer": "E", "call": "E@4"})
    return OpGraph.from_spec(spec)


def test_an_arithmetic_op_joins_the_only_op_that_reads_it():
    # m = a * b is read only by d = m * c (a dropout's scaling, say). One
    # device's graph optimiser computes a * (b * c) instead; the pipelined
    # step can do the same only if m and d run in one task (rule 6).
    g = _gated_product()
    groups = colocation_groups(g)
    assert _same_group(groups, g, "m", "D/d", "D/rng")
    # Not the layers whose outputs m reads.
    assert not _same_group(groups, g, "m", "A/f")
    assert not _same_group(groups, g, "m", "B/f")


@pytest.mark.parametrize("case", ["two readers", "reader is not arithmetic", "integers"])
def test_an_arithmetic_op_stays_apart_when_the_optimiser_could_not_fold_it(case):
    # A second reader keeps m (the optimiser rewrites a chain only through
    # an op with one reader); a MatMul is not reassociated with a product;
    # integer arithmetic does not round.
    g = _gated_product(
        extra_reader=case == "two readers",
        reader_type="MatMul" if case == "reader is not arithmetic" else "Mul",
        dtype="int32" if case == "integers" else "float32",
    )
    groups = colocation_groups(g)
    assert not _same_group(groups, g, "m", "D/d")


def test_an_arithmetic_chain_cut_by_smp_partition_blocks_stays_cut():
    # The user put m in block 0 and its reader in block 1: honoured, with no
    # error, although the two ops then round differently from one device.
    g = _gated_product(manual=(0, 1))
    groups = colocation_groups(g)
    assert not _same_group(groups, g, "m", "D/d")
    assert groups.manual[groups.group_of[g.op_index["m"]]] == 0
    assert groups.manual[groups.group_of[g.op_index["D/d"]]] == 1
    # Only one side in a block: the chain joins that block.
    g = _gated_product(manual=(None, 1))
    groups = colocation_groups(g)
    assert _same_group(groups, g, "m", "D/d")
    assert groups.manual[groups.group_of[g.op_index["m"]]] == 1


# --------------------------------------------------------------------------
# plan: assign_partitions, check_assignment, PartitionPlan
# --------------------------------------------------------------------------


def _plan():
    # Imported here so that the groups tests above run even while a sibling
    # module (partitioner.balance) is being written.
    from smp_tf.partitioner import plan

    return plan


def _chain(num_layers=4, manual=None, act_bytes=None):
    """x -> L0 -> L1 -> ... -> loss, then the gradients in reverse.

    Every layer has a variable read (4 bytes), a forward op (10 flops, 100
    bytes out, or ``act_bytes[i]``) and a gradient op (10 flops); loss and
    its gradient cost 0.
    """
    manual = manual or {}
    act_bytes = act_bytes or [100] * num_layers
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]
    prev = "x"
    for i in range(num_layers):
        spec.append({"name": f"L{i}/read", "variables": [f"w{i}"], "layer": f"L{i}", "flops": 0,
                     "manual_partition": manual.get(i)})
        spec.append({"name": f"L{i}/f", "inputs": [prev, f"L{i}/read"], "layer": f"L{i}", "flops": 10,
                     "bytes": act_bytes[i]})
        prev = f"L{i}/f"
    spec.append({"name": "loss", "inputs": [prev], "flops": 0})
    spec.append({"name": "loss/grad", "inputs": ["loss"], "forward": "loss", "flops": 0})
    dprev = "loss/grad"
    for i in reversed(range(num_layers)):
        spec.append({"name": f"L{i}/grad", "inputs": [dprev, f"L{i}/read"], "forward": f"L{i}/f",
                     "flops": 10, "bytes": 100})
        dprev = f"L{i}/grad"
    return OpGraph.from_spec(spec)


def _part(graph, assignment, name):
    return assignment[graph.op_index[name]]


def test_single_partition_puts_everything_on_zero():
    g = _chain()
    assignment = _plan().assign_partitions(g, 1)
    assert assignment == [0] * len(g)


def test_num_partitions_must_be_positive():
    with pytest.raises(ValueError, match="num_partitions must be >= 1"):
        _plan().assign_partitions(_chain(), 0)


def test_manual_mode_honours_smp_partition_and_defaults_the_rest():
    # auto_partition=False: layer L1 asked for partition 2 and L3 for 1 (via
    # its read op); everything else goes to default_partition=0. The gradient
    # op of each layer follows its forward op (same group), and the free
    # argument x follows its consumer L0 (partition 0).
    g = _chain(manual={1: 2, 3: 1})
    a = _plan().assign_partitions(g, 3, auto_partition=False, default_partition=0)
    expected = {"L0": 0, "L1": 2, "L2": 0, "L3": 1}
    for layer, p in expected.items():
        for suffix in ["read", "f", "grad"]:
            assert _part(g, a, f"{layer}/{suffix}") == p, (layer, suffix)
    assert _part(g, a, "loss") == 0 and _part(g, a, "loss/grad") == 0
    assert _part(g, a, "x") == 0


def test_manual_mode_default_partition():
    # Same, but unplaced ops go to default_partition=1.
    g = _chain(manual={0: 0})
    a = _plan().assign_partitions(g, 2, auto_partition=False, default_partition=1)
    assert _part(g, a, "L0/f") == 0 and _part(g, a, "L0/grad") == 0
    assert all(_part(g, a, f"L{i}/{s}") == 1 for i in (1, 2, 3) for s in ("read", "f", "grad"))
    assert _part(g, a, "loss") == 1


def test_auto_contiguous_splits_four_equal_layers_two_and_two():
    # Units in forward order: L0, L1, L2, L3 (each: 20 flops of 80 = 1/4 of
    # the flops + 0.1 * 1/4 of the variables) and loss (cost 0). Contiguous
    # splits into 2: {L0} | {L1..loss} has bottleneck 3 layers, {L0,L1} |
    # {L2,L3,loss} has 2, {L0..L2} | {L3,loss} has 3. The unique optimum
    # is 2+2: L0, L1 on partition 0, L2, L3 and loss on 1. Gradient ops
    # follow their forward ops, the loss gradient follows the loss.
    g = _chain()
    a = _plan().assign_partitions(g, 2, optimize="speed", contiguous=True)
    for i, p in enumerate([0, 0, 1, 1]):
        for suffix in ["read", "f", "grad"]:
            assert _part(g, a, f"L{i}/{suffix}") == p, (i, suffix)
    assert _part(g, a, "loss") == 1 and _part(g, a, "loss/grad") == 1
    # x is free and follows its only consumer, L0/f.
    assert _part(g, a, "x") == 0


def test_auto_contiguous_memory_mode_weighs_variable_bytes():
    # optimize="memory": unit cost = variable bytes * (1 + 2 slots) plus the
    # forward activations read by gradient ops. Make L0's variable huge
    # (1000 bytes -> 3000) against 4*3 + 100 = 112 for the other layers:
    # the best 2-way split isolates L0, so L1..L3 and the loss go on 1.
    spec_graph = _chain()
    g = OpGraph(spec_graph.ops, spec_graph.tensors, {**spec_graph.variable_bytes, "w0": 1000})
    a = _plan().assign_partitions(g, 2, optimize="memory")
    assert _part(g, a, "L0/f") == 0
    assert [_part(g, a, f"L{i}/f") for i in (1, 2, 3)] == [1, 1, 1]


def test_memory_mode_counts_each_stages_fixed_overheads():
    # Four equal layers (4 variable bytes * (1 + 2 slots + 2 gradients) = 20
    # each; no gradient op reads a forward output, so no activations): 2 + 2
    # without overheads. A stage 1 that needs 30 bytes whatever it holds
    # (say, the workspace of its loss) is best with one layer: 3 + 1 costs
    # max(60, 20 + 30) = 60 against 2 + 2's 70 and 4 + 0's 80.
    g = _chain()
    plan = _plan()
    even = plan.assign_partitions(g, 2, optimize="memory", stage_multipliers=[1.0, 1.0])
    assert [_part(g, even, f"L{i}/f") for i in range(4)] == [0, 0, 1, 1]
    heavy = plan.assign_partitions(g, 2, optimize="memory", stage_multipliers=[1.0, 1.0], stage_overheads=[0, 30])
    assert [_part(g, heavy, f"L{i}/f") for i in range(4)] == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="fixed_costs must have"):
        plan.assign_partitions(g, 2, optimize="memory", stage_multipliers=[1.0, 1.0], stage_overheads=[0])


@pytest.mark.parametrize("contiguous", [True, False])
def test_memory_mode_keeps_variable_bytes_within_ten_percent_of_even(contiguous):
    # Activations dominate the first layers, variables the last two. Memory
    # alone would isolate L0 (10012 of 26224 bytes) and leave 2008 of the
    # 2016 variable bytes on partition 1; the variable limit (1.10 x 1008)
    # allows only L3 (1000 bytes) apart from the rest.
    base = _chain(act_bytes=[10000, 10000, 100, 100])
    g = OpGraph(base.ops, base.tensors, {**base.variable_bytes, "w2": 1000, "w3": 1000})
    plan = _plan()
    a = plan.assign_partitions(g, 2, optimize="memory", contiguous=contiguous)
    per_part = [0, 0]
    for v, nbytes in g.variable_bytes.items():
        readers = {a[op.index] for op in g.ops if v in op.variables}
        assert len(readers) == 1
        per_part[readers.pop()] += nbytes
    assert max(per_part) <= plan.VARIABLE_BALANCE * sum(per_part) / 2
    assert _part(g, a, "L2/f") != _part(g, a, "L3/f")
    if contiguous:
        assert [_part(g, a, f"L{i}/f") for i in range(4)] == [0, 0, 0, 1]


def test_variable_limit_is_what_a_contiguous_split_can_do():
    plan = _plan()
    # Even share 5, largest unit 4: 1.10 x 5 unless contiguity needs more.
    assert plan.variable_limit([4, 1, 1, 4], 2, contiguous=False) == pytest.approx(5.5)
    assert plan.variable_limit([4, 1, 1, 4], 2, contiguous=True) == pytest.approx(5.5)
    # [4, 4, 1, 1]: the best contiguous split holds 8 | 2 or 4 | 6.
    assert plan.variable_limit([4, 4, 1, 1], 2, contiguous=True) == pytest.approx(6)
    assert plan.variable_limit([4, 4, 1, 1], 2, contiguous=False) == pytest.approx(5.5)


def test_free_ops_follow_their_consumer():
    # c (a constant) feeds only B/f, which is manually on partition 1: c goes
    # to 1. k -> k2 (free chain) feeds A/f on 0: both on 0 (consumers are
    # visited before producers). "unused" feeds nobody: default partition.
    g = OpGraph.from_spec(
        [
            {"name": "c", "type": "Const"},
            {"name": "k", "type": "Const"},
            {"name": "k2", "inputs": ["k"]},
            {"name": "unused", "type": "Const"},
            {"name": "A/f", "inputs": ["k2"], "stateful": True, "manual_partition": 0},
            {"name": "B/f", "inputs": ["A/f", "c"], "stateful": True, "manual_partition": 1},
        ]
    )
    a = _plan().assign_partitions(g, 2, auto_partition=False, default_partition=0)
    assert _part(g, a, "c") == 1
    assert _part(g, a, "k") == 0 and _part(g, a, "k2") == 0
    assert _part(g, a, "unused") == 0
    a = _plan().assign_partitions(g, 2, auto_partition=False, default_partition=1)
    assert _part(g, a, "unused") == 1


def test_free_op_with_consumers_on_two_partitions_takes_the_earliest():
    # x feeds A/f (partition 0, created first) and B/f (partition 1): the
    # free op goes to the earliest of them, partition 0.
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "A/f", "inputs": ["x"], "stateful": True, "manual_partition": 0},
            {"name": "B/f", "inputs": ["x", "A/f"], "stateful": True, "manual_partition": 1},
        ]
    )
    a = _plan().assign_partitions(g, 2, auto_partition=False)
    assert _part(g, a, "x") == 0


def test_gradient_only_group_follows_its_heaviest_neighbour():
    # Units: A (partition 0), B (partition 1) -- two equal forward ops.
    # "dangling" is a gradient op with no forward op: not a unit. It reads
    # 4 bytes from A and 100 from B, so it follows B to partition 1.
    g = OpGraph.from_spec(
        [
            {"name": "A", "stateful": True, "flops": 5, "bytes": 4},
            {"name": "B", "inputs": ["A"], "stateful": True, "flops": 5, "bytes": 100},
            {"name": "dangling", "inputs": ["A", "B"], "is_gradient": True, "stateful": True},
        ]
    )
    a = _plan().assign_partitions(g, 2)
    assert _part(g, a, "A") == 0 and _part(g, a, "B") == 1
    assert _part(g, a, "dangling") == 1


def test_check_assignment_rejects_bad_assignments():
    plan = _plan()
    g = OpGraph.from_spec([{"name": "a"}, {"name": "b", "inputs": ["a"]}])
    plan.check_assignment(g, [0, 1], 2)  # valid: no error
    # Too short: one op has no partition.
    with pytest.raises(RuntimeError, match="1 assignments for 2 ops"):
        plan.check_assignment(g, [0], 2)
    # Out of range (2 with 2 partitions), unassigned (-1), not an int.
    for bad in ([0, 2], [-1, 0], [0, 1.0], [0, None]):
        with pytest.raises(RuntimeError, match="Partition invariant violated"):
            plan.check_assignment(g, bad, 2)


def _plan_graph():
    """p0: x(arg) -> a(100 B) -> {b on p1, c on p2, d on p0}; b -> e on p2."""
    return OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg", "bytes": 64, "flops": 0},
            {"name": "a", "inputs": ["x"], "bytes": 100, "flops": 1e9, "variables": ["wa"], "stateful": True},
            {"name": "b", "inputs": ["a"], "bytes": 10, "flops": 2e9, "variables": ["wb"]},
            {"name": "c", "inputs": ["a"], "bytes": 7, "flops": 1e9},
            {"name": "d", "inputs": ["a"], "bytes": 7, "flops": 0},
            {"name": "e", "inputs": ["b", "c"], "bytes": 4, "flops": 0, "variables": ["wb"]},
        ],
        variable_bytes={"wa": 1000, "wb": 3000},
    )


def test_partition_plan_cut_bytes():
    plan = _plan()
    g = _plan_graph()
    parts = [0, 0, 1, 2, 0, 2]
    p = plan.PartitionPlan(None, g, parts, 3, devices=["/cpu:0", "/cpu:1", "/cpu:2"])
    # a's 100-byte tensor is consumed on partitions 1 (b) and 2 (c) besides
    # its own (d): sent twice, 200. b's 10 bytes go 1 -> 2: 10. c -> e is
    # inside partition 2. x is a free step argument fed where needed: 0.
    # Total 210.
    assert p.cut_bytes == 210
    assert p.assignment == {"x": 0, "a": 0, "b": 1, "c": 2, "d": 0, "e": 2}


def test_partition_plan_summary_and_report():
    plan = _plan()
    g = _plan_graph()
    p = plan.PartitionPlan(None, g, [0, 0, 1, 2, 0, 2], 3, devices=["/cpu:0", "/cpu:1", "/cpu:2"], seconds=0.5)
    rows = p.summary()
    # Partition 0: x, a, d (3 ops, 1 GFLOP), variable wa (1000 B).
    # Partition 1: b (1 op, 2 GFLOP), wb (3000 B) -- wb is attributed to the
    #   first op using it (b), although e on partition 2 uses it too.
    # Partition 2: c, e (2 ops, 1 GFLOP), no variable of its own.
    assert [r["ops"] for r in rows] == [3, 1, 2]
    assert [r["flops"] for r in rows] == [1e9, 2e9, 1e9]
    assert [r["variables"] for r in rows] == [1, 1, 0]
    assert [r["variable_bytes"] for r in rows] == [1000, 3000, 0]
    assert [r["device"] for r in rows] == ["/cpu:0", "/cpu:1", "/cpu:2"]
    assert p.partition_of_variable() == {"wa": 0, "wb": 1}
    text = p.report()
    # Header: 3 partitions, 6 ops, 210 B cut, 0.50 s.
    assert "3 partitions, 6 ops, 210 B cut per micro-batch, 0.50 s" in text
    lines = text.splitlines()
    assert len(lines) == 2 + 3
    # Partition 1 row: 3000 B of 4000 = 75.0% of the variables; 2 of 4 GFLOP = 50.0%.
    row1 = lines[3].split()
    assert row1[0] == "1" and row1[1] == "/cpu:1"
    assert "75.0%" in row1 and "50.0%" in row1 and "2.000" in row1


def test_partition_plan_report_widens_the_device_column_for_devices_of_other_processes():
    # With pipeline_processes the devices carry their job and task.
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(3)]
    p = _plan().PartitionPlan(None, _plan_graph(), [0, 0, 1, 2, 0, 2], 3, devices=devices, seconds=0.5)
    lines = p.report().splitlines()[1:]
    assert len({len(line) for line in lines}) == 1, lines  # every column lines up
    end = lines[0].index("ops") + 3  # the counts are right-aligned under "ops"
    assert [line[:end].split()[-1] for line in lines[1:]] == ["3", "1", "2"]
    assert lines[2].split()[1] == devices[1]


def test_partition_plan_rejects_invalid_assignment():
    with pytest.raises(RuntimeError):
        _plan().PartitionPlan(None, _plan_graph(), [0, 0, 1, 3, 0, 2], 3)


def test_unit_costs_speed_and_memory():
    plan = _plan()
    # Groups: {r0} (reads variable v0, 6 bytes; r0 shares no variable, layer
    # or colocation with f0, so it stays alone), {f0, g0} (g0 is f0's
    # gradient and reads f0's 40-byte output) and {f1, g1} (variables v1, v2).
    g = OpGraph.from_spec(
        [
            {"name": "r0", "variables": ["v0"], "flops": 0},
            {"name": "f0", "inputs": ["r0"], "flops": 30, "bytes": 40},
            {"name": "f1", "inputs": ["f0"], "flops": 50, "variables": ["v1", "v2"], "bytes": 8},
            {"name": "g1", "inputs": ["f1"], "forward": "f1", "flops": 0},
            {"name": "g0", "inputs": ["g1", "f0"], "forward": "f0", "flops": 20},
        ],
        variable_bytes={"v0": 6, "v1": 10, "v2": 1},
    )
    groups = colocation_groups(g)
    by_name = {n: groups.group_of[g.op_index[n]] for n in ["r0", "f0", "f1"]}
    assert len(groups) == 3
    speed = plan.unit_costs(g, groups, "speed")
    # speed = flop share + 0.1 * variable-count share.
    # {r0}: 0/100 + 0.1*1/3; {f0,g0}: 50/100; {f1,g1}: 50/100 + 0.1*2/3.
    assert speed[by_name["r0"]] == pytest.approx(0.1 / 3)
    assert speed[by_name["f0"]] == pytest.approx(0.5)
    assert speed[by_name["f1"]] == pytest.approx(0.5 + 0.2 / 3)
    memory = plan.unit_costs(g, groups, "memory", slots=2.0)
    # memory = variable bytes * (1 + 2) + activations read by gradient ops.
    # {r0}: 6*3 = 18; {f0,g0}: f0's 40 bytes are read by g0 -> 40;
    # {f1,g1}: (10+1)*3 = 33 + f1's 8 bytes read by g1 = 41.
    assert memory[by_name["r0"]] == pytest.approx(18)
    assert memory[by_name["f0"]] == pytest.approx(40)
    assert memory[by_name["f1"]] == pytest.approx(41)
    with pytest.raises(ValueError, match="optimize must be"):
        plan.unit_costs(g, groups, "latency")


def test_cut_costs_count_a_skip_connection_on_every_boundary_it_spans():
    plan = _plan()
    # Units u0, u1, u2, u3 in order. u0's 100-byte output is read by u1 and
    # (skip connection) by u3: it crosses boundaries 0|1, 1|2 and 2|3.
    # u1 -> u2 sends 10 bytes (boundary 1|2), u2 -> u3 sends 1 (2|3).
    g = OpGraph.from_spec(
        [
            {"name": "u0", "stateful": True, "bytes": 100},
            {"name": "u1", "inputs": ["u0"], "stateful": True, "bytes": 10},
            {"name": "u2", "inputs": ["u1"], "stateful": True, "bytes": 1},
            {"name": "u3", "inputs": ["u2", "u0"], "stateful": True, "bytes": 4},
        ]
    )
    groups = colocation_groups(g)
    unit_of_group = {groups.group_of[i]: i for i in range(4)}
    assert plan._cut_costs(g, groups, unit_of_group, 4) == [100, 110, 101]


def test_a_light_unit_is_not_moved_against_the_forward_order():
    """A cheap glue op C reads a big skip connection from L0 and a small
    tensor from L1: by bytes alone it would go to L0's partition, but there
    it would wait for L1's partition, and the forward pass would go
    0 -> 1 -> 0 -> 2. It stays where the forward order puts it."""
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]
    for i, (src, nbytes) in enumerate([("x", 10_000), ("L0/f", 10)]):
        spec.append({"name": f"L{i}/read", "variables": [f"w{i}"], "layer": f"L{i}", "flops": 0})
        spec.append({"name": f"L{i}/f", "inputs": [src, f"L{i}/read"], "layer": f"L{i}", "flops": 100,
                     "bytes": nbytes})
    spec.append({"name": "C/f", "inputs": ["L0/f", "L1/f"], "layer": "C", "flops": 1, "bytes": 10})
    spec.append({"name": "L2/read", "variables": ["w2"], "layer": "L2", "flops": 0})
    spec.append({"name": "L2/f", "inputs": ["C/f", "L2/read"], "layer": "L2", "flops": 100, "bytes": 10})
    spec.append({"name": "loss", "inputs": ["L2/f"], "flops": 0})
    g = OpGraph.from_spec(spec)
    a = _plan().assign_partitions(g, 3)
    assert [_part(g, a, f"L{i}/f") for i in range(3)] == [0, 1, 2]
    assert _part(g, a, "C/f") in (1, 2)


def test_a_unit_that_reads_a_later_partition_moves_there():
    """A rotary-like group R (``c = q * cos``, then ``c + rotate(c) * sin``,
    one group) and the rotation T read each other, so no order of the two
    keeps the forward pass in order. R's first op comes first, and the split
    puts the cut between R and T: the forward pass would go 0 -> 1 (T) -> 0
    (R) -> 1 (O). R, cheap and variable-free, moves to T's partition,
    slightly over the split's bound."""
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]
    for name, src, flops, nbytes in [("A", "x", 100, 10), ("Q", "A/f", 100, 1000)]:
        spec.append({"name": f"{name}/read", "variables": [f"w{name}"], "layer": name, "flops": 0})
        spec.append({"name": f"{name}/f", "inputs": [src, f"{name}/read"], "layer": name, "flops": flops,
                     "bytes": nbytes})
    spec += [
        {"name": "R/cos", "inputs": ["Q/f"], "layer": "R", "flops": 0.5, "bytes": 10},
        {"name": "T/f", "inputs": ["R/cos"], "layer": "T", "flops": 100, "bytes": 10},
        {"name": "R/sin", "inputs": ["T/f"], "layer": "R", "flops": 0.5, "bytes": 10},
        {"name": "R/add", "inputs": ["R/cos", "R/sin"], "layer": "R", "flops": 0, "bytes": 10},
        {"name": "O/read", "variables": ["wO"], "layer": "O", "flops": 0},
        {"name": "O/f", "inputs": ["R/add", "O/read"], "layer": "O", "flops": 120, "bytes": 10},
        {"name": "loss", "inputs": ["O/f"], "flops": 0},
    ]
    g = OpGraph.from_spec(spec)
    a = _plan().assign_partitions(g, 2)
    assert [_part(g, a, n) for n in ("A/f", "Q/f", "T/f", "O/f")] == [0, 0, 1, 1]
    assert [_part(g, a, n) for n in ("R/cos", "R/sin", "R/add")] == [1, 1, 1]


def test_units_are_split_in_topological_order_not_first_op_order():
    """A fusion stage ``inputs + residual(x)`` (DepthAnything's neck): the
    sum J reads the projection P of the stage before, and is its only
    reader, so the two are one group (an arithmetic chain), whose first op
    comes before the residual unit U that J also reads. Cut in the order of
    first ops ([A, P+J] | [U, O]), the forward pass went 0 -> 1 (U) -> 0 (J)
    -> 1 (O), and the group's two halves ran in different tasks of
    partition 0. In topological order the cut falls between U and P+J."""
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]
    for name, src in [("A", "x"), ("P", "x")]:
        spec.append({"name": f"{name}/read", "variables": [f"w{name}"], "layer": name, "flops": 0})
        spec.append({"name": f"{name}/f", "inputs": [src, f"{name}/read"], "layer": name, "flops": 100,
                     "bytes": 10})
    spec += [
        {"name": "P/bias", "type": "BiasAdd", "inputs": ["P/f"], "layer": "P", "flops": 1, "bytes": 10},
        {"name": "U/read", "variables": ["wU"], "layer": "U", "flops": 0},
        {"name": "U/f", "inputs": ["A/f", "U/read"], "layer": "U", "flops": 100, "bytes": 10},
        {"name": "J/add", "type": "AddV2", "inputs": ["P/bias", "U/f"], "flops": 1, "bytes": 10},
        {"name": "O/read", "variables": ["wO"], "layer": "O", "flops": 0},
        {"name": "O/f", "inputs": ["J/add", "O/read"], "layer": "O", "flops": 100, "bytes": 10},
        {"name": "loss", "inputs": ["O/f"], "flops": 0},
    ]
    g = OpGraph.from_spec(spec)
    groups = colocation_groups(g)
    assert groups.group_of[g.op_index["P/f"]] == groups.group_of[g.op_index["J/add"]]
    a = _plan().assign_partitions(g, 2)
    parts = {n: _part(g, a, n) for n in ("A/f", "U/f", "P/f", "J/add", "O/f")}
    assert parts == {"A/f": 0, "U/f": 0, "P/f": 1, "J/add": 1, "O/f": 1}


def test_groups_that_read_each_other_are_ordered_together():
    """A router: the softmax S and the top-k K read each other (K reads the
    softmax, S's normalisation reads the top-k), so neither can go first by
    itself. The combine C reads S; the residual sum J, a group whose first
    op comes before S's, reads C. The forward order puts S and K together
    where their inputs are ready, and J after C: releasing the blocked group
    whose first op comes first (J) would have put it before the router it
    reads, and the split would send the forward pass back."""
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]

    def op(name, inputs, layer, var=None, flops=10):
        if var:
            spec.append({"name": f"{layer}/read", "variables": [var], "layer": layer, "flops": 0})
            inputs = inputs + [f"{layer}/read"]
        spec.append({"name": name, "inputs": inputs, "layer": layer, "flops": flops, "bytes": 10})

    op("A/f", ["x"], "A", var="wA", flops=100)
    op("J/early", ["A/f"], "J")
    op("S/soft", ["A/f"], "S")
    op("K/top", ["S/soft"], "K")
    op("S/div", ["S/soft", "K/top"], "S")
    op("E/f", ["A/f"], "E", var="wE", flops=100)
    op("C/mul", ["E/f", "S/div"], "C")
    op("J/add", ["J/early", "C/mul"], "J")
    op("O/f", ["J/add"], "O", var="wO", flops=100)
    spec.append({"name": "loss", "inputs": ["O/f"], "flops": 0})
    g = OpGraph.from_spec(spec)
    groups = colocation_groups(g)
    pos = _plan()._group_positions(g, groups)
    at = {name: pos[groups.group_of[g.op_index[name]]] for name in ("A/f", "S/soft", "K/top", "E/f", "C/mul",
                                                                    "J/add", "O/f")}
    assert at["A/f"] < at["S/soft"] < at["K/top"] < at["C/mul"] < at["J/add"] < at["O/f"]
    assert at["E/f"] < at["C/mul"]
    a = _plan().assign_partitions(g, 2)
    parts = [_part(g, a, n) for n in ("A/f", "S/soft", "K/top", "E/f", "C/mul", "J/add", "O/f")]
    assert parts == sorted(parts)


def test_a_gradient_sum_keeps_the_backward_order():
    """L0's output is read by Q on partition 0 and by K, V and the residual
    R on partition 1, so its gradient is a sum of four terms, three of them
    made on partition 1. By bytes alone the sum would go to partition 1
    (three terms in, against one term in and the sum out on partition 0),
    and partition 0 would send Q's term forward: each micro-batch's backward
    would go 1 -> 0 -> 1 -> 0. The sum goes to partition 0, which reads it."""
    spec = [{"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0}]
    fwd = [("L0/f", ["x"], 0), ("Q/f", ["L0/f"], 0), ("K/f", ["L0/f"], 1), ("V/f", ["L0/f"], 1),
           ("R/f", ["L0/f"], 1), ("C/f", ["Q/f", "K/f", "V/f", "R/f"], 1)]
    for name, inputs, part in fwd:
        spec.append({"name": name, "inputs": inputs, "manual_partition": part, "stateful": True, "bytes": 100})
    spec.append({"name": "dC/f", "inputs": ["C/f"], "forward": "C/f", "bytes": 100})
    for name in ("Q", "K", "V", "R"):
        spec.append({"name": f"d{name}/f", "inputs": ["dC/f"], "forward": f"{name}/f", "bytes": 100})
    spec.append({"name": "sum", "type": "AddN", "inputs": ["dQ/f", "dK/f", "dV/f", "dR/f"], "is_gradient": True,
                 "bytes": 100})
    spec.append({"name": "dL0/f", "inputs": ["sum"], "forward": "L0/f", "bytes": 100})
    g = OpGraph.from_spec(spec)
    a = _plan().assign_partitions(g, 2, auto_partition=False)
    assert [_part(g, a, n) for n in ("dQ/f", "dK/f", "dL0/f")] == [0, 1, 0]
    assert _part(g, a, "sum") == 0
    # Where no partition keeps the order (a term made on partition 0 and
    # the sum read on partition 1), the bytes decide as before.
    spec[-1] = {"name": "dL0/f", "inputs": ["sum"], "forward": "K/f", "bytes": 100}
    g = OpGraph.from_spec(spec)
    a = _plan().assign_partitions(g, 2, auto_partition=False)
    assert _part(g, a, "sum") == 1
