"""A pipeline over three processes of unequal speed: speed-oblivious against
speed-aware partitioning, with the speeds measured in the same run, and
against speed-aware partitioning with speeds learned from the
speed-oblivious step's profile.

Three processes (``pipeline_processes=3``, ``partitions=3``, one device each)
run the MLP of ``benchmarks/pipeline`` (12 x Dense(1024), batch 256, MSE,
SGD) at M=8 under the interleaved (1F1B) schedule, on 127.0.0.1. Each
process pins itself with ``os.sched_setaffinity`` before TensorFlow starts:
rank 0 (the driver, stage 0) has the first core to itself, ranks 1 and 2
(stages 1 and 2) share the second (``--alone R``: rank R alone, the other
two sharing; rank k runs stage k). Each process has one intra-op thread
(``smp.init`` sets it for a process bound to one core) and the library's
inter-op pool (its device's thread and 8 for the transfers, not spinning).
So the two stages on the shared core run about half as fast as the one
alone.

Each round starts the three processes, then, in the driver:

1. **Measures each device's speed under the real concurrent load.** Every
   measurement is one function that runs the same chain on all three
   devices at once: the two processes on the shared core run theirs at the
   same time and each measures about half the speed. A chain is a series
   of groups, a `tf.timestamp` on the chain's own device after each (all
   three processes read the host's clock); only the groups that start and
   end inside the window where all three chains run count (the processes
   start a few milliseconds apart), and a figure is the median over 5 calls
   (after an untimed one) of the mean time of a counted group. The
   function is built with `tf.compat.v1.wrap_function`: in a `tf.function`
   the timestamps, stateful ops, run in program order, which made the
   three chains run one after the other. The chains, in the shapes of the
   model's work: ``matmul``, 32 groups of 4 links of a Dense layer's three
   products on one micro-batch (``y = x @ w``, ``x^T @ y``, ``y @ w^T``; x
   is 32 x 1024, w 1024 x 1024, the links cycling over 4 distinct
   orthogonal weights: a stage's share of the model); ``elementwise``, 30
   groups of 40 links of ``x * 0.999 + 0.001`` on a micro-batch's
   activation (32 x 1024); the per-op overhead, 30 groups of 50 such links
   on a scalar. As in `smp_tf.planner.calibrate`, a speed is the group's
   flops (`estimate_flops`) over its time less its ops' overhead. The same
   element-wise chain on 1024 x 1024 tensors (24 groups of 2 links) gives
   the speed of the gradients' running sums and the optimizer's update
   (used only by the prediction, below; the declared cluster has one
   element-wise speed). ``conv`` is declared at the ``matmul`` speed (the
   MLP has no convolution). The links, one pair at a time: a 4-byte and a
   4 MiB tensor moved from one device to the other, less the same function
   without the move (latency, bandwidth); and the time of a call with one
   scalar op in each process (the step's fixed dispatch cost).
2. Runs three variants, the first two alternating which goes first from
   round to round, the third always last (it needs the first's profile):
   (a) **speed-oblivious**: no ``cluster`` key (equal devices); (b)
   **speed-aware**: ``smp.init`` again with the config key ``cluster``
   declaring the three devices just measured, in the stages' order (one
   host ``localhost``, devices ``CPU:0``..``CPU:2`` = the device of rank
   0..2; links ``host`` and one pair each, as measured); (c) **learned**:
   ``smp.init`` again with ``cluster`` declaring the devices with the
   speeds learned from the speed-oblivious step's profile (step 5), links
   as measured. Each variant builds its own model (same seed), warms up,
   and times the step, in the round's three processes (each round starts
   fresh ones).
3. **Predicts** each variant's step time from the op graph's flops at the
   measured speeds: per task of the compiled step (forward and backward
   tasks of each stage), its ops' flops per cost class at its stage's
   device's speeds plus their per-op overhead (``Device.seconds``), plus
   the time to send its outputs read by other stages over the measured
   link (``Link.seconds``, each tensor once per reading stage: the plan's
   ``stage_send_seconds`` split over the tasks), plus, for backward tasks,
   one running-sum addition per gradient element at the 1024 x 1024
   element-wise speed; then ``make_schedule``'s interleaved schedule
   (the compiled step's) simulated with those costs
   (``Schedule.simulate(costs=...)``); then each stage's update after its
   last task (divide by M, SGD: 3 flops per parameter, at the same speed);
   plus the measured fixed call cost. The table lists every part.
4. Traces each variant's step again inside `smp.profile` (3 warm-up and 5
   profiled steps) for where the time goes: each stage's forward and
   backward task per micro-batch and busy time per step, measured next to
   predicted. As a diagnostic (not the prediction), each device's speeds
   are then scaled so that the speed-oblivious step's tasks take the busy
   time its profile measured, and every variant is predicted again.
5. **Learns the speeds** for (c), before it runs, from (a)'s profile: per
   stage k, the factor by which its measured busy time per step (the sum
   of its profiled tasks, median over the steps) exceeds the busy time
   predicted at the chain-measured speeds (its tasks' operations plus the
   backward tasks' running sums, M micro-batches, as in step 3). Device
   k's speeds are divided by it and its per-op overhead multiplied by it,
   so that every time predicted on it scales by the factor: what rank k
   does per step besides its ops (rank 0 dispatches the step, splits the
   batch, sends the labels and receives the results) counts as a slower
   device. (c) is predicted as in step 3 on the learned devices its plan
   declares; its target is the same as (b)'s.

The table ends with the speed-ups and their bound per round: the best
split of the equal layers at the learned speeds against the equal split,
each stage's compute alone (`split_bound`, every split tried): what no
partition can beat, before the pipeline's fill and drain and transfers.

Run ``python benchmarks/planner/heterogeneous.py`` (``--quick`` for tiny
sizes: checks that the script runs, the figures mean nothing). Every
process is started on 127.0.0.1 by this script, every wait is bounded, and
only the processes it started are ended; see README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import choose_cpus, versions  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The profile's probes read TensorFlow's clock, which op determinism forbids.
os.environ.pop("TF_DETERMINISTIC_OPS", None)

_MARK = "@@SMP_BENCH_RESULT@@"
P = 3
M = 8
SPEEDUP_TARGET = 1.25
PREDICTION_TARGET = 0.10
VARIANTS = ("oblivious", "aware", "learned")
#: The measurement chains (module doc): groups of links, a timestamp after
#: each group. A group of products takes about 6 ms on a core of its own
#: (1024 wide), one of element-wise ops on an activation 0.3 ms, on a weight
#: 0.7 ms, of scalar ops 40 us.
PRODUCT_GROUPS, PRODUCT_LINKS = 32, 4
ELEMENTWISE_GROUPS, ELEMENTWISE_LINKS = 30, 40
UPDATE_GROUPS, UPDATE_LINKS = 24, 2
SCALAR_GROUPS, SCALAR_LINKS = 30, 50
MEASURE_REPEATS = 5
#: Seconds a round (three processes) may take before it is ended.
ROUND_TIMEOUT_S = 900
QUICK_ROUND_TIMEOUT_S = 240
#: Seconds the stage processes get to leave after their driver is done (they
#: look for its server once a second).
EXIT_TIMEOUT_S = 60


def sizes(args) -> dict:
    if args.quick:
        return dict(layers=6, width=128, batch=64)
    return dict(layers=12, width=args.width, batch=256)


def _emit(result: dict) -> None:
    print(_MARK + json.dumps(result), flush=True)


def _base_config() -> dict:
    return {"partitions": P, "microbatches": M, "pipeline": "interleaved", "pipeline_processes": P}


# ---------------------------------------------------------------------------
# Measuring the devices under concurrent load (driver)
# ---------------------------------------------------------------------------
def _concurrent(tf, devices: Sequence[str], group, inputs: Sequence, groups: int, repeats: int) -> dict:
    """Seconds per `group` of a chain on each device while all devices run
    theirs at once.

    One function runs, on every device, `groups` groups of the chain one
    after the other, a `tf.timestamp` on the device after each (the next
    group reads it, so the stamp is taken before the group starts). The
    function is built by `tf.compat.v1.wrap_function`, not `tf.function`:
    a `tf.function` orders its stateful ops (the timestamps) in program
    order, and the three devices' chains would run one after the other. The
    devices' processes start their parts a few milliseconds apart, so only
    the groups that start and end inside the window where every device runs
    its chain count (all three processes read the host's clock). Returns,
    per device, the median over `repeats` calls of the mean seconds of those
    groups, and the fewest groups that counted (at least 3, or else every
    group counts)."""

    def body(*xs):
        out = []
        for d, x in zip(devices, xs):
            with tf.device(d):
                # Data dependencies at both ends: TensorFlow prunes work that
                # is only a control input, and runs a timestamp without
                # inputs as early as it can.
                t0 = tf.timestamp()
                x = x + tf.cast(t0 * 0.0, x.dtype)  # t0 is finite
                stamps, kept = [t0], []
                for _ in range(groups):
                    x, extra = group(x, d)
                    with tf.control_dependencies([x] + extra):
                        stamp = tf.timestamp()
                    x = x + tf.cast(stamp * 0.0, x.dtype)
                    stamps.append(stamp)
                    kept += extra
                used = tf.add_n([tf.reduce_sum(tf.reshape(t, [-1])[:1]) for t in kept + [x]])
                out.append(tf.stack(stamps) + tf.cast(tf.math.is_finite(used), tf.float64) * 0.0)
        return tf.stack(out)

    run = tf.compat.v1.wrap_function(body, [tf.TensorSpec(x.shape, x.dtype) for x in inputs])
    run(*inputs).numpy()  # traces and warms up
    per_group: List[List[float]] = [[] for _ in devices]
    counted: List[List[int]] = [[] for _ in devices]
    for _ in range(repeats):
        stamps = run(*inputs).numpy()
        lo, hi = max(st[0] for st in stamps), min(st[-1] for st in stamps)
        for k, st in enumerate(stamps):
            inside = [(a, b) for a, b in zip(st[:-1], st[1:]) if a >= lo and b <= hi]
            if len(inside) < 3:
                inside = list(zip(st[:-1], st[1:]))
            per_group[k].append(sum(b - a for a, b in inside) / len(inside))
            counted[k].append(len(inside))
    return {"seconds": [statistics.median(t) for t in per_group], "groups": [min(c) for c in counted]}


def _wall(fn, *args, repeats: int) -> float:
    fn(*args).numpy()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).numpy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_devices(tf, devices: Sequence[str], s: dict) -> dict:
    """Each device's speeds and the links between them (module doc, step 1)."""
    from smp_tf.graph_view import estimate_flops

    rows, width = s["batch"] // M, s["width"]
    ws, acts, bigs, scalars = {}, [], [], []
    for k, d in enumerate(devices):
        with tf.device(d):
            # Orthogonal: the chain's values keep their size. As many
            # distinct weights as a stage of equal thirds holds, so that
            # they stream from memory as the model's do.
            ws[d] = [tf.linalg.qr(tf.random.stateless_normal((width, width), seed=(100 + i, k)))[0]
                     for i in range(max(s["layers"] // P, 1))]
            acts.append(tf.random.stateless_normal((rows, width), seed=(2, k)))
            bigs.append(tf.random.stateless_normal((width, width), seed=(3, k)))
            scalars.append(tf.constant(1.0))

    def products(x, d):
        # A Dense layer's three products on one micro-batch: forward, the
        # weight's gradient, the input's gradient.
        grads = []
        for i in range(PRODUCT_LINKS):
            w = ws[d][i % len(ws[d])]
            y = tf.matmul(x, w)
            grads.append(tf.matmul(x, y, transpose_a=True))
            x = tf.matmul(y, w, transpose_b=True)
        return x, grads

    def elementwise(links):
        def chain(x, d):
            # Products and sums in turn: TensorFlow's graph optimizer merges
            # a chain of additions alone into one op.
            for _ in range(links):
                x = x * 0.999 + 0.001
            return x, []
        return chain

    overhead = _concurrent(tf, devices, elementwise(SCALAR_LINKS), scalars, SCALAR_GROUPS, MEASURE_REPEATS)
    oh = [t / (2 * SCALAR_LINKS) for t in overhead["seconds"]]
    t_mm = _concurrent(tf, devices, products, acts, PRODUCT_GROUPS, MEASURE_REPEATS)
    t_ew = _concurrent(tf, devices, elementwise(ELEMENTWISE_LINKS), acts, ELEMENTWISE_GROUPS, MEASURE_REPEATS)
    t_big = _concurrent(tf, devices, elementwise(UPDATE_LINKS), bigs, UPDATE_GROUPS, MEASURE_REPEATS)
    mm = estimate_flops("MatMul", [(rows, width), (width, width)], [(rows, width)])
    product_flops, product_ops = PRODUCT_LINKS * 3 * mm, PRODUCT_LINKS * 3
    ew_flops, ew_ops = 2 * ELEMENTWISE_LINKS * rows * width, 2 * ELEMENTWISE_LINKS
    big_flops, big_ops = 2 * UPDATE_LINKS * width * width, 2 * UPDATE_LINKS

    def speed(flops: float, seconds: float, ops: int, oh: float) -> float:
        return flops / max(seconds - ops * oh, 1e-9)

    out = {"devices": []}
    for k in range(len(devices)):
        out["devices"].append({
            "matmul": speed(product_flops, t_mm["seconds"][k], product_ops, oh[k]),
            "elementwise": speed(ew_flops, t_ew["seconds"][k], ew_ops, oh[k]),
            "update_elementwise": speed(big_flops, t_big["seconds"][k], big_ops, oh[k]),
            "overhead": oh[k],
            "group_s": {"matmul": t_mm["seconds"][k], "elementwise": t_ew["seconds"][k],
                        "update_elementwise": t_big["seconds"][k], "overhead": overhead["seconds"][k]},
            "groups_in_window": {"matmul": t_mm["groups"][k], "elementwise": t_ew["groups"][k],
                                 "update_elementwise": t_big["groups"][k], "overhead": overhead["groups"][k]},
        })

    # Links, one pair at a time (nothing else runs): latency from 4 bytes,
    # bandwidth from 4 MiB, each less the same function without the move.
    big_n = (1 << 20) if s["width"] >= 1024 else (1 << 14)
    pairs = []
    for i in range(len(devices)):
        for j in range(i + 1, len(devices)):
            a, b = devices[i], devices[j]
            with tf.device(a):
                small = tf.constant([1.0])
                large = tf.random.stateless_normal((big_n,), seed=(4, i))

            @tf.function
            def move(x, a=a, b=b):
                with tf.device(a):
                    y = x + 0.0
                with tf.device(b):
                    return tf.reduce_sum(y[:1]) + 0.0

            @tf.function
            def stay(x, a=a):
                with tf.device(a):
                    y = x + 0.0
                    return tf.reduce_sum(y[:1]) + 0.0

            latency = max(_wall(move, small, repeats=7) - _wall(stay, small, repeats=7), 1e-6)
            extra = max(_wall(move, large, repeats=5) - _wall(stay, large, repeats=5) - latency, 1e-6)
            pairs.append({"a": i, "b": j, "latency": latency, "bandwidth": big_n * 4 / extra})
    out["pairs"] = pairs

    @tf.function
    def tick(x):
        for d in devices[1:] + devices[:1]:
            with tf.device(d):
                x = x + 1.0
        return x

    with tf.device(devices[0]):
        one = tf.constant(0.0)
    out["call_s"] = _wall(tick, one, repeats=9)
    return out


def cluster_of(measured: dict) -> dict:
    """The config key ``cluster`` declaring the measured devices, device k
    being rank k's (stage k's)."""
    names = [f"CPU:{k}" for k in range(len(measured["devices"]))]
    devices = [{"name": n, "kind": "CPU", "memory": 0, "overhead": d["overhead"],
                "flops": {"matmul": d["matmul"], "conv": d["matmul"], "elementwise": d["elementwise"]}}
               for n, d in zip(names, measured["devices"])]
    pairs = [{"a": f"localhost/{names[p['a']]}", "b": f"localhost/{names[p['b']]}", "bandwidth": p["bandwidth"],
              "latency": p["latency"]} for p in measured["pairs"]]
    host = {"bandwidth": statistics.median(p["bandwidth"] for p in measured["pairs"]),
            "latency": statistics.median(p["latency"] for p in measured["pairs"])}
    return {"hosts": {"localhost": {"devices": devices}}, "links": {"host": host, "pairs": pairs}}


# ---------------------------------------------------------------------------
# The prediction (driver; plain Python on the compiled step)
# ---------------------------------------------------------------------------
def predict(entry, graph, measured: dict) -> dict:
    """The step time of compiled step `entry` on resource graph `graph`
    (module doc, step 3), and its parts."""
    from smp_tf.planner.resources import graph_flops_by_class

    plan, g = entry.plan, entry.plan.op_graph
    dev = [graph.devices[p % len(graph.devices)] for p in range(plan.num_partitions)]
    upd = [measured["devices"][p % len(graph.devices)]["update_elementwise"] for p in range(plan.num_partitions)]
    params = [0.0] * plan.num_partitions
    nvars = [0] * plan.num_partitions
    for v, p in plan.partition_of_variable().items():
        params[p] += g.variable_bytes.get(v, 0) / 4
        nvars[p] += 1
    compute, sends, accumulate = {}, {}, {}
    backward_flops = [0.0] * plan.num_partitions
    for t in entry.tasks:
        ops = [g.ops[i] for i in list(t.members) + list(t.recomputed)]
        work = graph_flops_by_class([op.type for op in ops], [op.flops for op in ops])
        compute[t.key] = dev[t.partition].seconds(work, len(ops))
        sends[t.key] = 0.0
        if t.kind.backward:
            backward_flops[t.partition] += max(t.flops, 1.0)
    seen = set()
    for u in entry.tasks:
        for tid in u.inputs:
            src = u.producer_of_input.get(tid)
            if src is None or src[0] == u.partition or (tid, u.partition) in seen:
                continue
            seen.add((tid, u.partition))
            sends[src] += graph.link(dev[src[0]].name, dev[u.partition].name).seconds(g.tensors[tid].bytes)
    for t in entry.tasks:
        p = t.partition
        share = max(t.flops, 1.0) / backward_flops[p] if t.kind.backward and backward_flops[p] else 0.0
        # One addition per gradient element and micro-batch (the running sum).
        accumulate[t.key] = share * (params[p] / upd[p] + nvars[p] * dev[p].overhead)
    compute_only = entry.schedule.simulate(costs=compute).makespan
    with_sends = entry.schedule.simulate(costs={k: compute[k] + sends[k] for k in compute}).makespan
    sim = entry.schedule.simulate(costs={k: compute[k] + sends[k] + accumulate[k] for k in compute})
    end = [0.0] * plan.num_partitions
    for action, e in sim.end.items():
        end[action.partition] = max(end[action.partition], e)
    # After its last task each stage divides by M and applies SGD (3 flops
    # per parameter; about 3 ops per variable).
    finish = max(end[p] + 3 * params[p] / upd[p] + 3 * nvars[p] * dev[p].overhead for p in range(len(end)))
    speeds = []
    for p in range(plan.num_partitions):
        ops = [op for op, q in zip(g.ops, plan.partition_of_op) if q == p]
        work = graph_flops_by_class([op.type for op in ops], [op.flops for op in ops])
        seconds = dev[p].seconds(work)
        speeds.append(sum(work.values()) / seconds if seconds > 0 else 0.0)
    stage = [{"compute_mb_s": sum(v for k, v in compute.items() if k[0] == p), "speed": speeds[p],
              "forward_mb_s": sum(compute[t.key] for t in entry.tasks if t.partition == p and not t.kind.backward),
              "backward_mb_s": sum(compute[t.key] for t in entry.tasks if t.partition == p and t.kind.backward),
              "accumulate_mb_s": sum(v for k, v in accumulate.items() if k[0] == p),
              "sends_mb_s": sum(v for k, v in sends.items() if k[0] == p)} for p in range(plan.num_partitions)]
    return {"makespan_compute_s": compute_only, "sends_s": with_sends - compute_only,
            "accumulate_s": sim.makespan - with_sends, "update_s": finish - sim.makespan,
            "call_s": measured["call_s"], "step_s": finish + measured["call_s"], "stages": stage}


def learn_speeds(measured: dict, prediction: dict, profile: dict):
    """The devices' speeds learned from the speed-oblivious step's profile
    (module doc, step 5): per stage, the factor by which its measured busy
    time per step exceeds its predicted one (its tasks' operations and the
    backward tasks' running sums, M micro-batches, at the chain-measured
    speeds); that device's speeds divided by it and its per-op overhead
    multiplied by it, so that every predicted time of the device scales by
    it. Returns (the learned measurement, the factors by stage = rank)."""
    factors = [profile["busy_s"][p] / max(M * (st["compute_mb_s"] + st["accumulate_mb_s"]), 1e-12)
               for p, st in enumerate(prediction["stages"])]
    learned = json.loads(json.dumps(measured))
    for f, d in zip(factors, learned["devices"]):
        for key in ("matmul", "elementwise", "update_elementwise"):
            d[key] /= f
        d["overhead"] *= f
    return learned, factors


def plan_summary(entry, layers: int, name: str) -> List[dict]:
    """Per stage: Dense layers, ops, flops share, and the plan's own
    predicted compute and sends per micro-batch (declared cluster only)."""
    plan = entry.plan
    rows = plan.summary()
    total = sum(r["flops"] for r in rows) or 1.0
    owned: Dict[int, List[int]] = {}
    for v, p in plan.partition_of_variable().items():
        for i in range(layers):
            if f"{name}_dense{i}/kernel" in v or f"{name}_dense{i}_kernel" in v:
                owned.setdefault(p, []).append(i)
    seconds = plan.stage_seconds() if plan.stage_resources else []
    sends = plan.stage_send_seconds() if plan.stage_resources else []
    out = []
    for r in rows:
        p = r["partition"]
        out.append({"partition": p, "ops": r["ops"], "flops": r["flops"], "share": r["flops"] / total,
                    "layers": sorted(set(owned.get(p, []))),
                    "plan_stage_s": seconds[p] if seconds else None, "plan_send_s": sends[p] if sends else None,
                    "declared": plan.stage_resources[p].name if plan.stage_resources else None,
                    "speed": plan.op_graph_speed(p) if plan.stage_resources else None})
    return out


def profiled_steps(smp, tf, keras, model, x, y, warmup: int, steps: int) -> dict:
    """The same step traced again inside `smp.profile` (the actions timed by
    `tf.timestamp` in the process that ran them), for where the time goes:
    per stage the median forward and backward task per micro-batch and the
    busy time per step; per step the pipeline's span (first action's start
    to last action's end), the time from the call to the first action and
    from the last action to the result. Medians over `steps` steps."""
    from benchmarks.pipeline.bench import smp_train_step

    calls = []
    with smp.profile(None) as prof:
        probed, _ = smp_train_step(tf, keras, smp, model)
        for _ in range(warmup + steps):
            start = time.time()
            probed(x, y).numpy()
            calls.append((start, time.time()))
    tl = prof.timeline
    med = statistics.median
    spans, leads, tails = [], [], []
    fwd: Dict[int, List[float]] = {}
    bwd: Dict[int, List[float]] = {}
    busy: Dict[int, List[float]] = {}
    for step in range(warmup, tl.num_steps):
        recs = tl.step_records(step)
        first, last = min(r.start for r in recs), max(r.end for r in recs)
        spans.append(last - first)
        leads.append(first - calls[step][0])
        tails.append(calls[step][1] - last)
        per: Dict[int, float] = {}
        for r in recs:
            # "F3": forward; "B3" backward; "FB3" both (the last stage's fused task).
            (fwd if r.name.startswith("F") and not r.name.startswith("FB") else bwd).setdefault(
                r.partition, []).append(r.duration)
            per[r.partition] = per.get(r.partition, 0.0) + r.duration
        for p_, b in per.items():
            busy.setdefault(p_, []).append(b)
    parts = sorted(busy)
    return {"span_s": med(spans), "lead_s": med(leads), "tail_s": med(tails),
            "forward_mb_s": [med(fwd[p_]) if p_ in fwd else 0.0 for p_ in parts],
            "backward_mb_s": [med(bwd[p_]) if p_ in bwd else 0.0 for p_ in parts],
            "busy_s": [med(busy[p_]) for p_ in parts]}


# ---------------------------------------------------------------------------
# The processes
# ---------------------------------------------------------------------------
def part_stage(args) -> None:
    """Ranks 1 and 2: `smp.init` serves this process's device until the
    driver is done, then exits the process."""
    import smp_tf as smp

    smp.init(_base_config())
    raise AssertionError("unreachable: smp.init serves and exits on a stage process")


def part_driver(args) -> dict:
    import smp_tf as smp

    smp.init(_base_config())
    import keras
    import tensorflow as tf

    from benchmarks.pipeline.bench import build_mlp, smp_train_step
    from smp_tf.planner import resource_graph_of

    tf.get_logger().setLevel("ERROR")
    s = sizes(args)
    devices = list(smp.topology().devices)
    measured = measure_devices(tf, devices, s)
    cluster = cluster_of(measured)
    graph = resource_graph_of(json.dumps(cluster))
    out: Dict[str, object] = {"devices": devices, "measured": measured, "cluster": cluster, "variants": {}}
    # The learned variant needs the speed-oblivious profile: it runs last.
    order = ("oblivious", "aware") if args.order == 0 else ("aware", "oblivious")
    order += ("learned",)
    entries = {}
    for variant in order:
        cfg = _base_config()
        if variant == "aware":
            cfg["cluster"] = cluster
        if variant == "learned":
            learned, factors = learn_speeds(measured, predict(entries["oblivious"], graph, measured),
                                            out["variants"]["oblivious"]["profile"])
            out["learned"] = learned
            out["learned_factors"] = factors
            out["learned_cluster"] = cfg["cluster"] = cluster_of(learned)
        smp.init(cfg)
        keras.utils.set_random_seed(0)
        name = f"mlp_{variant}"
        model = build_mlp(keras, smp.DistributedModel, s["layers"], s["width"], name)
        train, body = smp_train_step(tf, keras, smp, model)
        with tf.device(devices[0]):
            x = tf.random.normal([s["batch"], s["width"]], seed=1)
            y = tf.random.normal([s["batch"], s["width"]], seed=2)
        t0 = time.perf_counter()
        train(x, y).numpy()
        first = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            train(x, y).numpy()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            train(x, y).numpy()
            times.append(time.perf_counter() - t0)
        entries[variant] = body.last_compiled
        profile = profiled_steps(smp, tf, keras, model, x, y, *((1, 2) if args.quick else (3, 5)))
        out["variants"][variant] = {
            "step_s": times, "first_step_s": first, "profile": profile,
            "stages": plan_summary(entries[variant], s["layers"], name),
            "report": entries[variant].plan.report(),
        }
        del model, train, body
    # The first two variants are predicted on the measured devices (the
    # speed-aware one's plan declares exactly these); the learned one on the
    # learned devices its plan declares.
    for variant in ("oblivious", "aware"):
        out["variants"][variant]["prediction"] = predict(entries[variant], graph, measured)
    learned_graph = resource_graph_of(json.dumps(out["learned_cluster"]))
    out["variants"]["learned"]["prediction"] = predict(entries["learned"], learned_graph, out["learned"])
    # The speed-oblivious step at the learned speeds (by construction its
    # stages' predicted busy times are the measured ones).
    out["variants"]["oblivious"]["learned_prediction"] = predict(entries["oblivious"], learned_graph, out["learned"])
    # A diagnostic, not the prediction: each device's speeds scaled so that
    # the speed-oblivious step's tasks take, at the model's flops, the busy
    # time its profile measured; every variant predicted again with them.
    pred, prof = out["variants"]["oblivious"]["prediction"], out["variants"]["oblivious"]["profile"]
    factors = [prof["busy_s"][p] / max(M * st["compute_mb_s"], 1e-12) for p, st in enumerate(pred["stages"])]
    refined = json.loads(json.dumps(measured))
    for f, d in zip(factors, refined["devices"]):
        for key in ("matmul", "elementwise", "update_elementwise"):
            d[key] /= f
        d["overhead"] *= f
    refined_graph = resource_graph_of(json.dumps(cluster_of(refined)))
    out["refined_factors"] = factors
    for variant in VARIANTS:
        out["variants"][variant]["refined_prediction"] = predict(entries[variant], refined_graph, refined)
    return out


def run_round(args, cpus: List[int], order: int) -> dict:
    from smp_tf.distributed.cluster import pick_free_ports

    addresses = ",".join(f"127.0.0.1:{p}" for p in pick_free_ports(P, "127.0.0.1"))
    timeout = QUICK_ROUND_TIMEOUT_S if args.quick else ROUND_TIMEOUT_S
    procs: List[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="smp_hetero_") as tmp:
        logs = []
        try:
            for rank in range(P):
                env = dict(os.environ, SMP_TF_RANK=str(rank), SMP_TF_SIZE=str(P), SMP_TF_LOCAL_RANK=str(rank),
                           SMP_TF_LOCAL_SIZE=str(P), SMP_TF_ADDRESSES=addresses, PYTHONPATH=str(ROOT))
                cmd = [sys.executable, __file__, "--part", "driver" if rank == 0 else "stage",
                       "--cpu", str(_cpu_of(rank, args, cpus)),
                       "--order", str(order), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
                cmd += ["--quick"] if args.quick else []
                cmd += ["--width", str(args.width), "--microbatches", str(M)]
                out = open(os.path.join(tmp, f"rank{rank}.out"), "w+")
                err = open(os.path.join(tmp, f"rank{rank}.err"), "w+")
                logs.append((out, err))
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err))
            try:
                procs[0].wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"the driver did not finish within {timeout} s")
            for p in procs[1:]:
                try:
                    p.wait(timeout=EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass  # ended below
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    try:
                        p.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
            texts = []
            for out, err in logs:
                out.seek(0)
                err.seek(0)
                texts.append((out.read(), err.read()))
                out.close()
                err.close()
        if procs[0].returncode != 0:
            raise RuntimeError(f"driver exit code {procs[0].returncode}\n" + "\n".join(
                f"--- rank {r} stderr ---\n{t[1][-3000:]}" for r, t in enumerate(texts)))
        for line in texts[0][0].splitlines():
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])
        raise RuntimeError("no result in the driver's output:\n" + texts[0][0][-3000:] + texts[0][1][-3000:])


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _gf(flops: float) -> str:
    return f"{flops / 1e9:.2f}"


def split_bound(speeds: List[float], layers: int) -> float:
    """How much faster the best split of `layers` equal layers over stages
    of these `speeds` is than the equal split, counting each stage's compute
    alone (no bubble, no transfers): the most a speed-aware partition can
    gain. Exhaustive over the splits (a few hundred for 3 stages)."""
    def slowest(counts) -> float:
        return max(n / v for n, v in zip(counts, speeds))

    def splits(n: int, k: int):
        if k == 1:
            yield (n,)
            return
        for first in range(n + 1):
            for rest in splits(n - first, k - 1):
                yield (first,) + rest

    k = len(speeds)
    equal = [layers // k + (i < layers % k) for i in range(k)]
    return slowest(equal) / min(slowest(c) for c in splits(layers, k))


def _shared(args) -> List[int]:
    """The two ranks that share the second CPU."""
    return [k for k in range(P) if k != args.alone]


def _cpu_of(rank: int, args, cpus: List[int]) -> int:
    """The CPU rank `rank` is pinned to: the first for ``--alone``, the
    second for the two others."""
    return cpus[0] if rank == args.alone else cpus[1]


def _header_lines(args, rounds: List[dict], cpus: List[int], elapsed: float) -> List[str]:
    s = sizes(args)
    return [
        "smp_tf speed-aware partitioning on unequal devices%s: MLP %d x Dense(%d), batch %d, P=%d over %d processes,"
        " M=%d, interleaved" % (" (--quick: figures mean nothing)" if args.quick else "", s["layers"], s["width"],
                                s["batch"], P, P, M),
        "%s; rank %d on CPU %d alone, ranks %s sharing CPU %d; %d timed steps after %d warm-up per variant and"
        " round, %d round(s), medians; run took %.0f s" % (versions(), args.alone, cpus[0],
                                                          " and ".join(str(k) for k in _shared(args)), cpus[1],
                                                          args.repeats, args.warmup, len(rounds), elapsed),
    ]


def _speed_lines(args, rounds: List[dict], cpus: List[int]) -> List[str]:
    """Each device's measured and learned speeds, and per round the ratios
    of the one alone to the others, the links and the call's cost."""
    lines = [
        "Device speeds measured under concurrent load (all three chains at once), per round; learned: the matmul"
        " speed divided by the",
        "speed-oblivious profile's busy time over its predicted one (all speeds divided, the overhead multiplied):",
        "%-6s %-5s %22s %22s %22s %16s %22s" % ("rank", "CPU", "matmul GFLOP/s", "elementwise GFLOP/s",
                                                "update elt. GFLOP/s", "overhead us/op", "learned matmul GF/s"),
    ]
    for k in range(P):
        devs = [r["measured"]["devices"][k] for r in rounds]
        lines.append("%-6d %-5d %22s %22s %22s %16s %22s" % (
            k, _cpu_of(k, args, cpus),
            " / ".join(_gf(d["matmul"]) for d in devs), " / ".join(_gf(d["elementwise"]) for d in devs),
            " / ".join(_gf(d["update_elementwise"]) for d in devs),
            " / ".join("%.1f" % (d["overhead"] * 1e6) for d in devs),
            " / ".join(_gf(r["learned"]["devices"][k]["matmul"]) for r in rounds)))
    a, shared = args.alone, _shared(args)
    for r_i, r in enumerate(rounds):
        m = r["measured"]
        ratio = [m["devices"][a]["matmul"] / m["devices"][k]["matmul"] for k in shared]
        lr = [r["learned"]["devices"][a]["matmul"] / r["learned"]["devices"][k]["matmul"] for k in shared]
        links = ", ".join("%d-%d %.0f us + %.0f MB/s" % (p["a"], p["b"], p["latency"] * 1e6, p["bandwidth"] / 1e6)
                          for p in m["pairs"])
        lines.append("round %d: rank %d / rank %d, rank %d matmul speed %.2f, %.2f (learned %.2f, %.2f; factors %s);"
                     " links %s; call with one op per process %.1f ms"
                     % (r_i + 1, a, shared[0], shared[1], ratio[0], ratio[1], lr[0], lr[1],
                        ",".join("%.2f" % f for f in r["learned_factors"]), links, m["call_s"] * 1e3))
    return lines


def _partition_lines(rounds: List[dict]) -> List[str]:
    """The last round's split per variant: each stage's layers, speed and
    tasks predicted against profiled; notes where rounds split differently."""
    last = rounds[-1]
    lines = ["", "Partitions (last round): Dense layers and share of the step's flops; the declared (learned: learned)"
              " device's speed on the stage's work; per micro-batch the forward / backward task predicted (at that"
              " speed) and",
              "measured (profiled steps, median task); per step the stage's busy time predicted (M micro-batches)"
              " and measured; predicted sends per micro-batch"]
    lines.append("%-9s %5s %-12s %6s %11s %14s %14s %15s %8s" % (
        "variant", "stage", "Dense layers", "flops", "speed GF/s", "pred fwd/bwd", "meas fwd/bwd", "busy pred/meas",
        "sends"))
    for v in VARIANTS:
        res = last["variants"][v]
        prof = res["profile"]
        for st, pr in zip(res["stages"], res["prediction"]["stages"]):
            p_ = st["partition"]
            layers = st["layers"]
            span = ("%d-%d (%d)" % (layers[0], layers[-1], len(layers)) if len(layers) > 1 else
                    "%d (1)" % layers[0] if layers else "-")
            lines.append("%-9s %5d %-12s %5.1f%% %11s %14s %14s %15s %8s" % (
                v, p_, span, 100 * st["share"], _gf(pr["speed"]),
                "%s / %s" % (_ms(pr["forward_mb_s"]), _ms(pr["backward_mb_s"])),
                "%s / %s" % (_ms(prof["forward_mb_s"][p_]), _ms(prof["backward_mb_s"][p_])),
                "%s / %s" % (_ms(M * pr["compute_mb_s"]), _ms(prof["busy_s"][p_])), _ms(pr["sends_mb_s"])))
    lines.append("(times in ms)")
    for v in VARIANTS:
        plan_s = [st["plan_stage_s"] for st in last["variants"][v]["stages"]]
        if all(p is not None for p in plan_s):
            lines.append("%s: plan.stage_seconds() %s ms, plan.stage_send_seconds() %s ms per micro-batch" % (
                v, " / ".join(_ms(p) for p in plan_s),
                " / ".join(_ms(st["plan_send_s"]) for st in last["variants"][v]["stages"])))
    splits = {v: {tuple(tuple(st["layers"]) for st in r["variants"][v]["stages"]) for r in rounds} for v in VARIANTS}
    for v, label in (("aware", "speed-aware"), ("learned", "learned")):
        if len(splits[v]) > 1:
            lines.append("note: the %s split differed between rounds: %s" % (label, sorted(splits[v])))

    return lines


def _figure_lines(rounds: List[dict], t_m: Dict[str, float], p_m: Dict[str, float]) -> List[str]:
    """The step measured against its predicted parts, the profile's view of
    the step, and the diagnostic fit, one column per variant."""
    med = statistics.median
    lines: List[str] = []

    def pred(v: str, key: str) -> float:
        return med(r["variants"][v]["prediction"][key] for r in rounds)

    fmt = "%-66s" + " %12s" * len(VARIANTS)
    lines += ["", fmt % (("figure",) + VARIANTS), fmt % (("-" * 66,) + ("-" * 12,) * len(VARIANTS))]

    def row(label: str, *cells: str) -> None:
        lines.append(fmt % ((label,) + cells))

    def each(fn) -> List[str]:
        return [fn(v) for v in VARIANTS]

    row("measured step, median [ms]", *each(lambda v: _ms(t_m[v])))
    row("  per round [ms]", *each(lambda v: " / ".join(_ms(med(r["variants"][v]["step_s"])) for r in rounds)))
    row("predicted: simulated 1F1B makespan, compute only [ms]", *each(lambda v: _ms(pred(v, "makespan_compute_s"))))
    row("  + sends over the measured links [ms]", *each(lambda v: _ms(pred(v, "sends_s"))))
    row("  + gradient running sums in the backward tasks [ms]", *each(lambda v: _ms(pred(v, "accumulate_s"))))
    row("  + update after each stage's last task [ms]", *each(lambda v: _ms(pred(v, "update_s"))))
    row("  + call with one op per process (measured) [ms]", *each(lambda v: _ms(pred(v, "call_s"))))
    row("predicted step [ms] (learned: at the learned speeds)", *each(lambda v: _ms(p_m[v])))
    err = {v: p_m[v] / t_m[v] - 1 for v in VARIANTS}
    row("predicted / measured - 1 (target for aware, learned: within %d%%)" % (100 * PREDICTION_TARGET),
        *each(lambda v: "%+.1f%%" % (100 * err[v]) if v == "oblivious" else
              "%+.1f%% %s" % (100 * err[v], "PASS" if abs(err[v]) <= PREDICTION_TARGET else "FAIL")))
    row("  per round", *each(lambda v: " / ".join(
        "%+.0f%%" % (100 * (r["variants"][v]["prediction"]["step_s"] / med(r["variants"][v]["step_s"]) - 1))
        for r in rounds)))

    def prof(v: str, key: str) -> str:
        return _ms(med(r["variants"][v]["profile"][key] for r in rounds))

    def busy(v: str) -> str:
        return "/".join("%.0f" % (1e3 * med(r["variants"][v]["profile"]["busy_s"][p_] for r in rounds))
                        for p_ in range(P))

    def pred_busy(v: str) -> str:
        return "/".join("%.0f" % (1e3 * med(M * r["variants"][v]["prediction"]["stages"][p_]["compute_mb_s"]
                                            for r in rounds)) for p_ in range(P))

    row("profiled steps (smp.profile): call to first action [ms]", *each(lambda v: prof(v, "lead_s")))
    row("  pipeline span, first action to last [ms]", *each(lambda v: prof(v, "span_s")))
    row("  last action to result [ms]", *each(lambda v: prof(v, "tail_s")))
    row("  stages' busy time per step, measured [ms]", *each(busy))
    row("  stages' busy time per step, predicted compute [ms]", *each(pred_busy))
    r_m = {v: med(r["variants"][v]["refined_prediction"]["step_s"] for r in rounds) for v in VARIANTS}
    factors = " / ".join(",".join("%.2f" % f for f in r["refined_factors"]) for r in rounds)
    row("diagnostic: chain speeds scaled to the oblivious profile's busy", *([""] * len(VARIANTS)))
    row("  times, by stage (per round) %s; predicted step [ms]" % factors, *each(lambda v: _ms(r_m[v])))
    row("  predicted / measured - 1 (oblivious: fitted)", *each(lambda v: "%+.1f%%" % (100 * (r_m[v] / t_m[v] - 1))))
    return lines


def _verdict_lines(args, rounds: List[dict], t_m: Dict[str, float], p_m: Dict[str, float]) -> List[str]:
    """The speed-ups against their target, their bound and their predictions."""
    med = statistics.median
    s = sizes(args)
    ratio = {v: t_m["oblivious"] / t_m[v] for v in ("aware", "learned")}
    return [
        "",
        "%-66s %25s" % ("speed-oblivious / speed-aware step (target >= %.2f)" % SPEEDUP_TARGET,
                        "%.3f %s" % (ratio["aware"], "PASS" if ratio["aware"] >= SPEEDUP_TARGET else "FAIL")),
        "%-66s %25s" % ("speed-oblivious / learned step (target >= %.2f)" % SPEEDUP_TARGET,
                        "%.3f %s" % (ratio["learned"], "PASS" if ratio["learned"] >= SPEEDUP_TARGET else "FAIL")),
        "%-66s %25s" % ("  per round", " / ".join(
            "%.3f" % (med(r["variants"]["oblivious"]["step_s"]) / med(r["variants"]["learned"]["step_s"]))
            for r in rounds)),
        "%-66s %25s" % ("bound: the best split of %d equal layers at the learned speeds," % s["layers"],
                        " / ".join("%.3f" % split_bound([d["matmul"] for d in r["learned"]["devices"]], s["layers"])
                                   for r in rounds)),
        "%-66s" % "  against an equal one, compute only (per round)",
        "%-66s %25s" % ("predicted speed-oblivious / speed-aware", "%.3f" % (p_m["oblivious"] / p_m["aware"])),
        "%-66s %25s" % ("predicted speed-oblivious (learned speeds) / learned",
                        "%.3f" % (med(r["variants"]["oblivious"]["learned_prediction"]["step_s"] for r in rounds)
                                  / p_m["learned"])),
    ]


def build_table(args, rounds: List[dict], cpus: List[int], elapsed: float) -> str:
    med = statistics.median
    t_m = {v: med([t for r in rounds for t in r["variants"][v]["step_s"]]) for v in VARIANTS}
    p_m = {v: med(r["variants"][v]["prediction"]["step_s"] for r in rounds) for v in VARIANTS}
    lines = (_header_lines(args, rounds, cpus, elapsed) + [""] + _speed_lines(args, rounds, cpus)
             + _partition_lines(rounds) + _figure_lines(rounds, t_m, p_m) + _verdict_lines(args, rounds, t_m, p_m))
    return "\n".join(lines)


def main(argv=None) -> int:
    global M
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (checks the script)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per variant and round (default 15)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; 2 with --quick)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of three fresh processes, alternating the variants' order (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="the Dense layers' width (default 1024)")
    parser.add_argument("--microbatches", type=int, default=M, help="micro-batches per step (default %d)" % M)
    parser.add_argument("--alone", type=int, default=0, choices=range(P),
                        help="the rank with a core to itself (default 0: the driver, stage 0)")
    parser.add_argument("--json", help="write the raw results to this file")
    parser.add_argument("--part", default="all", choices=["all", "driver", "stage"], help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.microbatches < 1 or 256 % args.microbatches:
        parser.error("--microbatches must divide the batch of 256, got %d" % args.microbatches)
    M = args.microbatches
    if args.part != "all":
        # Pinned before TensorFlow starts: every thread it creates inherits it.
        os.sched_setaffinity(0, {args.cpu})
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    if args.warmup is None:
        args.warmup = 2 if args.quick else 10
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.part == "stage":
        part_stage(args)
        return 0
    if args.part == "driver":
        _emit(part_driver(args))
        return 0
    cpus = choose_cpus(2)
    if cpus is None:
        print("SKIPPED: this benchmark needs 2 CPUs (sched_getaffinity)", flush=True)
        return 0
    start = time.monotonic()
    rounds = [run_round(args, cpus, r % 2) for r in range(args.rounds)]
    print(build_table(args, rounds, cpus, time.monotonic() - start), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
