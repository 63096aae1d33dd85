"""Tensor parallelism: a transformer MLP block and a GPT-2 block at t=2 against t=1.

Each case runs in a fresh process (``smp.init`` must come before any
TensorFlow op), pinned to as many cores as it has devices, with one intra-op
thread per device: t=1 is one core, t=2 two devices of one core each. A step
is the forward, the backward and an SGD update in one ``tf.function``; the
figure is the median over the timed steps. Prints one table.

    python benchmarks/tensor_parallel/bench.py             # full sizes (a few minutes)
    python benchmarks/tensor_parallel/bench.py --quick     # small sizes: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _case(args) -> dict:
    from benchmarks.machine import choose_cpus

    cpus = choose_cpus(args.devices)
    if cpus is None:
        return {"error": f"needs {args.devices} cores"}
    os.sched_setaffinity(0, cpus)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp

    t = args.t
    if args.mode == "plain":
        tf.config.threading.set_intra_op_parallelism_threads(1)
    else:
        smp.init({"partitions": 1, "microbatches": 1, "tensor_parallel_degree": t})
        tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if args.model == "mlp":
        width, tokens = args.width, args.tokens
        inp = keras.Input((width,))
        h = keras.layers.Dense(4 * width, activation="gelu", name="up")(inp)
        out = keras.layers.Dense(width, name="down")(h)
        x = tf.constant(rng.normal(size=(tokens, width)).astype("float32"))
        y = tf.constant(rng.normal(size=(tokens, width)).astype("float32"))
        cls = keras.Model if args.mode == "plain" else smp.DistributedModel
        model = cls(inp, out)
    else:
        import keras_hub

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=256, num_layers=1, num_heads=args.width // 64, hidden_dim=args.width,
            intermediate_dim=4 * args.width, dropout=0.0, max_sequence_length=args.seq,
        )
        inputs = {"token_ids": keras.Input((args.seq,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((args.seq,), dtype="int32", name="padding_mask")}
        cls = keras.Model if args.mode == "plain" else smp.DistributedModel
        model = cls(inputs, backbone(inputs))
        batch = args.tokens // args.seq
        x = {"token_ids": tf.constant(rng.integers(0, 256, size=(batch, args.seq)).astype("int32")),
             "padding_mask": tf.ones((batch, args.seq), "int32")}
        y = tf.constant(rng.normal(size=(batch, args.seq, args.width)).astype("float32"))
    opt = keras.optimizers.SGD(1e-3)

    body = _mse_body(model)

    if args.mode == "plain":
        @tf.function
        def train(x, y):
            loss, grads = body(x, y)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
    else:
        step = smp.step(body)
        train = _trainer(step, opt, model)

    for _ in range(args.warmup):
        float(train(x, y))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        float(train(x, y))
        times.append(time.perf_counter() - t0)
    result = {"median": statistics.median(times), "times": times, "cpus": cpus}
    if args.mode == "smp" and step.last_plan.shard_plan is not None:
        plan = step.last_plan.shard_plan
        result["all_reduces"] = sum(1 for r in plan.reshards for s in r.steps if s == "all_reduce")
        result["all_gathers"] = sum(1 for r in plan.reshards for s in r.steps if s == "all_gather")
        result["reshard_mib"] = plan.reshard_bytes() / 2**20
        # The all-reduces of activations (partial sums as large as a layer's
        # output) against Megatron's count: per block two in the forward and
        # two in the backward (one each in the forward for the MLP alone,
        # whose input needs no gradient).
        activation = args.tokens * args.width * 4
        reduced = [r.nbytes for r in plan.reshards if "all_reduce" in r.steps]
        result["activation_all_reduces"] = sum(1 for b in reduced if b >= activation)
        result["activation_reduced_mib"] = sum(b for b in reduced if b >= activation) / 2**20
        result["small_all_reduces"] = sum(1 for b in reduced if b < activation)
        # A token embedding split by vocabulary adds one: its masked lookup's
        # partial sum (Megatron's vocabulary-parallel embedding does the same).
        embedding = any(k.endswith("token_embedding/embeddings") and not s.is_replicated
                        for k, s in plan.variables.items())
        result["predicted_reduced_mib"] = ((1 if args.model == "mlp" else 4) + embedding) * activation / 2**20
        result["whole_ops"] = sorted({ty for _, ty in plan.whole_ops})
        # Where the variables and Adam's slots live: the bytes of the live
        # storage on each device (a split variable's pieces on theirs), and
        # what the memory model predicts for each device.
        sharded = {k for k, s in plan.variables.items() if not s.is_replicated}
        result["sharded_variables"] = len(sharded)
        result["stored_split"] = len(plan.stored_split)
        result["variable_bytes_by_device"] = _bytes_by_device(model.trainable_variables)
        adam = keras.optimizers.Adam()
        adam.build(model.trainable_variables)  # slots of split variables are split too
        result["adam_slot_bytes_by_device"] = _bytes_by_device([v for v in adam.variables if len(v.shape)])
        result["variable_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        report = step.memory_report(adam)
        result["predicted_bytes_by_device"] = {r.device: r.variables + r.optimizer for r in report.devices}
    return result


def _mse_body(model):
    """One micro-batch of a regression step: mean squared error and the gradients."""
    import tensorflow as tf

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    return body


def _bytes_by_device(variables) -> dict:
    """Bytes of each variable's live storage on each device (a split
    variable's pieces on theirs)."""
    import numpy as np

    from smp_tf.sharding import storage

    out = {}
    for v in variables:
        for piece in storage.shards_of(v) or [v.value]:
            d = "/device:" + piece.device.rsplit("device:", 1)[1]
            out[d] = out.get(d, 0) + int(np.prod(piece.shape)) * piece.dtype.size
    return out


