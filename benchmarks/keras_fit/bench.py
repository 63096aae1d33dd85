"""Keras ``fit`` benchmark of smp_tf: samples per second against plain Keras.

Prints one table; every figure in it is measured by this invocation:

(a) plain Keras: a `keras.Model` MLP trained with ``fit`` on one device (one
    core, one intra-op thread): the reference;
(b) the same model as an `smp.DistributedModel`, ``fit`` with
    ``partitions=1`` and ``microbatches`` 1, 4 and 8 on one core: what
    smp_tf's pipelined ``train_step`` costs when it does not pipeline
    (target for M=1: time per sample <= 1.05x plain Keras);
(c) ``partitions=2`` (one core per logical device, two cores), micro-batches
    4 and 8, schedules ``simple`` and ``interleaved``: samples/s, speedup
    over (a) and over (b) with the same micro-batches, the bound of the
    schedule P*M/(M+P-1) and the bubble of smp_tf's own schedule simulation.

Each figure is the median samples/s over the epochs of a ``fit`` after its
first epoch (tracing, partitioning, graph optimisation), pooled over
``--rounds`` round-robin runs of all cases. `smp.init` must be
the first TensorFlow call of a process and TensorFlow's devices and thread
pools cannot change afterwards, so every configuration runs in a fresh
subprocess of this script (``--case JSON``), pinned before TensorFlow starts
with ``os.sched_setaffinity`` to one CPU (one-device cases) or two CPUs on
different physical cores (P=2), with one intra-op and two inter-op threads.
The subprocess prints one JSON line that the driver parses.

Run ``python benchmarks/keras_fit/bench.py`` (a few minutes), ``--quick`` for
a smoke test with tiny sizes (figures mean nothing), ``--help`` for the
options; see README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import aligned, choose_cpus, pin_all_threads, threads_pinned, versions  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_MARK = "@@SMP_KERAS_FIT_RESULT@@"
INTRA_OP_THREADS = 1
INTER_OP_THREADS = 2
OVERHEAD_TARGET = 1.05  # time per sample, smp P=1 M=1 / plain Keras
# Below this fraction of the time busy (process CPU time / wall time), a
# one-core case shared its core with another load.
BUSY_MIN = 0.95
P = 2
ONE_DEVICE_MICROBATCHES = (1, 4, 8)
PIPELINE_MICROBATCHES = (4, 8)
SCHEDULES = ("simple", "interleaved")


# ---------------------------------------------------------------------------
# Sizes and cases


def sizes(quick: bool) -> dict:
    """Problem sizes: `batches` per epoch, `epochs` timed after the first."""
    if quick:
        return dict(layers=4, width=64, batch=32, batches=2, epochs=1)
    return dict(layers=8, width=1024, batch=256, batches=5, epochs=3)


def cases(quick: bool = False) -> list:
    """The configurations, in the order they run (one subprocess each).

    --quick leaves out M=8 (the same code paths as M=4), to stay within a
    minute: most of a quick case is starting TensorFlow.
    """
    one_device = ONE_DEVICE_MICROBATCHES[:2] if quick else ONE_DEVICE_MICROBATCHES
    pipelined = PIPELINE_MICROBATCHES[:1] if quick else PIPELINE_MICROBATCHES
    out = [dict(name="keras", kind="keras", partitions=1, microbatches=1, schedule="", cpus=1)]
    for m in one_device:
        out.append(dict(name=f"smp_p1_m{m}", kind="smp", partitions=1, microbatches=m,
                        schedule="interleaved", cpus=1))
    for m in pipelined:
        for sched in SCHEDULES:
            out.append(dict(name=f"smp_p{P}_m{m}_{sched}", kind="smp", partitions=P, microbatches=m,
                            schedule=sched, cpus=P))
    return out


# ---------------------------------------------------------------------------
# One configuration (runs in a subprocess; TensorFlow is imported here only)


def mlp_class(keras, base):
    """An MLP of `layers` Dense(width) (relu, the last linear) on `base`.

    ``train_step`` records the static batch dimension the step was traced
    with (None: only known at run time), then runs the class's own step.
    """

    class MLP(base):
        def __init__(self, layers: int, width: int, **kwargs):
            super().__init__(**kwargs)
            self.dense = [keras.layers.Dense(width, activation="relu" if i < layers - 1 else None, name=f"dense{i}")
                          for i in range(layers)]
            self.traced_batch_dims = []

        def call(self, x):
            for layer in self.dense:
                x = layer(x)
            return x

        def train_step(self, data):
            self.traced_batch_dims.append(data[0].shape[0])
            return super().train_step(data)

    return MLP


def run_case(spec: dict, quick: bool, pin: bool) -> dict:
    # CPU pinning (Linux): the main thread is restricted before TensorFlow
    # starts, so every thread TensorFlow (and tf.data) creates inherits the
    # mask; every thread is checked again after the run.
    cpus = choose_cpus(spec["cpus"]) if pin else None
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before TensorFlow creates any thread
    import numpy as np

    smp = None
    if spec["kind"] == "smp":
        import smp_tf as smp

        smp.init({"partitions": spec["partitions"], "microbatches": spec["microbatches"],
                  "pipeline": spec["schedule"]})
    import tensorflow as tf

    # smp.init sets one intra-op thread for P > 1 only: the same settings
    # for every case, before any op runs (this raises otherwise).
    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    tf.get_logger().setLevel("ERROR")
    import keras

    keras.utils.set_random_seed(0)
    s = sizes(quick)
    L, W, B = s["layers"], s["width"], s["batch"]
    n = B * s["batches"]  # a multiple of the batch: no partial last batch
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, W), dtype=np.float32)
    y = rng.standard_normal((n, W), dtype=np.float32)

    model = mlp_class(keras, smp.DistributedModel if smp else keras.Model)(L, W, name="mlp")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-4), loss="mse", jit_compile=False)

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_epoch_begin(self, epoch, logs=None):
            if cpus is not None:
                pin_all_threads(cpus)  # no thread escapes the mask
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)

    timer = EpochTimer()
    t0 = time.perf_counter()
    if spec.get("input", "dataset") == "numpy":
        # Keras's own array path: it builds a tf.data pipeline with
        # autotuned prefetching, which on one pinned core leaves the core
        # idle for a large part of each epoch (see README).
        data = dict(x=x, y=y, batch_size=B)
    else:
        # Pre-batched, with tf.data's autotuning off: the timing is the
        # train step's, not the input pipeline's idling.
        options = tf.data.Options()
        options.autotune.enabled = False
        # drop_remainder gives the batch a static size, as Keras's array
        # path does here (n is a multiple of B: no row is dropped).
        data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
                    .with_options(options))
    hist = model.fit(**data, epochs=1 + s["epochs"], shuffle=False, verbose=0, callbacks=[timer])
    fit_s = time.perf_counter() - t0

    wall, cpu = timer.wall[1:], timer.cpu[1:]
    out = {
        "spec": spec,
        "samples_per_epoch": n,
        "epoch_wall": wall,
        "epoch_cpu": cpu,
        "samples_per_s": n / statistics.median(wall),
        "busy": statistics.median(c / w for c, w in zip(cpu, wall)),
        "first_epoch_s": timer.wall[0],
        "fit_s": fit_s,
        "loss": [float(v) for v in hist.history["loss"]],
        "traced_batch_dims": model.traced_batch_dims,
        "cpus": cpus,
        "pinned": None if cpus is None else threads_pinned(cpus),
        "threads": [tf.config.threading.get_intra_op_parallelism_threads(),
                    tf.config.threading.get_inter_op_parallelism_threads()],
        "sizes": {"layers": L, "width": W, "batch": B, "batches": s["batches"], "epochs": s["epochs"]},
    }
    if smp is not None:
        step = model._pipelined_steps().train
        out["sim_bubble"] = step.schedule.simulate().bubble if step.schedule is not None else None
        out["plan"] = step.last_plan.report() if step.last_plan is not None else None
    return out


# ---------------------------------------------------------------------------
# Driver and table


def launch(spec: dict, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(spec)]
    if args.quick:
        cmd.append("--quick")
    if args.no_pin:
        cmd.append("--no-pin")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seconds = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            out = json.loads(line[len(_MARK):])
            out["seconds"] = seconds
            return out
    tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
    return {"spec": spec, "error": f"exit code {proc.returncode}\n{tail}", "seconds": seconds}


def merge_rounds(runs: list) -> dict:
    """One case's per-round results as one: the timed epochs of all rounds
    pooled (samples/s from their median), the first epoch's median."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    out = dict(runs[0])
    n = out["samples_per_epoch"]
    wall = [w for r in runs for w in r["epoch_wall"]]
    cpu = [c for r in runs for c in r["epoch_cpu"]]
    out.update(
        epoch_wall=wall,
        epoch_cpu=cpu,
        samples_per_s=n / statistics.median(wall),
        cpu_s_per_sample=statistics.median(cpu) / n,
        busy=statistics.median(c / w for c, w in zip(cpu, wall)),
        first_epoch_s=statistics.median(r["first_epoch_s"] for r in runs),
        round_samples_per_s=[r["samples_per_s"] for r in runs],
        traced_batch_dims=[d for r in runs for d in r["traced_batch_dims"]],
        pinned=None if out["pinned"] is None else all(r["pinned"] for r in runs),
        seconds=sum(r["seconds"] for r in runs),
    )
    return out


