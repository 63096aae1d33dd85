"""Sharded data parallelism benchmark: what ``shard_optimizer_state`` divides, and what it costs.

Prints one table, two replicas (processes on 127.0.0.1, one core each) of
an MLP (P=2, M=4, Adam), with plain data parallelism and with the optimizer
state sharded:

* model-state bytes each replica holds, live (the variables' storage, read
  after training) and predicted (``step.memory_report(optimizer)``):
  parameters, gradients (one accumulated gradient per variable) and
  optimizer state, and the ratio sharded / plain;
* the median step time and its ratio to plain data parallelism; under
  sharding the time of the collectives it adds (the gradients' all-to-all
  and the parameters' all-gather, measured alone on the same bytes) and of
  the plain all-reduce they replace.

Every configuration runs in fresh processes started by this script, with
every wait bounded.

Usage: python benchmarks/sharded_data_parallel/bench.py [--repeats 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------
# a replica (run in its own process)
# --------------------------------------------------------------------------
def _pin(rank: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _model_state(model, optimizer, report) -> dict:
    """Bytes this replica holds: live storage, and the memory report's."""
    import numpy as np

    from smp_tf.sharding import storage

    def stored(v) -> int:
        tv = getattr(v, "value", v)
        piece = storage.local_piece_of(tv)
        shape = (tv if piece is None else piece).shape
        return int(np.prod(shape)) * tv.dtype.size

    params = sum(stored(v) for v in model.trainable_variables)
    slots = sum(stored(v) for v in optimizer.variables if len(v.shape) and int(np.prod(v.shape)) > 1)
    rows = report.partitions
    return {
        "params": params,
        # Gradients are tensors of the step, not storage: predicted only.
        "grads": None,
        "optimizer": slots,
        "predicted_params": sum(r.variables for r in rows),
        "predicted_grads": sum(r.gradients for r in rows),
        "predicted_optimizer": sum(r.optimizer for r in rows),
    }


def _gpt2_lm(args, rng, seq: int, vocab: int, heads: int):
    """A keras_hub GPT-2 language model of ``--layers`` blocks of width
    ``--width`` (its embedding tied to its output), one batch of
    ``--batch`` random sequences, and its loss: (model, x, y, loss_of)."""
    import keras
    import keras_hub
    import tensorflow as tf

    import smp_tf as smp

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_layers=args.layers, num_heads=heads, hidden_dim=args.width,
        intermediate_dim=4 * args.width, dropout=0.0, max_sequence_length=seq)
    inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
    model = smp.DistributedModel(inputs, backbone.token_embedding(backbone(inputs), reverse=True))
    tokens = rng.integers(0, vocab, size=(args.batch, seq + 1)).astype("int32")
    x = {"token_ids": tf.constant(tokens[:, :-1]), "padding_mask": tf.ones((args.batch, seq), "int32")}
    y = tf.constant(tokens[:, 1:])

    def loss_of(x, y):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x, training=True)))

    return model, x, y, loss_of


def worker_step(args) -> None:
    import smp_tf as smp

    rank = int(os.environ.get("SMP_TF_RANK", "0"))
    _pin(rank)
    smp.init({"partitions": 2, "microbatches": 4, "horovod": True, "dp_timeout": 120,
              "shard_optimizer_state": args.sharded == "on"})
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(rank)
    if args.model == "gpt2":
        model, x, y, loss_of = _gpt2_lm(args, rng, seq=128, vocab=1024, heads=4)
    else:
        inp = keras.Input((args.width,))
        h = inp
        for _ in range(args.layers):
            h = keras.layers.Dense(args.width, activation="relu")(h)
        model = smp.DistributedModel(inp, keras.layers.Dense(args.width)(h))
        x = y = tf.constant(rng.normal(size=(args.batch, args.width)).astype("float32"))

        def loss_of(x, y):
            return tf.reduce_mean(tf.square(model(x, training=True) - y))
    optimizer = keras.optimizers.Adam(1e-4)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train(x, y):
        loss, grads = step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    for _ in range(3):
        train(x, y).numpy()
    times = []
    for _ in range(args.repeats):
        smp.barrier()
        t = time.perf_counter()
        train(x, y).numpy()
        times.append(time.perf_counter() - t)
    state = _model_state(model, optimizer, step.memory_report(optimizer))
    if rank == 0:
        print("RESULT " + json.dumps({"step": statistics.median(times), **state}), flush=True)


