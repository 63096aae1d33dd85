"""The sharding layer's pure logic, on plain data and hand-written graphs:
specs, layout maps, the per-op rules, completion, reshards and the built-in
layouts. No TensorFlow op runs here."""

import pytest

from smp_tf.sharding.builtin import output_layer_layouts, pair_layouts, product_pairs
from smp_tf.sharding.completion import ShardGraph, complete
from smp_tf.sharding.layout_map import LayoutMap, resolve_layout
from smp_tf.sharding.reshard import reshard_bytes, reshard_steps
from smp_tf.sharding.rules import OpInfo, parse_einsum, reshape_dim, rule_for
from smp_tf.sharding.spec import ShardSpec, check_divisible, parse_spec

R2, S0, S1, P2 = ShardSpec((None, None)), ShardSpec(("tensor", None)), ShardSpec((None, "tensor")), ShardSpec.partial_sum(2)


# ---------------------------------------------------------------- specs


def test_spec_forms():
    assert str(R2) == "R" and str(S0) == "S(0)" and str(S1) == "S(1)" and str(P2) == "P"
    assert ShardSpec.split(3, -1) == ShardSpec((None, None, "tensor"))
    assert R2.is_replicated and not S0.is_replicated and not P2.is_replicated


def test_spec_errors_name_the_value():
    with pytest.raises(ValueError, match="'data'"):
        parse_spec(("data", None))
    with pytest.raises(ValueError, match="At most one"):
        parse_spec(("tensor", "tensor"))
    with pytest.raises(ValueError, match="rank 3"):
        parse_spec((None, "tensor"), rank=3)
    with pytest.raises(ValueError, match="one entry per dimension"):
        parse_spec("tensor")
    with pytest.raises(ValueError, match=r"Variable 'up/kernel' of shape \(16, 30\).*dimension 1 has size 30, which 4"):
        check_divisible(S1, (16, 30), 4, "Variable 'up/kernel'")


# ----------------------------------------------------------- layout maps

SHAPES = {"dense/kernel": (16, 64), "dense/bias": (64,), "dense_1/kernel": (64, 16), "dense_1/bias": (16,)}


def test_layout_map_matches_whole_paths():
    # re.fullmatch: "dense/.*" does not reach dense_1's variables.
    lm = LayoutMap({"dense/kernel": (None, "tensor"), "dense/bias": ("tensor",), r"dense_1/kernel": ("tensor", None)})
    specs = resolve_layout(lm, SHAPES, 2)
    assert specs == {"dense/kernel": S1, "dense/bias": ShardSpec(("tensor",)), "dense_1/kernel": S0}


def test_layout_map_key_matching_nothing_lists_closest_paths():
    with pytest.raises(ValueError, match=r"'dense_2/kernel' matches no variable.*dense_1/kernel"):
        resolve_layout({"dense_2/kernel": (None, "tensor")}, SHAPES, 2)


def test_layout_map_two_keys_for_one_variable():
    with pytest.raises(ValueError, match="'dense/kernel' is matched by two layout_map keys"):
        resolve_layout({"dense/kernel": (None, "tensor"), "dense/.*": (None, "tensor")}, SHAPES, 2)


def test_layout_map_rank_and_divisibility():
    with pytest.raises(ValueError, match="has 1 entries but the tensor has rank 2"):
        resolve_layout({"dense/kernel": ("tensor",)}, SHAPES, 2)
    with pytest.raises(ValueError, match="dimension 0 has size 16, which 3 does not divide"):
        resolve_layout({"dense_1/bias": ("tensor",)}, SHAPES, 3)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        LayoutMap({"dense/[": (None,)})


# -------------------------------------------------------------- reshards


