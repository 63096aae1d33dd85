"""The lowered graph: boundary ops per micro-batch, placement of variables."""


import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf.boundary import is_smp_input, is_smp_output
from smp_tf.partitioner.groups import free_ops
from tests import models


def _lowered_ops(step, x, y):
    @tf.function
    def run(x, y):
        loss, _, _ = step(x, y)
        return loss.reduce_mean()

    return run.get_concrete_function(tf.constant(x), tf.constant(y)).graph.get_operations()


def _crossing_tensors(plan):
    """Tensors sent to another partition, computed from the plan alone."""
    g = plan.op_graph
    free = free_ops(g)
    out = []
    for t in g.tensors:
        if free[t.producer]:
            continue
        src = plan.partition_of_op[t.producer]
        if any(plan.partition_of_op[c] != src for c in t.consumers):
            out.append(t.id)
    return out


@pytest.mark.parametrize("partitions,microbatches", [(2, 1), (2, 4), (3, 2), (4, 3)])
def test_one_boundary_pair_per_crossing_tensor_per_microbatch(partitions, microbatches):
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": partitions, "microbatches": microbatches})
    step = smp.step(models.make_body(model, "mlp"))
    x, y = models.data("mlp")
    ops = _lowered_ops(step, x, y)
    plan = step.last_plan
    crossing = _crossing_tensors(plan)
    # A chain of P stages sends one activation forward and one gradient
    # backward across each of its P-1 boundaries.
    assert len(crossing) == 2 * (partitions - 1)
    n_out = sum(is_smp_output(op) for op in ops)
    n_in = sum(is_smp_input(op) for op in ops)
    assert n_out == microbatches * len(crossing)
    # Each crossing tensor is received once per micro-batch by its partition,
    # even when a later task there (the backward) needs it again.
    assert n_in == microbatches * len(crossing)
    # Every SMPInput reads an SMPOutput on another device.
    for op in ops:
        if is_smp_input(op):
            src = op.inputs[0].op
            assert is_smp_output(src)
            assert src.device != op.device


