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

Each figure is the median samples/s over the epochs of one ``fit`` after its
first epoch (tracing, partitioning, graph optimisation). `smp.init` must be
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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_MARK = "@@SMP_KERAS_FIT_RESULT@@"
INTRA_OP_THREADS = 1
INTER_OP_THREADS = 2
OVERHEAD_TARGET = 1.05  # time per sample, smp P=1 M=1 / plain Keras
P = 2
ONE_DEVICE_MICROBATCHES = (1, 4, 8)
PIPELINE_MICROBATCHES = (4, 8)
SCHEDULES = ("simple", "interleaved")


# ---------------------------------------------------------------------------
# Sizes and cases


def sizes(quick: bool) -> dict:
    """Problem sizes: `batches` per epoch, `epochs` timed after the first."""
    if quick:
        return dict(layers=4, width=128, batch=64, batches=4, epochs=2)
    return dict(layers=8, width=1024, batch=256, batches=8, epochs=5)


def cases() -> list:
    """The configurations, in the order they run (one subprocess each)."""
    out = [dict(name="keras", kind="keras", partitions=1, microbatches=1, schedule="", cpus=1)]
    for m in ONE_DEVICE_MICROBATCHES:
        out.append(dict(name=f"smp_p1_m{m}", kind="smp", partitions=1, microbatches=m,
                        schedule="interleaved", cpus=1))
    for m in PIPELINE_MICROBATCHES:
        for sched in SCHEDULES:
            out.append(dict(name=f"smp_p{P}_m{m}_{sched}", kind="smp", partitions=P, microbatches=m,
                            schedule=sched, cpus=P))
    return out


# ---------------------------------------------------------------------------
# CPU pinning (Linux): the subprocess restricts its main thread before
# TensorFlow starts, so every thread TensorFlow (and tf.data) creates inherits
# the mask; every thread is checked again after the run.


def _physical_core(cpu: int):
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            pkg = f.read().strip()
        with open(base + "core_id") as f:
            core = f.read().strip()
        return (pkg, core)
    except OSError:
        return ("?", str(cpu))


