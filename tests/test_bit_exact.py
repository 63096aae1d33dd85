"""Tasks compute bit for bit what the single-device function computes.

Each test builds a model whose pipelined step used to round differently
from the single-device loop, for a reason that lies in how TensorFlow runs
a function rather than in the model, and checks every loss and gradient
for exact equality:

- a layer holding small constant tensors (a `Normalization` with a given
  mean and variance) captures them into the function, which reads them as
  arguments; a task that held them as constants let the graph optimiser
  fold ``(x - mean) / sqrt(var)`` into a product, which rounds differently;
- a gradient that sums three or more terms (a tensor read by several
  branches) is an ``AddN``; its kernel accumulates into the first input
  buffer it owns and moves that input to the front of the sum, and a term
  received from another partition is a buffer the task does not own;
- a product read only by a product with a constant (a gated unit and the
  dropout after it) is reassociated by the graph optimiser on one device,
  ``a * (b * c)``, which a cut between the two products prevented;
- the own ops of a composite layer (a transformer layer's residual
  additions and gated product), joined into one group, pulled part of the
  layer back to the partition of its first sublayers;
- a sum joined to an earlier projection (a fusion stage) started before
  the residual branch it adds, and a cut by first ops split the group
  between two tasks of one partition;
- GELU's tanh approximation computes ``x ** 3``, which the graph optimiser
  turns into ``x * square(x)`` and, on one device, shares with the
  gradient's ``square(x)``; the shared op keeps the gradient's name, and
  names decide how ``c * (x * square(x))`` is reassociated.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from tests import models

M = 4


def _assert_bit_exact(model, x, y, state=()):
    """The pipelined step equals the per-micro-batch tf.function exactly.

    `state`: variables outside the model that the step reads and writes;
    they start both runs from the same value and must end equal too.
    Returns the step, for a look at its plan."""
    body = models.make_body(model, "mlp")  # mean squared error
    variables = list(model.variables) + list(state)
    init = [v.numpy() for v in variables]
    ref = models.reference(body, x, y, M)
    ref_state = [v.numpy() for v in variables]
    for v, value in zip(variables, init):
        v.assign(value)

    step = smp.step(body)
    loss, grads, _ = step(x, y)
    for m in range(M):
        np.testing.assert_array_equal(loss.outputs[m], ref[m][0], err_msg=f"loss of micro-batch {m}")
        for g, r, v in zip(grads, ref[m][1], model.trainable_variables):
            np.testing.assert_array_equal(g.outputs[m], r, err_msg=f"gradient of {v.path}, micro-batch {m}")
    for v, r in zip(variables, ref_state):
        np.testing.assert_array_equal(v.numpy(), r, err_msg=f"state of {v.path}")
    return step


def test_captured_constants_stay_arguments():
    # EfficientNetV2's preprocessing: the normalisation reads the input
    # (a step argument) and two captured 3-element constants.
    smp.init({"partitions": 2, "microbatches": M})
    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.229**2, 0.224**2, 0.225**2])(inp)
    h = keras.layers.Conv2D(8, 3, use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Conv2D(8, 3, activation="swish")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(16, activation="relu")(h)
    model = smp.DistributedModel(inp, keras.layers.Dense(5)(h))
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, (16, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(16, 5)).astype("float32")
    _assert_bit_exact(model, x, y)


class InceptionBlock(smp.DistributedModel):
    """An Inception-style block: ``h`` feeds four branches (two convolutions
    and an average pool on partition 1, a 1x1 convolution on partition 0)
    that are concatenated. The gradient reaching ``h`` sums four terms on
    partition 0, the first of them received from partition 1."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        layers = keras.layers
        self.stem = layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")
        self.branches = [
            (1, layers.Conv2D(8, 3, padding="same", name="conv3x3")),
            (0, layers.AveragePooling2D(3, 1, padding="same", name="pool")),
            (1, layers.Conv2D(8, 1, name="conv1x1")),
            (0, layers.Conv2D(8, 3, padding="same", name="conv3x3_b")),
        ]
        self.concat = layers.Concatenate()
        self.pool = layers.GlobalAveragePooling2D()
        self.head = layers.Dense(4, name="head")

    def call(self, x):
        with smp.partition(0):
            h = self.stem(x)
        outs = []
        for partition, layer in self.branches:
            with smp.partition(partition):
                outs.append(layer(h))
        with smp.partition(1):
            return self.head(self.pool(self.concat(outs)))


def test_received_terms_of_a_sum_are_added_in_the_same_order():
    smp.init({"partitions": 2, "microbatches": M, "auto_partition": False, "default_partition": 0})
    keras.utils.set_random_seed(5)
    model = InceptionBlock()
    model(np.zeros((2, 8, 8, 3), "float32"))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    _assert_bit_exact(model, x, y)