def test_reshard_table():
    assert reshard_steps(R2, S1) == ("split",)
    assert reshard_steps(S1, R2) == ("all_gather",)
    assert reshard_steps(P2, R2) == ("all_reduce",)
    assert reshard_steps(P2, S0) == ("reduce_scatter",)
    assert reshard_steps(S0, S1) == ("all_gather", "split")
    assert reshard_steps(S0, S0) == ()
    with pytest.raises(ValueError):
        reshard_steps(R2, P2)
    # A ring all-reduce receives 2 (t-1)/t of the tensor, an all-gather (t-1)/t.
    assert reshard_bytes(P2, R2, 1000, 4) == 1500.0
    assert reshard_bytes(S0, R2, 1000, 2) == 500.0
    assert reshard_bytes(R2, S0, 1000, 2) == 0.0


# ------------------------------------------------------------------ rules


def _decide(op_type, shapes, out, ins, attrs=None, const=None, t=2):
    info = OpInfo("op", op_type, attrs or {}, tuple(shapes), (out,), const or {}, t)
    return rule_for(op_type)(info, ins)


def test_matmul_column_and_row_parallel():
    # x (whole) @ W split by columns: the output is split by columns.
    d = _decide("MatMul", [(8, 16), (16, 64)], (8, 64), [R2, S1])
    assert d.inputs == (R2, S1) and d.outputs == (S1,)
    # h split by columns @ W split by rows: a partial sum.
    d = _decide("MatMul", [(8, 64), (64, 16)], (8, 16), [S1, S0])
    assert d.outputs == (P2,)
    # The weight gradient h^T @ dy keeps h's split on the kernel's rows.
    d = _decide("MatMul", [(8, 64), (8, 16)], (64, 16), [S1, R2], {"transpose_a": True})
    assert d.outputs == (S0,)
    # dx = dz @ W^T with both split on the contracted dimension: partial.
    d = _decide("MatMul", [(8, 64), (16, 64)], (8, 16), [S1, S1], {"transpose_b": True})
    assert d.outputs == (P2,)


def test_matmul_gathers_rather_than_splitting_a_whole_operand_on_a_contracted_dimension():
    # h split by columns @ W whole: W could be split for free, but the sum
    # over the split dimension would change its order; h is gathered instead.
    d = _decide("MatMul", [(8, 64), (64, 16)], (8, 16), [S1, R2])
    assert d.inputs == (R2, R2) and d.outputs == (R2,)


def test_matmul_partial_times_whole_stays_partial():
    d = _decide("MatMul", [(8, 16), (16, 4)], (8, 4), [P2, R2])
    assert d.inputs == (P2, R2) and d.outputs == (P2,)


def test_batch_matmul_by_heads():
    s4 = ShardSpec((None, "tensor", None, None))
    d = _decide("BatchMatMulV2", [(2, 4, 8, 16), (2, 4, 16, 8)], (2, 4, 8, 8), [s4, s4])
    assert d.outputs == (s4,)


def test_einsum_parse_and_heads():
    assert parse_einsum("abc,cde->abde", [3, 3]) == (["abc", "cde"], "abde")
    assert parse_einsum("...b,bc->...c", [3, 2]) == (["ABb", "bc"], "ABc")
    # keras' attention projection: x (b, s, d) @ kernel (d, heads, size).
    d = _decide("Einsum", [(2, 8, 16), (16, 4, 4)], (2, 8, 4, 4), [ShardSpec.replicated(3), ShardSpec((None, "tensor", None))],
                {"equation": "abc,cde->abde"})
    assert d.outputs == (ShardSpec((None, None, "tensor", None)),)


def test_elementwise_broadcast_and_partials():
    # A bias (64,) added to a column-split (8, 64): the bias is split too.
    d = _decide("AddV2", [(8, 64), (64,)], (8, 64), [S1, ShardSpec((None,))])
    assert d.inputs == (S1, ShardSpec(("tensor",))) and d.outputs == (S1,)
    # A broadcast dimension of size 1 stays whole.
    d = _decide("Mul", [(8, 64), (8, 1)], (8, 64), [S1, R2])
    assert d.inputs == (S1, R2)
    # Linear: a partial sum times a whole tensor stays partial; a ReLU needs the sum.
    assert _decide("Mul", [(8, 4), (8, 4)], (8, 4), [P2, R2]).outputs == (P2,)
    assert _decide("Relu", [(8, 4)], (8, 4), [P2]).inputs == (R2,)
    # P + R would add the whole tensor t times: the partial sum is reduced first.
    assert _decide("AddV2", [(8, 4), (8, 4)], (8, 4), [P2, R2]).inputs == (R2, R2)


