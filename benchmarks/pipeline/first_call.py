"""First call of a pipelined training step on the models of the test zoo.

For each model of ``tests/zoo/zoo_models.py`` this prints the first call of
its training step (forward, loss, gradients, SGD update) as

- a plain `tf.function` on one device (``/device:CPU:0``, the whole batch),
- a `tf.function` around an `@smp.step` of the same body at partitions=2,
  microbatches=4, pipeline "interleaved" (two logical CPU devices),

and their ratio, with target <= 2.0. A first call is tracing (the
`tf.function`'s `get_concrete_function`; for smp_tf it includes tracing the
micro-batch step, partitioning, cutting tasks, scheduling and building the
task functions) plus the first execution (graph optimisation included).

Every first call runs in a fresh process (``--side plain|smp --model NAME``,
used internally), so nothing of one is cached for another. Both sides set up
TensorFlow alike (`smp.init` with the same config: two logical CPU devices,
one intra-op thread) and warm the process up on a tiny model first (lazy
imports, TensorFlow's first-ever tracing), so that neither side pays it.

Run ``python benchmarks/pipeline/first_call.py`` (all models, 1 round),
``--models resnet50,bert_classifier --rounds 3`` for a subset with medians,
``--quick`` for two small models (smoke test), ``--microbatches N`` for
another M.

``--loop`` also times a third first call per model and round: a plain
`tf.function` on one device that loops over the same M micro-batches
(forward, backward, gradients summed one micro-batch at a time, SGD
update), with no pipeline. Its column ``smp/loop`` separates what the
pipeline adds to a first call from what micro-batching itself costs (M
copies of the forward and backward pass to trace and optimise).

``--runtime`` also splits each first execution into what TensorFlow's
runtime does before the step runs, read from its own log (the children run
with ``TF_CPP_VMODULE`` set for the function library runtime, the graph
optimisation passes and grappler): preparing the outer function (its graph
passes, the function-call lowering among them; grappler, with its function
optimiser and MLIR (tfg) passes; XLA's clustering passes) and preparing the
functions it calls (smp_tf's task functions), with their grappler time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import aligned, versions  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_MARK = "@@SMP_FIRST_CALL@@"
P = 2
M = 4
SCHEDULE = "interleaved"
TARGET = 2.0
QUICK_MODELS = ("lstm", "noise_dropout")
# smp's breakdown, in the order of the table: (key, column title).
PHASES = (
    ("step_trace", "trace"),
    ("partition", "partition"),
    ("tasks", "tasks"),
    ("functions", "functions"),
    ("emit", "emit+rest"),
    ("execute", "execute"),
)


# ---------------------------------------------------------------------------
# One first call (in a fresh process)


def _timed(cls, name: str, record: dict) -> None:
    """Wraps method `name` of `cls` to add its wall time to record[name]."""
    original = getattr(cls, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            record[name] = record.get(name, 0.0) + time.perf_counter() - t0

    setattr(cls, name, wrapper)


def measure(side: str, model_name: str, microbatches: int = M) -> dict:
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": microbatches, "pipeline": SCHEDULE})
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    from smp_tf.lowering import CompiledStep
    from tests.zoo import zoo_models

    def plain_train(model, loss_fn, kwargs):
        opt = keras.optimizers.SGD(learning_rate=1e-3)

        @tf.function
        def train(x, y):
            with tf.device("/device:CPU:0"):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True, **kwargs))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

        return train, None

    def loop_train(model, loss_fn, kwargs):
        # The same M micro-batches on one device, summed one at a time in
        # the order smp_tf's `accumulate` sums them: what micro-batching
        # alone costs a first call, without a pipeline.
        opt = keras.optimizers.SGD(learning_rate=1e-3)

        def add(a, b):
            if isinstance(a, tf.IndexedSlices):  # an embedding's gradient stays sparse
                return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                        a.dense_shape)
            return a + b

        def mean(g):
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(g.values / microbatches, g.indices, g.dense_shape)
            return g / microbatches

        @tf.function
        def train(x, y):
            with tf.device("/device:CPU:0"):
                xs = [tf.split(a, microbatches) for a in tf.nest.flatten(x)]
                ys = tf.split(y, microbatches)
                total_loss, total = None, None
                for m in range(microbatches):
                    xm = tf.nest.pack_sequence_as(x, [parts[m] for parts in xs])
                    with tf.GradientTape() as tape:
                        loss = loss_fn(ys[m], model(xm, training=True, **kwargs))
                    grads = tape.gradient(loss, model.trainable_variables)
                    if total is None:
                        total_loss, total = loss, grads
                    else:
                        total_loss = total_loss + loss
                        total = [None if a is None else add(a, g) for a, g in zip(total, grads)]
                opt.apply_gradients(zip([None if g is None else mean(g) for g in total], model.trainable_variables))
                return total_loss / microbatches

        return train, None

    def smp_train(model, loss_fn, kwargs):
        opt = keras.optimizers.SGD(learning_rate=1e-3)

        @smp.step
        def body(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True, **kwargs))
            return loss, tape.gradient(loss, model.trainable_variables)

        @tf.function
        def train(x, y):
            loss, grads = body(x, y)
            opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
            return loss.reduce_mean()

        return train, body

    make = {"plain": plain_train, "loop": loop_train, "smp": smp_train}[side]

    # Warm-up: the same tiny model through both kinds of step.
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    tiny = smp.DistributedModel(inp, keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inp)))
    xs, ys = tf.ones([8, 8]), tf.ones([8, 4])
    for warm in (plain_train, loop_train, smp_train):
        warm(tiny, zoo_models.mse, {})[0](xs, ys).numpy()

    case = zoo_models.ENTRIES[model_name]()
    to_tensor = lambda a: tf.constant(a)  # noqa: E731
    x = tf.nest.map_structure(to_tensor, case.x)
    y = tf.constant(case.y)
    train, body = make(case.model, case.loss, case.training_kwargs)

    record: dict = {}
    if side == "smp":
        _timed(CompiledStep, "__init__", record)
        _timed(CompiledStep, "_build_functions", record)
    t0 = time.perf_counter()
    train.get_concrete_function(x, y)
    t1 = time.perf_counter()
    start_unix = time.time()
    train(x, y).numpy()
    t2 = time.perf_counter()
    # The runtime's log lines of the first execution lie between these two
    # (both read the host's real-time clock).
    out = {"trace": t1 - t0, "execute": t2 - t1, "total": t2 - t0,
           "execute_from": start_unix, "execute_to": time.time()}
    if side == "smp":
        plan = body.last_plan
        out["step_trace"] = plan.trace_seconds
        out["partition"] = plan.seconds
        out["functions"] = record.get("_build_functions", 0.0)
        out["tasks"] = record.get("__init__", 0.0) - out["functions"]
        out["emit"] = out["trace"] - plan.trace_seconds - plan.seconds - record.get("__init__", 0.0)
        out["ops"] = len(plan.op_graph.ops)
        out["tasks_n"] = len(body.last_compiled.tasks)
    return out


# ---------------------------------------------------------------------------
# Where the first execution goes, from TensorFlow's own log

# VLOG(1) of these files: the start and end of each function's preparation
# ("Instantiating MultiDevice function" ... "Instantiated ..."), every graph
# optimisation pass, and grappler's start, end and per-optimiser times.
RUNTIME_VMODULE = "process_function_library_runtime=1,optimization_registry=1,meta_optimizer=1"
# Graph passes that XLA's JIT registers; they run on every function, also
# with XLA off (auto-clustering finds nothing to cluster).
XLA_PASSES = frozenset({
    "EncapsulateXlaComputationsPass", "FunctionalizeControlFlowForXlaPass", "CloneConstantsForBetterClusteringPass",
    "ClusterScopingPass", "MarkForCompilationPass", "ForceXlaConstantsOnHostPass", "IncreaseDynamismForAutoJitPass",
    "PartiallyDeclusterPass", "ReportClusteringInfoPass", "EncapsulateSubgraphsPass", "BuildXlaOpsPass",
})
_LOG_LINE = re.compile(r"^[IWEF](\d{4}) (\d+):(\d+):(\d+(?:\.\d+)?)\s+(\d+) ([\w.]+):\d+\] (.*)$")
# The form of TensorFlow releases before absl's logging (2.16, for one):
# ``2026-11-27 03:12:01.123456: I tensorflow/core/.../file.cc:72] message``,
# local time, no thread id.
_DATED_LOG_LINE = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?): [IWEF] (?:[\w./-]*/)?([\w.]+):\d+\] (.*)$")
_OPTIMIZER_TIME = re.compile(r"^([^:{]+)(?:\{.*\})?: Graph size after: .* time = ([\d.]+)ms")


def parse_tf_log(text: str, year: int) -> list:
    """TensorFlow's C++ log lines as (time, thread, source file, message).

    A line reads ``I1127 03:12:01.123456  4321 file.cc:72] message``; before
    absl's logging is initialised, month, day, hour and minute are printed
    as zeros and the seconds are the Unix time. `year` completes the date of
    the other form. Older releases print
    ``2026-11-27 03:12:01.123456: I tensorflow/core/.../file.cc:72] message``
    without a thread id: their lines all get thread ``"?"``, so windows of
    different threads cannot be told apart there. Other lines (Python's,
    continuations) are skipped.
    """
    events = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if not m:
            d = _DATED_LOG_LINE.match(line)
            if d:
                yy, mo, dd, hh, mi, sec, source, message = d.groups()
                whole = time.mktime((int(yy), int(mo), int(dd), int(hh), int(mi), 0, 0, 0, -1))
                events.append((whole + float(sec), "?", source, message))
            continue
        mmdd, hh, mi, sec, thread, source, message = m.groups()
        if mmdd == "0000":
            t = int(hh) * 3600 + int(mi) * 60 + float(sec)
        else:
            whole = time.mktime((year, int(mmdd[:2]), int(mmdd[2:]), int(hh), int(mi), 0, 0, 0, -1))
            t = whole + float(sec)
        events.append((t, thread, source, message))
    return events


def _new_part() -> dict:
    return {"seconds": 0.0, "lowering": 0.0, "grappler": 0.0, "function_optimizer": 0.0, "tfg": 0.0,
            "xla": 0.0, "encapsulate": 0.0, "other": 0.0}


def runtime_breakdown(events: list, start: float, end: float) -> dict:
    """Where the runtime's preparation of a first execution goes.

    Each function the execution prepares is one window on one thread, from
    "Instantiating MultiDevice function" to "Instantiated MultiDevice
    function". The first window is the called function itself ("outer");
    the later ones are the functions it calls, prepared when the call is
    first reached ("nested": smp_tf's task functions). Inside a window each
    log line lasts until the thread's next line and counts towards the pass
    or grappler phase it belongs to: ``lowering`` (LowerFunctionalOpsPass,
    which also reads the body of every function call, one call node at a
    time), ``grappler`` (of which its ``function_optimizer`` and MLIR
    ``tfg`` optimisers, from grappler's own timings), ``xla`` (XLA's
    clustering passes, of which ``encapsulate``: EncapsulateSubgraphsPass,
    which instantiates the body of every called function twice per call
    node) and ``other`` (placement, partitioning, the other passes).
    Windows of different threads may overlap, so "nested" sums thread
    time, not wall time.
    """
    by_thread: dict = {}
    for ev in events:
        if start <= ev[0] <= end:
            by_thread.setdefault(ev[1], []).append(ev)
    windows = []
    for thread_events in by_thread.values():
        part, phase, name, t_open = None, "other", None, 0.0
        for i, (t, _, source, message) in enumerate(thread_events):
            nxt = thread_events[i + 1][0] if i + 1 < len(thread_events) else t
            if part is None:
                if message.startswith("Instantiating MultiDevice function"):
                    m = re.search(r'"([^"]+)"', message)
                    name = m.group(1) if m else "?"
                    part, phase, t_open = _new_part(), "other", t
                    part["other"] += nxt - t
                continue
            if message.startswith("Instantiated MultiDevice function"):
                part["seconds"] = t - t_open
                windows.append((t_open, name, part))
                part = None
                continue
            if message.startswith("Running optimization pass: "):
                pass_name = message.split(": ", 1)[1].strip()
                phase = ("lowering" if pass_name == "LowerFunctionalOpsPass"
                         else "encapsulate" if pass_name == "EncapsulateSubgraphsPass"
                         else "xla" if pass_name in XLA_PASSES else "other")
            elif message.startswith(("Running optimization phase", "Finished optimization of a group")):
                phase = "other"
            elif message.startswith("Starting optimization for grappler item"):
                phase = "grappler"
            elif phase == "grappler" and source.startswith("meta_optimizer"):
                m = _OPTIMIZER_TIME.match(message)
                key = {"function_optimizer": "function_optimizer", "tfg_optimizer": "tfg"}.get(m.group(1)) if m else None
                if key:
                    part[key] += float(m.group(2)) / 1000.0
                if message.startswith("Optimized") and "functions" in message:
                    # Grappler's last line: it ends when the thread logs again.
                    part["grappler"] += nxt - t
                    phase = "other"
                    continue
            part[phase] += nxt - t
            if phase == "encapsulate":
                part["xla"] += nxt - t
    windows.sort(key=lambda w: w[0])
    outer = windows[0][2] if windows else _new_part()
    nested = _new_part()
    for _, _, part in windows[1:]:
        for key, value in part.items():
            nested[key] += value
    return {"outer": outer, "outer_name": windows[0][1] if windows else None,
            "nested": nested, "nested_count": len(windows) - 1 if windows else 0}


def build_runtime_table(rows: dict) -> str:
    """One line per model and side: the first execution and, from the
    runtime's log, the preparation of the outer function and of the
    functions it calls (medians over the rounds)."""
    cols = ["model", "side", "execute", "outer", "lowering", "grappler", "fn-opt", "tfg", "xla", "encaps",
            "other", "nested n", "nested", "nested grappler"]
    lines = []
    for name, sides in rows.items():
        for side, results in sides.items():
            rts = [r for r in results if "runtime" in r]
            if not rts:
                continue

            def med(where, key):
                return f"{statistics.median(r['runtime'][where][key] for r in rts):.2f}"

            lines.append([name, side, f"{_median(rts, 'execute'):.2f}", med("outer", "seconds"),
                          med("outer", "lowering"), med("outer", "grappler"), med("outer", "function_optimizer"),
                          med("outer", "tfg"), med("outer", "xla"), med("outer", "encapsulate"),
                          med("outer", "other"), str(rts[0]["runtime"]["nested_count"]),
                          med("nested", "seconds"), med("nested", "grappler")])
    head = [
        "First execution, from TensorFlow's log (s): outer = preparing the called function, of which lowering "
        "(LowerFunctionalOpsPass), grappler (of which fn-opt: its function optimiser, tfg: its MLIR passes), "
        "xla (XLA's clustering passes, of which encaps: EncapsulateSubgraphsPass) and other; "
        "nested = preparing the functions it calls (summed over threads), n of them, of which their grappler",
        "",
    ]
    return "\n".join(head + aligned(cols, lines, left={0, 1}))


# ---------------------------------------------------------------------------
# Driver and table


def run_one(side: str, model: str, microbatches: int = M, runtime: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--models", model,
           "--microbatches", str(microbatches)]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if runtime:
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"
        env["TF_CPP_VMODULE"] = RUNTIME_VMODULE
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            result = json.loads(line[len(_MARK):])
            if runtime:
                events = parse_tf_log(proc.stderr, year=time.localtime(result["execute_from"]).tm_year)
                result["runtime"] = runtime_breakdown(events, result["execute_from"], result["execute_to"])
            return result
    tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
    return {"error": f"exit code {proc.returncode}\n{tail}"}


def _median(results, key):
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def build_table(rows: dict, args) -> str:
    """The first-call table: `rows` maps a model to {side: [results]}, the
    sides "plain" and "smp" and, with ``--loop``, "loop"."""
    with_loop = any(sides.get("loop") for sides in rows.values())
    cols = (["model", "ops", "plain s"] + (["loop s"] if with_loop else []) + ["smp s", "ratio"]
            + (["smp/loop"] if with_loop else []) + [title for _, title in PHASES] + ["target", "result"])
    lines, notes, verdicts = [], [], []
    for name, sides in rows.items():
        plain, smp, loop = sides["plain"], sides["smp"], sides.get("loop", [])
        errors = [r["error"] for r in plain + loop + smp if "error" in r]
        if errors:
            notes.append(f"{name} FAILED:\n{errors[0]}")
            lines.append([name] + [""] * (len(cols) - 3) + [f"<= {TARGET}", "FAILED"])
            verdicts.append("FAIL")
            continue
        tp, ts = _median(plain, "total"), _median(smp, "total")
        ratio = ts / tp
        verdict = "PASS" if ratio <= TARGET else "FAIL"
        verdicts.append(verdict)
        ops = smp[0].get("ops", "")
        tl = _median(loop, "total") if loop else None
        line = [name, str(ops), f"{tp:.2f}"]
        if with_loop:
            line.append(f"{tl:.2f}" if tl else "")
        line += [f"{ts:.2f}", f"{ratio:.2f}"]
        if with_loop:
            line.append(f"{ts / tl:.2f}" if tl else "")
        lines.append(line + [f"{_median(smp, key):.2f}" for key, _ in PHASES] + [f"<= {TARGET}", verdict])
        note = (f"{name}: plain trace {_median(plain, 'trace'):.2f} + execute {_median(plain, 'execute'):.2f} s; "
                f"smp {smp[0].get('tasks_n')} tasks; smp totals {[round(r['total'], 2) for r in smp]}, "
                f"plain totals {[round(r['total'], 2) for r in plain]}")
        if tl:
            note += (f", loop trace {_median(loop, 'trace'):.2f} + execute {_median(loop, 'execute'):.2f} s, "
                     f"loop totals {[round(r['total'], 2) for r in loop]}")
        notes.append(note)
    m = getattr(args, "microbatches", M)
    head = [
        f"smp_tf first-call benchmark: P={P} M={m} {SCHEDULE} "
        "vs a plain tf.function on one device; "
        f"medians of {args.rounds} round(s), each first call in a fresh process",
        f"python {platform.python_version()}, {versions()}, {os.cpu_count()} CPUs visible",
        "smp breakdown (s): trace = tracing the micro-batch step, partition = graph view + partitioner, "
        "tasks = cutting tasks + schedule, functions = building the task functions, "
        "emit+rest = emitting the pipeline and the rest of the outer tracing, execute = first execution",
    ]
    if with_loop:
        head.append(f"loop = a plain tf.function on one device looping over the same {m} micro-batches "
                    "(no pipeline); smp/loop = what the pipeline adds to micro-batching")
    out = head + [""] + aligned(cols, lines, left={0, len(cols) - 2, len(cols) - 1}) + [""] + notes + [""]
    overall = "PASS" if verdicts and all(v == "PASS" for v in verdicts) else "FAIL"
    out.append(f"overall: {overall} ({verdicts.count('PASS')} of {len(verdicts)} models within {TARGET}x)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None,
                    help="comma-separated zoo entries (default: all; --quick: %s)" % ",".join(QUICK_MODELS))
    ap.add_argument("--rounds", type=int, default=1, help="fresh first calls per model and side (median)")
    ap.add_argument("--quick", action="store_true", help="two small models, one round (smoke test)")
    ap.add_argument("--side", choices=["plain", "loop", "smp"], help="measure one first call in this process (internal)")
    ap.add_argument("--microbatches", type=int, default=M, help=f"micro-batches of the smp step (default {M})")
    ap.add_argument("--runtime", action="store_true",
                    help="also split each first execution by what TensorFlow's runtime prepares (from its log)")
    ap.add_argument("--loop", action="store_true",
                    help="also time a plain tf.function looping over the same micro-batches on one device")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results to FILE")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1. Received: {args.rounds}")
    if args.microbatches < 1:
        ap.error(f"--microbatches must be >= 1. Received: {args.microbatches}")

    if args.side:
        result = measure(args.side, args.models, args.microbatches)
        sys.stdout.write(_MARK + json.dumps(result) + "\n")
        return 0

    from tests.zoo import zoo_models

    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
    else:
        models = list(QUICK_MODELS) if args.quick else list(zoo_models.ENTRIES)
    unknown = [m for m in models if m not in zoo_models.ENTRIES]
    if unknown:
        ap.error(f"unknown zoo models {unknown}; known: {', '.join(zoo_models.ENTRIES)}")
    rows = {}
    for name in models:
        order = ("plain", "loop", "smp") if args.loop else ("plain", "smp")
        sides = {side: [] for side in order}
        for r in range(args.rounds):
            # Rotate the order so that no side always runs first.
            for side in order[r % len(order):] + order[:r % len(order)]:
                t0 = time.perf_counter()
                res = run_one(side, name, args.microbatches, args.runtime)
                sides[side].append(res)
                print(f"[first_call] {name} {side} round {r}: "
                      f"{res.get('total', float('nan')):.2f} s (process {time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
        rows[name] = sides
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(build_table(rows, args))
    if args.runtime:
        print()
        print(build_runtime_table(rows))
    return 1 if any("error" in r for sides in rows.values() for results in sides.values() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
