"""Train a small CNN on scikit-learn's digits with a pipelined custom training loop.

The model is split into `--partitions` pipeline stages, one per device (GPUs
when TensorFlow sees enough of them, otherwise one logical CPU device per
stage). Every batch is cut into `--microbatches` micro-batches that flow
through the stages in the order of the `--pipeline` schedule.

Run:

    python examples/custom_training_loop.py
    python examples/custom_training_loop.py --partitions 3 --microbatches 8 --pipeline simple

The data set (1,797 8x8 images of hand-written digits) ships with
scikit-learn, so nothing is downloaded.
"""

import argparse
import os
import time

# Keep TensorFlow's C++ start-up messages out of the example's output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import smp_tf as smp  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--partitions", type=int, default=2, help="pipeline stages (devices)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch")
    parser.add_argument(
        "--pipeline", choices=("interleaved", "simple", "zero_bubble"), default="interleaved",
        help="schedule: interleaved (1F1B), simple (GPipe) or zero_bubble (weight gradients in the bubbles)",
    )
    parser.add_argument(
        "--virtual-stages", type=int, default=1,
        help="model chunks per device (Megatron-LM's interleaved schedule with --pipeline interleaved)",
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument(
        "--batch-size", type=int, default=64,
        help="rows per batch; must be a multiple of --microbatches",
    )
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", metavar="DIR",
        help="after training, record 5 more steps with smp.profile and write DIR/timeline.json (and .png)",
    )
    return parser.parse_args()


args = parse_args()

# 1. smp.init comes first: it creates one device per partition, which
#    TensorFlow only allows before its first operation runs.
smp.init({
    "partitions": args.partitions,
    "microbatches": args.microbatches,
    "pipeline": args.pipeline,
    "virtual_stages": args.virtual_stages,
})
if args.batch_size % args.microbatches:
    raise SystemExit(
        f"--batch-size {args.batch_size} must be a multiple of "
        f"--microbatches {args.microbatches}: every micro-batch gets the same number of rows."
    )
keras.utils.set_random_seed(args.seed)


# 2. The model: a DistributedModel is a keras.Model whose forward pass, loss
#    and gradients smp_tf splits across the devices.
class DigitsCNN(smp.DistributedModel):
    def __init__(self, num_classes=10, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")
        self.conv2 = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")
        self.pool = keras.layers.MaxPooling2D(2, name="pool")
        self.conv3 = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv3")
        self.conv4 = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv4")
        self.flatten = keras.layers.Flatten(name="flatten")
        self.dense1 = keras.layers.Dense(128, activation="relu", name="dense1")
        self.dense2 = keras.layers.Dense(64, activation="relu", name="dense2")
        self.logits = keras.layers.Dense(num_classes, name="logits")

    def call(self, x, training=False):
        x = self.conv1(x)
        x = self.conv2(x)
        x = self.pool(x)
        x = self.conv3(x)
        x = self.conv4(x)
        x = self.flatten(x)
        x = self.dense1(x)
        x = self.dense2(x)
        return self.logits(x)


# The data: 8x8 grey images with values 0..16, scaled to [0, 1].
digits = load_digits()
images = (digits.images / 16.0).astype("float32")[..., None]  # (N, 8, 8, 1)
labels = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(
    images, labels, test_size=0.2, random_state=args.seed, stratify=labels
)

model = DigitsCNN()
model(x_train[:1])  # build the variables (they start on the default device)
optimizer = keras.optimizers.Adam(args.learning_rate)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# 3. The step body is written for one micro-batch. smp_tf runs it once per
#    micro-batch, pipelined, and returns each value as a StepOutput.
@smp.step
def train_step(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = loss_fn(y, logits)
    grads = tape.gradient(loss, model.trainable_variables)
    return loss, grads, logits


# 4. Combining micro-batches and updating the weights happens outside the step.
#    The whole function (pipeline, accumulation, update) is one graph.
@tf.function
def train_on_batch(x, y):
    loss, grads, logits = train_step(x, y)
    optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
    # merge() puts the rows back in batch order (the split is strided).
    return loss.reduce_mean(), logits.merge()


def short_device(name):
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> '/device:CPU:1'; a device of
    another process of the job (``pipeline_processes``) keeps its task:
    '/job:worker/replica:0/task:1/device:CPU:0' -> 'task:1/device:CPU:0'."""
    spec = tf.DeviceSpec.from_string(name)
    short = f"/device:{spec.device_type}:{spec.device_index}"
    if spec.job not in (None, "localhost"):
        short = f"task:{spec.task}{short}"
    return short


def batches(x, y, batch_size, rng):
    """Shuffled full batches (a partial last batch would change the shape)."""
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]


print(f"smp_tf: {smp.pp_size()} partitions on {', '.join(smp.topology().devices)}, "
      f"{smp.num_microbatches()} micro-batches, '{smp.current_config().pipeline}' pipeline")
print(f"digits: {len(x_train)} training and {len(x_test)} test images, "
      f"batch size {args.batch_size} ({args.batch_size // args.microbatches} rows per micro-batch)\n")

rng = np.random.default_rng(args.seed)
start = time.perf_counter()
for epoch in range(args.epochs):
    losses, correct, seen = [], 0, 0
    t0 = time.perf_counter()
    for step, (xb, yb) in enumerate(batches(x_train, y_train, args.batch_size, rng)):
        loss, logits = train_on_batch(xb, yb)
        losses.append(float(loss))
        correct += int(np.sum(np.argmax(logits.numpy(), axis=1) == yb))
        seen += len(yb)
        if epoch == 0 and step == 0:
            # The first call traced and partitioned the step; show the result.
            print(train_step.last_plan.report())
            print(f"\nSchedule ({train_step.schedule.kind}, one column per clock cycle):")
            print(train_step.schedule)
            print("\nWhere each layer's variables live:")
            for layer in model.layers:
                where = sorted({short_device(v.value.device) for v in layer.weights})
                if where:
                    print(f"  {layer.name:<8} {', '.join(where)}")
            print()
    print(f"epoch {epoch + 1:>2}/{args.epochs}: loss {np.mean(losses):.4f}, "
          f"train accuracy {correct / seen:.4f} ({time.perf_counter() - t0:.1f} s)")

# Evaluation with a plain model call: outside a step the model runs like any
# Keras model, reading each variable from the device it lives on.
test_logits = model(x_test, training=False)
test_accuracy = float(np.mean(np.argmax(test_logits, axis=1) == y_test))
print(f"\ntest accuracy: {test_accuracy:.4f} on {len(x_test)} images "
      f"(training took {time.perf_counter() - start:.1f} s)")

if args.profile:
    # 5. What each device actually ran, and when: a few more training steps
    #    inside smp.profile. The step function is traced inside the block so
    #    that it carries the timing probes.
    with smp.profile(args.profile) as prof:
        profiled = tf.function(train_on_batch.python_function)
        for _, (xb, yb) in zip(range(5), batches(x_train, y_train, args.batch_size, rng)):
            profiled(xb, yb)
    print("\n" + prof.timeline.summary())
    print("wrote " + ", ".join(prof.files) + " (open timeline.json in https://ui.perfetto.dev)")