def worker_fits(args) -> None:
    """A keras_hub GPT-2 with Adam, 3 steps at R=2 (P=2, M=4), under the
    memory budget `--budget` (bytes per device; 0: none) and whatever
    ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` the environment sets. Prints the
    outcome (``trains``, ``MemoryBudgetError`` or ``OOM``), the losses, the
    largest device's and the process's predicted peak, and the allocator's
    measured peak of the process over the steps after the first."""
    import smp_tf as smp

    rank = int(os.environ.get("SMP_TF_RANK", "0"))
    _pin(rank)
    config = {"partitions": 2, "microbatches": 4, "horovod": True, "dp_timeout": 60,
              "shard_optimizer_state": args.sharded == "on"}
    if args.budget:
        config["memory_budget"] = args.budget
    smp.init(config)
    import keras
    import numpy as np
    import tensorflow as tf

    from smp_tf.memory import MemoryBudgetError

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(rank)
    model, x, y, loss_of = _gpt2_lm(args, rng, seq=64, vocab=args.vocab, heads=8)
    optimizer = keras.optimizers.Adam(1e-4)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x, y)
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function(autograph=False)
    def train(x, y):
        loss, grads = step(x, y)
        accumulated = [g.accumulate() for g in grads]
        if args.without_update:
            # The gradients reduced over the replicas, then only summed: the
            # peak without the optimizer's update.
            used = [tf.reduce_sum(tf.convert_to_tensor(a)) for a in accumulated if a is not None]
            return loss.reduce_mean() + 0.0 * tf.add_n(used)
        optimizer.apply_gradients(zip(accumulated, model.trainable_variables))
        return loss.reduce_mean()

    out = {"outcome": "trains", "losses": [], "measured_peak": None, "first_peak": None}
    bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() == "true"
    try:
        if bfc:
            tf.config.experimental.reset_memory_stats("CPU:0")
        # The first step also builds the optimizer's slots.
        out["losses"].append(float(train(x, y)))
        if bfc:
            out["first_peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(2):
            out["losses"].append(float(train(x, y)))
        if bfc:
            out["measured_peak"] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except MemoryBudgetError as e:
        out["outcome"], out["detail"] = "MemoryBudgetError", str(e).splitlines()[0][:160]
    except Exception as e:  # noqa: BLE001 - the outcome is the result: OOM, or the peer's failure
        out["outcome"] = "OOM" if "OOM" in str(e) or isinstance(e, tf.errors.ResourceExhaustedError) else type(e).__name__
        limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
        if out["outcome"] == "CancelledError" and limit:
            # TensorFlow raises an OOM inside a function call as its
            # cancellation; the allocator's peak says whether it was one.
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            if peak >= 0.9 * int(limit) * (1 << 20):
                out["outcome"] = "OOM (as CancelledError)"
        out["detail"] = str(e).splitlines()[0][:160]
    if step.last_compiled is not None:
        report = step.memory_report(optimizer)
        out["device_peak"] = max(r.total for r in report.partitions)
        out["process_peak"] = report.process_peak
        out["optimizer"] = sum(r.optimizer for r in report.partitions)
    # Each replica's figures in a file of its own (after a failure the
    # replicas' collectives cannot be trusted to gather them).
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if rank == 0:
        print("RESULT {}", flush=True)
    sys.stdout.flush()
    # A replica that ran out of memory leaves its peer's collectives open:
    # end without waiting for them.
    os._exit(0)


def worker_collectives(args) -> None:
    """The collectives of one step on the model's bytes, timed alone:
    all-reduce (plain), all-to-all + all-gather (sharded)."""
    import smp_tf as smp

    rank = int(os.environ.get("SMP_TF_RANK", "0"))
    _pin(rank)
    smp.init({"partitions": 1, "horovod": True, "dp_timeout": 120})
    import tensorflow as tf

    from smp_tf.distributed import collectives

    n = args.elements
    device = "/device:CPU:0"
    with tf.device(device):
        x = tf.ones([n + n % 2], tf.float32)

    @tf.function
    def all_reduce():
        return collectives.all_reduce_sum(x, 0, device, collectives.instance_key("bench-ar", n))

    @tf.function
    def scatter_gather():
        piece = collectives.reduce_scatter_sum(tf.reshape(x, [2, -1]), 0, device, collectives.instance_key("bench-rs", n))
        return collectives.all_gather(piece, 0, device, collectives.instance_key("bench-ag", n))

    out = {}
    for name, fn in (("all_reduce", all_reduce), ("scatter_gather", scatter_gather)):
        for _ in range(3):
            fn().numpy()
        times = []
        for _ in range(args.repeats):
            smp.barrier()
            t = time.perf_counter()
            fn().numpy()
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    if rank == 0:
        print("RESULT " + json.dumps({**out, "bytes": 4 * n}), flush=True)


# --------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------
def run(role: str, extra: list, timeout: float = 900.0) -> dict:
    """This script's `role` in two replicas (`benchmarks.machine.run_workers`)."""
    sys.path.insert(0, ROOT)
    from benchmarks.machine import run_workers

    return run_workers(__file__, role, 2, extra, timeout)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f}"


