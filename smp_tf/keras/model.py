"""`smp.DistributedModel`: a Keras model whose ops are split across devices.

Inside a `@smp.step` function its forward pass, the loss and the gradients
are traced, partitioned and pipelined. Keras's ``fit``, ``evaluate`` and
``predict`` (and ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``)
run through the same pipeline: the model's ``train_step``, ``test_step`` and
``predict_step`` are pipelined (see `smp_tf.keras.steps`), and everything
around them (the epoch loop, callbacks, progress bar, validation,
``steps_per_execution``) is Keras's own.
"""

from __future__ import annotations

import smp_tf._autograph  # noqa: F401  (keeps AutoGraph out of smp_tf)

from typing import Any, List, Tuple

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.data_adapters import data_adapter_utils
from keras.src.trainers.trainer import Trainer

from smp_tf import placement, state
from smp_tf.keras import data_parallel
from smp_tf.keras.steps import PipelinedSteps, loss_scale_of, merge

__all__ = ["DistributedModel", "live_models"]


def _this_replicas_rows(data: Any) -> Tuple[Any, Any, Any, Any]:
    """(x, y, sample_weight, process group) of a training or evaluation
    batch: with data parallelism and ``shard_inputs`` this replica's rows
    of the global batch; the group is None without data parallelism."""
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    group = state.process_group() if state.data_parallel() else None
    if group is not None and state.config().shard_inputs:
        x, y, sample_weight = data_parallel.shard((x, y, sample_weight), group.rank, group.size)
    return x, y, sample_weight, group