def test_reductions():
    d = _decide("Sum", [(8, 64), (1,)], (8,), [S1, ShardSpec((None,))], const={1: [1]})
    assert d.outputs == (ShardSpec.partial_sum(1),)
    d = _decide("Sum", [(8, 64), (1,)], (64,), [S1, ShardSpec((None,))], const={1: [0]})
    assert d.outputs == (ShardSpec(("tensor",)),)
    d = _decide("Mean", [(8, 64), (1,)], (8, 1), [S1, ShardSpec((None,))], {"keep_dims": True}, const={1: [1]})
    assert d.inputs[0] == R2  # a mean over a split dimension needs it whole
    d = _decide("Mean", [(8, 64), (1,)], (1, 64), [S1, ShardSpec((None,))], {"keep_dims": True}, const={1: [0]})
    assert d.outputs == (S1,)


def test_softmax_needs_its_axis_whole():
    assert _decide("Softmax", [(8, 64)], (8, 64), [S1]).inputs == (R2,)
    assert _decide("Softmax", [(8, 64)], (8, 64), [S0]).outputs == (S0,)


def test_reshape_dimension_map():
    # Merging (4, 8) -> 32 keeps a split of the leading dimension, not of the second.
    assert reshape_dim((2, 4, 8), (2, 32), 1, 2) == 1
    assert reshape_dim((2, 4, 8), (2, 32), 2, 2) is None
    # Splitting 32 -> (4, 8) keeps it on the leading piece when t divides it.
    assert reshape_dim((2, 32), (2, 4, 8), 1, 2) == 1
    assert reshape_dim((2, 32), (2, 4, 8), 1, 8) is None
    assert reshape_dim((2, 1, 32), (2, 32), 2, 2) == 1  # size-1 dimensions belong to no group


def test_transpose_bias_add_grad_and_conv():
    s4 = ShardSpec((None, "tensor", None, None))
    d = _decide("Transpose", [(2, 4, 8, 16), (4,)], (2, 8, 4, 16), [s4, ShardSpec((None,))], const={1: [0, 2, 1, 3]})
    assert d.outputs == (ShardSpec((None, None, "tensor", None)),)
    assert _decide("BiasAddGrad", [(8, 64)], (64,), [S1]).outputs == (ShardSpec(("tensor",)),)
    assert _decide("BiasAddGrad", [(8, 64)], (64,), [S0]).outputs == (ShardSpec.partial_sum(1),)
    # Conv2D with its output channels split (filter split on its last dimension).
    r4 = ShardSpec.replicated(4)
    d = _decide("Conv2D", [(2, 8, 8, 3), (3, 3, 3, 16)], (2, 8, 8, 16), [r4, ShardSpec((None, None, None, "tensor"))])
    assert d.outputs == (ShardSpec((None, None, None, "tensor")),)


# ------------------------------------------------------------- completion


def _mlp(extra=(), t=2):
    return ShardGraph.from_spec([
        dict(name="x", type="Placeholder", shape=(8, 16), argument=True),
        dict(name="h1", type="Placeholder", shape=()),
        dict(name="w1", type="ReadVariableOp", inputs=["h1"], shape=(16, 64), variable="w1"),
        dict(name="hb", type="Placeholder", shape=()),
        dict(name="b1", type="ReadVariableOp", inputs=["hb"], shape=(64,), variable="b1"),
        dict(name="mm1", type="MatMul", inputs=["x", "w1"], shape=(8, 64)),
        dict(name="ba1", type="BiasAdd", inputs=["mm1", "b1"], shape=(8, 64)),
        dict(name="relu", type="Relu", inputs=["ba1"], shape=(8, 64)),
        dict(name="h2", type="Placeholder", shape=()),
        dict(name="w2", type="ReadVariableOp", inputs=["h2"], shape=(64, 16), variable="w2"),
        dict(name="mm2", type="MatMul", inputs=["relu", "w2"], shape=(8, 16)),
        *extra,
    ], outputs=["mm2"], t=t)


