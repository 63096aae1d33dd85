"""Split ops that need more than a copy per device (`Decision.kind`).

Each writes, into the sharded graph, what one op computes when its input
is split in a way a plain copy per device cannot handle: a cross-entropy
or log-softmax over logits split by classes (the maximum and the sum of
exponentials reduced over the devices), a lookup along a split axis
(masked per device, then added). The ops are made with TensorFlow's Python
API in a scratch graph (`built`) and copied in.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Mapping, Tuple

import tensorflow as tf

from smp_tf.sharding.read import MARK, SHARD_ATTR
from smp_tf.sharding.spec import ShardSpec

__all__ = ["SPECIAL"]


def built(writer: Any, op: Any, inputs: Mapping[str, Tuple[str, Any, Any]], build: Any) -> Dict[str, str]:
    """Writes ops made with TensorFlow's Python API into the sharded graph.

    `build(placeholders, shard)` makes them in a scratch graph from
    placeholders standing for `inputs` (placeholder name -> (tensor of the
    sharded graph, dtype, shape)), calling ``shard(k)`` (a context) around
    the ops of device k; it returns name -> scratch tensor of the results.
    Their nodes are copied under ``<op>__smp_x/``, device k's marked for its
    device; returns name -> the result's name in the sharded graph."""
    scratch = tf.Graph()
    owner: Dict[str, int] = {}

    @contextlib.contextmanager
    def shard(k: int):
        before = {o.name for o in scratch.get_operations()}
        yield
        for o in scratch.get_operations():
            if o.name not in before:
                owner.setdefault(o.name, k)

    with scratch.as_default():
        placeholders = {}
        for name, (_, dtype, shape) in inputs.items():
            placeholders[name] = tf.compat.v1.placeholder(tf.as_dtype(dtype), shape=shape, name=name)
        results = build(placeholders, shard)
    prefix = f"{op.name}{MARK}_x/"
    mapping = {p.op.name: inputs[n][0] for n, p in placeholders.items()}
    for node in scratch.as_graph_def().node:
        if node.name in mapping:
            continue
        new = writer.out.node.add()
        new.CopyFrom(node)
        new.name = prefix + node.name
        del new.input[:]
        for x in node.input:
            control = x.startswith("^")
            name, colon, port = x.lstrip("^").partition(":")
            ref = mapping.get(name)
            if ref is None:
                ref = prefix + name + (colon + port if colon else "")
            elif colon and port != "0":
                raise ValueError(f"A placeholder has one output; received {x!r}.")
            new.input.append(("^" if control else "") + (ref.split(":")[0] if control else ref))
        k = owner.get(node.name, 0)
        if k:
            new.attr[SHARD_ATTR].i = k
    for o in scratch.get_operations():
        if o.name in mapping:
            continue
        for j, x in enumerate(o.outputs):
            if x.shape.rank is not None:
                writer.shapes[f"{prefix}{o.name}:{j}"] = tuple(x.shape.as_list())
    return {n: f"{prefix}{t.op.name}:{t.value_index}" for n, t in results.items()}


