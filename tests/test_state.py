"""smp.init, devices and ranks."""

import pytest
import tensorflow as tf

import smp_tf as smp


def test_init_returns_config_and_sets_devices():
    cfg = smp.init({"partitions": 3, "microbatches": 6, "pipeline": "simple"})
    assert cfg.partitions == 3 and cfg.microbatches == 6 and cfg.pipeline == "simple"
    assert smp.current_config() == cfg
    assert smp.topology().devices == ("/device:CPU:0", "/device:CPU:1", "/device:CPU:2")
    assert smp.topology().logical_cpu
    assert len(tf.config.list_logical_devices("CPU")) >= 3


def test_ranks_single_process():
    smp.init({"partitions": 2, "microbatches": 4})
    assert (smp.rank(), smp.size(), smp.local_rank(), smp.local_size()) == (0, 1, 0, 1)
    assert (smp.mp_rank(), smp.mp_size(), smp.pp_rank(), smp.pp_size()) == (0, 2, 0, 2)
    assert (smp.dp_rank(), smp.dp_size()) == (0, 1)
    assert smp.num_microbatches() == 4


def test_reinit_replaces_config():
    smp.init({"partitions": 2, "microbatches": 2})
    smp.init({"partitions": 4, "microbatches": 8})
    assert smp.pp_size() == 4 and smp.num_microbatches() == 8


def test_more_partitions_than_devices_after_tf_started_is_a_clear_error():
    # The test session created 4 logical devices before TensorFlow started.
    with pytest.raises(RuntimeError, match=r"(?s)partitions=5.*smp\.init"):
        smp.init({"partitions": 5})
    smp.init({"partitions": 2})  # still usable afterwards


def test_invalid_config_names_key_and_value():
    with pytest.raises(ValueError, match="microbatches"):
        smp.init({"microbatches": 0})
    with pytest.raises(ValueError, match="Unrecognized config parameter"):
        smp.init({"partitons": 2})


def test_partition_context_validates_index():
    smp.init({"partitions": 2})
    with pytest.raises(ValueError, match="less than the number of partitions"):
        smp.partition(2)
    with pytest.raises(ValueError, match="int"):
        smp.partition("1")
    with smp.partition(1):  # outside a traced step it has no effect
        tf.constant(1.0)


def test_versions_older_than_supported_are_named_with_what_to_install():
    from smp_tf.state import unsupported_versions

    assert unsupported_versions(tf.__version__, __import__("keras").__version__) is None
    assert unsupported_versions("2.17.1", "3.7.0") is None
    assert unsupported_versions("2.21.0rc1", "3.15.1.dev2025") is None
    message = unsupported_versions("2.15.1", "3.3.3")
    assert "TensorFlow 2.15.1 (smp_tf needs 2.17 or later)" in message
    assert "Keras 3.3.3 (smp_tf needs 3.7 or later)" in message
    assert "pip install 'tensorflow>=2.17' 'keras>=3.7'" in message
    assert "TensorFlow" not in unsupported_versions("2.17.0", "3.6.0")
    # TensorFlow 2.16 computes a pipelined EfficientNetB0 differently from
    # its single-device step (tests/zoo/test_zoo.py): below the floor.
    assert "TensorFlow 2.16.2 (smp_tf needs 2.17 or later)" in unsupported_versions("2.16.2", "3.7.0")


def test_init_refuses_an_older_keras(monkeypatch):
    import keras

    monkeypatch.setattr(keras, "__version__", "3.3.3")
    with pytest.raises(RuntimeError, match=r"Keras 3\.3\.3 \(smp_tf needs 3\.7 or later\)"):
        smp.init({"partitions": 2})


def test_the_oldest_releases_agree_everywhere_and_nothing_caps_the_newest():
    """`.ci/oldest-requirements.txt` (what CI tests as the oldest releases),
    setup.cfg's bounds and `smp.init`'s floor name the same releases, and
    no requirement has an upper bound, so that CI's newest half picks up
    every new release."""
    import configparser
    import pathlib
    import re

    from smp_tf.state import MIN_KERAS, MIN_TENSORFLOW, _release

    root = pathlib.Path(__file__).resolve().parents[1]
    pins = {}
    for line in (root / ".ci" / "oldest-requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    assert _release(pins["tensorflow-cpu"])[:2] == MIN_TENSORFLOW, pins
    assert _release(pins["keras"])[:2] == MIN_KERAS, pins
    assert "keras-hub" in pins

    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    extras = cfg["options.extras_require"]
    floor = ".".join(map(str, MIN_TENSORFLOW))
    assert f"tensorflow-cpu>={floor}" in extras["cpu"].split()
    assert f"tensorflow>={floor}" in extras["gpu"].split()
    assert f"keras>={'.'.join(map(str, MIN_KERAS))}" in cfg["options"]["install_requires"].split()
    requirements = cfg["options"]["install_requires"].split() + [
        r for key in extras for r in extras[key].splitlines() if r.strip() and not r.strip().startswith("#")
    ]
    capped = [r for r in requirements if re.match(r"(tensorflow|keras)", r) and ("<" in r or "==" in r)]
    assert not capped, capped
