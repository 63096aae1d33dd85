"""Tests for smp_tf.rewrite: duplicable ops, waves, tasks, task specs, task GraphDefs.

Graphs are built by hand (`OpGraph.from_spec`, one output tensor per op,
whose tensor id is the op's index) with a hand-written partition for every
op; each test explains the expected answer before asserting it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from smp_tf.graph_view import OpGraph, from_tf_graph
from smp_tf.rewrite import (
    Task, build_tasks, duplicable_ops, fusable_gradients, pretranspose_graph_def, pretransposable_products,
    shared_squares, task_graph_def, task_specs, waves,
)
from smp_tf.schedules import TaskKind, make_schedule, validate


def _chain3(skip=False, extra=()):
    """A 3-stage chain: forward f0, f1, f2, the loss, gradients b2, b1, b0.

    Partitions: x:-, r0/f0/b0: 0, r1/f1/b1: 1, r2/f2/loss/b2: 2 (the free
    ops x, y, c get the partition of their consumer, it does not matter).
    Each stage reads its weight through a variable read r<i> (no data
    input), which its forward and its gradient both use.
    """
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 0},
        {"name": "y", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 2},
        {"name": "c", "type": "Const", "flops": 0, "p": 2},
        {"name": "r0", "type": "ReadVariableOp", "variables": ["w0"], "flops": 0, "p": 0},
        {"name": "f0", "inputs": ["x", "r0"], "flops": 10, "p": 0},
        {"name": "r1", "type": "ReadVariableOp", "variables": ["w1"], "flops": 0, "p": 1},
        {"name": "f1", "inputs": ["f0", "r1"], "flops": 10, "p": 1},
        {"name": "r2", "type": "ReadVariableOp", "variables": ["w2"], "flops": 0, "p": 2},
        {"name": "f2", "inputs": ["f1", "r2"] + (["f0"] if skip else []), "flops": 10, "p": 2},
        {"name": "loss", "inputs": ["f2", "y", "c"], "flops": 1, "p": 2},
        {"name": "b2", "inputs": ["loss", "f2", "r2"], "forward": "f2", "flops": 20, "p": 2},
        {"name": "b1", "inputs": ["b2", "f1", "r1"], "forward": "f1", "flops": 20, "p": 1},
        {"name": "b0", "inputs": ["b1", "f0", "r0"], "forward": "f0", "flops": 20, "p": 0},
        *extra,
    ]
    parts = [s.pop("p") for s in spec]
    return OpGraph.from_spec(spec), parts


def _idx(g, *names):
    return [g.op_index[n] for n in names]


def _tensor(g, name):
    return g.op(name).outputs[0]


def _by_key(tasks):
    return {t.key: t for t in tasks}


# --------------------------------------------------------------------------
# duplicable_ops
# --------------------------------------------------------------------------


def test_duplicable_ops_are_free_ops_and_placeholders():
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "handle", "kind": "capture", "variables": ["w"]},
            {"name": "read", "inputs": ["handle"], "variables": ["w"]},
            {"name": "c", "type": "Const"},
            {"name": "shape", "inputs": ["x", "c"]},
            {"name": "f", "inputs": ["shape", "read"]},
        ]
    )
    dup = duplicable_ops(g)
    # x (argument), c and shape (free) can be recomputed anywhere; the
    # captured variable handle is not free (it touches w) but it is a
    # placeholder, so every task gets its own copy. The read and f are not.
    assert [g.ops[i].name for i, d in enumerate(dup) if d] == ["x", "handle", "c", "shape"]
    # `keep` pins an op (a producer of a step output) to a single task, but
    # never a placeholder.
    dup = duplicable_ops(g, keep=_idx(g, "shape", "x", "handle"))
    assert [g.ops[i].name for i, d in enumerate(dup) if d] == ["x", "handle", "c"]


# --------------------------------------------------------------------------
# waves
# --------------------------------------------------------------------------


def test_waves_of_a_three_stage_chain():
    g, parts = _chain3()
    dup = duplicable_ops(g)
    w = waves(g, parts, dup)
    # The wave is the number of partition boundaries on the longest path
    # from a step argument:
    #   f0 reads x on partition 0:                    0
    #   f1 (partition 1) reads f0 (partition 0):      1
    #   f2 crosses again:                             2
    #   loss and b2 stay on partition 2:              2 (no boundary)
    #   b1 reads b2 from partition 2:                 3
    #   b0 reads b1 from partition 1:                 4
    expected = {"f0": 0, "f1": 1, "f2": 2, "loss": 2, "b2": 2, "b1": 3, "b0": 4}
    assert {n: w[g.op_index[n]] for n in expected} == expected
    # Duplicable ops (x, y, c) have no wave.
    assert [w[i] for i in _idx(g, "x", "y", "c")] == [None, None, None]


def test_variable_read_joins_the_first_task_that_needs_it():
    g, parts = _chain3()
    w = waves(g, parts, duplicable_ops(g))
    # r1 has no data input, so the longest path into it is 0 boundaries;
    # but it would be pointless as a task of its own at wave 0 on
    # partition 1. It joins the earliest consumer on its partition: f1
    # (wave 1); b1 (wave 3) then receives it from that task.
    assert w[g.op_index["r1"]] == 1
    assert w[g.op_index["r2"]] == 2
    assert w[g.op_index["r0"]] == 0
    # Hence no (partition 1, wave 0) or (partition 2, wave 0) task exists.
    keys = {(p, wv) for p, wv in zip(parts, w) if wv is not None}
    assert keys == {(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)}


def test_values_computed_without_data_on_another_partition_join_their_readers_tasks():
    # A seed read on partition 1 ("seed", no data input) read by f1 and by a
    # mask drawn on partition 2 ("mask", which reads nothing else and feeds
    # f2): one call of a dropout on each side of a cut, sharing one seed (a
    # Swin block's drop path). Reading another partition does not make the
    # mask depend on data: it joins f2's task, and the seed joins f1's,
    # instead of two tasks of their own at waves 0 and 1 (seen on Swin at 3
    # partitions: 7 tasks instead of 5).
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 0},
        {"name": "r0", "type": "ReadVariableOp", "variables": ["w0"], "flops": 0, "p": 0},
        {"name": "f0", "inputs": ["x", "r0"], "flops": 10, "p": 0},
        {"name": "seed", "type": "ReadVariableOp", "variables": ["s"], "flops": 0, "p": 1},
        {"name": "f1", "inputs": ["f0", "seed"], "flops": 10, "p": 1},
        {"name": "mask", "inputs": ["seed"], "flops": 1, "p": 2},
        {"name": "tied", "type": "ReadVariableOp", "variables": ["e"], "flops": 0, "p": 0},
        {"name": "f2", "inputs": ["f1", "mask", "tied"], "flops": 10, "p": 2},
        {"name": "b2", "inputs": ["f2", "mask"], "forward": "f2", "flops": 20, "p": 2},
        {"name": "b1", "inputs": ["b2", "f1"], "forward": "f1", "flops": 20, "p": 1},
        {"name": "b0", "inputs": ["b1", "f0"], "forward": "f0", "flops": 20, "p": 0},
    ]
    parts = [s.pop("p") for s in spec]
    g = OpGraph.from_spec(spec)
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["seed"]] == 1
    assert w[g.op_index["mask"]] == 2
    # A read on partition 0 that only partition 2 needs (a tied embedding
    # read for the output projection) joins the forward task at wave 0, the
    # latest task of partition 0 before wave 2, not a task of its own at 1.
    assert w[g.op_index["tied"]] == 0
    keys = {(p, wv) for p, wv in zip(parts, w) if wv is not None}
    assert keys == {(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)}


def _encoder_decoder(bias_reader="f1", bias_op=None, last_stage_bias=False):
    """An encoder on partition 0 and a decoder on 1 and 2 whose attention
    bias ("bias", then "masked") is computed on partition 1 from the
    decoder's own input "xd" and a variable: it depends on data but not on
    the encoder, so it is ready at wave 0 (keras_hub's T5 at 3 partitions).
    `bias_reader` "f1": the decoder's forwards on partitions 1 and 2 read
    it; "b1": only the backward on partition 1 does. `last_stage_bias`:
    partition 2 computes a bias of its own ("pos") from "xd" for f2.
    """
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 0},
        {"name": "xd", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 1},
        {"name": "r0", "type": "ReadVariableOp", "variables": ["w0"], "flops": 0, "p": 0},
        {"name": "f0", "inputs": ["x", "r0"], "flops": 10, "p": 0},
        {"name": "rb", "type": "ReadVariableOp", "variables": ["relative_bias"], "flops": 0, "p": 1},
        dict({"name": "bias", "inputs": ["xd", "rb"], "flops": 1, "p": 1}, **(bias_op or {})),
        {"name": "masked", "inputs": ["bias", "xd"], "flops": 1, "p": 1},
        {"name": "f1", "inputs": ["f0"] + (["masked"] if bias_reader == "f1" else []), "flops": 10, "p": 1},
        {"name": "f2", "inputs": ["f1"] + (["masked"] if bias_reader == "f1" else [])
         + (["pos"] if last_stage_bias else []), "flops": 10, "p": 2},
        {"name": "b2", "inputs": ["f2"], "forward": "f2", "flops": 20, "p": 2},
        {"name": "b1", "inputs": ["b2", "f1"] + (["masked"] if bias_reader == "b1" else []), "forward": "f1",
         "flops": 20, "p": 1},
        {"name": "b0", "inputs": ["b1", "f0"], "forward": "f0", "flops": 20, "p": 0},
    ]
    if last_stage_bias:
        spec[-4:-4] = [
            {"name": "rp", "type": "ReadVariableOp", "variables": ["position_bias"], "flops": 0, "p": 2},
            {"name": "pos", "inputs": ["xd", "rp"], "flops": 1, "p": 2},
        ]
    parts = [s.pop("p") for s in spec]
    return OpGraph.from_spec(spec), parts


def test_a_wave_of_values_only_later_tasks_read_joins_the_next_forward_task():
    # As soon as possible, the bias is a task of partition 1 at wave 0 of
    # its own, ahead of f1's: one more call per micro-batch (T5 at P=3 had
    # 6 tasks). It joins f1's task, the latest forward task of partition 1
    # before every reader (f1 there, f2 a wave later on partition 2).
    g, parts = _encoder_decoder()
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["bias"]] == w[g.op_index["masked"]] == w[g.op_index["rb"]] == 1
    keys = {(p, wv) for p, wv in zip(parts, w) if wv is not None}
    assert keys == {(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)}
    tasks = build_tasks(g, parts, [g.op_index["b0"]])  # output tensor id == op index
    assert sorted(t.key for t in tasks) == sorted(keys)
    assert all(t.kind is TaskKind.FORWARD for t in tasks if t.key == (1, 1))


def test_a_lone_forward_value_that_only_a_backward_reads_joins_a_forward_task():
    # Joining the backward task that reads it would make that task a fused
    # one; the forward task at wave 1 precedes it as well.
    g, parts = _encoder_decoder(bias_reader="b1")
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["bias"]] == w[g.op_index["masked"]] == 1
    kinds = {t.key: t.kind for t in build_tasks(g, parts, [g.op_index["b0"]])}
    assert kinds[(1, 1)] is TaskKind.FORWARD and kinds[(1, 3)] is TaskKind.BACKWARD


def test_a_lone_forward_value_of_the_last_stage_joins_its_fused_task():
    # The last stage's only later task is its fused forward-backward one:
    # forward work leaves it fused, so the bias joins it rather than run in
    # a task of its own at wave 0 (keras_hub's T5Gemma at 3 partitions).
    g, parts = _encoder_decoder(last_stage_bias=True)
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["pos"]] == 2
    kinds = {t.key: t.kind for t in build_tasks(g, parts, [g.op_index["b0"]])}
    assert sorted(kinds) == [(0, 0), (0, 4), (1, 1), (1, 3), (2, 2)]
    assert kinds[(2, 2)] is TaskKind.FUSED


@pytest.mark.parametrize("case", ["random", "state"])
def test_a_lone_forward_wave_of_random_draws_or_written_state_stays(case):
    # Random draws and the state the step writes keep the task the rules
    # of `waves` give them: moving them would change what the micro-batches
    # draw or read.
    bias_op = {"type": "RandomUniform"} if case == "random" else {"variables": ["counter"], "writes": ["counter"]}
    g, parts = _encoder_decoder(bias_op=bias_op)
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["bias"]] == 0


def _late_gradient(partition, reader, reader_partition, also_reads):
    """`_chain3` plus a gradient "g" on `partition` computed from that
    partition's forward value alone (a masked gradient of a value that
    every partition reads, as DeBERTa's relative-position embedding), read
    by `reader` on `reader_partition`, which also reads `also_reads`."""
    extra = [
        {"name": "g", "inputs": [f"f{partition}"], "forward": f"f{partition}", "flops": 1, "p": partition},
        {"name": reader, "inputs": [also_reads, "g"], "forward": f"f{reader_partition}", "flops": 1,
         "p": reader_partition},
    ]
    g, parts = _chain3(extra=extra)
    return g, parts, waves(g, parts, duplicable_ops(g))


def _keys(parts, w):
    return {(p, wv) for p, wv in zip(parts, w) if wv is not None}


def test_a_gradient_read_by_an_earlier_partition_joins_a_task_that_computes_gradients():
    # "acc" on partition 0 adds the last partition's "g" at the end of the
    # backward (wave 4). As late as that reader allows is wave 3, where
    # partition 2 has nothing else to do: a task of one op. "g" joins
    # partition 2's fused task instead, the latest that computes gradients.
    g, parts, w = _late_gradient(2, "acc", 0, "b0")
    assert w[g.op_index["g"]] == 2
    assert _keys(parts, w) == {(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)}
    tasks = _by_key(build_tasks(g, parts, [_tensor(g, "acc")]))
    assert tasks[(2, 2)].kind is TaskKind.FUSED
    assert tasks[(0, 4)].producer_of_input[_tensor(g, "g")] == (2, 2)


def test_a_late_gradient_joins_the_latest_backward_task_before_its_reader():
    # "g" on partition 1 is read on partition 2 by "late2", which also
    # reads b0 (partition 0, wave 4) and so runs at wave 5. As late as that
    # reader allows is wave 4, where partition 1 has nothing else to do; it
    # joins B1 at wave 3 instead.
    g, parts, w = _late_gradient(1, "late2", 2, "b0")
    assert w[g.op_index["late2"]] == 5
    assert w[g.op_index["g"]] == 3
    assert _keys(parts, w) == {(0, 0), (1, 1), (2, 2), (1, 3), (0, 4), (2, 5)}


def test_a_late_gradient_does_not_join_a_forward_task():
    # The same gradient read at wave 3 on partition 0 ("late0" also reads
    # f2, which reaches partition 0 at wave 3): before that, partition 1
    # only has its forward task F1, which the gradient would make a fused
    # one. It keeps the wave its reader gives it.
    g, parts, w = _late_gradient(1, "late0", 0, "f2")
    assert w[g.op_index["late0"]] == 3
    assert w[g.op_index["g"]] == 2
    kinds = {t.key: t.kind for t in build_tasks(g, parts, [_tensor(g, "b0"), _tensor(g, "late0")])}
    assert kinds[(1, 1)] is TaskKind.FORWARD


def test_read_used_only_by_the_backward_joins_the_backward_task():
    # A read "r1b" on partition 1 used only by b1 (wave 3) joins wave 3, and
    # a stateful update "bump" on partition 1 that nobody consumes joins the
    # partition's first task (wave 1).
    extra = [
        {"name": "r1b", "variables": ["w1b"], "p": 1},
        {"name": "b1b", "inputs": ["b1", "r1b"], "forward": "f1", "p": 1},
        {"name": "bump", "stateful": True, "p": 1},
    ]
    g, parts = _chain3(extra=extra)
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["b1b"]] == 3
    assert w[g.op_index["r1b"]] == 3
    assert w[g.op_index["bump"]] == 1


def test_variable_read_feeding_another_partition_runs_one_wave_earlier():
    # A read on partition 1 consumed only by f0 on partition 0: the value
    # crosses a boundary, so f0 starts at wave 1 and the read, one wave
    # before its consumer, at wave 0.
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "r", "variables": ["w"]},
            {"name": "f0", "inputs": ["x", "r"]},
        ]
    )
    w = waves(g, [0, 1, 0], duplicable_ops(g))
    assert w == [None, 0, 1]


def test_same_partition_control_edge_orders_waves():
    # "late" on partition 0 has a control edge from b0 (wave 4 on partition
    # 0) and no data input: it must not run before b0, so it gets wave 4.
    g, parts = _chain3(extra=[{"name": "late", "stateful": True, "control_inputs": ["b0"], "p": 0}])
    w = waves(g, parts, duplicable_ops(g))
    assert w[g.op_index["late"]] == 4


# --------------------------------------------------------------------------
# build_tasks
# --------------------------------------------------------------------------


def test_build_tasks_on_a_three_stage_chain():
    g, parts = _chain3()
    outputs = [_tensor(g, "loss"), _tensor(g, "b0")]
    tasks = build_tasks(g, parts, outputs)
    # Sorted by (wave, partition): F0, F1, FB2, B1, B0.
    assert [t.key for t in tasks] == [(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)]
    t = _by_key(tasks)

    def names(ids):
        return [g.ops[i].name for i in ids]

    # Members in creation order: each stage's read joins its forward task.
    assert names(t[0, 0].members) == ["r0", "f0"]
    assert names(t[1, 1].members) == ["r1", "f1"]
    assert names(t[2, 2].members) == ["r2", "f2", "loss", "b2"]
    assert names(t[1, 3].members) == ["b1"]
    assert names(t[0, 4].members) == ["b0"]
    # Copies: the argument x is copied into the task of f0; y and the
    # constant c into the task of the loss. Nobody else reads them.
    assert names(t[0, 0].copies) == ["x"]
    assert names(t[2, 2].copies) == ["y", "c"]
    assert t[1, 1].copies == t[1, 3].copies == t[0, 4].copies == []
    # Inputs and where they come from:
    #  F1 reads f0 from F0; FB2 reads f1 from F1;
    #  B1 reads f1 and r1 stashed by F1 (same partition) and b2 from FB2;
    #  B0 reads f0 and r0 stashed by F0 and b1 from B1.
    assert t[0, 0].inputs == []
    assert t[1, 1].producer_of_input == {_tensor(g, "f0"): (0, 0)}
    assert t[2, 2].producer_of_input == {_tensor(g, "f1"): (1, 1)}
    assert t[1, 3].producer_of_input == {
        _tensor(g, "r1"): (1, 1), _tensor(g, "f1"): (1, 1), _tensor(g, "b2"): (2, 2)
    }
    assert t[0, 4].producer_of_input == {
        _tensor(g, "r0"): (0, 0), _tensor(g, "f0"): (0, 0), _tensor(g, "b1"): (1, 3)
    }
    assert t[1, 3].inputs == sorted(t[1, 3].producer_of_input)
    # Only the cross-partition ones get an SMPInput.
    assert t[1, 3].boundary_inputs() == [_tensor(g, "b2")]
    assert t[0, 4].boundary_inputs() == [_tensor(g, "b1")]
    assert t[1, 1].boundary_inputs() == [_tensor(g, "f0")]
    # Outputs: whatever another task reads, plus the step outputs (loss, b0).
    assert t[0, 0].outputs == sorted(_idx(g, "r0", "f0"))
    assert t[1, 1].outputs == sorted(_idx(g, "r1", "f1"))
    assert t[2, 2].outputs == sorted(_idx(g, "loss", "b2"))
    assert t[1, 3].outputs == _idx(g, "b1")
    assert t[0, 4].outputs == _idx(g, "b0")
    # Flags: FB2 holds forward and gradient ops (fused); B1, B0 only
    # gradients; F0, F1 only forward ops.
    assert [(x.backward, x.fused) for x in tasks] == [
        (False, False), (False, False), (True, True), (True, False), (True, False)
    ]
    # Flops of the members: FB2 = f2 10 + loss 1 + b2 20 = 31.
    assert [x.flops for x in tasks] == [10, 10, 31, 20, 20]


def test_gradient_ops_that_carry_forward_values_leave_a_forward_task_a_forward():
    """An embedding's gradient is a `tf.IndexedSlices` whose indices are the
    ids reshaped and whose dense shape is the table's: gradient ops that
    read forward values only, without gradient arithmetic. As step outputs
    they sit in the first forward task, which stays a forward task (the
    schedule then runs the first stage as 1F1B, not as fused tasks)."""
    extra = [
        {"name": "ids", "type": "Reshape", "inputs": ["x"], "flops": 0, "p": 0},
        {"name": "g_ids", "type": "Identity", "inputs": ["ids"], "is_gradient": True, "flops": 0, "p": 0},
        {"name": "g_shape", "type": "Shape", "inputs": ["r0"], "is_gradient": True, "flops": 0, "p": 0},
        {"name": "g_dense", "type": "Identity", "inputs": ["g_shape"], "is_gradient": True, "flops": 0, "p": 0},
        # Gradient arithmetic on forward values (a loss's own gradient)
        # does make its task a backward one.
        {"name": "g_aux", "type": "Mul", "inputs": ["f1", "c"], "is_gradient": True, "flops": 1, "p": 1},
    ]
    g, parts = _chain3(extra=extra)
    outputs = [_tensor(g, n) for n in ("loss", "b0", "g_ids", "g_dense", "g_aux")]
    tasks = _by_key(build_tasks(g, parts, outputs))
    assert set(_idx(g, "g_ids", "g_dense")) <= set(tasks[0, 0].members)
    assert tasks[0, 0].kind is TaskKind.FORWARD
    assert g.op_index["g_aux"] in tasks[1, 1].members and tasks[1, 1].kind is TaskKind.FUSED
    schedule = make_schedule(task_specs(list(tasks.values())), 4, "interleaved")
    assert [schedule.display(a) for a in schedule.order[0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_every_non_duplicable_op_is_in_exactly_one_task():
    g, parts = _chain3(skip=True)
    tasks = build_tasks(g, parts, [_tensor(g, "loss")])
    dup = duplicable_ops(g, keep=_idx(g, "loss"))
    owners = {}
    for t in tasks:
        for i in t.members:
            assert i not in owners, g.ops[i].name
            owners[i] = t.key
        # A member is never also copied, and copies are only duplicable ops.
        assert not set(t.members) & set(t.copies)
        assert all(dup[i] for i in t.copies)
        # A task runs on the partition of every member.
        assert all(parts[i] == t.partition for i in t.members)
    # Every non-duplicable op has an owner; duplicable ones never do.
    assert set(owners) == {i for i, d in enumerate(dup) if not d}


def test_skip_connection_feeds_partition_two_from_partition_zero():
    # f2 also reads f0 (a skip over partition 1): FB2 gets an input from
    # F0, a boundary input, and F0 outputs f0 to both F1 and FB2 (and B0).
    g, parts = _chain3(skip=True)
    t = _by_key(build_tasks(g, parts, [_tensor(g, "loss")]))
    f0 = _tensor(g, "f0")
    assert t[2, 2].producer_of_input[f0] == (0, 0)
    assert f0 in t[2, 2].boundary_inputs()
    assert sorted(t[2, 2].boundary_inputs()) == sorted([f0, _tensor(g, "f1")])
    assert f0 in t[0, 0].outputs
    # The skip does not change the waves: f2 is still 2 boundaries deep.
    assert sorted(t) == [(0, 0), (0, 4), (1, 1), (1, 3), (2, 2)]


def test_copies_include_the_free_ops_a_copy_needs():
    # loss reads k2 = k1(k0): a chain of free ops; all three are copied into
    # the task (the transitive closure), not just k2.
    extra = [
        {"name": "k0", "type": "Const", "p": 2},
        {"name": "k1", "inputs": ["k0"], "p": 2},
        {"name": "k2", "inputs": ["k1", "y"], "p": 2},
        {"name": "loss2", "inputs": ["loss", "k2"], "p": 2},
    ]
    g, parts = _chain3(extra=extra)
    t = _by_key(build_tasks(g, parts, [_tensor(g, "loss2")]))
    assert [g.ops[i].name for i in t[2, 2].copies] == ["y", "c", "k0", "k1", "k2"]
    # Copies are never inputs: nothing is received for them.
    assert not set(t[2, 2].copies) & set(t[2, 2].inputs)


def test_step_output_from_a_free_op_is_owned_by_one_task():
    # n = Shape(x) is free, but it is also a step output, so `keep` pins it
    # to one task (on its partition 0, wave 0), which outputs it. f1 on
    # partition 1 reads it through n2 (free): the copy closure recomputes
    # n there (stateless, so harmless) instead of receiving it.
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "n", "type": "Shape", "inputs": ["x"]},
            {"name": "n2", "inputs": ["n"]},
            {"name": "f0", "inputs": ["x"], "stateful": True},
            {"name": "f1", "inputs": ["f0", "n2"], "stateful": True},
        ]
    )
    tasks = build_tasks(g, [0, 0, 1, 0, 1], [_tensor(g, "n")])
    n = g.op_index["n"]
    owners = [t.key for t in tasks if n in t.members]
    assert owners == [(0, 0)]
    assert [t.key for t in tasks if _tensor(g, "n") in t.outputs] == [(0, 0)]
    # f1's task receives only f0.
    t1 = _by_key(tasks)[(1, 1)]
    assert t1.inputs == [_tensor(g, "f0")]


# --------------------------------------------------------------------------
# task_specs
# --------------------------------------------------------------------------


def test_task_specs_dependencies_and_costs():
    g, parts = _chain3()
    tasks = build_tasks(g, parts, [_tensor(g, "loss")])
    specs = task_specs(tasks)
    deps = {(s.partition, s.wave): s.deps for s in specs}
    # Each task depends on the producers of its inputs, same partition
    # included (B1 needs F1's stash), in sorted order, without repeats.
    assert deps == {
        (0, 0): (),
        (1, 1): ((0, 0),),
        (2, 2): ((1, 1),),
        (1, 3): ((1, 1), (2, 2)),
        (0, 4): ((0, 0), (1, 3)),
    }
    # Cost: share of the flops times the number of tasks. Flops are
    # 10, 10, 31, 20, 20 (total 91), 5 tasks: e.g. FB2 = 31/91*5.
    costs = {(s.partition, s.wave): s.cost for s in specs}
    assert costs[(2, 2)] == pytest.approx(31 / 91 * 5)
    assert costs[(0, 0)] == pytest.approx(10 / 91 * 5)
    assert [(s.backward, s.fused) for s in specs] == [(t.backward, t.fused) for t in tasks]
    # The specs form a valid pipeline (3 devices, 4 micro-batches).
    validate(make_schedule(specs, 4, "simple"))


def test_task_specs_floor_keeps_empty_tasks_visible():
    # Two tasks: A (100 flops, partition 0) and B (0 flops, partition 1).
    # Costs are flop shares times 2: A = 2.0, and B = 0 -- but a floor of
    # 0.05 keeps the empty task visible to simulations. (a is stateful so
    # that it is not a free op computed from x.)
    g = OpGraph.from_spec(
        [
            {"name": "x", "kind": "arg"},
            {"name": "a", "inputs": ["x"], "flops": 100, "stateful": True},
            {"name": "b", "inputs": ["a"], "flops": 0},
        ]
    )
    specs = task_specs(build_tasks(g, [0, 0, 1], [_tensor(g, "b")]))
    assert [s.cost for s in specs] == [pytest.approx(2.0), pytest.approx(0.05)]
    assert specs[1].deps == ((0, 0),)


# --------------------------------------------------------------------------
# task_graph_def
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_tf_graph():
    """A captured variable read r, and b = identity(a) [^s], e = b*b, d = b + c [^e].

    Creation order: x h r c a0 a s b e d.
    """
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        h = tf.compat.v1.placeholder(tf.resource, [], name="h")
        r = tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32, name="r")
        c = tf.constant(2.0, name="c")
        a0 = tf.multiply(x, c, name="a0")
        a = tf.multiply(a0, r, name="a")
        s = tf.identity(a, name="s")
        with tf.control_dependencies([s]):
            b = tf.identity(a, name="b")
        e = tf.square(b, name="e")
        with tf.compat.v1.colocate_with(b), tf.control_dependencies([e]):
            tf.add(b, c, name="d")
    return g


def _view(g):
    return from_tf_graph(g, arg_ops=["x"], captured_variables={"h": ("w", 24, True)})


def test_task_graph_def_keeps_members_and_copies_on_the_device(small_tf_graph):
    g = small_tf_graph
    og = _view(g)
    gd = g.as_graph_def()
    # A task owning b, e and d, with the constant c copied in; a and s live
    # in another task.
    task = Task(partition=1, wave=1, members=_idx(og, "b", "e", "d"), copies=_idx(og, "c"),
                inputs=[_tensor(og, "a")], producer_of_input={_tensor(og, "a"): (0, 0)})
    device = "/job:localhost/replica:0/task:0/device:CPU:1"
    sub = task_graph_def(gd, og, task, device)
    nodes = {n.name: n for n in sub.node}
    # Exactly the members and copies, in creation order, all on the device.
    assert [n.name for n in sub.node] == ["c", "b", "e", "d"]
    assert all(n.device == device for n in sub.node)
    # b keeps its data input "a" (mapped at import time) but loses the
    # control input ^s (outside the task: the schedule orders tasks).
    assert list(nodes["b"].input) == ["a"]
    # d keeps its control input ^e (inside the task) and drops _class.
    assert list(nodes["d"].input) == ["b", "c", "^e"]
    assert "_class" not in nodes["d"].attr
    # The source GraphDef is untouched.
    src = {n.name: n for n in gd.node}
    assert list(src["b"].input) == ["a", "^s"]
    assert "_class" in src["d"].attr
    assert src["d"].device == ""
    # Importable once its input from another task is mapped in.
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(sub, input_map={"a:0": tf.zeros([2, 3])}, name="t")


def test_task_graph_def_of_built_tasks(small_tf_graph):
    # End to end on the real graph: {x h r c a0 a s} on partition 0, {b e d}
    # on partition 1. r (no data input) joins a's task at wave 0; b crosses
    # a boundary: wave 1. Task 0 owns r, a, s and copies the argument x, the
    # captured handle h and the free ops c and a0 = x*c; task 1 copies c.
    g = small_tf_graph
    og = _view(g)
    gd = g.as_graph_def()
    parts = [0] * 7 + [1] * 3
    tasks = build_tasks(og, parts, [_tensor(og, "d")])
    assert [t.key for t in tasks] == [(0, 0), (1, 1)]
    subs = [task_graph_def(gd, og, t, f"/device:CPU:{t.partition}") for t in tasks]
    assert [[n.name for n in s.node] for s in subs] == [
        ["x", "h", "r", "c", "a0", "a", "s"],
        ["c", "b", "e", "d"],
    ]
    # b's control input ^s came from the other task: dropped.
    b = [n for n in subs[1].node if n.name == "b"][0]
    assert list(b.input) == ["a"]
    assert tasks[1].boundary_inputs() == [_tensor(og, "a")]


def _cube_and_its_gradient():
    """``cube = x ** y`` (y = 3) on partition 0, then the gradient's
    ``sq = x ** (y - 1)``, read by the gradient's product ``g``."""
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0},
        {"name": "y", "type": "Const", "flops": 0},
        {"name": "cube", "type": "Pow", "inputs": ["x", "y"], "flops": 3},
        {"name": "out", "type": "Mul", "inputs": ["cube", "x"], "flops": 1},
        {"name": "one", "type": "Const", "flops": 0},
        {"name": "sub", "type": "Sub", "inputs": ["y", "one"], "forward": "cube", "flops": 0},
        {"name": "sq", "type": "Pow", "inputs": ["x", "sub"], "forward": "cube", "flops": 3},
        {"name": "g", "type": "Mul", "inputs": ["out", "sq"], "forward": "cube", "flops": 1},
    ]
    return OpGraph.from_spec(spec)