def test_completion_of_a_megatron_mlp():
    # Column-parallel up, row-parallel down: everything between is split,
    # and the only reshard is the all-reduce of the partial output.
    plan = complete(_mlp(), {"w1": S1, "b1": ShardSpec(("tensor",)), "w2": S0}, 2)
    assert [str(plan.specs[f"{n}:0"]) for n in ("mm1", "ba1", "relu", "mm2")] == ["S(1)", "S(1)", "S(1)", "P"]
    assert [(r.tensor, r.steps) for r in plan.reshards] == [("mm2:0", ("all_reduce",))]
    assert plan.whole_ops == []
    assert "w1" in plan.summary() and "all_reduce x1" in plan.summary()


def test_completion_from_an_activation_constraint():
    # No variable is sharded; smp.shard_tensor asks for relu's output split by
    # columns. The split moves back through relu and the bias addition to the
    # product, which splits its kernel (free) and computes only its columns.
    g = ShardGraph.from_spec([
        dict(name="x", type="Placeholder", shape=(8, 16), argument=True),
        dict(name="h1", type="Placeholder", shape=()),
        dict(name="w1", type="ReadVariableOp", inputs=["h1"], shape=(16, 64), variable="w1"),
        dict(name="mm1", type="MatMul", inputs=["x", "w1"], shape=(8, 64)),
        dict(name="exp", type="Exp", inputs=["mm1"], shape=(8, 64)),
        dict(name="c", type="Identity", inputs=["exp"], shape=(8, 64), constraint=(None, "tensor")),
        dict(name="out", type="Relu", inputs=["c"], shape=(8, 64)),
    ], outputs=["out"])
    plan = complete(g, {}, 2)
    assert str(plan.specs["exp:0"]) == "S(1)" and str(plan.specs["out:0"]) == "S(1)"
    assert plan.decisions["exp"].inputs == (S1,)
    # The product has no sharded input, so the split lands on its output.
    assert [(r.tensor, r.steps) for r in plan.reshards] == [("mm1:0", ("split",)), ("out:0", ("all_gather",))]


def test_completion_runs_ops_without_rules_whole():
    extra = [dict(name="odd", type="Cumsum", inputs=["relu"], shape=(8, 64))]
    plan = complete(_mlp(extra), {"w1": S1, "b1": ShardSpec(("tensor",)), "w2": S0}, 2)
    assert plan.whole_ops == [("odd", "Cumsum")]
    assert any(r.tensor == "relu:0" and r.steps == ("all_gather",) for r in plan.reshards)
    assert "Cumsum x1" in plan.summary()


def test_completion_reads_outputs_whole():
    plan = complete(_mlp(), {"w1": S1}, 2)
    # Without w2 split, the down product gathers its input and is whole; the
    # whole bias b1 is split (a local slice) for the column-split addition.
    assert str(plan.specs["mm2:0"]) == "R"
    assert [(r.tensor, r.steps) for r in plan.reshards] == [("b1:0", ("split",)), ("relu:0", ("all_gather",))]


