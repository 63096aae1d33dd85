"""After variables move to their partitions' devices, nothing uses an old copy.

The first partitioned step moves every variable it uses to the device of its
partition. The move keeps the variable's identity, so what existed before it
keeps working: optimizers built earlier (with their state), checkpoints
restored earlier, and functions traced earlier, which from then on read the
moved variables.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf import state
from tests import models


def _mlp():
    keras.utils.set_random_seed(11)
    return models.mlp()


def _devices(variables):
    return {v.value.device.rsplit(":", 1)[-1] for v in variables}


def _train(model, optimizer, step, x, y, steps):
    @tf.function
    def train(x, y):
        loss, grads, _ = step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    return [float(train(x, y)) for _ in range(steps)]


def _reference_train(model, optimizer, x, y, steps, M):
    """The single-device loop: mean gradient of the M micro-batches, applied once."""
    body = tf.function(models.make_body(model, "mlp"))
    losses = []
    for _ in range(steps):
        outs = [body(tf.constant(x[m::M]), tf.constant(y[m::M])) for m in range(M)]
        grads = [tf.add_n([o[1][i] for o in outs]) / M for i in range(len(outs[0][1]))]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(np.mean([o[0] for o in outs])))
    return losses


def test_move_keeps_the_identity_of_every_variable():
    model = _mlp()
    before = [(id(v), id(v.value), v.value._unique_id) for v in model.variables]
    smp.init({"partitions": 2, "microbatches": 2})
    smp.step(models.make_body(model, "mlp"))(*models.data("mlp"))
    assert _devices(model.variables) == {"0", "1"}
    assert [(id(v), id(v.value), v.value._unique_id) for v in model.variables] == before


@pytest.mark.parametrize("optimizer_cls", [keras.optimizers.Adam, keras.optimizers.SGD])
def test_optimizer_built_before_the_first_step_keeps_its_state(optimizer_cls):
    """An optimizer built (and stepped) before the move goes on with its state."""
    x, y = models.data("mlp")
    M = 2

    def make_optimizer():
        kwargs = {"momentum": 0.9} if optimizer_cls is keras.optimizers.SGD else {}
        return optimizer_cls(0.01, **kwargs)

    # Reference: two optimizer steps before, three after, all on one device.
    ref_model = _mlp()
    ref_opt = make_optimizer()
    _reference_train(ref_model, ref_opt, x, y, 2, M)
    ref_losses = _reference_train(ref_model, ref_opt, x, y, 3, M)

    model = _mlp()
    opt = make_optimizer()
    _reference_train(model, opt, x, y, 2, M)  # slots exist on the default device
    slots_before = {id(s): s.numpy() for s in opt.variables}
    smp.init({"partitions": 2, "microbatches": M})
    step = smp.step(models.make_body(model, "mlp"))
    losses = _train(model, opt, step, x, y, 3)

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for v, r in zip(model.trainable_variables, ref_model.trainable_variables):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-5, atol=1e-7, err_msg=v.path)
    # The optimizer's own slots moved with their variables (none was replaced).
    assert set(slots_before) == {id(s) for s in opt.variables}
    part = step.last_plan.partition_of_variable()
    for v in model.trainable_variables:
        prefix = v.path.replace("/", "_") + "_"
        for s in opt.variables:
            if s.name.startswith(prefix) and tuple(s.shape) == tuple(v.shape):
                assert s.value.device.endswith(f"CPU:{part[v.path]}"), s.name


def test_checkpoint_restored_before_the_first_step(tmp_path):
    """A tf.train.Checkpoint restored before partitioning (model and
    optimizer state) trains on exactly as without the interruption."""
    x, y = models.data("mlp")
    M = 2
    ref_model = _mlp()
    ref_opt = keras.optimizers.Adam(0.01)
    _reference_train(ref_model, ref_opt, x, y, 2, M)
    path = tf.train.Checkpoint(model=ref_model, optimizer=ref_opt).save(str(tmp_path / "ckpt"))
    ref_losses = _reference_train(ref_model, ref_opt, x, y, 2, M)

    model = _mlp()
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_consumed()
    smp.init({"partitions": 2, "microbatches": M})
    losses = _train(model, opt, smp.step(models.make_body(model, "mlp")), x, y, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for v, r in zip(model.trainable_variables, ref_model.trainable_variables):
        np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=1e-5, atol=1e-7, err_msg=v.path)


def test_function_traced_before_the_move_reads_the_moved_variables():
    model = _mlp()
    x, y = models.data("mlp")

    @tf.function
    def evaluate(x):
        return model(x)

    evaluate(tf.constant(x))  # traced (and run) before anything moved
    smp.init({"partitions": 2, "microbatches": 2})
    opt = keras.optimizers.SGD(0.5)
    _train(model, opt, smp.step(models.make_body(model, "mlp")), x, y, 3)
    assert _devices(model.variables) == {"0", "1"}
    # Three steps changed the weights; the old trace sees the new values.
    np.testing.assert_allclose(evaluate(tf.constant(x)), model(x), rtol=1e-6, atol=1e-6)
    assert evaluate.experimental_get_tracing_count() == 1


def _plain_keras_mlp():
    """The test MLP as a plain keras.Model (Keras's own fit/predict)."""
    keras.utils.set_random_seed(11)
    inp = keras.Input((16,))
    h = inp
    for i in range(6):
        h = keras.layers.Dense(32, activation="relu", name=f"dense{i}")(h)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(h))


