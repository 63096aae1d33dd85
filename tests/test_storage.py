"""A variable stored in pieces (tensor parallelism) behaves as a whole one.

`smp_tf.sharding.storage` keeps the `tf.Variable` (and the Keras variable
around it) and moves its value into pieces on a stage's devices. Reads,
writes, a Keras optimizer's update, checkpoints and the trace of a step are
checked here against an unsplit twin, on logical CPU devices.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf.placement  # noqa: F401  (its hook splits the slots of split variables)
from smp_tf.sharding import storage

DEVICES = ["/device:CPU:1", "/device:CPU:2"]


def _twins(seed=0):
    keras.utils.set_random_seed(seed)
    a = keras.layers.Dense(4)
    a.build((None, 6))
    b = keras.layers.Dense(4)
    b.build((None, 6))
    b.set_weights(a.get_weights())
    return a, b


def _device(v):
    return "/device:" + v.device.rsplit("device:", 1)[1]


def test_pieces_live_on_their_devices_and_reads_are_whole():
    a, b = _twins()
    old = storage.shard_variable(a.kernel, 1, DEVICES)
    assert old is not None and storage.is_sharded(a.kernel) and storage.split_dim_of(a.kernel) == 1
    pieces = storage.shards_of(a.kernel)
    assert [_device(p) for p in pieces] == DEVICES and [tuple(p.shape) for p in pieces] == [(6, 2), (6, 2)]
    assert _device(a.kernel.value) == DEVICES[0]
    np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
    np.testing.assert_array_equal(pieces[1].numpy(), b.kernel.numpy()[:, 2:])
    x = tf.random.normal((3, 6))
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    np.testing.assert_array_equal(tf.function(a)(x).numpy(), b(x).numpy())
    assert bool(a.kernel.value.is_initialized())


def test_writes_split_the_value():
    a, b = _twins()
    storage.shard_variable(a.kernel, 0, DEVICES)
    delta = tf.random.normal((6, 4))
    for kind in ("assign_add", "assign_sub", "assign"):
        getattr(a.kernel, kind)(delta)
        getattr(b.kernel, kind)(delta)
        np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())

    @tf.function
    def write(d):
        a.kernel.assign_add(d)
        return a.kernel.value.read_value()

    np.testing.assert_array_equal(write(delta).numpy(), b.kernel.numpy() + delta.numpy())
    rows = tf.IndexedSlices(tf.ones((2, 4)), tf.constant([1, 4]))
    a.kernel.value.scatter_add(rows)
    want = b.kernel.numpy() + delta.numpy()
    want[[1, 4]] += 1
    np.testing.assert_array_equal(a.kernel.numpy(), want)
    with pytest.raises(ValueError, match="shape"):
        a.kernel.value.assign(tf.zeros((3, 4)))
    with pytest.raises(NotImplementedError, match="split over 2 devices"):
        a.kernel.value.scatter_max(rows)


def test_a_keras_optimizer_trains_it_as_a_whole_variable():
    a, b = _twins()
    storage.shard_variable(a.kernel, 1, DEVICES)
    opt_a, opt_b = keras.optimizers.Adam(0.1), keras.optimizers.Adam(0.1)
    grads = [tf.random.normal((6, 4)), tf.random.normal((4,))]

    def apply(opt, layer):
        return tf.function(lambda: opt.apply_gradients(zip(grads, layer.trainable_variables)))

    apply_a, apply_b = apply(opt_a, a), apply(opt_b, b)
    for _ in range(3):
        apply_a()
        apply_b()
    # Bit for bit: the update is element-wise, and runs piece by piece.
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(x, y)
    graph = apply_a.get_concrete_function().graph
    sqrt_devices = sorted(op.device.rsplit("device:", 1)[-1] for op in graph.get_operations() if op.type == "Sqrt")
    # Adam's two square roots (of the second moment and of the bias
    # correction) for each piece of the kernel on its device, and for the
    # whole bias on its own.
    assert sqrt_devices == ["CPU:0", "CPU:0", "CPU:1", "CPU:1", "CPU:2", "CPU:2"], sqrt_devices
    # Slots created for a split variable are split the same way
    # (smp_tf.placement's slot hook).
    moments = [v for v in opt_a.variables if tuple(v.shape) == (6, 4)]
    assert len(moments) == 2
    for m in moments:
        assert [_device(p) for p in storage.shards_of(m)] == DEVICES


def test_checkpoints_hold_the_whole_value(tmp_path):
    a, b = _twins()
    storage.shard_variable(a.kernel, 1, DEVICES)
    path = tf.train.Checkpoint(w=a.kernel).write(str(tmp_path / "ckpt"))
    plain = tf.Variable(tf.zeros((6, 4)))
    tf.train.Checkpoint(w=plain).read(path).assert_consumed()
    np.testing.assert_array_equal(plain.numpy(), b.kernel.numpy())
    # Restored into a split variable: each piece gets its slice.
    a.kernel.assign(tf.zeros((6, 4)))
    tf.train.Checkpoint(w=a.kernel).read(path).assert_consumed()
    np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
    np.testing.assert_array_equal(storage.shards_of(a.kernel)[0].numpy(), b.kernel.numpy()[:, :2])


def test_a_step_trace_reads_the_own_handle_and_unsharding_restores_a_plain_variable():
    a, b = _twins()
    storage.shard_variable(a.kernel, 1, DEVICES)
    with storage.reading_own_handle():
        graph = tf.function(a).get_concrete_function(tf.TensorSpec((3, 6))).graph
    captured = {id(external) for external, _ in graph.captures}
    assert id(a.kernel.value.handle) in captured
    assert not any(id(p.handle) in captured for p in storage.shards_of(a.kernel))
    # The own handle holds nothing: the value is only in the pieces.
    own = tf.raw_ops.ReadVariableOp(resource=a.kernel.value.handle, dtype=tf.float32)
    assert own.shape.num_elements() == 0
    # TensorFlow's eager fast path (a raw op given the variable) gathers too.
    np.testing.assert_array_equal(tf.subtract(a.kernel.value, b.kernel.value).numpy(), np.zeros((6, 4)))
    storage.unshard_variable(a.kernel, "/device:CPU:3")
    assert not storage.is_sharded(a.kernel) and type(a.kernel.value) is tf.Variable(1.0).__class__
    assert _device(a.kernel.value) == "/device:CPU:3"
    np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())


def test_errors_name_the_variable_and_the_split():
    a, _ = _twins()
    with pytest.raises(ValueError, match=r"shape \[6, 4\] along dimension 1 over 3 devices"):
        storage.shard_variable(a.kernel, 1, DEVICES + ["/device:CPU:3"])
    storage.shard_variable(a.kernel, 1, DEVICES)
    with pytest.raises(ValueError, match="already split"):
        storage.shard_variable(a.kernel, 1, DEVICES)
