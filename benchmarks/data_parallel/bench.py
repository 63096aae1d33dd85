"""Data-parallel benchmark: the all-reduce, and what it costs a training step.

Prints one table:

(a) all-reduce of 1, 4, 16 and 64 MiB of float32 between 2 processes on this
    machine (smp_tf's collective: TensorFlow's ring all-reduce over gRPC),
    median time and bus bandwidth ``2 (n-1)/n * bytes / time``;
(b) the transport's ceiling: the same bytes copied one way over a plain TCP
    socket between 2 processes on 127.0.0.1, median time and bandwidth;
(c) the step time of a model whose compute dominates (an MLP, 2 partitions,
    4 micro-batches), for 1 replica and for 2 replicas (each replica pinned to
    one core, so each has the same compute as the single replica): the ratio
    is 1.0 when data parallelism costs nothing; with the all-reduce
    overlapping the rest of the pipeline (the default) and without it.

Every configuration runs in fresh processes (smp.init must run before
TensorFlow starts) started by this script on 127.0.0.1, with every wait
bounded.

Usage: python benchmarks/data_parallel/bench.py [--repeats 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES_MIB = (1, 4, 16, 64)


# --------------------------------------------------------------------------
# workers (run in their own processes)
# --------------------------------------------------------------------------
def _pin(rank: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def worker_allreduce(args) -> None:
    import smp_tf as smp

    smp.init({"partitions": 1, "horovod": True, "dp_timeout": 120})
    import tensorflow as tf

    from smp_tf.distributed import collectives

    results = {}
    for mib in args.sizes:
        n = mib * (1 << 20) // 4
        with tf.device("/device:CPU:0"):
            x = tf.ones([n], tf.float32)
        key = collectives.instance_key("bench", n)

        @tf.function(autograph=False)
        def reduce(x=x, key=key):
            return collectives.all_reduce_sum(x, 0, "/device:CPU:0", key)[0]

        for _ in range(3):
            reduce().numpy()
        times = []
        for _ in range(args.repeats):
            smp.barrier()
            t = time.perf_counter()
            reduce().numpy()
            times.append(time.perf_counter() - t)
        results[mib] = statistics.median(times)
    if smp.rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)


def worker_tcp(args) -> None:
    rank, port = int(os.environ["BENCH_RANK"]), int(os.environ["BENCH_PORT"])
    results = {}
    if rank == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        server.settimeout(60)
        conn, _ = server.accept()
        conn.settimeout(60)
        for mib in args.sizes:
            for _ in range(args.repeats + 2):
                left = mib << 20
                while left:
                    left -= len(conn.recv(min(left, 1 << 20)))
                conn.sendall(b"k")
        conn.close()
        server.close()
        return
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    for mib in args.sizes:
        payload = b"\0" * (mib << 20)
        times = []
        for i in range(args.repeats + 2):
            t = time.perf_counter()
            conn.sendall(payload)
            conn.recv(1)
            if i >= 2:
                times.append(time.perf_counter() - t)
        results[mib] = statistics.median(times)
    conn.close()
    print("RESULT " + json.dumps(results), flush=True)


def worker_step(args) -> None:
    import smp_tf as smp

    replicas = int(os.environ.get("SMP_TF_SIZE", "1"))
    _pin(int(os.environ.get("SMP_TF_RANK", "0")))
    smp.init({"partitions": 2, "microbatches": 4, "horovod": replicas > 1, "dp_timeout": 120})
    import keras
    import numpy as np
    import tensorflow as tf

    from smp_tf.distributed import collectives

    collectives.OVERLAP = args.overlap == "on"
    keras.utils.set_random_seed(0)
    inp = keras.Input((args.width,))
    h = inp
    for i in range(args.layers):
        h = keras.layers.Dense(args.width, activation="relu")(h)
    model = smp.DistributedModel(inp, keras.layers.Dense(args.width)(h))
    optimizer = keras.optimizers.SGD(1e-3)
    x = np.random.default_rng(smp.rank()).normal(size=(args.batch, args.width)).astype("float32")

    @smp.step
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - x))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train(x):
        loss, grads = step(x)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    x = tf.constant(x)
    for _ in range(3):
        train(x).numpy()
    times = []
    for _ in range(args.repeats):
        smp.barrier()
        t = time.perf_counter()
        train(x).numpy()
        times.append(time.perf_counter() - t)
    grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    if smp.rank() == 0:
        print("RESULT " + json.dumps({"step": statistics.median(times), "grad_bytes": grad_bytes}), flush=True)


# --------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------
def run(role: str, processes: int, extra: list, timeout: float = 600.0) -> dict:
    """This script's `role` in `processes` processes (`benchmarks.machine.run_workers`)."""
    sys.path.insert(0, ROOT)
    from benchmarks.machine import run_workers

    return run_workers(__file__, role, processes, extra, timeout, replicas=role != "tcp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", default="main")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES_MIB))
    parser.add_argument("--overlap", default="on")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if args.role != "main":
        {"allreduce": worker_allreduce, "tcp": worker_tcp, "step": worker_step}[args.role](args)
        return
    if args.quick:
        args.sizes, args.repeats, args.layers, args.width, args.batch = [1, 4], 3, 3, 256, 64
    common = ["--repeats", str(args.repeats), "--sizes", ",".join(map(str, args.sizes))]
    model = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    started = time.time()
    allreduce = run("allreduce", 2, common)
    tcp = run("tcp", 2, common)
    one = run("step", 1, common + model)
    two = run("step", 2, common + model + ["--overlap", "on"])
    two_serial = run("step", 2, common + model + ["--overlap", "off"])

    rows = []
    for mib in args.sizes:
        t, c = allreduce[str(mib)], tcp[str(mib)]
        nbytes = mib << 20
        rows.append(("(a)", f"all-reduce {mib} MiB, 2 processes (ring over gRPC)", f"{t * 1e3:.1f} ms",
                     f"{nbytes / t / 1e9:.2f} GB/s", f"{c / t:.2f}"))
        rows.append(("(b)", f"TCP copy {mib} MiB, 127.0.0.1", f"{c * 1e3:.1f} ms", f"{nbytes / c / 1e9:.2f} GB/s", ""))
    gib = two["grad_bytes"] / (1 << 20)
    rows.append(("(c)", f"1 replica: MLP {args.layers}x{args.width}, batch {args.batch}, P=2 M=4, 1 core",
                 f"{one['step'] * 1e3:.1f} ms", "", "1.00"))
    rows.append(("(c)", f"2 replicas, 1 core each, all-reduce {gib:.1f} MiB overlapping the pipeline",
                 f"{two['step'] * 1e3:.1f} ms", "", f"{two['step'] / one['step']:.2f}"))
    rows.append(("(c)", "2 replicas, 1 core each, all-reduce after the pipeline",
                 f"{two_serial['step'] * 1e3:.1f} ms", "", f"{two_serial['step'] / one['step']:.2f}"))
    sys.path.insert(0, ROOT)
    from benchmarks.machine import aligned

    header = ("part", "case", "median time", "bandwidth", "ratio")
    print("\n".join(aligned(header, rows, left=range(len(header)))))
    print("\nratio: (a) TCP time / all-reduce time (the all-reduce's share of the transport's ceiling); "
          "(c) step time / 1 replica's (1.00 = data parallelism costs nothing)")
    print(f"bandwidth: (a) bus bandwidth 2(n-1)/n * bytes / time, n=2; medians of {args.repeats}; "
          f"total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
