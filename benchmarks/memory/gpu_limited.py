"""A model too large for one memory-limited GPU trains with smp_tf at P=4.

Needs one physical GPU visible to TensorFlow; without one it prints a
``SKIPPED: ...`` line and exits with 0. GPU 0 is split into four logical GPUs
of ``--limit-mib`` MiB each (``tf.config.set_logical_device_configuration``,
before anything else touches the GPU), and a GPT-2 style language model
(keras_hub ``GPT2Backbone``, tied output embedding; sizes from the flags) is
trained:

1. on one device: a plain `tf.function` step (forward, loss, gradients) under
   ``tf.device("/GPU:0")`` on the full batch, which should fail with
   ``tf.errors.ResourceExhaustedError`` (its error is printed). This attempt
   runs in a subprocess of this script (``--one-device``), so that an
   exhausted allocator cannot disturb what follows;
2. with smp_tf: ``smp.init`` with 4 partitions (it uses the GPUs TensorFlow
   sees, the four logical GPUs) and M micro-batches; ``--steps`` training
   steps (with the optimizer applying the accumulated gradients), printing the
   loss of each, then ``step.measure_memory(x, y, optimizer=...)``: the
   predicted peak of every partition next to the peak measured on its
   logical GPU's own allocator.

Run ``python benchmarks/memory/gpu_limited.py`` (``--help`` for the flags).
By the estimate in README.md the default sizes need well above the
default limit for the one-device step's activations; 4 x ``--limit-mib``
must fit on the GPU.
See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SKIP_LINE = ("SKIPPED: no GPU visible to TensorFlow (this benchmark needs one physical GPU, split into "
             "logical GPUs with memory limits)")
PARTITIONS = 4
_MARK = "@@SMP_ONE_DEVICE_RESULT@@"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-mib", type=int, default=10240,
                    help="memory limit of each of the 4 logical GPUs, in MiB (default 10240)")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    ap.add_argument("--width", type=int, default=768, help="hidden width (default 768)")
    ap.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    ap.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches M (default 8)")
    ap.add_argument("--pipeline", choices=("interleaved", "simple"), default="interleaved",
                    help="schedule (default interleaved)")
    ap.add_argument("--recompute", choices=("never", "selective", "full", "auto"), default="never",
                    help="smp_tf activation recomputation (default never)")
    ap.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="optimizer (default adam)")
    ap.add_argument("--steps", type=int, default=3, help="smp_tf training steps (default 3)")
    ap.add_argument("--skip-one-device", action="store_true", help="do not attempt the one-device step")
    ap.add_argument("--one-device", action="store_true", help=argparse.SUPPRESS)  # internal: the subprocess
    args = ap.parse_args(argv)
    if args.width % args.heads:
        ap.error("--width must be a multiple of --heads")
    if args.batch % args.microbatches:
        ap.error("--batch must be a multiple of --microbatches")
    return args


def split_gpu(tf, limit_mib: int):
    """Splits the first physical GPU into `PARTITIONS` logical GPUs of
    `limit_mib` MiB each; returns the physical GPUs (empty: none visible)."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)] * PARTITIONS
        )
    return gpus


def build_model(keras, model_cls, args):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_heads=args.heads, hidden_dim=args.width,
        intermediate_dim=4 * args.width, max_sequence_length=args.seq, dropout=0.1,
    )
    tok = keras.Input((args.seq,), dtype="int32", name="token_ids")
    pad = keras.Input((args.seq,), dtype="int32", name="padding_mask")
    h = backbone({"token_ids": tok, "padding_mask": pad})
    logits = backbone.token_embedding(h, reverse=True)
    return model_cls({"token_ids": tok, "padding_mask": pad}, logits)


def make_batch(tf, args):
    """Random tokens, next-token labels; kept in host memory."""
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1))
    with tf.device("/device:CPU:0"):
        x = {"token_ids": tf.constant(tokens[:, :-1], tf.int32),
             "padding_mask": tf.ones((args.batch, args.seq), tf.int32)}
        y = tf.constant(tokens[:, 1:], tf.int32)
    return x, y


def smp_train_step(smp, tf, model, loss_fn, opt):
    """The `smp.step` of forward, loss and gradients, and a `tf.function` that
    runs it and applies the accumulated gradients, returning the mean loss."""

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train(x, y):
        loss, grads = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    return step, train


def sizes_line(args) -> str:
    return (f"GPT-2 LM (keras_hub GPT2Backbone, tied output embedding): {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, sequence {args.seq}, vocabulary {args.vocab}, batch {args.batch}")


def first_lines(text: str, n: int = 4, width: int = 300) -> str:
    lines = [line[:width] for line in str(text).strip().splitlines() if line.strip()]
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


# ---------------------------------------------------------------------------
# 1. One device (runs in a subprocess)


