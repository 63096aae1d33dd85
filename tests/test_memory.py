"""The memory model (pure, on hand-built graphs and tasks), recomputation
choices, the budget, and the report of a real step.

The hand-built graphs follow `tests/test_rewrite.py`: a chain whose forward
ops feed gradient ops, with byte sizes chosen so that each expected figure
can be worked out by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from smp_tf.graph_view import OpGraph
from smp_tf.memory import (
    EAGER_ROUNDING,
    MemoryBudgetError,
    MemoryReport,
    PartitionMemory,
    choose_recompute,
    format_bytes,
    optimizer_slots,
    output_holds,
    predict_assignment,
    predict_memory,
    refine_memory_split,
    stage_multipliers,
    _granules,
    is_view,
    compiled_scratch,
    kernel_scratch,
    storage_bytes,
    task_workspace,
)
from smp_tf.profiling.memory import requested_peak
from smp_tf.rewrite import build_tasks, recomputable_ops, task_specs
from smp_tf.schedules import make_schedule

ROOT = Path(__file__).resolve().parents[1]


def _chain(grad_bytes=16):
    """x -> read(w0) -> a0 = matmul -> r0 = relu -> (partition 1) a1 = matmul(r0, w1) -> loss;
    the backward mirrors it. Tensor bytes: a0, r0 100 each; a1 50; the
    weights and their gradients `grad_bytes`."""
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "bytes": 40, "flops": 0},
        {"name": "read0", "type": "ReadVariableOp", "variables": ["w0"], "stateful": True, "bytes": 16, "flops": 0},
        {"name": "a0", "type": "MatMul", "inputs": ["x", "read0"], "bytes": 100, "flops": 1000},
        {"name": "r0", "type": "Relu", "inputs": ["a0"], "bytes": 100, "flops": 1},
        {"name": "read1", "type": "ReadVariableOp", "variables": ["w1"], "stateful": True, "bytes": 16, "flops": 0},
        {"name": "a1", "type": "MatMul", "inputs": ["r0", "read1"], "bytes": 50, "flops": 1000},
        {"name": "loss", "type": "Sum", "inputs": ["a1"], "bytes": 4, "flops": 50},
        {"name": "g_a1", "type": "Fill", "inputs": ["loss"], "bytes": 50, "forward": "a1"},
        {"name": "g_w1", "type": "MatMul", "inputs": ["r0", "g_a1"], "bytes": grad_bytes, "forward": "a1",
         "flops": 1000},
        {"name": "g_r0", "type": "MatMul", "inputs": ["g_a1", "read1"], "bytes": 100, "forward": "a1", "flops": 1000},
        {"name": "g_a0", "type": "ReluGrad", "inputs": ["g_r0", "r0"], "bytes": 100, "forward": "r0", "flops": 25},
        {"name": "g_w0", "type": "MatMul", "inputs": ["x", "g_a0"], "bytes": grad_bytes, "forward": "a0",
         "flops": 1000},
    ]
    g = OpGraph.from_spec(spec, variable_bytes={"w0": grad_bytes, "w1": grad_bytes})
    parts = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    outputs = [g.ops[g.op_index[n]].outputs[0] for n in ("loss", "g_w0", "g_w1")]
    return g, parts, outputs


def test_predict_assignment_is_the_prediction_of_the_lowered_tasks():
    g, parts, outputs = _chain()
    tasks = build_tasks(g, parts, outputs)
    simulation = make_schedule(task_specs(tasks), 3, "interleaved").simulate()
    grads = {0: g.tensors[outputs[1]].bytes, 1: g.tensors[outputs[2]].bytes}
    held = {outputs[0]: "buffers", outputs[1]: "gradients", outputs[2]: "gradients"}
    want = predict_memory(g, parts, tasks, simulation, num_partitions=2,
                          partition_of_variable={"w0": 0, "w1": 1}, gradient_bytes=grads, slots=1.0,
                          held_outputs=held, combined_bytes=grads)
    got = predict_assignment(g, parts, outputs, num_partitions=2, num_microbatches=3, kind="interleaved", slots=1.0)
    assert got.partitions == want.partitions
    assert got.process_peak == want.process_peak


@pytest.mark.parametrize("M", [1, 3])
def test_every_microbatchs_gradients_are_held_until_the_end_and_summed_there(M):
    # A `StepOutput` holds the M values of a gradient until `accumulate`
    # sums them: at the end of the step M values and their sum are alive.
    nbytes = 1 << 20  # the gradients outweigh every activation: the peak is at the end
    g, parts, outputs = _chain(grad_bytes=nbytes)
    report = predict_assignment(g, parts, outputs, num_partitions=2, num_microbatches=M, kind="interleaved")
    for r in report.partitions:
        assert r.gradients == (M + 1) * nbytes, (r.partition, r.gradients)
        dynamic = r.gradients + r.activations + r.buffers + r.transient
        assert r.total == r.variables + dynamic + r.rounding
        assert r.rounding == round(EAGER_ROUNDING * dynamic)
    # Both partitions' gradients count in the one allocator's peak.
    assert report.process_peak >= 2 * nbytes + 2 * (M + 1) * nbytes
    # The values are held from the task that makes them: partition 1's
    # backward of micro-batch 0 ends before the step does, so some of its
    # gradients are alive while later micro-batches run.
    tasks = build_tasks(g, parts, outputs)
    sim = make_schedule(task_specs(tasks), M, "interleaved").simulate()
    held, _ = output_holds(g, parts, outputs)
    assert held == {outputs[0]: "buffers", outputs[1]: "gradients", outputs[2]: "gradients"}
    backward = next(a for a in sim.start if a.partition == 1 and a.microbatch == 0
                    and any(outputs[2] in t.outputs for t in tasks if t.key == a.task))
    assert sim.end[backward] < max(sim.end.values()) or M == 1


def _totals_report(totals, overheads):
    return MemoryReport([PartitionMemory(p, total=t, transient=o) for p, (t, o) in enumerate(zip(totals, overheads))])


def test_refine_memory_split_hands_the_overheads_back_and_keeps_the_best():
    # Each assignment is a tuple naming itself; the prediction of each is fixed.
    predictions = {
        (0,): _totals_report([100, 140], [5, 40]),
        (1,): _totals_report([120, 118], [7, 30]),
        (2,): _totals_report([125, 119], [7, 30]),
    }
    seen = []

    def assign(overheads):
        seen.append(None if overheads is None else list(overheads))
        return [len(seen) - 1] if len(seen) <= 3 else [2]

    best = refine_memory_split(assign, lambda a: predictions[tuple(a)], rounds=5)
    # Round 1 splits with no overheads, round 2 with the first prediction's
    # buffers + transient, round 3 with the second's; then the split repeats.
    assert seen == [None, [5, 40], [7, 30], [7, 30]]
    assert best == [1]  # the lowest largest peak: 120 < 125 < 140
    # A split that does not move stops at once.
    calls = []
    assert refine_memory_split(lambda o: calls.append(o) or [0], lambda a: predictions[(0,)]) == [0]
    assert calls == [None, [5, 40]]


def test_refine_memory_split_moves_boundaries_on_the_predicted_peaks():
    # Assignments are named by their shifts; the split itself never changes.
    predictions = {
        (0, 0): _totals_report([100, 100, 130], [0, 0, 0]),
        (0, 1): _totals_report([100, 118, 112], [0, 0, 0]),  # first unit of 2 -> 1: 118 < 130
        (1, 1): _totals_report([110, 108, 112], [0, 0, 0]),  # first unit of 1 -> 0: 112 < 118
        (1, 2): _totals_report([111, 125, 95], [0, 0, 0]),  # first unit of 2 -> 1 again: 125, worse
    }
    asked = []

    def assign(overheads, shifts=None):
        asked.append(None if shifts is None else tuple(shifts))
        return list(shifts) if shifts is not None else [0, 0]

    best = refine_memory_split(assign, lambda a: predictions[tuple(a)], rounds=2, moves=5)
    # The largest peak (partition 2, 130) gives its first unit to partition
    # 1 (118 now the largest), which gives its first unit to partition 0;
    # partition 2 (112) is then the largest and giving another unit to
    # partition 1 would raise the peak: stop.
    assert best == [1, 1]
    assert [a for a in asked if a is not None] == [(0, 1), (1, 1), (0, 0), (1, 2)]
    assert refine_memory_split(assign, lambda a: predictions[tuple(a)], rounds=2, moves=0) == [0, 0]


def test_refine_memory_split_balances_the_devices_sums_with_virtual_stages():
    # Four chunks, chunk c on device c % 2. The split's own choice leaves
    # device 0 (chunks 0 and 2) at 100 + 130 = 230 against 180; moving
    # chunk 2's first unit to chunk 1 balances the devices, although chunk
    # 2 is not the largest chunk afterwards either way.
    predictions = {
        (0, 0, 0): _totals_report([100, 70, 130, 110], [0] * 4),
        (0, 1, 0): _totals_report([100, 95, 110, 110], [0] * 4),  # devices 210 / 205
        (-1, 0, 0): _totals_report([90, 80, 130, 110], [0] * 4),  # devices 220 / 190
        (0, 0, -1): _totals_report([100, 70, 120, 120], [0] * 4),  # devices 220 / 190
    }
    asked = []

    def assign(overheads, shifts=None):
        asked.append(None if shifts is None else tuple(shifts))
        return list(shifts) if shifts is not None else [0, 0, 0]

    def predict(a):
        return predictions.get(tuple(a), _totals_report([999] * 4, [0] * 4))

    best = refine_memory_split(assign, predict, rounds=1, moves=1, device_of_partition=[0, 1, 0, 1])
    assert best == [0, 1, 0]
    # Every boundary of device 0's chunks was tried, not only the largest chunk's.
    assert {(-1, 0, 0), (0, 1, 0), (0, 0, -1)} <= set(asked)
    # Without devices the largest chunk (2, 130) decides, and the same move wins.
    assert refine_memory_split(assign, predict, rounds=1, moves=1) == [0, 1, 0]


def test_refine_memory_split_balances_each_device_of_a_stage_with_tensor_parallelism():
    # Two stages of two devices each. By partition totals the first split
    # (140 / 150) looks better than the second (160 / 150); by device it
    # is not: its stage 0 leaves one device at 110, the second split's
    # worst device holds 85.
    def report(partitions, devices):
        rows = [PartitionMemory(p, total=t) for p, t in enumerate(partitions)]
        per_device = [PartitionMemory(p, total=t, shard=k) for (p, k), t in devices.items()]
        return MemoryReport(rows, devices=per_device)

    predictions = {
        (0,): report([140, 150], {(0, 0): 110, (0, 1): 30, (1, 0): 75, (1, 1): 75}),
        (1,): report([160, 150], {(0, 0): 80, (0, 1): 80, (1, 0): 85, (1, 1): 65}),
    }
    calls = []

    def assign(overheads):
        calls.append(overheads)
        return [len(calls) - 1] if len(calls) <= 2 else [1]

    assert refine_memory_split(assign, lambda a: predictions[tuple(a)], rounds=3) == [1]


def test_shifted_bounds_keep_every_partition_non_empty():
    from smp_tf.partitioner.plan import _shift_bounds

    assert _shift_bounds([0, 3, 6, 9], [1, -1]) == [0, 4, 5, 9]
    assert _shift_bounds([0, 3, 6, 9], [5, 0]) == [0, 7, 8, 9]  # pushes the next boundary along
    assert _shift_bounds([0, 3, 6, 9], [0, -9]) == [0, 3, 4, 9]
    with pytest.raises(ValueError, match="2 entries"):
        _shift_bounds([0, 3, 6, 9], [1])


def test_stage_multipliers_follow_the_schedule():
    # 1F1B: stage p keeps P - p micro-batches (capped by M); GPipe: all M.
    # The last stage runs forward and backward in one task: one.
    assert stage_multipliers(4, 8, "interleaved") == [4, 3, 2, 1]
    assert stage_multipliers(4, 2, "interleaved") == [2, 2, 2, 1]
    assert stage_multipliers(4, 8, "simple") == [8, 8, 8, 1]
    assert stage_multipliers(1, 8, "simple") == [1]
    # Virtual stages: read off the simulated schedule, chunk c on device
    # c % 2. Under Megatron's interleaved 1F1B device 0's first chunk holds
    # the most; the last chunk (fused) one at a time.
    assert stage_multipliers(4, 8, "interleaved", num_devices=2) == [4, 3, 2, 1]
    assert stage_multipliers(4, 8, "simple", num_devices=2) == [8, 8, 8, 1]
    assert stage_multipliers(4, 8, "interleaved", num_devices=4) == [4, 3, 2, 1]  # one chunk each
    # ZB-H1: stage p also holds p micro-batches waiting for their W.
    assert stage_multipliers(4, 8, "zero_bubble") == [4, 4, 4, 4]
    assert stage_multipliers(4, 2, "zero_bubble") == [2, 2, 2, 2]


def test_optimizer_slots():
    class Adam: ...
    class SGD:
        def __init__(self, momentum): self.momentum = momentum
    assert optimizer_slots(None) == 0
    assert optimizer_slots(Adam()) == 2
    assert optimizer_slots(SGD(0.9)) == 1
    assert optimizer_slots(SGD(0.0)) == 0


def test_storage_bytes_views_of_variables_are_free():
    g, _, _ = _chain()
    st = storage_bytes(g)
    name = lambda n: g.ops[g.op_index[n]].outputs[0]  # noqa: E731
    # A variable read aliases the variable; arguments and captures are not
    # the step's to allocate; an activation takes its bytes, in whole
    # allocator granules (100 bytes take 256).
    assert st[name("read0")] == 0 and st[name("x")] == 0
    assert st[name("a0")] == 256
    assert [_granules(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]


def test_recomputable_ops():
    g, _, _ = _chain()
    full = recomputable_ops(g, "full")
    selective = recomputable_ops(g, "selective")
    idx = g.op_index
    # A weight read and the forward ops may run again; gradient ops never.
    assert full[idx["read0"]] and full[idx["a0"]] and full[idx["r0"]]
    assert not full[idx["g_a0"]]
    # Selective keeps the product (1000 flops per element) and recomputes the relu.
    assert selective[idx["r0"]] and not selective[idx["a0"]]
    assert recomputable_ops(g, "never") == [False] * len(g.ops)
    with pytest.raises(ValueError, match="recompute"):
        recomputable_ops(g, "sometimes")


def test_recomputable_ops_keep_state_reads_and_stateful_draws():
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "bytes": 40, "flops": 0},
        # Reads and advances the seed: a dropout's seed generator.
        {"name": "read_seed", "type": "ReadVariableOp", "variables": ["seed"], "stateful": True, "bytes": 8},
        {"name": "bump", "type": "AssignAddVariableOp", "inputs": ["read_seed"], "writes": ["seed"]},
        {"name": "mask", "type": "StatelessRandomUniformV2", "inputs": ["x", "read_seed"], "bytes": 40},
        {"name": "draw", "type": "RandomUniform", "inputs": ["x"], "stateful": True, "bytes": 40},
    ]
    g = OpGraph.from_spec(spec, variable_bytes={"seed": 8})
    again = recomputable_ops(g, "full")
    # The mask is recomputed from the kept seed value; the seed read and a
    # stateful draw are not run again.
    assert again[g.op_index["mask"]]
    assert not again[g.op_index["read_seed"]] and not again[g.op_index["draw"]] and not again[g.op_index["bump"]]


def test_selective_recomputation_keeps_a_dropout_mask_instead_of_drawing_again():
    # A dropout as TensorFlow builds it: a uniform draw from the kept seed
    # value, shifted into its range, compared with the rate (the keep mask),
    # then applied. Selective keeps the mask (one byte per element) so the
    # draw never runs again; full recomputes all of it from the seed.
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "bytes": 400, "flops": 0},
        {"name": "read_seed", "type": "ReadVariableOp", "variables": ["seed"], "stateful": True, "bytes": 8},
        {"name": "bump", "type": "AssignAddVariableOp", "inputs": ["read_seed"], "writes": ["seed"]},
        {"name": "draw", "type": "StatelessRandomUniformV2", "inputs": ["read_seed"], "bytes": 400, "flops": 1},
        {"name": "shifted", "type": "AddV2", "inputs": ["draw"], "bytes": 400, "flops": 1},
        {"name": "keep", "type": "GreaterEqual", "inputs": ["shifted"], "bytes": 100, "dtype": "bool", "flops": 1},
        {"name": "scaled", "type": "Mul", "inputs": ["x"], "bytes": 400, "flops": 1},
        {"name": "dropped", "type": "SelectV2", "inputs": ["keep", "scaled"], "bytes": 400, "flops": 1},
        # A boolean that no draw feeds stays recomputable.
        {"name": "positive", "type": "Greater", "inputs": ["dropped"], "bytes": 100, "dtype": "bool", "flops": 1},
    ]
    g = OpGraph.from_spec(spec, variable_bytes={"seed": 8})
    idx = g.op_index
    selective, full = recomputable_ops(g, "selective"), recomputable_ops(g, "full")
    assert not selective[idx["keep"]] and full[idx["keep"]]
    assert selective[idx["draw"]] and selective[idx["shifted"]] and selective[idx["dropped"]]
    assert selective[idx["positive"]]


def test_pinned_tensors_keep_the_readers_of_the_single_device_graph():
    # a feeds b in the forward and g_b (its gradient reads a) in the
    # backward: two readers in the single-device graph. With recomputation
    # the forward no longer returns a (the backward computes it again), so
    # the forward task reads it once, and so does the backward that
    # recomputes it: both tasks pin it, to show the graph optimiser two
    # readers as the single-device graph does (it would otherwise fold a
    # chain of additions through a into one AddN that rounds differently).
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "bytes": 40, "flops": 0},
        {"name": "read", "type": "ReadVariableOp", "variables": ["w"], "stateful": True, "bytes": 40, "flops": 0},
        {"name": "a", "type": "AddV2", "inputs": ["x", "read"], "bytes": 40, "flops": 10},
        {"name": "b", "type": "AddV2", "inputs": ["a", "x"], "bytes": 40, "flops": 10},
        {"name": "c", "type": "MatMul", "inputs": ["b", "x"], "bytes": 40, "flops": 1000},
        {"name": "loss", "type": "Sum", "inputs": ["c"], "bytes": 4, "flops": 10},
        {"name": "g_c", "type": "Fill", "inputs": ["loss"], "bytes": 40, "forward": "c"},
        {"name": "g_b", "type": "MatMul", "inputs": ["g_c", "x"], "bytes": 40, "forward": "c", "flops": 1000},
        {"name": "g_x", "type": "Mul", "inputs": ["g_b", "a"], "bytes": 40, "forward": "b", "flops": 10},
    ]
    g = OpGraph.from_spec(spec, variable_bytes={"w": 40})
    parts = [0, 0, 0, 0, 1, 1, 1, 1, 0]
    outputs = [g.ops[g.op_index[n]].outputs[0] for n in ("loss", "g_x")]
    a = g.ops[g.op_index["a"]].outputs[0]
    by_key = lambda tasks: {t.key: t for t in tasks}  # noqa: E731
    never = by_key(build_tasks(g, parts, outputs))
    # Without recomputation the forward returns a for the backward: two readers.
    assert all(not t.pinned for t in never.values())
    full = by_key(build_tasks(g, parts, outputs, recompute="full"))
    forward, backward = full[(0, 0)], full[(0, 2)]
    assert a not in forward.outputs and forward.pinned == [a]
    assert g.op_index["a"] in backward.recomputed and backward.pinned == [a]
    # b has one reader everywhere (c, on the other partition, reads it
    # through the task's output): nothing to pin.
    assert g.ops[g.op_index["b"]].outputs[0] not in forward.pinned


def _kept(tasks, g):
    st = storage_bytes(g)
    return {t.key: sum(st[x] for x in t.kept_inputs()) for t in tasks}


def test_full_recompute_keeps_only_received_tensors():
    g, parts, outputs = _chain()
    never = build_tasks(g, parts, outputs)
    full = build_tasks(g, parts, outputs, recompute="full")
    selective = build_tasks(g, parts, outputs, recompute="selective")
    # Stage 0's backward (wave 2) reads r0 (its relu grad): kept without
    # recomputation, recomputed from x with it (x is an argument, a0 and r0
    # run again).
    assert _kept(never, g)[(0, 2)] == 256  # r0's 100 bytes, one granule
    assert _kept(full, g)[(0, 2)] == 0
    b = next(t for t in full if t.key == (0, 2))
    assert {g.ops[i].name for i in b.recomputed} == {"read0", "a0", "r0"}
    # Selective keeps the product a0 and recomputes r0 from it.
    assert _kept(selective, g)[(0, 2)] == 256
    bs = next(t for t in selective if t.key == (0, 2))
    assert {g.ops[i].name for i in bs.recomputed} == {"r0"}
    # The forward no longer returns what nobody reads from it.
    f = next(t for t in full if t.key == (0, 0))
    assert g.op_index["r0"] in {g.tensors[x].producer for x in f.outputs}  # sent to stage 1


def _report(recompute="never", kind="interleaved", M=4, budget=None):
    g, parts, outputs = _chain()
    tasks = build_tasks(g, parts, outputs, recompute=recompute)
    sim = make_schedule(task_specs(tasks), M, kind).simulate()
    return predict_memory(
        g, parts, tasks, sim, num_partitions=2, partition_of_variable={"w0": 0, "w1": 1},
        gradient_bytes={0: 16, 1: 16}, slots=2.0, recompute=[recompute] * 2, budget=budget,
    )


def test_predicted_parts_add_up():
    r = _report()
    for row in r:
        assert row.total == sum(getattr(row, f) for f in ("variables", "optimizer", "gradients", "activations", "buffers", "transient"))
    # Static: 16 bytes of variables, 2 Adam slots, gradient sum + one micro-batch's.
    assert (r[0].variables, r[0].optimizer, r[0].gradients) == (16, 32, 32)


def test_memory_table_widens_the_device_column_for_devices_of_other_processes():
    g, parts, outputs = _chain()
    tasks = build_tasks(g, parts, outputs)
    sim = make_schedule(task_specs(tasks), 4, "interleaved").simulate()
    devices = ["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"]
    report = predict_memory(
        g, parts, tasks, sim, num_partitions=2, partition_of_variable={"w0": 0, "w1": 1},
        gradient_bytes={0: 16, 1: 16}, slots=2.0, recompute=["never"] * 2, devices=devices,
    )
    lines = report.table().splitlines()
    header, rows = lines[1], lines[2:4]
    assert [row.split()[1] for row in rows] == devices
    assert {len(row) for row in rows} == {len(header)}  # the columns after the device line up
    assert {row.index("never") for row in rows} == {header.index("recompute")}
    # Each process has its own allocator: no peak of "one allocator" for all
    # partitions, a line per process instead.
    assert "one allocator" not in report.table()
    assert lines[-1] == (
        "per process, sum of its partitions' peaks (an upper bound): "
        f"/job:worker/task:0 {format_bytes(report[0].total)}, /job:worker/task:1 {format_bytes(report[1].total)}"
    )


@pytest.mark.parametrize("devices, one", [
    (["/device:CPU:0", "/device:CPU:1"], True),  # logical CPU devices of this process
    (["/job:localhost/replica:0/task:0/device:CPU:0", "/cpu:1"], True),
    (["", ""], True),  # not known: the figure is still shown
    (["/device:GPU:0", "/device:GPU:1"], False),  # an allocator per GPU
    (["/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"], False),
])
def test_the_one_allocator_line_only_where_the_devices_share_one(devices, one):
    rows = [PartitionMemory(p, device=d, total=1024) for p, d in enumerate(devices)]
    text = MemoryReport(rows, process_peak=2048).table()
    assert ("all partitions, one allocator: predicted 2.0 KiB" in text) == one, text


def test_schedule_multiplies_kept_activations():
    # Stage 0 keeps r0 (100 bytes, one 256-byte granule) per live
    # micro-batch: at most 2 under 1F1B with 2 stages, all 4 under GPipe.
    assert _report(kind="interleaved")[0].activations == 2 * 256
    assert _report(kind="simple")[0].activations == 4 * 256
    assert _report(recompute="full", kind="simple")[0].activations == 0


def test_task_workspace_frees_after_last_use():
    g, parts, outputs = _chain()
    tasks = build_tasks(g, parts, outputs)
    f0 = next(t for t in tasks if t.key == (0, 0))
    # a0 (100 bytes: a 256-byte granule) then r0 (in place of a0: a Relu
    # writes into its input).
    assert task_workspace(g, f0) == 256


def _transposes():
    """Transposes the runtime does and does not materialise."""
    f = {"type": "Op", "dtype": "float32"}
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "shape": (16, 100), "bytes": 6400},
        {"name": "h", **f, "inputs": ["x"], "shape": (16, 100), "bytes": 6400},
        {"name": "perm", "type": "Const", "shape": (2,), "bytes": 8},
        # A matrix transpose read only by matrix products: folded into them.
        {"name": "ht", "type": "Transpose", "inputs": ["h", "perm"], "shape": (100, 16), "bytes": 6400},
        {"name": "mm", "type": "MatMul", "inputs": ["x", "ht"], "shape": (16, 16), "bytes": 1024},
        # The same transpose read by an addition as well: materialised.
        {"name": "ht2", "type": "Transpose", "inputs": ["h", "perm"], "shape": (100, 16), "bytes": 6400},
        {"name": "mm2", "type": "MatMul", "inputs": ["x", "ht2"], "shape": (16, 16), "bytes": 1024},
        {"name": "add", **f, "inputs": ["ht2"], "shape": (100, 16), "bytes": 6400},
        # A permutation that can only move dimensions of size 1.
        {"name": "s", **f, "inputs": ["x"], "shape": (2, 1, 8), "bytes": 64},
        {"name": "st", "type": "Transpose", "inputs": ["s", "perm"], "shape": (2, 8, 1), "bytes": 64},
        # Repeated sizes: the permutation is not known from the shapes.
        {"name": "q", **f, "inputs": ["x"], "shape": (4, 4, 8), "bytes": 512},
        {"name": "qt", "type": "Transpose", "inputs": ["q", "perm"], "shape": (4, 8, 4), "bytes": 512},
        {"name": "qm", "type": "BatchMatMulV2", "inputs": ["qt", "q"], "shape": (4, 8, 8), "bytes": 1024},
        # An identity permutation computed at run time (a gather's gradient).
        {"name": "it", "type": "Transpose", "inputs": ["h", "perm"], "shape": (16, 100), "bytes": 6400},
        {"name": "out", **f, "inputs": ["it", "mm", "mm2", "add", "st", "qm"], "shape": (16, 16), "bytes": 1024},
    ]
    return OpGraph.from_spec(spec)


def test_transposes_the_runtime_does_not_materialise_are_views():
    g = _transposes()
    views = {op.name for op in g.ops if is_view(g, op)}
    assert views & {"ht", "ht2", "st", "qt", "it"} == {"ht", "st", "it"}
    # A view allocates nothing and keeps its source alive: the peak of
    # x -> h -> h transposed -> matmul is h and the product, not h and its copy.
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "shape": (16, 100), "bytes": 6400},
        {"name": "h", "type": "Op", "inputs": ["x"], "shape": (16, 100), "bytes": 6400},
        {"name": "perm", "type": "Const", "shape": (2,), "bytes": 8},
        {"name": "ht", "type": "Transpose", "inputs": ["h", "perm"], "shape": (100, 16), "bytes": 6400},
        {"name": "mm", "type": "MatMul", "inputs": ["x", "ht"], "shape": (16, 16), "bytes": 1024},
    ]
    small = OpGraph.from_spec(spec)
    (task,) = build_tasks(small, [0] * len(small.ops), [small.ops[small.op_index["mm"]].outputs[0]])
    assert task_workspace(small, task, storage_bytes(small)) == 6400 + 1024
    spec[3]["type"] = "Op"  # the same graph with the transpose materialised
    small = OpGraph.from_spec(spec)
    (task,) = build_tasks(small, [0] * len(small.ops), [small.ops[small.op_index["mm"]].outputs[0]])
    assert task_workspace(small, task, storage_bytes(small)) == 2 * 6400


def test_requested_peak_counts_granules_and_frees_first():
    # (time, is_allocation, requested bytes)
    events = [(0, True, 100), (1, True, 1000), (2, False, 100), (2, True, 300), (3, False, 1000), (4, False, 300)]
    # 256 + 1024 live at time 1; at time 2 the 256 is freed before 512 is taken.
    assert requested_peak(events) == 256 + 1024 + 512 - 256
    assert requested_peak(reversed(events)) == requested_peak(events)
    assert requested_peak([]) == 0


def _conv_gradients():
    """A convolution's two gradients on a hand-built graph: x [2, 8, 8, 4],
    a 3x3 filter of 4 -> 16 channels, the incoming gradient [2, 8, 8, 16]."""
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "shape": (2, 8, 8, 4), "bytes": 2048},
        {"name": "w", "type": "Placeholder", "kind": "arg", "shape": (3, 3, 4, 16), "bytes": 2304},
        {"name": "dy", "type": "Placeholder", "kind": "arg", "shape": (2, 8, 8, 16), "bytes": 8192},
        {"name": "sizes", "type": "Const", "shape": (4,), "bytes": 16},
        {"name": "dw", "type": "Conv2DBackpropFilter", "inputs": ["x", "sizes", "dy"], "shape": (3, 3, 4, 16),
         "bytes": 2304, "is_gradient": True},
        {"name": "dx", "type": "Conv2DBackpropInput", "inputs": ["sizes", "w", "dy"], "shape": (2, 8, 8, 4),
         "bytes": 2048, "is_gradient": True},
        {"name": "mm", "type": "MatMul", "inputs": ["x", "w"], "bytes": 64},
    ]
    return OpGraph.from_spec(spec)


def test_kernel_scratch_of_convolution_gradients():
    g = _conv_gradients()
    op = lambda n: g.ops[g.op_index[n]]  # noqa: E731
    # TensorFlow's CPU filter gradient: im2col rows of as many images as fit
    # 30 MiB (one image: 64 output pixels x 36 filter taps; a work unit adds
    # the gradient's and the filter's elements), whatever the batch.
    col_image = 64 * 36
    shard = -(-((30 << 20) // 4) // (col_image + 64 * 16 + 36 * 16))
    assert kernel_scratch(g, op("dw")) == shard * col_image * 4
    # The input gradient: one image's rows at a time.
    assert kernel_scratch(g, op("dx")) == col_image * 4
    assert kernel_scratch(g, op("mm")) == 0
    # Unknown shapes: nothing is guessed.
    g.tensors[op("dy").outputs[0]].shape = None
    assert kernel_scratch(g, op("dw")) == 0


def test_task_workspace_adds_the_scratch_of_both_convolution_gradients():
    from smp_tf.rewrite import Task

    g = _conv_gradients()
    ids = [g.op_index[n] for n in ("sizes", "dw", "dx")]
    task = Task(0, 2, members=ids, outputs=[g.ops[i].outputs[0] for i in ids[1:]])
    scratch = kernel_scratch(g, g.ops[ids[1]]) + kernel_scratch(g, g.ops[ids[2]])
    # They read the same incoming gradient and run side by side: while the
    # second runs, the first's output and both buffers are live.
    assert task_workspace(g, task) == 2304 + 2048 + scratch  # the sizes are a constant
    # On a GPU the CPU kernels' buffers are not counted.
    assert task_workspace(g, task, cpu_scratch=False) == 2304 + 2048


def _grouped_conv_call():
    """Keras's grouped Conv2D(8, 3, groups=8), XLA-compiled, on x [2, 4, 4, 8]:
    the forward call returns the filter [3, 3, 1, 8] besides its output, and
    its gradient call returns the filter gradient."""
    spec = [
        {"name": "x", "type": "Placeholder", "kind": "arg", "shape": (2, 4, 4, 8), "bytes": 1024},
        {"name": "w", "type": "ReadVariableOp", "variables": ["k"], "shape": (3, 3, 1, 8), "bytes": 288},
        {"name": "fwd", "type": "StatefulPartitionedCall", "inputs": ["x", "w"], "shape": (3, 3, 1, 8),
         "bytes": 288, "compiled": True},
        {"name": "dy", "type": "Placeholder", "kind": "arg", "shape": (2, 4, 4, 8), "bytes": 1024},
        {"name": "dw", "type": "PartitionedCall", "inputs": ["dy", "x", "fwd"], "shape": (3, 3, 1, 8),
         "bytes": 288, "forward": "fwd", "compiled": True},
        {"name": "dw_tf", "type": "PartitionedCall", "inputs": ["dy", "x", "fwd"], "shape": (3, 3, 1, 8),
         "bytes": 288, "forward": "fwd"},
    ]
    return OpGraph.from_spec(spec, variable_bytes={"k": 288})


def test_compiled_scratch_of_a_depthwise_filter_gradient():
    g = _grouped_conv_call()
    op = lambda n: g.ops[g.op_index[n]]  # noqa: E731
    # XLA on a CPU computes the dense 3 x 3 x 8 x 8 filter gradient and a mask
    # of that shape: twice 576 floats, in whole granules.
    assert compiled_scratch(g, op("dw")) == _granules(2 * 3 * 3 * 8 * 8 * 4)
    # The forward call also returns a (3, 3, 1, 8) tensor (the filter for
    # its gradient): no scratch; nor for a call XLA does not compile.
    assert compiled_scratch(g, op("fwd")) == 0
    assert compiled_scratch(g, op("dw_tf")) == 0
    from smp_tf.rewrite import Task

    task = Task(0, 1, members=[g.op_index["dw"]], outputs=[op("dw").outputs[0]])
    assert task_workspace(g, task) == _granules(288) + compiled_scratch(g, op("dw"))
    assert task_workspace(g, task, on_cpu=False) == _granules(288)  # a GPU's XLA has grouped convolutions


def test_choose_recompute_escalates_only_where_needed():
    # A fake predictor: partition 0 needs 300 bytes with never, 150 with
    # selective, 100 with full; partition 1 always 100.
    need = {"never": 300, "selective": 150, "full": 100}

    def predict(modes):
        rows = [PartitionMemory(0, total=need[modes[0]], recompute=modes[0]), PartitionMemory(1, total=100, recompute=modes[1])]
        return MemoryReport(rows)

    assert choose_recompute(predict, 2, "auto", 200)[0] == ["selective", "never"]
    assert choose_recompute(predict, 2, "auto", 120)[0] == ["full", "never"]
    assert choose_recompute(predict, 2, "auto", None)[0] == ["never", "never"]
    with pytest.raises(MemoryBudgetError) as e:
        choose_recompute(predict, 2, "never", 200)
    # Names each partition's peak and what would fit.
    msg = str(e.value)
    assert "partition 0 300 B" in msg and "OVER" in msg and "recompute='full'" in msg and "fits" in msg
    with pytest.raises(MemoryBudgetError, match="more partitions"):
        choose_recompute(predict, 2, "auto", 50)


def test_choose_recompute_leaves_a_partition_recomputing_does_not_help():
    # Partition 1 (a last stage) needs 250 bytes whatever it recomputes;
    # partition 0 as above. With a budget of 200 partition 0 goes to
    # selective, partition 1 stays at never (recomputing there would cost
    # time for nothing) and the error names it.
    need = {"never": 300, "selective": 150, "full": 100}
    calls = []

    def predict(modes):
        calls.append(list(modes))
        return MemoryReport([
            PartitionMemory(0, total=need[modes[0]], recompute=modes[0]),
            PartitionMemory(1, total=250, recompute=modes[1]),
        ])

    with pytest.raises(MemoryBudgetError) as e:
        choose_recompute(predict, 2, "auto", 200)
    assert "partition 1 250 B (activations 0 B, recompute='never') OVER" in str(e.value)
    assert "partition 0 150 B (activations 0 B, recompute='selective')" in str(e.value)
    # A budget partition 1 fits: it is never escalated.
    assert choose_recompute(predict, 2, "auto", 260)[0] == ["selective", "never"]


def test_choose_recompute_tries_full_where_selective_does_not_help():
    # Partition 0 is all products: selective keeps what never keeps.
    need = {"never": 300, "selective": 300, "full": 100}

    def predict(modes):
        return MemoryReport([
            PartitionMemory(0, total=need[modes[0]], recompute=modes[0]),
            PartitionMemory(1, total=100, recompute=modes[1]),
        ])

    assert choose_recompute(predict, 2, "auto", 200)[0] == ["full", "never"]


def test_choose_recompute_counts_the_sum_of_a_devices_partitions():
    # Virtual stages: partitions 0 and 2 on device a, 1 and 3 on device b.
    # Each partition fits a budget of 200 alone; device a's pair does not.
    need = {"never": 150, "selective": 90, "full": 60}

    def predict(modes):
        return MemoryReport([
            PartitionMemory(p, device="ab"[p % 2], total=need[m] if p % 2 == 0 else 80, recompute=m)
            for p, m in enumerate(modes)
        ])

    modes, report = choose_recompute(predict, 4, "auto", 200)
    # Device a's chunks move up together (90 + 90 fits); device b's stay.
    assert modes == ["selective", "never", "selective", "never"]
    assert max(report.device_totals().values()) <= 200
    with pytest.raises(MemoryBudgetError) as e:
        choose_recompute(predict, 4, "never", 200)
    msg = str(e.value)
    # Names each chunk, each device's sum, and fewer chunks per device.
    assert "Per device, the sum of its partitions: a 300 B OVER, b 160 B" in msg
    assert "fewer virtual_stages" in msg and "recompute='full' (predicted largest device sum 160 B: fits)" in msg
    with pytest.raises(MemoryBudgetError, match="a 120 B OVER"):
        choose_recompute(predict, 4, "auto", 110)


# -- a real step ----------------------------------------------------------------


def _mlp_step(model):
    """An `smp.step` of `model` (an MLP): mean squared error and its gradients."""
    import tensorflow as tf

    import smp_tf as smp

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((y - model(x, training=True)) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    return step


def test_an_eager_step_holds_every_microbatchs_gradients_and_a_traced_one_sums_them():
    import keras
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp
    from tests.models import BATCH, mlp

    keras.utils.set_random_seed(0)
    model = mlp()
    step = _mlp_step(model)
    x = np.random.default_rng(0).normal(size=(BATCH, 16)).astype("float32")
    y = np.ones((BATCH, 4), "float32")
    M = 4
    smp.init({"partitions": 2, "microbatches": M})

    @tf.function
    def traced(x, y):
        loss, grads = step(x, y)
        return [g.accumulate() for g in grads]

    traced(x, y)
    entry = step.last_compiled
    assert not entry.outputs_held
    summed = step.memory_report()
    grads = {p: sum(i[2] for i in entry.output_info() if i is not None and i[0] and i[1] == p) for p in range(2)}
    # Inside a tf.function the running sum takes each gradient as it comes.
    assert [r.gradients for r in summed] == [2 * grads[0], 2 * grads[1]]
    # Called eagerly, the M values leave the pipeline together: held with
    # their sum at the end of the step (rounded up to the allocator's granule).
    step(x, y)
    assert step.last_compiled is entry and entry.outputs_held
    held = step.memory_report()
    for r in held:
        assert (M + 1) * grads[r.partition] <= r.gradients <= (M + 1) * (grads[r.partition] + 256 * 16), r
        # Values that outlive the call sit in the allocator's rounded chunks.
        dynamic = r.gradients + r.activations + r.buffers + r.transient
        assert r.rounding == round(EAGER_ROUNDING * dynamic) > 0, r
        assert r.total == r.variables + r.optimizer + dynamic + r.rounding, r
    assert all(r.rounding == 0 for r in summed)
    assert held.process_peak > summed.process_peak
    assert "chunk rounding" in held.table() and "chunk rounding" not in summed.table()
    # Each can be asked for.
    assert entry.memory_report(outputs_held=False).process_peak == summed.process_peak


def test_memory_report_of_a_step_and_the_budget_error():
    import numpy as np

    import smp_tf as smp
    from tests.models import BATCH, mlp

    smp.init({"partitions": 2, "microbatches": 4})
    model = mlp()
    step = _mlp_step(model)
    with pytest.raises(RuntimeError, match="call the step function once"):
        step.memory_report()
    x = np.ones((BATCH, 16), "float32")
    y = np.ones((BATCH, 4), "float32")
    step(x, y)
    report = step.memory_report(keras_optimizer := __import__("keras").optimizers.Adam())
    assert len(report) == 2
    var_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert sum(r.variables for r in report) == var_bytes
    assert sum(r.optimizer for r in report) == 2 * var_bytes
    assert "activations" in str(report) and "total" in str(report)
    del keras_optimizer

    # A budget below the static part cannot fit, whatever is recomputed.
    smp.init({"partitions": 2, "microbatches": 4, "memory_budget": 64, "recompute": "auto"})
    with pytest.raises(MemoryBudgetError, match="memory_budget=64"):
        step(x, y)
    # A generous budget: the step runs and the report shows it.
    smp.init({"partitions": 2, "microbatches": 4, "memory_budget": 2**30, "recompute": "auto"})
    step(x, y)
    assert step.memory_report().budget == 2**30


def test_the_recomputation_fitted_to_a_budget_follows_the_schedule_of_each_init():
    """GPipe keeps all 8 micro-batches' activations alive where 1F1B keeps
    two: under this budget the first must recompute, the second need not. A
    step switched between them by `smp.init` fits the budget anew."""
    import keras

    import smp_tf as smp
    from tests import models

    keras.utils.set_random_seed(3)
    model = models.tied_transformer()
    x, y = models.data("tied_transformer")
    config = {"partitions": 2, "microbatches": 8, "memory_budget": 120_000, "recompute": "auto"}
    fresh = {}
    for schedule in ("simple", "interleaved"):
        smp.init({**config, "pipeline": schedule})
        step = smp.step(models.make_body(model, "tied_transformer"))
        step(x, y)
        fresh[schedule] = step.last_compiled.recompute
    assert fresh["simple"] != ["never", "never"] and fresh["interleaved"] == ["never", "never"]
    for first, then in (("simple", "interleaved"), ("interleaved", "simple")):
        smp.init({**config, "pipeline": first})
        step = smp.step(models.make_body(model, "tied_transformer"))
        step(x, y)
        smp.init({**config, "pipeline": then})
        step(x, y)
        assert step.last_compiled.recompute == fresh[then], (first, then)


def test_measure_memory_reads_each_gpus_own_peak(monkeypatch):
    """Where partitions are GPUs, each has its own allocator: the measured
    column is the peak of each partition's device, reset before the step."""
    import dataclasses

    import numpy as np
    import tensorflow as tf

    import smp_tf as smp
    from smp_tf import state
    from tests.models import BATCH, mlp

    smp.init({"partitions": 2, "microbatches": 4})
    model = mlp()
    step = _mlp_step(model)
    x = np.ones((BATCH, 16), "float32")
    y = np.ones((BATCH, 4), "float32")
    step(x, y)
    devices = list(step.last_compiled.devices)
    # A stand-in for GPU allocators: each device has its own peak.
    resets = []
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", resets.append)
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda d: {"current": 0, "peak": 1000 * (1 + devices.index(d))})
    gpu = dataclasses.replace(state.topology(), kind="GPU")
    monkeypatch.setattr(state, "topology", lambda: gpu)
    report = step.measure_memory(x, y)
    assert sorted(resets) == sorted(devices)
    assert [r.measured for r in report] == [1000, 2000]
    assert "GPU allocator" in report.method


