"""Keras `fit`, `evaluate` and `predict` of a DistributedModel run through the pipeline.

Transparency: without dropout or BatchNorm, `fit` under smp_tf gives plain
Keras's History and final weights (from the same initial weights and data
order), also with a validation set and a last batch whose size is not a
multiple of the batch size nor of `microbatches`. With BatchNorm and dropout
the reference is the per-micro-batch loop on one device (a model whose
`train_step` loops over the micro-batches, below), since BatchNorm statistics
and dropout masks are per micro-batch.
"""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.trainers.data_adapters import data_adapter_utils

import smp_tf as smp

M = 4
RTOL = 1e-5
ATOL = 1e-5  # final weights: "within 1e-5"


# --------------------------------------------------------------------------
# models and data
# --------------------------------------------------------------------------
class _Body:
    """The subclassed form: three Dense layers and a head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = [keras.layers.Dense(32, activation="relu") for _ in range(3)]
        self.head = keras.layers.Dense(3)

    def call(self, x):
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)


class PlainSubclassed(_Body, keras.Model):
    pass


class SmpSubclassed(_Body, smp.DistributedModel):
    pass


def _functional(cls):
    inp = keras.Input((16,))
    h = inp
    for _ in range(3):
        h = keras.layers.Dense(32, activation="relu")(h)
    return cls(inp, keras.layers.Dense(3)(h))


def build(kind: str, smp_form: bool):
    keras.utils.set_random_seed(7)
    if kind == "functional":
        model = _functional(smp.DistributedModel if smp_form else keras.Model)
    else:
        model = (SmpSubclassed if smp_form else PlainSubclassed)()
        model(np.zeros((2, 16), "float32"))
    return model


def compile_(model, **kwargs):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def data(n=90, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 3, size=(n,)).astype("int32")


X, Y = data(90)          # batch 16: 5 full batches and one of 10 rows (not a multiple of 4)
XV, YV = data(21, 1)     # validation batches of 16 and 5 rows


def assert_history_equal(got, expected):
    assert set(got) == set(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=RTOL, atol=1e-6, err_msg=key)


def assert_weights_equal(model, reference):
    for w, r in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(w, r, rtol=RTOL, atol=ATOL)


_REFERENCE = {}


def plain_fit(kind):
    """Plain Keras on one device: the reference History and model (cached)."""
    if kind not in _REFERENCE:
        model = compile_(build(kind, smp_form=False))
        history = model.fit(X, Y, batch_size=16, epochs=3, validation_data=(XV, YV), shuffle=False, verbose=0)
        _REFERENCE[kind] = (history.history, model)
    return _REFERENCE[kind]


# --------------------------------------------------------------------------
# transparency against plain Keras
# --------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,partitions,virtual_stages", [
    ("simple", 2, 1), ("interleaved", 2, 1), ("simple", 3, 1), ("interleaved", 3, 1),
    ("zero_bubble", 2, 1), ("interleaved", 2, 2), ("zero_bubble", 2, 2),
])
@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_fit_matches_plain_keras(kind, partitions, schedule, virtual_stages):
    expected, reference = plain_fit(kind)
    smp.init({"partitions": partitions, "microbatches": M, "pipeline": schedule, "virtual_stages": virtual_stages})
    model = compile_(build(kind, smp_form=True))
    history = model.fit(X, Y, batch_size=16, epochs=3, validation_data=(XV, YV), shuffle=False, verbose=0)
    assert_history_equal(history.history, expected)
    assert_weights_equal(model, reference)
    # The variables and the optimizer state live on their partitions.
    devices = {v.value.device.rsplit(":", 1)[-1] for v in model.trainable_variables}
    assert devices == {str(p) for p in range(partitions)}
    slots = [v for v in model.optimizer.variables if tuple(v.shape) != ()]
    for v in model.trainable_variables:
        prefix = v.path.replace("/", "_") + "_"
        for s in slots:
            if s.name.startswith(prefix) and tuple(s.shape) == tuple(v.shape):
                assert s.value.device == v.value.device, s.name
    # evaluate and predict through the pipeline equal plain Keras.
    np.testing.assert_allclose(
        model.evaluate(XV, YV, batch_size=6, verbose=0), reference.evaluate(XV, YV, batch_size=6, verbose=0),
        rtol=RTOL, atol=1e-6,
    )
    np.testing.assert_allclose(
        model.predict(XV, batch_size=8, verbose=0), reference.predict(XV, batch_size=8, verbose=0), rtol=RTOL, atol=1e-5
    )


def test_predict_keeps_row_order_for_every_batch_size():
    smp.init({"partitions": 2, "microbatches": M})
    model = build("functional", smp_form=True)
    x, _ = data(23)
    expected = model(x).numpy()
    for batch_size in (1, 3, 4, 5, 8, 23):
        np.testing.assert_allclose(model.predict(x, batch_size=batch_size, verbose=0), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.predict_on_batch(x[:7]), expected[:7], rtol=1e-5, atol=1e-6)


def _loss_and_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


class PlainCustomStep(_Body, keras.Model):
    """A custom `train_step` as Keras's guide writes one."""

    def loss_and_grads(self, x, y):
        return _loss_and_grads(self, x, y)

    def train_step(self, data):
        x, y = data
        loss, grads = self.loss_and_grads(x, y)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"step_loss": loss}


