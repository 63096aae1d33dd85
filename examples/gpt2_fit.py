"""Train a small GPT-2 language model with Keras `fit`, pipelined over several devices.

A tiny keras_hub GPT-2 backbone with a language-model head tied to its token
embedding learns to predict the next byte of Python source code. The model is
a functional `smp.DistributedModel`, so `model.compile(...)` and
`model.fit(...)` work as in Keras, but every batch is cut into
`--microbatches` micro-batches that flow through `--partitions` pipeline
stages, one per device (GPUs when TensorFlow sees enough of them, otherwise
one logical CPU device per stage). After training the script prints the
partition report and the schedule of the pipelined train step, where each
layer's variables live, and a greedy continuation of a prompt.

Run:

    python examples/gpt2_fit.py
    python examples/gpt2_fit.py --epochs 6 --max-bytes 400000 --partitions 2
    python examples/gpt2_fit.py --partitions 2 --tensor-parallel 2   # 4 devices: attention and MLPs split in two

The corpus is the source of Python's own standard library (the public
top-level modules, in name order, cut at `--max-bytes`), read from the
running interpreter's installation, so nothing is downloaded. Tokens are
bytes: ids 0-255 are the byte values, plus a few special ids.
"""

import argparse
import glob
import os
import time

# Keep TensorFlow's C++ start-up messages out of the example's output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

try:
    import keras_hub
except ImportError:  # not in the `examples` extra
    raise SystemExit("This example needs keras_hub: pip install keras-hub") from None

import smp_tf as smp  # noqa: E402

