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
``--quick`` for two small models (smoke test).
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

from benchmarks.machine import versions  # noqa: E402

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


def measure(side: str, model_name: str) -> dict:
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": M, "pipeline": SCHEDULE})
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

    make = plain_train if side == "plain" else smp_train

    # Warm-up: the same tiny model through both kinds of step.
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    tiny = smp.DistributedModel(inp, keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inp)))
    xs, ys = tf.ones([8, 8]), tf.ones([8, 4])
    for warm in (plain_train, smp_train):
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
    train(x, y).numpy()
    t2 = time.perf_counter()
    out = {"trace": t1 - t0, "execute": t2 - t1, "total": t2 - t0}
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
# Driver and table


def run_one(side: str, model: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--models", model]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
    return {"error": f"exit code {proc.returncode}\n{tail}"}


def _median(results, key):
    values = [r[key] for r in results if key in r]
    return statistics.median(values) if values else None


def build_table(rows: dict, args) -> str:
    cols = ["model", "ops", "plain s", "smp s", "ratio"] + [title for _, title in PHASES] + ["target", "result"]
    lines, notes, verdicts = [], [], []
    for name, (plain, smp) in rows.items():
        errors = [r["error"] for r in plain + smp if "error" in r]
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
        lines.append([name, str(ops), f"{tp:.2f}", f"{ts:.2f}", f"{ratio:.2f}"]
                     + [f"{_median(smp, key):.2f}" for key, _ in PHASES] + [f"<= {TARGET}", verdict])
        notes.append(f"{name}: plain trace {_median(plain, 'trace'):.2f} + execute {_median(plain, 'execute'):.2f} s; "
                     f"smp {smp[0].get('tasks_n')} tasks; smp totals {[round(r['total'], 2) for r in smp]}, "
                     f"plain totals {[round(r['total'], 2) for r in plain]}")
    widths = [max([len(cols[i])] + [len(r[i]) for r in lines]) for i in range(len(cols))]

    def fmt(r):
        return "  ".join(v.ljust(widths[i]) if i in (0, len(cols) - 2, len(cols) - 1) else v.rjust(widths[i])
                         for i, v in enumerate(r)).rstrip()

    head = [
        f"smp_tf first-call benchmark: P={P} M={M} {SCHEDULE} vs a plain tf.function on one device; "
        f"medians of {args.rounds} round(s), each first call in a fresh process",
        f"python {platform.python_version()}, {versions()}, {os.cpu_count()} CPUs visible",
        "smp breakdown (s): trace = tracing the micro-batch step, partition = graph view + partitioner, "
        "tasks = cutting tasks + schedule, functions = building the task functions, "
        "emit+rest = emitting the pipeline and the rest of the outer tracing, execute = first execution",
        "",
        fmt(cols),
        fmt(["-" * w for w in widths]),
    ]
    out = head + [fmt(r) for r in lines] + [""] + notes + [""]
    overall = "PASS" if verdicts and all(v == "PASS" for v in verdicts) else "FAIL"
    out.append(f"overall: {overall} ({verdicts.count('PASS')} of {len(verdicts)} models within {TARGET}x)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None,
                    help="comma-separated zoo entries (default: all; --quick: %s)" % ",".join(QUICK_MODELS))
    ap.add_argument("--rounds", type=int, default=1, help="fresh first calls per model and side (median)")
    ap.add_argument("--quick", action="store_true", help="two small models, one round (smoke test)")
    ap.add_argument("--side", choices=["plain", "smp"], help="measure one first call in this process (internal)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results to FILE")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1. Received: {args.rounds}")

    if args.side:
        result = measure(args.side, args.models)
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
        plain, smp = [], []
        for r in range(args.rounds):
            # Alternate the order so that neither side always runs first.
            for side in (("plain", "smp") if r % 2 == 0 else ("smp", "plain")):
                t0 = time.perf_counter()
                res = run_one(side, name)
                (plain if side == "plain" else smp).append(res)
                print(f"[first_call] {name} {side} round {r}: "
                      f"{res.get('total', float('nan')):.2f} s (process {time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
        rows[name] = (plain, smp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(build_table(rows, args))
    return 1 if any("error" in r for p, s in rows.values() for r in p + s) else 0


if __name__ == "__main__":
    sys.exit(main())