class SmpCustomStep(_Body, smp.DistributedModel):
    """The same with its forward and backward in an `smp.step` method."""

    @smp.step
    def loss_and_grads(self, x, y):
        return _loss_and_grads(self, x, y)

    def train_step(self, data):
        x, y = data
        loss, grads = self.loss_and_grads(x, y)
        self.optimizer.apply_gradients(zip([g.accumulate() for g in grads], self.trainable_variables))
        return {"step_loss": loss.reduce_mean()}


def _custom_steps_fit_alike(plain_cls, smp_cls, input_width, seed, compile_kwargs, *fit_args, **fit_kwargs):
    """`fit` of a plain Keras model with a custom `train_step` and of its
    pipelined form (P=2) from the same initial weights: asserts the same
    history and weights and returns the pipelined model. `compile_kwargs()`
    gives each model its own optimizer."""
    smp.init({"partitions": 2, "microbatches": M})
    histories, models = [], []
    for cls in (plain_cls, smp_cls):
        keras.utils.set_random_seed(seed)
        model = cls()
        model(np.zeros((2, input_width), "float32"))
        model.compile(**compile_kwargs())
        histories.append(model.fit(*fit_args, shuffle=False, verbose=0, **fit_kwargs).history)
        models.append(model)
    assert_history_equal(histories[1], histories[0])
    assert_weights_equal(models[1], models[0])
    assert len({v.value.device for v in models[1].trainable_variables}) == 2
    return models[1]


def test_a_custom_train_step_pipelines_through_an_smp_step_method():
    def compile_kwargs():
        return dict(optimizer=keras.optimizers.Adam(1e-2),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    # 80 rows: batches of 16, each split into M equal micro-batches.
    model = _custom_steps_fit_alike(PlainCustomStep, SmpCustomStep, 16, 7, compile_kwargs, X[:80], Y[:80],
                                    batch_size=16, epochs=2)
    step = model.loss_and_grads
    assert step.last_plan is not None and step.last_plan.num_partitions == 2


_LATENT = 8
_BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def _mlp(inputs, outputs):
    return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(32, activation="relu"), keras.layers.Dense(outputs)])