def test_shared_squares_pairs_a_cube_with_its_gradients_square_in_another_task():
    g = _cube_and_its_gradient()
    cube, sq = _idx(g, "cube", "sq")
    three = {_tensor(g, "y")}
    forward = Task(partition=0, wave=0, members=_idx(g, "cube", "out"), outputs=[_tensor(g, "out")])
    assert shared_squares(g, forward, lambda t: t in three) == {cube: sq}
    # Not when the exponent is not 3 (the optimiser makes no square for it),
    assert shared_squares(g, forward, lambda t: False) == {}
    # not when the task returns the cube (its name must not change),
    returned = Task(partition=0, wave=0, members=_idx(g, "cube", "out"), outputs=[_tensor(g, "cube")])
    assert shared_squares(g, returned, lambda t: t in three) == {}
    # and not when the gradient's square is in the task (as in one function).
    fused = Task(partition=0, wave=0, members=_idx(g, "cube", "out", "sq", "g"), copies=_idx(g, "sub"))
    assert shared_squares(g, fused, lambda t: t in three) == {}


def test_only_a_real_scalar_constant_counts_as_the_exponent_three():
    from smp_tf.rewrite import _constant_equals

    gr = tf.Graph()
    with gr.as_default():
        tf.constant(3.0, tf.bfloat16, name="bf16")
        tf.constant(3, tf.int32, name="int")
        tf.constant(2.0, name="two")
        tf.constant([3.0, 3.0], name="vector")
        tf.constant(3 + 0j, tf.complex64, name="complex")
        tf.constant("3", name="string")
        tf.compat.v1.placeholder(tf.float32, [], name="fed")
    og = from_tf_graph(gr, arg_ops=["fed"])
    nodes = {n.name: n for n in gr.as_graph_def().node}
    is_three = {n: _constant_equals(nodes, og, _tensor(og, n), 3.0)
                for n in ("bf16", "int", "two", "vector", "complex", "string", "fed")}
    assert is_three == {"bf16": True, "int": True, "two": False, "vector": False, "complex": False,
                        "string": False, "fed": False}


