"""A zoo of small configurations of the models users bring to smp_tf.

Each entry is a function ``build()`` that returns a `ZooCase`: a
`smp.DistributedModel`, one batch of inputs and targets, a loss, the keyword
arguments of the training call and the mixed precision policy the model was
built under. `ENTRIES` maps each entry's name to its ``build``.

Every ``build()`` seeds Keras (`keras.utils.set_random_seed`) before creating
any layer and draws its data from ``np.random.default_rng(SEED)``, so two
builds of an entry have the same weights, inputs and dropout seeds.

Tags:

- ``"large"``: a `keras.applications` network at its real width (millions
  of parameters, thousands of ops once differentiated).
- ``"keras_hub"``: a `keras_hub` backbone, fed a dict of inputs.
- ``"random"``: draws random numbers in training (dropout or noise layers);
  each such layer owns a `keras.random.SeedGenerator` whose state variable
  advances on every training call.
- ``"batchnorm"``: has BatchNormalization layers whose moving statistics
  (non-trainable variables) are updated by every training call.
- ``"rnn"``: a recurrent layer or a `tf.while_loop` over timesteps.
- ``"subclassed"``: a subclass of `smp.DistributedModel` with its own `call`.
- ``"tied"``: one weight matrix is used twice (embedding and output layer).
- ``"skip"``: long skip connections.
- ``"bf16"``: built under the ``"mixed_bfloat16"`` policy.
- ``"noise"``: one entry per Keras noise layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Set

import keras
import numpy as np
import tensorflow as tf

import smp_tf as smp

__all__ = ["BATCH", "ENTRIES", "SEED", "ZooCase", "mse", "sparse_ce_from_logits"]

#: Rows in every entry's batch; divisible by 4 micro-batches of 2 rows.
BATCH = 8
#: Seed of every entry's weights (`keras.utils.set_random_seed`) and data.
SEED = 1234

Inputs = Any  # np.ndarray, or a dict of np.ndarray for keras_hub models


@dataclasses.dataclass
class ZooCase:
    """One model of the zoo, ready for a training step.

    Attributes:
        name: The entry's name (its key in `ENTRIES`).
        model: The model, an instance of `smp.DistributedModel`, built.
        x: The input batch of `BATCH` rows: an array, or a dict of arrays.
        y: The targets for ``x``.
        loss: ``loss(y_true, y_pred)``, a scalar float32 tensor: the mean
            over the rows (and over tokens or pixels where there are any).
        training_kwargs: Extra keyword arguments of
            ``model(x, training=True, **training_kwargs)``.
        policy: The mixed precision policy the layers were built under, or
            None for float32. The layers keep it; ``build()`` restores the
            global policy to ``"float32"`` before returning.
        tags: Features of the model; see the module docstring.
    """

    name: str
    model: keras.Model
    x: Inputs
    y: np.ndarray
    loss: Callable[[Any, Any], tf.Tensor]
    training_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    policy: Optional[str] = None
    tags: Set[str] = dataclasses.field(default_factory=set)


# --------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------


def mse(y_true, y_pred) -> tf.Tensor:
    """Mean squared error over every element, computed in float32."""
    y_pred = tf.cast(y_pred, tf.float32)
    y_true = tf.cast(y_true, tf.float32)
    return tf.reduce_mean(tf.square(y_pred - y_true))


def sparse_ce_from_logits(y_true, y_pred) -> tf.Tensor:
    """Sparse softmax cross-entropy from logits, averaged over rows (and tokens).

    ``y_true`` holds integer class ids of shape ``y_pred.shape[:-1]``.
    """
    labels = tf.cast(y_true, tf.int32)
    logits = tf.cast(y_pred, tf.float32)
    return tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    )


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


def _images(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.uniform(0.0, 1.0, size=(BATCH,) + tuple(shape)).astype("float32")


def _normal(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.standard_normal((BATCH,) + tuple(shape)).astype("float32")


def _classes(rng: np.random.Generator, n: int, shape=()) -> np.ndarray:
    return rng.integers(0, n, size=(BATCH,) + tuple(shape)).astype("int32")


# --------------------------------------------------------------------------
# 1. keras.applications (weights=None, the smallest input each accepts)
# --------------------------------------------------------------------------

#: All the applications below accept 32x32 inputs, their minimum
#: (`imagenet_utils.obtain_input_shape(min_size=32)`).
APP_IMAGE_SHAPE = (32, 32, 3)
APP_CLASSES = 4


def _application(
    name: str, app_fn: Callable[..., keras.Model], tags: Set[str], image_shape=APP_IMAGE_SHAPE, **kwargs
) -> ZooCase:
    keras.utils.set_random_seed(SEED)
    app = app_fn(
        weights=None,
        include_top=True,
        classes=APP_CLASSES,
        classifier_activation=None,
        input_shape=image_shape,
        **kwargs,
    )
    inp = keras.Input(image_shape, name="image")
    model = smp.DistributedModel(inp, app(inp), name=name)
    rng = _rng()
    return ZooCase(
        name=name,
        model=model,
        x=_images(rng, image_shape),
        y=_classes(rng, APP_CLASSES),
        loss=sparse_ce_from_logits,
        tags={"large", "batchnorm"} | tags,
    )


def resnet50() -> ZooCase:
    """ResNet50 at 32x32, 4 classes (logits): residual blocks with BatchNorm."""
    return _application("resnet50", keras.applications.ResNet50, set())


def mobilenet_v2() -> ZooCase:
    """MobileNetV2 (alpha=0.35) at 32x32, 4 classes: depthwise convs, ReLU6, BatchNorm."""
    return _application("mobilenet_v2", keras.applications.MobileNetV2, set(), alpha=0.35)


def densenet121() -> ZooCase:
    """DenseNet121 at 32x32, 4 classes: every block concatenates all earlier features."""
    return _application("densenet121", keras.applications.DenseNet121, set())


def efficientnet_b0() -> ZooCase:
    """EfficientNetB0 at 32x32, 4 classes.

    Contains its own preprocessing (Rescaling and a Normalization layer with
    non-trainable mean and variance), squeeze-and-excitation multiplies,
    stochastic depth (Dropout with ``noise_shape=(None, 1, 1, 1)``) in the
    blocks and Dropout(0.2) before the classifier; the dropout layers have no
    explicit seed and are seeded through `keras.utils.set_random_seed`.
    """
    return _application("efficientnet_b0", keras.applications.EfficientNetB0, {"random"})


def efficientnet_v2_b0() -> ZooCase:
    """EfficientNetV2B0 at 32x32, 4 classes.

    Its preprocessing is a `Normalization` with a given mean and variance:
    small constant tensors that the step's function captures and reads as
    arguments, never as constants the graph optimiser could fold.
    """
    return _application("efficientnet_v2_b0", keras.applications.EfficientNetV2B0, {"random"})


def inception_v3() -> ZooCase:
    """InceptionV3 at 75x75 (its smallest input), 4 classes.

    Every Inception block feeds one tensor to four branches and concatenates
    them, so the gradient reaching it sums four terms, some computed on
    another partition.
    """
    return _application("inception_v3", keras.applications.InceptionV3, set(), image_shape=(75, 75, 3))


def mobilenet_v3_small() -> ZooCase:
    """MobileNetV3Small (alpha=0.75) at 32x32, 4 classes, Dropout(0.3) before the classifier.

    Its own preprocessing (Rescaling), hard-swish activations
    (``x * relu6(x + 3) / 6``), squeeze-and-excitation multiplies and
    residual adds: the gradient of every hard-swish multiplies three
    tensors with a constant, which the graph optimiser reassociates, and
    the BatchNorm gradients sum terms that cancel almost exactly.
    """
    return _application(
        "mobilenet_v3_small", keras.applications.MobileNetV3Small, {"random"},
        alpha=0.75, dropout_rate=0.3, include_preprocessing=True,
    )


def mobilenet_v3_large() -> ZooCase:
    """MobileNetV3Large (alpha=0.75) at 32x32, 4 classes, Dropout(0.2): as the small one, deeper."""
    return _application(
        "mobilenet_v3_large", keras.applications.MobileNetV3Large, {"random"},
        alpha=0.75, dropout_rate=0.2, include_preprocessing=True,
    )


def hard_swish_cnn() -> ZooCase:
    """A MobileNetV3-style CNN at 8x8, written out: Conv -> BatchNorm -> hard-swish,
    then two inverted-residual blocks (expand, depthwise, squeeze-and-excite
    with a hard sigmoid, project, BatchNorm), the second with a residual add.

    Small enough to be quick at every partition count, and every partition
    boundary falls next to a hard-swish or a squeeze-and-excite multiply.
    """
    keras.utils.set_random_seed(SEED)
    layers = keras.layers

    def hard_sigmoid(t):
        return layers.ReLU(6.0)(t + 3.0) * (1.0 / 6.0)

    def hard_swish(t):
        return layers.Multiply()([t, hard_sigmoid(t)])

    def block(t, channels, residual):
        h = hard_swish(layers.BatchNormalization()(layers.Conv2D(2 * channels, 1, use_bias=False)(t)))
        h = hard_swish(layers.BatchNormalization()(layers.DepthwiseConv2D(3, padding="same", use_bias=False)(h)))
        s = layers.GlobalAveragePooling2D(keepdims=True)(h)
        s = layers.Conv2D(2 * channels, 1)(layers.ReLU()(layers.Conv2D(4, 1)(s)))
        h = layers.Multiply()([h, hard_sigmoid(s)])
        h = layers.BatchNormalization()(layers.Conv2D(channels, 1, use_bias=False)(h))
        return layers.Add()([t, h]) if residual else h

    inp = keras.Input((8, 8, 3), name="image")
    t = hard_swish(layers.BatchNormalization()(layers.Conv2D(8, 3, padding="same")(inp)))
    t = block(t, 8, residual=False)
    t = block(t, 8, residual=True)
    out = layers.Dense(APP_CLASSES)(layers.GlobalAveragePooling2D()(t))
    model = smp.DistributedModel(inp, out, name="hard_swish_cnn")

    rng = _rng()
    return ZooCase(
        name="hard_swish_cnn",
        model=model,
        x=_images(rng, (8, 8, 3)),
        y=_classes(rng, APP_CLASSES),
        loss=sparse_ce_from_logits,
        tags={"batchnorm", "skip"},
    )


# --------------------------------------------------------------------------
# 2. keras_hub backbones (dict inputs)
# --------------------------------------------------------------------------

HUB_VOCAB = 100
HUB_SEQ_LEN = 8


def bert_classifier() -> ZooCase:
    """A tiny `keras_hub` BERT backbone; its pooled output goes to Dense(3).

    Inputs are a dict ``{"token_ids", "segment_ids", "padding_mask"}`` of
    int32 ``(batch, 8)`` arrays; the last tokens of some rows are padding.
    """
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=HUB_VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.1,
        max_sequence_length=16,
    )
    inputs = {
        "token_ids": keras.Input((HUB_SEQ_LEN,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((HUB_SEQ_LEN,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((HUB_SEQ_LEN,), dtype="int32", name="padding_mask"),
    }
    pooled = backbone(inputs)["pooled_output"]
    logits = keras.layers.Dense(3, name="classifier")(pooled)
    model = smp.DistributedModel(inputs, logits, name="bert_classifier")

    rng = _rng()
    lengths = rng.integers(HUB_SEQ_LEN // 2, HUB_SEQ_LEN + 1, size=(BATCH, 1))
    positions = np.arange(HUB_SEQ_LEN)[None, :]
    padding_mask = (positions < lengths).astype("int32")
    token_ids = rng.integers(1, HUB_VOCAB, size=(BATCH, HUB_SEQ_LEN)) * padding_mask
    segment_ids = (positions >= lengths // 2).astype("int32") * padding_mask
    x = {
        "token_ids": token_ids.astype("int32"),
        "segment_ids": segment_ids.astype("int32"),
        "padding_mask": padding_mask,
    }
    return ZooCase(
        name="bert_classifier",
        model=model,
        x=x,
        y=_classes(rng, 3),
        loss=sparse_ce_from_logits,
        tags={"keras_hub", "random"},
    )


def gpt2_lm() -> ZooCase:
    """A tiny `keras_hub` GPT-2 backbone with a tied language-model head.

    Logits are ``backbone.token_embedding(sequence_output, reverse=True)``,
    i.e. ``sequence_output @ token_embedding^T`` with the same variable as
    the input embedding (as in `keras_hub.models.GPT2CausalLM`). Inputs are
    ``{"token_ids", "padding_mask"}`` of shape ``(batch, 8)``; the targets are
    the next tokens and the loss is the mean cross-entropy over all tokens.
    """
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=HUB_VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.1,
        max_sequence_length=16,
    )
    inputs = {
        "token_ids": keras.Input((HUB_SEQ_LEN,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((HUB_SEQ_LEN,), dtype="int32", name="padding_mask"),
    }
    sequence_output = backbone(inputs)
    logits = backbone.token_embedding(sequence_output, reverse=True)
    model = smp.DistributedModel(inputs, logits, name="gpt2_lm")

    rng = _rng()
    tokens = rng.integers(0, HUB_VOCAB, size=(BATCH, HUB_SEQ_LEN + 1)).astype("int32")
    x = {
        "token_ids": tokens[:, :-1],
        "padding_mask": np.ones((BATCH, HUB_SEQ_LEN), dtype="int32"),
    }
    return ZooCase(
        name="gpt2_lm",
        model=model,
        x=x,
        y=tokens[:, 1:],
        loss=sparse_ce_from_logits,
        tags={"keras_hub", "random", "tied"},
    )


# --------------------------------------------------------------------------
# 3. Recurrent models (unroll=False: each runs a tf.while_loop)
# --------------------------------------------------------------------------

RNN_TIMESTEPS = 5
RNN_FEATURES = 3
RNN_OUTPUTS = 2


def _rnn_case(name: str, inp: keras.KerasTensor, out: keras.KerasTensor, tags: Set[str]) -> ZooCase:
    model = smp.DistributedModel(inp, out, name=name)
    rng = _rng()
    return ZooCase(
        name=name,
        model=model,
        x=_normal(rng, (RNN_TIMESTEPS, RNN_FEATURES)),
        y=_normal(rng, (RNN_OUTPUTS,)),
        loss=mse,
        tags={"rnn"} | tags,
    )


def _rnn_input() -> keras.KerasTensor:
    return keras.Input((RNN_TIMESTEPS, RNN_FEATURES), name="sequence")


def lstm() -> ZooCase:
    """LSTM(8) over 5 timesteps, last state -> Dense(2)."""
    keras.utils.set_random_seed(SEED)
    inp = _rnn_input()
    h = keras.layers.LSTM(8, name="lstm")(inp)
    out = keras.layers.Dense(RNN_OUTPUTS, name="head")(h)
    return _rnn_case("lstm", inp, out, set())


def gru() -> ZooCase:
    """GRU(8) over 5 timesteps, last state -> Dense(2)."""
    keras.utils.set_random_seed(SEED)
    inp = _rnn_input()
    h = keras.layers.GRU(8, name="gru")(inp)
    out = keras.layers.Dense(RNN_OUTPUTS, name="head")(h)
    return _rnn_case("gru", inp, out, set())


def stacked_lstm() -> ZooCase:
    """Two LSTM(8) layers; the first returns its whole sequence."""
    keras.utils.set_random_seed(SEED)
    inp = _rnn_input()
    h = keras.layers.LSTM(8, return_sequences=True, name="lstm0")(inp)
    h = keras.layers.LSTM(8, name="lstm1")(h)
    out = keras.layers.Dense(RNN_OUTPUTS, name="head")(h)
    return _rnn_case("stacked_lstm", inp, out, set())


def bidirectional_lstm() -> ZooCase:
    """Bidirectional(LSTM(8)): a forward and a reversed loop, concatenated."""
    keras.utils.set_random_seed(SEED)
    inp = _rnn_input()
    h = keras.layers.Bidirectional(keras.layers.LSTM(8), name="bilstm")(inp)
    out = keras.layers.Dense(RNN_OUTPUTS, name="head")(h)
    return _rnn_case("bidirectional_lstm", inp, out, set())


def lstm_dropout() -> ZooCase:
    """Dense(8) input projection, then LSTM(8, dropout=0.2): a random layer and a loop.

    The LSTM draws one input dropout mask per call (from its own seed
    generator) and applies it at every timestep.
    """
    keras.utils.set_random_seed(SEED)
    inp = _rnn_input()
    h = keras.layers.Dense(8, activation="tanh", name="proj")(inp)
    h = keras.layers.LSTM(8, dropout=0.2, recurrent_dropout=0.0, seed=7, name="lstm")(h)
    out = keras.layers.Dense(RNN_OUTPUTS, name="head")(h)
    return _rnn_case("lstm_dropout", inp, out, {"random"})


class WhileLoopRNN(smp.DistributedModel):
    """A hand-written recurrence: ``h = tanh(x_t @ U + b + h @ W)`` in a `tf.while_loop`.

    ``U`` and ``b`` are a Dense input projection applied to all timesteps at
    once; ``W`` is the kernel of a second Dense layer, multiplied inside the
    loop, so the gradient needs every step's ``h`` (stored by the loop's
    gradient accumulators).
    """

    def __init__(self, units: int = 8, outputs: int = RNN_OUTPUTS, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.proj = keras.layers.Dense(units, name="proj")
        self.recurrent = keras.layers.Dense(units, use_bias=False, name="recurrent")
        self.head = keras.layers.Dense(outputs, name="head")

    def build(self, input_shape):
        self.proj.build(input_shape)
        self.recurrent.build((None, self.units))
        self.head.build((None, self.units))
        self.built = True

    def call(self, x, training=False):
        xs = tf.transpose(self.proj(x), [1, 0, 2])  # (time, batch, units)
        kernel = self.recurrent.kernel
        steps = tf.shape(xs)[0]
        h0 = tf.zeros_like(xs[0])

        def cond(t, h):
            return t < steps

        def body(t, h):
            return t + 1, tf.tanh(xs[t] + tf.matmul(h, kernel))

        _, h = tf.while_loop(cond, body, (tf.constant(0), h0))
        return self.head(h)


def while_loop_rnn() -> ZooCase:
    """A subclassed model whose `call` runs its own `tf.while_loop` over timesteps."""
    keras.utils.set_random_seed(SEED)
    model = WhileLoopRNN(name="while_loop_rnn")
    rng = _rng()
    x = _normal(rng, (RNN_TIMESTEPS, RNN_FEATURES))
    model(x[:2])
    return ZooCase(
        name="while_loop_rnn",
        model=model,
        x=x,
        y=_normal(rng, (RNN_OUTPUTS,)),
        loss=mse,
        tags={"rnn", "subclassed"},
    )


# --------------------------------------------------------------------------
# 4. U-Net
# --------------------------------------------------------------------------


def unet() -> ZooCase:
    """A U-Net on 32x32x3: two down and two up levels, long Concatenate skips.

    Channels 4 (32x32), 8 (16x16) and 8 (8x8, bottom); per-pixel MSE against
    a 32x32x3 target.
    """
    keras.utils.set_random_seed(SEED)
    conv = keras.layers.Conv2D

    inp = keras.Input((32, 32, 3), name="image")
    e1 = conv(4, 3, padding="same", activation="relu", name="enc1_a")(inp)
    e1 = conv(4, 3, padding="same", activation="relu", name="enc1_b")(e1)
    d = keras.layers.MaxPooling2D(name="down1")(e1)
    e2 = conv(8, 3, padding="same", activation="relu", name="enc2_a")(d)
    e2 = conv(8, 3, padding="same", activation="relu", name="enc2_b")(e2)
    d = keras.layers.MaxPooling2D(name="down2")(e2)
    b = conv(8, 3, padding="same", activation="relu", name="bottom_a")(d)
    b = conv(8, 3, padding="same", activation="relu", name="bottom_b")(b)
    u = keras.layers.UpSampling2D(name="up2")(b)
    u = keras.layers.Concatenate(name="skip2")([u, e2])
    u = conv(8, 3, padding="same", activation="relu", name="dec2")(u)
    u = keras.layers.UpSampling2D(name="up1")(u)
    u = keras.layers.Concatenate(name="skip1")([u, e1])
    u = conv(4, 3, padding="same", activation="relu", name="dec1")(u)
    out = conv(3, 1, name="out")(u)
    model = smp.DistributedModel(inp, out, name="unet")

    rng = _rng()
    return ZooCase(
        name="unet",
        model=model,
        x=_images(rng, (32, 32, 3)),
        y=_images(rng, (32, 32, 3)),
        loss=mse,
        tags={"skip"},
    )


# --------------------------------------------------------------------------
# 5. Transformer with tied embeddings
# --------------------------------------------------------------------------


class TiedTransformerLM(smp.DistributedModel):
    """Embedding -> 2 post-norm Transformer blocks -> ``logits = h @ E^T``.

    Each block: MultiHeadAttention, residual, LayerNorm, then a feed-forward
    network (Dense, Dense, Dropout(0.1)), residual, LayerNorm. The output
    projection reuses the embedding matrix ``E``.
    """

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, blocks: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, dim, name="embed")
        self.blocks = []
        for i in range(blocks):
            self.blocks.append(
                dict(
                    attn=keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attn{i}"),
                    norm1=keras.layers.LayerNormalization(name=f"norm{i}_1"),
                    ff1=keras.layers.Dense(2 * dim, activation="relu", name=f"ff{i}_1"),
                    ff2=keras.layers.Dense(dim, name=f"ff{i}_2"),
                    drop=keras.layers.Dropout(0.1, seed=100 + i, name=f"drop{i}"),
                    norm2=keras.layers.LayerNormalization(name=f"norm{i}_2"),
                )
            )

    def call(self, tokens, training=False):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b["norm1"](h + b["attn"](h, h, training=training))
            f = b["drop"](b["ff2"](b["ff1"](h)), training=training)
            h = b["norm2"](h + f)
        return tf.matmul(h, self.embed.embeddings, transpose_b=True)


def tied_transformer() -> ZooCase:
    """A subclassed 2-block Transformer LM on int tokens (8, 6), vocabulary 32, tied output."""
    keras.utils.set_random_seed(SEED)
    model = TiedTransformerLM(name="tied_transformer")
    rng = _rng()
    tokens = rng.integers(0, 32, size=(BATCH, 7)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    model(x[:2])
    return ZooCase(
        name="tied_transformer",
        model=model,
        x=x,
        y=y,
        loss=sparse_ce_from_logits,
        tags={"subclassed", "tied", "random"},
    )


# --------------------------------------------------------------------------
# 6. Mixed precision
# --------------------------------------------------------------------------


def mixed_bfloat16_cnn() -> ZooCase:
    """A Conv/Dense classifier under ``mixed_bfloat16``.

    Variables are float32 and computations bfloat16; the last layer,
    ``Activation("linear", dtype="float32")``, casts the logits back to
    float32 so the loss is computed in float32. Gradients are float32 (the
    variables' dtype).
    """
    policy = "mixed_bfloat16"
    keras.utils.set_random_seed(SEED)
    keras.mixed_precision.set_global_policy(policy)
    try:
        inp = keras.Input((8, 8, 3), name="image")
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv0")(inp)
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(h)
        h = keras.layers.Flatten(name="flatten")(h)
        h = keras.layers.Dense(32, activation="relu", name="dense0")(h)
        h = keras.layers.Dense(32, activation="relu", name="dense1")(h)
        h = keras.layers.Dense(4, name="head")(h)
        out = keras.layers.Activation("linear", dtype="float32", name="logits_f32")(h)
        model = smp.DistributedModel(inp, out, name="mixed_bfloat16_cnn")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    rng = _rng()
    return ZooCase(
        name="mixed_bfloat16_cnn",
        model=model,
        x=_images(rng, (8, 8, 3)),
        y=_classes(rng, 4),
        loss=sparse_ce_from_logits,
        policy=policy,
        tags={"bf16"},
    )


# --------------------------------------------------------------------------
# 7. Noise layers, each after an input transform
# --------------------------------------------------------------------------


def _noise_case(name: str, inp, out, x: np.ndarray, rng: np.random.Generator) -> ZooCase:
    model = smp.DistributedModel(inp, out, name=name)
    return ZooCase(
        name=name,
        model=model,
        x=x,
        y=_normal(rng, (4,)),
        loss=mse,
        tags={"random", "noise"},
    )


def noise_dropout() -> ZooCase:
    """Rescaling(0.5) -> Dense(32, relu) -> Dropout(0.3) -> Dense(32) -> Dense(32) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((16,), name="features")
    h = keras.layers.Rescaling(0.5, name="rescale")(inp)
    h = keras.layers.Dense(32, activation="relu", name="d0")(h)
    h = keras.layers.Dropout(0.3, seed=11, name="dropout")(h)
    h = keras.layers.Dense(32, name="d1")(h)
    h = keras.layers.Dense(32, name="d2")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_dropout", inp, out, _normal(rng, (16,)), rng)


def noise_flatten_dropout() -> ZooCase:
    """Flatten (4x4 -> 16) -> Dense(32, relu) -> Dropout(0.3) -> Dense(32) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((4, 4), name="grid")
    h = keras.layers.Flatten(name="flatten")(inp)
    h = keras.layers.Dense(32, activation="relu", name="d0")(h)
    h = keras.layers.Dropout(0.3, seed=12, name="dropout")(h)
    h = keras.layers.Dense(32, name="d1")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_flatten_dropout", inp, out, _normal(rng, (4, 4)), rng)


def noise_spatial_dropout1d() -> ZooCase:
    """Embedding(32, 8) on int tokens (6) -> SpatialDropout1D(0.3) -> Dense(16) -> mean over time -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(32, 8, name="embed")(inp)
    h = keras.layers.SpatialDropout1D(0.3, seed=13, name="spatial_dropout")(h)
    h = keras.layers.Dense(16, activation="relu", name="d0")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    x = rng.integers(0, 32, size=(BATCH, 6)).astype("int32")
    return _noise_case("noise_spatial_dropout1d", inp, out, x, rng)


def noise_embedding_dropout() -> ZooCase:
    """Embedding(32, 8) on int tokens (6) -> Dropout(0.3) -> Flatten -> Dense(16) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(32, 8, name="embed")(inp)
    h = keras.layers.Dropout(0.3, seed=18, name="dropout")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(16, activation="relu", name="d0")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    x = rng.integers(0, 32, size=(BATCH, 6)).astype("int32")
    return _noise_case("noise_embedding_dropout", inp, out, x, rng)


def noise_spatial_dropout2d() -> ZooCase:
    """Rescaling(1/255) -> Conv2D(4) -> SpatialDropout2D(0.3) -> Conv2D(4) -> pool -> Dense(4), on 8x8x3."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Rescaling(1.0 / 255, name="rescale")(inp)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv0")(h)
    h = keras.layers.SpatialDropout2D(0.3, seed=14, name="spatial_dropout")(h)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    x = rng.uniform(0, 255, size=(BATCH, 8, 8, 3)).astype("float32")
    return _noise_case("noise_spatial_dropout2d", inp, out, x, rng)


