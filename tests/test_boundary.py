"""SMPInput / SMPOutput: identities whose gradients mirror each other."""

import numpy as np
import tensorflow as tf

from smp_tf import smp_input, smp_output
from smp_tf.boundary import is_smp_input, is_smp_output


def test_identity_in_value_eager():
    x = tf.constant([[1.0, -2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(smp_input(x), x)
    np.testing.assert_array_equal(smp_output(x), x)


def test_gradient_tape_eager():
    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(smp_output(smp_input(x)) * tf.constant([2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(tape.gradient(y, x), [2.0, 3.0, 4.0])


def _graph_ops(fn, *specs):
    return fn.get_concrete_function(*specs).graph.get_operations()


def test_gradient_of_input_is_output_and_vice_versa_in_tf_function():
    """The backward of an SMPInput holds an SMPOutput op, and the reverse."""

    @tf.function
    def through_input(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(smp_input(x) * 3.0)
        return tape.gradient(y, x)

    @tf.function
    def through_output(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(smp_output(x) * 3.0)
        return tape.gradient(y, x)

    spec = tf.TensorSpec([3], tf.float32)
    ops = _graph_ops(through_input, spec)
    assert sum(is_smp_input(op) for op in ops) == 1
    assert sum(is_smp_output(op) for op in ops) == 1  # the mirrored gradient
    ops = _graph_ops(through_output, spec)
    assert sum(is_smp_output(op) for op in ops) == 1
    assert sum(is_smp_input(op) for op in ops) == 1
    np.testing.assert_array_equal(through_input(tf.ones([3])), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(through_output(tf.ones([3])), [3.0, 3.0, 3.0])


def test_second_order_gradients_pass_through():
    x = tf.constant(2.0)
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = smp_input(x) ** 3
        dy = inner.gradient(y, x)
    np.testing.assert_allclose(dy, 12.0)
    np.testing.assert_allclose(outer.gradient(dy, x), 12.0)