def test_task_graph_def_names_a_cube_under_its_gradients_square():
    gr = tf.Graph()
    with gr.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        y = tf.constant(3.0, name="gelu/Pow/y")
        cube = tf.pow(x, y, name="gelu/Pow")
        tf.multiply(cube, 0.5, name="gelu/mul")
        with tf.name_scope("gradient_tape/gelu/Pow"):
            tf.pow(x, y - 1.0, name="Pow")
    og = from_tf_graph(gr, arg_ops=["x"])
    gd = gr.as_graph_def()
    members = [i for i, op in enumerate(og.ops) if op.type in ("Pow", "Mul") and not op.is_gradient]
    copies = [i for i, op in enumerate(og.ops) if op.kind == "arg" or op.type == "Const"]
    task = Task(partition=0, wave=0, members=members, copies=copies, outputs=[_tensor(og, "gelu/mul")])
    sub = task_graph_def(gd, og, task, "")
    nodes = {n.name: n for n in sub.node}
    # The cube sorts as the gradient's square does (its optimised square is
    # named under it), and its reader follows the new name.
    assert "gelu/Pow" not in nodes
    assert nodes["gradient_tape/gelu/Pow/Pow/Pow"].op == "Pow"
    assert list(nodes["gelu/mul"].input)[0] == "gradient_tape/gelu/Pow/Pow/Pow"
    # The source GraphDef is untouched, and a task holding both keeps the names.
    assert "gelu/Pow" in {n.name for n in gd.node}
    both = Task(partition=0, wave=0, members=[i for i, op in enumerate(og.ops) if op.kind == "op" and op.type != "Const"],
                copies=copies, outputs=[_tensor(og, "gelu/mul")])
    assert "gelu/Pow" in {n.name for n in task_graph_def(gd, og, both, "").node}