def noise_gaussian_noise() -> ZooCase:
    """Rescaling(0.5) -> Dense(32) -> GaussianNoise(0.1) -> Dense(32, relu) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((16,), name="features")
    h = keras.layers.Rescaling(0.5, name="rescale")(inp)
    h = keras.layers.Dense(32, name="d0")(h)
    h = keras.layers.GaussianNoise(0.1, seed=15, name="gaussian_noise")(h)
    h = keras.layers.Dense(32, activation="relu", name="d1")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_gaussian_noise", inp, out, _normal(rng, (16,)), rng)


def noise_gaussian_dropout() -> ZooCase:
    """Flatten (4x4) -> Dense(32, relu) -> GaussianDropout(0.2) -> Dense(32) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((4, 4), name="grid")
    h = keras.layers.Flatten(name="flatten")(inp)
    h = keras.layers.Dense(32, activation="relu", name="d0")(h)
    h = keras.layers.GaussianDropout(0.2, seed=16, name="gaussian_dropout")(h)
    h = keras.layers.Dense(32, name="d1")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_gaussian_dropout", inp, out, _normal(rng, (4, 4)), rng)


def noise_alpha_dropout() -> ZooCase:
    """Dense(32, selu) -> AlphaDropout(0.2) -> Dense(32, selu) -> Dense(4)."""
    keras.utils.set_random_seed(SEED)
    inp = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="selu", kernel_initializer="lecun_normal", name="d0")(inp)
    h = keras.layers.AlphaDropout(0.2, seed=17, name="alpha_dropout")(h)
    h = keras.layers.Dense(32, activation="selu", kernel_initializer="lecun_normal", name="d1")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_alpha_dropout", inp, out, _normal(rng, (16,)), rng)


