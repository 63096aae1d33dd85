"""Splitting the arguments of an `smp.step` function into micro-batches.

The split is *strided*, as in the SageMaker model parallel library: with
``M`` micro-batches, micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``
of every split argument along its split axis (axis 0 unless
``input_split_axes`` says otherwise). `merge_microbatches` is the inverse and
`microbatch_indices` names the rows of one micro-batch.

What is split, per value (nested lists, tuples, dicts and namedtuples are
split element-wise, keeping their structure):

* `tf.Tensor`: strided slice along the axis (works in eager mode and inside
  `tf.function`, also when the batch size is only known at run time).
* `np.ndarray`: strided numpy slice; the micro-batches stay numpy arrays
  (views of the input, no copy).
* `tf.SparseTensor` and `tf.RaggedTensor` (the latter along axis 0 only).
* Any object with a method ``smp_slice(num_microbatches, microbatch, axis)``:
  the method is called once per micro-batch and returns that micro-batch.
* Passed unchanged to every micro-batch: variables (`tf.Variable`, Keras
  variables), which are model state rather than data, so every micro-batch
  must see (and update) the same variable; 0-d tensors and arrays and numpy
  scalars, which have no axis to split; and anything else (Python numbers,
  strings, None, other objects).
"""

from __future__ import annotations

import inspect
import numbers
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["split_arguments", "check_split_sizes", "microbatch_indices", "merge_microbatches"]


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _check_num_microbatches(num_microbatches: Any) -> int:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, numbers.Integral):
        raise ValueError(
            "The number of micro-batches must be a positive integer. "
            f"Received: num_microbatches={num_microbatches!r} "
            f"(of type {type(num_microbatches).__name__})"
        )
    if num_microbatches < 1:
        raise ValueError(
            "The number of micro-batches must be at least 1. "
            f"Received: num_microbatches={num_microbatches!r}"
        )
    return int(num_microbatches)


