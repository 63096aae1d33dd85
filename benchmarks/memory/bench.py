"""Memory benchmark of smp_tf on logical CPU devices: predicted against measured.

Prints one table; every figure in it is measured by this invocation. A GPT-2
style language model (keras_hub ``GPT2Backbone`` with its tied embedding as
the output layer) is built once, and for partitions P in {1, 2, 4}, both
schedules (``interleaved``, ``simple``) and ``recompute`` in {never,
selective, full}, at M micro-batches, the script

* calls ``step.measure_memory(x, y)`` (one step of the pipeline with
  ``accumulate()`` on every output, as a `tf.function`): the predicted peak
  of every partition (``total``, with its ``activations``), the measured
  per-partition peaks (composed from each task's measured peak), and the
  predicted and measured process-wide peak of the one allocator that all
  logical CPU devices share;
* times the same training step (a `tf.function` that runs the step and
  ``accumulate()``s every output): median of ``--repeats`` calls after
  ``--warmup`` calls, as a ratio to ``recompute="never"`` with the same P and
  schedule;

and adds a row with ``optimize="memory"`` at P=4 interleaved (the partitioner
balances predicted memory instead of time): the largest predicted partition
peak over the mean of the partition peaks, next to ``optimize="speed"``.
The reference row is a plain `tf.function` step (forward, loss, gradients) of
the full batch on one device, with its measured process-wide peak.

Below the table a "targets" block says PASS or FAIL for each target, from
the measured figures (at P=2 and P=4, interleaved schedule):

* ``recompute="full"`` cuts the activations of the largest partition by
  >= 70% against ``"never"`` at <= 1.40x the step time;
* ``recompute="selective"`` by >= 50% at <= 1.10x;
* ``optimize="memory"``: largest / mean partition peak <= 1.10 at P=4;
* the predicted process-wide peak is within 15% of the measured one on
  every smp_tf row.

``TF_CPU_ALLOCATOR_USE_BFC=true`` is set below before TensorFlow is imported:
without it the CPU allocator counts no bytes. All configurations run in this
one process, one model, re-initialised with ``smp.init`` between them; the
first ``smp.init`` asks for the largest P so that the logical CPU devices
exist for every configuration. Before every configuration all model
variables (dropout seed states included) get their initial values back.

Run ``python benchmarks/memory/bench.py`` (``--quick`` for tiny sizes and few
repeats: a smoke test, its figures mean little; ``--help`` for the options).
See README.md beside this file.
"""

from __future__ import annotations

import os

# Before TensorFlow starts: the CPU allocator then counts bytes (peak, current).
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import aligned, choose_cpus, pin_all_threads, threads_pinned, versions  # noqa: E402

PARTITIONS = (1, 2, 4)
MAX_PARTITIONS = max(PARTITIONS)
SCHEDULES = ("interleaved", "simple")
RECOMPUTE = ("never", "selective", "full")
#: The targets are checked at these partition counts, interleaved schedule.
TARGET_PARTITIONS = (2, 4)
TARGET_SCHEDULE = "interleaved"
FULL_ACT_CUT, FULL_TIME = 0.70, 1.40
SELECTIVE_ACT_CUT, SELECTIVE_TIME = 0.50, 1.10
BALANCE_TARGET = 1.10  # optimize="memory": largest / mean partition peak
BALANCE_PARTITIONS = 4
PEAK_TOLERANCE = 0.15  # |measured - predicted| / predicted, process-wide peak
INTRA_OP_THREADS = 1
INTER_OP_THREADS = MAX_PARTITIONS

_FIELDS = ("variables", "optimizer", "gradients", "activations", "buffers", "transient", "total", "measured")


# ---------------------------------------------------------------------------
# Sizes and configurations


def sizes(quick: bool) -> dict:
    """GPT-2 LM sizes: layers, width, heads, sequence, batch, vocabulary, micro-batches."""
    if quick:
        return dict(layers=2, width=64, heads=4, seq=32, batch=8, vocab=260, microbatches=4)
    return dict(layers=8, width=256, heads=4, seq=256, batch=16, vocab=260, microbatches=8)


def configs() -> list:
    """The smp_tf configurations, in the order they run."""
    out = []
    for p in PARTITIONS:
        for sched in SCHEDULES:
            for rc in RECOMPUTE:
                out.append(dict(partitions=p, pipeline=sched, recompute=rc, optimize="speed"))
    out.append(dict(partitions=BALANCE_PARTITIONS, pipeline="interleaved", recompute="never", optimize="memory"))
    return out