def test_keras_predict_and_fit_before_the_move_follow_it():
    """A plain Keras model whose layers a step uses: Keras's cached predict
    and train functions, traced before the move, read and train the moved
    variables."""
    model = _plain_keras_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = models.data("mlp")
    model.predict(x, verbose=0)  # Keras's predict function traced before the move
    model.fit(x, y, epochs=1, batch_size=len(x), verbose=0)
    smp.init({"partitions": 2, "microbatches": 2})
    _train(model, keras.optimizers.SGD(0.5), smp.step(models.make_body(model, "mlp")), x, y, 3)
    np.testing.assert_allclose(model.predict(x, verbose=0), model(x), rtol=1e-6, atol=1e-6)
    # A later fit trains the moved variables themselves.
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, epochs=1, batch_size=len(x), verbose=0)
    changed = [float(np.max(np.abs(v.numpy() - b))) for v, b in zip(model.trainable_variables, before)]
    assert min(changed) > 0
    assert _devices(model.trainable_variables) == {"0", "1"}


def test_a_later_step_keeps_the_placement_and_puts_its_ops_there():
    """An evaluation step partitioned after the training step reads every
    variable on the device where it already lives."""
    model = _mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": 2})
    train_step = smp.step(models.make_body(model, "mlp"))
    train_step(x, y)
    where = {v.path: v.value.device for v in model.variables}

    eval_step = smp.step(lambda x: model(x, training=False))
    out = eval_step(x)
    np.testing.assert_allclose(out.merge(), model(x), rtol=1e-6, atol=1e-6)
    assert {v.path: v.value.device for v in model.variables} == where
    plan = eval_step.last_plan
    for op, p in zip(plan.op_graph.ops, plan.partition_of_op):
        for key in op.variables:
            assert where[key].endswith(f"CPU:{p}"), (op.name, key)


def test_post_partition_hooks_run_eagerly_once_per_init(monkeypatch, tmp_path):
    """Hooks run once per smp.init, outside any graph (so a hook that
    restores a checkpoint does not put its ops into the step), after the
    variables were placed."""
    monkeypatch.setattr(state._STATE, "post_partition_hooks", [])
    model = _mlp()
    x, y = models.data("mlp")
    saved = [v.numpy() * 0 + 0.5 for v in model.variables]
    calls = []

    @smp.register_post_partition_hook
    def restore():
        calls.append((tf.executing_eagerly(), _devices(model.variables)))
        for v, s in zip(model.variables, saved):
            v.assign(s)

    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))

    @tf.function
    def run(x, y):
        return step(x, y)[0].reduce_mean()

    loss = run(tf.constant(x), tf.constant(y))  # first partitioned inside a trace
    run(tf.constant(x), tf.constant(y))
    assert calls == [(True, {"0", "1"})]
    # The step ran on the restored weights (the hook ran before it).
    for v in model.variables:
        v.assign(np.full(v.shape, 0.5, v.dtype))
    expected = models.reference(models.make_body(model, "mlp"), x, y, 2)
    np.testing.assert_allclose(loss, np.mean([r[0] for r in expected]), rtol=1e-5)
    # A new smp.init runs the hooks again, once.
    smp.init({"partitions": 3, "microbatches": 2})
    step(x, y)
    step(x, y)
    assert len(calls) == 2 and calls[1][0]


def test_hook_must_be_callable():
    with pytest.raises(ValueError, match="callable"):
        smp.register_post_partition_hook(42)


def _outer_graph(model, optimizer, step, x, y):
    @tf.function
    def train(x, y):
        loss, grads, _ = step(x, y)
        optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    return train.get_concrete_function(tf.constant(x), tf.constant(y)).graph