def _lm_body(model):
    """One micro-batch of the language model's training step."""
    import tensorflow as tf

    def body(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        return loss, tape.gradient(loss, model.trainable_variables)

    return body


def _lm_trainer(model):
    """The training step as the budget case runs it: the pipeline and
    Adam's update in one `tf.function` (the prediction depends on how the
    step is called: eagerly, every micro-batch's outputs are held).
    Returns (the `smp.step`, the optimizer, the training function)."""
    import keras

    import smp_tf as smp

    step = smp.step(_lm_body(model))
    opt = keras.optimizers.Adam(1e-3)
    return step, opt, _trainer(step, opt, model)


def _trainer(step, opt, model):
    """The pipeline and the optimizer's update of the accumulated gradients
    in one `tf.function`; returns the mean loss. Without AutoGraph, a
    MemoryBudgetError raised while tracing reaches the caller as itself
    (AutoGraph re-raises a StagingError)."""
    import tensorflow as tf

    @tf.function(autograph=False)
    def train(x, y):
        loss, grads = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    return train


def _budget_case(args) -> dict:
    """A GPT-2 LM whose tied embedding dominates: the largest device's
    predicted peak at P=2 x t=1 and at P=2 x t=2, then a budget between the
    two: P=2 x t=1 must raise MemoryBudgetError, P=2 x t=2 must train, with
    the loss of the single-device loop."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp
    from smp_tf.memory import MemoryBudgetError

    vocab, width, seq, batch, m = args.vocab, 64, 8, 8, 2
    four = {"partitions": 2, "microbatches": m, "tensor_parallel_degree": 2}
    two = {"partitions": 2, "microbatches": m}
    smp.init(four)  # before any TensorFlow op: it creates the four devices
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype("int32")
    x = {"token_ids": tf.constant(tokens[:, :-1]), "padding_mask": tf.ones((batch, seq), "int32")}
    y = tf.constant(tokens[:, 1:])

    def build():
        keras.utils.set_random_seed(11)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, num_layers=2, num_heads=2, hidden_dim=width, intermediate_dim=4 * width,
            dropout=0.0, max_sequence_length=seq)
        inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
                  "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
        return smp.DistributedModel(inputs, backbone.token_embedding(backbone(inputs), reverse=True))

    def peak(config):
        smp.init(config)
        step, opt, train = _lm_trainer(build())
        train(x, y)
        return max(step.memory_report(opt).device_totals().values())

    p4 = peak(four)
    p2 = peak(two)
    budget = int(p4 * 1.02)
    out = {"peak_t1": p2, "peak_t2": p4, "budget": budget}
    smp.init(dict(two, memory_budget=budget))
    try:
        _lm_trainer(build())[2](x, y)
        out["t1"] = "trains"
    except MemoryBudgetError:
        out["t1"] = "MemoryBudgetError"
    reference = build()
    ref_body = tf.function(_lm_body(reference))
    ref_opt = keras.optimizers.Adam(1e-3)
    smp.init(dict(four, memory_budget=budget))
    model = build()
    step, opt, train = _lm_trainer(model)

    losses, ref_losses = [], []
    try:
        for _ in range(3):
            losses.append(float(train(x, y)))
            outs = [ref_body({k: v[j::m] for k, v in x.items()}, y[j::m]) for j in range(m)]
            grads = [tf.add_n(list(gs)) / m for gs in zip(*[g for _, g in outs])]
            ref_opt.apply_gradients(zip(grads, reference.trainable_variables))
            ref_losses.append(float(np.mean([float(l) for l, _ in outs])))
        out["t2"] = "trains"
    except MemoryBudgetError:
        out["t2"] = "MemoryBudgetError"
    out["losses"], out["ref_losses"] = losses, ref_losses
    out["embedding_mib"] = vocab * width * 4 / 2**20
    return out


def _gradients_case(args) -> dict:
    """A 4-block MLP (Megatron pairs) at P=1 x t: each device's bytes of
    variables and Adam slots as stored, and of gradients as the memory
    model predicts them inside a ``tf.function`` (the running sums and one
    micro-batch's gradients, where they are made)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp

    smp.init({"partitions": 1, "microbatches": 4, "tensor_parallel_degree": args.t})
    keras.utils.set_random_seed(0)
    width = args.width
    inp = keras.Input((width,))
    h = inp
    for b in range(4):
        h = keras.layers.Dense(4 * width, activation="gelu", name=f"up{b}")(h)
        h = keras.layers.Dense(width, name=f"down{b}")(h)
    model = smp.DistributedModel(inp, h)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.tokens, width)).astype("float32"))
    y = tf.constant(rng.normal(size=(args.tokens, width)).astype("float32"))
    opt = keras.optimizers.Adam(1e-3)

    body = _mse_body(model)

    step = smp.step(body)
    train = _trainer(step, opt, model)

    losses = [float(train(x, y)) for _ in range(2)]

    report = step.memory_report(opt)
    rows = report.devices or report.partitions
    return {
        "losses": losses,
        "variables": _bytes_by_device(model.trainable_variables),
        "optimizer": _bytes_by_device([v for v in opt.variables if len(v.shape)]),
        "predicted": {r.device: {"variables": r.variables, "optimizer": r.optimizer, "gradients": r.gradients}
                      for r in rows},
    }


