"""Partitioner benchmark: speed and balance of `smp_tf`'s automatic partitioning.

For real Keras training steps (forward, loss and `tf.GradientTape` gradients
of one micro-batch) and for a large synthetic `tf.compat.v1` graph, prints one
table with, per model, partition count and method:

* ``trace s``: time to trace the step (median of 3; for the synthetic graph,
  the time to build it with `tf.compat.v1` ops and `tf.gradients`, once);
* ``part s``: partitioning time, i.e. graph view (`from_tf_graph`) plus
  colocation groups plus assignment (median of 3);
* ``var/ideal`` and ``var/best``: the largest partition's variable bytes
  divided by the ideal (total / P) and by the best contiguous split of the
  units' variable bytes (exact `balance.min_bottleneck` over the unit order);
* ``flop/ideal`` and ``flop/best``: the same for estimated flops;
* ``mem/ideal``: the largest partition's ``optimize="memory"`` cost (variables times
  (1 + optimizer slots) plus kept activations) over total / P;
* ``cut``: bytes sent between partitions per micro-batch (`PartitionPlan.cut_bytes`);
* ``target``: PASS / FAIL against the targets listed at the end.

Methods: ``smp`` is `assign_partitions` with the given ``optimize`` and
``contiguous``; ``eq-layers`` splits the unit sequence (colocation groups in
forward order, about one Keras layer each) into P runs of equal length
(`balance.equal_count_split`); ``eq-ops`` splits the forward ops in creation
order into P chunks of equal op count, gradient ops going with their forward
op (the heuristic of the original library).

Usage::

    python benchmarks/partitioner/bench.py            # full run (a few minutes)
    python benchmarks/partitioner/bench.py --quick    # small models only (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

#: Logical CPU devices to create before anything else (smp.init reuses them).
MAX_PARTITIONS = 8
_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * MAX_PARTITIONS
    )
except RuntimeError:  # pragma: no cover - devices already initialised
    pass

import importlib  # noqa: E402

import keras  # noqa: E402

import smp_tf as smp  # noqa: E402
from smp_tf.graph_view import OpGraph, from_tf_graph  # noqa: E402
from smp_tf.partitioner import balance  # noqa: E402
from smp_tf.partitioner import plan as plan_lib  # noqa: E402
from smp_tf.partitioner.groups import Groups, colocation_groups  # noqa: E402
from smp_tf.partitioner.plan import (  # noqa: E402
    PartitionPlan,
    _follow_neighbours,
    _group_positions,
    assign_partitions,
    unit_costs,
)

# The module that traces a step (it builds the graph view), for the view timing.
smp_trace = importlib.import_module("smp_tf.trace")

REPS = 3
#: Targets (see README.md).
RESNET_P4_SECONDS = 2.0
SYNTHETIC_SECONDS = 30.0
MEMORY_BALANCE = 1.10

#: (method, optimize, contiguous) rows per model and partition count.
SMP_CONFIGS = [("speed", True), ("memory", True), ("speed", False), ("memory", False)]


# --------------------------------------------------------------------------- models


class TiedEncoder(smp.DistributedModel):
    """A Transformer encoder whose output projection reuses the embedding matrix."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, dim, name="embed")
        self.blocks = []
        for i in range(layers):
            self.blocks.append(
                (
                    keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attn{i}"),
                    keras.layers.LayerNormalization(name=f"ln{i}a"),
                    keras.layers.Dense(4 * dim, activation="gelu", name=f"ff{i}a"),
                    keras.layers.Dense(dim, name=f"ff{i}b"),
                    keras.layers.LayerNormalization(name=f"ln{i}b"),
                )
            )

    def call(self, tokens: Any, training: bool = False) -> Any:
        h = self.embed(tokens)
        for attn, ln_a, ff_a, ff_b, ln_b in self.blocks:
            h = ln_a(h + attn(h, h, training=training))
            h = ln_b(h + ff_b(ff_a(h)))
        # Tied output projection: logits = h @ E^T.
        return tf.matmul(h, self.embed.embeddings, transpose_b=True, name="tied_logits")


