"""Transparency: a pipelined step computes exactly what one device computes.

For every model, schedule, partition count and micro-batch count, the loss,
the predictions, every gradient and the model's state after the step (BatchNorm
moving statistics, dropout seed state) equal the single-device reference: the
same body run per micro-batch in a plain loop from the same initial weights.

The tests of one model run in one worker (``xdist_group``), the schedules of
one layout one after another: the reference of a micro-batch count is
computed once per model, and the step of a layout is traced and partitioned
once and called under each schedule after its `smp.init`, as a user who
switches schedules keeps it (each schedule's pipeline is still built from its
own schedule, emitted and run anew).
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from tests import models

RTOL = 1e-5
ATOL = 1e-6

SCHEDULES = ("simple", "interleaved", "zero_bubble")
PARTITIONS = (1, 2, 3, 4)
MICROBATCHES = (1, 2, 3, 4, 8)
#: (partitions, micro-batches, schedule), the schedules of a layout in a row.
GRID = [(s, p, m) for p, m, s in itertools.product(PARTITIONS, MICROBATCHES, SCHEDULES)]
KINDS = ["mlp", "residual_cnn", "tied_transformer", "batchnorm", "dropout"]

_MODELS = {}
#: The current model's single-device results per micro-batch count.
_REFERENCES = {}
#: The current layout's step: (key, step).
_STEP = [None, None]


def _grouped(kind):
    return pytest.mark.xdist_group(f"transparency_{kind}")


def _params(kinds, configs):
    """The test parameters, one model's in a row and in one worker."""
    def name(value):
        return "+".join(value) if isinstance(value, tuple) else str(value)

    return [
        pytest.param(kind, *config, marks=_grouped(kind), id="-".join([name(c) for c in config] + [kind]))
        for kind in kinds for config in configs
    ]


def _model(kind):
    """One model per kind for the module, with its initial state saved."""
    if kind not in _MODELS:
        import keras

        keras.utils.set_random_seed(42)
        model = models.BUILDERS[kind]()
        _MODELS[kind] = (model, [v.numpy() for v in model.variables])
    model, init = _MODELS[kind]
    for v, value in zip(model.variables, init):
        v.assign(value)
    return model, init


def _reference(kind, model, init, body, x, y, microbatches):
    """The single-device loop's results and the state after it, from `init`."""
    if (kind, microbatches) not in _REFERENCES:
        if any(k != kind for k, _ in _REFERENCES):
            _REFERENCES.clear()
        ref = models.reference(body, x, y, microbatches)
        _REFERENCES[(kind, microbatches)] = (ref, [v.numpy() for v in model.variables])
        for v, value in zip(model.variables, init):
            v.assign(value)
    return _REFERENCES[(kind, microbatches)]


def _step(kind, model, partitions, microbatches, options, config):
    """The step of this model and layout, shared by its schedules."""
    key = (kind, partitions, microbatches, tuple(options), tuple(sorted(config.items())))
    if _STEP[0] != key:
        _STEP[:] = [key, smp.step(models.make_body(model, kind))]
    return _STEP[1]


def _check(kind, schedule, partitions, microbatches, options=(), **config):
    model, init = _model(kind)
    x, y = models.data(kind)
    smp.init({
        "partitions": partitions, "microbatches": microbatches, "pipeline": schedule,
        **{o: True for o in options}, **config,
    })
    body = models.make_body(model, kind)
    ref, ref_state = _reference(kind, model, init, body, x, y, microbatches)

    step = _step(kind, model, partitions, microbatches, options, config)
    loss, grads, pred = step(x, y)
    # The accumulated gradients (the mean over micro-batches), checked first:
    # for fused outputs it is one op over all micro-batches.
    for i, (g, var) in enumerate(zip(grads, model.trainable_variables)):
        ref_mean = tf.add_n([tf.convert_to_tensor(r[1][i]) for r in ref]) / microbatches
        np.testing.assert_allclose(
            tf.convert_to_tensor(g.accumulate()), ref_mean, rtol=RTOL, atol=ATOL,
            err_msg=f"accumulated gradient of {var.path}",
        )
    compiled = step.last_compiled
    if "fuse_weight_gradients" in options:
        fused = sum(g._fused is not None for g in grads)
        assert fused == len(compiled.fused)
        if kind == "mlp":
            assert fused == len(grads)  # every kernel and bias gradient
    if "pretranspose_weights" in options and kind == "mlp":
        # Every kernel but the first layer's is read transposed by the
        # input gradient (the first layer's input needs no gradient).
        assert len(compiled.pretransposed) == len(model.trainable_variables) // 2 - 1

    assert len(loss.outputs) == microbatches
    for m, (ref_loss, ref_grads, ref_pred) in enumerate(ref):
        np.testing.assert_allclose(loss.outputs[m], ref_loss, rtol=RTOL, atol=ATOL, err_msg=f"loss, micro-batch {m}")
        np.testing.assert_allclose(pred.outputs[m], ref_pred, rtol=RTOL, atol=ATOL, err_msg=f"pred, micro-batch {m}")
        assert len(grads) == len(ref_grads)
        for g, rg, var in zip(grads, ref_grads, model.trainable_variables):
            np.testing.assert_allclose(
                tf.convert_to_tensor(g.outputs[m]), tf.convert_to_tensor(rg),
                rtol=RTOL, atol=ATOL, err_msg=f"gradient of {var.path}, micro-batch {m}",
            )
    # Predictions back in the original row order.
    ref_merged = np.empty_like(np.concatenate([r[2] for r in ref]))
    for m, r in enumerate(ref):
        ref_merged[m::microbatches] = r[2]
    np.testing.assert_allclose(pred.merge(), ref_merged, rtol=RTOL, atol=ATOL)
    # State updated once per micro-batch, in order (BatchNorm, seeds).
    for v, expected in zip(model.variables, ref_state):
        np.testing.assert_allclose(v.numpy(), expected, rtol=RTOL, atol=ATOL, err_msg=f"state of {v.path}")
    return compiled


