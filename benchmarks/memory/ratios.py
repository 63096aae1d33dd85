"""Predicted against measured memory, per partition and for the process, on
a few models trained as a new user would (Adam applied outside the step).

Run one case per process (the allocator's history matters)::

    python benchmarks/memory/ratios.py convnext_tiny 2
    python benchmarks/memory/ratios.py gpt2_lm 2          # a zoo model

Prints one ``ROW`` line per partition and one ``PROCESS`` line (the step
called inside a ``tf.function``), then one ``EAGER`` line (the process
peak of the step and its ``accumulate`` called eagerly) and one
``EAGER_REQUESTED`` line (the same call's peak of the bytes its tensors
asked for, against the prediction less the variables, the optimizer state
and the allocator's chunk rounding, `smp_tf.memory.EAGER_ROUNDING`):
``ROW case P sched recompute partition predicted measured ratio`` (bytes).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def app_case(keras, name: str):
    import numpy as np

    keras.utils.set_random_seed(0)
    fn = {"convnext_tiny": keras.applications.ConvNeXtTiny,
          "efficientnet_v2_b0": keras.applications.EfficientNetV2B0}[name]
    model = fn(weights=None, input_shape=(64, 64, 3))
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (16, 64, 64, 3)).astype("float32")
    y = rng.integers(0, 1000, (16,)).astype("int32")
    return model, x, y, keras.losses.SparseCategoricalCrossentropy()


def llama_case(keras):
    import numpy as np
    import keras_hub

    keras.utils.set_random_seed(0)
    V, S, B = 512, 64, 16
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=V, num_layers=4, num_query_heads=4, num_key_value_heads=2, hidden_dim=128,
        intermediate_dim=384, max_sequence_length=S)
    tok = keras.Input((S,), dtype="int32", name="token_ids")
    pad = keras.Input((S,), dtype="int32", name="padding_mask")
    h = backbone({"token_ids": tok, "padding_mask": pad})
    logits = backbone.token_embedding(h, reverse=True)
    model = keras.Model({"token_ids": tok, "padding_mask": pad}, logits)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (B, S + 1))
    x = {"token_ids": tokens[:, :-1].astype("int32"), "padding_mask": np.ones((B, S), "int32")}
    y = tokens[:, 1:].astype("int32")
    return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _eager_rows(tf, train_step, optimizer, x, y, label) -> None:
    """Prints the ``EAGER`` and ``EAGER_REQUESTED`` lines of the step called
    eagerly (`label`: case, P, schedule, recompute)."""
    from smp_tf.memory import EAGER_ROUNDING
    from smp_tf.profiling.memory import AllocationRecorder

    # Called eagerly, the step's outputs of every micro-batch leave the
    # pipeline together and are held until `accumulate` sums them.
    report = train_step.last_compiled.memory_report(optimizer, outputs_held=True)
    predicted = report.process_peak

    def eager_step():
        loss, grads = train_step(x, y)
        return [g.accumulate() for g in grads]

    eager_step()  # builds the eager wrapper
    tf.config.experimental.reset_memory_stats("CPU:0")
    if os.environ.get("RATIOS_TABLE"):
        print("current before the eager step", tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20)
        print(report.table())
    eager_step()
    m = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print("EAGER", *label, predicted, m, f"{m / predicted:.3f}", flush=True)
    # The same call again, counting each allocation as the bytes it asked
    # for rather than the chunk the allocator handed it: what the step's
    # own tensors take, above the variables and optimizer state (and
    # whatever else was held before it), against the prediction less them
    # and less the chunk rounding.
    static = sum(r.variables + r.optimizer for r in report)
    with AllocationRecorder() as recorder:
        counted = recorder.run("eager", eager_step)
    requested = counted if counted is not None else recorder.peaks["eager"]
    dynamic = round((predicted - static) / (1 + EAGER_ROUNDING))
    print("EAGER_REQUESTED", *label, dynamic, requested, f"{requested / dynamic:.3f}", flush=True)


def main(argv) -> int:
    name, P = argv[0], int(argv[1])
    sched = argv[2] if len(argv) > 2 else "interleaved"
    recompute = argv[3] if len(argv) > 3 else "never"
    M = 4
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": M, "pipeline": sched, "recompute": recompute})
    import tensorflow as tf
    import keras

    if name in ("convnext_tiny", "efficientnet_v2_b0"):
        model, x, y, loss_fn = app_case(keras, name)
    elif name == "llama":
        model, x, y, loss_fn = llama_case(keras)
    else:
        from tests.zoo import zoo_models

        case = zoo_models.ENTRIES[name]()
        model, x, y, loss_fn = case.model, case.x, case.y, case.loss
    x = tf.nest.map_structure(tf.constant, x)
    y = tf.constant(y)
    optimizer = keras.optimizers.Adam(1e-4)

    @smp.step
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    train_step.optimizer = optimizer

    @tf.function
    def train(x, y):
        loss, grads = train_step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    train(x, y)
    report = train_step.measure_memory(x, y, optimizer=optimizer)
    if os.environ.get("RATIOS_TABLE"):
        print(report.table())
    for r in report:
        print("ROW", name, P, sched, recompute, r.partition, r.total, r.measured,
              f"{r.measured / r.total:.3f}" if r.measured else "-", flush=True)
    m = report.measured_process_peak
    print("PROCESS", name, P, sched, recompute, report.process_peak, m,
          f"{m / report.process_peak:.3f}" if m else "-", flush=True)
    _eager_rows(tf, train_step, optimizer, x, y, (name, P, sched, recompute))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