def test_gradients_returned_in_pieces_are_not_gathered():
    # The step returns a split gradient in its pieces: no gather of it is
    # planned. A partial sum returned as a gradient is still added up, and
    # an output that is not a gradient is still gathered.
    from dataclasses import replace

    from smp_tf.sharding.completion import returned_in_pieces

    g = _mlp()
    g = replace(g, outputs=["mm1:0", "mm2:0", "relu:0"], gradient_outputs=frozenset({"mm1:0", "mm2:0"}))
    plan = complete(g, {"w1": S1, "b1": ShardSpec(("tensor",)), "w2": S0}, 2)
    assert [(r.tensor, r.steps) for r in plan.reshards] == [("mm2:0", ("all_reduce",)), ("relu:0", ("all_gather",))]
    assert returned_in_pieces(S1) and returned_in_pieces(S0)
    assert not returned_in_pieces(P2) and not returned_in_pieces(ShardSpec.replicated(2))


def _two_blocks(tokens=8, t=2):
    """Two Megatron MLP blocks with a bias, a residual addition and a
    norm-like chain between them (what sequence parallelism splits)."""
    def var(name, shape):
        return [dict(name=f"h_{name}", type="Placeholder", shape=()),
                dict(name=name, type="ReadVariableOp", inputs=[f"h_{name}"], shape=shape, variable=name)]
    return ShardGraph.from_spec([
        dict(name="x", type="Placeholder", shape=(tokens, 16), argument=True),
        *var("w1", (16, 64)), *var("w2", (64, 16)), *var("b2", (16,)), *var("w3", (16, 64)), *var("w4", (64, 16)),
        dict(name="mm1", type="MatMul", inputs=["x", "w1"], shape=(tokens, 64)),
        dict(name="relu", type="Relu", inputs=["mm1"], shape=(tokens, 64)),
        dict(name="mm2", type="MatMul", inputs=["relu", "w2"], shape=(tokens, 16)),
        dict(name="ba2", type="BiasAdd", inputs=["mm2", "b2"], shape=(tokens, 16)),
        dict(name="res", type="AddV2", inputs=["ba2", "x"], shape=(tokens, 16)),
        dict(name="mean", type="Mean", inputs=["res"], shape=(tokens, 1), attrs={"keep_dims": True},
             const={1: [-1]}),
        dict(name="centred", type="Sub", inputs=["res", "mean"], shape=(tokens, 16)),
        dict(name="norm", type="Mul", inputs=["centred", "centred"], shape=(tokens, 16)),
        dict(name="mm3", type="MatMul", inputs=["norm", "w3"], shape=(tokens, 64)),
        dict(name="relu3", type="Relu", inputs=["mm3"], shape=(tokens, 64)),
        dict(name="mm4", type="MatMul", inputs=["relu3", "w4"], shape=(tokens, 16)),
    ], outputs=["mm4"], t=t)


_PAIRS = {"w1": S1, "w2": S0, "w3": S1, "w4": S0}


def test_sequence_parallelism_splits_the_ops_between_the_regions_along_the_sequence():
    plain = complete(_two_blocks(), _PAIRS, 2)
    assert [str(plain.specs.get(f"{n}:0", "R")) for n in ("ba2", "res", "mean", "norm")] == ["R"] * 4
    assert sorted(s for r in plain.reshards for s in r.steps) == ["all_reduce", "all_reduce"]

    plan = complete(_two_blocks(), _PAIRS, 2, sequence_parallel=True)
    # Between the regions every op runs on its rows (tokens) of the sequence.
    assert [str(plan.specs[f"{n}:0"]) for n in ("ba2", "res", "mean", "centred", "norm")] == ["S(0)"] * 5
    steps = {r.tensor: r.steps for r in plan.reshards}
    # The row-parallel output is reduce-scattered instead of all-reduced,
    # the residual input sliced where it is, the next column-parallel
    # product's input all-gathered; the products keep their layouts.
    assert steps["mm2:0"] == ("reduce_scatter",)
    assert steps["x:0"] == ("split",)
    assert steps["norm:0"] == ("all_gather",)
    assert steps["mm4:0"] == ("all_reduce",)  # the step's output is read whole
    assert plan.decisions["mm3"].inputs == (R2, S1)
    assert str(plan.specs["mm3:0"]) == "S(1)" and plan.sequence_parallel
    assert plan.sequence_ops == ["ba2", "res", "mean", "centred", "norm"]
    assert "sequence parallel: 5 ops between the regions run on 1/2 of the sequence" in plan.summary()
    # The same volume moves: a reduce-scatter and an all-gather for an all-reduce.
    assert plan.reshard_bytes() == plain.reshard_bytes()


