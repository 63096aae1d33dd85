"""Manual placement with smp.partition runs as a plain pipeline and stays exact."""

import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from tests import models


class TwoBlocks(smp.DistributedModel):
    def __init__(self, **kwargs):
        import keras

        super().__init__(**kwargs)
        self.first = [keras.layers.Dense(16, activation="relu", name=f"first{i}") for i in range(2)]
        self.second = [keras.layers.Dense(16, activation="relu", name=f"second{i}") for i in range(2)]
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        with smp.partition(0):
            for layer in self.first:
                x = layer(x)
        with smp.partition(1):
            for layer in self.second:
                x = layer(x)
            return self.head(x)


@pytest.mark.parametrize("default_partition", [0, 1])
def test_manual_blocks_are_honoured_and_exact(default_partition):
    import keras

    smp.init({"partitions": 2, "microbatches": 4, "auto_partition": False, "default_partition": default_partition})
    keras.utils.set_random_seed(1)
    model = TwoBlocks()
    model(np.zeros((2, 16), "float32"))
    body = models.make_body(model, "mlp")
    x, y = models.data("mlp")
    ref = models.reference(body, x, y, 4)
    init = [v.numpy() for v in model.variables]

    step = smp.step(body)
    loss, grads, _ = step(x, y)
    for m in range(4):
        np.testing.assert_allclose(loss.outputs[m], ref[m][0], rtol=1e-5)
        for g, r in zip(grads, ref[m][1]):
            np.testing.assert_allclose(g.outputs[m], r, rtol=1e-5, atol=1e-6)

    plan = step.last_plan
    part = plan.partition_of_variable()
    assert {part[v.path] for v in model.variables if "first" in v.path} == {0}
    assert {part[v.path] for v in model.variables if "second" in v.path or "head" in v.path} == {1}
    # The loss is outside every block: it goes to default_partition.
    assert plan.assignment["Mean"] == default_partition
    if default_partition == 1:
        # Forward of 0, fused forward+backward of 1, backward of 0: the
        # returned gradients stay beside the ops that computed them.
        assert {t.key for t in step.schedule.tasks} == {(0, 0), (1, 1), (0, 2)}
    for v, value in zip(model.variables, init):
        v.assign(value)


def test_layer_called_in_two_blocks_runs_each_call_in_its_block():
    import keras

    class Shared(smp.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(16, name="shared")

        def call(self, x):
            with smp.partition(0):
                x = self.dense(x)
            with smp.partition(1):
                return self.dense(x)

    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 1})
    keras.utils.set_random_seed(1)
    model = Shared()
    model(np.zeros((2, 16), "float32"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 16)).astype("float32")
    y = rng.normal(size=(4, 16)).astype("float32")

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        return loss, tape.gradient(loss, model.trainable_variables)

    ref = models.reference(body, x, y, 2)
    step = smp.step(body)
    loss, grads = step(x, y)
    for m in range(2):
        np.testing.assert_array_equal(loss.outputs[m], ref[m][0])
        for g, r in zip(grads, ref[m][1]):
            np.testing.assert_array_equal(g.outputs[m], r)
    plan = step.last_plan
    matmuls = [op for op in plan.op_graph.ops if op.type == "MatMul" and not op.is_gradient]
    assert [plan.partition_of_op[op.index] for op in matmuls] == [0, 1]
    assert set(plan.partition_of_variable().values()) == {0}


def test_one_layer_call_in_two_blocks_is_an_error():
    import keras

    class TwoBlockLayer(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 16), name="w")

        def call(self, x):
            with smp.partition(0):
                h = tf.matmul(x, self.w)
            with smp.partition(1):
                return tf.nn.relu(h)

    class Model(smp.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = TwoBlockLayer(name="two_blocks")

        def call(self, x):
            return self.inner(x)

    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "default_partition": 0})
    model = Model()
    model(np.zeros((2, 16), "float32"))
    step = smp.step(lambda x: model(x))
    with pytest.raises(ValueError, match="different smp.partition blocks"):
        step.get_plan(tf.ones([4, 16]))
