"""The pipelined train, test and predict steps of a `DistributedModel`.

Keras's ``fit``, ``evaluate`` and ``predict`` call ``train_step``,
``test_step`` and ``predict_step`` once per batch, inside the functions they
build (so the epoch loop, callbacks, progress bar, validation and
``steps_per_execution`` stay Keras's own). A `DistributedModel` implements
those steps with three `smp.step` functions, created once per model:

* **train**: per micro-batch the forward pass, the compiled loss (with
  ``model.losses``) and its gradients; after the pipeline the optimizer
  applies the accumulated gradients once, and the loss tracker and the
  compiled metrics are updated with the whole batch (predictions merged back
  into row order), as plain Keras does;
* **test**: the same without gradients: a forward-only pipeline;
* **predict**: the forward pass only; predictions in row order.

Each step is equivalent to this loop on one device, for a batch of ``n`` rows
and ``M = microbatches``::

    k = M if n >= M else 1                      # the batch rule
    micro-batch m takes rows m, m+k, m+2k, ...  # sizes differ by at most one
    loss_m  = compiled loss of micro-batch m (mean over its rows)
    loss    = sum_m (rows_m / n) * loss_m       # the full batch's mean loss
    grads   = d loss / d weights                # the same weights per row

So a batch whose size is not a multiple of ``M`` (the last, smaller batch of
an epoch) is trained, evaluated and predicted whole, without dropping or
repeating rows: with a loss that is a mean over rows (Keras's default
reduction) its loss and gradients equal plain Keras's. A batch of fewer than
``M`` rows runs as one micro-batch through the same partitions.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import tensorflow as tf

from smp_tf import state
from smp_tf.step_function import StepFunction
from smp_tf.step_output import StepOutput

logger = logging.getLogger("smp_tf")

__all__ = ["PipelinedSteps", "loss_scale_of", "merge"]


def _first_tensor(x: Any) -> Optional[tf.Tensor]:
    for leaf in tf.nest.flatten(x):
        if leaf is not None and hasattr(leaf, "shape"):
            return leaf
    return None


def _rows_weight(x: Any, num_microbatches: tf.Tensor, batch_size: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """rows of this micro-batch * k / n: the weight that makes the mean over
    micro-batches of the weighted losses the mean over the batch's rows.

    Exactly 1 when the micro-batches are of equal size (an integer ratio of
    equal integers), so an even split computes what the plain mean does.
    """
    first = _first_tensor(x)
    if first is None:
        return tf.constant(1.0, dtype)
    rows = tf.shape(first, out_type=tf.int64)[0]
    return tf.cast(rows * tf.cast(num_microbatches, tf.int64), dtype) / tf.cast(batch_size, dtype)


def loss_scale_of(model: Any) -> tf.Tensor:
    """The optimizer's loss-scale factor (mixed precision), read now: Keras's
    `LossScaleOptimizer.scale_loss` picks it in Python, so it must not be
    frozen into the cached step."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return tf.constant(1.0, tf.float32)
    return tf.cast(tf.convert_to_tensor(optimizer.scale_loss(tf.constant(1.0, tf.float32))), tf.float32)


class PipelinedSteps:
    """The three `smp.step` functions of one model and the batch rule.

    Args:
        model: the `DistributedModel`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        extra = ["batch_size", "num_microbatches"]
        self.train = StepFunction(self._train_body, non_split_inputs=extra + ["loss_scale"])
        self.test = StepFunction(self._test_body, non_split_inputs=extra)
        self.predict = StepFunction(self._predict_body)
        for fn in (self.train, self.test, self.predict):
            # The Keras steps average over the replicas themselves, weighting
            # each replica by its rows (see smp_tf.keras.data_parallel).
            fn.reduce_over_replicas = False

    # -- step bodies (one micro-batch) -----------------------------------------
    def _forward(self, x: Any, training: bool) -> Any:
        model = self.model
        return model(x, training=training) if model._call_has_training_arg else model(x)

    def _train_body(self, x, y, sample_weight, batch_size, num_microbatches, loss_scale):
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            loss = loss * _rows_weight(x, num_microbatches, batch_size, loss.dtype)
            scaled = loss * tf.cast(loss_scale, loss.dtype)
        grads = tape.gradient(scaled, model.trainable_weights)
        return loss, grads, y_pred

    def _test_body(self, x, y, sample_weight, batch_size, num_microbatches):
        model = self.model
        y_pred = self._forward(x, training=False)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
        return loss * _rows_weight(x, num_microbatches, batch_size, loss.dtype), y_pred

    def _predict_body(self, x):
        return self._forward(x, training=False)

    # -- the batch rule ---------------------------------------------------------
    def run(self, x: Any, emit: Callable[[int, bool], Tuple[Any, ...]]) -> Tuple[Any, ...]:
        """Runs `emit(k, uneven)` for the batch `x` by the batch rule.

        `emit` emits the pipeline with `k` micro-batches and returns the
        combined results (tensors; None stays None). With a batch size known
        only at run time, both the `M`-micro-batch pipeline and the
        one-micro-batch pipeline are emitted (they share their tasks) and a
        `tf.cond` picks one per batch.
        """
        m = state.config().microbatches
        first = _first_tensor(x)
        n = None if first is None else tf.compat.dimension_value(first.shape[0]) if first.shape.rank else None
        if m == 1:
            return emit(1, False)
        if n is not None:
            if n % m == 0:
                return emit(m, False)
            return emit(m, True) if n >= m else emit(1, False)
        rows = tf.shape(first)[0]
        # tf.cond returns tensors only: None results (the gradient of a
        # variable the loss does not use) are kept out and put back, and
        # sparse gradients are made dense (both branches must agree).
        structure: List[Any] = []
        missing: List[List[bool]] = []

        def branch(k: int, uneven: bool) -> Callable[[], List[tf.Tensor]]:
            def fn() -> List[tf.Tensor]:
                out = emit(k, uneven)
                flat = [tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t for t in tf.nest.flatten(out)]
                if not structure:
                    structure.append(out)
                    missing.append([t is None for t in flat])
                return [t for t in flat if t is not None]

            return fn

        values = iter(tf.cond(rows >= m, branch(m, True), branch(1, False)))
        flat = [None if none else next(values) for none in missing[0]]
        return tf.nest.pack_sequence_as(structure[0], flat)


def merge(outputs: Any) -> Any:
    """Every `StepOutput` of a structure merged back into row order."""
    return tf.nest.map_structure(lambda s: s.merge() if isinstance(s, StepOutput) else s, outputs)