def test_budget_with_virtual_stages_holds_for_each_devices_chunks():
    import keras
    import numpy as np

    import smp_tf as smp
    from tests.models import BATCH, mlp

    keras.utils.set_random_seed(3)
    model = mlp()
    init = [v.numpy() for v in model.variables]
    step = _mlp_step(model)
    step.optimizer = keras.optimizers.SGD()  # no slots: the report and the check count the same
    # Rows enough for the activations to outweigh the gradients held to the end.
    x = np.random.default_rng(0).normal(size=(8 * BATCH, 16)).astype("float32")
    y = np.ones((8 * BATCH, 4), "float32")
    base = {"partitions": 2, "virtual_stages": 2, "microbatches": 4}

    def run(**config):
        for v, value in zip(model.variables, init):
            v.assign(value)
        smp.init({**base, **config})
        loss, grads = step(x, y)
        report = step.memory_report()
        return loss.reduce_mean().numpy(), [g.accumulate().numpy() for g in grads], report

    loss0, grads0, never = run(recompute="never")
    assert len(never) == 4 and len(never.device_totals()) == 2
    _, _, full = run(recompute="full")
    worst_never, worst_full = max(never.device_totals().values()), max(full.device_totals().values())
    assert worst_full < worst_never
    # Between the two: "auto" recomputes on the device that is over, and
    # the values stay those of the run that recomputes nothing.
    budget = (worst_never + worst_full) // 2
    loss, grads, fitted = run(recompute="auto", memory_budget=budget)
    assert max(fitted.device_totals().values()) <= budget
    assert any(r.recompute != "never" for r in fitted)
    assert loss == loss0 and all(np.array_equal(a, b) for a, b in zip(grads, grads0))
    # Far too small: the error names the per-device sums.
    with pytest.raises(MemoryBudgetError, match="Per device, the sum of its partitions"):
        run(recompute="auto", memory_budget=64)