def test_skip_connection_crossing_two_partitions():
    """A residual tensor consumed on two other partitions: one SMPOutput, two SMPInputs."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    a = keras.layers.Dense(8, name="a")(inp)
    b = keras.layers.Dense(8, name="b")(a)
    c = keras.layers.Dense(8, name="c")(keras.layers.Add(name="ab")([a, b]))
    out = keras.layers.Dense(2, name="out")(keras.layers.Add(name="ac")([a, c]))
    model = smp.DistributedModel(inp, out)
    smp.init({"partitions": 3, "microbatches": 2, "optimize": "speed"})

    def body(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        return loss, tape.gradient(loss, model.trainable_variables), loss

    step = smp.step(body)
    x = np.random.rand(4, 8).astype("float32")
    y = np.random.rand(4, 2).astype("float32")
    ops = _lowered_ops(step, x, y)
    entry = next(iter(step._compiled.values()))
    consumers = {}
    for t in entry.tasks:
        for tin in t.boundary_inputs():
            consumers.setdefault(tin, set()).add(t.partition)
    # Some tensor is consumed on two different partitions.
    assert any(len(parts) >= 2 for parts in consumers.values())
    # One SMPOutput per crossing tensor, one SMPInput per receiving partition.
    assert sum(is_smp_output(op) for op in ops) == 2 * len(consumers)
    assert sum(is_smp_input(op) for op in ops) == 2 * sum(len(p) for p in consumers.values())


def test_variables_and_optimizer_slots_live_on_their_partition():
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 3, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    opt = keras.optimizers.Adam(1e-3)
    x, y = models.data("mlp")
    before = list(model.variables)

    @tf.function
    def train(x, y):
        _, grads, _ = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))

    train(x, y)
    plan = step.last_plan
    part_of_var = plan.partition_of_variable()
    assert [id(v) for v in model.variables] == [id(v) for v in before]  # same Keras objects
    seen_partitions = set()
    for v in model.variables:
        p = part_of_var[v.path]
        seen_partitions.add(p)
        assert v.value.device.endswith(f"CPU:{p}"), (v.path, v.value.device, p)
        prefix = v.path.replace("/", "_") + "_"
        slots = [s for s in opt.variables if s.name.startswith(prefix)]
        if v.trainable:
            assert len(slots) == 2  # Adam: momentum and velocity
        for s in slots:
            assert s.value.device.endswith(f"CPU:{p}"), (s.name, s.value.device, p)
    assert seen_partitions == {0, 1, 2}


def test_already_built_optimizer_slots_are_moved():
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.optimizer.build(model.trainable_variables)  # slots exist on CPU:0
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    step(*models.data("mlp"))
    part_of_var = step.last_plan.partition_of_variable()
    moved = 0
    for v in model.trainable_variables:
        p = part_of_var[v.path]
        prefix = v.path.replace("/", "_") + "_"
        for s in model.optimizer.variables:
            if s.name.startswith(prefix):
                assert s.value.device.endswith(f"CPU:{p}")
                moved += p == 1
    assert moved > 0


def test_plain_tf_variables_move_to_their_partition_keeping_identity():
    smp.init({"partitions": 2, "microbatches": 2})
    w0 = tf.Variable(tf.ones([4, 4]), name="w0")
    w1 = tf.Variable(tf.ones([4, 1]), name="w1")
    ids = (id(w0), id(w1), w0._unique_id, w1._unique_id)

    def body(x):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.matmul(x, w0))
            loss = tf.reduce_sum(tf.matmul(h, w1))
        return loss, tape.gradient(loss, [w0, w1])

    step = smp.step(body)
    loss, grads = step(tf.ones([4, 4]))
    np.testing.assert_allclose(loss.reduce_sum(), 64.0)
    part = step.last_plan.partition_of_variable()
    # Not owned by a Keras layer, they move all the same, as the same objects.
    assert (id(w0), id(w1), w0._unique_id, w1._unique_id) == ids
    for v in (w0, w1):
        key = v.name.split(":")[0]
        assert v.device.endswith(f"CPU:{part[key]}"), (key, v.device)
    np.testing.assert_allclose(w0.numpy(), np.ones([4, 4]))


def test_accumulated_gradients_are_summed_on_their_variables_device():
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 4})
    step = smp.step(models.make_body(model, "mlp"))
    devices = []

    @tf.function
    def run(x, y):
        _, grads, _ = step(x, y)
        acc = [g.accumulate() for g in grads]
        devices.extend(a.device for a in acc)
        return acc

    x, y = models.data("mlp")
    run(tf.constant(x), tf.constant(y))
    part = step.last_plan.partition_of_variable()
    for v, d in zip(model.trainable_variables, devices):
        assert d.endswith(f"CPU:{part[v.path]}"), (v.path, d)


def test_conv_model_gets_a_one_forward_one_backward_schedule():
    """Convolution gradients' ShapeN ops must not turn a forward task into a backward one."""
    import keras

    keras.utils.set_random_seed(0)
    model = models.residual_cnn()
    smp.init({"partitions": 2, "microbatches": 4, "pipeline": "interleaved"})
    step = smp.step(models.make_body(model, "residual_cnn"))
    step(*models.data("residual_cnn"))
    labels = {t.partition: t.label for t in step.schedule.tasks if t.partition == 0 and not t.backward}
    assert labels == {0: "F"}
    sim = step.schedule.simulate()
    assert sim.peak_live[0] <= 2 and sim.peak_live[1] <= 1


def test_second_step_function_does_not_move_placed_variables():
    """Variables are placed once per smp.init: graphs built earlier keep working."""
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 2})
    opt = keras.optimizers.SGD(0.1)
    train = smp.step(models.make_body(model, "mlp"))

    @tf.function
    def train_step(x, y):
        _, grads, _ = train(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))

    x, y = models.data("mlp")
    train_step(x, y)
    storage = [id(v.value) for v in model.variables]

    # A second step function, same smp.init: its plan may differ.
    other = smp.step(lambda x: model(x))
    other(x[:4])
    assert [id(v.value) for v in model.variables] == storage
    before = [v.numpy() for v in model.trainable_variables]
    train_step(x, y)  # still updates the variables the model reads
    after = [v.numpy() for v in model.trainable_variables]
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))


def _train_graph(config):
    """The MLP's training step (gradients accumulated) traced under `config`.

    Returns the model, the batch x, the step function, the traced graph, the
    step's compiled entry and the accumulated gradient tensors.
    """
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init(config)
    step = smp.step(models.make_body(model, "mlp"))
    x, y = models.data("mlp")
    accumulated = []

    @tf.function
    def run(x, y):
        _, grads, _ = step(x, y)
        acc = [g.accumulate() for g in grads]
        accumulated.extend(acc)
        return acc

    graph = run.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    return model, x, step, graph, next(iter(step._compiled.values())), accumulated


