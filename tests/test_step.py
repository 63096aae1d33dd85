"""`smp.step`: arguments, splitting, caching, tf.function embedding, hooks."""

import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf import state
from tests import models


@pytest.fixture
def mlp():
    import keras

    keras.utils.set_random_seed(3)
    return models.mlp()


def test_step_before_init_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(state._STATE, "config", None)
    step = smp.step(lambda x: x * 2)
    with pytest.raises(RuntimeError, match=r"smp\.init"):
        step(tf.ones([4, 2]))


def test_decorator_forms_and_unknown_names():
    smp.init({"partitions": 1, "microbatches": 2})

    @smp.step
    def plain(x):
        return x + 1

    @smp.step(non_split_inputs=["w"])
    def with_args(x, w):
        return x * w

    assert isinstance(plain, smp.StepFunction)
    out = with_args(tf.ones([4, 3]), tf.constant(2.0))
    np.testing.assert_allclose(out.concat(), 2 * np.ones([4, 3]))
    with pytest.raises(ValueError, match="'y'"):
        smp.step(non_split_inputs=["y"])(lambda x: x)
    with pytest.raises(ValueError, match="'z'"):
        smp.step(input_split_axes={"z": 1})(lambda x: x)


def test_strided_split_and_merge():
    """Micro-batch m gets rows m, m+M, ...; merge() restores the order."""
    smp.init({"partitions": 2, "microbatches": 3})
    step = smp.step(lambda x: x * 10.0)
    x = tf.reshape(tf.range(12, dtype=tf.float32), [6, 2])
    out = step(x)
    np.testing.assert_allclose(out.outputs[0], x.numpy()[0::3] * 10)
    np.testing.assert_allclose(out.outputs[2], x.numpy()[2::3] * 10)
    np.testing.assert_allclose(out.merge(), x.numpy() * 10)


def test_indivisible_batch_names_both_numbers():
    smp.init({"partitions": 1, "microbatches": 4})
    step = smp.step(lambda x: x)
    with pytest.raises(ValueError, match=r"(?s)(10.*4|4.*10)"):
        step(tf.ones([10, 2]))


def test_input_split_axes():
    smp.init({"partitions": 1, "microbatches": 2})
    step = smp.step(input_split_axes={"x": 1})(lambda x: tf.reduce_sum(x, axis=0))
    x = tf.reshape(tf.range(8, dtype=tf.float32), [2, 4])
    out = step(x)
    np.testing.assert_allclose(out.outputs[0], tf.reduce_sum(x[:, 0::2], axis=0))
    np.testing.assert_allclose(out.outputs[1], tf.reduce_sum(x[:, 1::2], axis=0))


def test_returning_an_argument_and_nested_structures():
    smp.init({"partitions": 2, "microbatches": 2})

    @smp.step
    def body(batch):
        return {"same": batch["a"], "double": batch["b"] * 2.0}

    a = tf.reshape(tf.range(8, dtype=tf.float32), [4, 2])
    b = tf.ones([4, 1])
    out = body({"a": a, "b": b})
    np.testing.assert_allclose(out["same"].merge(), a)
    np.testing.assert_allclose(out["double"].merge(), 2 * b)


def test_a_step_on_a_method_binds_each_instance():
    """`@smp.step` on a method: ``obj.step(x)`` runs with ``obj`` bound, each
    instance has its own step (own compiled steps and plan), and through the
    class the step is unbound, the instance an argument like any other."""
    smp.init({"partitions": 2, "microbatches": 2})

    class Scaler:
        def __init__(self, factor):
            self.factor = tf.constant(factor)

        @smp.step(non_split_inputs=["offset"])
        def apply(self, x, offset):
            return x * self.factor + offset

    a, b = Scaler(2.0), Scaler(3.0)
    x = tf.reshape(tf.range(8, dtype=tf.float32), [4, 2])
    np.testing.assert_allclose(a.apply(x, 1.0).merge(), x * 2.0 + 1.0)
    np.testing.assert_allclose(b.apply(x, 1.0).merge(), x * 3.0 + 1.0)
    assert a.apply is a.apply and a.apply is not b.apply
    assert isinstance(Scaler.apply, smp.StepFunction) and Scaler.apply is not a.apply
    assert a.apply.last_plan is not None and Scaler.apply.last_plan is None
    np.testing.assert_allclose(Scaler.apply(a, x, 1.0).merge(), x * 2.0 + 1.0)


def test_a_step_on_a_method_of_a_slotted_class_is_a_clear_error():
    smp.init({"partitions": 1, "microbatches": 2})

    class Slotted:
        __slots__ = ()

        @smp.step
        def apply(self, x):
            return x

    with pytest.raises(TypeError, match=r"Slotted\.apply.*__slots__"):
        Slotted().apply


def test_smp_slice_objects():
    calls = []

    class Batch:
        def __init__(self, t):
            self.t = t

        def smp_slice(self, num_mb, mb, axis):
            calls.append((num_mb, mb, axis))
            return self.t[mb::num_mb]

    smp.init({"partitions": 1, "microbatches": 2})
    step = smp.step(lambda b: b * 3.0)
    out = step(Batch(tf.ones([4, 2])))
    np.testing.assert_allclose(out.concat(), 3 * np.ones([4, 2]))
    assert (2, 0, 0) in calls and (2, 1, 0) in calls


def test_cached_per_signature_and_one_graph_in_tf_function(mlp):
    """The body is traced once per signature; later calls run the built graph."""
    smp.init({"partitions": 2, "microbatches": 4})
    traces = []
    body = models.make_body(mlp, "mlp")

    def counted(x, y):
        traces.append(1)
        return body(x, y)

    step = smp.step(counted)
    x, y = models.data("mlp")
    step(x, y)
    step(x, y)
    assert len(traces) == 1
    step(x[:8], y[:8])  # new signature -> new trace
    assert len(traces) == 2

    @tf.function
    def train(x, y):
        loss, _, _ = step(x, y)
        return loss.reduce_mean()

    train(x, y)
    train(x, y)
    # One more trace for the graph built inside train (same micro-batch
    # signature, but a new emission); no Python runs per micro-batch or call.
    assert len(traces) <= 3