def config_name(c: dict) -> str:
    name = f"P={c['partitions']} {c['pipeline']} {c['recompute']}"
    return name + (f" optimize={c['optimize']}" if c["optimize"] != "speed" else "")


def reference_key(c: dict) -> tuple:
    """The row a configuration's ratios refer to: recompute never, optimize
    speed, same P and schedule."""
    return (c["partitions"], c["pipeline"], "never", "speed")


def key(c: dict) -> tuple:
    return (c["partitions"], c["pipeline"], c["recompute"], c["optimize"])


# ---------------------------------------------------------------------------
# CPU pinning (Linux): all threads of the process on min(P, available) CPUs


class Pinning:
    def __init__(self, enabled: bool) -> None:
        self.requested = enabled
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
        # Chosen once, before any pinning narrows the process's affinity:
        # distinct physical cores first, then SMT siblings.
        self.order = choose_cpus(len(allowed)) if enabled and allowed else None
        self.enabled = bool(self.order)
        self.used = {}

    def cpus(self, n: int):
        if not self.enabled:
            return None
        return self.order[:max(1, min(n, len(self.order)))]

    def set(self, n: int) -> None:
        cpus = self.cpus(n)
        if cpus is not None:
            pin_all_threads(cpus)
            self.used[n] = cpus

    def check(self, n: int) -> bool:
        cpus = self.cpus(n)
        return True if cpus is None else threads_pinned(cpus)

    def describe(self) -> str:
        if not self.enabled:
            return "threads not pinned" + (" (--no-pin)" if not self.requested else " (no sched_setaffinity)")
        parts = [f"{n} device(s) -> CPU(s) {','.join(map(str, c))}" for n, c in sorted(self.used.items())]
        return "all threads pinned per configuration, min(devices, CPUs available) CPUs: " + "; ".join(parts)


# ---------------------------------------------------------------------------
# The model (TensorFlow is imported after the first smp.init)


def build(smp, tf, keras, s: dict):
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    L, D, S, V = s["layers"], s["width"], s["seq"], s["vocab"]
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=V, num_layers=L, num_heads=s["heads"], hidden_dim=D, intermediate_dim=4 * D,
        max_sequence_length=S, dropout=0.1,
    )
    tok = keras.Input((S,), dtype="int32", name="token_ids")
    pad = keras.Input((S,), dtype="int32", name="padding_mask")
    h = backbone({"token_ids": tok, "padding_mask": pad})
    logits = backbone.token_embedding(h, reverse=True)
    model = smp.DistributedModel({"token_ids": tok, "padding_mask": pad}, logits)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    # The step applies no optimizer: tell it so (plain SGD keeps no state),
    # or the partitioner and the reports would count Adam's two slots.
    step.optimizer = keras.optimizers.SGD()

    rng = np.random.default_rng(0)
    B = s["batch"]
    tokens = rng.integers(0, V, (B, S + 1))
    x = {"token_ids": tf.constant(tokens[:, :-1], tf.int32), "padding_mask": tf.ones((B, S), tf.int32)}
    y = tf.constant(tokens[:, 1:], tf.int32)
    return model, loss_fn, step, x, y


def snapshot(model) -> list:
    """Initial values of every model variable, as numpy copies (outside the
    TensorFlow allocator, so they do not count in its peak)."""
    import numpy as np

    return [np.array(v.numpy(), copy=True) for v in model.variables]


def restore(model, values: list) -> None:
    for v, value in zip(model.variables, values):
        v.assign(value)


def memory_info(tf) -> dict:
    return tf.config.experimental.get_memory_info("CPU:0")


def timed_step(tf, step):
    """The measured training step: the pipeline, ``accumulate()`` on every
    output (what ``measure_memory`` runs). Returns the batch loss first."""
    from smp_tf.step_output import StepOutput

    @tf.function(autograph=False)
    def run(x, y):
        outs = step(x, y)
        return [o.accumulate() if isinstance(o, StepOutput) else o for o in tf.nest.flatten(outs)]

    return run


def time_calls(fn, pin: Pinning, ncpus: int, warmup: int, repeats: int):
    """Median wall time of `repeats` calls after `warmup` calls; the first loss."""
    losses, walls = [], []
    for i in range(warmup + repeats):
        pin.set(ncpus)
        t0 = time.perf_counter()
        out = fn()
        loss = float(out[0].numpy())
        t1 = time.perf_counter()
        losses.append(loss)
        if i >= warmup:
            walls.append(t1 - t0)
        del out
    return walls, losses[0]