def test_fused_weight_gradients_leave_the_tasks_and_run_once_per_variable():
    """With fuse_weight_gradients, each kernel gradient is one MatMul over the
    whole batch, on its variable's device, and no task computes it."""
    model, x, step, graph, entry, accumulated = _train_graph(
        {"partitions": 2, "microbatches": 4, "fuse_weight_gradients": True})
    kernels = [v for v in model.trainable_variables if "kernel" in v.path]
    assert len(entry.fused) == len(model.trainable_variables)
    removed = {entry.plan.op_graph.ops[f.op].name for f, _ in entry.fused.values()}
    for task in entry.tasks:
        names = {entry.plan.op_graph.ops[i].name for i in task.members}
        assert not names & removed, task.key
    part = step.last_plan.partition_of_variable()
    for v, a in zip(model.trainable_variables, accumulated):
        assert a.device.endswith(f"CPU:{part[v.path]}"), (v.path, a.device)
    # The step's own graph: one weight-gradient MatMul per kernel, reading
    # the concatenated inputs of all micro-batches.
    full_batch = [
        op for op in graph.get_operations()
        if op.type == "MatMul" and op.get_attr("transpose_a") and op.inputs[0].shape[0] == x.shape[0]
    ]
    assert len(full_batch) == len(kernels)
    # Their inputs are read where they are: on the MatMul's device (an input
    # that came from another partition is taken as received there).
    for op in full_batch:
        device = tf.DeviceSpec.from_string(op.device)
        for concat in op.inputs:
            assert concat.op.type == "ConcatV2"
            for t in concat.op.inputs[:-1]:
                src = t.op
                while src.type == "Identity" and not src.device:
                    src = src.inputs[0].op
                if src.device:
                    assert tf.DeviceSpec.from_string(src.device).device_index == device.device_index, (op.name, src.name)


def test_fused_weight_gradients_off_by_default():
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    x, y = models.data("mlp")
    _, grads, _ = step(x, y)
    assert all(g._fused is None for g in grads)
    assert next(iter(step._compiled.values())).fused == {}


def test_pretransposed_weights_are_transposed_once_per_step_on_their_device():
    """With pretranspose_weights, no task multiplies by a transposed kernel:
    each kernel read transposed is transposed once per step, by the outer
    graph, on the partition that reads it, and fed to the task."""
    model, _, _, graph, entry, _ = _train_graph(
        {"partitions": 2, "microbatches": 4, "pretranspose_weights": True})
    kernels = [v for v in model.trainable_variables if "kernel" in v.path]
    # The first layer's input gradient is never computed (x is no variable).
    assert len(entry.pretransposed) == len(kernels) - 1
    for fn in entry._functions.values():
        transposed = [op.name for op in fn.graph.get_operations() if op.type == "MatMul" and op.get_attr("transpose_b")]
        assert transposed == [], transposed
    transposes = [op for op in graph.get_operations() if op.type == "Transpose" and "/transposed" in op.name]
    # One per kernel read, not one per micro-batch.
    assert len(transposes) == len(entry.pretransposed)
    readers = {r: t.partition for t in entry.tasks for r in t.transposed_reads}
    assert sorted(readers) == sorted(p.read for p in entry.pretransposed.values())
    devices = sorted(tf.DeviceSpec.from_string(op.device).device_index for op in transposes)
    assert devices == sorted(readers.values())


def test_pretranspose_weights_off_by_default():
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    step(*models.data("mlp"))
    entry = next(iter(step._compiled.values()))
    assert entry.pretransposed == {}
    assert all(t.transposed_reads == [] for t in entry.tasks)