def test_optimize_memory_with_virtual_stages_balances_the_devices():
    import keras
    import numpy as np

    import smp_tf as smp
    from tests.models import BATCH

    keras.utils.set_random_seed(5)
    inputs = keras.Input((16,))
    h = inputs
    for i in range(8):
        h = keras.layers.Dense(32 if i % 2 else 64, activation="relu", name=f"d{i}")(h)
    model = smp.DistributedModel(inputs, keras.layers.Dense(4, name="head")(h))
    init = [v.numpy() for v in model.variables]
    step = _mlp_step(model)
    step.optimizer = keras.optimizers.SGD()
    x = np.random.default_rng(1).normal(size=(BATCH, 16)).astype("float32")
    y = np.ones((BATCH, 4), "float32")

    def run(optimize):
        for v, value in zip(model.variables, init):
            v.assign(value)
        smp.init({"partitions": 2, "virtual_stages": 2, "microbatches": 4, "optimize": optimize})
        loss, grads = step(x, y)
        return loss.reduce_mean().numpy(), [g.accumulate().numpy() for g in grads], step.memory_report()

    loss_speed, grads_speed, speed = run("speed")
    loss_mem, grads_mem, mem = run("memory")
    assert len(mem) == 4
    # The worst device's sum of its chunks' peaks is no worse than the
    # speed split's, and the values are the same.
    assert max(mem.device_totals().values()) <= max(speed.device_totals().values())
    assert loss_mem == loss_speed and all(np.array_equal(a, b) for a, b in zip(grads_mem, grads_speed))


