"""Test set-up: logical CPU devices, quiet TensorFlow, deterministic kernels;
the longest test groups first; and, at the end of a run, the table of the
zoo's worst errors (each zoo test records its worst error as a property of
its report; reports reach these hooks in the main process also when the
tests run in workers)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The transparency tests compare against a single-device run at rtol 1e-5;
# deterministic kernels make both runs add in the same order.
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import re  # noqa: E402

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


#: Test groups (``xdist_group``) that take a minute or more, longest first.
#: pytest-xdist hands a worker the next group in collection order when it is
#: free (``--no-loadscope-reorder`` in setup.cfg); starting with the longest
#: keeps one of them from running alone at the end of the run.
LONG_GROUPS = ("data_parallel", "pipeline_processes", "transparency_tied_transformer", "mobilenet_v3_small",
               "efficientnet_b0", "tied_transformer", "bert_classifier", "resnet50", "gpt2_lm", "mobilenet_v2")


def _group(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return ""
    return marker.args[0] if marker.args else marker.kwargs.get("name", "")


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONG_GROUPS)}
    # A stable sort: the other tests keep their order, after the long groups.
    items.sort(key=lambda item: rank.get(_group(item), len(LONG_GROUPS)))


_ZOO_RESULTS = {}


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == "zoo_worst_error":
            m = re.search(r"\[(.+)-P(\d+)-(\w+)\]$", report.nodeid)
            if m:
                _ZOO_RESULTS[(m.group(1), int(m.group(2)), m.group(3))] = value


def pytest_terminal_summary(terminalreporter):
    if not _ZOO_RESULTS:
        return
    configs = sorted({(p, s) for _, p, s in _ZOO_RESULTS})
    names = list(dict.fromkeys(n for n, _, _ in _ZOO_RESULTS))
    terminalreporter.section("zoo: worst relative error (loss, gradients, state) against the single-device loop")
    terminalreporter.write_line(f"{'model':<26}" + "".join(f"{f'P={p} {s}':>16}" for p, s in configs))
    for n in names:
        cells = "".join(
            f"{_ZOO_RESULTS[(n, p, s)]:>16.2e}" if (n, p, s) in _ZOO_RESULTS else f"{'-':>16}" for p, s in configs
        )
        terminalreporter.write_line(f"{n:<26}{cells}")
