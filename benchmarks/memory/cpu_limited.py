"""A step that runs out of memory on one device trains with smp_tf, under a
real allocator limit on CPUs.

The CPU counterpart of ``gpu_limited.py`` for machines without a GPU.
TensorFlow's CPU BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``) refuses to
hold more than ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` MiB and raises
``tf.errors.ResourceExhaustedError`` beyond it, as a GPU's allocator does at
its memory limit. Logical CPU devices share that one allocator, so the limit
caps the sum over all partitions, not each partition: this shows that a
pipeline's step (micro-batches, schedule, recomputation) fits where the
one-device step does not, not how the bytes spread over devices (that is
``gpu_limited.py``'s part, and the per-partition figures of ``bench.py``).

Each configuration runs in a fresh process with the limit set before
TensorFlow starts: the plain one-device step (a `tf.function`: forward,
loss, gradients, SGD update, on the full batch), then smp_tf steps under
the same limit. Each prints whether it ran (``trains``: ``--steps`` training
steps, the last loss, the allocator's peak) or ran out of memory (``OOM``,
the first line of TensorFlow's error).

Run ``python benchmarks/memory/cpu_limited.py`` (``--help`` for the flags;
``--quick`` for a small model and limit that check the script).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_MARK = "@@SMP_CPU_LIMITED@@"

#: (label, config or None for the plain one-device step)
CONFIGS = (
    ("one device, plain tf.function", None),
    ("P=1 M={m} interleaved never", {"partitions": 1, "pipeline": "interleaved", "recompute": "never"}),
    ("P=4 M={m} simple never", {"partitions": 4, "pipeline": "simple", "recompute": "never"}),
    ("P=4 M={m} interleaved never", {"partitions": 4, "pipeline": "interleaved", "recompute": "never"}),
    ("P=4 M={m} interleaved full", {"partitions": 4, "pipeline": "interleaved", "recompute": "full"}),
    ("P=2 M={m} interleaved never", {"partitions": 2, "pipeline": "interleaved", "recompute": "never"}),
    # Tensor parallelism: its pieces share this one allocator with the rest,
    # so the limit shows that the split step fits, not how it spreads over
    # devices (the memory report's rows per device and the pieces' own
    # devices do; see docs/tensor_parallelism.md).
    ("P=2 x t=2 M={m} interleaved never",
     {"partitions": 2, "tensor_parallel_degree": 2, "pipeline": "interleaved", "recompute": "never"}),
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-mib", type=int, default=None,
                    help="TF_CPU_BFC_MEM_LIMIT_IN_MB for every run (default 768; --quick 40)")
    ap.add_argument("--layers", type=int, default=None, help="transformer layers (default 8; --quick 2)")
    ap.add_argument("--width", type=int, default=None, help="hidden width (default 256; --quick 64)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 256; --quick 128)")
    ap.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    ap.add_argument("--vocab", type=int, default=260, help="vocabulary size (default 260)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches M (default 8)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per configuration (default 2)")
    ap.add_argument("--quick", action="store_true", help="a small model and limit (checks the script)")
    ap.add_argument("--run", metavar="INDEX", type=int, default=None, help=argparse.SUPPRESS)  # internal
    args = ap.parse_args(argv)
    defaults = (40, 2, 64, 128) if args.quick else (768, 8, 256, 256)
    for key, value in zip(("limit_mib", "layers", "width", "seq"), defaults):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.width % args.heads:
        ap.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    if args.batch % args.microbatches:
        ap.error(f"--batch ({args.batch}) must be a multiple of --microbatches ({args.microbatches})")
    if args.limit_mib <= 0:
        ap.error(f"--limit-mib must be positive, got {args.limit_mib}")
    return args


# ---------------------------------------------------------------------------
# One configuration (in a fresh process, the limit set before TensorFlow)


def run_config(args) -> dict:
    label, config = CONFIGS[args.run]
    import tensorflow as tf

    import smp_tf as smp

    if config is not None:
        smp.init(dict(config, microbatches=args.microbatches))
    import keras

    from benchmarks.memory.gpu_limited import build_model, make_batch, smp_train_step

    model = build_model(keras, keras.Model if config is None else smp.DistributedModel, args)
    x, y = make_batch(tf, args)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(1e-3)

    if config is None:
        @tf.function
        def train(x, y):
            with tf.device("/device:CPU:0"):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss
    else:
        _, train = smp_train_step(smp, tf, model, loss_fn, opt)

    out = {"label": label.format(m=args.microbatches)}
    try:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tf.config.experimental.reset_memory_stats("CPU:0")
            loss = float(train(x, y).numpy())
        out.update(status="trains", loss=loss, seconds=time.perf_counter() - t0,
                   peak=tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except tf.errors.ResourceExhaustedError as e:
        out.update(status="OOM", error=_oom_line(str(e.message)) or "ResourceExhaustedError")
    except tf.errors.CancelledError as e:
        # When a task function inside the step runs out of memory, TensorFlow
        # may raise the cancellation of the step's other transfers instead;
        # the parent looks for the out-of-memory error in TensorFlow's log.
        out.update(status="cancelled", error=f"CancelledError: {_first_line(str(e.message))}")
    return out


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip() and "error:" not in line.lower()), "")[:160]


def _oom_line(text: str) -> str:
    """TensorFlow's "OOM when allocating tensor ..." line, shortened, or ''."""
    match = re.search(r"OOM when allocating tensor[^\n]*?(?= by allocator|$)", text, re.M)
    return match.group(0)[:160] if match else ""