@pytest.mark.parametrize("optimizer_cls", [keras.optimizers.Adam, keras.optimizers.SGD])
def test_optimizer_updates_run_on_each_variables_device(optimizer_cls):
    """Each variable's update reads its gradient where both live: no op
    without a device stands between a partition's gradient and its update
    (such an op runs on the function's default device, and every gradient of
    another partition would go there and back, over the network when a
    pipeline spans processes)."""
    model = _mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    opt = optimizer_cls(learning_rate=1e-3)
    graph = _outer_graph(model, opt, step, x, y)
    updates = [op for op in graph.get_operations() if op.type in ("AssignSubVariableOp", "AssignVariableOp",
                                                                   "AssignAddVariableOp")]
    assert updates
    big = [op for op in graph.get_operations() if op.type in ("Identity", "IdentityN") and not op.device
           and any(t.shape.num_elements() and t.shape.num_elements() > 1 for t in op.outputs)]
    assert not big, [op.name for op in big]
    # Every update of a model or slot variable runs on one of the partitions.
    for op in updates:
        if op.inputs[1].shape.num_elements() and op.inputs[1].shape.num_elements() > 1:
            assert op.device.endswith(("CPU:0", "CPU:1")), (op.name, op.device)


def test_optimizer_update_placement_keeps_the_numbers():
    """The same training with the optimizer's updates on the variables'
    devices equals the single-device loop."""
    model = _mlp()
    ref = keras.models.clone_model(model)
    ref.set_weights(model.get_weights())
    x, y = models.data("mlp")
    M = 2
    smp.init({"partitions": 2, "microbatches": M})
    losses = _train(model, keras.optimizers.Adam(1e-3), smp.step(models.make_body(model, "mlp")), x, y, 2)
    ref_losses = _reference_train(ref, keras.optimizers.Adam(1e-3), x, y, 2, M)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_batch_is_split_on_the_first_stage_device_when_a_pipeline_spans_processes(monkeypatch):
    """A driver splits the batch on its first stage's device, not on its
    client CPU (the default device of its ops)."""
    from smp_tf.distributed import remote

    model = _mlp()
    x, y = models.data("mlp")
    smp.init({"partitions": 2, "microbatches": 2})
    monkeypatch.setattr(remote, "first_stage_device", lambda: "/device:CPU:1")
    step = smp.step(models.make_body(model, "mlp"))
    graph = _outer_graph(model, keras.optimizers.SGD(1e-3), step, x, y)
    splits = [op for op in graph.get_operations() if op.type in ("Reshape", "Unpack")]
    assert splits
    assert all(op.device.endswith("CPU:1") for op in splits), [(op.name, op.device) for op in splits]
    monkeypatch.setattr(remote, "first_stage_device", lambda: None)
    step = smp.step(models.make_body(model, "mlp"))
    graph = _outer_graph(model, keras.optimizers.SGD(1e-3), step, x, y)
    assert all(not op.device for op in graph.get_operations() if op.type in ("Reshape", "Unpack"))


def test_live_objects_finds_instances_of_subclasses():
    from smp_tf.live_objects import live_objects as _live_objects

    class MyAdam(keras.optimizers.Adam):
        pass

    opt = MyAdam()
    f = tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec([], tf.float32))
    live = _live_objects()
    assert any(o is opt for o in live["optimizers"])
    assert any(o is f for o in live["functions"])
    assert any(o is f.graph for o in live["graphs"])


def test_live_objects_come_from_the_registry_without_a_heap_scan(monkeypatch):
    from smp_tf import live_objects as registry

    registry.install_object_registry()
    monkeypatch.setitem(registry._REGISTRY, "complete", True)

    def no_scan():
        raise AssertionError("the registry is complete: no heap scan")

    monkeypatch.setattr(registry, "_scan_live_objects", no_scan)
    opt = keras.optimizers.SGD()
    f = tf.function(lambda x: x * 2).get_concrete_function(tf.TensorSpec([], tf.float32))
    live = registry.live_objects()
    assert any(o is opt for o in live["optimizers"])
    assert any(o is f for o in live["functions"])
    assert any(o is f.graph for o in live["graphs"])


def test_an_incomplete_registry_scans_the_heap_once_and_registers_what_it_finds(monkeypatch):
    """Objects created before the registry was installed (TensorFlow's
    runtime already started) are found by one scan, then registered."""
    from smp_tf import live_objects as registry

    registry.install_object_registry()
    f = tf.function(lambda x: x - 1).get_concrete_function(tf.TensorSpec([], tf.float32))
    registry._REGISTERED["functions"].discard(f)  # as if created before the registry
    monkeypatch.setitem(registry._REGISTRY, "complete", False)
    scans = []
    scan = registry._scan_live_objects
    monkeypatch.setattr(registry, "_scan_live_objects", lambda: scans.append(1) or scan())
    assert any(o is f for o in registry.live_objects()["functions"])
    assert any(o is f for o in registry.live_objects()["functions"])
    assert scans == [1]
    assert registry._REGISTRY["complete"]
