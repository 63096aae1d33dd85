"""Tests of `smp_tf.step_output.StepOutput`."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import inspect  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from smp_tf.split import split_arguments  # noqa: E402
from smp_tf.step_output import StepOutput  # noqa: E402

M = 3
RNG = np.random.default_rng(0)
VALUES = [RNG.standard_normal([4, 5]).astype(np.float32) for _ in range(M)]


def step_output(values=VALUES):
    return StepOutput([tf.constant(v) for v in values])


def slices(m, rows, dense_rows=10, width=3, index_dtype=tf.int64):
    values = tf.constant(RNG.standard_normal([len(rows), width]).astype(np.float32) + m)
    return tf.IndexedSlices(values, tf.constant(rows, index_dtype), tf.constant([dense_rows, width], tf.int64))


# -- container ----------------------------------------------------------------
def test_container_protocol_and_repr():
    so = step_output()
    assert len(so) == M
    assert [o.numpy().tolist() for o in so] == [v.tolist() for v in VALUES]
    assert so[1].numpy().tolist() == VALUES[1].tolist()
    outputs = so.outputs
    outputs.append(None)  # a copy: the StepOutput is unchanged
    assert len(so.outputs) == M
    assert repr(so) == "StepOutput(microbatches=3, dtype=float32, shape=(4, 5))"


def test_is_a_leaf_for_tf_nest():
    so = step_output()
    assert tf.nest.flatten([so, (so,)]) == [so, so]


@pytest.mark.parametrize("outputs", [[], (), "abc", tf.constant([1.0]), None])
def test_invalid_outputs(outputs):
    with pytest.raises(ValueError, match=r"StepOutput expects"):
        StepOutput(outputs)


# -- values vs numpy ------------------------------------------------------------
def test_reduce_mean():
    got = step_output().reduce_mean()
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got, np.mean(VALUES, axis=0), rtol=1e-6)


def test_reduce_mean_keeps_half_precision():
    so = StepOutput([tf.constant(1.0, tf.float16), tf.constant(2.0, tf.float16)])
    got = so.reduce_mean()
    assert got.dtype == tf.float16 and float(got) == 1.5


def test_reduce_mean_of_integers_is_true_division():
    got = StepOutput([tf.constant(1), tf.constant(2)]).reduce_mean()
    assert got.dtype == tf.float64 and float(got) == 1.5


def test_reduce_mean_of_python_numbers():
    assert float(StepOutput([1.0, 2.0, 6.0]).reduce_mean()) == 3.0


def test_reduce_sum():
    got = step_output().reduce_sum()
    np.testing.assert_allclose(got, np.sum(VALUES, axis=0), rtol=1e-6)
    assert int(StepOutput([tf.constant(2), tf.constant(3)]).reduce_sum()) == 5


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_is_in_microbatch_order(axis):
    np.testing.assert_array_equal(step_output().concat(axis), np.concatenate(VALUES, axis=axis))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack(axis):
    np.testing.assert_array_equal(step_output().stack(axis), np.stack(VALUES, axis=axis))


def test_stack_scalars():
    np.testing.assert_array_equal(StepOutput([tf.constant(1.0), tf.constant(2.0)]).stack(), [1.0, 2.0])


@pytest.mark.parametrize("axis", [0, 1])
def test_merge_restores_the_original_row_order(axis):
    x = tf.reshape(tf.range(6 * 9), [6, 9])
    parts = split_arguments(inspect.signature(lambda x: None), (x,), {}, M, input_split_axes={"x": axis})
    so = StepOutput([args[0] for args, _ in parts])
    np.testing.assert_array_equal(so.merge(axis), x)
    # concat is not the original order (the split is strided).
    assert not np.array_equal(so.concat(axis), x)


# -- accumulate --------------------------------------------------------------------
def test_accumulate_dense_equals_reduce_mean():
    so = step_output()
    np.testing.assert_allclose(so.accumulate(), so.reduce_mean(), rtol=1e-6)
    assert so.accumulate().dtype == tf.float32


def test_accumulate_single_microbatch():
    so = StepOutput([tf.constant(VALUES[0])])
    np.testing.assert_array_equal(so.accumulate(), VALUES[0])


def test_accumulate_indexed_slices_stays_sparse():
    parts = [slices(0, [0, 3]), slices(1, [3, 9, 1]), slices(2, [0])]
    so = StepOutput(parts)
    got = so.accumulate()
    assert isinstance(got, tf.IndexedSlices)
    assert got.indices.numpy().tolist() == [0, 3, 3, 9, 1, 0]
    np.testing.assert_array_equal(got.dense_shape, [10, 3])
    np.testing.assert_allclose(tf.convert_to_tensor(got), so.reduce_mean(), rtol=1e-6)
    np.testing.assert_allclose(
        so.reduce_mean(), sum(tf.convert_to_tensor(p).numpy() for p in parts) / len(parts), rtol=1e-6
    )


def test_accumulate_indexed_slices_with_mixed_index_dtypes():
    so = StepOutput([slices(0, [1], index_dtype=tf.int32), slices(1, [2])])
    got = so.accumulate()
    assert got.indices.dtype == tf.int64
    np.testing.assert_allclose(tf.convert_to_tensor(got), so.reduce_mean(), rtol=1e-6)


def test_accumulate_mixed_sparse_and_dense_is_dense():
    so = StepOutput([slices(0, [1, 2]), tf.ones([10, 3])])
    got = so.accumulate()
    assert isinstance(got, tf.Tensor)
    np.testing.assert_allclose(got, so.reduce_mean(), rtol=1e-6)


def test_accumulate_none():
    assert StepOutput([None, None]).accumulate() is None


def test_accumulate_some_none():
    with pytest.raises(ValueError, match=r"accumulate\(\) cannot combine None values \(micro-batches \[1\]"):
        StepOutput([tf.ones([2]), None]).accumulate()


# -- errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["reduce_mean", "reduce_sum", "concat", "stack", "merge"])
def test_none_values(method):
    with pytest.raises(ValueError, match=rf"StepOutput.{method}\(\) cannot combine None values"):
        getattr(StepOutput([None, None]), method)()


@pytest.mark.parametrize("method", ["reduce_mean", "reduce_sum", "accumulate"])
@pytest.mark.parametrize("values", [[True, False], [b"a", b"b"]])
def test_non_numeric(method, values):
    so = StepOutput([tf.constant(v) for v in values])
    with pytest.raises(ValueError, match=rf"{method}\(\) needs numeric values.*dtype (bool|string)"):
        getattr(so, method)()


def test_mixed_dtypes():
    with pytest.raises(ValueError, match=r"same dtype.*\['float32', 'float64'\]"):
        StepOutput([tf.constant(1.0), tf.constant(1.0, tf.float64)]).reduce_mean()


def test_concat_scalars():
    with pytest.raises(ValueError, match=r"cannot concatenate 0-d"):
        StepOutput([tf.constant(1.0), tf.constant(2.0)]).concat()


# -- inside tf.function ------------------------------------------------------------------
def test_inside_tf_function():
    @tf.function(autograph=False)
    def combine(a, b, c, s0, s1):
        so = StepOutput([a, b, c])
        sparse = StepOutput(
            [tf.IndexedSlices(s0, tf.constant([0, 2]), tf.constant([4, 3])), tf.IndexedSlices(s1, tf.constant([1]), tf.constant([4, 3]))]
        )
        acc = sparse.accumulate()
        return {
            "mean": so.reduce_mean(),
            "sum": so.reduce_sum(),
            "concat": so.concat(1),
            "stack": so.stack(),
            "merge": so.merge(),
            "accumulate": so.accumulate(),
            "sparse_accumulate": tf.convert_to_tensor(acc),
            "sparse_mean": sparse.reduce_mean(),
        }

    s0 = RNG.standard_normal([2, 3]).astype(np.float32)
    s1 = RNG.standard_normal([1, 3]).astype(np.float32)
    got = combine(*VALUES, s0, s1)
    np.testing.assert_allclose(got["mean"], np.mean(VALUES, axis=0), rtol=1e-6)
    np.testing.assert_allclose(got["sum"], np.sum(VALUES, axis=0), rtol=1e-6)
    np.testing.assert_array_equal(got["concat"], np.concatenate(VALUES, axis=1))
    np.testing.assert_array_equal(got["stack"], np.stack(VALUES))
    merged = np.stack(VALUES, axis=1).reshape(12, 5)
    np.testing.assert_array_equal(got["merge"], merged)
    np.testing.assert_allclose(got["accumulate"], got["mean"], rtol=1e-6)
    np.testing.assert_allclose(got["sparse_accumulate"], got["sparse_mean"], rtol=1e-6)
    expected = np.zeros([4, 3], np.float32)
    expected[[0, 2]] += s0
    expected[[1]] += s1
    np.testing.assert_allclose(got["sparse_mean"], expected / 2, rtol=1e-6)


def test_means_in_one_graph_share_their_divisor_per_dtype_and_device():
    """Every mean divides by one constant per graph, dtype and device (not
    one per value), made outside the caller's control dependencies; the
    results are those of dividing each by its own constant."""
    half = [v.astype(np.float16) for v in VALUES]

    @tf.function(autograph=False)
    def means(a, b, c, h0, h1, h2):
        outs = []
        with tf.device("/device:CPU:0"):
            with tf.control_dependencies([tf.no_op(name="before")]):
                outs.append(StepOutput([a, b, c]).accumulate())
            outs.append(StepOutput([a * 2.0, b, c]).reduce_mean())
            outs.append(StepOutput([h0, h1, h2]).accumulate())
        outs.append(StepOutput([a, c, b]).accumulate())  # no device scope
        return outs

    concrete = means.get_concrete_function(*VALUES, *half)
    divisors = [op for op in concrete.graph.get_operations() if op.type in ("RealDiv", "Div")]
    assert len(divisors) == 4
    counts = {op.inputs[1].op for op in divisors}
    # float32 on CPU:0, float16 on CPU:0, float32 without a device.
    assert len(counts) == 3
    assert all(c.type == "Const" and not c.control_inputs for c in counts)

    @tf.function(autograph=False)
    def reference(a, b, c, h0, h1, h2):
        def mean(x, y, z):
            return (x + y + z) / tf.constant(3, dtype=x.dtype)

        return [mean(a, b, c), mean(a * 2.0, b, c), mean(h0, h1, h2), mean(a, c, b)]

    got = means(*VALUES, *half)
    for g, r in zip(got, reference(*VALUES, *half)):
        np.testing.assert_array_equal(g, r)


def test_inside_tf_function_with_dynamic_shapes():
    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float32)] * 3, autograph=False)
    def merge(a, b, c):
        return StepOutput([a, b, c]).merge()

    np.testing.assert_array_equal(merge(*VALUES), np.stack(VALUES, axis=1).reshape(12, 5))


# --------------------------------------------------------------------------
# Fused outputs (fuse_weight_gradients)
# --------------------------------------------------------------------------


def _fused_matmul(M=3, seed=0):
    from smp_tf.step_output import FusedOp

    rng = np.random.default_rng(seed)
    inputs = [(rng.normal(size=(5, 4)).astype("float32"), rng.normal(size=(5, 2)).astype("float32")) for _ in range(M)]
    per_mb = [x.T @ dy for x, dy in inputs]
    so = StepOutput._from_fused(FusedOp("MatMul"), [tuple(tf.constant(a) for a in i) for i in inputs])
    return so, per_mb


def test_fused_output_sums_with_one_op_and_materialises_per_microbatch():
    so, per_mb = _fused_matmul()
    assert len(so) == 3
    assert "fused MatMul" in repr(so)
    np.testing.assert_allclose(so.reduce_sum(), np.sum(per_mb, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(so.reduce_mean(), np.mean(per_mb, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(so.accumulate(), np.mean(per_mb, 0), rtol=1e-5, atol=1e-6)
    # Per-micro-batch access builds the values, once.
    for m in range(3):
        np.testing.assert_allclose(so[m], per_mb[m], rtol=1e-5, atol=1e-6)
    assert so.outputs[0] is so.outputs[0]
    np.testing.assert_allclose(so.stack(), np.stack(per_mb), rtol=1e-5, atol=1e-6)


def test_fused_bias_gradient_and_single_microbatch():
    from smp_tf.step_output import FusedOp

    rng = np.random.default_rng(1)
    dys = [rng.normal(size=(2, 3, 3, 4)).astype("float32") for _ in range(2)]
    so = StepOutput._from_fused(FusedOp("BiasAddGrad", "NHWC"), [(tf.constant(d),) for d in dys])
    np.testing.assert_allclose(so.accumulate(), np.mean([d.sum((0, 1, 2)) for d in dys], 0), rtol=1e-5, atol=1e-6)
    one, per_mb = _fused_matmul(M=1)
    np.testing.assert_allclose(one.accumulate(), per_mb[0], rtol=1e-5, atol=1e-6)


def test_fused_op_rejects_unknown_op_types():
    from smp_tf.step_output import FusedOp

    with pytest.raises(ValueError, match="'Conv2D'"):
        FusedOp("Conv2D").apply([tf.zeros((1, 1))])
