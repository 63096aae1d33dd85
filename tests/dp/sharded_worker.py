"""One replica of the sharded data-parallel tests (run in 2 processes).

Usage: sharded_worker.py SCENARIO OUT_DIR [ZOO_ENTRIES]. For each
optimizer the scenario names (or each zoo entry, ``zoo``), the same model
is trained from the same weights twice in this process: with plain data
parallelism, then (``smp.init`` again) with ``shard_optimizer_state``;
OUT_DIR/rank{r}.json holds both runs' losses and weights and what each
replica stored of the optimizer state.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

import smp_tf as smp  # noqa: E402

SCENARIO, OUT = sys.argv[1], sys.argv[2]
CONFIG = {"partitions": 2, "microbatches": 2, "horovod": True, "dp_timeout": 20.0}
smp.init(CONFIG)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from smp_tf.sharding import storage  # noqa: E402
from tests.dp import common  # noqa: E402

RANK = smp.rank()
STEPS = 3

#: name -> the optimizer, built anew for each run.
OPTIMIZERS = {
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    # (Keras's default epsilon_1, 1e-30, makes the factored moment of a
    # unit without gradient underflow to 0 in float32, and its update NaN,
    # with or without sharding.)
    "adafactor": lambda: keras.optimizers.Adafactor(0.01, epsilon_1=1e-12),
}


class RenamedSGD(keras.optimizers.SGD):
    """An optimizer defined outside Keras: sharding cannot tell what its update does."""


def slot_elements(optimizer) -> int:
    """Elements of the optimizer's slots that this process stores."""
    total = 0
    for v in optimizer.variables:
        tv = getattr(v, "value", v)
        local = storage.local_piece_of(tv)
        if local is not None:
            total += int(np.prod(local.shape))
        elif tuple(tv.shape) and "iteration" not in v.name and "learning_rate" not in v.name:
            total += int(np.prod(tv.shape))
    return total


def run(name: str, sharded: bool, fit: bool = False, checkpoint: bool = False) -> dict:
    smp.init(dict(CONFIG, shard_optimizer_state=sharded))
    model = common.build(seed=100)  # the same weights on both replicas and in both runs
    optimizer = OPTIMIZERS[name]()
    x, y = common.batches(STEPS)
    if fit:
        model.compile(optimizer=optimizer, loss=common.loss)
        xs = np.concatenate(list(x)); ys = np.concatenate(list(y))
        history = model.fit(xs, ys, batch_size=common.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        losses = history.history["loss"]
    else:
        train = common.train_function(model, optimizer)
        losses = [float(train(*common.half(x[s], y[s], RANK))) for s in range(STEPS)]
        storage = {(r["parameters"], r["gradients"], r["optimizer"], r["data"])
                   for r in train.step.last_plan.variable_storage()}
        report = train.step.last_plan.report()
    if checkpoint:
        # Saving reads each divided slot whole: every replica saves at once
        # (each to its own path here; a job keeps rank 0's).
        tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(OUT, f"ckpt_rank{RANK}", "ckpt"))
    return {
        "losses": losses,
        "weights": [v.numpy().tolist() for v in model.trainable_variables],
        "slot_elements": slot_elements(optimizer),
        # A whole read of every slot (a checkpoint's): gathered from the replicas.
        "slots": [v.numpy().tolist() for v in optimizer.variables if tuple(v.shape)],
        # How the partition report says the variables are stored.
        "storage": sorted(storage) if not fit else None,
        "report": report if not fit else None,
    }


def run_zoo(name: str, sharded: bool) -> dict:
    """Two steps of zoo entry `name` (Adam with global_clipnorm), each
    replica on its half of the entry's batch (rows rank, rank + 2, ...)."""
    from tests.zoo import zoo_models

    smp.init(dict(CONFIG, shard_optimizer_state=sharded))
    case = zoo_models.ENTRIES[name]()
    model = case.model
    optimizer = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = case.loss(y, model(x, training=True, **case.training_kwargs))
        return loss, tape.gradient(loss, model.trainable_variables)

    train = common.apply_accumulated(step, optimizer, model)
    mine = lambda a: tf.nest.map_structure(lambda v: tf.constant(v[RANK::2]), a)  # noqa: E731
    losses = [float(train(mine(case.x), mine(case.y))) for _ in range(2)]
    return {
        "losses": losses,
        # Trained and not (BatchNorm statistics): every variable.
        "weights": [v.numpy().astype("float32").tolist() for v in model.variables],
        "slot_elements": slot_elements(optimizer),
        "slots": [v.numpy().astype("float32").tolist() for v in optimizer.variables if tuple(v.shape)],
    }


result = {"rank": RANK}
if SCENARIO == "optimizers":
    for name in OPTIMIZERS:
        result[name] = {"plain": run(name, False), "sharded": run(name, True, checkpoint=name == "adam_global_clipnorm")}
elif SCENARIO == "zoo":
    for name in sys.argv[3].split(","):
        result[name] = {"plain": run_zoo(name, False), "sharded": run_zoo(name, True)}
elif SCENARIO == "fit":
    name = "adam_global_clipnorm"
    result[name] = {"plain": run(name, False, fit=True), "sharded": run(name, True, fit=True)}
elif SCENARIO == "refused":
    smp.init(dict(CONFIG, shard_optimizer_state=True))
    model = common.build(seed=100)
    x, y = common.batches(1)
    train = common.train_function(model, RenamedSGD(0.01))
    try:
        train(*common.half(x[0], y[0], RANK))
    except ValueError as e:
        result["error"] = str(e)
with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
    json.dump(result, f)