def test_input_signature_with_unknown_batch(mlp):
    smp.init({"partitions": 2, "microbatches": 2})
    body = models.make_body(mlp, "mlp")
    step = smp.step(
        body,
        input_signature=[tf.TensorSpec([None, 16], tf.float32), tf.TensorSpec([None, 4], tf.float32)],
    )
    x, y = models.data("mlp")
    loss, _, pred = step(x, y)
    ref = models.reference(body, x, y, 2)
    np.testing.assert_allclose(loss.outputs[1], ref[1][0], rtol=1e-5)
    assert pred.merge().shape == (models.BATCH, 4)


def test_get_plan_and_schedule(mlp):
    smp.init({"partitions": 2, "microbatches": 4, "pipeline": "simple"})
    step = smp.step(models.make_body(mlp, "mlp"))
    x, y = models.data("mlp")
    plan = step.get_plan(x, y)
    assert isinstance(plan, smp.PartitionPlan)
    assert plan.num_partitions == 2
    assert set(plan.assignment) == {op.name for op in plan.graph.get_operations()}
    assert set(plan.assignment.values()) == {0, 1}
    rows = plan.summary()
    assert [r["partition"] for r in rows] == [0, 1]
    assert all(r["ops"] > 0 and r["variables"] > 0 and r["flops"] > 0 for r in rows)
    assert "PartitionPlan" in plan.report()
    assert step.schedule is None  # get_plan does not run the pipeline
    step(x, y)
    assert isinstance(step.schedule, smp.Schedule)
    assert step.schedule.kind == "simple"
    table = str(step.schedule)
    assert "dev0" in table and "dev1" in table
    sim = step.schedule.simulate()
    assert 0 <= sim.bubble < 1


def test_post_partition_hook_runs_once_before_first_execution(mlp, monkeypatch):
    monkeypatch.setattr(state._STATE, "post_partition_hooks", [])
    seen = []

    @smp.register_post_partition_hook
    def hook():
        # Runs after partitioning: the variables are already on their devices.
        seen.append({v.value.device.split(":")[-1] for v in mlp.variables})

    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(mlp, "mlp"))
    x, y = models.data("mlp")
    step(x, y)
    step(x, y)
    assert len(seen) == 1
    assert seen[0] == {"0", "1"}


def test_reinit_discards_cached_pipelines(mlp):
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(mlp, "mlp"))
    x, y = models.data("mlp")
    assert len(step(x, y)[0].outputs) == 2
    smp.init({"partitions": 3, "microbatches": 4})
    loss = step(x, y)[0]
    assert len(loss.outputs) == 4
    assert step.last_plan.num_partitions == 3


def test_memory_split_follows_the_schedule_of_each_init():
    """With ``optimize="memory"`` the split depends on the schedule (GPipe
    keeps every micro-batch alive on every stage, 1F1B fewer on later ones):
    a step compiled under one schedule and called after an `smp.init` with
    another is split as a new step under that one."""
    import keras

    keras.utils.set_random_seed(3)
    model = models.residual_cnn()
    x, y = models.data("residual_cnn")
    config = {"partitions": 3, "microbatches": 4, "optimize": "memory"}
    plans = {}
    for schedule in ("simple", "interleaved"):
        smp.init({**config, "pipeline": schedule})
        plans[schedule] = smp.step(models.make_body(model, "residual_cnn")).get_plan(x, y).assignment
    assert plans["simple"] != plans["interleaved"]
    smp.init({**config, "pipeline": "simple"})
    step = smp.step(models.make_body(model, "residual_cnn"))
    step(x, y)
    assert step.last_plan.assignment == plans["simple"]
    smp.init({**config, "pipeline": "interleaved"})
    step(x, y)
    assert step.last_plan.assignment == plans["interleaved"]


def test_optimizer_update_inside_the_step_is_a_clear_error(mlp):
    import keras

    smp.init({"partitions": 2, "microbatches": 2})
    opt = keras.optimizers.SGD(0.1)
    opt.build(mlp.trainable_variables)
    body = models.make_body(mlp, "mlp")

    def bad(x, y):
        loss, grads, _ = body(x, y)
        opt.apply_gradients(zip(grads, mlp.trainable_variables))
        return loss

    with pytest.raises(ValueError, match=r"(?s)writes trainable variable.*apply_gradients.*g\.accumulate\(\)"):
        smp.step(bad)(*models.data("mlp"))

    w = tf.Variable(tf.ones([16, 4]), name="manual_w")

    def manual_sgd(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(x @ w - y))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss

    with pytest.raises(ValueError, match="manual_w"):
        smp.step(manual_sgd)(*models.data("mlp"))


def test_unknown_batch_size_not_divisible_is_the_static_error_first():
    """With an input_signature that leaves the batch size unknown, an eager
    call gets the same clear ValueError as a static shape, before anything runs."""
    smp.init({"partitions": 2, "microbatches": 4})
    step = smp.step(lambda x: x * 2.0, input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    np.testing.assert_allclose(step(tf.ones([8, 3])).merge(), 2 * np.ones([8, 3]))
    with pytest.raises(ValueError, match=r"Batch size 10 of argument 'x' \(axis 0\) is not divisible by microbatches=4"):
        step(tf.ones([10, 3]))
    with pytest.raises(ValueError, match="Batch size 6"):
        step(np.ones([6, 3], np.float32))