def run_reference(tf, model, loss_fn, x, y, pin: Pinning, args) -> dict:
    """A plain `tf.function` step of the full batch on /device:CPU:0."""

    @tf.function(autograph=False)
    def plain(x, y):
        with tf.device("/device:CPU:0"):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
        return [loss] + list(grads)

    pin.set(1)
    plain(x, y)  # trace and first run
    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    out = plain(x, y)
    peak = memory_info(tf)["peak"]
    del out
    walls, loss = time_calls(lambda: plain(x, y), pin, 1, args.warmup, args.repeats)
    del plain
    gc.collect()
    return dict(measured_process_peak=peak, walls=walls, time=statistics.median(walls), loss=loss,
                held=memory_info(tf)["current"], pinned=pin.check(1))


def run_config(smp, tf, model, step, x, y, init_values, c: dict, s: dict, pin: Pinning, args) -> dict:
    smp.init({"partitions": c["partitions"], "microbatches": s["microbatches"], "pipeline": c["pipeline"],
              "recompute": c["recompute"], "optimize": c["optimize"], "memory_budget": None})
    restore(model, init_values)
    gc.collect()
    pin.set(c["partitions"])
    t0 = time.perf_counter()
    report = step.measure_memory(x, y)
    measure_s = time.perf_counter() - t0
    gc.collect()
    held = memory_info(tf)["current"]
    run = timed_step(tf, step)
    walls, loss = time_calls(lambda: run(x, y), pin, c["partitions"], args.warmup, args.repeats)
    pinned = pin.check(c["partitions"])
    del run
    gc.collect()
    parts = [{f: getattr(r, f) for f in _FIELDS} | {"device": r.device, "recompute": r.recompute}
             for r in report.partitions]
    return dict(
        config=c, parts=parts, process_peak=report.process_peak,
        measured_process_peak=report.measured_process_peak, method=report.method, schedule=report.schedule,
        table=str(report), walls=walls, time=statistics.median(walls), loss=loss, held=held,
        measure_s=measure_s, pinned=pinned,
        plan=step.last_plan.report() if getattr(step, "last_plan", None) is not None else None,
    )


# ---------------------------------------------------------------------------
# Table


