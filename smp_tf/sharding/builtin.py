"""Built-in layouts: what to shard when no `layout_map` is given.

Megatron-LM's pattern, found on the traced graph rather than by layer
names, so that it covers any model built of dense products:

* **Pairs of products.** A product that reads a kernel (``MatMul``,
  ``Einsum``, or ``BatchMatMulV2`` with a 2-D kernel, on a variable),
  whose result reaches a second product that reads another kernel
  through element-wise ops only (bias, activation,
  a gate's multiplication), is column-parallel: its kernel is split along
  the output dimension, its bias with it. The second is row-parallel: its
  kernel is split along the contracted dimension and its result is a
  partial sum. So an MLP (up, activation, down) and a gated MLP (gate and
  up, product, down) run with one all-reduce in the forward.
* **Output layers.** The product that makes the logits of a sparse
  softmax cross-entropy is column-parallel (a tied embedding read
  transposed is split by vocabulary rows), and the loss is then computed
  vocabulary-parallel, without gathering the logits
  (`output_layer_layouts`).
* **Attention.** `keras.layers.MultiHeadAttention` (and keras_hub's
  subclasses) has its query, key and value projections split by head and
  its output projection by head along the contracted dimensions
  (`attention_layouts`).

A product no rule covers stays whole; the partition report lists what was
sharded. Plain Python over `ShardGraph` (the attention rule reads Keras
layers' variables).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from smp_tf.sharding.completion import READ_OPS, ShardGraph, ShardOp
from smp_tf.sharding.rules import BINARY, UNARY, parse_einsum
from smp_tf.sharding.spec import TENSOR, ShardSpec

__all__ = ["product_pairs", "pair_layouts", "output_layer_layouts", "attention_layouts"]

_PRODUCTS = frozenset(["MatMul", "Einsum", "BatchMatMulV2"])
# Reshapes keep a product's output dimension last (a dense layer on a 3-D
# input is reshape, product, reshape); only their data input joins the path.
_RESHAPES = frozenset(["Reshape", "ExpandDims", "Squeeze"])
# IdentityN: what `tf.custom_gradient` returns (Keras's silu, a gated MLP's
# activation), output i being input i.
_THROUGH = (UNARY | BINARY | _RESHAPES | frozenset(["BiasAdd", "IdentityN"])) - frozenset(["AddN"])


# A variable read reaches its product through casts under mixed precision
# (Keras reads a float32 kernel and casts it to the compute dtype).
_CASTS = frozenset(["Cast", "Identity"])
_GRADIENT_SCOPES = ("gradient_tape", "gradients")


def _kernel_dims(op: ShardOp, position: int) -> Optional[Tuple[List[int], List[int]]]:
    """The kernel's (output, contracted) dimensions of a product that reads
    its kernel at input `position`."""
    if op.type == "MatMul":
        if position != 1:
            return None
        tb = bool(op.info.attrs.get("transpose_b"))
        return ([0], [1]) if tb else ([1], [0])
    if op.type == "BatchMatMulV2":
        # An activation of any rank times a 2-D kernel, broadcast (Keras's
        # EinsumDense "btd,df->btf" on TensorFlow).
        shapes = op.info.input_shapes
        if position != 1 or shapes[1] is None or len(shapes[1]) != 2:
            return None
        return ([0], [1]) if op.info.attrs.get("adj_y") else ([1], [0])
    ranks = [len(s) if s is not None else -1 for s in op.info.input_shapes]
    parsed = parse_einsum(str(op.info.attrs.get("equation", "")), ranks) if min(ranks) >= 0 else None
    if parsed is None or len(parsed[0]) != 2:
        return None
    letters, out = parsed
    mine, other = letters[position], letters[1 - position]
    outs = [i for i, c in enumerate(mine) if c in out and c not in other]
    contracted = [i for i, c in enumerate(mine) if c not in out and c in other]
    return outs, contracted


class _Index:
    """What the built-in layouts look up on a graph, built once: each
    tensor's producer and readers, the tensors computed from the batch, and
    which products read a kernel."""

    def __init__(self, graph: ShardGraph) -> None:
        self.by_name = {op.name: op for op in graph.ops}
        self.producer = {x: op for op in graph.ops for x in op.outputs}
        self.readers: Dict[str, List[Tuple[ShardOp, int]]] = {}
        for op in graph.ops:
            for k, x in enumerate(op.inputs):
                self.readers.setdefault(x, []).append((op, k))
        # Tensors computed from the step's arguments: another activation (a
        # residual) stops a walk; a constant, a variable or a dropout mask
        # does not.
        self.from_batch: Set[str] = set()
        for op in graph.ops:
            if op.argument or any(x in self.from_batch for x in op.inputs):
                self.from_batch.update(op.outputs)

    def read_of(self, x: str) -> Optional[ShardOp]:
        """The variable read that tensor `x` is, through casts; None if it is not one."""
        p = self.producer.get(x)
        while p is not None and p.type in _CASTS and p.inputs:
            p = self.producer.get(p.inputs[0])
        return p if p is not None and p.type in READ_OPS and p.variable is not None else None

    def root(self, x: str) -> str:
        """The tensor `x` is a reshape of (itself if none): each dense layer
        on a sequence reshapes its input anew (``Tensordot``)."""
        p = self.producer.get(x)
        while p is not None and p.type in _RESHAPES and p.inputs:
            x = p.inputs[0]
            p = self.producer.get(x)
        return x

    def kernel_position(self, op: ShardOp) -> Optional[int]:
        """The input of a forward product that is a kernel, or None."""
        if op.type not in _PRODUCTS or len(op.inputs) != 2 or op.name.startswith(_GRADIENT_SCOPES):
            return None
        for k, x in enumerate(op.inputs):
            if self.read_of(x) is not None and _kernel_dims(op, k):
                return k
        return None


def _second_products(index: _Index, op: ShardOp, k: int) -> List[ShardOp]:
    """The products that read kernels and that the result of `op` (a
    product reading its kernel at input `k`) reaches through element-wise
    ops (see `product_pairs`)."""
    # Siblings read the same activation, maybe through reshapes of their own.
    activation = index.root(op.inputs[1 - k])
    views = [activation]
    for x in views:
        views.extend(y for r, _ in index.readers.get(x, ()) if r.type in _RESHAPES for y in r.outputs)
    siblings = [r for x in views for r, pos in index.readers.get(x, ()) if index.kernel_position(r) == 1 - pos]
    path: Set[str] = {x for s in siblings for x in s.outputs}
    stack = list(path)
    found: List[ShardOp] = []
    seen: Set[str] = set()
    while stack:
        x = stack.pop()
        for r, pos in index.readers.get(x, ()):
            if r.name in seen:
                continue
            kr = index.kernel_position(r)
            if kr is not None:
                if pos != kr and r not in siblings:
                    seen.add(r.name)
                    found.append(r)
                continue
            if r.type not in _THROUGH or r.name.startswith(_GRADIENT_SCOPES):
                continue
            data = r.inputs[:1] if r.type in _RESHAPES else r.inputs
            if not all(y in path or y not in index.from_batch for y in data):
                continue  # waits until its other inputs join the path, or never does
            seen.add(r.name)
            for y in r.outputs:
                if y not in path:
                    path.add(y)
                    stack.append(y)
    return found


def product_pairs(graph: ShardGraph, index: Optional[_Index] = None) -> List[Tuple[str, str]]:
    """(column-parallel product, row-parallel product) pairs, by op name
    (see the module doc), forward ops only, in graph order.

    From a product, the walk follows its result through element-wise ops
    whose other inputs do not depend on the batch (constants, variables,
    dropout masks) or are results of its sibling products (those reading
    the same activation: a gated MLP's gate and up projections). A residual
    addition reads another activation and stops it, so a pair never spans
    two blocks.
    """
    index = index or _Index(graph)
    pairs: List[Tuple[str, str]] = []
    for op in graph.ops:
        k = index.kernel_position(op)
        if k is not None:
            pairs.extend((op.name, second.name) for second in _second_products(index, op, k))
    return pairs


def _bias_of(index: _Index, product: ShardOp, kernel: ShardOp, size: int) -> Optional[ShardOp]:
    """The read of the bias added to `product`'s output (past the reshape
    back to 3-D of a dense layer on a sequence), of `size` elements."""
    outs = list(product.outputs)
    for x in list(outs):
        outs.extend(y for r, _ in index.readers.get(x, ()) if r.type in _RESHAPES for y in r.outputs)
    for x in outs:
        for r, _ in index.readers.get(x, ()):
            if r.type not in ("BiasAdd", "AddV2", "Add"):
                continue
            for y in r.inputs:
                p = index.read_of(y)
                shape = p.info.output_shapes[0] if p is not None else None
                if p is not None and p is not kernel and shape is not None and tuple(shape) == (size,):
                    return p
    return None


def pair_layouts(graph: ShardGraph, t: int, decided: Optional[Mapping[str, ShardSpec]] = None) -> Dict[str, ShardSpec]:
    """Variable -> layout for the product pairs of `graph` (module doc),
    with the layouts already `decided` (an output layer's) kept: a pair
    that would split one of their variables otherwise stays whole.

    A pair whose split dimension `t` does not divide stays whole."""
    index = _Index(graph)
    out: Dict[str, ShardSpec] = dict(decided or {})
    for first, second in product_pairs(graph, index):
        a, b = index.by_name[first], index.by_name[second]
        pa, pb = index.kernel_position(a), index.kernel_position(b)
        read_a, read_b = index.read_of(a.inputs[pa]), index.read_of(b.inputs[pb])
        dims_a, dims_b = _kernel_dims(a, pa), _kernel_dims(b, pb)
        shape_a, shape_b = read_a.info.output_shapes[0], read_b.info.output_shapes[0]
        if not dims_a[0] or not dims_b[1] or shape_a is None or shape_b is None:
            continue
        col, row = dims_a[0][0], dims_b[1][0]
        if shape_a[col] is None or shape_a[col] % t or shape_b[row] is None or shape_b[row] % t:
            continue
        spec_a, spec_b = ShardSpec.split(len(shape_a), col), ShardSpec.split(len(shape_b), row)
        if out.get(read_a.variable, spec_a) != spec_a or out.get(read_b.variable, spec_b) != spec_b:
            continue  # a kernel two pairs would split differently stays as first decided
        out[read_a.variable] = spec_a
        out[read_b.variable] = spec_b
        # The bias of the column-parallel product follows its output.
        bias = _bias_of(index, a, read_a, shape_a[col])
        if bias is not None:
            out[bias.variable] = ShardSpec.split(1, 0)
    return out


_TO_LOGITS = frozenset(["Reshape", "Identity", "Cast", "BiasAdd", "AddV2", "Add", "Snapshot"])
# The losses over logits: the fused cross-entropies, and the log-softmax
# that the sparse one becomes under TF_DETERMINISTIC_OPS (then a gather).
_LOSSES = frozenset(["SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits", "LogSoftmax"])


def output_layer_layouts(graph: ShardGraph, t: int) -> Dict[str, ShardSpec]:
    """Variable -> layout for the output layers of a classification or
    language-model loss: the product that makes the logits of a sparse
    softmax cross-entropy is column-parallel (split by classes; a tied
    embedding read transposed is split by vocabulary rows), its bias with
    it, so that the logits are never gathered (the loss is
    vocabulary-parallel, `rules.loss`)."""
    index = _Index(graph)
    out: Dict[str, ShardSpec] = {}
    for loss in graph.ops:
        if loss.type not in _LOSSES or not loss.inputs or loss.name.startswith(_GRADIENT_SCOPES):
            continue
        biases = []
        op = index.producer.get(loss.inputs[0])
        while op is not None and op.type in _TO_LOGITS and op.inputs:
            if op.type in ("BiasAdd", "AddV2", "Add") and len(op.inputs) == 2:
                biases.append(index.read_of(op.inputs[1]))
            op = index.producer.get(op.inputs[0])
        if op is None or op.type not in _PRODUCTS or len(op.inputs) != 2:
            continue
        for k, y in enumerate(op.inputs):
            read, perm = index.read_of(y), None
            moved = index.producer.get(y)
            if read is None and moved is not None and moved.type == "Transpose":
                perm = moved.info.const_inputs.get(1)
                read = index.read_of(moved.inputs[0])
            if read is None:
                continue
            dims = _kernel_dims(op, k)
            shape = read.info.output_shapes[0]
            if not dims or not dims[0] or shape is None:
                continue
            col = dims[0][0] if perm is None else int(perm[dims[0][0]])
            if shape[col] is None or shape[col] % t:
                continue
            out[read.variable] = ShardSpec.split(len(shape), col)
            for b in biases:
                if b is not None and tuple(b.info.output_shapes[0] or ()) == (shape[col],):
                    out[b.variable] = ShardSpec.split(1, 0)
            break
    return out


def attention_layouts(layers: Sequence[Any], t: int) -> Dict[str, ShardSpec]:
    """Variable path -> layout for the attention layers among `layers`:
    heads split over the devices.

    An attention layer is a `keras.layers.MultiHeadAttention` (and
    subclasses: keras_hub's GPT-2, BERT, ...) or a layer with the same four
    projections (``_query_dense``, ``_key_dense``, ``_value_dense``,
    ``_output_dense``, with or without the underscore: keras_hub's Llama,
    Gemma, Mistral, Qwen attention),
    its heads in ``num_heads`` or ``num_query_heads`` and, with grouped-query
    attention, its key and value heads in ``num_key_value_heads`` (each
    with or without a leading underscore: keras_hub's Mistral keeps them
    private). Both head
    counts must be divisible by ``t`` (each device then holds whole groups:
    query head ``q`` reads key head ``q // groups``, on the same device).
    """
    out: Dict[str, ShardSpec] = {}
    for layer in layers:
        projections = []
        for name in ("query_dense", "key_dense", "value_dense", "output_dense"):
            projections.append(getattr(layer, "_" + name, None) or getattr(layer, name, None))
        if any(p is None for p in projections):
            continue
        heads = _first_attr(layer, "num_heads", "_num_heads", "num_query_heads", "_num_query_heads")
        kv_heads = _first_attr(layer, "num_key_value_heads", "_num_key_value_heads") or heads
        if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % t or kv_heads % t:
            continue
        for sub, n in zip(projections[:3], (heads, kv_heads, kv_heads)):
            d = _head_dim_of_kernel(sub, output=True)
            for v in getattr(sub, "weights", ()):
                shape = tuple(v.shape)
                # Kernel (model, heads, head size) or (heads, model, head
                # size), as its equation says; bias (heads, head size).
                if len(shape) == 3 and d is not None and shape[d] == n:
                    out[v.path] = ShardSpec(tuple(TENSOR if i == d else None for i in range(3)))
                elif len(shape) == 2 and shape[0] == n:
                    out[v.path] = ShardSpec((TENSOR, None))
        d = _head_dim_of_kernel(projections[3], output=False)
        for v in getattr(projections[3], "weights", ()):
            shape = tuple(v.shape)
            if len(shape) == 3 and d is not None and shape[d] == heads:  # kernel (heads, head size, model)
                out[v.path] = ShardSpec(tuple(TENSOR if i == d else None for i in range(3)))
    return out


def _first_attr(obj: Any, *names: str) -> Any:
    """The first of `names` that `obj` has (and is not None)."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return None


def _head_dim_of_kernel(projection: Any, output: bool) -> Optional[int]:
    """The kernel dimension of an attention projection that holds the heads:
    the letter of its einsum equation that is second to last in its output
    (a query, key or value projection: ``...nh``) or in its input (the
    output projection). Without an equation: dimension 1 for a query, key
    or value kernel (``(model, heads, head size)``), 0 for the output one."""
    equation = getattr(projection, "equation", None)
    if not isinstance(equation, str) or "->" not in equation or "," not in equation:
        return 1 if output else 0
    lhs, result = equation.split("->")
    x, kernel = lhs.split(",")
    side = result if output else x
    if len(side) < 2 or side[-2] not in kernel:
        return None
    return kernel.index(side[-2])


def embedding_layouts(layers: Sequence[Any], t: int) -> Dict[str, ShardSpec]:
    """Variable path -> layout for the `keras.layers.Embedding` layers (and
    subclasses: keras_hub's token embeddings) among `layers`: the table
    split by vocabulary rows (its lookup is then masked per device, and the
    pieces added: exact). Tables whose vocabulary `t` does not divide stay
    whole."""
    import keras

    out: Dict[str, ShardSpec] = {}
    for layer in layers:
        if not isinstance(layer, keras.layers.Embedding):
            continue
        table = getattr(layer, "embeddings", None)
        shape = tuple(getattr(table, "shape", ()))
        if len(shape) == 2 and shape[0] % t == 0 and shape[0] >= t:
            out[table.path] = ShardSpec((TENSOR, None))
    return out
