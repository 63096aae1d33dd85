"""`SMPInput` / `SMPOutput`: the boundary ops of a pipeline task.

Both are identities in value. An ``SMPOutput`` sits where a tensor leaves the
task that produced it, an ``SMPInput`` where it enters a task on another
partition; the schedule's control dependencies attach to the consuming
task's inputs, and a reader of the lowered graph sees every pipeline
boundary by these names.

Their gradients mirror each other: the gradient of an `smp_input` is an
`smp_output` and vice versa, so differentiating through a boundary gives
the boundary of the backward pass.
"""

from __future__ import annotations

import smp_tf._autograph  # noqa: F401  (keeps AutoGraph out of smp_tf)

import tensorflow as tf

__all__ = ["smp_input", "smp_output", "SMP_INPUT", "SMP_OUTPUT", "is_smp_input", "is_smp_output"]

SMP_INPUT = "SMPInput"
SMP_OUTPUT = "SMPOutput"


def raw_input(x: tf.Tensor, name: str = SMP_INPUT) -> tf.Tensor:
    """An ``SMPInput`` identity op without a gradient override (for lowering)."""
    return tf.identity(x, name=name)


def raw_output(x: tf.Tensor, name: str = SMP_OUTPUT) -> tf.Tensor:
    """An ``SMPOutput`` identity op without a gradient override (for lowering)."""
    return tf.identity(x, name=name)


@tf.custom_gradient
def smp_input(x: tf.Tensor):
    """Marks `x` as entering a task; the gradient leaves through an `smp_output`.

    Args:
        x: a tensor.

    Returns:
        `x` unchanged (an op named ``SMPInput``).
    """
    y = raw_input(x)

    def grad(dy):
        return raw_output(dy)

    return y, grad


@tf.custom_gradient
def smp_output(x: tf.Tensor):
    """Marks `x` as leaving a task; the gradient enters through an `smp_input`.

    Args:
        x: a tensor.

    Returns:
        `x` unchanged (an op named ``SMPOutput``).
    """
    y = raw_output(x)

    def grad(dy):
        return raw_input(dy)

    return y, grad


def _last_component(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def is_smp_input(op) -> bool:
    """True for an ``SMPInput`` op (its name's last component starts with it)."""
    return op.type == "Identity" and _last_component(op.name).startswith(SMP_INPUT)


def is_smp_output(op) -> bool:
    """True for an ``SMPOutput`` op."""
    return op.type == "Identity" and _last_component(op.name).startswith(SMP_OUTPUT)