# --------------------------------------------------------------------------
# fusable_gradients
# --------------------------------------------------------------------------


def _with_weight_gradients(extra=()):
    """The 3-stage chain plus weight gradients: gw1 = MatMul(f0, b2, transpose_a)
    returned through an Identity, gw0 = MatMul(x, b1, transpose_a) returned
    directly, gb2 = BiasAddGrad(loss), and whatever `extra` adds."""
    return _chain3(extra=[
        {"name": "gw1", "type": "MatMul", "inputs": ["f0", "b2"], "forward": "f1", "p": 1},
        {"name": "gw1_out", "type": "Identity", "inputs": ["gw1"], "flops": 0, "p": 1},
        {"name": "gw0", "type": "MatMul", "inputs": ["x", "b1"], "forward": "f0", "p": 0},
        {"name": "gb2", "type": "BiasAddGrad", "inputs": ["loss"], "forward": "f2", "p": 2},
        *extra,
    ])


_TRANSPOSED = {"transpose_a": True, "transpose_b": False}


def _attrs(g, table):
    return lambda i: table.get(g.ops[i].name, {})


def test_fusable_gradients_finds_weight_and_bias_gradients():
    g, _ = _with_weight_gradients()
    outputs = [_tensor(g, n) for n in ("loss", "gw1_out", "gw0", "gb2")]
    found = fusable_gradients(g, outputs, _attrs(g, {"gw1": _TRANSPOSED, "gw0": _TRANSPOSED}))
    # The loss is no weight gradient; the other three are, in output order.
    assert [f.output for f in found] == [1, 2, 3]
    gw1, gw0, gb2 = found
    # The Identity between gw1 and the output leaves the tasks with it.
    assert sorted(gw1.removed) == _idx(g, "gw1", "gw1_out") and gw1.op == g.op_index["gw1"]
    assert gw1.inputs == (_tensor(g, "f0"), _tensor(g, "b2"))
    # A step argument may be an input (returned as it is per micro-batch).
    assert gw0.inputs == (_tensor(g, "x"), _tensor(g, "b1"))
    assert gb2.removed == (g.op_index["gb2"],) and gb2.inputs == (_tensor(g, "loss"),)