def noise_stochastic_depth() -> ZooCase:
    """Dense(32, relu) -> residual Dense(32) behind stochastic depth (0.3) ->
    Dense(4). The stochastic depth layer is ConvNeXt's: it draws with no seed,
    from Keras's global seed generator, which is not a variable of the model."""
    from keras.src.applications.convnext import StochasticDepth

    keras.utils.set_random_seed(SEED)
    inp = keras.Input((16,), name="features")
    h = keras.layers.Dense(32, activation="relu", name="d0")(inp)
    branch = keras.layers.Dense(32, name="branch")(h)
    h = keras.layers.Add(name="residual")([h, StochasticDepth(0.3, name="drop_path")(branch)])
    h = keras.layers.Dense(32, name="d1")(h)
    out = keras.layers.Dense(4, name="head")(h)
    rng = _rng()
    return _noise_case("noise_stochastic_depth", inp, out, _normal(rng, (16,)), rng)


# --------------------------------------------------------------------------
# 8. More Keras applications, exercised with -m zoo_all
# --------------------------------------------------------------------------


def nasnet_mobile() -> ZooCase:
    return _application("nasnet_mobile", keras.applications.NASNetMobile, set())


def convnext_tiny_drop_path() -> ZooCase:
    """ConvNeXt-Tiny with stochastic depth 0.2: unseeded draws from Keras's
    global seed generator in every block."""
    from keras.src.applications.convnext import ConvNeXt

    def build(**kwargs):
        return ConvNeXt(depths=[3, 3, 9, 3], projection_dims=[96, 192, 384, 768], drop_path_rate=0.2,
                        name="convnext_tiny", **kwargs)

    return _application("convnext_tiny_drop_path", build, {"random"})


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

