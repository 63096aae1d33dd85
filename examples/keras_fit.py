"""Train a small CNN on scikit-learn's digits with Keras `fit`, pipelined over two devices.

The same Keras code as for one device, plus three lines: `smp.init(...)`
first, the model built as a `smp.DistributedModel`, and nothing else. `fit`
then splits every batch into `--microbatches` micro-batches and runs them
through the model's partitions, one per device (GPUs when TensorFlow sees
enough of them, otherwise one logical CPU device per partition), with a
validation split, Keras callbacks and a layout-free checkpoint.

Run:

    python examples/keras_fit.py
    python examples/keras_fit.py --partitions 3 --microbatches 8 --pipeline simple

The data set (1,797 8x8 images of hand-written digits) ships with
scikit-learn, so nothing is downloaded.
"""

import argparse
import os
import tempfile
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
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="rows per batch")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--checkpoint-dir", default=None, help="where to save (default: a temporary folder)")
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
})
keras.utils.set_random_seed(args.seed)

# The data: 8x8 grey images with values 0..16, scaled to [0, 1].
digits = load_digits()
images = (digits.images / 16.0).astype("float32")[..., None]  # (N, 8, 8, 1)
labels = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(
    images, labels, test_size=0.2, random_state=args.seed, stratify=labels
)

# 2. The model: the functional Keras API, with smp.DistributedModel in place
#    of keras.Model.
inputs = keras.Input((8, 8, 1), name="image")
x = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inputs)
x = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2")(x)
x = keras.layers.MaxPooling2D(2, name="pool")(x)
x = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv3")(x)
x = keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv4")(x)
x = keras.layers.Flatten(name="flatten")(x)
x = keras.layers.Dense(128, activation="relu", name="dense1")(x)
x = keras.layers.Dropout(0.2, seed=args.seed, name="dropout")(x)
outputs = keras.layers.Dense(10, name="logits")(x)
model = smp.DistributedModel(inputs, outputs, name="digits_cnn")

# 3. Compile and fit exactly as with Keras.
model.compile(
    optimizer=keras.optimizers.Adam(args.learning_rate),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="smp_tf_digits_")
manager = smp.CheckpointManager(
    tf.train.Checkpoint(model=model, optimizer=model.optimizer), checkpoint_dir, max_to_keep=2
)


class ShowPipeline(keras.callbacks.Callback):
    """After the first epoch, prints what smp_tf made of the training step:
    the partitions, the schedule and the predicted memory of each partition."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            train = self.model.step_functions.train
            print("\n" + train.last_plan.report())
            print(f"\nSchedule ({train.schedule.kind}, one column per clock cycle):")
            print(train.schedule)
            print("\n" + train.memory_report(self.model.optimizer).table(), "\n")


print(f"smp_tf: {smp.pp_size()} partitions on {', '.join(smp.topology().devices)}, "
      f"{smp.num_microbatches()} micro-batches, '{smp.current_config().pipeline}' pipeline")
print(f"digits: {len(x_train)} training images (20% held out for validation), {len(x_test)} test images\n")
start = time.perf_counter()
history = model.fit(
    x_train, y_train,
    batch_size=args.batch_size,
    epochs=args.epochs,
    validation_split=0.2,
    callbacks=[
        ShowPipeline(),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3, restore_best_weights=True),
        keras.callbacks.CSVLogger(os.path.join(checkpoint_dir, "history.csv")),
    ],
    verbose=2,
)
print(f"\nfit: {len(history.history['loss'])} epochs in {time.perf_counter() - start:.1f} s; "
      f"loss {history.history['loss'][0]:.3f} -> {history.history['loss'][-1]:.3f}")

# 4. evaluate and predict run through the pipeline too (forward only).
test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=100, verbose=0)
predictions = np.argmax(model.predict(x_test, batch_size=100, verbose=0), axis=1)
print(f"test: loss {test_loss:.4f}, accuracy {test_accuracy:.4f} "
      f"(from predict: {np.mean(predictions == y_test):.4f})")

# 5. Where the variables live: each on the device of its partition.
def short_device(name):
    """'/job:localhost/replica:0/task:0/device:CPU:1' -> 'CPU:1'; a device of
    another process of the job (``pipeline_processes``) keeps its task:
    '/job:worker/replica:0/task:1/device:CPU:0' -> 'task:1/CPU:0'."""
    spec = tf.DeviceSpec.from_string(name)
    short = f"{spec.device_type}:{spec.device_index}"
    if spec.job not in (None, "localhost"):
        short = f"task:{spec.task}/{short}"
    return short


print("\nWhere each layer's variables live:")
for layer in model.layers:
    where = sorted({short_device(v.value.device) for v in layer.weights})
    if where:
        print(f"  {layer.name:<8} {', '.join(where)}")

# 6. A checkpoint of the model and its optimizer. It is layout-free: restored
#    into a fresh model it gives the same predictions, as it would under
#    another partition count, or in plain Keras without smp_tf.
path = manager.save()
fresh = keras.models.clone_model(model)
smp.CheckpointManager(tf.train.Checkpoint(model=fresh), checkpoint_dir).restore().expect_partial()
same = np.allclose(fresh.predict(x_test[:50], verbose=0), model.predict(x_test[:50], verbose=0), atol=1e-5)
print(f"\ncheckpoint {path} (and history.csv) written; restored into a fresh model: "
      f"{'the same' if same else 'DIFFERENT'} predictions")
