"""Tests of `smp_tf.split`: the strided micro-batch split and its inverse."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collections  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from smp_tf.split import merge_microbatches, microbatch_indices, split_arguments  # noqa: E402

Pair = collections.namedtuple("Pair", ["a", "b"])


def sig(fn):
    return inspect.signature(fn)


def step_xy(x, y):
    pass


def step_x(x):
    pass


def x_of(parts, m):
    """The first positional argument of micro-batch m."""
    return parts[m][0][0]


def arange(*shape, dtype=tf.int32):
    # From numpy: some TensorFlow releases have no float16 `Range` kernel on CPU.
    return tf.constant(np.arange(int(np.prod(shape))).reshape(shape), dtype=dtype)


# -- strided order -------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_strided_order(M):
    x = arange(12, 2)
    parts = split_arguments(sig(step_x), (x,), {}, M)
    assert len(parts) == M
    if M == 1:
        assert x_of(parts, 0) is x  # an unsplit batch is passed as is
    for m in range(M):
        np.testing.assert_array_equal(x_of(parts, m), x.numpy()[m::M])
        np.testing.assert_array_equal(x_of(parts, m), x.numpy()[microbatch_indices(12, M, m)])
        assert isinstance(x_of(parts, m), tf.Tensor)
        assert parts[m][1] == {}


@pytest.mark.parametrize("M", [2, 3, 4])
def test_microbatch_indices(M):
    rows = [microbatch_indices(12, M, m) for m in range(M)]
    np.testing.assert_array_equal(rows[1], np.arange(1, 12, M))
    assert sorted(np.concatenate(rows).tolist()) == list(range(12))
    assert rows[0].dtype == np.int64


def test_microbatch_indices_errors():
    with pytest.raises(ValueError, match=r"Batch size 10 .* not divisible by microbatches=3"):
        microbatch_indices(10, 3, 0)
    with pytest.raises(ValueError, match=r"less than num_microbatches=2.*microbatch=2"):
        microbatch_indices(4, 2, 2)
    with pytest.raises(ValueError, match=r"num_microbatches=True"):
        microbatch_indices(4, True, 0)
    with pytest.raises(ValueError, match=r"batch_size=-4"):
        microbatch_indices(-4, 2, 0)


def test_numpy_stays_numpy():
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    parts = split_arguments(sig(step_x), (x,), {}, 3)
    for m in range(3):
        assert isinstance(x_of(parts, m), np.ndarray)
        np.testing.assert_array_equal(x_of(parts, m), x[m::3])


def test_float_tensor_keeps_dtype_and_static_shape():
    x = arange(8, 3, 5, dtype=tf.float16)
    part = x_of(split_arguments(sig(step_x), (x,), {}, 4), 1)
    assert part.dtype == tf.float16 and part.shape == (2, 3, 5)


# -- structures ------------------------------------------------------------------
def test_nested_structures():
    x = {"a": arange(4, 2), "b": [np.arange(4), (arange(4), "label")]}
    parts = split_arguments(sig(step_x), (x,), {}, 2)
    for m in range(2):
        got = x_of(parts, m)
        assert set(got) == {"a", "b"} and isinstance(got["b"], list) and isinstance(got["b"][1], tuple)
        np.testing.assert_array_equal(got["a"], x["a"].numpy()[m::2])
        assert isinstance(got["b"][0], np.ndarray)
        np.testing.assert_array_equal(got["b"][0], np.arange(4)[m::2])
        np.testing.assert_array_equal(got["b"][1][0], np.arange(4)[m::2])
        assert got["b"][1][1] == "label"


def test_dict_key_order_is_kept():
    x = {"z": arange(2), "a": arange(2)}
    assert list(x_of(split_arguments(sig(step_x), (x,), {}, 2), 0)) == ["z", "a"]


def test_namedtuple():
    x = Pair(arange(6), np.arange(6) * 10)
    parts = split_arguments(sig(step_x), (x,), {}, 3)
    for m in range(3):
        got = x_of(parts, m)
        assert type(got) is Pair
        np.testing.assert_array_equal(got.a, np.arange(6)[m::3])
        np.testing.assert_array_equal(got.b, (np.arange(6) * 10)[m::3])


class Sliceable:
    def __init__(self):
        self.calls = []

    def smp_slice(self, num_mb, mb, axis):
        self.calls.append((num_mb, mb, axis))
        return f"slice {mb} of {num_mb} on axis {axis}"


def test_smp_slice_object():
    obj = Sliceable()
    parts = split_arguments(sig(step_xy), (arange(4), obj), {}, 2, input_split_axes={"y": 1})
    assert obj.calls == [(2, 0, 1), (2, 1, 1)]
    assert [p[0][1] for p in parts] == ["slice 0 of 2 on axis 1", "slice 1 of 2 on axis 1"]


def test_smp_slice_object_inside_a_structure():
    obj = Sliceable()
    parts = split_arguments(sig(step_x), ([obj, arange(4)],), {}, 2)
    assert obj.calls == [(2, 0, 0), (2, 1, 0)]
    assert x_of(parts, 1)[0] == "slice 1 of 2 on axis 0"


def test_pass_through_values():
    def step(x, n, s, nothing, obj, scalar, npscalar, flag=True):
        pass

    obj = object()
    scalar = tf.constant(3.0)
    npscalar = np.float32(2.0)
    parts = split_arguments(sig(step), (arange(4), 5, "text", None, obj, scalar, npscalar), {}, 2)
    for args, kwargs in parts:
        assert args[1:5] == (5, "text", None, obj)
        assert args[5] is scalar and args[6] is npscalar
        assert args[7] is True  # default applied
        assert kwargs == {}


def test_zero_d_numpy_array_passes_through():
    a = np.array(7)
    parts = split_arguments(sig(step_x), (a,), {}, 2)
    assert x_of(parts, 0) is a and x_of(parts, 1) is a


def test_variables_pass_through():
    import keras

    tv = tf.Variable(tf.zeros([4, 2]))
    kv = keras.Variable(np.zeros([4, 2], np.float32))
    parts = split_arguments(sig(step_xy), (tv, kv), {}, 2)
    for args, _ in parts:
        assert args[0] is tv and args[1] is kv


def test_sparse_tensor():
    dense = np.arange(24).reshape(6, 4) * (np.arange(24).reshape(6, 4) % 3 == 0)
    sp = tf.sparse.from_dense(dense)
    for axis in (0, 1):
        M = 2 if axis == 1 else 3
        parts = split_arguments(sig(step_x), (sp,), {}, M, input_split_axes={"x": axis})
        for m in range(M):
            got = x_of(parts, m)
            assert isinstance(got, tf.SparseTensor)
            expected = dense[m::M] if axis == 0 else dense[:, m::M]
            np.testing.assert_array_equal(tf.sparse.to_dense(got), expected)


def test_ragged_tensor():
    rt = tf.ragged.constant([[1], [2, 3], [4], [5, 6, 7]])
    parts = split_arguments(sig(step_x), (rt,), {}, 2)
    assert x_of(parts, 1).to_list() == [[2, 3], [5, 6, 7]]
    with pytest.raises(ValueError, match=r"tf.RaggedTensor, which is only split along axis 0"):
        split_arguments(sig(step_x), (rt,), {}, 2, input_split_axes={"x": 1})


# -- options ----------------------------------------------------------------------
def test_non_split_inputs():
    x, y = arange(4), arange(4)
    parts = split_arguments(sig(step_xy), (x, y), {}, 2, non_split_inputs=["y"])
    for m, (args, _) in enumerate(parts):
        np.testing.assert_array_equal(args[0], x.numpy()[m::2])
        assert args[1] is y


def test_input_split_axes():
    x, y = arange(2, 6), arange(6)
    parts = split_arguments(sig(step_xy), (x, y), {}, 3, input_split_axes={"x": 1})
    for m, (args, _) in enumerate(parts):
        np.testing.assert_array_equal(args[0], x.numpy()[:, m::3])
        np.testing.assert_array_equal(args[1], y.numpy()[m::3])


def test_negative_axis():
    x = arange(3, 4)
    parts = split_arguments(sig(step_x), (x,), {}, 2, input_split_axes={"x": -1})
    np.testing.assert_array_equal(x_of(parts, 1), x.numpy()[:, 1::2])


def test_keyword_arguments_and_keyword_only_parameters():
    def step(x, *, y, z=None):
        pass

    parts = split_arguments(sig(step), (), {"x": arange(4), "y": np.arange(4)}, 2)
    for m, (args, kwargs) in enumerate(parts):
        np.testing.assert_array_equal(args[0], np.arange(4)[m::2])
        assert set(kwargs) == {"y", "z"} and kwargs["z"] is None
        np.testing.assert_array_equal(kwargs["y"], np.arange(4)[m::2])


def test_var_positional_and_var_keyword():
    def step(x, *rest, **extra):
        pass

    parts = split_arguments(
        sig(step),
        (arange(4), arange(2, 4), "s"),
        {"mask": arange(4), "const": arange(4), "cols": arange(2, 4)},
        2,
        non_split_inputs=["const"],
        input_split_axes={"rest": 1, "cols": 1},
    )
    for m, (args, kwargs) in enumerate(parts):
        assert len(args) == 3
        np.testing.assert_array_equal(args[0], np.arange(4)[m::2])
        np.testing.assert_array_equal(args[1], np.arange(8).reshape(2, 4)[:, m::2])  # *rest on axis 1
        assert args[2] == "s"
        assert list(kwargs) == ["mask", "const", "cols"]
        np.testing.assert_array_equal(kwargs["mask"], np.arange(4)[m::2])
        np.testing.assert_array_equal(kwargs["const"], np.arange(4))
        np.testing.assert_array_equal(kwargs["cols"], np.arange(8).reshape(2, 4)[:, m::2])


def test_whole_var_keyword_parameter_can_be_non_split():
    def step(x, **extra):
        pass

    a = arange(4)
    parts = split_arguments(sig(step), (arange(4),), {"a": a}, 2, non_split_inputs=["extra"])
    assert parts[1][1]["a"] is a


def test_var_keyword_names_may_be_absent_from_a_call():
    def step(x, **extra):
        pass

    parts = split_arguments(sig(step), (arange(4),), {}, 2, non_split_inputs=["mask"])
    assert parts[0][1] == {}


# -- errors -----------------------------------------------------------------------
def test_indivisible_batch():
    with pytest.raises(ValueError) as info:
        split_arguments(sig(step_xy), (arange(12), arange(10)), {}, 3)
    msg = str(info.value)
    assert "Batch size 10 of argument 'y' (axis 0) is not divisible by microbatches=3" in msg
    assert "multiple of 3" in msg


def test_indivisible_batch_numpy_and_axis():
    with pytest.raises(ValueError, match=r"Batch size 5 of argument 'x' \(axis 1\) is not divisible by microbatches=2"):
        split_arguments(sig(step_x), (np.zeros([4, 5]),), {}, 2, input_split_axes={"x": 1})


def test_indivisible_batch_in_var_positional():
    def step(*xs):
        pass

    with pytest.raises(ValueError, match=re.escape("Batch size 3 of argument 'xs[1]'")):
        split_arguments(sig(step), (arange(4), arange(3)), {}, 2)


def test_axis_out_of_range():
    with pytest.raises(ValueError, match=r"Split axis 2 is out of range .* rank 2"):
        split_arguments(sig(step_x), (arange(4, 2),), {}, 2, input_split_axes={"x": 2})


@pytest.mark.parametrize("axis", [True, 1.0, "1"])
def test_axis_must_be_int(axis):
    with pytest.raises(ValueError, match=rf"must be an integer.*axis={re.escape(repr(axis))}"):
        split_arguments(sig(step_x), (arange(4, 2),), {}, 2, input_split_axes={"x": axis})


@pytest.mark.parametrize("label", ["non_split_inputs", "input_split_axes"])
def test_unknown_names(label):
    option = ["z"] if label == "non_split_inputs" else {"z": 0}
    with pytest.raises(ValueError) as info:
        split_arguments(sig(step_xy), (arange(4), arange(4)), {}, 2, **{label: option})
    msg = str(info.value)
    assert f"`{label}` names 'z'" in msg and "Valid parameter names: 'x', 'y'" in msg


def test_non_split_inputs_as_a_string():
    with pytest.raises(ValueError, match=r"not a single string.*\['y'\]"):
        split_arguments(sig(step_xy), (arange(4), arange(4)), {}, 2, non_split_inputs="y")


def test_name_in_both_options():
    with pytest.raises(ValueError, match=r"'y' cannot be both"):
        split_arguments(sig(step_xy), (arange(4), arange(4)), {}, 2, non_split_inputs=["y"], input_split_axes={"y": 0})


@pytest.mark.parametrize("M", [0, -1, True, 2.0])
def test_bad_num_microbatches(M):
    with pytest.raises(ValueError, match=rf"num_microbatches={re.escape(repr(M))}"):
        split_arguments(sig(step_x), (arange(4),), {}, M)


def test_arguments_not_matching_signature():
    with pytest.raises(TypeError, match=r"do not match the step function\(x, y\)"):
        split_arguments(sig(step_xy), (arange(4),), {}, 2)


# -- graph mode and dynamic shapes ------------------------------------------------------
@pytest.mark.parametrize("M", [2, 4])
def test_dynamic_batch_in_tf_function(M):
    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)], autograph=False)
    def split_and_merge(x):
        parts = split_arguments(sig(step_x), (x,), {}, M)
        xs = [x_of(parts, m) for m in range(M)]
        assert xs[0].shape.as_list() == [None, 3]
        merged = merge_microbatches(xs)
        assert merged.shape.as_list() == [None, 3]
        return xs, merged

    x = arange(8, 3, dtype=tf.float32)
    xs, merged = split_and_merge(x)
    for m in range(M):
        np.testing.assert_array_equal(xs[m], x.numpy()[m::M])
    np.testing.assert_array_equal(merged, x)


def test_dynamic_batch_indivisible_raises_at_run_time():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)], autograph=False)
    def split(x):
        parts = split_arguments(sig(step_x), (x,), {}, 3)
        return [x_of(parts, m) for m in range(3)]

    assert len(split(tf.zeros([6]))) == 3
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"argument `x` \(axis 0\) is not divisible by microbatches=3.*Batch size:\] \[7\]"):
        split(tf.zeros([7]))


def test_unknown_rank_in_tf_function():
    @tf.function(input_signature=[tf.TensorSpec(None, tf.int32)], autograph=False)
    def split(x):
        parts = split_arguments(sig(step_x), (x,), {}, 2, input_split_axes={"x": -1})
        return x_of(parts, 1)

    np.testing.assert_array_equal(split(arange(3, 4)), arange(3, 4).numpy()[:, 1::2])


# -- merge ------------------------------------------------------------------------------
@pytest.mark.parametrize("M,axis", [(1, 0), (2, 0), (3, 0), (4, 1), (2, -1)])
def test_round_trip_eager(M, axis):
    x = arange(12, 8, 2)
    parts = split_arguments(sig(step_x), (x,), {}, M, input_split_axes={"x": axis})
    merged = merge_microbatches([x_of(parts, m) for m in range(M)], axis=axis)
    np.testing.assert_array_equal(merged, x)
    assert merged.shape == x.shape


def test_round_trip_in_tf_function_with_dynamic_inner_axis():
    @tf.function(input_signature=[tf.TensorSpec([2, None, 3], tf.int32)], autograph=False)
    def round_trip(x):
        parts = split_arguments(sig(step_x), (x,), {}, 2, input_split_axes={"x": 1})
        return merge_microbatches([x_of(parts, m) for m in range(2)], axis=1)

    x = arange(2, 6, 3)
    np.testing.assert_array_equal(round_trip(x), x)


def test_merge_row_order():
    parts = [tf.constant([0, 2, 4]), tf.constant([1, 3, 5])]
    np.testing.assert_array_equal(merge_microbatches(parts), [0, 1, 2, 3, 4, 5])


def test_merge_errors():
    with pytest.raises(ValueError, match=r"non-empty list"):
        merge_microbatches([])
    with pytest.raises(ValueError, match=r"0-d"):
        merge_microbatches([tf.constant(1.0), tf.constant(2.0)])
    with pytest.raises(ValueError, match=r"Split axis 2 is out of range"):
        merge_microbatches([arange(2, 2), arange(2, 2)], axis=2)
