"""Measured timeline of the pipeline benchmark's MLP under each schedule.

Prints one table; every figure in it is measured by this invocation. For
each schedule and M, the MLP of ``bench.py`` (8 x Dense(1024), batch 256,
P=2, both processes' threads pinned to two cores, one intra-op thread) runs
its steps inside ``smp.profile``:

- step: median wall time of a training step, without probes (a function
  traced outside the profile) and with them (the cost of the probes);
- span: the measured pipeline span (first action's start to last action's
  end) and the simulator's makespan for the same schedule from the measured
  task costs (median duration of each task over all steps and micro-batches);
- bubble: the measured idle fraction of the devices inside the span, and the
  simulated one from the same costs.

Besides ``simple``, ``interleaved`` and ``zero_bubble`` it runs the two
with ``virtual_stages: 2`` (``/v2``: 4 chunks, 2 per device), and compares
each schedule's step with ``interleaved`` at the same M, measured and
simulated.

With ``--png-dir DIR`` it also writes ``DIR/timeline_<schedule>.png``, the
Gantt chart of the median step at M=8 (matplotlib needed).

Run ``python benchmarks/pipeline/timeline.py`` (``--quick`` for small sizes:
checks the script, figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import choose_cpus, versions  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The probes read TensorFlow's clock, which op determinism forbids.
os.environ.pop("TF_DETERMINISTIC_OPS", None)

P = 2
#: (row name, pipeline, virtual_stages); "/v2": 2 chunks per device.
SCHEDULES = (
    ("simple", "simple", 1), ("interleaved", "interleaved", 1), ("zero_bubble", "zero_bubble", 1),
    ("interleaved/v2", "interleaved", 2), ("zero_bubble/v2", "zero_bubble", 2),
)
MICROBATCHES = (2, 4, 8)
PNG_AT_M = 8


def sizes(quick: bool) -> dict:
    return dict(layers=8, width=256, batch=64) if quick else dict(layers=8, width=1024, batch=256)


def _median_step(train, x, y, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train(x, y).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args) -> list:
    cpus = choose_cpus(2)
    if cpus is not None:
        os.sched_setaffinity(0, set(cpus))
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": MICROBATCHES[0]})
    import keras
    import tensorflow as tf

    from benchmarks.pipeline.bench import build_mlp, smp_train_step

    tf.config.threading.set_inter_op_parallelism_threads(P)
    s = sizes(args.quick)
    x = tf.random.normal([s["batch"], s["width"]], seed=1)
    y = tf.random.normal([s["batch"], s["width"]], seed=2)
    rows = []
    for sched, pipeline, virtual in SCHEDULES:
        for M in MICROBATCHES:
            smp.init({"partitions": P, "microbatches": M, "pipeline": pipeline, "virtual_stages": virtual})
            keras.utils.set_random_seed(0)
            model = build_mlp(keras, smp.DistributedModel, s["layers"], s["width"], f"mlp_{sched.replace('/', '_')}_{M}")
            plain, body = smp_train_step(tf, keras, smp, model)
            for _ in range(args.warmup):
                plain(x, y).numpy()
            with smp.profile(None) as prof:
                probed, _ = smp_train_step(tf, keras, smp, model)
                for _ in range(args.warmup):
                    probed(x, y).numpy()
            # Alternate the two so a drift of the machine hits both.
            t_plain, t_probed = [], []
            with smp.profile(None) as prof:
                for _ in range(args.repeats):
                    t_plain.append(_median_step(plain, x, y, 1))
                    t_probed.append(_median_step(probed, x, y, 1))
            tl = prof.timeline
            spans = [tl.step_time(k) for k in range(tl.num_steps)]
            sim = tl.simulated()
            gap = tl.measured_gap()
            sim_mean = tl.simulated(gap=gap, statistic="mean")
            # The memory model's activations at the schedule's peak, summed
            # over each device's partitions: the largest device.
            report = body.memory_report()
            act: dict = {}
            for r in report:
                act[r.device] = act.get(r.device, 0) + r.activations
            rows.append({
                "schedule": sched, "M": M,
                "step_s": statistics.median(t_plain), "probed_step_s": statistics.median(t_probed),
                "span_s": statistics.median(spans), "sim_span_s": sim.makespan,
                "gap_s": gap, "sim_mean_span_s": sim_mean.makespan,
                "replay_ratio": statistics.median(tl.replayed_span(k) / tl.step_time(k) for k in range(tl.num_steps)),
                "bubble": tl.measured_bubble(), "sim_bubble": sim.bubble,
                "activations": max(act.values()),
            })
            if args.png_dir and M == PNG_AT_M:
                os.makedirs(args.png_dir, exist_ok=True)
                tl.plot(os.path.join(args.png_dir, f"timeline_{sched.replace('/', '_')}.png"))
    # Each schedule against interleaved at the same M: measured step times,
    # and the simulator's spans from each one's measured task costs.
    base = {r["M"]: r for r in rows if r["schedule"] == "interleaved"}
    for r in rows:
        b = base[r["M"]]
        r["speedup"] = b["step_s"] / r["step_s"]
        r["sim_speedup"] = b["sim_span_s"] / r["sim_span_s"]
    return rows


def table(rows: list, args) -> str:
    s = sizes(args.quick)
    lines = [
        "smp_tf measured timeline%s: MLP %d x Dense(%d), batch %d, P=%d; %d timed steps per case, medians"
        % (" (--quick: figures mean nothing)" if args.quick else "", s["layers"], s["width"], s["batch"], P,
           args.repeats),
        versions(),
        "",
        "%-15s %3s %10s %10s %7s %10s %10s %8s %7s %9s %8s %7s %9s %9s %8s %8s %8s" % (
            "schedule", "M", "step ms", "probed ms", "probes", "span ms", "sim span", "sim/meas", "gap ms",
            "mean sim", "mean/meas", "replay", "bubble", "sim bubble", "vs 1F1B", "sim vs", "act MiB"),
    ]
    for r in rows:
        lines.append(
            "%-15s %3d %10.2f %10.2f %7.3f %10.2f %10.2f %8.3f %7.3f %9.2f %8.3f %7.3f %8.1f%% %8.1f%% %8.3f %8.3f %8.2f" % (
                r["schedule"], r["M"], r["step_s"] * 1e3, r["probed_step_s"] * 1e3,
                r["probed_step_s"] / r["step_s"], r["span_s"] * 1e3, r["sim_span_s"] * 1e3,
                r["sim_span_s"] / r["span_s"], r["gap_s"] * 1e3, r["sim_mean_span_s"] * 1e3,
                r["sim_mean_span_s"] / r["span_s"], r["replay_ratio"], 100 * r["bubble"], 100 * r["sim_bubble"], r["speedup"],
                r["sim_speedup"], r["activations"] / 2**20))
    lines += [
        "",
        "step: a training step without probes; probed: the same step traced inside smp.profile (probes: their",
        "ratio). span: first action's start to last action's end, measured; sim span: the simulator's makespan",
        "for the same schedule from the measured task costs (transfers free, every action of a task the same",
        "cost: the median of its durations). gap: the median time from an action being ready (its device",
        "free, its inputs done) to its start, measured (the runtime's dispatch and transfers). mean sim: the",
        "simulator's makespan with each task's mean duration as its cost and that gap before every action",
        "that waited. replay: the span if every action had started as soon as it was ready, with its own",
        "measured duration, over the measured span (median over steps). bubble: idle fraction of the devices",
        "inside the span, measured and simulated (median costs). vs 1F1B: the",
        "interleaved step time over this one's at the same M (above 1: faster); sim vs: the same from the",
        "simulated spans. act MiB: the memory model's activations kept at the schedule's peak on the device",
        "that keeps the most (its partitions summed). /v2: virtual_stages 2 (4 chunks, 2 per device).",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (checks the script)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per case (default 15; 3 --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per case first")
    parser.add_argument("--png-dir", help="write the Gantt chart of each schedule at M=8 here")
    parser.add_argument("--json", help="write the raw rows to this file")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