# Token ids: the 256 byte values, then the special tokens.
PAD = 256  # fills the unused end of a generation prompt (masked out)
BOS = 257  # starts every file of the corpus
EOS = 258  # ends every file of the corpus
VOCABULARY_SIZE = 260  # 256 bytes + 3 special ids, rounded up


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=4, help="pipeline stages (devices)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch")
    parser.add_argument(
        "--pipeline", choices=("interleaved", "simple", "zero_bubble"), default="interleaved",
        help="schedule: interleaved (1F1B), simple (GPipe) or zero_bubble (weight gradients in the bubbles)",
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=1,
        help="model chunks per device (Megatron-LM's interleaved schedule with --pipeline interleaved)",
    )
    parser.add_argument(
        "--tensor-parallel", type=int, default=1,
        help="devices each stage's attention heads and MLPs are split over (tensor_parallel_degree)",
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--max-bytes", type=int, default=300_000,
        help="bytes of standard-library source to train and validate on",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training window")
    parser.add_argument(
        "--batch-size", type=int, default=32,
        help="windows per batch; must be a multiple of --microbatches",
    )
    parser.add_argument("--learning-rate", type=float, default=5e-3, help="Adam learning rate")
    parser.add_argument("--prompt", default="def ", help="text to continue after training")
    parser.add_argument("--generate", type=int, default=40, help="tokens to generate")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


args = parse_args()

# 1. smp.init comes first: it creates one device per partition, which
#    TensorFlow only allows before its first operation runs.
smp.init({
    "partitions": args.partitions,
    "microbatches": args.microbatches,
    "pipeline": args.pipeline,
    "virtual_stages": args.virtual_stages,
    "tensor_parallel_degree": args.tensor_parallel,
})
if args.batch_size % args.microbatches:
    raise SystemExit(
        f"--batch-size {args.batch_size} must be a multiple of "
        f"--microbatches {args.microbatches}: every micro-batch gets the same number of rows."
    )
keras.utils.set_random_seed(args.seed)


# 2. The corpus: Python's standard library, as bytes.
def read_corpus(max_bytes):
    """BOS + bytes + EOS of each public top-level stdlib module, in name
    order, until `max_bytes` bytes of source; returns (token ids, file names)."""
    stdlib = os.path.dirname(os.__file__)
    paths = sorted(
        p for p in glob.glob(os.path.join(stdlib, "*.py"))
        if not os.path.basename(p).startswith("_")  # private and generated modules
    )
    pieces, names, total = [], [], 0
    for path in paths:
        if total >= max_bytes:
            break
        with open(path, "rb") as f:
            data = f.read()[: max_bytes - total]
        total += len(data)
        names.append(os.path.basename(path))
        pieces += [[BOS], np.frombuffer(data, np.uint8), [EOS]]
    return np.concatenate(pieces).astype("int32"), names


def windows(tokens, seq_len):
    """Non-overlapping (input, next-token target) windows of `seq_len` tokens."""
    n = (len(tokens) - 1) // seq_len
    x = tokens[: n * seq_len].reshape(n, seq_len)
    y = tokens[1: n * seq_len + 1].reshape(n, seq_len)
    return x, y


def dataset(x, y, batch_size, shuffle):
    """Batches of ({"token_ids", "padding_mask"}, targets). Every window is
    full-length, so the padding mask is all ones. drop_remainder keeps one
    batch shape: the pipelined step is traced and partitioned once per shape."""
    inputs = {"token_ids": x, "padding_mask": np.ones_like(x)}
    ds = tf.data.Dataset.from_tensor_slices((inputs, y))
    if shuffle:
        ds = ds.shuffle(len(x), seed=args.seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


tokens, files = read_corpus(args.max_bytes)
x_all, y_all = windows(tokens, args.seq_len)
order = np.random.default_rng(args.seed).permutation(len(x_all))
# About 10% for validation, in whole batches (at least one).
n_val = max(1, len(x_all) // 10 // args.batch_size) * args.batch_size
val_idx, train_idx = order[:n_val], order[n_val:]
if len(train_idx) < args.batch_size:
    raise SystemExit(f"--max-bytes {args.max_bytes} gives fewer than one training batch; raise it.")
train_ds = dataset(x_all[train_idx], y_all[train_idx], args.batch_size, shuffle=True)
val_ds = dataset(x_all[val_idx], y_all[val_idx], args.batch_size, shuffle=False)


# 3. The model: a tiny GPT-2 backbone; the logits reuse the token embedding
#    matrix (h @ E^T), as keras_hub.models.GPT2CausalLM does. The functional
#    form of smp.DistributedModel wraps it like keras.Model(inputs, outputs).
backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=VOCABULARY_SIZE,
    num_layers=4,
    num_heads=4,
    hidden_dim=64,
    intermediate_dim=128,
    dropout=0.1,
    max_sequence_length=args.seq_len,
)
inputs = {
    "token_ids": keras.Input((args.seq_len,), dtype="int32", name="token_ids"),
    "padding_mask": keras.Input((args.seq_len,), dtype="int32", name="padding_mask"),
}
hidden = backbone(inputs)
logits = backbone.token_embedding(hidden, reverse=True)  # tied LM head
model = smp.DistributedModel(inputs, logits, name="gpt2_lm")

model.compile(
    optimizer=keras.optimizers.Adam(args.learning_rate),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
)

print(f"smp_tf: {smp.pp_size()} partitions on {', '.join(smp.topology().devices)}, "
      f"{smp.num_microbatches()} micro-batches, '{smp.current_config().pipeline}' pipeline")
print(f"corpus: {len(tokens):,} tokens from {len(files)} stdlib modules "
      f"({files[0]} .. {files[-1]}); {len(train_idx)} training and {n_val} validation "
      f"windows of {args.seq_len} tokens")
print(f"model: GPT-2, {model.count_params():,} parameters; batch size {args.batch_size} "
      f"({args.batch_size // args.microbatches} windows per micro-batch)\n")


class FirstBatchLoss(keras.callbacks.Callback):
    """Keeps the loss of the first training batch (Keras's per-epoch loss is
    the mean over the epoch, so it hides the starting point)."""

    loss = None

    def on_train_batch_end(self, batch, logs=None):
        if self.loss is None:
            self.loss = float(logs["loss"])


# 4. fit: Keras's own epoch loop, progress output, callbacks and validation;
#    each training and validation batch runs through the pipeline. An
#    untrained model predicts about uniformly: a loss of ln(260) = 5.56.
first_batch = FirstBatchLoss()
start = time.perf_counter()
# train_ds shuffles itself (shuffle=False only tells Keras not to warn).
history = model.fit(
    train_ds, validation_data=val_ds, epochs=args.epochs, shuffle=False,
    callbacks=[first_batch], verbose=2,
)
train_seconds = time.perf_counter() - start
losses = history.history["loss"]
val_losses = history.history["val_loss"]
print(f"\nloss: {first_batch.loss:.3f} (first batch) -> {losses[-1]:.3f} (last epoch), "
      f"validation loss {val_losses[-1]:.3f} ({args.epochs} epochs, {train_seconds:.0f} s)")

# 5. The pipelined train step that fit ran: how the traced micro-batch step
#    (forward, loss and gradients) was split across the devices, and which
#    device ran which micro-batch in each clock cycle.
train_step = model.step_functions.train
print("\n" + train_step.last_plan.report())
print(f"\nSchedule ({train_step.schedule.kind}, one column per clock cycle):")
print(train_step.schedule)


def short_device(name):
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1'; a device of
    another process of the job (``pipeline_processes``) keeps its task:
    '/job:worker/replica:0/task:1/device:CPU:0' -> 'task:1/CPU:0'."""
    spec = tf.DeviceSpec.from_string(name)
    short = f"{spec.device_type}:{spec.device_index}"
    if spec.job not in (None, "localhost"):
        short = f"task:{spec.task}/{short}"
    return short


# Each variable lives on the device of its partition. The token embedding is
# one variable used twice (the input lookup and the output logits); it lives
# on one device like any other.
print("\nWhere each layer's variables live:")
for layer in backbone.layers:
    where = sorted({short_device(v.value.device) for v in layer.weights})
    if where:
        print(f"  {layer.name:<20} {', '.join(where)}")


# 6. Greedy generation. Outside fit, calling the model runs it as a plain
#    Keras model (unpartitioned), reading each weight on the device it lives
#    on. The prompt is right-padded to the fixed window length: the causal
#    attention keeps the padding from affecting the positions before it.
@tf.function
def next_token_logits(token_ids, padding_mask, position):
    out = model({"token_ids": token_ids, "padding_mask": padding_mask}, training=False)
    return out[0, position]


def generate(prompt, num_tokens):
    ids = [BOS] + list(prompt.encode())
    for _ in range(num_tokens):
        context = ids[-args.seq_len:]
        token_ids = np.full((1, args.seq_len), PAD, "int32")
        token_ids[0, : len(context)] = context
        padding_mask = (token_ids != PAD).astype("int32")
        position = tf.constant(len(context) - 1)
        token = int(np.argmax(next_token_logits(token_ids, padding_mask, position)))
        if token == EOS:
            break
        ids.append(token)
    # Byte-level sampling can split a UTF-8 character: decode leniently.
    return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


print(f"\nGreedy continuation of {args.prompt!r} ({args.generate} tokens):")
print(generate(args.prompt, args.generate))