def _sequence_case(args) -> dict:
    """A pre-norm keras_hub GPT-2 with dropout at P x t, with or without
    sequence parallelism: the step's median time, each device's predicted
    activations and total (the memory model inside a ``tf.function``), the
    reshards and the first losses."""
    from benchmarks.machine import choose_cpus

    devices = args.partitions * args.t
    cpus = choose_cpus(min(devices, len(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, cpus)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import smp_tf as smp

    smp.init({"partitions": args.partitions, "microbatches": 2, "tensor_parallel_degree": args.t,
              "sequence_parallel": bool(args.sp)})
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    width, seq, batch = args.width, args.seq, args.tokens // args.seq
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=2 * args.partitions, num_heads=max(width // 64, 2), hidden_dim=width,
        intermediate_dim=4 * width, dropout=0.1, max_sequence_length=seq)
    inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
    model = smp.DistributedModel(inputs, backbone(inputs))
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(0, 256, size=(batch, seq)).astype("int32")),
         "padding_mask": tf.ones((batch, seq), "int32")}
    y = tf.constant(rng.normal(size=(batch, seq, width)).astype("float32"))
    opt = keras.optimizers.SGD(1e-3)
    step = smp.step(_mse_body(model))
    train = _trainer(step, opt, model)

    losses = [float(train(x, y)) for _ in range(max(args.warmup, 2))]
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        float(train(x, y))
        times.append(time.perf_counter() - t0)
    report = step.memory_report(opt)
    rows = report.devices or report.partitions
    plan = step.last_plan.shard_plan
    kinds: dict = {}
    for r in plan.reshards:
        for k in r.steps:
            kinds[k] = kinds.get(k, 0) + 1
    return {"median": statistics.median(times), "losses": losses, "cores": len(cpus), "reshards": kinds,
            "reshard_mib": plan.reshard_bytes() / 2**20,
            "devices": {r.device: {"activations": r.activations, "total": r.total,
                                   "dynamic": r.total - r.variables - r.optimizer - r.gradients} for r in rows}}


