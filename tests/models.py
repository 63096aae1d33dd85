"""Small models used by the tests: each exercises one pipeline feature."""

from __future__ import annotations

import numpy as np
import keras
import tensorflow as tf

import smp_tf as smp

BATCH = 24  # divisible by every micro-batch count the tests use: 1, 2, 3, 4, 8


def mlp() -> keras.Model:
    """A plain chain: every partition boundary is one activation tensor."""
    inp = keras.Input((16,))
    x = inp
    for i in range(6):
        x = keras.layers.Dense(32, activation="relu", name=f"dense{i}")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return smp.DistributedModel(inp, out)


def residual_cnn() -> keras.Model:
    """Skip connections that jump over layers, so they cross partitions."""
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(inp)
    for b in range(3):
        y = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name=f"b{b}_c1")(x)
        y = keras.layers.Conv2D(8, 3, padding="same", name=f"b{b}_c2")(y)
        x = keras.layers.Add(name=f"b{b}_add")([x, y])
        x = keras.layers.Activation("relu", name=f"b{b}_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return smp.DistributedModel(inp, out)


class TiedTransformer(smp.DistributedModel):
    """A Transformer block whose output projection reuses the embedding matrix."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, dim, name="embed")
        self.attn = keras.layers.MultiHeadAttention(heads, dim // heads, name="attn")
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.ff1 = keras.layers.Dense(2 * dim, activation="relu", name="ff1")
        self.ff2 = keras.layers.Dense(dim, name="ff2")
        self.norm2 = keras.layers.LayerNormalization(name="norm2")

    def call(self, tokens, training=False):
        h = self.embed(tokens)
        h = self.norm1(h + self.attn(h, h, training=training))
        h = self.norm2(h + self.ff2(self.ff1(h)))
        # Tied output projection: logits = h @ E^T.
        return tf.matmul(h, self.embed.embeddings, transpose_b=True)


def tied_transformer() -> keras.Model:
    model = TiedTransformer()
    model(np.zeros((2, 6), dtype="int32"))
    return model


def batchnorm_model() -> keras.Model:
    """BatchNorm updates moving statistics once per micro-batch, in order."""
    inp = keras.Input((16,))
    x = keras.layers.Dense(32, name="d0")(inp)
    x = keras.layers.BatchNormalization(momentum=0.5, name="bn0")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Dense(32, name="d1")(x)
    x = keras.layers.BatchNormalization(momentum=0.5, name="bn1")(x)
    x = keras.layers.Activation("relu")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return smp.DistributedModel(inp, out)


def dropout_model() -> keras.Model:
    """Dropout draws from a seed generator whose state advances per micro-batch."""
    inp = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d0")(inp)
    x = keras.layers.Dropout(0.3, seed=7, name="drop0")(x)
    x = keras.layers.Dense(32, activation="relu", name="d1")(x)
    x = keras.layers.Dropout(0.3, seed=8, name="drop1")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return smp.DistributedModel(inp, out)


def data(kind: str, batch: int = BATCH, seed: int = 0):
    """Deterministic inputs and targets for a model kind."""
    rng = np.random.default_rng(seed)
    if kind == "residual_cnn":
        x = rng.normal(size=(batch, 8, 8, 3)).astype("float32")
        y = rng.normal(size=(batch, 4)).astype("float32")
    elif kind == "tied_transformer":
        x = rng.integers(0, 32, size=(batch, 6)).astype("int32")
        y = rng.integers(0, 32, size=(batch, 6)).astype("int32")
    else:
        x = rng.normal(size=(batch, 16)).astype("float32")
        y = rng.normal(size=(batch, 4)).astype("float32")
    return x, y


def loss_fn(kind: str):
    if kind == "tied_transformer":
        return lambda y, p: tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=p)
        )
    return lambda y, p: tf.reduce_mean(tf.square(p - y))


BUILDERS = {
    "mlp": mlp,
    "residual_cnn": residual_cnn,
    "tied_transformer": tied_transformer,
    "batchnorm": batchnorm_model,
    "dropout": dropout_model,
}


def make_body(model: keras.Model, kind: str):
    """The training-step body used by the tests: loss, gradients, predictions."""
    loss_of = loss_fn(kind)

    def body(x, y):
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = loss_of(y, pred)
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads, pred

    return body


def reference(body, x, y, num_microbatches: int):
    """The single-device reference: the same body per micro-batch, in a loop."""
    fn = tf.function(body)
    outs = []
    for m in range(num_microbatches):
        outs.append(fn(tf.constant(x[m::num_microbatches]), tf.constant(y[m::num_microbatches])))
    return outs