ENTRIES: Dict[str, Callable[[], ZooCase]] = {
    "resnet50": resnet50,
    "mobilenet_v2": mobilenet_v2,
    "densenet121": densenet121,
    "efficientnet_b0": efficientnet_b0,
    "efficientnet_v2_b0": efficientnet_v2_b0,
    "inception_v3": inception_v3,
    "mobilenet_v3_small": mobilenet_v3_small,
    "mobilenet_v3_large": mobilenet_v3_large,
    "nasnet_mobile": nasnet_mobile,
    "convnext_tiny_drop_path": convnext_tiny_drop_path,
    "hard_swish_cnn": hard_swish_cnn,
    "bert_classifier": bert_classifier,
    "gpt2_lm": gpt2_lm,
    "lstm": lstm,
    "gru": gru,
    "stacked_lstm": stacked_lstm,
    "bidirectional_lstm": bidirectional_lstm,
    "lstm_dropout": lstm_dropout,
    "while_loop_rnn": while_loop_rnn,
    "unet": unet,
    "tied_transformer": tied_transformer,
    "mixed_bfloat16_cnn": mixed_bfloat16_cnn,
    "noise_dropout": noise_dropout,
    "noise_stochastic_depth": noise_stochastic_depth,
    "noise_flatten_dropout": noise_flatten_dropout,
    "noise_embedding_dropout": noise_embedding_dropout,
    "noise_spatial_dropout1d": noise_spatial_dropout1d,
    "noise_spatial_dropout2d": noise_spatial_dropout2d,
    "noise_gaussian_noise": noise_gaussian_noise,
    "noise_gaussian_dropout": noise_gaussian_dropout,
    "noise_alpha_dropout": noise_alpha_dropout,
}