@keras.saving.register_keras_serializable(package="smp_tf")
class DistributedModel(keras.Model):
    """A `keras.Model` whose ops are split across devices and pipelined.

    Use it exactly like `keras.Model`, either by subclassing it (write
    `call`) or in the functional form ``smp.DistributedModel(inputs,
    outputs)``.

    - Inside a `@smp.step` function its forward pass, the loss and the
      gradients are traced, partitioned and pipelined.
    - ``compile`` / ``fit`` / ``evaluate`` / ``predict`` work as in Keras, and
      run each batch through the pipeline (`smp.init` must have been
      called): the loss and gradients per micro-batch, the optimizer once
      per batch on the accumulated gradients, the metrics on the whole
      batch. ``jit_compile`` is off (XLA compiles for one device); passing
      ``jit_compile=True`` raises.
    - Each variable (and its optimizer slots) lives on the device of its
      partition; the variables stay the model's own, so checkpoints
      (``save_weights``, ``tf.train.Checkpoint``, `smp.CheckpointManager`)
      do not depend on the layout.
    - Called outside a step, ``fit`` or ``predict`` (``model(x)``), it runs
      like any Keras model, reading each variable where it lives.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # keras.Model turns `Model(inputs, outputs)` into a Functional by
        # rewriting the *class's* bases, which would break every later
        # subclass of DistributedModel. The functional form gets its own class.
        if cls is DistributedModel and functional_init_arguments(args, kwargs):
            return keras.Model.__new__(FunctionalDistributedModel)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        placement.register_model(self)

    # -- the pipelined Keras steps ----------------------------------------------
    def _pipelined_steps(self) -> PipelinedSteps:
        steps = self.__dict__.get("_smp_tf_steps")
        if steps is None:
            # Set through __dict__: Keras tracks attributes set normally.
            steps = self.__dict__["_smp_tf_steps"] = PipelinedSteps(self)
        return steps

    @property
    def step_functions(self) -> PipelinedSteps:
        """The `smp.step` functions behind ``fit``, ``evaluate`` and ``predict``.

        ``model.step_functions.train`` (and ``.test``, ``.predict``) is a
        `smp.StepFunction`: after the first batch, its ``last_plan`` is the
        `PartitionPlan` (``print(plan.report())``) and its ``schedule`` the
        pipeline schedule (``print(schedule)``).
        """
        return self._pipelined_steps()

    def training_step_of(self, x: Any, y: Any) -> Tuple[Any, tuple]:
        """The `smp.step` function ``fit`` trains with and its arguments for
        one batch ``(x, y)`` (what `smp.plan(model, x, y)` plans)."""
        if not self.built:
            self(x)
        steps = self._pipelined_steps()
        steps.train.optimizer = self.optimizer
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = tf.nest.map_structure(tf.convert_to_tensor, y)
        batch = int(tf.nest.flatten(x)[0].shape[0])
        return steps.train, (x, y, None, tf.constant(batch, tf.int64), tf.constant(1, tf.int64), loss_scale_of(self))

    def _check_pipelinable(self) -> None:
        if tf.distribute.has_strategy():
            raise ValueError(
                "DistributedModel.fit/evaluate/predict cannot run under a tf.distribute strategy "
                f"({type(tf.distribute.get_strategy()).__name__}): smp_tf places the model on its "
                "partitions' devices itself. Build and compile the model outside the strategy's "
                "scope; for data parallelism use smp_tf's own (the `horovod` config key)."
            )

    def train_step(self, data: Any) -> Any:
        """One pipelined training step on a batch (see `smp_tf.keras.steps`)."""
        self._check_pipelinable()
        x, y, sample_weight, group = _this_replicas_rows(data)
        steps = self._pipelined_steps()
        # Its state counts in the memory report and against memory_budget.
        steps.train.optimizer = self.optimizer
        batch_size = _batch_size(x)
        loss_scale = loss_scale_of(self)

        def emit(k, uneven):
            loss, grads, y_pred = steps.train._emit(
                (x, y, sample_weight, batch_size, tf.constant(k, tf.int64), loss_scale), {},
                num_microbatches=k, uneven=uneven,
            )
            return loss.reduce_mean(), [g.accumulate() for g in grads], merge(y_pred)

        if group is None:
            loss, grads, y_pred = steps.run(x, emit)
        else:
            loss, grads, y_pred = data_parallel.run_or_contribute_nothing(
                batch_size, lambda: steps.run(x, emit), [v.shape for v in self.trainable_weights]
            )
            raise_if_uneven = state.config().raises_on_uneven_inputs
            rows = tf.cast(batch_size, tf.float32)
            data_parallel.sync_written_state(
                steps.train, rows, [loss] + [g for g in grads if g is not None], "fit/state", raise_if_uneven
            )
            grads = data_parallel.reduce_gradients(
                grads, list(self.trainable_weights), rows, "fit/grad", raise_if_uneven
            )
        if self.trainable_weights:
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self._loss_tracker.update_state(loss, sample_weight=batch_size)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, data: Any) -> Any:
        """One pipelined evaluation step (forward only) on a batch."""
        self._check_pipelinable()
        x, y, sample_weight, group = _this_replicas_rows(data)
        steps = self._pipelined_steps()
        batch_size = _batch_size(x)

        def emit(k, uneven):
            loss, y_pred = steps.test._emit(
                (x, y, sample_weight, batch_size, tf.constant(k, tf.int64)), {},
                num_microbatches=k, uneven=uneven,
            )
            return loss.reduce_mean(), merge(y_pred)

        if group is None:
            loss, y_pred = steps.run(x, emit)
        else:
            # This replica's share may be empty (the last, small batch).
            def forward():
                loss, y_pred = steps.run(x, emit)
                return loss, [], y_pred

            loss, _, y_pred = data_parallel.run_or_contribute_nothing(batch_size, forward, [])
        self._loss_tracker.update_state(loss, sample_weight=batch_size)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data: Any) -> Any:
        """Pipelined predictions (forward only) for a batch, in row order.

        With data parallelism every replica predicts every row (predictions
        are not sharded)."""
        self._check_pipelinable()
        x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(data)
        steps = self._pipelined_steps()

        def emit(k, uneven):
            return (merge(steps.predict._emit((x,), {}, num_microbatches=k, uneven=uneven)),)

        return steps.run(x, emit)[0]

    # -- the epoch's logs with data parallelism -----------------------------------
    def make_train_function(self, force: bool = False) -> Any:
        super().make_train_function(force)
        return self._mark_phase("train_function", "train")

    def make_test_function(self, force: bool = False) -> Any:
        super().make_test_function(force)
        return self._mark_phase("test_function", "test")

    def _mark_phase(self, attribute: str, phase: str) -> Any:
        # Which loop ran last (training or evaluation) decides what the end
        # of the epoch must join (see _get_metrics_result_or_logs).
        function = getattr(self, attribute)
        if function is None or getattr(function, "_smp_tf_phase", None) == phase:
            return function

        def marked(*args, **kwargs):
            self.__dict__["_smp_tf_phase"] = phase
            try:
                return function(*args, **kwargs)
            except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError) as e:
                group = state.process_group() if state.is_initialized() else None
                if group is None:
                    raise
                from smp_tf.distributed.runtime import raise_replica_error

                raise_replica_error(e, group, f"a {phase} step")

        marked._smp_tf_phase = phase
        setattr(self, attribute, marked)
        return marked

    def _get_metrics_result_or_logs(self, logs: Any) -> Any:
        # With data parallelism, the end of a training or evaluation loop:
        # a replica that ran out of data first joins the others' remaining
        # steps, then the logs are computed from the metrics of all replicas.
        if not (state.is_initialized() and state.data_parallel()):
            return super()._get_metrics_result_or_logs(logs)
        if self.__dict__.get("_smp_tf_phase") == "train":
            from smp_tf.distributed.join import finish_uneven

            variables = list(self.variables) + (list(self.optimizer.variables) if self.optimizer else [])
            finish_uneven(state.config().raises_on_uneven_inputs, lambda: variables)
        self.__dict__["_smp_tf_phase"] = None
        return data_parallel.global_metrics(self)

    # -- XLA ---------------------------------------------------------------------
    def _resolve_auto_jit_compile(self) -> bool:
        # Keras turns XLA on by default on GPUs; XLA compiles the step for
        # one device, which a pipeline over several devices cannot be.
        return False

    @property
    def jit_compile(self) -> bool:
        return False

    @jit_compile.setter
    def jit_compile(self, value: Any) -> None:
        if value and value != "auto":
            raise ValueError(
                f"A DistributedModel cannot be compiled with jit_compile={value!r}: XLA compiles "
                "the whole step for one device, but smp_tf runs it as a pipeline over several "
                "devices. Remove jit_compile (or pass jit_compile=False)."
            )
        self._jit_compile = False

    # -- export ------------------------------------------------------------------
    def save_model(self, path: str, input_signature: Any = None) -> None:
        """Writes an unpartitioned TensorFlow SavedModel of the model's forward pass.

        The SavedModel holds the variables' values and a ``serve`` /
        ``serving_default`` signature, without any device placement or
        pipeline: ``tf.saved_model.load(path)`` serves it on one device,
        without smp_tf (or Keras) installed.

        Args:
            path: the directory to write.
            input_signature: optional `tf.TensorSpec`s of the inputs, as for
                `keras.Model.export` (default: taken from the model's inputs).
        """
        from smp_tf.sharding import storage

        kwargs = {} if input_signature is None else {"input_signature": input_signature}
        # Variables split by tensor parallelism are read through their own
        # handle, which the SavedModel maps to a whole variable holding the
        # value their checkpoint gathers.
        with storage.reading_own_handle():
            self.export(path, format="tf_saved_model", verbose=False, **kwargs)


def _batch_size(x: Any) -> tf.Tensor:
    first = next((t for t in tf.nest.flatten(x) if t is not None), None)
    if first is None:
        raise ValueError("The batch holds no input tensor (x is empty or None).")
    return tf.shape(first, out_type=tf.int64)[0]


@keras.saving.register_keras_serializable(package="smp_tf")
class FunctionalDistributedModel(Functional, DistributedModel):
    """The functional form of `DistributedModel` (created by `DistributedModel(inputs, outputs)`)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return keras.Model.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Trainer.__init__(self)
        Functional.__init__(self, *args, **kwargs)
        placement.register_model(self)


def live_models() -> List[DistributedModel]:
    """The `DistributedModel` instances alive in this process."""
    return placement.live_models()