def run_child(args, index: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), f"--run={index}"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in sorted(vars(args).items()) if k not in ("run", "quick")
    ]
    env = dict(os.environ)
    # Warnings stay on (level 1): the allocator's out-of-memory line is one.
    env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(args.limit_mib),
               TF_CPP_MIN_LOG_LEVEL="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            result = json.loads(line[len(_MARK):])
            logged = _oom_line(proc.stderr)
            if result["status"] == "cancelled" and logged:
                result.update(status="OOM", error=f"raised as CancelledError; TensorFlow's log: {logged}")
            return result
    label = CONFIGS[index][0].format(m=args.microbatches)
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
    return {"label": label, "status": "FAILED", "error": f"exit code {proc.returncode}: " + " | ".join(tail)[-300:]}


def build_table(results, args) -> str:
    from benchmarks.machine import versions

    lines = [
        f"smp_tf under a CPU allocator limit ({'quick' if args.quick else 'full'}): TF_CPU_BFC_MEM_LIMIT_IN_MB="
        f"{args.limit_mib} for every configuration, one shared allocator for all logical CPU devices",
        f"GPT-2 LM (keras_hub GPT2Backbone, tied output embedding): {args.layers} layers, width {args.width}, "
        f"{args.heads} heads, sequence {args.seq}, vocabulary {args.vocab}, batch {args.batch}, SGD; {versions()}",
        "",
    ]
    width = max(len(r["label"]) for r in results)
    lines.append(f"{'configuration':<{width}}  {'result':<7}  {'peak MiB':>8}  {'loss':>7}  detail")
    lines.append(f"{'-' * width}  {'-' * 7}  {'-' * 8}  {'-' * 7}  {'-' * 6}")
    for r in results:
        if r["status"] == "trains":
            lines.append(f"{r['label']:<{width}}  {'trains':<7}  {r['peak'] / 2**20:>8.1f}  {r['loss']:>7.4f}  "
                         f"{args.steps} steps in {r['seconds']:.1f} s")
        else:
            lines.append(f"{r['label']:<{width}}  {r['status']:<7}  {'-':>8}  {'-':>7}  {r['error']}")
    lines.append("")
    lines.append("peak: the allocator's peak during the last step (all partitions together; the limit caps this sum)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run is not None:
        sys.stdout.write(_MARK + json.dumps(run_config(args)) + "\n")
        sys.stdout.flush()
        return 0
    results = []
    for i in range(len(CONFIGS)):
        print(f"[cpu_limited] {CONFIGS[i][0].format(m=args.microbatches)} ...", file=sys.stderr, flush=True)
        results.append(run_child(args, i))
    print(build_table(results, args))
    return 1 if any(r["status"] == "FAILED" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