@pytest.mark.parametrize("case", ["not_transposed", "read_elsewhere", "returned_twice", "waited_on", "none_output"])
def test_fusable_gradients_skips_what_cannot_be_summed_after_the_pipeline(case):
    extra, attrs = [], {"gw1": _TRANSPOSED, "gw0": _TRANSPOSED}
    names = ["gw1_out", "gw0"]
    if case == "not_transposed":
        # MatMul(f0, b2) does not sum over the rows of its inputs.
        attrs["gw1"] = {"transpose_a": False, "transpose_b": False}
    elif case == "read_elsewhere":
        # Another op (gradient clipping, say) reads the gradient.
        extra = [{"name": "clip", "inputs": ["gw1_out"], "p": 1}]
    elif case == "returned_twice":
        names = ["gw1_out", "gw0", "gw1_out"]
    elif case == "waited_on":
        extra = [{"name": "after", "type": "NoOp", "control_inputs": ["gw1"], "p": 1}]
    g, _ = _with_weight_gradients(extra)
    outputs = [_tensor(g, n) for n in names]
    if case == "none_output":
        outputs = [None] + outputs
    found = fusable_gradients(g, outputs, _attrs(g, attrs))
    fused_ops = {g.ops[f.op].name for f in found}
    if case == "none_output":
        assert fused_ops == {"gw1", "gw0"} and [f.output for f in found] == [1, 2]
    else:
        assert fused_ops == {"gw0"}