def derived(r: dict) -> dict:
    """Figures of one result: the largest predicted partition, its
    activations, largest / mean, measured / predicted process peak."""
    parts = r["parts"]
    totals = [p["total"] for p in parts]
    big = max(range(len(parts)), key=lambda i: totals[i])
    mp, pp = r.get("measured_process_peak"), r["process_peak"]
    return dict(
        big=big, total=totals[big], act=parts[big]["activations"],
        balance=max(totals) / (sum(totals) / len(totals)),
        ratio=(mp / pp) if (mp is not None and pp) else None,
    )


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def build_table(results: list, reference: dict, args, s: dict, seconds: float, pin: Pinning) -> str:
    from smp_tf.memory import format_bytes

    cols = ["config", "loss", "peak part", "pred total", "pred act", "act vs never", "measured/part MiB",
            "max/mean", "proc pred", "proc meas", "meas/pred", "±15%", "held", "ms/step", "vs never"]
    by_key = {key(r["config"]): r for r in results if "error" not in r}
    rows, notes = [], []
    prev_group = None
    for r in results:
        c = r["config"]
        group = (c["partitions"], c["optimize"])
        if prev_group is not None and group != prev_group:
            rows.append(None)  # blank separator line
        prev_group = group
        if "error" in r:
            rows.append([config_name(c), "FAILED"] + [""] * (len(cols) - 2))
            notes.append(f"FAILED: {config_name(c)} (smp.init {json.dumps(r['smp_config'])}):\n{r['error']}")
            continue
        d = derived(r)
        ref = by_key.get(reference_key(c))
        act_cut = time_ratio = ""
        if ref is not None and ref is not r:
            dr = derived(ref)
            act_cut = f"{d['act'] / dr['act'] - 1:+.0%}" if dr["act"] else "n/a"
            time_ratio = f"{r['time'] / ref['time']:.2f}x"
        elif ref is r:
            act_cut, time_ratio = "-", "1.00x"
        measured = "/".join(_mib(p["measured"]) for p in r["parts"])
        within = "" if d["ratio"] is None else ("ok" if abs(d["ratio"] - 1) <= PEAK_TOLERANCE else "out")
        rows.append([
            config_name(c), f"{r['loss']:.4f}", str(d["big"]), format_bytes(d["total"]), format_bytes(d["act"]),
            act_cut, measured, f"{d['balance']:.2f}", format_bytes(r["process_peak"]),
            "-" if r["measured_process_peak"] is None else format_bytes(r["measured_process_peak"]),
            "-" if d["ratio"] is None else f"{d['ratio']:.2f}", within, format_bytes(r["held"]),
            f"{1e3 * r['time']:.1f}", time_ratio,
        ])
    if reference is not None:
        rows.append(None)
        if "error" in reference:
            rows.append(["(ref) one device, plain tf.function", "FAILED"] + [""] * (len(cols) - 2))
            notes.append(f"FAILED: reference step:\n{reference['error']}")
        else:
            rows.append(["(ref) one device, plain tf.function", f"{reference['loss']:.4f}", "-", "-", "-", "-", "-",
                         "-", "-", format_bytes(reference["measured_process_peak"]), "-", "",
                         format_bytes(reference["held"]), f"{1e3 * reference['time']:.1f}", ""])

    table = aligned(cols, rows, left={0, 6, 11})

    mode = "quick" if args.quick else "full"
    variables = next((sum(p["variables"] for p in r["parts"]) for r in results if "error" not in r), None)
    method = next((r["method"] for r in results if "error" not in r and r.get("method")), "")
    head = [
        f"smp_tf memory benchmark ({mode}): GPT-2 LM (keras_hub GPT2Backbone, tied output embedding), "
        f"{s['layers']} layers, width {s['width']}, {s['heads']} heads, sequence {s['seq']}, vocabulary "
        f"{s['vocab']}, batch {s['batch']}, M={s['microbatches']} micro-batches, dropout 0.1, no optimizer state"
        + ("" if variables is None else f"; variables {format_bytes(variables)}"),
        f"python {platform.python_version()}, {versions()}, {os.cpu_count()} CPUs visible; "
        f"{args.repeats} timed steps after {args.warmup} warm-up per row (median); "
        f"intra-op/inter-op threads {INTRA_OP_THREADS}/{INTER_OP_THREADS}; run took {seconds:.0f} s",
        "",
        *table[:2],
    ]
    legend = [
        "",
        "peak part: the partition with the largest predicted peak; pred total / pred act: its predicted peak and "
        "its activations at that peak; act vs never: change of that figure against recompute=never (same P and "
        "schedule); measured/part: each partition's peak composed from its tasks' measured peaks (each task run "
        "alone, its ops one at a time); max/mean: largest over mean predicted partition peak; proc pred / proc meas: predicted and "
        "measured peak of the one allocator all logical CPU devices share (the whole process); ±15%: "
        "|meas/pred - 1| <= 0.15; held: allocator bytes in use between steps; vs never: step time against "
        "recompute=never, same P and schedule.",
        f"measured: {method}" if method else "measured: -",
        "pinning: " + pin.describe() + ("" if all(r.get("pinned", True) for r in results + [reference or {}])
                                        else " (NOT all threads stayed pinned)"),
    ]
    targets = build_targets(results, by_key, s)
    return "\n".join(head + table[2:] + legend + notes + [""] + targets)