def one_device(args) -> int:
    import tensorflow as tf

    split_gpu(tf, args.limit_mib)
    import keras

    result = {}
    try:
        with tf.device("/GPU:0"):
            model = build_model(keras, keras.Model, args)
        x, y = make_batch(tf, args)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def plain(x, y):
            with tf.device("/GPU:0"):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
            return loss, grads

        tf.config.experimental.reset_memory_stats("GPU:0")
        with tf.device("/GPU:0"):
            loss, _ = plain(x, y)
        result = {"status": "fits", "loss": float(loss.numpy()),
                  "peak": tf.config.experimental.get_memory_info("GPU:0")["peak"]}
    except tf.errors.ResourceExhaustedError as e:
        result = {"status": "oom", "type": type(e).__name__, "message": first_lines(e.message, 6)}
    except Exception as e:  # noqa: BLE001 - reported by the parent
        result = {"status": "error", "type": type(e).__name__, "message": first_lines(str(e), 6)}
    sys.stdout.write(_MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def run_one_device(args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one-device"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in sorted(vars(args).items())
        if k not in ("one_device", "skip_one_device")
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    return {"status": "crashed", "type": f"exit code {proc.returncode}",
            "message": first_lines(proc.stderr[-4000:], 8)}


# ---------------------------------------------------------------------------
# 2. smp_tf, P=4


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one_device:
        return one_device(args)

    import tensorflow as tf

    # Before anything else uses the GPU: four logical GPUs with memory limits.
    gpus = split_gpu(tf, args.limit_mib)
    if not gpus:
        print(SKIP_LINE)
        return 0
    from benchmarks.machine import versions

    print(f"smp_tf on one memory-limited GPU: {len(gpus)} physical GPU(s) visible, GPU 0 split into "
          f"{PARTITIONS} logical GPUs of {args.limit_mib} MiB each; {versions()}")
    print(sizes_line(args))
    print()

    # 1. One device. The subprocess runs before this process starts its
    # GPU runtime, so it has the GPU to itself.
    if args.skip_one_device:
        print("one device (plain tf.function on /GPU:0): skipped (--skip-one-device)")
    else:
        t0 = time.perf_counter()
        one = run_one_device(args)
        took = time.perf_counter() - t0
        if one["status"] == "oom":
            print(f"one device (plain tf.function on /GPU:0, full batch, limit {args.limit_mib} MiB): "
                  f"FAILED as expected with tf.errors.{one['type']} ({took:.0f} s):")
            print("  " + one["message"].replace("\n", "\n  "))
        elif one["status"] == "fits":
            print(f"one device (plain tf.function on /GPU:0): it FITS (loss {one['loss']:.4f}, peak "
                  f"{one['peak'] / 2**20:.0f} MiB of {args.limit_mib} MiB): the model is not too large for one "
                  "device; raise --batch/--seq/--layers or lower --limit-mib")
        else:
            print(f"one device (plain tf.function on /GPU:0): ended with {one['type']} (not an out-of-memory "
                  f"error):\n  " + one["message"].replace("\n", "\n  "))
    print()

    # 2. smp_tf, four partitions, one per logical GPU.
    import smp_tf as smp

    try:
        smp.init({"partitions": PARTITIONS, "microbatches": args.microbatches, "pipeline": args.pipeline,
                  "recompute": args.recompute})
    except Exception as e:  # noqa: BLE001
        print(f"FAILED: smp.init(partitions={PARTITIONS}) on {PARTITIONS} logical GPUs: "
              f"{type(e).__name__}: {first_lines(str(e), 6)}")
        return 1
    import keras

    print(f"smp_tf: partitions {PARTITIONS} on {', '.join(smp.topology().devices)}, {args.microbatches} "
          f"micro-batches, {args.pipeline} schedule, recompute={args.recompute}, optimizer {args.optimizer}")
    model = build_model(keras, smp.DistributedModel, args)
    x, y = make_batch(tf, args)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(1e-4) if args.optimizer == "adam" else keras.optimizers.SGD(1e-3)

    step, train = smp_train_step(smp, tf, model, loss_fn, opt)

    status = 0
    try:
        for i in range(args.steps):
            t0 = time.perf_counter()
            loss = float(train(x, y).numpy())
            print(f"  step {i + 1}: loss {loss:.4f} ({time.perf_counter() - t0:.1f} s"
                  + (", first call: tracing, partitioning" if i == 0 else "") + ")")
        try:
            report = step.measure_memory(x, y, optimizer=opt)
        except tf.errors.ResourceExhaustedError:
            raise
        except Exception:  # noqa: BLE001 - shown, then measured without the optimizer's state
            import traceback

            status = 1
            print(f"FAILED: step.measure_memory(x, y, optimizer={type(opt).__name__}):\n"
                  + traceback.format_exc().rstrip())
            print("measuring again without the optimizer (its state then is not in the predicted figures)")
            report = step.measure_memory(x, y)
    except tf.errors.ResourceExhaustedError as e:
        print(f"FAILED: smp_tf at P={PARTITIONS} ran out of memory too: {first_lines(e.message, 6)}")
        return 1
    except Exception:  # noqa: BLE001 - e.g. MemoryBudgetError: the prediction does not fit the limit
        import traceback

        print(f"FAILED: smp_tf at P={PARTITIONS}:\n" + traceback.format_exc().rstrip())
        return 1
    print()
    print(report)
    measured = [r.measured for r in report.partitions]
    limit = args.limit_mib * 2**20
    if all(m is not None for m in measured):
        worst = max(measured)
        print(f"largest measured peak {worst / 2**20:.0f} MiB of the {args.limit_mib} MiB limit "
              f"({'fits' if worst <= limit else 'ABOVE THE LIMIT'})")
    return status


if __name__ == "__main__":
    sys.exit(main())
