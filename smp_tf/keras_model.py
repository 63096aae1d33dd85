"""`smp.DistributedModel`: a Keras model whose `call` is partitioned by `smp.step`."""

from __future__ import annotations

import smp_tf._autograph  # noqa: F401  (keeps AutoGraph out of smp_tf)

import weakref
from typing import Any, List

import keras
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.trainers.trainer import Trainer

__all__ = ["DistributedModel", "live_models"]

_MODELS: "weakref.WeakSet[DistributedModel]" = weakref.WeakSet()


class DistributedModel(keras.Model):
    """A `keras.Model` whose ops are split across devices inside `smp.step`.

    Use it exactly like `keras.Model`, either by subclassing it (write
    `call`) or in the functional form ``smp.DistributedModel(inputs,
    outputs)``. Inside a `@smp.step` function its forward pass, the loss and
    the gradients are traced, partitioned and pipelined; each of its
    variables (and the optimizer slots of those variables) is moved once to
    the device of its partition. The variables stay the model's own Keras
    variables, so checkpoints written with `model.save_weights` or
    `tf.train.Checkpoint` do not depend on the layout.

    Outside a step the model runs like any Keras model on the default device.
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
        _MODELS.add(self)


class FunctionalDistributedModel(Functional, DistributedModel):
    """The functional form of `DistributedModel` (created by `DistributedModel(inputs, outputs)`)."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return keras.Model.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        Trainer.__init__(self)
        Functional.__init__(self, *args, **kwargs)
        _MODELS.add(self)


def live_models() -> List[DistributedModel]:
    """The `DistributedModel` instances alive in this process."""
    return list(_MODELS)