def _check_axis(axis: Any, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise ValueError(
            f"The split axis of {what} must be an integer. "
            f"Received: axis={axis!r} (of type {type(axis).__name__})"
        )
    return int(axis)


def _normalize_axis(axis: int, rank: Optional[int], what: str, shape: Any) -> int:
    """Maps a possibly negative `axis` into [0, rank); rank None keeps it."""
    if rank is None:
        return axis
    if not -rank <= axis < rank:
        raise ValueError(
            f"Split axis {axis} is out of range for {what} of rank {rank} "
            f"(shape {shape}). Use an axis in [{-rank}, {rank}), for example "
            f"via `input_split_axes`."
        )
    return axis % rank


def _indivisible_message(size: Optional[int], what: str, axis: int, num_microbatches: int) -> str:
    # `size` is None for a size only known at run time (printed by the check).
    size_text = "The batch size" if size is None else f"Batch size {size}"
    return (
        f"{size_text} of {what} (axis {axis}) is not divisible by "
        f"microbatches={num_microbatches}. Use a batch size that is a multiple "
        f"of {num_microbatches} (e.g. `dataset.batch(..., drop_remainder=True)` "
        f"with such a size), change `microbatches` in the smp config, or list "
        f"the argument in `non_split_inputs` if it should not be split."
    )


def _check_static_size(size: Optional[int], what: str, axis: int, num_microbatches: int) -> None:
    if size is not None and size % num_microbatches != 0:
        raise ValueError(_indivisible_message(size, what, axis, num_microbatches))


def _dynamic_size_check(size: tf.Tensor, what: str, axis: int, num_microbatches: int) -> tf.Operation:
    """A run-time check that `size` (a scalar tensor) is divisible by M."""
    # `tf.debugging.Assert` (rather than `assert_equal`) so that the error
    # shows the offending size itself, not just the remainder.
    divisible = tf.equal(tf.math.floormod(size, tf.cast(num_microbatches, size.dtype)), 0)
    return tf.debugging.Assert(
        divisible,
        # TensorFlow prints string data with its quotes escaped, so name
        # the argument with backticks instead.
        [_indivisible_message(None, what.replace("'", "`"), axis, num_microbatches), "Batch size:", size],
    )


def _axis_slices(axis: int, sl: slice) -> tuple:
    """An index tuple that applies `sl` along `axis` and keeps other axes.

    A negative axis is counted from the end with an Ellipsis, which works
    even when the rank is unknown (graph mode).
    """
    if axis >= 0:
        return (slice(None),) * axis + (sl,)
    return (Ellipsis, sl) + (slice(None),) * (-axis - 1)


# --------------------------------------------------------------------------
# splitting one value into M parts
# --------------------------------------------------------------------------
def _is_variable(value: Any) -> bool:
    if isinstance(value, tf.Variable):
        return True
    # Keras 3 variables are not `tf.Variable`s; only look if Keras is loaded
    # (importing it here just for the check would be slow).
    keras = sys.modules.get("keras")
    variable_cls = getattr(keras, "Variable", None) if keras is not None else None
    return variable_cls is not None and isinstance(value, variable_cls)


def _split_tensor(t: tf.Tensor, m_count: int, axis: int, what: str, uneven: bool = False) -> List[tf.Tensor]:
    rank = t.shape.rank
    if rank == 0:
        return [t] * m_count  # a scalar has no batch axis
    axis = _normalize_axis(axis, rank, what, t.shape)
    size = t.shape[axis] if rank is not None else None
    if m_count == 1:
        return [t]  # no ops for an unsplit batch (axis still validated)
    if uneven and (size is None or size % m_count):
        # Micro-batch m takes rows m, m+M, ...: sizes differ by at most one.
        return [t[_axis_slices(axis, slice(m, None, m_count))] for m in range(m_count)]
    _check_static_size(size, what, axis, m_count)
    if size is None:
        # Only in graph mode (eager tensors have fully known shapes).
        check = _dynamic_size_check(tf.shape(t, out_type=tf.int64)[axis], what, axis, m_count)
        with tf.control_dependencies([check]):
            t = tf.identity(t)
    if rank is not None:
        # Rows m, m+M, ... are column m of the [size/M, M] view of the axis:
        # one reshape and one unstack instead of M strided gathers.
        dims = t.shape.as_list()
        if all(d is not None for d in dims):
            new_shape = dims[:axis] + [size // m_count, m_count] + dims[axis + 1:]
        else:
            s = tf.shape(t)
            new_shape = tf.concat([s[:axis], [-1, m_count], s[axis + 1:]], 0)
        return tf.unstack(tf.reshape(t, new_shape), num=m_count, axis=axis + 1)
    return [t[_axis_slices(axis, slice(m, None, m_count))] for m in range(m_count)]


def _split_numpy(a: np.ndarray, m_count: int, axis: int, what: str, uneven: bool = False) -> List[np.ndarray]:
    if a.ndim == 0:
        return [a] * m_count
    axis = _normalize_axis(axis, a.ndim, what, a.shape)
    if m_count == 1:
        return [a]
    if not uneven:
        _check_static_size(a.shape[axis], what, axis, m_count)
    return [a[_axis_slices(axis, slice(m, None, m_count))] for m in range(m_count)]


def _split_sparse(sp: tf.SparseTensor, m_count: int, axis: int, what: str) -> List[tf.SparseTensor]:
    rank = sp.shape.rank
    if rank is None:
        raise ValueError(
            f"Cannot split {what}: it is a tf.SparseTensor of unknown rank. "
            "Give it a known rank (e.g. with an `input_signature`) or list it "
            "in `non_split_inputs`."
        )
    axis = _normalize_axis(axis, rank, what, sp.shape)
    size = sp.shape[axis]
    _check_static_size(size, what, axis, m_count)
    dense_shape = sp.dense_shape
    if size is None:
        check = _dynamic_size_check(dense_shape[axis], what, axis, m_count)
        with tf.control_dependencies([check]):
            dense_shape = tf.identity(dense_shape)
    # Row r along the axis goes to micro-batch r % M, where it becomes row
    # r // M: divide that index column (and the dense shape) by M.
    divisor = np.ones([rank], np.int64)
    divisor[axis] = m_count
    static = sp.shape.as_list()
    if static[axis] is not None:
        static[axis] //= m_count
    if None not in static:
        new_shape = tf.constant(static, tf.int64)  # keeps the static shape
    else:
        new_shape = dense_shape // divisor
    coord = sp.indices[:, axis]
    parts = []
    for m in range(m_count):
        kept = tf.sparse.retain(sp, tf.equal(coord % m_count, m))
        part = tf.SparseTensor(kept.indices // divisor, kept.values, new_shape)
        part.set_shape(static)  # the shape arithmetic loses the known dims
        parts.append(part)
    return parts


def _split_ragged(rt: tf.RaggedTensor, m_count: int, axis: int, what: str) -> List[tf.RaggedTensor]:
    if _normalize_axis(axis, rt.shape.rank, what, rt.shape) != 0:
        raise ValueError(
            f"Cannot split {what} along axis {axis}: it is a tf.RaggedTensor, "
            "which is only split along axis 0. Set its axis to 0 in "
            "`input_split_axes` or list it in `non_split_inputs`."
        )
    size = rt.shape[0]
    _check_static_size(size, what, 0, m_count)
    if size is None:
        check = _dynamic_size_check(rt.nrows(out_type=tf.int64), what, 0, m_count)
        with tf.control_dependencies([check]):
            rt = tf.identity(rt)
    return [rt[m::m_count] for m in range(m_count)]


def _split_leaf(value: Any, m_count: int, axis: int, what: str, uneven: bool = False) -> List[Any]:
    """Splits one non-nested value into `m_count` micro-batches."""
    if _is_variable(value):
        return [value] * m_count
    if isinstance(value, tf.SparseTensor):
        return _split_sparse(value, m_count, axis, what)
    if isinstance(value, tf.RaggedTensor):
        return _split_ragged(value, m_count, axis, what)
    if isinstance(value, tf.Tensor):
        return _split_tensor(value, m_count, axis, what, uneven)
    if isinstance(value, np.ndarray):
        return _split_numpy(value, m_count, axis, what, uneven)
    if callable(getattr(value, "smp_slice", None)):
        return [value.smp_slice(m_count, m, axis) for m in range(m_count)]
    return [value] * m_count


def _split_value(value: Any, m_count: int, axis: int, what: str, uneven: bool = False) -> List[Any]:
    """Splits a possibly nested value into `m_count` micro-batches."""
    # An object that knows how to slice itself wins even if it is also a
    # list/tuple/dict that tf.nest would descend into.
    if callable(getattr(value, "smp_slice", None)) or not tf.nest.is_nested(value):
        return _split_leaf(value, m_count, axis, what, uneven)
    leaves = tf.nest.flatten(value)
    split_leaves = [_split_leaf(leaf, m_count, axis, what, uneven) for leaf in leaves]
    return [
        tf.nest.pack_sequence_as(value, [parts[m] for parts in split_leaves])
        for m in range(m_count)
    ]


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
# The public functions build ops with plain Python control flow over Python
# values; AutoGraph must not rewrite them when called from a tf.function.
@tf.autograph.experimental.do_not_convert
def split_arguments(
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    num_microbatches: int,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Optional[Mapping[str, int]] = None,
    uneven: bool = False,
) -> List[Tuple[tuple, Dict[str, Any]]]:
    """Splits the arguments of a call into `num_microbatches` micro-batches.

    The arguments are bound to `signature` (defaults applied); then every
    parameter value is split as described in the module doc, strided along
    its split axis: micro-batch ``m`` gets rows ``m, m + M, m + 2M, ...``.

    Args:
        signature: the signature of the step function.
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call.
        num_microbatches: the number of micro-batches ``M`` (>= 1).
        non_split_inputs: names of parameters passed unchanged to every
            micro-batch. The name of a ``*args`` or ``**kwargs`` parameter
            covers all its values; keys of ``**kwargs`` may also be named. If
            the function has a ``**kwargs`` parameter, names that are not
            parameters are taken as keys of it that this call may omit.
        input_split_axes: parameter (or ``**kwargs`` key) name to split axis;
            axis 0 for parameters not listed. Negative axes count from the end.
        uneven: allow tensor and array sizes that are not multiples of
            `num_microbatches`: the micro-batches then differ in size by at
            most one row (the first ones are larger). The caller makes sure
            that no micro-batch is empty.

    Returns:
        A list of ``M`` ``(args, kwargs)`` pairs, one per micro-batch, to call
        the function with. Positional parameters (and ``*args``) stay
        positional; keyword-only parameters and ``**kwargs`` entries are in
        the kwargs dict.

    Raises:
        TypeError: `args`/`kwargs` do not match `signature`.
        ValueError: `num_microbatches` is not a positive integer; a name in
            `non_split_inputs`/`input_split_axes` is not a parameter (or
            appears in both); an axis is not an integer or out of range; or
            the size of a split argument along its axis is not divisible by
            `num_microbatches`.
        tf.errors.InvalidArgumentError: (at run time, inside `tf.function`)
            a batch size only known at run time is not divisible.
    """
    m_count = _check_num_microbatches(num_microbatches)
    if isinstance(non_split_inputs, str):
        raise ValueError(
            "`non_split_inputs` must be a list of parameter names, not a single "
            f"string. Received: non_split_inputs={non_split_inputs!r}; use "
            f"[{non_split_inputs!r}] instead."
        )
    non_split = list(non_split_inputs or ())
    if input_split_axes is None:
        split_axes: Dict[str, Any] = {}
    elif isinstance(input_split_axes, Mapping):
        split_axes = dict(input_split_axes)
    else:
        raise ValueError(
            "`input_split_axes` must be a dict from parameter name to axis. "
            f"Received: input_split_axes={input_split_axes!r}"
        )
    split_axes = {
        name: _check_axis(axis, f"argument {name!r} in `input_split_axes`")
        for name, axis in split_axes.items()
    }

    params = signature.parameters
    var_kw = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    var_pos = next((p.name for p in params.values() if p.kind is p.VAR_POSITIONAL), None)
    for label, names in (("non_split_inputs", non_split), ("input_split_axes", list(split_axes))):
        unknown = [n for n in names if n not in params]
        if unknown and var_kw is None:
            raise ValueError(
                f"`{label}` names {', '.join(repr(n) for n in unknown)}, which "
                f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} "
                f"of the step function{signature}. Valid parameter names: "
                f"{', '.join(repr(n) for n in params)}."
            )
    both = sorted(set(non_split) & set(split_axes))
    if both:
        raise ValueError(
            f"{', '.join(repr(n) for n in both)} cannot be both in "
            "`non_split_inputs` (not split) and in `input_split_axes` (split "
            "along an axis); remove it from one of them."
        )

    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"The arguments do not match the step function{signature}: {e}"
        ) from None
    bound.apply_defaults()

    per_param: Dict[str, List[Any]] = {}
    for name, value in bound.arguments.items():
        if name in non_split:
            per_param[name] = [value] * m_count
        elif name == var_pos:
            axis = split_axes.get(name, 0)
            items = [
                _split_value(v, m_count, axis, f"argument '{name}[{i}]'", uneven)
                for i, v in enumerate(value)
            ]
            per_param[name] = [tuple(parts[m] for parts in items) for m in range(m_count)]
        elif name == var_kw:
            default_axis = split_axes.get(name, 0)
            items = {}
            for key, v in value.items():
                if key in non_split:
                    items[key] = [v] * m_count
                else:
                    axis = split_axes.get(key, default_axis)
                    items[key] = _split_value(v, m_count, axis, f"argument {key!r}", uneven)
            per_param[name] = [{k: parts[m] for k, parts in items.items()} for m in range(m_count)]
        else:
            per_param[name] = _split_value(value, m_count, split_axes.get(name, 0), f"argument {name!r}", uneven)

    result = []
    for m in range(m_count):
        arguments = {name: parts[m] for name, parts in per_param.items()}
        mb = inspect.BoundArguments(signature, arguments)
        result.append((tuple(mb.args), dict(mb.kwargs)))
    return result


def _check_value_sizes(value: Any, m_count: int, axis: int, what: str) -> None:
    if callable(getattr(value, "smp_slice", None)):
        return
    for leaf in tf.nest.flatten(value) if tf.nest.is_nested(value) else [value]:
        if _is_variable(leaf) or not isinstance(leaf, (tf.Tensor, np.ndarray)):
            continue
        shape = tuple(leaf.shape)
        if len(shape) == 0:
            continue
        a = _normalize_axis(axis, len(shape), what, shape)
        _check_static_size(shape[a], what, a, m_count)


def check_split_sizes(
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    num_microbatches: int,
    non_split_inputs: Sequence[str] = (),
    input_split_axes: Optional[Mapping[str, int]] = None,
) -> None:
    """Checks, without splitting, that concrete arguments can be split.

    For eager values, whose sizes are known, before they enter a graph
    where the size may be unknown (an ``input_signature`` with ``None``
    dimensions) and a bad size would only fail at run time.

    Raises:
        ValueError: as `split_arguments` for a size not divisible by
            `num_microbatches`.
        TypeError: `args`/`kwargs` do not match `signature`.
    """
    m_count = _check_num_microbatches(num_microbatches)
    if m_count == 1:
        return
    non_split = set(non_split_inputs or ())
    axes = dict(input_split_axes or {})
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"The arguments do not match the step function{signature}: {e}") from None
    bound.apply_defaults()
    params = signature.parameters
    for name, value in bound.arguments.items():
        if name in non_split:
            continue
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            for i, v in enumerate(value):
                _check_value_sizes(v, m_count, axes.get(name, 0), f"argument '{name}[{i}]'")
        elif kind is inspect.Parameter.VAR_KEYWORD:
            for key, v in value.items():
                if key not in non_split:
                    _check_value_sizes(v, m_count, axes.get(key, axes.get(name, 0)), f"argument {key!r}")
        else:
            _check_value_sizes(value, m_count, axes.get(name, 0), f"argument {name!r}")