def test_sequence_parallelism_never_asks_a_partial_sum_of_pieces():
    # A linear op on the row-parallel output (an Identity) runs on sequence
    # pieces; the product after it makes a step output, so it is not moved
    # to pieces, and the layout it had (a partial sum in, a partial sum out)
    # cannot stand: it runs whole, its input gathered.
    g = ShardGraph.from_spec([
        dict(name="x", type="Placeholder", shape=(8, 16), argument=True),
        dict(name="h1", type="Placeholder", shape=()),
        dict(name="w1", type="ReadVariableOp", inputs=["h1"], shape=(16, 64), variable="w1"),
        dict(name="h2", type="Placeholder", shape=()),
        dict(name="w2", type="ReadVariableOp", inputs=["h2"], shape=(64, 16), variable="w2"),
        dict(name="h5", type="Placeholder", shape=()),
        dict(name="w5", type="ReadVariableOp", inputs=["h5"], shape=(16, 4), variable="w5"),
        dict(name="mm1", type="MatMul", inputs=["x", "w1"], shape=(8, 64)),
        dict(name="mm2", type="MatMul", inputs=["mm1", "w2"], shape=(8, 16)),
        dict(name="relu", type="Relu", inputs=["mm2"], shape=(8, 16)),
        dict(name="ident", type="Identity", inputs=["mm2"], shape=(8, 16)),
        dict(name="mm5", type="MatMul", inputs=["ident", "w5"], shape=(8, 4)),
    ], outputs=["relu", "mm5"])
    plan = complete(g, {"w1": S1, "w2": S0}, 2, sequence_parallel=True)
    assert str(plan.specs["ident:0"]) == "S(0)" and "mm5" not in plan.decisions  # it runs whole
    assert not any(r.dst.partial for r in plan.reshards)
    assert ("all_gather",) in [r.steps for r in plan.reshards if r.tensor == "ident:0"]


def test_sequence_parallelism_refuses_a_sequence_t_does_not_divide():
    from smp_tf.sharding.completion import SequenceLengthError, sequence_dim

    with pytest.raises(SequenceLengthError, match=r"mm2:0 of shape \(6, 16\).*tensor_parallel_degree=4.*size 6"):
        complete(_two_blocks(tokens=6, t=4), {"w1": S1, "w2": S0}, 4, sequence_parallel=True)
    assert complete(_two_blocks(tokens=6, t=4), {"w1": S1, "w2": S0}, 4).reshards  # fine without it
    # The sequence of (batch, sequence, features) is dimension 1; a tensor
    # whose leading dimension is not the batch is not an activation.
    assert sequence_dim((4, 128, 64), 4) == 1 and sequence_dim((32, 64), 32) == 0
    assert sequence_dim((64, 64), 4) is None and sequence_dim((4, 2, 8, 8), 4) is None


# ------------------------------------------------------- built-in layouts


def test_builtin_pairs_an_mlp():
    g = _mlp()
    assert product_pairs(g) == [("mm1", "mm2")]
    assert pair_layouts(g, 2) == {"w1": S1, "w2": S0, "b1": ShardSpec(("tensor",))}
    # A degree that does not divide the hidden width leaves the pair whole.
    assert pair_layouts(g, 3) == {}