def _image_case(builder: Callable[[], Any], shape: Tuple[int, ...], classes: int, batch: int):
    def make():
        model = builder()
        x = np.random.default_rng(0).normal(size=(batch,) + shape).astype("float32")
        y = (np.arange(batch) % classes).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy()
        return model, x, y, loss

    return make


def _transformer_case(vocab: int, dim: int, heads: int, layers: int, seq: int, batch: int):
    def make():
        model = TiedEncoder(vocab, dim, heads, layers)
        model(np.zeros((1, seq), "int32"))
        rng = np.random.default_rng(0)
        x = rng.integers(0, vocab, size=(batch, seq)).astype("int32")
        y = rng.integers(0, vocab, size=(batch, seq)).astype("int32")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return model, x, y, loss

    return make


def keras_cases(quick: bool) -> List[Tuple[str, Callable, Sequence[int]]]:
    """(label, factory, partition counts). Micro-batch of 2 samples throughout."""
    if quick:
        return [
            ("Transformer-2L (tiny)", _transformer_case(512, 64, 2, 2, 16, 2), (2, 4)),
        ]
    return [
        (
            "ResNet50 224px",
            _image_case(lambda: keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3)),
                        (224, 224, 3), 1000, 2),
            (2, 4, 8),
        ),
        (
            "MobileNetV2 224px",
            _image_case(lambda: keras.applications.MobileNetV2(weights=None), (224, 224, 3), 1000, 2),
            (4,),
        ),
        ("Transformer-4L tied", _transformer_case(8192, 256, 4, 4, 128, 2), (4,)),
    ]