def test_fusable_gradients_skips_inputs_captured_from_outside():
    g, _ = _chain3(extra=[
        {"name": "outer", "type": "Placeholder", "kind": "capture", "flops": 0, "p": 0},
        {"name": "gw", "type": "MatMul", "inputs": ["outer", "b1"], "forward": "f0", "p": 0},
    ])
    assert fusable_gradients(g, [_tensor(g, "gw")], _attrs(g, {"gw": _TRANSPOSED})) == []


def test_build_tasks_leaves_fused_gradients_out_and_returns_their_inputs():
    g, parts = _with_weight_gradients()
    outputs = [_tensor(g, n) for n in ("loss", "gw1_out", "gw0")]
    found = fusable_gradients(g, outputs, _attrs(g, {"gw1": _TRANSPOSED, "gw0": _TRANSPOSED}))
    removed = [i for f in found for i in f.removed]
    task_outputs = sorted({_tensor(g, "loss")} | {t for f in found for t in f.inputs})
    tasks = build_tasks(g, parts, task_outputs, exclude=removed)
    owned = [i for t in tasks for i in t.members + t.copies]
    assert not set(owned) & set(removed)
    t = _by_key(tasks)
    # Same five tasks as without the weight gradients.
    assert sorted(t) == [(0, 0), (0, 4), (1, 1), (1, 3), (2, 2)]
    # The producers return the inputs: f0 (stage 0's forward), b2 (the fused
    # last stage), b1 (stage 1's backward); x is a step argument.
    assert _tensor(g, "f0") in t[0, 0].outputs
    assert _tensor(g, "b2") in t[2, 2].outputs
    assert _tensor(g, "b1") in t[1, 3].outputs


# --------------------------------------------------------------------------
# pretransposable_products / pretranspose_graph_def
# --------------------------------------------------------------------------


def _products(extra=()):
    """x @ W^T through a variable read: capture h -> read r -> MatMul y."""
    return OpGraph.from_spec([
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0},
        {"name": "h", "type": "VarHandleOp", "kind": "capture", "flops": 0},
        {"name": "r", "type": "ReadVariableOp", "inputs": ["h"], "variables": ["w"], "flops": 0},
        {"name": "y", "type": "MatMul", "inputs": ["x", "r"]},
        *extra,
    ])


_T_B = {"transpose_a": False, "transpose_b": True}


def test_pretransposable_products_finds_a_transposed_variable_read():
    g = _products()
    (p,) = pretransposable_products(g, _attrs(g, {"y": _T_B}))
    assert (p.op, p.read, p.capture) == tuple(_idx(g, "y", "r", "h"))


@pytest.mark.parametrize("case", ["not_transposed", "written", "through_identity", "activation"])
def test_pretransposable_products_skips_what_may_change_within_a_step(case):
    extra, attrs = [], {"y": _T_B}
    if case == "not_transposed":
        attrs = {"y": {"transpose_a": False, "transpose_b": False}}
    elif case == "written":
        # The step assigns the variable: its value differs between reads.
        extra = [{"name": "assign", "type": "AssignVariableOp", "inputs": ["h", "x"], "stateful": True}]
    elif case == "through_identity":
        extra = [
            {"name": "i", "type": "Identity", "inputs": ["r"], "flops": 0},
            {"name": "z", "type": "MatMul", "inputs": ["x", "i"]},
        ]
        attrs = {"z": _T_B}
    elif case == "activation":
        # Both operands are activations: nothing to transpose ahead of time.
        extra = [{"name": "z", "type": "MatMul", "inputs": ["x", "y"]}]
        attrs = {"z": _T_B}
    g = _products(extra)
    assert pretransposable_products(g, _attrs(g, attrs)) == []


def test_pretranspose_graph_def_reads_the_transposed_placeholder():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        w = tf.compat.v1.placeholder(tf.float32, [4, 3], name="w")
        tf.linalg.matmul(x, w, transpose_b=True, name="y")
    gd = g.as_graph_def()
    device = "/device:CPU:0"
    for n in gd.node:
        n.device = device
    pretranspose_graph_def(gd, {"y": "smp_transposed/w"}, {"smp_transposed/w": (tf.float32.as_datatype_enum, [3, 4])})
    nodes = {n.name: n for n in gd.node}
    assert list(nodes["y"].input) == ["x", "smp_transposed/w"]
    assert nodes["y"].attr["transpose_b"].b is False
    ph = nodes["smp_transposed/w"]
    assert ph.op == "Placeholder" and ph.device == device
    assert [d.size for d in ph.attr["shape"].shape.dim] == [3, 4]
    # Same product as before once the transposed copy is fed in.
    xv = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    wv = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    with tf.Graph().as_default() as out:
        (y,) = tf.graph_util.import_graph_def(
            gd, input_map={"x:0": tf.constant(xv), "smp_transposed/w:0": tf.constant(wv.T)},
            return_elements=["y:0"], name="t")
        with tf.compat.v1.Session(graph=out) as sess:
            got = sess.run(y)
    np.testing.assert_array_equal(got, xv @ wv.T)