def _megatron_ratio(width: int, seq: int, heads: int, t: int) -> float:
    """Activations per layer with sequence parallelism against without, as
    Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
    Transformer Models", table 2) count them: s*b*h*(10 + 24/t + 5*a*s/(h*t))
    without, s*b*h*(34/t + 5*a*s/(h*t)) with."""
    scores = 5 * heads * seq / (width * t)
    return (34 / t + scores) / (10 + 24 / t + scores)


def _sequence_table(quick: bool, repeats: int) -> dict:
    """Prints the sequence-parallel rows: each layout with and without it."""
    sizes = (["--width", "128", "--tokens", "256", "--seq", "64"] if quick
             else ["--width", "512", "--tokens", "2048", "--seq", "256"])
    width, seq = int(sizes[1]), int(sizes[5])
    out = {}
    print()
    head = ("layout", "cores", "sequence_parallel", "step s", "time ratio", "fullest activations MiB",
            "ratio", "fullest dynamic MiB", "ratio", "Megatron's count", "reshards", "MiB/dev", "losses rel diff")
    rows = []
    for partitions, t in ((2, 2), (1, 2), (1, 4)):
        got = {}
        for sp in (0, 1):
            cmd = [sys.executable, __file__, "--case", "--model", "sequence", "--partitions", str(partitions),
                   "--t", str(t), "--sp", str(sp), "--repeats", str(2 if quick else repeats)] + sizes
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
            if done.returncode or not lines:
                print(f"sequence parallelism at P={partitions} x t={t}: error " + (done.stderr or done.stdout)[-600:])
                return out
            got[sp] = json.loads(lines[-1])
        out[f"P{partitions}t{t}"] = got
        act = {sp: max(d["activations"] for d in got[sp]["devices"].values()) for sp in (0, 1)}
        dyn = {sp: max(d["dynamic"] for d in got[sp]["devices"].values()) for sp in (0, 1)}
        diff = max(abs(a - b) / abs(b) for a, b in zip(got[1]["losses"], got[0]["losses"]))
        for sp in (0, 1):
            g = got[sp]
            rows.append((f"P={partitions} x t={t}", g["cores"], "on" if sp else "off", f"{g['median']:.3f}",
                         f"{g['median'] / got[0]['median']:.2f}" if sp else "",
                         f"{act[sp] / 2**20:.1f}", f"{act[1] / act[0]:.2f}" if sp and act[0] else "",
                         f"{dyn[sp] / 2**20:.1f}", f"{dyn[1] / dyn[0]:.2f}" if sp else "",
                         f"{_megatron_ratio(width, seq, max(width // 64, 2), t):.2f}" if sp else "",
                         ", ".join(f"{k} x{n}" for k, n in sorted(g["reshards"].items())), f"{g['reshard_mib']:.2f}",
                         f"{diff:.1e}" if sp else ""))
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print(f"Sequence parallelism: keras_hub GPT-2 (pre-norm, dropout 0.1), width {width}, sequence {seq}, "
          f"{int(sizes[3]) // seq} sequences, 2 blocks per partition, M=2, SGD; predicted by the memory model")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return out