def microbatch_indices(batch_size: int, num_microbatches: int, microbatch: int) -> np.ndarray:
    """Returns the rows of the batch that form one micro-batch.

    Args:
        batch_size: the size of the batch along the split axis.
        num_microbatches: the number of micro-batches ``M``.
        microbatch: the micro-batch index ``m`` in ``[0, M)``.

    Returns:
        An int64 array ``[m, m + M, m + 2M, ...]`` of ``batch_size // M``
        row indices.

    Raises:
        ValueError: an argument is not an integer or out of range, or
            `batch_size` is not divisible by `num_microbatches`.
    """
    m_count = _check_num_microbatches(num_microbatches)
    for name, value in (("batch_size", batch_size), ("microbatch", microbatch)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative integer. Received: {name}={value!r}")
    if microbatch >= m_count:
        raise ValueError(
            f"`microbatch` must be less than num_microbatches={m_count}. "
            f"Received: microbatch={microbatch!r}"
        )
    _check_static_size(int(batch_size), "the batch", 0, m_count)
    return np.arange(int(microbatch), int(batch_size), m_count, dtype=np.int64)


@tf.autograph.experimental.do_not_convert
def _merge_uneven(tensors: List[tf.Tensor], axis: int) -> tf.Tensor:
    """Merges parts whose sizes may differ (by at most one, as an uneven
    strided split makes them): row ``i * M + m`` comes from row ``i`` of part ``m``."""
    m_count = len(tensors)
    if axis != 0:
        perm = [axis] + [d for d in range(tensors[0].shape.rank) if d != axis]
        inverse = [perm.index(d) for d in range(len(perm))]
        return tf.transpose(_merge_uneven([tf.transpose(t, perm) for t in tensors], 0), inverse)
    sizes = [tf.shape(t, out_type=tf.int32)[0] for t in tensors]
    total = tf.add_n(sizes)
    indices = [tf.range(m, total, m_count) for m in range(m_count)]
    return tf.dynamic_stitch(indices, tensors)


def merge_microbatches(parts: Sequence[Any], axis: int = 0) -> tf.Tensor:
    """Merges micro-batches back into one batch in the original row order.

    The inverse of the strided split: row ``i * M + m`` of the result is row
    ``i`` of ``parts[m]``. Works with dynamic shapes inside `tf.function`,
    and with parts whose sizes differ by one (an uneven split).

    Args:
        parts: the ``M`` per-micro-batch tensors (or values convertible to
            tensors) of one dtype; their sizes along `axis` are equal or,
            after an uneven split, decrease by at most one.
        axis: the axis that was split; negative axes count from the end.

    Returns:
        The merged tensor, ``M`` times larger along `axis`.

    Raises:
        ValueError: `parts` is empty, the axis is not an integer or out of
            range, or the parts are 0-d.
    """
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or len(parts) == 0:
        raise ValueError(
            "`merge_microbatches` expects a non-empty list of per-micro-batch "
            f"tensors. Received: parts={parts!r}"
        )
    axis = _check_axis(axis, "`merge_microbatches`")
    tensors = [tf.convert_to_tensor(p) for p in parts]
    m_count = len(tensors)
    rank = tensors[0].shape.rank
    if rank == 0:
        raise ValueError(
            "Cannot merge 0-d (scalar) micro-batch values along an axis; use "
            f"tf.stack instead. Received: parts with shape {tensors[0].shape}"
        )
    axis = _normalize_axis(axis, rank, "the micro-batch values", tensors[0].shape)
    if axis < 0:
        raise ValueError(
            "`merge_microbatches` needs a non-negative axis when the rank of the "
            f"parts is unknown. Received: axis={axis}"
        )
    if m_count == 1:
        return tensors[0]
    # Sizes unknown or unequal: an uneven split (or one that may be). With an
    # unknown rank the parts are merged as equal-sized ones.
    sizes = [t.shape[axis] for t in tensors] if rank is not None else []
    if None in sizes or len(set(sizes)) > 1:
        return _merge_uneven(tensors, axis)
    # [..., n, ...] x M  ->  [..., n, M, ...]  ->  [..., n * M, ...]: element
    # (i, m) lands at row i * M + m, which undoes the strided split.
    stacked = tf.stack(tensors, axis=axis + 1)
    static = stacked.shape
    if static.is_fully_defined():
        dims = static.as_list()
        return tf.reshape(stacked, dims[:axis] + [dims[axis] * m_count] + dims[axis + 2:])
    shape = tf.shape(stacked)
    new_shape = tf.concat([shape[:axis], [shape[axis] * m_count], shape[axis + 2:]], axis=0)
    merged = tf.reshape(stacked, new_shape)
    if static.rank is not None:
        dims = static.as_list()
        n = dims[axis] * m_count if dims[axis] is not None else None
        merged.set_shape(dims[:axis] + [n] + dims[axis + 2:])
    return merged
