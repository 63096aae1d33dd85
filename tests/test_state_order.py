"""State advances once per micro-batch, in order: waves of state accesses.

Hand-built graphs (`OpGraph.from_spec`, one output per op). Each test says
in a comment which task every op must land in, and why, before asserting.
"""

import pytest

from smp_tf.graph_view import OpGraph
from smp_tf.rewrite import StateOrderError, build_tasks, duplicable_ops, waves


def _wave_of(g, w, *names):
    return [w[g.op_index[n]] for n in names]


def _rescaled_dropout_graph():
    """Input -> Rescaling -> Dense -> Dropout on partition 0, Dense + loss on 1.

    ``scale`` multiplies the input by a constant: a free op, copied into the
    tasks that read it. ``seed`` reads the dropout seed state ``s``,
    ``bump`` writes it back (state + 1); ``mask`` draws from the seed.
    """
    spec = [
        {"name": "x", "kind": "arg"},
        {"name": "c", "type": "Const"},
        {"name": "scale", "inputs": ["x", "c"]},
        {"name": "h", "inputs": ["scale"], "variables": ["k0"]},
        {"name": "seed", "variables": ["s"]},
        {"name": "bump", "inputs": ["seed"], "writes": ["s"]},
        {"name": "mask", "inputs": ["seed", "h"]},
        {"name": "f1", "inputs": ["mask"], "variables": ["k1"]},
        {"name": "loss", "inputs": ["f1"]},
        {"name": "b1", "inputs": ["loss"], "forward": "f1"},
        {"name": "b0", "inputs": ["b1", "mask"], "forward": "h"},
    ]
    parts = {"x": 0, "c": 0, "scale": 0, "h": 0, "seed": 0, "bump": 0, "mask": 0, "f1": 1, "loss": 1, "b1": 1, "b0": 0}
    g = OpGraph.from_spec(spec)
    return g, [parts[op.name] for op in g.ops]


def test_data_dependence_flows_through_copied_ops():
    # `scale` is free (it reads only the argument and a constant), so it is
    # copied, not scheduled; but `h` still depends on the step argument
    # through it: wave 0, the forward of partition 0.
    g, parts = _rescaled_dropout_graph()
    w = waves(g, parts, duplicable_ops(g))
    assert _wave_of(g, w, "h", "mask", "f1", "b0") == [0, 0, 1, 2]


def test_seed_read_and_update_share_the_forward_task():
    # The read and the write of the seed state must be one task, so that
    # micro-batch m+1 reads what micro-batch m wrote. `seed` feeds `mask`
    # (wave 0); `bump` is consumed by nobody and would otherwise drift to
    # the partition's first data task -- it must follow the read instead.
    g, parts = _rescaled_dropout_graph()
    w = waves(g, parts, duplicable_ops(g))
    assert _wave_of(g, w, "seed", "bump", "mask") == [0, 0, 0]
    tasks = {t.key: [g.ops[i].name for i in t.members] for t in build_tasks(g, parts, [g.op_index["loss"]])}
    assert {"seed", "bump", "mask", "h"} <= set(tasks[(0, 0)])


def test_state_write_delayed_to_the_backward_with_its_reader():
    # A counter `n` is incremented by `inc` (it reads `f0`, wave 0) and read
    # by a backward op `use` of partition 0 (wave 2). Nothing reads `inc`,
    # so both can run in the backward task of partition 0, `inc` first as in
    # the reference: one task, wave 2.
    spec = [
        {"name": "x", "kind": "arg"},
        {"name": "f0", "inputs": ["x"], "variables": ["k0"]},
        {"name": "inc", "inputs": ["f0"], "writes": ["n"]},
        {"name": "f1", "inputs": ["f0"], "variables": ["k1"]},
        {"name": "b1", "inputs": ["f1"], "forward": "f1"},
        {"name": "use", "inputs": ["b1"], "variables": ["n"]},
    ]
    g = OpGraph.from_spec(spec)
    parts = [0, 0, 0, 1, 1, 0]
    w = waves(g, parts, duplicable_ops(g))
    assert _wave_of(g, w, "f0", "f1", "inc", "use") == [0, 1, 2, 2]


def test_state_whose_value_crosses_partitions_before_its_write_is_an_error():
    # `r` reads the state `n` on partition 0; its value goes to partition 1
    # (`f1`), whose result comes back to `wr`, which writes `n`. `r` and `wr`
    # must share a task, but `wr` needs partition 1's output, which needs
    # `r`: no task order can run them together. A clear error, never a
    # silent reordering.
    spec = [
        {"name": "x", "kind": "arg"},
        {"name": "r", "variables": ["n"]},
        {"name": "f0", "inputs": ["x", "r"], "variables": ["k0"]},
        {"name": "f1", "inputs": ["f0"], "variables": ["k1"]},
        {"name": "wr", "inputs": ["f1"], "writes": ["n"]},
    ]
    g = OpGraph.from_spec(spec)
    parts = [0, 0, 0, 1, 0]
    with pytest.raises(StateOrderError, match=r"\['n'\].*partitions \[0, 1\]"):
        waves(g, parts, duplicable_ops(g))


def test_state_accesses_in_two_forward_waves_are_merged_when_possible():
    # Partition 0 holds `pre` (wave 0) and, after a hop through partition 1,
    # `post` (wave 2). The state `s` is read by `r` (no data inputs) and
    # written by `wr`, which reads `post`. Both must share `post`'s task:
    # `r` is placed at wave 2, not at the earliest wave.
    spec = [
        {"name": "x", "kind": "arg"},
        {"name": "pre", "inputs": ["x"], "variables": ["k0"]},
        {"name": "mid", "inputs": ["pre"], "variables": ["k1"]},
        {"name": "post", "inputs": ["mid"], "variables": ["k2"]},
        {"name": "r", "variables": ["s"]},
        {"name": "wr", "inputs": ["r", "post"], "writes": ["s"]},
        {"name": "user", "inputs": ["r", "pre"]},
    ]
    g = OpGraph.from_spec(spec)
    parts = [0, 0, 1, 0, 0, 0, 0]
    # `user` reads `r` and `pre` (wave 0), so it would run at wave 0 and
    # read the state before `wr` of the same micro-batch writes it... as in
    # the reference, where `user` may run before `wr` too -- but it must
    # then be in the same task as `r` and `wr`, since `r` is a state access.
    w = waves(g, parts, duplicable_ops(g))
    assert _wave_of(g, w, "pre", "mid", "post") == [0, 1, 2]
    assert _wave_of(g, w, "r", "wr") == [2, 2]


def test_read_only_variables_stay_free_to_move():
    # A trainable kernel read in the forward and again by a backward op is
    # not written in the step: the reads may sit in different tasks.
    spec = [
        {"name": "x", "kind": "arg"},
        {"name": "r", "variables": ["k"]},
        {"name": "f0", "inputs": ["x", "r"]},
        {"name": "f1", "inputs": ["f0"], "variables": ["k1"]},
        {"name": "b1", "inputs": ["f1"], "forward": "f1"},
        {"name": "r2", "variables": ["k"]},
        {"name": "b0", "inputs": ["b1", "r2"], "forward": "f0"},
    ]
    g = OpGraph.from_spec(spec)
    parts = [0, 0, 0, 1, 1, 0, 0]
    w = waves(g, parts, duplicable_ops(g))
    assert _wave_of(g, w, "r", "f0", "r2", "b0") == [0, 0, 2, 2]