def _gradients_table(quick: bool) -> dict:
    """Prints the split-gradient line: t=2 against t=1 on the 4-block MLP."""
    sizes = ["--width", "64" if quick else "512", "--tokens", "64" if quick else "256"]
    got = {}
    for t in (1, 2):
        cmd = [sys.executable, __file__, "--case", "--model", "gradients", "--t", str(t)] + sizes
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
        if done.returncode or not lines:
            print(f"split gradients at t={t}: error " + (done.stderr or done.stdout)[-600:])
            return {}
        got[t] = json.loads(lines[-1])

    def fullest(r, key):
        return max(v[key] for v in r["predicted"].values())

    def state(r):
        return max(sum(v.values()) for v in r["predicted"].values())

    grads = fullest(got[2], "gradients") / fullest(got[1], "gradients")
    whole = state(got[2]) / state(got[1])
    live = all(got[t]["variables"].get(d, 0) == p["variables"] and got[t]["optimizer"].get(d, 0) == p["optimizer"]
               for t in (1, 2) for d, p in got[t]["predicted"].items())
    print(f"4-block MLP (width {sizes[1]}, Adam, M=4), P=1 x t=2 against t=1, fullest device: gradients "
          f"{grads:.2f}x, variables + gradients + optimizer {whole:.2f}x (target <= 0.55 each: "
          f"{'PASS' if grads <= 0.55 and whole <= 0.55 else 'FAIL'}); variables and slots predicted = live: "
          f"{live}; by device at t=2 (MiB, variables / gradients / optimizer): "
          + ", ".join(f"{d} {p['variables'] / 2**20:.2f} / {p['gradients'] / 2**20:.2f} / {p['optimizer'] / 2**20:.2f}"
                      for d, p in sorted(got[2]["predicted"].items()))
          + f"; losses t=1 {got[1]['losses']}, t=2 {got[2]['losses']}")
    return got


def _run(model, mode, t, devices, sizes, quick) -> dict:
    cmd = [sys.executable, __file__, "--case", "--model", model, "--mode", mode, "--t", str(t),
           "--devices", str(devices)] + sizes + (["--repeats", "2", "--warmup", "1"] if quick else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout)[-800:]}
    return json.loads(lines[-1])