def _vocab_cross_entropy(writer: Any, op: Any, src: Any, dec: Any) -> None:
    """Megatron-LM's vocabulary-parallel cross-entropy (see the rule): the
    logits stay split by classes; the maxima, the sums of exponentials and
    the label's logit are reduced over the devices in device order."""
    t = writer.t
    feats, labels = [writer.canonical(x) for x in writer.data_inputs(src)[:2]]
    n, v = writer.shape_of[feats]
    local = v // t
    # SparseSoftmaxCrossEntropyWithLogits takes class ids (N,), whole;
    # SoftmaxCrossEntropyWithLogits label weights (N, V), split like the logits.
    dense = op.type == "SoftmaxCrossEntropyWithLogits"
    inputs = {f"f{k}": (writer.piece(feats, dec.inputs[0], k), writer.dtype_of(feats), (n, local))
              for k in range(t)}
    if dense:
        inputs.update({f"l{k}": (writer.piece(labels, dec.inputs[1], k), writer.dtype_of(labels), (n, local))
                       for k in range(t)})
    else:
        inputs["labels"] = (writer.piece(labels, dec.inputs[1], None), writer.dtype_of(labels), (n,))

    def build(ph, shard):
        f = [ph[f"f{k}"] for k in range(t)]
        if dense:
            return _dense_cross_entropy(f, [ph[f"l{k}"] for k in range(t)], shard)
        lab = ph["labels"]
        m, exps, total = _normaliser(f, shard)
        picked, hot = [], []
        for k in range(t):
            with shard(k):
                mine = tf.logical_and(lab >= k * local, lab < (k + 1) * local)
                index = tf.where(mine, lab - k * local, tf.zeros_like(lab))
                value = tf.gather(f[k], index[:, None], axis=1, batch_dims=1)[:, 0]
                picked.append(tf.where(mine, value, tf.zeros_like(value)))
                hot.append(tf.one_hot(index, local, dtype=f[k].dtype) * tf.cast(mine, f[k].dtype)[:, None])
        label_logit = picked[0]
        for k in range(1, t):
            label_logit = label_logit + picked[k]
        out = {"loss": tf.math.log(total[:, 0]) - (label_logit - m[:, 0])}
        for k in range(t):
            with shard(k):
                out[f"backprop{k}"] = exps[k] / total - hot[k]
        return out

    names = built(writer, op, inputs, build)
    writer.sharded[op.name] = True
    # The op's outputs under the names the writer gives a split op's:
    # output 0 (the loss, whole) under the op's own name, output 1 (the
    # gradient, split by classes) under each copy's.
    whole = writer.out.node.add()
    whole.name = op.name
    whole.op = "IdentityN"
    whole.input.extend([names["loss"], names["backprop0"]])
    whole.attr["T"].list.type.extend([src.attr["T"].type, src.attr["T"].type])
    for k in range(t):
        node = writer.out.node.add()
        node.name = f"{op.name}{MARK}_s{k}"
        node.op = "IdentityN"
        node.input.extend([names["loss"], names[f"backprop{k}"]])
        node.attr["T"].list.type.extend([src.attr["T"].type, src.attr["T"].type])
        if k:
            node.attr[SHARD_ATTR].i = k
        writer.shapes[f"{node.name}:1"] = (n, local)
        writer.shapes[f"{node.name}:0"] = (n,)
    writer.shapes[f"{op.name}:0"] = (n,)
    writer.shapes[f"{op.name}:1"] = (n, local)
    writer.physical[f"{op.name}:0"] = dec.outputs[0]
    writer.physical[f"{op.name}:1"] = dec.outputs[1]


def _normaliser(xs: List[tf.Tensor], shard: Any) -> Tuple[tf.Tensor, List[tf.Tensor], tf.Tensor]:
    """Over the last axis, split over the devices: the maximum (each
    device's, then theirs), each device's ``exp(x - max)``, and the sum of
    the exponentials (each device's, then added in device order); the
    maximum and the sum keep the axis (size 1)."""
    t = len(xs)
    maxima = []
    for k in range(t):
        with shard(k):
            maxima.append(tf.reduce_max(xs[k], axis=-1, keepdims=True))
    m = maxima[0]
    for k in range(1, t):
        m = tf.maximum(m, maxima[k])
    exps, sums = [], []
    for k in range(t):
        with shard(k):
            exps.append(tf.exp(xs[k] - m))
            sums.append(tf.reduce_sum(exps[k], axis=-1, keepdims=True))
    total = sums[0]
    for k in range(1, t):
        total = total + sums[k]
    return m, exps, total


def _dense_cross_entropy(f: List[tf.Tensor], labels: List[tf.Tensor], shard: Any) -> Dict[str, tf.Tensor]:
    """The vocabulary-parallel loss of label weights split like the logits:
    per device sum(labels * (log(total) - (logits - max))), added over the
    devices; the gradient softmax - labels stays split."""
    t = len(f)
    m, exps, total = _normaliser(f, shard)
    log_total = tf.math.log(total)
    out: Dict[str, tf.Tensor] = {}
    losses = []
    for k in range(t):
        with shard(k):
            losses.append(tf.reduce_sum(labels[k] * (log_total - (f[k] - m)), axis=1))
            out[f"backprop{k}"] = exps[k] / total - labels[k]
    loss = losses[0]
    for k in range(1, t):
        loss = loss + losses[k]
    out["loss"] = loss
    return out