def fits_table(args) -> None:
    """The 'fits only when sharded' table (module doc of `worker_fits`):
    reference runs without a limit, then the budget and the allocator limit
    each set between the plain and the sharded figure."""
    sys.path.insert(0, ROOT)
    from benchmarks.machine import aligned

    model = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch),
             "--vocab", str(args.vocab)]
    held = {k: os.environ.get(k) for k in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB",
                                           "TF_ENABLE_ONEDNN_OPTS")}

    def fits(sharded: str, budget: int = 0, limit_mib: int = 0, without_update: bool = False) -> dict:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        # oneDNN's einsum kernel aborts the process when the allocator
        # refuses its scratch (a failed check in TensorFlow 2.21) instead of
        # raising ResourceExhaustedError: every run of this table uses
        # TensorFlow's own kernels.
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
        if limit_mib:
            os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(limit_mib)
        else:
            os.environ.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
        with tempfile.TemporaryDirectory() as out:
            try:
                run("fits", model + ["--sharded", sharded, "--budget", str(budget), "--out", out]
                    + (["--without-update"] if without_update else []), timeout=600)
            finally:
                for k, v in held.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            ranks = []
            for name in sorted(os.listdir(out)):
                with open(os.path.join(out, name)) as f:
                    ranks.append(json.load(f))
        # The fuller replica's figures, and what happened to each: a replica
        # whose peer ran out of memory sees its collectives fail.
        merged = dict(ranks[0])
        merged["outcome"] = " / ".join(dict.fromkeys(r["outcome"] for r in ranks))
        for key in ("measured_peak", "first_peak"):
            values = [r[key] for r in ranks if r.get(key) is not None]
            merged[key] = max(values) if values else None
        return merged

    plain, sharded = fits("off"), fits("on")
    plain_pipe, sharded_pipe = fits("off", without_update=True), fits("on", without_update=True)
    budget = (plain["device_peak"] + sharded["device_peak"]) // 2
    peak = {name: max(r["measured_peak"], r["first_peak"]) for name, r in (("plain", plain), ("sharded", sharded))}
    limit = int((peak["plain"] + peak["sharded"]) / 2 / (1 << 20))
    runs = [("plain, no limit", plain, "-", "-"), ("sharded, no limit", sharded, "-", "-"),
            ("plain, memory_budget", fits("off", budget=budget), _mib(budget), "-"),
            ("sharded, memory_budget", fits("on", budget=budget), _mib(budget), "-"),
            ("plain, allocator limit", fits("off", limit_mib=limit), "-", str(limit)),
            ("sharded, allocator limit", fits("on", limit_mib=limit), "-", str(limit))]
    rows = []
    for label, r, b, l in runs:
        same = ("-" if not r["losses"] else
                "equal" if r["losses"] == plain["losses"][:len(r["losses"])] else
                f"{max(abs(a - c) / abs(c) for a, c in zip(r['losses'], plain['losses'])):.1e}")
        rows.append((label, b, l, r["outcome"], " ".join(f"{v:.4f}" for v in r["losses"]) or "-", same,
                     _mib(r["device_peak"]) if r.get("device_peak") else "-",
                     _mib(r["process_peak"]) if r.get("process_peak") else "-",
                     _mib(r["first_peak"]) if r.get("first_peak") else "-",
                     _mib(r["measured_peak"]) if r.get("measured_peak") else "-",
                     f"{r['measured_peak'] / r['process_peak']:.2f}" if r.get("measured_peak") else "-"))
    print(f"fits only when sharded: 2 replicas x (keras_hub GPT-2, {args.layers} blocks of width {args.width}, "
          f"vocabulary {args.vocab}, sequence 64, P=2, M=4, batch {args.batch}, Adam), 1 core each, 3 steps")
    header = ("run", "budget MiB", "limit MiB", "outcome", "losses", "vs plain", "pred device MiB",
              "pred process MiB", "first step MiB", "later steps MiB", "later/pred")
    print("\n".join(aligned(header, rows, left=[0, 3, 4])))
    print("allocator peak without the optimizer's update (gradients reduced, then only summed): "
          f"plain {_mib(plain_pipe['measured_peak'])} MiB, sharded {_mib(sharded_pipe['measured_peak'])} MiB; "
          f"the update adds {_mib(plain['measured_peak'] - plain_pipe['measured_peak'])} and "
          f"{_mib(sharded['measured_peak'] - sharded_pipe['measured_peak'])} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="main")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a small model, for a smoke test")
    parser.add_argument("--sharded", default="off")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", default="mlp", choices=("mlp", "gpt2"),
                        help="an MLP of --layers x Dense(--width), or a keras_hub GPT-2 of --layers blocks of "
                             "width --width (sequence 128, vocabulary 1024)")
    parser.add_argument("--elements", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--without-update", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=16384, help=argparse.SUPPRESS)
    parser.add_argument("--fits", action="store_true",
                        help="only the 'fits only when sharded' table: a keras_hub GPT-2 (--layers, --width, "
                             "vocabulary 16384, sequence 64) under a memory budget and an allocator limit")
    args = parser.parse_args()
    if args.role != "main":
        {"step": worker_step, "collectives": worker_collectives, "fits": worker_fits}[args.role](args)
        return
    if args.fits:
        if args.quick:
            args.layers, args.width, args.batch, args.vocab = 1, 64, 8, 1024
        fits_table(args)
        return
    if args.quick:
        args.repeats, args.layers, args.width, args.batch = 3, 2, 128, 16
    model = ["--repeats", str(args.repeats), "--layers", str(args.layers), "--width", str(args.width),
             "--batch", str(args.batch), "--model", args.model]
    started = time.time()
    # Alternate the order, and keep each configuration's faster run: a
    # burst of other work on the machine slows one run, not the comparison.
    runs = {"off": [], "on": []}
    for order in (("off", "on"), ("on", "off")):
        for sharded in order:
            runs[sharded].append(run("step", model + ["--sharded", sharded]))
    plain, sharded = (min(runs[k], key=lambda r: r["step"]) for k in ("off", "on"))
    comm = run("collectives", model + ["--elements", str(plain["params"] // 4)])

    def row(label, keys):
        p, s = (None if any(r[k] is None for k in keys) else sum(r[k] for k in keys) for r in (plain, sharded))
        pp, sp = (sum(r[f"predicted_{k}"] for k in keys) for r in (plain, sharded))
        live = ("-", "-", "-") if p is None else (_mib(p), _mib(s), f"{s / p:.2f}")
        return (label,) + live + (_mib(pp), _mib(sp), f"{sp / pp:.2f}")

    rows = [row("parameters", ["params"]), row("gradients", ["grads"]), row("optimizer state", ["optimizer"]),
            row("gradients + optimizer", ["grads", "optimizer"]),
            row("parameters + gradients + optimizer", ["params", "grads", "optimizer"])]
    sys.path.insert(0, ROOT)
    from benchmarks.machine import aligned

    header = ("per replica (MiB)", "plain live", "sharded live", "ratio", "plain pred", "sharded pred", "ratio")
    described = (f"GPT-2, {args.layers} blocks of width {args.width}, sequence 128" if args.model == "gpt2"
                 else f"MLP {args.layers + 1} x Dense({args.width})")
    print(f"2 replicas x ({described}, P=2, M=4, batch {args.batch}, Adam), 1 core each")
    print("\n".join(aligned(header, rows, left=[0])))
    print()
    steps = [
        ("plain data parallelism", f"{plain['step'] * 1e3:.1f}", "1.00"),
        ("shard_optimizer_state", f"{sharded['step'] * 1e3:.1f}", f"{sharded['step'] / plain['step']:.2f}"),
        (f"  all-reduce of {_mib(comm['bytes'])} MiB alone (plain's collective)", f"{comm['all_reduce'] * 1e3:.1f}",
         ""),
        (f"  all-to-all + all-gather of {_mib(comm['bytes'])} MiB alone (sharded's)",
         f"{comm['scatter_gather'] * 1e3:.1f}", f"{comm['scatter_gather'] / comm['all_reduce']:.2f}"),
    ]
    print("\n".join(aligned(("step", "median ms", "ratio"), steps, left=[0])))
    print(f"\nmedians of {args.repeats} steps, the faster of 2 runs each (alternating order); "
          f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
