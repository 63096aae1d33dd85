"""Test set-up: logical CPU devices, quiet TensorFlow, deterministic kernels."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The transparency tests compare against a single-device run at rtol 1e-5;
# deterministic kernels make both runs add in the same order.
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

#: Logical CPU devices created for the whole test session (smp.init reuses them).
NUM_DEVICES = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_DEVICES
)


@pytest.fixture
def seed():
    import keras

    keras.utils.set_random_seed(1234)
    return 1234