def test_optimize_memory_partitions_for_the_steps_optimizer(monkeypatch):
    import keras
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp
    import smp_tf.step_function as sf
    from tests.models import BATCH, mlp

    seen = []
    real = sf.assign_partitions

    def spy(*args, **kwargs):
        seen.append(kwargs.get("slots"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sf, "assign_partitions", spy)
    smp.init({"partitions": 2, "microbatches": 2, "optimize": "memory"})
    model = mlp()

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((y - model(x, training=True)) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    x = np.ones((BATCH, 16), "float32")
    y = np.ones((BATCH, 4), "float32")
    # Unknown optimizer: Adam's two slots; a known one: its own (plain SGD
    # keeps none, SGD with momentum one).
    for optimizer, slots in ((None, 2.0), (keras.optimizers.SGD(), 0.0), (keras.optimizers.SGD(momentum=0.9), 1.0)):
        step = smp.step(body)
        step.optimizer = optimizer
        step(x, y)
        assert seen[-1] == slots


# A subprocess's start: the BFC allocator (set before TensorFlow starts) and
# `zoo_step(name)`, a zoo model's training step with its arguments.
_PRELUDE = r"""
import os, random, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
sys.path.insert(0, sys.argv[1])
import smp_tf as smp
smp.init({"partitions": 2, "microbatches": 4})
import tensorflow as tf
from tests.zoo import zoo_models

def zoo_step(name):
    case = zoo_models.ENTRIES[name]()
    model = case.model
    def body(x, y):
        with tf.GradientTape() as tape:
            loss = case.loss(y, model(x, training=True, **case.training_kwargs))
        return loss, tape.gradient(loss, model.trainable_variables)
    return smp.step(body), tf.nest.map_structure(tf.constant, case.x), tf.nest.map_structure(tf.constant, case.y)
"""

_MEASURE = _PRELUDE + r"""
for name in sys.argv[2].split(","):
    step, x, y = zoo_step(name)
    for sched in ("interleaved", "simple"):
        smp.init({"partitions": 2, "microbatches": 4, "pipeline": sched})
        r = step.measure_memory(x, y)
        for row in r:
            print("ROW", name, sched, row.partition, row.total, row.measured, flush=True)
        print("PROCESS", name, sched, r.process_peak, r.measured_process_peak, flush=True)
        print("METHOD", name, sched, r.method, flush=True)
"""


@pytest.mark.xdist_group("memory_measure")
def test_prediction_within_15_percent_of_measurement_on_zoo_models():
    """Predicted partition peaks against the measured ones (logical CPU
    devices: composed from each task's measured peak, see
    smp_tf.profiling.memory) on four zoo models, both schedules: three
    transformers and a convolutional UNet, whose convolution gradients
    allocate scratch buffers of their own (`kernel_scratch`), measured with
    TensorFlow's own CPU kernels (oneDNN's keep their scratch outside
    TensorFlow's allocator, see the test below)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    models = "gpt2_lm,bert_classifier,tied_transformer,unet"
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ROOT), models], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("ROW")]
    assert len(rows) == 4 * 2 * 2
    for _, name, sched, p, total, measured in rows:
        total, measured = int(total), int(measured)
        assert abs(total - measured) <= 0.15 * measured, f"{name} {sched} partition {p}: predicted {total}, measured {measured}"
    process = [line.split() for line in out.stdout.splitlines() if line.startswith("PROCESS")]
    assert all(int(m) > 0 for *_, m in process)
    # Each task's ops run one at a time (under the default executor the
    # order of independent ops, and with it the peak, moves with the load).
    methods = [line for line in out.stdout.splitlines() if line.startswith("METHOD")]
    assert len(methods) == 4 * 2 and all(m.endswith("each task run alone, its ops one at a time)") for m in methods)


_STABLE = _PRELUDE + r"""
import smp_tf.profiling.memory as measuring
if sys.argv[2] == "allocator":
    measuring.COUNT_REQUESTS = False
step, x, y = zoo_step("gpt2_lm")
random.seed(0)
kept = []
for _ in range(3):
    print("MEASURED", *[row.measured for row in step.measure_memory(x, y)], flush=True)
    # Leave the allocator other free chunks: tensors of odd sizes, half of them kept.
    junk = [tf.zeros([random.randint(1, 3000)]) + 1.0 for _ in range(200)]
    kept.extend(junk[::2])
if sys.argv[2] == "events":  # a profile of the user's own is open: the counter is read
    import tempfile
    tf.profiler.experimental.start(tempfile.mkdtemp())
    print("BUSY", *[row.measured for row in step.measure_memory(x, y)], flush=True)
    tf.profiler.experimental.stop()
"""


@pytest.mark.xdist_group("memory_measure")
def test_measured_task_peaks_do_not_move_with_the_allocators_free_chunks():
    """A request may get a free chunk of up to twice its size, depending on
    what earlier work left: the measured figures count the requests (from
    the allocator's own events), so they stay the same when other tensors
    are allocated and freed between measurements. The allocator's peak
    counter does not (it moved partition 1's figure by several percent)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")

    def measured(method):
        out = subprocess.run([sys.executable, "-c", _STABLE, str(ROOT), method], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [line.split()[1:] for line in out.stdout.splitlines() if line.startswith(("MEASURED", "BUSY"))]

    rows = measured("events")
    assert len(rows) == 4 and rows[0] == rows[1] == rows[2], rows
    assert all(int(v) > 0 for v in rows[3])  # with a profile of the user's own open
    counted = measured("allocator")
    assert len(counted) == 3 and (counted[0] != counted[1] or counted[1] != counted[2]), counted


def test_measured_task_peaks_fall_back_to_the_default_executor_for_loops():
    """A task whose while loop TensorFlow lowers to low-level control flow
    cannot run on the single-threaded executor: it is measured under the
    default one, and the report's method says how many such tasks there were."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(ROOT), "lstm"], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    methods = [line for line in out.stdout.splitlines() if line.startswith("METHOD")]
    assert len(methods) == 2
    for method in methods:
        assert re.search(r"its ops one at a time; [1-9]\d* task\(s\) under the default executor, median of 3 runs\)$",
                         method), method
    measured = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("ROW")]
    assert len(measured) == 2 * 2 and all(int(m) > 0 for m in measured)


_NO_SECOND_COPY = r"""
import os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
sys.path.insert(0, sys.argv[1])
import json
import smp_tf as smp
smp.init(json.loads(sys.argv[2]))
import keras
import tensorflow as tf

@tf.custom_gradient
def scaled(x):  # registers a gradient function that keeps the traced graph alive
    return 2.0 * x, lambda dy: 2.0 * dy

keras.utils.set_random_seed(0)
inputs = keras.Input((1024,))
h = inputs
for i in range(3):
    h = keras.layers.Dense(1024, name=f"dense{i}")(h)
model = smp.DistributedModel(inputs, h)
x, y = tf.random.normal((32, 1024)), tf.random.normal((32, 1024))
optimizer = keras.optimizers.SGD(0.1)

@smp.step
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((scaled(model(x)) - y) ** 2)
    return loss, tape.gradient(loss, model.trainable_variables)

@tf.function
def train(x, y):
    loss, grads = step(x, y)
    optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
    return loss.reduce_mean()

for _ in range(2):
    train(x, y)
held = sum(v.numpy().nbytes for v in model.variables + optimizer.variables) + 2 * 32 * 1024 * 4
print("BYTES", tf.config.experimental.get_memory_info("CPU:0")["current"], held, len(step.last_plan.devices))
"""


@pytest.mark.parametrize("config", [{"partitions": 2, "microbatches": 2},
                                    {"partitions": 1, "tensor_parallel_degree": 2, "microbatches": 2}])
def test_placement_leaves_no_second_copy_of_the_moved_variables(config):
    # The trace captured the variables' handles from before placement; a
    # graph that outlives the trace (a custom gradient's registration holds
    # it) kept those resources alive, and the first update gave them a copy
    # of their own: every moved variable twice. With tensor parallelism, the
    # pieces of a split variable were views of its whole value, which the
    # first updates left in use as well.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _NO_SECOND_COPY, str(ROOT), json.dumps(config)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("BYTES"))
    current, held, devices = map(int, line.split()[1:])
    assert devices == config["partitions"]
    # Within 1 MiB of the variables, optimizer state and inputs; a moved
    # 1024 x 1024 layer alone is 4 MiB.
    assert held <= current <= held + 2**20, (current, held)


def test_predicted_transient_counts_cpu_kernel_scratch_on_cpus_only():
    g = _conv_gradients()
    parts = [0] * len(g.ops)
    outputs = [g.ops[g.op_index[n]].outputs[0] for n in ("dw", "dx")]
    tasks = build_tasks(g, parts, outputs)
    sim = make_schedule(task_specs(tasks), 2, "interleaved").simulate()

    def transient(device):
        return predict_memory(g, parts, tasks, sim, num_partitions=1, partition_of_variable={},
                              gradient_bytes={}, devices=[device])[0].transient

    scratch = sum(kernel_scratch(g, g.ops[g.op_index[n]]) for n in ("dw", "dx"))
    assert transient("/device:CPU:0") - transient("/job:worker/replica:0/task:0/device:GPU:0") == scratch
    # oneDNN's CPU kernels keep their scratch outside TensorFlow's allocator.
    onednn = predict_memory(g, parts, tasks, sim, num_partitions=1, partition_of_variable={}, gradient_bytes={},
                            devices=["/device:CPU:0"], cpu_kernel_scratch=False)[0].transient
    assert onednn == transient("/job:worker/replica:0/task:0/device:GPU:0")


_ONEDNN = _PRELUDE + r"""
from smp_tf.lowering import cpu_kernels_allocate_scratch
from tensorflow.python.util import _pywrap_util_port
print("SCRATCH", cpu_kernels_allocate_scratch(), _pywrap_util_port.IsMklEnabled(), flush=True)
if _pywrap_util_port.IsMklEnabled():
    smp.init({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"})
    step, x, y = zoo_step("unet")
    for row in step.measure_memory(x, y):
        print("ROW", row.partition, row.total, row.measured, flush=True)
"""


@pytest.mark.xdist_group("memory_measure")
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_onednn_cpu_kernels_leave_the_im2col_scratch_out(onednn):
    """`TF_ENABLE_ONEDNN_OPTS` decides which kernels run the convolutions:
    TensorFlow's own allocate the im2col buffer through its allocator,
    oneDNN's do not. With oneDNN (where this CPU and build have it), the
    UNet's measured partitions are near the prediction, which then leaves
    that buffer out (with it, the prediction is about 64 times too high)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS=onednn)
    out = subprocess.run([sys.executable, "-c", _ONEDNN, str(ROOT)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x.split() for x in out.stdout.splitlines() if x.startswith("SCRATCH")]
    allocate, mkl = line[1] == "True", line[2] == "True"
    assert allocate is (not mkl)
    if onednn == "0":
        assert not mkl
    rows = [x.split() for x in out.stdout.splitlines() if x.startswith("ROW")]
    assert len(rows) == (2 if mkl else 0)
    for _, p, total, measured in rows:
        # 1.03 and 1.24 on an AVX-512 machine: oneDNN's reordered copies of
        # some tensors go through TensorFlow's allocator (docs/memory_measurement.md).
        assert 0.6 * int(measured) <= int(total) <= 1.15 * int(measured), (p, total, measured)


_GROUPED = r"""
import os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
sys.path.insert(0, sys.argv[1])
import smp_tf as smp
smp.init({"partitions": 2, "microbatches": 4})
import numpy as np
import tensorflow as tf
import keras

keras.utils.set_random_seed(0)
inp = keras.Input((4, 4, 256))
h = inp
for k in range(4):  # ConvNeXt's block, small: a depthwise convolution written as a grouped one
    t = keras.layers.Conv2D(256, 7, padding="same", groups=256, name=f"dw{k}")(h)
    t = keras.layers.LayerNormalization(epsilon=1e-6)(t)
    t = keras.layers.Dense(512, activation="gelu")(t)
    h = h + keras.layers.Dense(256)(t)
model = smp.DistributedModel(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

@smp.step
def step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)

x = tf.constant(np.random.default_rng(0).uniform(size=(16, 4, 4, 256)).astype("float32"))
y = tf.constant(np.arange(16) % 10)
for row in step.measure_memory(x, y):
    print("ROW", row.partition, row.total, row.measured, row.transient, flush=True)
"""


@pytest.mark.xdist_group("memory_measure")
def test_prediction_of_a_grouped_depthwise_convolutions_xla_scratch():
    """Keras runs Conv2D(C, groups=C) as an XLA-compiled function; the
    gradient XLA compiles for it on a CPU holds a dense K x K x C x C filter
    gradient and its mask (`compiled_scratch`), 12.25 MiB per block here
    against 49 KiB of filter. Predicted within [0.85, 1.05] of measured on
    both partitions (without the scratch, partition 1 measured 3 times its
    prediction)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", _GROUPED, str(ROOT)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("ROW")]
    assert len(rows) == 2
    for p, total, measured, transient in rows:
        assert int(transient) >= 2 * 7 * 7 * 256 * 256 * 4, (p, transient)  # a block's scratch at least
        assert 0.85 * int(total) <= int(measured) <= 1.05 * int(total), (p, total, measured)


# `pytest -m memory_all`: the models of the issue "a memory model that never
# under-predicts", each partition and the step called eagerly predicted
# within [0.85, 1.05] of its measurement (benchmarks/memory/ratios.py); the
# process at most 5% above the prediction and at most 20% below it.
_ALL_CASES = [("convnext_tiny", "2"), ("convnext_tiny", "1"), ("efficientnet_v2_b0", "2"), ("llama", "2"),
              ("llama", "1"), ("resnet50", "2")]


@pytest.mark.memory_all
@pytest.mark.xdist_group("memory_measure")
@pytest.mark.parametrize("case,partitions", _ALL_CASES)
def test_prediction_within_target_on_large_models(case, partitions):
    if case == "llama":
        pytest.importorskip("keras_hub")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory" / "ratios.py"), case, partitions],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("ROW", "PROCESS", "EAGER"))]
    assert len(rows) == int(partitions) + 3
    for row in rows:
        predicted, measured = int(row[-3]), int(row[-2])
        # The process-wide peak is the allocator's counter during a real step
        # (inside a tf.function), whose executor runs both partitions' tasks
        # side by side. The model counts the gradients' running sum and one
        # micro-batch's gradient through the whole step; ResNet50's executor
        # adds each gradient in place as it comes, and measures 0.85 of the
        # prediction (the other models 0.90 to 1.03).
        # Called eagerly (EAGER), the allocator's chunks against the
        # prediction with its rounding; the bytes the tensors asked for
        # (EAGER_REQUESTED) against the prediction without it.
        low = 0.80 if row[0] == "PROCESS" else 0.85
        assert low * predicted <= measured <= 1.05 * predicted, row


# -- the graph TensorFlow runs: a task's function after Grappler ---------------------------

def test_a_functions_rewritten_graph_drops_what_grappler_prunes():
    import tensorflow as tf

    from smp_tf.graph_view import from_tf_graph
    from smp_tf.rewrite import Task
    from smp_tf.rewritten import rewritten_workspace

    @tf.function
    def with_dead_work(x):
        _ = tf.ones((512, 512)) * x[0, 0]  # 1 MiB nothing reads: pruned by Grappler
        return x * 2.0

    @tf.function
    def without(x):
        return x * 2.0

    spec = tf.TensorSpec((64, 64), tf.float32)

    def traced_peak(fn):
        g = from_tf_graph(fn.graph)
        names = {op.name: op.index for op in g.ops}
        outs = [g.ops[names[t.name.split(":")[0]]].outputs[0] for t in fn.outputs]
        return task_workspace(g, Task(0, 0, members=[op.index for op in g.ops if op.kind == "op"], outputs=outs))

    dead, alive = with_dead_work.get_concrete_function(spec), without.get_concrete_function(spec)
    assert traced_peak(dead) >= 512 * 512 * 4 > traced_peak(alive)
    assert rewritten_workspace(dead, 0, 0) == rewritten_workspace(alive, 0, 0) == traced_peak(alive)
    # What cannot be read keeps the traced prediction (None).
    assert rewritten_workspace(object(), 0, 0) is None


def test_a_compiled_steps_report_predicts_each_task_on_its_rewritten_graph():
    import numpy as np

    import smp_tf as smp
    from tests.models import BATCH, mlp

    smp.init({"partitions": 2, "microbatches": 4})
    step = _mlp_step(mlp())
    step(np.ones((BATCH, 16), "float32"), np.ones((BATCH, 4), "float32"))
    entry = step.last_compiled
    report = step.memory_report()
    assert set(entry._rewritten) == {t.key for t in entry.tasks}
    assert all(v > 0 for v in entry._rewritten.values())
    # The report's transient parts come from those peaks: the same as
    # predicting with them given explicitly.
    again = entry.memory_report(workspace=dict(entry._rewritten), outputs_held=entry.outputs_held)
    assert [r.total for r in again] == [r.total for r in report]