def _split_log_softmax(writer: Any, op: Any, src: Any, dec: Any) -> None:
    """Log-softmax over a split last axis: (x - max) - log(sum(exp(x - max))),
    the maximum and the sum reduced over the devices in device order."""
    t = writer.t
    x = writer.canonical(writer.data_inputs(src)[0])
    shape = writer.shape_of[x]
    local = writer.local_shape(shape, dec.inputs[0])
    inputs = {f"x{k}": (writer.piece(x, dec.inputs[0], k), writer.dtype_of(x), local) for k in range(t)}

    def build(ph, shard):
        xs = [ph[f"x{k}"] for k in range(t)]
        m, _, total = _normaliser(xs, shard)
        log_total = tf.math.log(total)
        out = {}
        for k in range(t):
            with shard(k):
                out[f"y{k}"] = (xs[k] - m) - log_total
        return out

    names = built(writer, op, inputs, build)
    _name_copies(writer, op, src, [names[f"y{k}"] for k in range(t)], dec.outputs[0], local)


def _masked_gather(writer: Any, op: Any, src: Any, dec: Any) -> None:
    """Each device looks up the indices that fall in its piece of the
    gathered axis and zeroes the rest: a partial sum with one addend not
    zero per element (its all-reduce is exact)."""
    t = writer.t
    data = [writer.canonical(x) for x in writer.data_inputs(src)]
    params, indices = data[0], data[1]
    pshape, ishape = writer.shape_of[params], writer.shape_of[indices]
    axis = int(writer.plan_info[op.name].const_inputs[2]) % len(pshape)
    batch_dims = int(src.attr["batch_dims"].i) if "batch_dims" in src.attr else 0
    local = writer.local_shape(pshape, dec.inputs[0])
    size = local[axis]
    inputs = {f"p{k}": (writer.piece(params, dec.inputs[0], k), writer.dtype_of(params), local) for k in range(t)}
    inputs["i"] = (writer.piece(indices, dec.inputs[1], None), writer.dtype_of(indices), ishape)
    trailing = len(pshape) - axis - 1
    out_shape = writer.shape_of[f"{op.name}:0"]

    def build(ph, shard):
        out = {}
        for k in range(t):
            with shard(k):
                ids = ph["i"]
                mine = tf.logical_and(ids >= k * size, ids < (k + 1) * size)
                index = tf.where(mine, ids - k * size, tf.zeros_like(ids))
                value = tf.gather(ph[f"p{k}"], index, axis=axis, batch_dims=batch_dims)
                mask = tf.reshape(mine, tf.concat([tf.shape(mine), tf.ones([trailing], tf.int32)], 0))
                out[f"y{k}"] = tf.where(mask, value, tf.zeros_like(value))
        return out

    names = built(writer, op, inputs, build)
    _name_copies(writer, op, src, [names[f"y{k}"] for k in range(t)], dec.outputs[0], out_shape)


def _name_copies(writer: Any, op: Any, src: Any, pieces: List[str], spec: ShardSpec, shape: Any) -> None:
    """Names device k's result of a one-output op ``<op>__smp_s<k>``, as the
    writer names a split op's copies, so that its readers find it."""
    writer.sharded[op.name] = True
    dtype = src.attr["T"].type if "T" in src.attr else src.attr["Tparams"].type
    for k, piece in enumerate(pieces):
        node = writer.out.node.add()
        node.name = f"{op.name}{MARK}_s{k}"
        node.op = "Identity"
        node.input.append(piece)
        node.attr["T"].type = dtype
        if k:
            node.attr[SHARD_ATTR].i = k
        writer.shapes[f"{node.name}:0"] = tuple(shape) if shape is not None else None
    writer.physical[f"{op.name}:0"] = spec


#: Decision kind -> its lowering ``(writer, op, node, decision)``.
SPECIAL = {
    "vocab_cross_entropy": _vocab_cross_entropy,
    "split_log_softmax": _split_log_softmax,
    "masked_gather": _masked_gather,
}