def test_builtin_pairs_a_gated_mlp_and_stops_at_residuals():
    g = ShardGraph.from_spec([
        dict(name="x", type="Placeholder", shape=(8, 16), argument=True),
        *[dict(name=f"h{k}", type="Placeholder", shape=()) for k in range(4)],
        dict(name="wg", type="ReadVariableOp", inputs=["h0"], shape=(16, 64), variable="gate"),
        dict(name="wu", type="ReadVariableOp", inputs=["h1"], shape=(16, 64), variable="up"),
        dict(name="wd", type="ReadVariableOp", inputs=["h2"], shape=(64, 16), variable="down"),
        dict(name="wn", type="ReadVariableOp", inputs=["h3"], shape=(16, 16), variable="next"),
        dict(name="g", type="MatMul", inputs=["x", "wg"], shape=(8, 64)),
        dict(name="u", type="MatMul", inputs=["x", "wu"], shape=(8, 64)),
        dict(name="act", type="Sigmoid", inputs=["g"], shape=(8, 64)),
        dict(name="gu", type="Mul", inputs=["act", "u"], shape=(8, 64)),
        dict(name="d", type="MatMul", inputs=["gu", "wd"], shape=(8, 16)),
        dict(name="res", type="AddV2", inputs=["d", "x"], shape=(8, 16)),
        dict(name="n", type="MatMul", inputs=["res", "wn"], shape=(8, 16)),
    ])
    assert sorted(product_pairs(g)) == [("g", "d"), ("u", "d")]
    assert pair_layouts(g, 2) == {"gate": S1, "up": S1, "down": S0}


def test_cross_entropy_by_rows_or_vocabulary():
    r1 = ShardSpec((None,))
    d = _decide("SparseSoftmaxCrossEntropyWithLogits", [(8, 64), (8,)], (8,), [S1, r1])
    assert d.kind == "vocab_cross_entropy" and d.inputs == (S1, r1) and d.outputs == (r1, S1)
    d = _decide("SparseSoftmaxCrossEntropyWithLogits", [(8, 64), (8,)], (8,), [S0, r1])
    assert d.kind == "local" and d.inputs == (S0, ShardSpec(("tensor",)))
    # A partial sum of logits is reduced first (no rule for it).
    assert _decide("SparseSoftmaxCrossEntropyWithLogits", [(8, 64), (8,)], (8,), [P2, r1]) is None


def test_output_layer_of_a_loss_is_column_parallel_and_a_tied_embedding_split_by_rows():
    g = ShardGraph.from_spec([
        dict(name="h", type="Placeholder", shape=(8, 16), argument=True),
        dict(name="labels", type="Placeholder", shape=(8,), argument=True),
        dict(name="he", type="Placeholder", shape=()),
        dict(name="emb", type="ReadVariableOp", inputs=["he"], shape=(64, 16), variable="embeddings"),
        dict(name="embT", type="Transpose", inputs=["emb"], shape=(16, 64), const={1: [1, 0]}),
        dict(name="logits", type="MatMul", inputs=["h", "embT"], shape=(8, 64)),
        dict(name="loss", type="SparseSoftmaxCrossEntropyWithLogits", inputs=["logits", "labels"], shape=(8,)),
    ])
    assert output_layer_layouts(g, 2) == {"embeddings": S0}
    plan = complete(g, output_layer_layouts(g, 2), 2)
    assert str(plan.specs["logits:0"]) == "S(1)" and plan.decisions["loss"].kind == "vocab_cross_entropy"


def test_log_softmax_over_split_classes_and_masked_gather():
    # Split over the normalised axis, log-softmax reduces its maximum and sum
    # over the devices instead of gathering the logits.
    d = _decide("LogSoftmax", [(8, 64)], (8, 64), [S1])
    assert d.kind == "split_log_softmax" and d.outputs == (S1,)
    # A gather along the split axis (axis == batch_dims) is a masked lookup:
    # a partial sum with one addend not zero per element.
    r1, r2 = ShardSpec((None,)), ShardSpec((None, None))
    d = _decide("GatherV2", [(8, 64), (8, 1), ()], (8, 1), [S1, r2, ShardSpec(())], {"batch_dims": 1}, const={2: 1})
    assert d.kind == "masked_gather" and d.outputs == (P2,)
    # An embedding table split by rows, looked up by ids (axis 0).
    d = _decide("GatherV2", [(64, 16), (8,), ()], (8, 16), [S0, r1, ShardSpec(())], const={2: 0})
    assert d.kind == "masked_gather"
    # Split along another axis than the gathered one: no rule (run whole).
    assert _decide("GatherV2", [(64, 16), (8,), ()], (8, 16), [S1, r1, ShardSpec(())], const={2: 0}) is None