def _f(x, fmt="{:.3f}"):
    return "" if x is None else fmt.format(x)


def build_table(results: list, args, seconds: float) -> str:
    cols = ["case", "partitions", "microbatches", "schedule", "cores", "samples/s", "ms/batch", "cpu ms/batch", "busy",
            "time/keras", "vs keras", "vs P=1 same M", "bound", "sim bound", "eff", "1st epoch", "target", "result"]
    by = {r["spec"]["name"]: r for r in results}
    ok = {k: r for k, r in by.items() if "error" not in r}
    ref = ok.get("keras")
    rows, notes, verdict = [], [], None
    labels = {"keras": "(a) plain Keras fit"}
    for r in results:
        spec = r["spec"]
        name = spec["name"]
        label = labels.get(name) or ("(b) smp fit, one device" if spec["partitions"] == 1 else "(c) smp fit, pipeline")
        if "error" in r:
            notes.append(f"{name} FAILED:\n{r['error']}")
            rows.append([label, str(spec["partitions"]), str(spec["microbatches"]), spec["schedule"], str(spec["cpus"]),
                         "error"] + [""] * (len(cols) - 6))
            continue
        sps = r["samples_per_s"]
        batch = r["sizes"]["batch"]
        time_ratio = ref["samples_per_s"] / sps if ref else None
        speedup = sps / ref["samples_per_s"] if ref else None
        vs_same_m = bound = sim_bound = eff = None
        if spec["partitions"] > 1:
            one = ok.get(f"smp_p1_m{spec['microbatches']}")
            M, Pn = spec["microbatches"], spec["partitions"]
            bound = Pn * M / (M + Pn - 1)
            if r.get("sim_bubble") is not None:
                sim_bound = Pn * (1 - r["sim_bubble"])
            if one:
                vs_same_m = sps / one["samples_per_s"]
                eff = vs_same_m / bound
        target = result = ""
        if spec["kind"] == "smp" and spec["partitions"] == 1 and spec["microbatches"] == 1:
            target = f"time <= {OVERHEAD_TARGET}x"
            if time_ratio is not None:
                result = verdict = "PASS" if time_ratio <= OVERHEAD_TARGET else "FAIL"
        rows.append([label, str(spec["partitions"]), str(spec["microbatches"]), spec["schedule"] or "-",
                     str(spec["cpus"]), f"{sps:.1f}", f"{1e3 * batch / sps:.1f}",
                     f"{1e3 * batch * r['cpu_s_per_sample']:.1f}", _f(r["busy"], "{:.2f}"),
                     _f(time_ratio), _f(speedup), _f(vs_same_m), _f(bound), _f(sim_bound), _f(eff),
                     f"{r['first_epoch_s']:.2f} s", target, result])

    table = aligned(cols, rows, left={0, 3, len(cols) - 2, len(cols) - 1})

    any_ok = next(iter(ok.values()), None)
    s = any_ok["sizes"] if any_ok else sizes(args.quick)
    mode = "quick" if args.quick else "full"
    head = [
        f"smp_tf Keras fit benchmark ({mode}): MLP {s['layers']}x Dense({s['width']}) on {s['width']} features, "
        f"batch {s['batch']}, {s['batches']} batches per epoch, SGD, MSE; "
        f"samples/s = median over {args.rounds} x {s['epochs']} epochs ({args.rounds} fit(s) per case, "
        "each fit's first epoch excluded)",
        "input: " + ("numpy arrays with batch_size (Keras's input pipeline, autotuned prefetching)"
                     if args.input == "numpy" else "pre-batched tf.data.Dataset, tf.data autotuning off"),
        f"python {platform.python_version()}, {versions()}, {os.cpu_count()} CPUs visible; "
        f"run took {seconds:.0f} s",
        "",
        *table[:2],
    ]
    if any_ok:
        dims = {str(d) for r in ok.values() for d in r["traced_batch_dims"]}
        threads = {tuple(r["threads"]) for r in ok.values()}
        pins = sorted({(r["spec"]["cpus"], str(r["cpus"]), r["pinned"]) for r in ok.values()})
        notes.append(f"batch dimension seen by train_step at tracing: {', '.join(sorted(dims))} "
                     + ("(static: no tf.cond between the M- and the 1-micro-batch pipeline)" if "None" not in dims
                        else "(None: known at run time only, train_step holds a tf.cond between the M- and the "
                             "1-micro-batch pipeline)"))
        if ref:
            # The same data, seed and model: every case should train alike
            # (M=1 exactly, M>1 up to the order of the float sums).
            last = ref["loss"][-1]
            diff = max(abs(r["loss"][-1] - last) / abs(last) for r in ok.values())
            notes.append(f"loss after the last epoch: plain Keras {last:.6g}; largest relative difference of a case "
                         f"to it {diff:.1e}")
        notes.append("intra-op/inter-op threads: " + ", ".join(f"{a}/{b}" for a, b in sorted(threads)))
        notes.append("pinning: " + "; ".join(
            f"{n}-core cases on CPUs {c}" + ("" if p else " (NOT all threads pinned)") if c != "None"
            else f"{n}-core cases not pinned" for n, c, p in pins))
        plan = next((r.get("plan") for r in ok.values() if r["spec"]["partitions"] > 1 and r.get("plan")), None)
        if plan:
            notes.append("partition of the MLP (P=2):\n  " + plan.replace("\n", "\n  "))
    # On a shared machine another process takes time from the pinned core:
    # a one-core case then keeps its core busy well under 100% of the time.
    stolen = [k for k, r in ok.items() if r["spec"]["cpus"] == 1 and r["busy"] < BUSY_MIN]
    if stolen and not args.no_pin and not args.quick:
        notes.append(f"WARNING: one-core case(s) {', '.join(stolen)} kept the core busy less than {BUSY_MIN:.0%} of "
                     "the time (busy): another load shared the core or the input pipeline left it idle (--input "
                     "numpy does on one core), their samples/s are too low and so is every "
                     "ratio against them. Run again on a quiet machine.")
    if verdict is None:
        notes.append("P=1 overhead target: NOT MEASURED")
    else:
        r = by["smp_p1_m1"]
        notes.append(f"P=1 overhead target (smp fit P=1 M=1 time per sample <= {OVERHEAD_TARGET}x plain Keras): "
                     f"{verdict} ({ref['samples_per_s'] / r['samples_per_s']:.3f}x; process CPU time per sample "
                     f"{r['cpu_s_per_sample'] / ref['cpu_s_per_sample']:.3f}x; samples/s per round: plain Keras "
                     f"{', '.join(f'{v:.1f}' for v in ref['round_samples_per_s'])}, smp "
                     f"{', '.join(f'{v:.1f}' for v in r['round_samples_per_s'])})")
    return "\n".join(head + table[2:] + [""] + notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 timed epochs (smoke test; figures mean nothing)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run every case this many times, round-robin, pooling the epochs (default 2; --quick 1)")
    ap.add_argument("--input", choices=("dataset", "numpy"), default="dataset",
                    help="feed fit a pre-batched tf.data.Dataset with autotuning off (default) or numpy arrays "
                         "with batch_size (Keras's own input pipeline)")
    ap.add_argument("--no-pin", action="store_true", help="do not restrict the subprocesses to one/two CPUs")
    ap.add_argument("--only", metavar="NAME", action="append",
                    help="run only this case (repeatable; names: " + ", ".join(c["name"] for c in cases()) + ")")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results (every epoch) to FILE")
    ap.add_argument("--case", metavar="JSON", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    if args.case:
        result = run_case(json.loads(args.case), args.quick, not args.no_pin)
        sys.stdout.write(_MARK + json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0

    todo = cases(args.quick)
    if args.only:
        unknown = set(args.only) - {c["name"] for c in cases()}
        if unknown:
            ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
        todo = [c for c in cases() if c["name"] in args.only]
    if not args.no_pin and choose_cpus(max(c["cpus"] for c in todo)) is None:
        print("[bench] cannot pin (no sched_setaffinity or too few CPUs); running unpinned", file=sys.stderr)
        args.no_pin = True
    for spec in todo:
        spec["input"] = args.input
    t0 = time.perf_counter()
    runs = {spec["name"]: [] for spec in todo}
    for rnd in range(args.rounds):  # round-robin: a drift of the machine hits every case alike
        for spec in todo:
            print(f"[bench] round {rnd + 1}/{args.rounds}: {spec['name']} ...", file=sys.stderr, flush=True)
            runs[spec["name"]].append(launch(spec, args))
            print(f"[bench]   done in {runs[spec['name']][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    results = [merge_rounds(runs[spec["name"]]) for spec in todo]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": runs, "merged": results}, f, indent=1)
    print(build_table(results, args, seconds))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