def _torch_peer() -> str:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "skipped: torch is not installed here"
    return "not run by this script"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="mlp")
    p.add_argument("--mode", default="smp")
    p.add_argument("--t", type=int, default=1)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary of the memory-budget GPT-2")
    p.add_argument("--partitions", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--sp", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--only-sequence", action="store_true", help="print only the sequence-parallel rows")
    args = p.parse_args()
    if args.case:
        case = {"budget": _budget_case, "gradients": _gradients_case, "sequence": _sequence_case}.get(args.model, _case)
        print(json.dumps(case(args)))
        return
    if args.only_sequence:
        _sequence_table(args.quick, args.repeats)
        return
    if args.quick:
        mlp_sizes, gpt_sizes = ["--width", "128", "--tokens", "64"], ["--width", "128", "--tokens", "64", "--seq", "32"]
    else:
        mlp_sizes = ["--width", "2048", "--tokens", "1024"]
        gpt_sizes = ["--width", "1024", "--tokens", "1024", "--seq", "256"]
    extra = ["--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    rows = []
    results = {}
    for model, sizes, label in (("mlp", mlp_sizes, "MLP block"), ("gpt2", gpt_sizes, "GPT-2 block")):
        one = _run(model, "plain", 1, 1, sizes + extra, args.quick)
        smp1 = _run(model, "smp", 1, 1, sizes + extra, args.quick)
        two = _run(model, "smp", 2, 2, sizes + extra, args.quick)
        results[model] = {"plain_t1": one, "smp_t1": smp1, "smp_t2": two}
        if any("error" in r for r in (one, smp1, two)):
            rows.append((label, "error", next(r["error"] for r in (one, smp1, two) if "error" in r)))
            continue
        target = ">= 1.8" if model == "mlp" else "-"
        ratio = one["median"] / two["median"]
        rows.append((label, f"{one['median']:.3f}", f"{smp1['median']:.3f}", f"{two['median']:.3f}",
                     f"{ratio:.2f}", f"{smp1['median'] / two['median']:.2f}", target,
                     ("PASS" if ratio >= 1.8 else "FAIL") if model == "mlp" else "",
                     f"{two['all_reduces']} / {two['all_gathers']}", f"{two['reshard_mib']:.1f}",
                     f"{two['activation_all_reduces']} x, {two['activation_reduced_mib']:.0f} MiB",
                     f"{two['predicted_reduced_mib']:.0f} MiB"))
    head = ("case", "t=1 plain s", "t=1 smp s", "t=2 smp s", "plain/t2", "smp t1/t2", "target", "result",
            "all-reduce / all-gather", "reshard MiB/dev", "activations all-reduced", "Megatron")
    widths = [max(len(str(r[i])) if i < len(r) else 0 for r in rows + [head]) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print()
    for model in results:
        two = results[model].get("smp_t2", {})
        if "variable_bytes_by_device" in two:
            print(f"{model}: split variables {two['sharded_variables']} (stored split: {two['stored_split']}); "
                  f"variable bytes by device at t=2: "
                  + ", ".join(f"{d}: {b / 2**20:.1f} MiB" for d, b in sorted(two["variable_bytes_by_device"].items()))
                  + f"; ops run whole: {two['whole_ops'] or 'none'}")
    for model in results:
        two = results[model].get("smp_t2", {})
        if "variable_bytes_by_device" in two:
            per_device = {}
            for table in (two["variable_bytes_by_device"], two["adam_slot_bytes_by_device"]):
                for d, b in table.items():
                    per_device[d] = per_device.get(d, 0) + b
            whole = two["variable_bytes"] * 3  # the variables and Adam's two slots at t=1
            ratio = max(per_device.values()) / whole
            predicted = two["predicted_bytes_by_device"]
            print(f"{model}: variables + Adam slots on the fullest device at t=2 / t=1: {ratio:.2f} "
                  f"(target <= 0.55: {'PASS' if ratio <= 0.55 else 'FAIL'}); by device, live / predicted: "
                  + ", ".join(f"{d} {per_device.get(d, 0) / 2**20:.1f} / {predicted.get(d, 0) / 2**20:.1f} MiB"
                              for d in sorted(set(per_device) | set(predicted))))
    results["gradients"] = _gradients_table(args.quick)
    vocab = "16384" if args.quick else str(args.vocab)
    cmd = [sys.executable, __file__, "--case", "--model", "budget", "--vocab", vocab]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
    if done.returncode or not lines:
        print("GPT-2 over a per-device memory budget: error " + (done.stderr or done.stdout)[-600:])
    else:
        b = json.loads(lines[-1])
        results["budget"] = b
        gap = max((abs(a - r) / abs(r) for a, r in zip(b["losses"], b["ref_losses"])), default=float("nan"))
        ok = b["t1"] == "MemoryBudgetError" and b["t2"] == "trains" and gap <= 1e-5
        print(f"GPT-2 LM, tied embedding {b['embedding_mib']:.1f} MiB (vocabulary {vocab}): largest device's predicted "
              f"peak {b['peak_t1'] / 2**20:.1f} MiB at P=2 x t=1, {b['peak_t2'] / 2**20:.1f} MiB at P=2 x t=2; budget "
              f"{b['budget'] / 2**20:.1f} MiB per device: P=2 x t=1 {b['t1']}, P=2 x t=2 {b['t2']}, loss against the "
              f"single-device loop within {gap:.1e} over {len(b['losses'])} Adam steps "
              f"(target: MemoryBudgetError, trains, within 1e-5: {'PASS' if ok else 'FAIL'})")
    results["sequence"] = _sequence_table(args.quick, args.repeats)
    print(f"PyTorch tensor-parallel peer: {_torch_peer()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
