"""The model, data and loss of the data-parallel tests, shared by the
replicas (worker.py) and the single-process references (the tests)."""

import keras
import numpy as np
import tensorflow as tf

import smp_tf as smp

#: Rows of one global batch; each of the 2 replicas takes half.
GLOBAL_BATCH = 16
LR = 0.1


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,))
    h = inp
    for i in range(3):
        h = keras.layers.Dense(32, activation="relu", name=f"d{i}")(h)
    return smp.DistributedModel(inp, keras.layers.Dense(4, name="head")(h))


def loss(y, pred):
    return tf.reduce_mean(tf.square(pred - y))


def batches(n: int):
    """n global batches (the same on every replica)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, GLOBAL_BATCH, 16)).astype("float32")
    y = rng.normal(size=(n, GLOBAL_BATCH, 4)).astype("float32")
    return x, y


def half(x, y, rank: int):
    """Replica `rank`'s half of a global batch."""
    b = GLOBAL_BATCH // 2
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def train_function(model, optimizer):
    """The custom-loop training step of the tests: a `smp.step` for one
    micro-batch, the accumulated (micro-batch and replica averaged)
    gradients applied after it; returns this process's mean loss."""

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            batch_loss = loss(y, model(x, training=True))
        return batch_loss, tape.gradient(batch_loss, model.trainable_variables)

    return apply_accumulated(step, optimizer, model)


def apply_accumulated(step, optimizer, model):
    """A `tf.function` of one call of the `smp.step` `step` (returning the
    loss and the gradients) and `optimizer`'s update with the accumulated
    gradients; returns the mean loss."""

    @tf.function
    def train(x, y):
        batch_loss, grads = step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return batch_loss.reduce_mean()

    train.step = step  # for the tests that read its plan
    return train