def test_task_graph_def_writes_known_shapes_as_constants():
    # g = Reshape(x, Shape(x)) and a convolution-gradient-like ShapeN read
    # only the shape of x, known when tracing. The task that needs them gets
    # constants, as a single-device run's optimiser makes them: Shape becomes
    # a Const of the same name, ShapeN an IdentityN of the same name over the
    # constants the optimiser would materialise. x stays out of the task: it
    # is not an input just to have its shape read.
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [2, 3], name="y")
        s = tf.raw_ops.Shape(input=x, name="s")
        sn = tf.raw_ops.ShapeN(input=[x, y], out_type=tf.int64, name="sn")
        tf.multiply(x, 2.0, name="v")
        w = tf.reshape(tf.identity(y, name="b"), s, name="w")
        tf.add(tf.cast(sn[1], tf.float32, name="c"), tf.reduce_sum(w), name="d")
    og = from_tf_graph(g, arg_ops=["x", "y"])
    parts = [0 if og.ops[i].name in ("x", "v") else 1 for i in range(len(og.ops))]
    tasks = build_tasks(og, parts, [_tensor(og, "d"), _tensor(og, "v")])
    task = next(t for t in tasks if og.op("d").index in t.members)
    assert _tensor(og, "x") not in task.inputs
    assert og.op("x").index not in task.copies
    sub = task_graph_def(g.as_graph_def(), og, task, "/device:CPU:1")
    nodes = {n.name: n for n in sub.node}
    assert nodes["s"].op == "Const"
    assert list(nodes["s"].attr["value"].tensor.int_val) == [2, 3]
    assert nodes["sn"].op == "IdentityN"
    assert list(nodes["sn"].input) == ["ConstantFolding/sn-matshapes-0", "ConstantFolding/sn-matshapes-1"]
    assert list(nodes["ConstantFolding/sn-matshapes-1"].attr["value"].tensor.int64_val) == [2, 3]
    assert "x" not in nodes
    # The step argument y is copied in as its placeholder: fed, the task
    # computes d = [2, 3] + sum(ones(2, 3)) = [8, 9] with no x anywhere.
    assert nodes["y"].op == "Placeholder"
    with tf.Graph().as_default() as imported:
        tf.graph_util.import_graph_def(sub, name="")
        with tf.compat.v1.Session(graph=imported) as sess:
            d_value = sess.run("d:0", feed_dict={"y:0": [[1.0] * 3] * 2})
    assert list(d_value) == [8.0, 9.0]


# -- backward split: B (input gradients) and W (weight gradients) -------------
def _two_stage_forward_and_input_gradient():
    """Two stages of y = x @ w, the loss on stage 1 (its fused task), and
    gx1 = dl @ w1^T, the gradient stage 1 sends back (spec entries with
    their partition under "p")."""
    return [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 0},
        {"name": "y", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 1},
        {"name": "r0", "type": "ReadVariableOp", "variables": ["w0"], "flops": 0, "p": 0},
        {"name": "f0", "type": "MatMul", "inputs": ["x", "r0"], "flops": 10, "p": 0},
        {"name": "r1", "type": "ReadVariableOp", "variables": ["w1"], "flops": 0, "p": 1},
        {"name": "f1", "type": "MatMul", "inputs": ["f0", "r1"], "flops": 10, "p": 1},
        {"name": "loss", "inputs": ["f1", "y"], "flops": 1, "p": 1},
        {"name": "dl", "inputs": ["loss", "f1"], "forward": "loss", "flops": 1, "p": 1},
        {"name": "gx1", "type": "MatMul", "inputs": ["dl", "r1"], "forward": "f1", "flops": 10, "p": 1},
    ]


def _two_stage_matmuls(relu_grad=False, state_in_weight_path=False):
    """Two stages of y = x @ w, with TensorFlow's two gradient products each:
    gx = dy @ w^T (what the previous stage waits for) and gw = x^T @ dy (a
    weight gradient, a step output). Stage 1 holds the loss (fused task).
    With `relu_grad`, stage 0's incoming gradient first goes through a
    ReluGrad that both products read. With `state_in_weight_path`, a
    stateful op (a write of variable "s") sits on stage 0's weight path."""
    spec = _two_stage_forward_and_input_gradient() + [
        {"name": "gw1", "type": "MatMul", "inputs": ["f0", "dl"], "forward": "f1", "flops": 10, "p": 1},
    ]
    d = "gx1"
    if relu_grad:
        spec.append({"name": "rg0", "type": "ReluGrad", "inputs": ["gx1", "f0"], "forward": "f0", "flops": 1, "p": 0})
        d = "rg0"
    spec += [
        {"name": "gx0", "type": "MatMul", "inputs": [d, "r0"], "forward": "f0", "flops": 10, "p": 0},
        {"name": "gw0", "type": "MatMul", "inputs": ["x", d], "forward": "f0", "flops": 10, "p": 0},
    ]
    outputs = ["loss", "gw0", "gw1"]
    if state_in_weight_path:
        spec.append({"name": "st", "type": "AssignAddVariableOp", "inputs": ["gw0"], "writes": ["s"], "flops": 1,
                     "forward": "f0", "p": 0})
    parts = [s.pop("p") for s in spec]
    g = OpGraph.from_spec(spec)
    return g, parts, [_tensor(g, n) for n in outputs]


def _split_of(g, parts, outputs, key):
    from smp_tf.rewrite import split_backward

    tasks = build_tasks(g, parts, outputs)
    task = _by_key(tasks)[key]
    return task, split_backward(g, task, tasks)


def _names(g, ids):
    return [g.ops[i].name for i in ids]


def test_split_of_the_last_stage_keeps_the_input_gradient_on_the_critical_path():
    # Stage 1's fused task: the forward, the loss and gx1 (stage 0 waits for
    # it) are B; only the weight product gw1 can wait.
    g, parts, outputs = _two_stage_matmuls()
    task, split = _split_of(g, parts, outputs, (1, 1))
    assert task.fused
    assert _names(g, split.b) == ["r1", "f1", "loss", "dl", "gx1"]
    assert _names(g, split.w) == ["gw1"]
    # gw1 reads dl from B (kept until W runs) and f0, a task input.
    assert split.handoff == (_tensor(g, "dl"),)
    assert (split.b_flops, split.w_flops) == (22.0, 10.0)


def test_the_fused_task_gives_w_only_its_weight_gradient_kernels():
    """Split for zero_bubble, the last stage's fused task moves its weight
    products and what only carries them on (a Reshape of gw1) to W, and
    keeps the element-wise gradient work (a Mul feeding a weight product
    and also the W side of a sum) in its FB task; nothing left in FB reads
    W, so the tasks stay acyclic."""
    from smp_tf.rewrite import WEIGHT_GRADIENT_KERNELS, _weight_kernel_leaves

    spec = _two_stage_forward_and_input_gradient() + [
        # Element-wise work that only weight gradients need.
        {"name": "scaled", "type": "Mul", "inputs": ["dl"], "forward": "f1", "flops": 1, "p": 1},
        {"name": "gw1", "type": "MatMul", "inputs": ["f0", "scaled"], "forward": "f1", "flops": 10, "p": 1},
        {"name": "gw1r", "type": "Reshape", "inputs": ["gw1"], "forward": "f1", "flops": 0, "p": 1},
        # A weight product that element-wise work outside W reads: stays in FB.
        {"name": "gv1", "type": "MatMul", "inputs": ["f0", "dl"], "forward": "f1", "flops": 10, "p": 1},
        {"name": "gv1s", "type": "Mul", "inputs": ["gv1", "scaled"], "forward": "f1", "flops": 1, "p": 1},
        {"name": "gx0", "type": "MatMul", "inputs": ["gx1", "r0"], "forward": "f0", "flops": 10, "p": 0},
        {"name": "gw0", "type": "MatMul", "inputs": ["x", "gx1"], "forward": "f0", "flops": 10, "p": 0},
    ]
    parts = [s.pop("p") for s in spec]
    g = OpGraph.from_spec(spec)
    outputs = [_tensor(g, n) for n in ("loss", "gw0", "gw1r", "gv1s")]
    whole, split = _split_of(g, parts, outputs, (1, 1))
    assert whole.fused
    assert set(_names(g, split.w)) == {"scaled", "gw1", "gw1r", "gv1", "gv1s"}
    assert "MatMul" in WEIGHT_GRADIENT_KERNELS
    assert set(_names(g, _weight_kernel_leaves(g, split.w))) == {"gw1", "gw1r"}

    tasks = _by_key(build_tasks(g, parts, outputs, split_weight=True))
    weights = [t for t in tasks.values() if t.weight and t.partition == 1]
    assert len(weights) == 1
    assert set(_names(g, weights[0].members)) == {"gw1", "gw1r"}
    fb = tasks[(1, 1)]
    assert {"scaled", "gv1", "gv1s", "gx1"} <= set(_names(g, fb.members))
    # FB reads nothing from W: W's inputs come from FB and stage 0.
    assert weights[0].key not in set(fb.producer_of_input.values())