def choose_cpus(n: int):
    """`n` CPUs this process may use, on distinct physical cores when possible."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen, cores = [], set()
    for cpu in allowed:  # one CPU per physical core first
        core = _physical_core(cpu)
        if core not in cores:
            cores.add(core)
            chosen.append(cpu)
    chosen += [cpu for cpu in allowed if cpu not in chosen]  # then SMT siblings
    return chosen[:n] if len(chosen) >= n else None


def _pin_all_threads(cpus) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def _threads_pinned(cpus) -> bool:
    ok = True
    for tid in os.listdir("/proc/self/task"):
        try:
            ok &= os.sched_getaffinity(int(tid)) == set(cpus)
        except OSError:
            pass
    return ok


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
                _pin_all_threads(cpus)  # no thread escapes the mask
            self._t, self._c = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(time.perf_counter() - self._t)
            self.cpu.append(time.process_time() - self._c)

    timer = EpochTimer()
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=B, epochs=1 + s["epochs"], shuffle=False, verbose=0, callbacks=[timer])
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
        "pinned": None if cpus is None else _threads_pinned(cpus),
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


def _f(x, fmt="{:.3f}"):
    return "" if x is None else fmt.format(x)


def build_table(results: list, args, seconds: float) -> str:
    cols = ["case", "partitions", "microbatches", "schedule", "cores", "samples/s", "ms/batch", "busy",
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
                     str(spec["cpus"]), f"{sps:.1f}", f"{1e3 * batch / sps:.1f}", _f(r["busy"], "{:.2f}"),
                     _f(time_ratio), _f(speedup), _f(vs_same_m), _f(bound), _f(sim_bound), _f(eff),
                     f"{r['first_epoch_s']:.2f} s", target, result])

    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    left = {0, 3, 15, 16}

    def fmt(r):
        return "  ".join(v.ljust(widths[i]) if i in left else v.rjust(widths[i]) for i, v in enumerate(r)).rstrip()

    any_ok = next(iter(ok.values()), None)
    s = any_ok["sizes"] if any_ok else sizes(args.quick)
    mode = "quick" if args.quick else "full"
    head = [
        f"smp_tf Keras fit benchmark ({mode}): MLP {s['layers']}x Dense({s['width']}) on {s['width']} features, "
        f"batch {s['batch']}, {s['batches']} batches per epoch, SGD, MSE; "
        f"samples/s = median over {s['epochs']} epochs after the first",
        f"python {platform.python_version()}, {_versions()}, {os.cpu_count()} CPUs visible; "
        f"run took {seconds:.0f} s",
        "",
        fmt(cols),
        fmt(["-" * w for w in widths]),
    ]
    if any_ok:
        dims = {str(d) for r in ok.values() for d in r["traced_batch_dims"]}
        threads = {tuple(r["threads"]) for r in ok.values()}
        pins = sorted({(r["spec"]["cpus"], str(r["cpus"]), r["pinned"]) for r in ok.values()})
        notes.append(f"batch dimension seen by train_step at tracing: {', '.join(sorted(dims))} "
                     "(static: no tf.cond between the M- and the 1-micro-batch pipeline)")
        notes.append("intra-op/inter-op threads: " + ", ".join(f"{a}/{b}" for a, b in sorted(threads)))
        notes.append("pinning: " + "; ".join(
            f"{n}-core cases on CPUs {c}" + ("" if p else " (NOT all threads pinned)") if c != "None"
            else f"{n}-core cases not pinned" for n, c, p in pins))
        plan = next((r.get("plan") for r in ok.values() if r["spec"]["partitions"] > 1 and r.get("plan")), None)
        if plan:
            notes.append("partition of the MLP (P=2):\n  " + plan.replace("\n", "\n  "))
    if verdict is None:
        notes.append("P=1 overhead target: NOT MEASURED")
    else:
        r = by["smp_p1_m1"]
        notes.append(f"P=1 overhead target (smp fit P=1 M=1 time per sample <= {OVERHEAD_TARGET}x plain Keras): "
                     f"{verdict} ({ref['samples_per_s'] / r['samples_per_s']:.3f}x)")
    return "\n".join(head + [fmt(r) for r in rows] + [""] + notes)


def _versions() -> str:
    try:
        from importlib.metadata import version

        return f"tensorflow {version('tensorflow')}, keras {version('keras')}"
    except Exception:  # pragma: no cover
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 timed epochs (smoke test; figures mean nothing)")
    ap.add_argument("--no-pin", action="store_true", help="do not restrict the subprocesses to one/two CPUs")
    ap.add_argument("--only", metavar="NAME", action="append",
                    help="run only this case (repeatable; names: " + ", ".join(c["name"] for c in cases()) + ")")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results (every epoch) to FILE")
    ap.add_argument("--case", metavar="JSON", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args(argv)

    if args.case:
        result = run_case(json.loads(args.case), args.quick, not args.no_pin)
        sys.stdout.write(_MARK + json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0

    todo = cases()
    if args.only:
        unknown = set(args.only) - {c["name"] for c in todo}
        if unknown:
            ap.error(f"unknown case(s): {', '.join(sorted(unknown))}")
        todo = [c for c in todo if c["name"] in args.only]
    if not args.no_pin and choose_cpus(max(c["cpus"] for c in todo)) is None:
        print("[bench] cannot pin (no sched_setaffinity or too few CPUs); running unpinned", file=sys.stderr)
        args.no_pin = True
    t0 = time.perf_counter()
    results = []
    for spec in todo:
        print(f"[bench] {spec['name']} ...", file=sys.stderr, flush=True)
        results.append(launch(spec, args))
        print(f"[bench] {spec['name']} done in {results[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(build_table(results, args, seconds))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