def _assert_step_bit_exact(model, x, y, loss_fn):
    """Like `_assert_bit_exact`, for inputs that may be dicts of arrays: the
    step returns its loss and gradients only."""

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]

    init = [v.numpy() for v in model.variables]
    reference = tf.function(body)
    ref = [reference(tf.nest.map_structure(lambda a: tf.constant(a[m::M]), x), tf.constant(y[m::M]))
           for m in range(M)]
    for v, value in zip(model.variables, init):
        v.assign(value)
    step = smp.step(body)
    loss, grads = step(x, y)
    for m in range(M):
        np.testing.assert_array_equal(loss.outputs[m], ref[m][0], err_msg=f"loss of micro-batch {m}")
        for g, r, v in zip(grads, ref[m][1], model.trainable_variables):
            np.testing.assert_array_equal(g.outputs[m], r, err_msg=f"gradient of {v.path}, micro-batch {m}")
    return step


class Scale(keras.layers.Layer):
    """Multiplies by a constant (what a dropout does to the values it keeps)."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor


class GatedProduct(smp.DistributedModel):
    """A gated unit ``a * b`` written in the model's `call`, outside the
    `smp.partition` blocks, and scaled by a constant in the next block. One
    device's graph optimiser computes ``(a * b) * c`` as ``a * (b * c)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(16, activation="relu", name="a")
        self.b = keras.layers.Dense(16, name="b")
        self.scale = Scale(1.0 / 0.9, name="scale")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        with smp.partition(0):
            a, b = self.a(x), self.b(x)
        product = a * b
        with smp.partition(1):
            return self.head(self.scale(product))


def test_a_product_scaled_on_the_next_partition_is_scaled_as_on_one_device():
    smp.init({"partitions": 2, "microbatches": M, "auto_partition": False, "default_partition": 0})
    keras.utils.set_random_seed(7)
    model = GatedProduct()
    model(np.zeros((2, 8), "float32"))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    _assert_bit_exact(model, x, y)


class SharedBlock(keras.layers.Layer):
    """A residual block with a dropout and a batch normalisation, one set
    of weights and state for every call (as ALBERT shares its layer)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(64, activation="relu")
        self.outer = keras.layers.Dense(32)
        self.drop = keras.layers.Dropout(0.2, seed=5)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=False):
        return self.norm(x + self.drop(self.outer(self.inner(x)), training=training), training=training)


def test_a_block_called_four_times_is_split_between_its_calls():
    # Each call of the block advances the dropout's seed and the moving
    # averages: those updates stay where the state lives, while the calls
    # themselves are split 2 and 2, with the block's weights (and their
    # gradients) crossing instead of every call's activations.
    smp.init({"partitions": 2, "microbatches": M})
    keras.utils.set_random_seed(4)
    # Sequences of 64 steps: a call's activations outweigh the block's weights.
    inp = keras.Input((64, 32))
    block = SharedBlock()
    h = keras.layers.Dense(32)(inp)
    for _ in range(4):
        h = block(h)
    model = smp.DistributedModel(inp, keras.layers.Dense(5)(h))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 64, 32)).astype("float32")
    y = rng.normal(size=(16, 64, 5)).astype("float32")
    step = _assert_bit_exact(model, x, y)
    plan = step.last_plan
    # The ops of each call of the block's first layer, but its weight reads
    # (which stay with the weights, on partition 0).
    by_call = {}
    for op in plan.op_graph.ops:
        if op.forward is None and op.layer and op.layer.startswith(block.inner.name + "#") and op.type != "ReadVariableOp":
            by_call.setdefault(int(op.call.rsplit("@", 1)[1]), set()).add(plan.partition_of_op[op.index])
    assert [by_call[c] for c in sorted(by_call)] == [{0}, {0}, {1}, {1}]
    # Before, every call's dropout and normalisation ran where their state
    # lives, and the step was 13 tasks.
    assert len(step.last_compiled.tasks) <= 5


class DropoutInTwoBlocks(smp.DistributedModel):
    """One Dropout layer called in two `smp.partition` blocks."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(16)
        self.second = keras.layers.Dense(4)
        self.drop = keras.layers.Dropout(0.3, seed=2)

    def call(self, x, training=False):
        with smp.partition(0):
            h = self.drop(self.first(x), training=training)
        with smp.partition(1):
            return self.drop(self.second(h), training=training)