def test_the_fused_task_stays_whole_under_recomputation():
    # Its W would recompute the last stage's forward: the split is skipped
    # on a partition that recomputes, and kept on the others.
    g, parts, outputs = _two_stage_matmuls()
    split = build_tasks(g, parts, outputs, split_weight=True)
    assert [t.key for t in split if t.weight and t.partition == 1]
    for mode in ("full", "selective"):
        whole = build_tasks(g, parts, outputs, split_weight=True, recompute=mode)
        assert not [t for t in whole if t.weight and t.partition == 1], mode
        assert [t for t in whole if t.weight and t.partition == 0], mode
    mixed = build_tasks(g, parts, outputs, split_weight=True, recompute=["full", "never"])
    assert [t for t in mixed if t.weight and t.partition == 1]


def test_split_of_the_first_stage_defers_everything_nobody_waits_for():
    # Nothing is sent upstream of stage 0: its whole backward can wait.
    g, parts, outputs = _two_stage_matmuls()
    task, split = _split_of(g, parts, outputs, (0, 2))
    assert _names(g, split.b) == []
    assert _names(g, split.w) == ["gx0", "gw0"]
    assert split.handoff == ()


def test_split_hands_over_what_both_parts_read():
    # Three stages; the middle one's backward: a ReluGrad rg1 of the incoming
    # gradient, read by gx1 (sent to stage 0: B) and by gw1 (W). rg1 is B,
    # and W reads it: it is kept from B until W runs.
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "flops": 0, "p": 0},
        {"name": "r0", "type": "ReadVariableOp", "variables": ["w0"], "flops": 0, "p": 0},
        {"name": "f0", "type": "MatMul", "inputs": ["x", "r0"], "flops": 10, "p": 0},
        {"name": "r1", "type": "ReadVariableOp", "variables": ["w1"], "flops": 0, "p": 1},
        {"name": "f1", "type": "MatMul", "inputs": ["f0", "r1"], "flops": 10, "p": 1},
        {"name": "a1", "type": "Relu", "inputs": ["f1"], "flops": 1, "p": 1},
        {"name": "loss", "inputs": ["a1"], "flops": 1, "p": 2},
        {"name": "dl", "inputs": ["loss", "a1"], "forward": "loss", "flops": 1, "p": 2},
        {"name": "rg1", "type": "ReluGrad", "inputs": ["dl", "a1"], "forward": "a1", "flops": 1, "p": 1},
        {"name": "gx1", "type": "MatMul", "inputs": ["rg1", "r1"], "forward": "f1", "flops": 10, "p": 1},
        {"name": "gw1", "type": "MatMul", "inputs": ["f0", "rg1"], "forward": "f1", "flops": 10, "p": 1},
        {"name": "gx0", "type": "MatMul", "inputs": ["gx1", "r0"], "forward": "f0", "flops": 10, "p": 0},
        {"name": "gw0", "type": "MatMul", "inputs": ["x", "gx1"], "forward": "f0", "flops": 10, "p": 0},
    ]
    parts = [s.pop("p") for s in spec]
    g = OpGraph.from_spec(spec)
    outputs = [_tensor(g, n) for n in ("loss", "gw0", "gw1")]
    tasks = build_tasks(g, parts, outputs)
    (middle,) = [t for t in tasks if t.partition == 1 and t.backward]
    from smp_tf.rewrite import split_backward

    split = split_backward(g, middle, tasks)
    assert _names(g, split.b) == ["rg1", "gx1"]
    assert _names(g, split.w) == ["gw1"]
    assert split.handoff == (_tensor(g, "rg1"),)


def test_split_keeps_stateful_ops_and_what_they_read_in_b():
    # A write on stage 0's weight path must run where it ran (state order):
    # it stays in B with the product it reads.
    g, parts, outputs = _two_stage_matmuls(state_in_weight_path=True)
    task, split = _split_of(g, parts, outputs, (0, 2))
    assert _names(g, split.b) == ["gw0", "st"]
    assert _names(g, split.w) == ["gx0"]


def test_split_of_a_forward_task_or_of_a_backward_without_weight_work_is_none():
    from smp_tf.rewrite import split_backward

    g, parts, outputs = _two_stage_matmuls()
    tasks = build_tasks(g, parts, outputs)
    assert split_backward(g, _by_key(tasks)[(0, 0)], tasks) is None  # forward
    # The 3-stage chain's backward ops each produce the input gradient the
    # previous stage waits for: nothing is left for W.
    g3, parts3 = _chain3()
    tasks3 = build_tasks(g3, parts3, [_tensor(g3, "loss"), _tensor(g3, "b0")])
    assert split_backward(g3, _by_key(tasks3)[(1, 3)], tasks3) is None


def test_split_on_a_traced_dense_model_moves_the_weight_gradients_to_w():
    """On a traced Keras MLP (2 stages): the kernel and bias gradients of
    the first stage's layers (MatMul with the activation transposed,
    BiasAddGrad) are W, and so are those of the last stage, whose B still
    computes the gradient sent to the first stage."""
    import keras

    import smp_tf as smp
    from smp_tf.rewrite import split_backward
    from tests import models

    keras.utils.set_random_seed(3)
    model = models.mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    step(x, y)
    compiled = step.last_compiled
    g = compiled.plan.op_graph
    grads = {g.tensors[t].producer for t in compiled.output_tensors if t is not None and g.ops[
        g.tensors[t].producer].is_gradient}
    splits = {t.key: split_backward(g, t, compiled.tasks) for t in compiled.tasks if t.backward}
    assert all(s is not None for s in splits.values()), splits
    for key, split in splits.items():
        w_types = {g.ops[i].type for i in split.w}
        assert "BiasAddGrad" in w_types, (key, w_types)
        # Every weight gradient of the task's partition that the step returns is W.
        mine = [i for i in grads if compiled.plan.partition_of_op[i] == key[0]]
        assert mine and all(i in split.w or g.ops[i].kind != "op" for i in mine if i in set(split.b) | set(split.w))
        # B is closed: nothing in B reads a W op.
        w = set(split.w)
        for i in split.b:
            assert not any(g.tensors[t].producer in w for t in g.ops[i].inputs)
    # The last stage sends a gradient upstream, so its B is not empty.
    last = max(splits)
    assert splits[last].b and splits[last].w_flops > 0
