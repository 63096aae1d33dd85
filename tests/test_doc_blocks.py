"""The Python blocks of README.md and docs/ that are marked runnable run.

A block is marked by an HTML comment on the line before its fence:

* ``<!-- run -->``: the block runs as it is written;
* ``<!-- run: keras -->``: it runs with the names a user would already
  have defined (`FIXTURES`: a small Keras model's ``inputs`` and
  ``outputs``, data ``x``/``y`` and ``x_train``/``y_train``/``x_test``/
  ``y_test``, ``MyModel``, ``loss_fn``, ``optimizer``), defined right after
  the block's ``smp.init`` call (smp_tf is initialised before any
  TensorFlow op, as the docs ask), or after `INIT` for a block without
  one; ``<!-- run: step -->`` adds a compiled ``model``, an ``smp.step``
  ``train_step`` and the ``tf.function`` ``train`` that applies it;
* ``<!-- not on CPU: <reason> -->``: it needs what this machine does not
  have; it is listed here, skipped with its reason.

Each block runs in a fresh process (``smp.init`` comes first in a process)
on the logical CPU devices ``smp.init`` creates. Unmarked blocks are
fragments of a longer program and are not run.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
#: At least this many blocks are marked runnable: the harness never runs nothing.
MIN_RUNNABLE = 6

FIXTURES = {
    "keras": '''
import numpy as _np
import keras
import tensorflow as tf

_rng = _np.random.default_rng(0)
inputs = keras.Input((16,))
outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Dense(32, activation="relu")(inputs))
x = _rng.normal(size=(256, 16)).astype("float32")
y = _rng.integers(0, 10, size=(256,)).astype("int32")
x_train = _rng.normal(size=(256, 8, 8, 1)).astype("float32")
y_train = _rng.integers(0, 10, size=(256,)).astype("int32")
x_test, y_test = x_train[:64], y_train[:64]


class MyModel(smp.DistributedModel):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.head = keras.layers.Dense(10)

    def call(self, x, training=False):
        return self.head(self.hidden(x))


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.Adam(1e-3)
''',
}

FIXTURES["step"] = FIXTURES["keras"] + '''
model = MyModel()
model.compile(optimizer="adam", loss=loss_fn)


@smp.step
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return loss, tape.gradient(loss, model.trainable_variables)


@tf.function
def train(x, y):
    loss, grads = train_step(x, y)
    optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
    return loss.reduce_mean()
'''

#: What a block run with a fixture but without its own ``smp.init`` (a
#: fragment of a program that called it before) is given first.
INIT = 'smp.init({"partitions": 2, "microbatches": 4})'

_MARK = re.compile(r"<!--\s*(run(?::\s*(\w+))?|not on CPU:\s*(.+?))\s*-->")


def _blocks():
    """(id, code, fixture or None, reason to skip or None) per marked block."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python" or i == 0:
                continue
            m = _MARK.search(lines[i - 1])
            if not m:
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append((f"{page.relative_to(ROOT)}:{i + 1}", "\n".join(lines[i + 1:end]), m.group(2), m.group(3)))
    return out


BLOCKS = _blocks()


def _program(code: str, fixture: str) -> str:
    """`code` with the fixture's names defined right after its ``smp.init``
    (and ``smp`` imported first, as the pages' earlier blocks do)."""
    lines = ["import smp_tf as smp"] + code.splitlines()
    # The block's own smp.init, if it comes before anything but imports.
    at = next((k for k, line in enumerate(lines)
               if line.strip() and not line.startswith(("import ", "from ", "#"))), None)
    if at is None or "smp.init(" not in lines[at]:
        lines, at = [lines[0], INIT] + lines[1:], 1
    while lines[at].count("(") > lines[at].count(")"):  # a call over several lines
        at += 1
    return "\n".join(lines[:at + 1] + [FIXTURES[fixture]] + lines[at + 1:])


def test_blocks_are_marked_and_fixtures_exist():
    runnable = [b for b in BLOCKS if b[3] is None]
    assert len(runnable) >= MIN_RUNNABLE, [b[0] for b in BLOCKS]
    unknown = {b[2] for b in BLOCKS if b[2] is not None and b[2] not in FIXTURES}
    assert not unknown, f"no such fixture: {unknown}"


@pytest.mark.parametrize("where, code, fixture, reason", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_block_runs(where, code, fixture, reason):
    if reason is not None:
        pytest.skip(f"{where}: {reason}")
    program = _program(code, fixture) if fixture else "import smp_tf as smp\n" + code
    # As a user runs it: without the test session's TF_DETERMINISTIC_OPS
    # (under which unseeded random ops, such as fit's shuffling, raise).
    env = {k: v for k, v in os.environ.items() if k != "TF_DETERMINISTIC_OPS"}
    env.update(PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{where} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
