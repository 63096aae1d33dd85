"""Checkpoints are layout-free: the variables are the user's Keras variables."""

import numpy as np
import tensorflow as tf

import smp_tf as smp
from tests import models


def _train(model, opt, partitions, steps=2):
    smp.init({"partitions": partitions, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))

    @tf.function
    def train(x, y):
        loss, grads, _ = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    x, y = models.data("mlp")
    for _ in range(steps):
        train(x, y)


def test_checkpoint_saved_under_one_layout_restores_under_another(tmp_path):
    import keras

    keras.utils.set_random_seed(5)
    model = models.mlp()
    opt = keras.optimizers.Adam(1e-2)
    _train(model, opt, partitions=3)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save(str(tmp_path / "ckpt"))
    weights = [v.numpy() for v in model.variables]
    slots = [v.numpy() for v in opt.variables]

    keras.utils.set_random_seed(6)
    other = models.mlp()
    other_opt = keras.optimizers.Adam(1e-2)
    _train(other, other_opt, partitions=2, steps=1)  # different layout, different values
    tf.train.Checkpoint(model=other, optimizer=other_opt).restore(path).assert_existing_objects_matched()
    for v, w in zip(other.variables, weights):
        np.testing.assert_array_equal(v.numpy(), w)
    for v, w in zip(other_opt.variables, slots):
        np.testing.assert_array_equal(v.numpy(), w)


def test_keras_weights_file_round_trip(tmp_path):
    import keras

    keras.utils.set_random_seed(7)
    model = models.mlp()
    _train(model, keras.optimizers.SGD(0.1), partitions=2)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    plain = models.mlp()  # never partitioned
    plain.load_weights(path)
    for a, b in zip(plain.variables, model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