@pytest.mark.parametrize("kind,schedule,partitions,microbatches", _params(KINDS, GRID))
def test_transparency(kind, schedule, partitions, microbatches):
    _check(kind, schedule, partitions, microbatches)


OPTION_SETS = [
    ("fuse_weight_gradients",),
    ("pretranspose_weights",),
    ("fuse_weight_gradients", "pretranspose_weights"),
]


OPTION_CONFIGS = [("interleaved", 2, 4), ("simple", 3, 4), ("interleaved", 4, 8), ("interleaved", 2, 1)]


@pytest.mark.parametrize(
    "kind,options,schedule,partitions,microbatches",
    _params(KINDS, [(o, *c) for o in OPTION_SETS for c in OPTION_CONFIGS]),
)
def test_transparency_with_smp_tf_options(kind, options, schedule, partitions, microbatches):
    """Weight gradients computed once over all micro-batches and kernels
    transposed once per step give the reference values too."""
    _check(kind, schedule, partitions, microbatches, options)


VIRTUAL_CONFIGS = [
    ("interleaved", 2, 2, 4), ("simple", 2, 2, 4), ("zero_bubble", 2, 2, 4),
    ("interleaved", 2, 2, 3), ("interleaved", 2, 3, 4), ("interleaved", 3, 2, 6),
]


@pytest.mark.parametrize("kind,schedule,partitions,virtual_stages,microbatches", _params(KINDS, VIRTUAL_CONFIGS))
def test_transparency_with_virtual_stages(kind, schedule, partitions, virtual_stages, microbatches):
    """Each device holding several partitions (chunk c on device c % P)
    computes the reference values too, and every device runs its chunks'
    actions in one order."""
    compiled = _check(kind, schedule, partitions, microbatches, virtual_stages=virtual_stages)
    plan = compiled.plan
    assert plan.num_partitions == partitions * virtual_stages
    assert plan.device_index == [c % partitions for c in range(plan.num_partitions)]
    assert len(set(plan.devices)) == partitions
    # One order per device, holding the actions of all its partitions.
    assert sorted(compiled.schedule.order) == list(range(partitions))
    for d, actions in compiled.schedule.order.items():
        assert {a.partition % partitions for a in actions} == {d}
    # The memory report has a row per chunk and sums them per device.
    report = compiled.memory_report()
    assert len(report) == plan.num_partitions
    totals = report.device_totals()
    assert sorted(totals) == sorted(set(plan.devices)) and sum(totals.values()) == sum(r.total for r in report)
    assert "per device" in report.table()


@pytest.mark.parametrize("kind,schedule", _params(["mlp", "tied_transformer"], [(s,) for s in SCHEDULES]))
def test_transparency_with_memory_aware_partitioning(kind, schedule):
    """``optimize="memory"`` moves the boundaries by the schedule's predicted
    peaks (ZB-H1 keeps more micro-batches on later stages than 1F1B); the
    values stay the reference's."""
    compiled = _check(kind, schedule, 3, 4, optimize="memory")
    assert len(compiled.memory_report()) == 3


def test_dropout_reproducible_with_same_seed():
    """Two runs from the same seed state give identical results."""
    model, init = _model("dropout")
    x, y = models.data("dropout")
    smp.init({"partitions": 2, "microbatches": 4})
    step = smp.step(models.make_body(model, "dropout"))
    first = step(x, y)[0].reduce_mean().numpy()
    second_run = step(x, y)[0].reduce_mean().numpy()
    for v, value in zip(model.variables, init):
        v.assign(value)
    again = step(x, y)[0].reduce_mean().numpy()
    assert first == again
    assert first != second_run  # the seed state advanced in between


def test_training_step_in_tf_function_matches_reference():
    """A full step (pipeline, accumulate, apply_gradients) in one tf.function."""
    import keras

    kind = "residual_cnn"
    model, init = _model(kind)
    x, y = models.data(kind)
    M = 4
    smp.init({"partitions": 2, "microbatches": M})
    body = models.make_body(model, kind)

    ref_opt = keras.optimizers.SGD(0.1)
    ref = models.reference(body, x, y, M)
    mean_grads = [tf.add_n([r[1][i] for r in ref]) / M for i in range(len(ref[0][1]))]
    ref_opt.apply_gradients(zip(mean_grads, model.trainable_variables))
    expected = [v.numpy() for v in model.trainable_variables]
    for v, value in zip(model.variables, init):
        v.assign(value)

    opt = keras.optimizers.SGD(0.1)
    step = smp.step(body)

    @tf.function
    def train(x, y):
        loss, grads, _ = step(x, y)
        opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
        return loss.reduce_mean()

    loss = train(x, y)
    np.testing.assert_allclose(loss, np.mean([r[0] for r in ref]), rtol=RTOL)
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(v.numpy(), e, rtol=RTOL, atol=ATOL, err_msg=v.path)