def test_identity_n_passes_every_layout_through():
    # tf.custom_gradient wraps its results in an IdentityN (Keras's silu).
    d = _decide("IdentityN", [(8, 64), (8, 64)], (8, 64), [S1, P2])
    assert d.inputs == (S1, P2) and d.outputs == (S1, P2)


def _decide_many(op_type, shapes, outs, ins, attrs=None, const=None, t=2):
    info = OpInfo("op", op_type, attrs or {}, tuple(shapes), tuple(outs), const or {}, t)
    return rule_for(op_type)(info, ins)


def test_splits_and_concatenations_along_a_whole_dimension_keep_the_split():
    # A rotary embedding on split heads [batch, seq, heads, size]: the head
    # size is split in halves, negated, stacked and concatenated.
    heads = ShardSpec.split(4, 2)
    whole = ShardSpec.replicated(4)
    d = _decide_many("Split", [(), (2, 8, 4, 8)], [(2, 8, 4, 4)] * 2, [ShardSpec.replicated(0), heads],
                     const={0: -1})
    assert d.outputs == (heads, heads)
    # Along the split dimension itself: no rule (gathered, runs whole).
    assert _decide_many("Split", [(), (2, 8, 4, 8)], [(2, 8, 2, 8)] * 2, [ShardSpec.replicated(0), heads],
                        const={0: 2}) is None
    d = _decide_many("SplitV", [(2, 8, 4, 8), (2,), ()], [(2, 8, 4, 4)] * 2,
                     [heads, ShardSpec.replicated(1), ShardSpec.replicated(0)], const={2: 3})
    assert d.outputs == (heads, heads)
    # A concatenation splits a whole value the way the others are split.
    d = _decide("ConcatV2", [(2, 8, 4, 4), (2, 8, 4, 4), ()], (2, 8, 4, 8), [heads, whole, ShardSpec.replicated(0)],
                const={2: -1})
    assert d.inputs[:2] == (heads, heads) and d.outputs == (heads,)
    assert _decide("ConcatV2", [(2, 8, 4, 4), (2, 8, 4, 4), ()], (2, 8, 8, 4), [heads, heads, ShardSpec.replicated(0)],
                   const={2: 2}) is None
    # Pack and Unpack shift the split past the new (or removed) axis; a
    # negative axis counts from the end of the packed shape.
    d = _decide("Pack", [(2, 8, 4, 4)] * 2, (2, 8, 4, 2, 4), [heads, heads], attrs={"axis": -2})
    assert d.outputs == (ShardSpec.split(5, 2),)
    d = _decide("Pack", [(2, 8, 4, 4)] * 2, (2, 2, 8, 4, 4), [heads, heads], attrs={"axis": 1})
    assert d.outputs == (ShardSpec.split(5, 3),)
    d = _decide_many("Unpack", [(2, 8, 4, 2, 4)], [(2, 8, 4, 4)] * 2, [ShardSpec.split(5, 2)], attrs={"axis": 3})
    assert d.outputs == (heads, heads)
    d = _decide_many("Unpack", [(2, 2, 8, 4, 4)], [(2, 8, 4, 4)] * 2, [ShardSpec.split(5, 3)], attrs={"axis": 1})
    assert d.outputs == (heads, heads)
    # Without its axis the rule declines rather than guess.
    assert _decide("Pack", [(2, 8, 4, 4)] * 2, (2, 8, 4, 2, 4), [heads, heads]) is None