def test_a_dropout_called_in_two_blocks_draws_as_on_one_device():
    # Its second call advances the seed where the seed lives (partition 0)
    # and draws its mask in its own block; this used to be refused.
    smp.init({"partitions": 2, "microbatches": M, "auto_partition": False, "default_partition": 0})
    keras.utils.set_random_seed(6)
    model = DropoutInTwoBlocks()
    model(tf.zeros([2, 8]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    step = _assert_bit_exact(model, x, y)
    plan = step.last_plan
    second = [op for op in plan.op_graph.ops if op.forward is None and op.layer and op.layer.startswith(model.second.name + "#")]
    assert {plan.partition_of_op[op.index] for op in second if op.type != "ReadVariableOp"} == {1}


class GlobalDropPath(keras.layers.Layer):
    """Stochastic depth that draws from Keras's global seed generator
    (``keras.random.uniform`` without a seed), as ConvNeXt's does."""

    def call(self, x, training=False):
        if not training:
            return x
        keep = keras.ops.floor(0.7 + keras.random.uniform((keras.ops.shape(x)[0], 1)))
        return x / 0.7 * keep


class GlobalDropPathBlocks(smp.DistributedModel):
    """Two residual blocks with stochastic depth, one per partition."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(16)
        self.blocks = [keras.layers.Dense(16, activation="relu") for _ in range(2)]
        self.drops = [GlobalDropPath() for _ in range(2)]
        self.head = keras.layers.Dense(4)

    def call(self, x, training=False):
        with smp.partition(0):
            h = self.stem(x)
            h = h + self.drops[0](self.blocks[0](h), training=training)
        with smp.partition(1):
            h = h + self.drops[1](self.blocks[1](h), training=training)
            return self.head(h)


def test_draws_from_the_global_seed_generator_follow_the_loop():
    # The global generator's state is no variable of the model, so it is
    # not moved, and both blocks draw from it. Micro-batch m draws what the
    # loop's m-th call draws, and the state ends where the loop leaves it.
    # A user's comparison must restore that state as well as the model's
    # variables (without it, every loss and gradient differs).
    from keras.src.random.seed_generator import global_seed_generator

    smp.init({"partitions": 2, "microbatches": M, "auto_partition": False, "default_partition": 0})
    keras.utils.set_random_seed(9)
    model = GlobalDropPathBlocks()
    model(tf.zeros([2, 8]))
    generator = global_seed_generator()
    start = generator.state.numpy()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    _assert_bit_exact(model, x, y, state=[generator.state])
    assert not np.array_equal(generator.state.numpy(), start)


@pytest.mark.filterwarnings("ignore:Layer .* does not support masking")
@pytest.mark.parametrize("partitions", [2, 3])
def test_an_encoder_decoder_of_composite_layers_with_dropout(partitions):
    # keras_hub's T5: each transformer layer is a composite layer whose own
    # ops (residual additions, the gated product of its feed-forward part,
    # masks) lie between the calls of its sublayers, and each dropout scales
    # what it keeps by a constant. The decoder's first layer straddles the
    # first two partitions.
    import keras_hub

    smp.init({"partitions": partitions, "microbatches": M})
    keras.utils.set_random_seed(7)
    vocabulary, length = 97, 12
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=vocabulary, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=48,
        key_value_dim=16, dropout=0.1, tie_embedding_weights=True,
    )
    inputs = {k: keras.Input(v.shape[1:], dtype=v.dtype, name=k) for k, v in backbone.input.items()}
    logits = keras.layers.Dense(vocabulary, name="lm_head")(backbone(inputs)["decoder_sequence_output"])
    model = smp.DistributedModel(inputs, logits)
    rng = np.random.default_rng(0)
    x = {k: np.ones((8, length), "int32") if "mask" in k else rng.integers(1, vocabulary, (8, length)).astype("int32")
         for k in backbone.input}
    y = rng.integers(0, vocabulary, (8, length)).astype("int32")
    step = _assert_step_bit_exact(model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # The glue of a layer follows its neighbours: the step crosses from
    # partition 0 to 1 and back once (F0, F1 with B1, B0), instead of
    # bringing a gated product back to partition 0 and sending it on again.
    # At 3 partitions the decoder's attention mask and position bias, which
    # read its token ids but not the encoder, run in partition 1's forward
    # task, not in a task of their own before it.
    expected = {2: [(0, 0), (1, 1), (0, 2)], 3: [(0, 0), (1, 1), (2, 2), (1, 3), (0, 4)]}
    assert [(t.partition, t.wave) for t in step.last_compiled.tasks] == expected[partitions]


def _shared_weights_backbone(name):
    """keras_hub text backbones whose weights several layers share: ALBERT
    runs one transformer layer at every depth; DeBERTaV3's layers all read
    one relative-position embedding, normalised once."""
    import keras_hub

    vocabulary, length = 97, 16
    if name == "albert":
        backbone = keras_hub.models.AlbertBackbone(
            vocabulary_size=vocabulary, num_layers=4, num_heads=2, num_groups=1, num_inner_repetitions=1,
            embedding_dim=16, hidden_dim=32, intermediate_dim=48, dropout=0.1, max_sequence_length=length,
        )
    else:
        backbone = keras_hub.models.DebertaV3Backbone(
            vocabulary_size=vocabulary, num_layers=4, num_heads=2, hidden_dim=32, intermediate_dim=48,
            dropout=0.1, max_sequence_length=length, bucket_size=8,
        )
    inputs = {k: keras.Input(v.shape[1:], dtype=v.dtype, name=k) for k, v in backbone.input.items()}
    out = backbone(inputs)
    logits = keras.layers.Dense(vocabulary, name="lm_head")(out["sequence_output"] if name == "albert" else out)
    if name == "albert":
        # Every variable has a gradient: the pooler's output biases the logits.
        pooled = keras.layers.Dense(vocabulary, name="pooled_head")(out["pooled_output"])
        logits = logits + keras.layers.Reshape((1, vocabulary))(pooled)
    model = smp.DistributedModel(inputs, logits)
    rng = np.random.default_rng(0)
    x = {}
    for k in backbone.input:
        if "mask" in k:
            x[k] = np.ones((8, length), "int32")
        elif "segment" in k:
            x[k] = np.zeros((8, length), "int32")
        else:
            x[k] = rng.integers(1, vocabulary, (8, length)).astype("int32")
    y = rng.integers(0, vocabulary, (8, length)).astype("int32")
    return model, x, y


@pytest.mark.parametrize("name", ["albert", "deberta"])
def test_weights_shared_by_every_partition_with_dropout(name):
    # Every partition's layers read the shared weights, so each partition
    # computes a part of their gradient, summed on the weights' partition
    # at the end of the backward. Some of those parts (DeBERTa's masked
    # relative-position gradients) read forward values only: as late as
    # their reader allows, they made tasks of two ops at the end of the
    # last partitions' backward (9 tasks for DeBERTa, 10 for ALBERT, at
    # P=4); they now join those partitions' backward or fused tasks.
    smp.init({"partitions": 4, "microbatches": M})
    keras.utils.set_random_seed(11)
    model, x, y = _shared_weights_backbone(name)
    step = _assert_step_bit_exact(model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert [(t.partition, t.wave) for t in step.last_compiled.tasks] == [
        (0, 0), (1, 1), (2, 2), (3, 3), (2, 4), (1, 5), (0, 6)]


def _fusion_stage_model():
    """A fusion stage as in DepthAnything's neck: ``proj(c0) + residual(c0)``
    with ``residual(c) = conv2(relu(conv1(relu(c)))) + c``. The sum is the
    only reader of the projection's output and of the residual's, so both
    join one group with the residual's second convolution (arithmetic
    chains), a group whose first op comes before the residual's first
    convolution."""
    layers = keras.layers
    inp = keras.Input((8, 8, 4))
    c0 = layers.Conv2D(8, 3, padding="same", name="c0")(inp)
    a = layers.Conv2D(8, 1, name="proj")(layers.ReLU()(c0))
    h = layers.Conv2D(8, 3, padding="same", name="r_conv1")(layers.ReLU()(c0))
    h = layers.Conv2D(8, 3, padding="same", name="r_conv2")(layers.ReLU()(h))
    f = layers.Add()([a, layers.Add()([h, c0])])
    for i in range(2):
        f = layers.Conv2D(8, 3, padding="same", activation="relu", name=f"post{i}")(f)
    return smp.DistributedModel(inp, layers.Dense(3)(layers.Flatten()(f)))


def test_a_fusion_stage_is_split_in_forward_order():
    # Cut in the order of first ops, the residual's first convolution went
    # to partition 1 and the sum stayed on 0: 7 tasks, and the group's two
    # halves in two tasks of partition 0, where the graph optimiser no
    # longer rewrote them as on one device (58 arrays differed).
    smp.init({"partitions": 2, "microbatches": M})
    keras.utils.set_random_seed(3)
    model = _fusion_stage_model()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 8, 8, 4)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    step = _assert_step_bit_exact(model, x, y, lambda y, p: tf.reduce_mean(tf.square(p - y)))
    assert len(step.last_compiled.tasks) == 3


def test_a_tanh_gelu_rounds_as_on_one_device():
    # Before the forward task's cube took a name under its gradient's
    # square, 79 of the 108 losses and gradients differed (up to 5.4e-7).
    smp.init({"partitions": 2, "microbatches": M})
    keras.utils.set_random_seed(3)
    layers = keras.layers
    inp = keras.Input((16,))
    h = inp
    for _ in range(4):
        z = layers.Dense(32)(layers.LayerNormalization()(h))
        z = layers.Activation(lambda t: keras.activations.gelu(t, approximate=True))(z)
        h = h + layers.Dense(16)(z)
    model = smp.DistributedModel(inp, layers.Dense(3)(h))
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 16)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    step = _assert_step_bit_exact(model, x, y, lambda y, p: tf.reduce_mean(tf.square(p - y)))
    assert len(step.last_compiled.tasks) == 3