class _GAN:
    """A GAN: one training step updates the discriminator, then the
    generator, each from its own loss and optimizer. Both losses run both
    networks, so the two steps share variables."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gen, self.disc = _mlp(_LATENT, 16), _mlp(16, 1)
        self.d_opt, self.g_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3)

    def call(self, z):
        return self.gen(z)

    def d_body(self, real, z):
        with tf.GradientTape() as tape:
            on_real = self.disc(real, training=True)
            on_fake = self.disc(self.gen(z, training=True), training=True)
            loss = _BCE(tf.ones_like(on_real), on_real) + _BCE(tf.zeros_like(on_fake), on_fake)
        return loss, tape.gradient(loss, self.disc.trainable_variables)

    def g_body(self, z):
        with tf.GradientTape() as tape:
            on_fake = self.disc(self.gen(z, training=True), training=True)
            loss = _BCE(tf.ones_like(on_fake), on_fake)
        return loss, tape.gradient(loss, self.gen.trainable_variables)

    def train_step(self, real):
        z = tf.random.stateless_normal([tf.shape(real)[0], _LATENT], seed=[1, 2])
        d_loss, d_grads = self.d_step(real, z)
        self.d_opt.apply_gradients(zip(self.combine(d_grads), self.disc.trainable_variables))
        g_loss, g_grads = self.g_step(z)
        self.g_opt.apply_gradients(zip(self.combine(g_grads), self.gen.trainable_variables))
        return {"d_loss": self.mean(d_loss), "g_loss": self.mean(g_loss)}


class PlainGAN(_GAN, keras.Model):
    d_step, g_step = _GAN.d_body, _GAN.g_body

    def combine(self, grads):
        return grads

    def mean(self, loss):
        return loss


class SmpGAN(_GAN, smp.DistributedModel):
    d_step, g_step = smp.step(_GAN.d_body), smp.step(_GAN.g_body)

    def combine(self, grads):
        return [g.accumulate() for g in grads]

    def mean(self, loss):
        return loss.reduce_mean()


def test_a_gan_with_two_smp_step_methods_matches_plain_keras():
    real = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
    _custom_steps_fit_alike(PlainGAN, SmpGAN, _LATENT, 5, dict, real, batch_size=32, epochs=3)


# --------------------------------------------------------------------------
# with BatchNorm and dropout: the per-micro-batch reference
# --------------------------------------------------------------------------
class MicrobatchLoop(keras.Model):
    """The reference for models with per-micro-batch state: Keras's step, run
    micro-batch by micro-batch on one device (strided rows, M equal parts),
    the mean of the gradients applied once, metrics on the whole batch."""

    def train_step(self, data):
        x, y, sw = data_adapter_utils.unpack_x_y_sample_weight(data)
        losses, grads, preds = [], None, []
        for m in range(M):
            xm, ym = x[m::M], y[m::M]
            with tf.GradientTape() as tape:
                pred = self(xm, training=True)
                loss = self._compute_loss(x=xm, y=ym, y_pred=pred, training=True)
            g = tape.gradient(loss, self.trainable_weights)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
            losses.append(loss)
            preds.append(pred)
        self.optimizer.apply_gradients(zip([g / M for g in grads], self.trainable_weights))
        self._loss_tracker.update_state(tf.add_n(losses) / M, sample_weight=tf.shape(x)[0])
        merged = smp_merge(preds)
        return self.compute_metrics(x, y, merged, sample_weight=sw)


def smp_merge(parts):
    from smp_tf.split import merge_microbatches

    return merge_microbatches(parts)


def _stateful(cls):
    keras.utils.set_random_seed(3)
    inp = keras.Input((16,))
    h = keras.layers.Rescaling(0.5)(inp)
    h = keras.layers.Dense(32, activation="relu")(h)
    h = keras.layers.BatchNormalization(momentum=0.7)(h)
    h = keras.layers.Dropout(0.25, seed=9)(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    h = keras.layers.BatchNormalization(momentum=0.7)(h)
    return cls(inp, keras.layers.Dense(3)(h))


@pytest.mark.parametrize("schedule", ["simple", "interleaved"])
def test_fit_with_batchnorm_and_dropout_matches_the_microbatch_loop(schedule):
    x, y = data(64, 2)
    reference = compile_(_stateful(MicrobatchLoop))
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    smp.init({"partitions": 2, "microbatches": M, "pipeline": schedule})
    model = compile_(_stateful(smp.DistributedModel))
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert_history_equal(history, expected)
    # Every variable, BatchNorm statistics and seed states included.
    for v, r in zip(model.variables, reference.variables):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=RTOL, atol=ATOL, err_msg=v.path)


# --------------------------------------------------------------------------
# what Keras users rely on
# --------------------------------------------------------------------------
def _fit_both(fit_kwargs, compile_kwargs=None, inputs=None):
    """fit with plain Keras and with smp_tf (2 partitions); both Histories and models."""
    results = []
    for smp_form in (False, True):
        if smp_form:
            smp.init({"partitions": 2, "microbatches": M})
        model = compile_(build("functional", smp_form), **(compile_kwargs or {}))
        keras.utils.set_random_seed(11)  # the same shuffling order in both runs
        history = model.fit(**(inputs() if inputs else {"x": X, "y": Y}), verbose=0, **fit_kwargs)
        results.append((history.history, model))
    return results


@pytest.mark.parametrize(
    "fit_kwargs",
    [
        {"batch_size": 16, "epochs": 2, "validation_split": 0.25},
        {"batch_size": 12, "epochs": 2, "shuffle": True},
        {"batch_size": 16, "epochs": 2, "class_weight": {0: 1.0, 1: 2.0, 2: 0.5}},
        {"batch_size": 16, "epochs": 2, "sample_weight": np.linspace(0.1, 2.0, 90).astype("float32")},
        {"batch_size": 16, "epochs": 3, "initial_epoch": 1},
        {"batch_size": 8, "epochs": 2, "steps_per_epoch": 5},
    ],
    ids=["validation_split", "shuffle", "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch"],
)
def test_fit_arguments_behave_as_in_plain_keras(fit_kwargs):
    (expected, reference), (got, model) = _fit_both(fit_kwargs)
    assert_history_equal(got, expected)
    assert_weights_equal(model, reference)


def test_steps_per_execution_and_run_eagerly():
    for compile_kwargs in ({"steps_per_execution": 3}, {"run_eagerly": True}):
        (expected, reference), (got, model) = _fit_both({"batch_size": 16, "epochs": 2}, compile_kwargs)
        assert_history_equal(got, expected)
        assert_weights_equal(model, reference)


def _dict_model(cls):
    keras.utils.set_random_seed(5)
    a, b = keras.Input((10,), name="a"), keras.Input((6,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8)(a), keras.layers.Dense(8)(b)])
    h = keras.layers.Dense(16, activation="relu")(h)
    return cls({"a": a, "b": b}, keras.layers.Dense(3)(h))


def test_dict_inputs_datasets_generators_and_pydatasets():
    rng = np.random.default_rng(4)
    xa, xb = rng.normal(size=(50, 10)).astype("float32"), rng.normal(size=(50, 6)).astype("float32")
    y = rng.integers(0, 3, size=(50,)).astype("int32")

    def dataset():
        return tf.data.Dataset.from_tensor_slices(({"a": xa, "b": xb}, y)).batch(12)

    def generator():
        while True:
            for i in range(0, 50, 12):
                yield {"a": xa[i:i + 12], "b": xb[i:i + 12]}, y[i:i + 12]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            s = slice(10 * i, 10 * i + 10)
            return {"a": xa[s], "b": xb[s]}, y[s]

    sources = {
        "numpy": dict(x={"a": xa, "b": xb}, y=y, batch_size=12),
        "dataset": dict(x=dataset()),
        "generator": dict(x=generator(), steps_per_epoch=5),
        "pydataset": dict(x=Batches()),
    }
    for name, kwargs in sources.items():
        histories, models = [], []
        for cls in (keras.Model, smp.DistributedModel):
            if cls is smp.DistributedModel:
                smp.init({"partitions": 2, "microbatches": M})
            model = compile_(_dict_model(cls))
            kw = dict(kwargs)
            if name == "generator":
                kw["x"] = generator()
            histories.append(model.fit(epochs=2, verbose=0, **kw).history)
            models.append(model)
        assert_history_equal(histories[1], histories[0])
        assert_weights_equal(models[1], models[0])


def test_on_batch_methods():
    smp.init({"partitions": 2, "microbatches": M})
    reference = compile_(build("functional", False))
    model = compile_(build("functional", True))
    for rows in (16, 10, 3):  # even, uneven, fewer rows than micro-batches
        expected = reference.train_on_batch(X[:rows], Y[:rows], return_dict=True)
        got = model.train_on_batch(X[:rows], Y[:rows], return_dict=True)
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=RTOL, atol=1e-6)
        np.testing.assert_allclose(
            model.test_on_batch(XV, YV), reference.test_on_batch(XV, YV), rtol=RTOL, atol=1e-6
        )
        np.testing.assert_allclose(model.predict_on_batch(XV), reference.predict_on_batch(XV), rtol=RTOL, atol=1e-5)
    assert_weights_equal(model, reference)


def test_callbacks_fire_as_in_plain_keras(tmp_path):
    logs = {}
    for smp_form in (False, True):
        name = "smp" if smp_form else "keras"
        if smp_form:
            smp.init({"partitions": 2, "microbatches": M})
        model = compile_(build("functional", smp_form))
        seen = []
        callbacks = [
            keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv")),
            keras.callbacks.ModelCheckpoint(str(tmp_path / f"{name}-{{epoch}}.weights.h5"), save_weights_only=True),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(("batch", batch)),
                                           on_epoch_end=lambda epoch, logs: seen.append(("epoch", epoch))),
        ]
        history = model.fit(X, Y, batch_size=16, epochs=6, validation_data=(XV, YV), callbacks=callbacks,
                            shuffle=False, verbose=0)
        with open(tmp_path / f"{name}.csv") as f:
            rows = list(csv.DictReader(f))
        logs[name] = (history.history, rows, seen, sorted(p.name for p in tmp_path.glob(f"{name}-*.weights.h5")),
                      model.get_weights(), float(model.optimizer.learning_rate))
    (h0, rows0, seen0, ck0, w0, lr0), (h1, rows1, seen1, ck1, w1, lr1) = logs["keras"], logs["smp"]
    assert_history_equal(h1, h0)
    assert len(h1["loss"]) == 2  # EarlyStopping stopped both runs after epoch 2
    assert [r["epoch"] for r in rows1] == [r["epoch"] for r in rows0]
    for r1, r0 in zip(rows1, rows0):
        for key in r0:
            np.testing.assert_allclose(float(r1[key]), float(r0[key]), rtol=RTOL, atol=1e-6)
    assert seen1 == seen0
    assert [c.replace("smp", "keras") for c in ck1] == ck0
    np.testing.assert_allclose(lr1, lr0, rtol=1e-6)
    for a, b in zip(w1, w0):  # restore_best_weights restored the same epoch's weights
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_tensorboard_callback_writes_logs(tmp_path):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build("functional", True))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    assert list((tmp_path / "train").glob("events.out.tfevents.*"))


def test_progress_bar_prints(capsys):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build("functional", True))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert "6/6" in out and "loss" in out and "accuracy" in out


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------
def test_fit_before_compile_is_a_clear_error():
    smp.init({"partitions": 2, "microbatches": M})
    with pytest.raises(ValueError, match="compile"):
        build("functional", True).fit(X, Y, verbose=0)


def test_jit_compile_true_is_rejected():
    smp.init({"partitions": 2, "microbatches": M})
    model = build("functional", True)
    with pytest.raises(ValueError, match=r"jit_compile=True.*pipeline"):
        compile_(model, jit_compile=True)
    compile_(model)  # "auto" resolves to False
    assert model.jit_compile is False


def test_strategy_scope_is_rejected():
    smp.init({"partitions": 2, "microbatches": M})
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = compile_(build("functional", True))
    with pytest.raises(ValueError, match="tf.distribute strategy"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)


def test_wrong_input_shape_and_dtype_are_clear_errors():
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build("functional", True))
    with pytest.raises(ValueError, match=r"(?i)shape|incompatible|expected"):
        model.fit(np.zeros((32, 5), "float32"), Y[:32], batch_size=16, verbose=0)
    with pytest.raises((ValueError, TypeError), match=r"(?i)string|dtype|type"):
        model.fit(np.array([["a"] * 16] * 32), Y[:32], batch_size=16, verbose=0)


def test_fit_before_smp_init_is_a_clear_error(monkeypatch):
    from smp_tf import state

    model = compile_(build("functional", True))
    monkeypatch.setattr(state._STATE, "config", None)
    with pytest.raises(RuntimeError, match=r"smp\.init"):
        model.fit(X, Y, batch_size=16, verbose=0)


def _fit_plain_and_pipelined(optimizer):
    """Two epochs of `fit` with a fresh `optimizer()`, in plain Keras and at
    P=2; asserts the same history and weights and returns both models."""
    histories, models = [], []
    for smp_form in (False, True):
        if smp_form:
            smp.init({"partitions": 2, "microbatches": M})
        model = build("functional", smp_form)
        model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        histories.append(model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0).history)
        models.append(model)
    assert_history_equal(histories[1], histories[0])
    assert_weights_equal(models[1], models[0])
    return models


def test_loss_scale_optimizer_matches_plain_keras():
    """The loss scale is read per batch, not frozen into the cached step."""
    def optimizer():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=4.0,
                                                   dynamic_growth_steps=1)

    plain, pipelined = _fit_plain_and_pipelined(optimizer)
    assert float(pipelined.optimizer.dynamic_scale) == float(plain.optimizer.dynamic_scale) > 4.0


_OPTIMIZERS = {
    "clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5),
    "global_clipnorm": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
    "clipvalue_momentum": lambda: keras.optimizers.SGD(1e-1, momentum=0.9, clipvalue=0.05),
    "adamw_ema_schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(1e-2, 20), weight_decay=0.05, use_ema=True, ema_overwrite_frequency=3),
    "gradient_accumulation": lambda: keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_optimizer_options_act_on_the_whole_batchs_gradients(name):
    """Clipping, weight decay, EMA, a schedule and Keras's own gradient
    accumulation see the gradients of the whole batch (the micro-batches'
    accumulated), as in plain Keras: clipping each micro-batch's gradients
    would give other weights."""
    _fit_plain_and_pipelined(_OPTIMIZERS[name])


def test_evaluate_and_predict_run_forward_only_pipelines():
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build("functional", True))
    model.fit(X[:32], Y[:32], batch_size=16, verbose=0)
    model.evaluate(XV, YV, batch_size=8, verbose=0)
    model.predict(XV, batch_size=8, verbose=0)
    steps = model.step_functions
    assert any(t.backward for t in steps.train.schedule.tasks)
    for fn in (steps.test, steps.predict):
        assert fn.schedule.num_microbatches == M
        assert not any(t.backward for t in fn.schedule.tasks), fn.schedule
        assert {t.partition for t in fn.schedule.tasks} == {0, 1}