def test_task_functions_read_their_inputs_under_the_traced_names():
    """Inside a task function, every tensor from another task (and every
    step argument) is read from an op named like its producer in the traced
    graph, so the graph optimiser, which orders commutative inputs by name,
    rewrites the task as it rewrites a single-device run; and the trace's
    arguments are named as `tf.function` names them (the body's parameters).
    """
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 2})
    step = smp.step(models.make_body(model, "mlp"))
    x, y = models.data("mlp")
    _lowered_ops(step, x, y)
    entry = next(iter(step._compiled.values()))
    assert entry.traced.arg_names == ["x", "y"]
    g = entry.plan.op_graph
    checked = 0
    for task in entry.tasks:
        graph = entry._functions[task.key].graph
        for t in task.inputs:
            name = g.tensor_name(t)
            op = graph.get_operation_by_name(name.rsplit(":", 1)[0])
            # Forwarded by an op the optimiser keeps, under the traced name.
            assert op.type in ("EnsureShape", "IdentityN"), (name, op.type)
            assert op.inputs[0].op.type == "Placeholder"
            consumers = [c for out in op.outputs for c in out.consumers()]
            assert consumers, name
            checked += 1
        for arg in task.arg_names:
            assert graph.get_operation_by_name(arg).type == "EnsureShape"
    assert checked > 0


def test_task_calls_skip_shape_inference_through_their_bodies_and_keep_their_shapes():
    """Each task call of the emitted step carries the attribute that makes
    TensorFlow skip shape inference through the task's body, and its outputs
    still have the task function's output shapes."""
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 3})
    step = smp.step(models.make_body(model, "mlp"))
    x, y = models.data("mlp")
    ops = _lowered_ops(step, x, y)
    calls = [op for op in ops if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert len(calls) == 3 * len(step.last_compiled.tasks)
    functions = {f.function_def.signature.name: f for f in step.last_compiled._functions.values()}
    for op in calls:
        assert op.get_attr("_disable_call_shape_inference") is True
        fn = functions[op.get_attr("f").name]
        expected = [o.shape for o in tf.nest.flatten(fn.structured_outputs)]
        assert [t.shape for t in op.outputs] == expected


def test_state_writes_no_output_reads_run_once_per_microbatch_in_order():
    """Task functions are built without TensorFlow's automatic control
    dependencies; the ops that must run are still their control outputs, and
    the order of the trace holds. Two writes to one variable that no output
    reads, which give another value in the other order, run once per
    micro-batch in the traced order: x -> 2x + 1 four times from 0 is 15
    (the other order, x -> 2(x + 1), gives 30)."""
    import keras

    keras.utils.set_random_seed(0)
    model = models.mlp()
    smp.init({"partitions": 2, "microbatches": 4})
    counter = tf.Variable(0.0, trainable=False)
    inner = models.make_body(model, "mlp")

    def body(x, y):
        counter.assign(counter * 2.0)
        counter.assign_add(1.0)
        return inner(x, y)

    step = smp.step(body)
    x, y = models.data("mlp")

    @tf.function
    def run(x, y):
        loss, _, _ = step(x, y)
        return loss.reduce_mean()

    run(tf.constant(x), tf.constant(y))
    assert counter.numpy() == 15.0
    writes = {"AssignVariableOp", "AssignAddVariableOp"}
    found = 0
    for fn in step.last_compiled._functions.values():
        ops = fn.graph.get_operations()
        control_outputs = {op.name for op in fn.graph.control_outputs}
        for op in ops:
            if op.type in writes:
                assert op.name in control_outputs, op.name
                found += 1
        # Each return waits for the ops that must run, through one NoOp.
        if control_outputs:
            for t in fn.graph.outputs:
                assert [c.type for c in t.op.control_inputs] == ["NoOp"], t.name
    assert found >= 2
    run(tf.constant(x), tf.constant(y))
    assert counter.numpy() == 255.0


def test_calls_without_body_shape_inference_restores_the_graph_and_nests():
    from smp_tf.lowering import calls_without_body_shape_inference

    inner = tf.function(lambda a: tf.reduce_sum(a * 2.0)).get_concrete_function(tf.TensorSpec([4]))
    g = tf.Graph()
    with g.as_default():
        a = tf.ones([4])
        with calls_without_body_shape_inference(g):
            with calls_without_body_shape_inference(g):
                inside = inner(a)
            also_inside = inner(a)
        outside = inner(a)
    assert inside.op.get_attr("_disable_call_shape_inference") is True
    assert also_inside.op.get_attr("_disable_call_shape_inference") is True
    with pytest.raises(ValueError):
        outside.op.get_attr("_disable_call_shape_inference")
    assert inside.shape == outside.shape == tf.TensorShape([])
    assert g.create_op.__func__ is tf.Graph.create_op
    # Eagerly, nothing to do.
    with calls_without_body_shape_inference(g):
        assert float(inner(tf.ones([4]))) == 8.0
