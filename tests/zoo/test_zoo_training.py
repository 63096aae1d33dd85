"""End to end: 20 pipelined training steps give the single-device loop's weights.

The reference applies, each step, the mean of the M micro-batches'
gradients computed one micro-batch at a time on one device; the pipeline
computes them on 2 partitions. Models with dropout, BatchNorm statistics and
a tied embedding, trained with Adam and with SGD with momentum: after 20
steps every variable (weights, optimizer state aside, BatchNorm statistics,
seed states) must match within 1e-5.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from tests.zoo import zoo_models

STEPS = 20
M = 4
RTOL = 1e-5


def _batchnorm_dropout_case():
    """Rescaling -> Dense -> BatchNorm -> Dropout -> Dense -> BatchNorm -> Dense."""
    keras.utils.set_random_seed(zoo_models.SEED)
    inp = keras.Input((16,))
    h = keras.layers.Rescaling(0.5)(inp)
    h = keras.layers.Dense(32, activation="relu")(h)
    h = keras.layers.BatchNormalization(momentum=0.8)(h)
    h = keras.layers.Dropout(0.2, seed=5)(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    h = keras.layers.BatchNormalization(momentum=0.8)(h)
    out = keras.layers.Dense(4)(h)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    return smp.DistributedModel(inp, out), x, y, zoo_models.mse


def _tied_transformer_case():
    case = zoo_models.ENTRIES["tied_transformer"]()
    return case.model, case.x, case.y, case.loss


CASES = {"batchnorm_dropout": _batchnorm_dropout_case, "tied_transformer": _tied_transformer_case}
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
}


def _body(model, loss_fn):
    def body(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    return body


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(CASES))
def test_twenty_steps_match_the_single_device_loop(case, optimizer):
    model, x, y, loss_fn = CASES[case]()
    init = [v.numpy() for v in model.variables]
    body = _body(model, loss_fn)

    ref_body = tf.function(body)
    ref_opt = OPTIMIZERS[optimizer]()
    ref_losses = []
    for _ in range(STEPS):
        outs = [ref_body(tf.constant(x[m::M]), tf.constant(y[m::M])) for m in range(M)]
        grads = [tf.add_n([o[1][i] for o in outs]) / M for i in range(len(outs[0][1]))]
        ref_opt.apply_gradients(zip(grads, model.trainable_variables))
        ref_losses.append(float(np.mean([o[0] for o in outs])))
    expected = [v.numpy() for v in model.variables]

    for v, value in zip(model.variables, init):
        v.assign(value)
    smp.init({"partitions": 2, "microbatches": M, "pipeline": "interleaved"})
    step = smp.step(body)
    opt = OPTIMIZERS[optimizer]()

    @tf.function
    def train(x, y):
        loss, grads = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    losses = [float(train(x, y)) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert losses[-1] < losses[0]
    for v, e in zip(model.variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=RTOL, atol=1e-7, err_msg=v.path)
    assert {v.value.device[-1] for v in model.trainable_variables} == {"0", "1"}