def build_targets(results: list, by_key: dict, s: dict) -> list:
    """The targets block: one PASS/FAIL line per target, computed from the results."""
    lines = [f"targets (recompute and optimize targets at P={' and P='.join(map(str, TARGET_PARTITIONS))}, "
             f"{TARGET_SCHEDULE} schedule, M={s['microbatches']}):"]
    verdicts = []

    def add(ok: bool, text: str) -> None:
        verdicts.append(ok)
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {text}")

    for mode, cut_target, time_target in (("full", FULL_ACT_CUT, FULL_TIME),
                                          ("selective", SELECTIVE_ACT_CUT, SELECTIVE_TIME)):
        for p in TARGET_PARTITIONS:
            what = (f"recompute={mode} at P={p} {TARGET_SCHEDULE}: activations of the largest partition cut by "
                    f">= {cut_target:.0%} vs never at <= {time_target:.2f}x step time")
            r = by_key.get((p, TARGET_SCHEDULE, mode, "speed"))
            ref = by_key.get((p, TARGET_SCHEDULE, "never", "speed"))
            if r is None or ref is None:
                add(False, f"{what}: not measured (a row failed)")
                continue
            act, act0 = derived(r)["act"], derived(ref)["act"]
            cut = 1 - act / act0 if act0 else 0.0
            ratio = r["time"] / ref["time"]
            add(cut >= cut_target and ratio <= time_target,
                f"{what}: cut {cut:.0%} ({act0} -> {act} bytes), step time {ratio:.2f}x")

    what = (f"optimize=memory at P={BALANCE_PARTITIONS} interleaved M={s['microbatches']}: largest / mean partition "
            f"peak <= {BALANCE_TARGET:.2f}")
    mem = by_key.get((BALANCE_PARTITIONS, "interleaved", "never", "memory"))
    speed = by_key.get((BALANCE_PARTITIONS, "interleaved", "never", "speed"))
    if mem is None:
        add(False, f"{what}: not measured (the row failed)")
    else:
        b = derived(mem)["balance"]
        beside = "not measured" if speed is None else f"{derived(speed)['balance']:.3f}"
        add(b <= BALANCE_TARGET, f"{what}: {b:.3f} (optimize=speed: {beside})")

    what = f"predicted process-wide peak within {PEAK_TOLERANCE:.0%} of the measured one on every smp_tf row"
    ok_rows = [r for r in results if "error" not in r]
    ratios = [(config_name(r["config"]), derived(r)["ratio"]) for r in ok_rows]
    missing = [n for n, x in ratios if x is None]
    failed = [config_name(r["config"]) for r in results if "error" in r]
    if not ok_rows or missing or failed:
        why = []
        if failed:
            why.append(f"{len(failed)} row(s) failed")
        if missing:
            why.append(f"{len(missing)} row(s) without a measured peak")
        add(False, f"{what}: not measured everywhere ({', '.join(why) or 'no rows'})")
    else:
        out = [(n, x) for n, x in ratios if abs(x - 1) > PEAK_TOLERANCE]
        worst = max(ratios, key=lambda nx: abs(nx[1] - 1))
        add(not out, f"{what}: {len(ratios) - len(out)} of {len(ratios)} rows within; measured / predicted "
                     f"{min(x for _, x in ratios):.2f} to {max(x for _, x in ratios):.2f}, worst {worst[0]} "
                     f"({worst[1]:.2f})")
    lines.append(f"overall: {'PASS' if all(verdicts) else 'FAIL'} ({sum(verdicts)} of {len(verdicts)} targets met)")
    return lines


# ---------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny model (L=2, D=64, S=32, B=8, M=4) and few repeats (smoke test; figures mean little)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per row (default 7; --quick 3)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps per row before timing (default 2; --quick 1)")
    ap.add_argument("--no-pin", action="store_true", help="do not restrict the threads to min(P, available) CPUs")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results (every timed step) to FILE")
    ap.add_argument("--reports", action="store_true", help="also print every configuration's memory report table")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    s = sizes(args.quick)
    pin = Pinning(not args.no_pin)
    t_start = time.perf_counter()

    import smp_tf as smp

    # The largest P first: the logical CPU devices are created once, by the
    # first smp.init (a later smp.init with fewer partitions reuses them).
    smp.init({"partitions": MAX_PARTITIONS, "microbatches": s["microbatches"]})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    tf.get_logger().setLevel("ERROR")
    import keras

    from smp_tf.profiling.memory import cpu_allocator_counts_bytes

    if not cpu_allocator_counts_bytes():
        print("[bench] WARNING: the CPU allocator counts no bytes (TF_CPU_ALLOCATOR_USE_BFC was not honoured): "
              "nothing is measured", file=sys.stderr)
    model, loss_fn, step, x, y = build(smp, tf, keras, s)
    init_values = snapshot(model)

    print("[bench] reference: one device, plain tf.function ...", file=sys.stderr, flush=True)
    try:
        reference = run_reference(tf, model, loss_fn, x, y, pin, args)
    except Exception:  # noqa: BLE001 - reported in the table
        reference = {"error": traceback.format_exc()}
    restore(model, init_values)

    results = []
    for c in configs():
        name = config_name(c)
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            r = run_config(smp, tf, model, step, x, y, init_values, c, s, pin, args)
        except Exception:  # noqa: BLE001 - one failed row does not stop the table
            r = {"config": c, "error": traceback.format_exc(),
                 "smp_config": {"partitions": c["partitions"], "microbatches": s["microbatches"],
                                "pipeline": c["pipeline"], "recompute": c["recompute"], "optimize": c["optimize"]}}
            print(f"[bench]   FAILED:\n{r['error']}", file=sys.stderr, flush=True)
        gc.collect()
        print(f"[bench]   done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        results.append(r)
    seconds = time.perf_counter() - t_start

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": s, "reference": reference, "results": results}, f, indent=1, default=str)
    if args.reports:
        for r in results:
            if "error" not in r:
                print(f"== {config_name(r['config'])}\n{r['table']}\n")
    print(build_table(results, reference, args, s, seconds, pin))
    failed = "error" in reference or any("error" in r for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
