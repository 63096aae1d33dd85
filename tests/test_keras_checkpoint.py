"""Checkpoints are layout-free; exports serve without smp_tf.

A checkpoint written under one partition count and schedule restores under
another, and in plain Keras in a process that cannot import smp_tf; training
resumed from it gives the losses of an uninterrupted run. A save that fails
halfway never leaves a checkpoint that restores wrong values.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp

M = 4
X = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, size=(64,)).astype("int32")


def build(cls=None):
    keras.utils.set_random_seed(5)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu", name="d0")(inp)
    h = keras.layers.Dense(32, activation="relu", name="d1")(h)
    h = keras.layers.Dense(32, activation="relu", name="d2")(h)
    return (cls or smp.DistributedModel)(inp, keras.layers.Dense(3, name="head")(h))


def compile_(model):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, epochs=1):
    return model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0).history["loss"]


# The same 3-epoch run, uninterrupted, on 2 partitions.
_UNINTERRUPTED = {}


def uninterrupted():
    if not _UNINTERRUPTED:
        smp.init({"partitions": 2, "microbatches": M, "pipeline": "interleaved"})
        _UNINTERRUPTED["losses"] = fit(compile_(build()), epochs=3)
    return _UNINTERRUPTED["losses"]


def run_without_smp_tf(code: str) -> str:
    """Runs `code` in a fresh interpreter in which `import smp_tf` fails."""
    prelude = textwrap.dedent('''
        import os, sys
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        class _Blocked:
            def find_spec(self, name, path=None, target=None):
                if name == "smp_tf" or name.startswith("smp_tf."):
                    raise ImportError("smp_tf is not installed here")
                return None
        sys.meta_path.insert(0, _Blocked())
        sys.path = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    ''')
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "smp_tf" not in proc.stdout
    return proc.stdout


def test_checkpoint_manager_restores_under_another_layout_and_resumes(tmp_path):
    expected = uninterrupted()
    # Two epochs on 2 partitions (interleaved), saved.
    smp.init({"partitions": 2, "microbatches": M, "pipeline": "interleaved"})
    model = compile_(build())
    fit(model, epochs=2)
    manager = smp.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=model.optimizer), tmp_path, max_to_keep=2)
    path = manager.save()
    assert path == str(tmp_path / "ckpt-1" / "ckpt") and tf.train.latest_checkpoint(str(tmp_path)) == path

    # Restored into a new model on 3 partitions (simple), before its first step.
    smp.init({"partitions": 3, "microbatches": M, "pipeline": "simple"})
    restored = compile_(build())
    restored.optimizer.build(restored.trainable_variables)
    manager = smp.CheckpointManager(tf.train.Checkpoint(model=restored, optimizer=restored.optimizer), tmp_path)
    manager.restore().assert_existing_objects_matched()
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    resumed = fit(restored, epochs=1)
    np.testing.assert_allclose(resumed, expected[2:], rtol=1e-5)
    assert {v.value.device[-1] for v in restored.trainable_variables} == {"0", "1", "2"}


def test_checkpoint_manager_numbering_and_retention(tmp_path):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build())
    manager = smp.CheckpointManager(tf.train.Checkpoint(model=model), tmp_path, max_to_keep=2, checkpoint_name="step")
    assert manager.restore() is None and manager.latest_checkpoint is None
    for _ in range(3):
        manager.save()
    assert [os.path.basename(os.path.dirname(p)) for p in manager.checkpoints] == ["step-2", "step-3"]
    assert tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths[-1].endswith("step-3/step")
    with pytest.raises(ValueError, match="No complete checkpoint"):
        manager.restore(str(tmp_path / "step-1" / "step"))
    for bad in ({"max_to_keep": 0}, {"checkpoint_name": "a/b"}):
        with pytest.raises(ValueError):
            smp.CheckpointManager(tf.train.Checkpoint(model=model), tmp_path, **bad)
    with pytest.raises(ValueError, match="tf.train.Checkpoint"):
        smp.CheckpointManager(model, tmp_path)


def test_interrupted_save_never_leaves_a_checkpoint_that_restores_wrong_values(tmp_path, monkeypatch):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build())
    fit(model)
    ckpt = tf.train.Checkpoint(model=model)
    manager = smp.CheckpointManager(ckpt, tmp_path)
    manager.save()
    saved = [v.numpy() for v in model.variables + model.optimizer.variables]
    fit(model)  # the weights and the optimizer state change

    original = tf.train.Checkpoint.write

    def write_half_then_fail(self, prefix, options=None):
        original(self, prefix, options)  # the data files exist ...
        os.remove(prefix + ".index")     # ... but the writer dies before the index
        raise OSError("disk full")

    monkeypatch.setattr(tf.train.Checkpoint, "write", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        manager.save()
    monkeypatch.undo()
    assert [os.path.basename(os.path.dirname(p)) for p in manager.checkpoints] == ["ckpt-1"]
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-1/ckpt")
    manager.restore().assert_existing_objects_matched()
    for v, b in zip(model.variables + model.optimizer.variables, saved):
        np.testing.assert_array_equal(v.numpy(), b)
    manager.save()  # the next save cleans up what the failed one left
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".partial-")]


def test_keras_file_saved_on_two_partitions_loads_and_resumes_on_three(tmp_path):
    expected = uninterrupted()
    smp.init({"partitions": 2, "microbatches": M, "pipeline": "interleaved"})
    model = compile_(build())
    fit(model, epochs=2)
    model.save(tmp_path / "model.keras")
    smp.init({"partitions": 3, "microbatches": M, "pipeline": "simple"})
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded, smp.DistributedModel)
    np.testing.assert_allclose(fit(loaded), expected[2:], rtol=1e-5)


def test_weights_and_tf_checkpoints_restore_in_plain_keras_without_smp_tf(tmp_path):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build())
    fit(model, epochs=2)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    tf.train.Checkpoint(model=model).write(str(tmp_path / "tf" / "ckpt"))
    np.save(tmp_path / "x.npy", X[:5])
    np.save(tmp_path / "expected.npy", model.predict(X[:5], verbose=0))
    out = run_without_smp_tf(f'''
        import numpy as np, keras, tensorflow as tf
        def build():
            inp = keras.Input((16,))
            h = keras.layers.Dense(32, activation="relu", name="d0")(inp)
            h = keras.layers.Dense(32, activation="relu", name="d1")(h)
            h = keras.layers.Dense(32, activation="relu", name="d2")(h)
            return keras.Model(inp, keras.layers.Dense(3, name="head")(h))
        x, expected = np.load("{tmp_path}/x.npy"), np.load("{tmp_path}/expected.npy")
        a = build(); a.load_weights("{tmp_path}/w.weights.h5")
        b = build(); tf.train.Checkpoint(model=b).read("{tmp_path}/tf/ckpt").assert_existing_objects_matched()
        for m in (a, b):
            np.testing.assert_allclose(m.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
        print("restored in plain keras")
    ''')
    assert "restored in plain keras" in out


def test_save_model_exports_a_savedmodel_served_without_smp_tf(tmp_path):
    smp.init({"partitions": 2, "microbatches": M})
    model = compile_(build())
    fit(model)
    model.save_model(str(tmp_path / "export"))
    np.save(tmp_path / "x.npy", X[:6])
    np.save(tmp_path / "expected.npy", model(X[:6]).numpy())
    out = run_without_smp_tf(f'''
        import numpy as np, tensorflow as tf
        served = tf.saved_model.load("{tmp_path}/export")
        x, expected = np.load("{tmp_path}/x.npy"), np.load("{tmp_path}/expected.npy")
        got = served.serve(tf.constant(x))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        sig = served.signatures["serving_default"]
        np.testing.assert_allclose(list(sig(tf.constant(x)).values())[0], expected, rtol=1e-5, atol=1e-6)
        print("served", sorted(served.signatures))
    ''')
    assert "served ['serve', 'serving_default']" in out
    saved = open(tmp_path / "export" / "saved_model.pb", "rb").read()
    assert b"CPU:1" not in saved and b"SMPInput" not in saved