def build_synthetic(blocks: int, width: int = 16, batch: int = 2) -> Tuple[tf.Graph, List[str]]:
    """A deep chain of small residual dense blocks with resource variables.

    Each block: two `VarHandleOp` + `ReadVariableOp`, MatMul, BiasAdd, Relu and
    a residual add; `tf.gradients` adds the backward. About 13 ops per block.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, width], name="x")
        h = x
        reads = []
        for i in range(blocks):
            with tf.name_scope(f"block{i}"):
                w = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[width, width], shared_name=f"block{i}/w", name="w")
                b = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[width], shared_name=f"block{i}/b", name="b")
                wr = tf.raw_ops.ReadVariableOp(resource=w, dtype=tf.float32)
                br = tf.raw_ops.ReadVariableOp(resource=b, dtype=tf.float32)
                h = h + tf.nn.relu(tf.nn.bias_add(tf.matmul(h, wr), br))
                reads += [wr, br]
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf.gradients(loss, reads)
    return graph, ["x"]


# --------------------------------------------------------------------------- metrics


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def unit_order(graph: OpGraph, groups: Groups) -> List[int]:
    """Group ids of the units in forward order (as `assign_partitions` orders them)."""
    pos = _group_positions(graph, groups)
    return [g for _, g in sorted((p, g) for g, p in enumerate(pos) if p is not None)]


def unit_metrics(graph: OpGraph, groups: Groups, units: List[int]) -> Tuple[List[float], List[float]]:
    """Variable bytes and flops of each unit."""
    vb, fl = [], []
    for g in units:
        seen = set()
        b = f = 0.0
        for i in groups.members[g]:
            op = graph.ops[i]
            f += op.flops
            for v in op.variables:
                if v not in seen:
                    seen.add(v)
                    b += graph.variable_bytes.get(v, 0)
        vb.append(b)
        fl.append(f)
    return vb, fl


def largest_group_bytes(graph: OpGraph, groups: Groups) -> float:
    best = 0.0
    for ms in groups.members:
        vs = {v for i in ms for v in graph.ops[i].variables}
        best = max(best, float(sum(graph.variable_bytes.get(v, 0) for v in vs)))
    return best


def complete_assignment(graph: OpGraph, groups: Groups, part_of_group: List[Optional[int]], P: int) -> List[int]:
    """The tail of `assign_partitions`: leftover groups follow neighbours, free ops their consumers."""
    part_of_group = list(part_of_group)
    _follow_neighbours(graph, groups, part_of_group, P - 1)
    return plan_lib.complete_assignment(graph, groups, part_of_group, 0)


def equal_layers(graph: OpGraph, P: int) -> List[int]:
    """Baseline 1: the same number of units (about one Keras layer each) per partition."""
    groups = colocation_groups(graph)
    units = unit_order(graph, groups)
    bounds = balance.equal_count_split(len(units), P)
    part: List[Optional[int]] = [None] * len(groups)
    for p in range(P):
        for u in range(bounds[p], bounds[p + 1]):
            part[units[u]] = p
    return complete_assignment(graph, groups, part, P)


def equal_ops(graph: OpGraph, P: int) -> List[int]:
    """Baseline 2: forward ops in creation order, P chunks of equal count.

    Gradient ops go with their forward op; gradient ops with no forward op
    (sums, the step's outputs) go with the producer of their first input.
    """
    forward = [op.index for op in graph.ops if not op.is_gradient]
    assignment = [-1] * len(graph.ops)
    for k, i in enumerate(forward):
        assignment[i] = k * P // len(forward)
    for op in graph.ops:
        if assignment[op.index] != -1:
            continue
        if op.forward is not None and assignment[op.forward] != -1:
            assignment[op.index] = assignment[op.forward]
        elif op.inputs:
            assignment[op.index] = max(assignment[graph.tensors[op.inputs[0]].producer], 0)
        else:
            assignment[op.index] = P - 1
    return assignment


def memory_cost_ratio(graph: OpGraph, groups: Groups, assignment: List[int], P: int) -> float:
    """Largest partition's ``optimize="memory"`` cost (variables with optimizer
    slots plus kept activations, `unit_costs`) over the ideal (total / P)."""
    cost = unit_costs(graph, groups, "memory")
    per = [0.0] * P
    for g, ms in enumerate(groups.members):
        per[assignment[ms[0]]] += cost[g]
    return max(per) / ((sum(per) / P) or 1.0)


def evaluate(graph: OpGraph, groups: Groups, assignment: List[int], P: int, best_var: float,
             best_flop: float) -> Dict[str, float]:
    plan = PartitionPlan(None, graph, assignment, P)
    rows = plan.summary()
    vb = [r["variable_bytes"] for r in rows]
    fl = [r["flops"] for r in rows]
    ideal_v = (sum(vb) / P) or 1.0
    ideal_f = (sum(fl) / P) or 1.0
    return {
        "var_max": max(vb),
        "var_ideal": ideal_v,
        "var/ideal": max(vb) / ideal_v,
        "var/best": max(vb) / best_var if best_var else float("nan"),
        "flop/ideal": max(fl) / ideal_f,
        "flop/best": max(fl) / best_flop if best_flop else float("nan"),
        "mem/ideal": memory_cost_ratio(graph, groups, assignment, P),
        "cut": float(plan.cut_bytes),
    }


# --------------------------------------------------------------------------- timing


@contextlib.contextmanager
def timed_views(sink: List[float]):
    """Records the time of every `from_tf_graph` call made by `smp.step` (the graph view)."""
    original = smp_trace.from_tf_graph

    def wrapper(*args: Any, **kwargs: Any) -> OpGraph:
        t = time.perf_counter()
        out = original(*args, **kwargs)
        sink.append(time.perf_counter() - t)
        return out

    smp_trace.from_tf_graph = wrapper
    try:
        yield
    finally:
        smp_trace.from_tf_graph = original


def time_assign(graphs: Sequence[OpGraph], fn: Callable[[OpGraph], List[int]]) -> Tuple[List[float], List[int]]:
    """Runs `fn` once per traced copy of the graph; returns the times and the last result."""
    times, out = [], None
    for g in graphs:
        t = time.perf_counter()
        out = fn(g)
        times.append(time.perf_counter() - t)
    return times, out


def smp_assign(P: int, optimize: str, contiguous: bool) -> Callable[[OpGraph], List[int]]:
    def fn(g: OpGraph) -> List[int]:
        groups = colocation_groups(g)
        return assign_partitions(g, P, optimize=optimize, contiguous=contiguous, groups=groups)

    return fn


# --------------------------------------------------------------------------- rows


def rows_for_graph(
    label: str,
    graphs: Sequence[OpGraph],
    view_times: Sequence[float],
    trace_s: float,
    partitions: Sequence[int],
    target_seconds: Optional[Tuple[int, float]] = None,
    check: Optional[Tuple[int, List[int]]] = None,
) -> List[Dict[str, Any]]:
    graph = graphs[-1]
    groups = colocation_groups(graph)
    units = unit_order(graph, groups)
    unit_vb, unit_fl = unit_metrics(graph, groups, units)
    big_group = largest_group_bytes(graph, groups)
    rows = []
    for P in partitions:
        best_var = balance.min_bottleneck(unit_vb, P)
        best_flop = balance.min_bottleneck(unit_fl, P)
        methods = [("smp", opt, contig, smp_assign(P, opt, contig)) for opt, contig in SMP_CONFIGS]
        methods += [("eq-layers", "-", True, lambda g, P=P: equal_layers(g, P)),
                    ("eq-ops", "-", True, lambda g, P=P: equal_ops(g, P))]
        for method, opt, contig, fn in methods:
            times, assignment = time_assign(graphs, fn)
            part_s = _median([v + a for v, a in zip(view_times, times)])
            if check is not None and (method, opt, contig) == ("smp", "speed", True) and P == check[0]:
                if list(check[1]) != list(assignment):
                    raise RuntimeError(f"{label}: re-running assign_partitions does not reproduce smp.step's plan.")
            m = evaluate(graph, groups, assignment, P, best_var, best_flop)
            targets = []
            if method == "smp" and target_seconds is not None and P == target_seconds[0]:
                ok = part_s < target_seconds[1]
                targets.append(f"time<{target_seconds[1]:g}s {'PASS' if ok else 'FAIL'}")
            if method == "smp" and opt == "memory":
                limit = max(m["var_ideal"], big_group)
                ok = m["var_max"] <= MEMORY_BALANCE * limit * (1 + 1e-9)  # float rounding only
                targets.append(f"var<={MEMORY_BALANCE:.2f}x{'grp' if big_group > m['var_ideal'] else 'ideal'} "
                               f"{'PASS' if ok else 'FAIL'} ({m['var_max'] / limit:.2f})")
            rows.append({
                "model": label, "ops": len(graph), "P": P, "method": method, "optimize": opt,
                "contig": ("yes" if contig else "no") if method == "smp" else ("yes" if method == "eq-layers" else "-"),
                "trace s": trace_s, "part s": part_s, **m, "target": "; ".join(targets),
            })
    return rows


def run_keras_case(label: str, make: Callable, partitions: Sequence[int], log: Callable[[str], None]) -> List[Dict[str, Any]]:
    keras.utils.set_random_seed(0)
    model, x, y, loss_fn = make()

    def body(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    P0 = 4 if 4 in partitions else partitions[0]
    smp.init({"partitions": P0, "microbatches": 1, "optimize": "speed", "contiguous": True})
    step = smp.step(body)
    plans, views = [], []
    with timed_views(views):
        for _ in range(REPS):
            plans.append(step.get_plan(x, y))  # get_plan re-traces every call
    trace_s = _median([p.trace_seconds for p in plans])
    log(f"{label}: {len(plans[-1].op_graph)} ops, trace {trace_s:.2f} s, smp.step partitioning "
        f"{_median([p.seconds for p in plans]):.2f} s (view {_median(views):.2f} s)")
    return rows_for_graph(
        label, [p.op_graph for p in plans], views, trace_s, partitions,
        target_seconds=(4, RESNET_P4_SECONDS) if label.startswith("ResNet50") else None,
        check=(P0, plans[-1].partition_of_op),
    )


def run_synthetic(blocks: int, partitions: Sequence[int], log: Callable[[str], None]) -> List[Dict[str, Any]]:
    t = time.perf_counter()
    graph, args = build_synthetic(blocks)
    build_s = time.perf_counter() - t
    graphs, views = [], []
    for _ in range(REPS):
        t = time.perf_counter()
        graphs.append(from_tf_graph(graph, arg_ops=args))
        views.append(time.perf_counter() - t)
    label = f"synthetic {blocks} blocks"
    log(f"{label}: {len(graphs[-1])} ops, build {build_s:.2f} s, view {_median(views):.2f} s")
    return rows_for_graph(label, graphs, views, build_s, partitions,
                          target_seconds=(8, SYNTHETIC_SECONDS) if len(graphs[-1]) >= 90_000 else None)


# --------------------------------------------------------------------------- table


COLUMNS = [
    ("model", "model", "{}"), ("ops", "ops", "{}"), ("P", "P", "{}"), ("method", "method", "{}"),
    ("optimize", "optimize", "{}"), ("contig", "contig", "{}"), ("trace s", "trace s", "{:.2f}"),
    ("part s", "part s", "{:.3f}"), ("var/ideal", "var/ideal", "{:.2f}"), ("var/best", "var/best", "{:.2f}"),
    ("flop/ideal", "flop/ideal", "{:.2f}"), ("flop/best", "flop/best", "{:.2f}"),
    ("mem/ideal", "mem/ideal", "{:.2f}"), ("cut", "cut", "{}"), ("target", "target", "{}"),
]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_table(rows: List[Dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in COLUMNS:
            v = r[key]
            if key == "cut":
                v = fmt_bytes(v)
            line.append(fmt.format(v))
        cells.append(line)
    heads = [h for h, _, _ in COLUMNS]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    numeric = {"ops", "P", "trace s", "part s", "var/ideal", "var/best", "flop/ideal", "flop/best", "mem/ideal",
               "cut"}

    def fmt_line(vals: Sequence[str]) -> str:
        return "| " + " | ".join(
            v.rjust(w) if h in numeric else v.ljust(w) for v, w, h in zip(vals, widths, heads)
        ) + " |"

    out = [fmt_line(heads), "|" + "|".join(("-" * (w + 1) + ":") if h in numeric else ("-" * (w + 2))
                                          for w, h in zip(widths, heads)) + "|"]
    out += [fmt_line(c) for c in cells]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models only (for the tests)")
    parser.add_argument("--synthetic-blocks", type=int, default=None,
                        help="blocks of the synthetic graph (default: 7700, about 100k ops; 300 with --quick)")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(f"# {msg}", file=sys.stderr, flush=True)

    smp.init({"partitions": MAX_PARTITIONS})
    t0 = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    for label, make, parts in keras_cases(args.quick):
        rows += run_keras_case(label, make, parts, log)
    blocks = args.synthetic_blocks or (300 if args.quick else 7700)
    rows += run_synthetic(blocks, (8,), log)

    print(format_table(rows))
    verdicts = [t for r in rows for t in r["target"].split("; ") if t]
    failed = [f"{r['model']} P={r['P']} {r['optimize']}/{r['contig']}: {t}"
              for r in rows for t in r["target"].split("; ") if "FAIL" in t]
    print()
    print(f"{'--quick run' if args.quick else 'full run'}; {len(verdicts) - len(failed)}/{len(verdicts)} "
          f"target checks PASS; total {time.perf_counter() - t0:.0f} s")
    for f in failed:
        print(f"FAIL {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
