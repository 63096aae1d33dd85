"""Tests for smp_tf.graph_view: flop estimates, gradient names, OpGraph, from_tf_graph.

Every test builds a few ops by hand (`OpGraph.from_spec`) or a tiny real
`tf.Graph`, and explains the expected answer before asserting it.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from smp_tf.graph_view import (
    OpGraph,
    estimate_flops,
    forward_name_of_gradient,
    free_op_flags,
    from_tf_graph,
    static_shape_value,
)


# --------------------------------------------------------------------------
# estimate_flops
# --------------------------------------------------------------------------


def test_matmul_flops_are_2mnk():
    # (M=4, K=3) @ (K=3, N=5) -> (4, 5): every one of the 4*5 outputs is a
    # K=3 long dot product, one multiply and one add each: 2*4*5*3 = 120.
    assert estimate_flops("MatMul", [(4, 3), (3, 5)], [(4, 5)]) == pytest.approx(120.0)


def test_matmul_flops_do_not_depend_on_transposition():
    # transpose_a=True: a is stored (K=3, M=4); the output is still (4, 5)
    # and K is still 3, so the cost is still 2*4*5*3 = 120. The estimate
    # only looks at sizes, never at which axis is contracted.
    assert estimate_flops("MatMul", [(3, 4), (3, 5)], [(4, 5)]) == pytest.approx(120.0)
    # A non-square case that a wrong axis choice would get wrong:
    # (M=2, K=7) @ (K=7, N=3): 2*2*3*7 = 84.
    assert estimate_flops("MatMul", [(2, 7), (7, 3)], [(2, 3)]) == pytest.approx(84.0)


@pytest.mark.parametrize("op_type", ["BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"])
def test_batched_matmul_flops(op_type):
    # B=4 independent (8, 3) @ (3, 5) products: 4 * (2*8*5*3) = 960.
    assert estimate_flops(op_type, [(4, 8, 3), (4, 3, 5)], [(4, 8, 5)]) == pytest.approx(960.0)


def test_batched_matmul_flops_with_broadcast_operand():
    # BatchMatMulV2 broadcasts a 2-d right operand over the batch: (4, 8, 3)
    # @ (3, 5) -> (4, 8, 5) does exactly the work of the unbroadcast case
    # above, 2*4*8*5*3 = 960. (The estimate gives 480: prod(a)*prod(b) =
    # 96*15 is divided by prod(out)*batch = 160*4, so K^2 = 2.25 instead of 9.)
    assert estimate_flops("BatchMatMulV2", [(4, 8, 3), (3, 5)], [(4, 8, 5)]) == pytest.approx(960.0)


def test_conv2d_flops():
    # Input (N=2, 8, 8, cin=3), filter (kh=3, kw=3, cin=3, cout=4), VALID
    # -> output (2, 6, 6, 4) = 288 values, each a 3*3*3 = 27 long dot
    # product: 2 * 288 * 27 = 15552.
    assert estimate_flops("Conv2D", [(2, 8, 8, 3), (3, 3, 3, 4)], [(2, 6, 6, 4)]) == pytest.approx(15552.0)


def test_conv2d_backprop_ops_cost_what_the_forward_costs():
    # Both back-propagation ops of the conv above do the same multiply-adds
    # as the forward, so both must also come out at 15552.
    # Conv2DBackpropInput(input_sizes (4,), filter, out_backprop) -> input grad.
    bp_input = estimate_flops("Conv2DBackpropInput", [(4,), (3, 3, 3, 4), (2, 6, 6, 4)], [(2, 8, 8, 3)])
    # Conv2DBackpropFilter(input, filter_sizes (4,), out_backprop) -> filter grad.
    bp_filter = estimate_flops("Conv2DBackpropFilter", [(2, 8, 8, 3), (4,), (2, 6, 6, 4)], [(3, 3, 3, 4)])
    forward = estimate_flops("Conv2D", [(2, 8, 8, 3), (3, 3, 3, 4)], [(2, 6, 6, 4)])
    assert bp_input == pytest.approx(15552.0)
    assert bp_filter == pytest.approx(15552.0)
    assert bp_input == forward == bp_filter


def test_depthwise_conv_flops_ignore_input_channels_in_the_dot_product():
    # Depthwise: filter (kh=3, kw=3, cin=3, multiplier=2), output
    # (2, 6, 6, 3*2=6) = 432 values; each output channel sees ONE input
    # channel, so each value is a 3*3 = 9 long dot product: 2*432*9 = 7776.
    fwd = estimate_flops("DepthwiseConv2dNative", [(2, 8, 8, 3), (3, 3, 3, 2)], [(2, 6, 6, 6)])
    assert fwd == pytest.approx(7776.0)
    # The back-prop ops again cost what the forward costs.
    bi = estimate_flops(
        "DepthwiseConv2dNativeBackpropInput", [(4,), (3, 3, 3, 2), (2, 6, 6, 6)], [(2, 8, 8, 3)]
    )
    bf = estimate_flops(
        "DepthwiseConv2dNativeBackpropFilter", [(2, 8, 8, 3), (4,), (2, 6, 6, 6)], [(3, 3, 3, 2)]
    )
    assert bi == pytest.approx(7776.0)
    assert bf == pytest.approx(7776.0)


@pytest.mark.parametrize("op_type", ["Sum", "Mean", "Max", "Min", "Prod", "ArgMax"])
def test_reductions_cost_the_input_size(op_type):
    # Reducing a (4, 5) tensor over axis 1 to (4,) touches each of the 20
    # inputs once: 20, not prod(output) = 4. (Second input: the axes.)
    assert estimate_flops(op_type, [(4, 5), (1,)], [(4,)]) == pytest.approx(20.0)


@pytest.mark.parametrize(
    "op_type", ["Const", "Placeholder", "Identity", "Reshape", "ReadVariableOp", "Shape", "NoOp", "StopGradient"]
)
def test_data_movement_ops_cost_nothing(op_type):
    # These ops only name, reshape or read data: 0 flops even for a large
    # (1000, 1000) output.
    assert estimate_flops(op_type, [(1000, 1000)], [(1000, 1000)]) == 0.0


def test_elementwise_ops_cost_the_output_size():
    # AddV2 of two (4, 5) tensors: one add per output element, 20.
    assert estimate_flops("AddV2", [(4, 5), (4, 5)], [(4, 5)]) == pytest.approx(20.0)
    # Broadcasting (4, 5) + (5,) still produces 20 elements: 20.
    assert estimate_flops("AddV2", [(4, 5), (5,)], [(4, 5)]) == pytest.approx(20.0)
    # Relu of (2, 3, 7) -> 42.
    assert estimate_flops("Relu", [(2, 3, 7)], [(2, 3, 7)]) == pytest.approx(42.0)


def test_unknown_dimensions_count_as_one():
    # MatMul (None, 3) @ (3, 5) -> (None, 5): the batch dim counts as 1, so
    # 2*1*5*3 = 30.
    assert estimate_flops("MatMul", [(None, 3), (3, 5)], [(None, 5)]) == pytest.approx(30.0)
    # Relu of (None, 5): 1*5 = 5; -1 (GraphDef style unknown) counts as 1 too.
    assert estimate_flops("Relu", [(None, 5)], [(None, 5)]) == pytest.approx(5.0)
    assert estimate_flops("Relu", [(-1, 5)], [(-1, 5)]) == pytest.approx(5.0)
    # Unknown rank (shape None): a single element, cost 1.
    assert estimate_flops("Relu", [None], [None]) == pytest.approx(1.0)
    # Sum of an unknown-rank input: prod(None) = 1.
    assert estimate_flops("Sum", [None, (1,)], [None]) == pytest.approx(1.0)


def test_two_dimensional_einsum():
    # 'ij,jk->ik' with (4, 3), (3, 5): the documented estimate
    # 2*prod(out)*sqrt(prod(a)*prod(b)/prod(out)) = 2*20*sqrt(12*15/20) = 2*20*3 = 120,
    # the exact matmul cost.
    assert estimate_flops("Einsum", [(4, 3), (3, 5)], [(4, 5)]) == pytest.approx(120.0)


# --------------------------------------------------------------------------
# forward_name_of_gradient
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        # GradientTape: "gradient_tape/<forward op>/<grad op>": drop the prefix
        # and the last component.
        ("gradient_tape/model/dense/MatMul/MatMul_1", "model/dense/MatMul"),
        ("gradient_tape/model/dense/MatMul/MatMul", "model/dense/MatMul"),
        # A second tape in the same graph is uniquified to gradient_tape_1.
        ("gradient_tape_1/model/dense/MatMul/MatMul", "model/dense/MatMul"),
        ("gradient_tape_12/model/conv/Conv2D/Conv2DBackpropInput", "model/conv/Conv2D"),
        # ReluGrad sits in the forward op's *scope*: the caller walks scopes.
        ("gradient_tape/model/dense/ReluGrad", "model/dense"),
        # tf.gradients: "gradients/<forward op>_grad/<grad op>".
        ("gradients/dense/MatMul_grad/MatMul", "dense/MatMul"),
        ("gradients/dense/MatMul_grad/MatMul_1", "dense/MatMul"),
        ("gradients_1/dense/MatMul_grad/MatMul", "dense/MatMul"),
        ("gradients/loss_grad/Tile", "loss"),
        # Top-level gradient ops (the seed "ones"/"Fill") point at the root scope.
        ("gradient_tape/Reshape", ""),
        ("gradients/grad_ys_0", ""),
    ],
)
def test_forward_name_of_gradient_ops(name, expected):
    assert forward_name_of_gradient(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "model/dense/MatMul",
        "loss",
        # Prefixes that only look like gradient scopes are forward ops.
        "gradients_layer/MatMul",
        "my_gradient_tape/MatMul",
        "model/gradients/MatMul",
        "gradient_tapes/MatMul",
    ],
)
def test_forward_ops_have_no_forward_name(name):
    assert forward_name_of_gradient(name) is None


# --------------------------------------------------------------------------
# OpGraph.from_spec
# --------------------------------------------------------------------------


def _diamond():
    # a -> b -> d
    #  \-> c -/
    # One output tensor per op, whose id is the op's index.
    return OpGraph.from_spec(
        [
            {"name": "a", "bytes": 8},
            {"name": "b", "inputs": ["a"], "flops": 2, "variables": ["w"]},
            {"name": "c", "inputs": ["a"], "flops": 3},
            {"name": "d", "inputs": ["b", "c"], "flops": 4, "control_inputs": ["a"]},
            {"name": "d_grad", "inputs": ["d"], "forward": "d"},
        ],
        variable_bytes={"w": 100},
    )


def test_from_spec_builds_edges_in_both_directions():
    g = _diamond()
    a, b, c, d, dg = (g.op_index[n] for n in ["a", "b", "c", "d", "d_grad"])
    # d reads b then c (in that order); a reads nothing.
    assert g.input_ops(d) == [b, c]
    assert g.input_ops(a) == []
    # a's output feeds b and c; d's feeds d_grad; d_grad's feeds nobody.
    assert sorted(g.consumer_ops(a)) == [b, c]
    assert g.consumer_ops(d) == [dg]
    assert g.consumer_ops(dg) == []
    # The control edge a -> d is not a data edge.
    assert d not in g.consumer_ops(a)
    assert g.ops[d].control_inputs == [a]
    # Tensor a:0 has 8 bytes and consumers b and c.
    assert g.tensors[a].bytes == 8 and g.tensors[a].consumers == [b, c]
    assert g.tensor_name(g.ops[c].outputs[0]) == "c:0"


def test_from_spec_fields_and_defaults():
    g = _diamond()
    # Defaults: type "Op", 4 bytes, 1 flop; "forward" marks a gradient op.
    assert g.op("a").type == "Op"
    assert g.tensors[g.op("b").outputs[0]].bytes == 4
    assert g.op("a").flops == 1.0
    assert g.op("d_grad").forward == g.op_index["d"] and g.op("d_grad").is_gradient
    assert g.op("d").forward is None and not g.op("d").is_gradient
    # Explicit variable bytes are kept; total flops 1 + 2 + 3 + 4 + 1 = 11.
    assert g.variable_bytes == {"w": 100}
    assert g.trainable == {"w": True}
    assert g.total_flops == pytest.approx(11.0)
    assert len(g) == 5


def test_from_spec_variables_default_to_four_bytes():
    g = OpGraph.from_spec([{"name": "r", "variables": ["v1", "v2"]}], variable_bytes={"v1": 10})
    # v1 was given, v2 gets the 4-byte default.
    assert g.variable_bytes == {"v1": 10, "v2": 4}


def test_from_spec_rejects_duplicate_names():
    with pytest.raises(ValueError, match="Duplicate op name 'a'"):
        OpGraph.from_spec([{"name": "a"}, {"name": "a"}])


def test_from_spec_rejects_use_before_definition():
    # b reads c, which is only defined after it.
    with pytest.raises(ValueError, match=r"'b' uses \['c'\] before"):
        OpGraph.from_spec([{"name": "a"}, {"name": "b", "inputs": ["a", "c"]}, {"name": "c"}])


def test_op_lookup_of_unknown_name():
    with pytest.raises(KeyError, match="No op named 'zz'"):
        _diamond().op("zz")


# --------------------------------------------------------------------------
# from_tf_graph on small real graphs
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v1_graph():
    """x(8,3) @ w(3,5) -> y; loss = sum(y); z colocated with y; tf.gradients."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [8, 3], name="x")
        side = tf.compat.v1.placeholder(tf.int64, [2], name="side")
        w = tf.compat.v1.get_variable("w", shape=[3, 5], initializer=tf.compat.v1.zeros_initializer())
        with tf.compat.v1.name_scope("dense"):
            y = tf.matmul(x, w)
        loss = tf.reduce_sum(y, name="loss")
        with tf.compat.v1.colocate_with(y):
            z = tf.identity(y, name="z")
        with tf.control_dependencies([z]):
            after = tf.identity(loss, name="after")
        h = tf.identity(w.handle, name="handle_copy")
        tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32, name="read_through_identity")
        tf.gradients(loss, [w])
        del side, after
    return g


def test_from_tf_graph_tensor_bytes_from_static_shapes(v1_graph):
    og = from_tf_graph(v1_graph, arg_ops=["x"])

    def out(name):
        return og.tensors[og.op(name).outputs[0]]

    # float32 (8, 3): 24 * 4 = 96 bytes; (8, 5) matmul output: 160 bytes.
    assert out("x").bytes == 96 and out("x").shape == (8, 3) and out("x").dtype == "float32"
    assert out("dense/MatMul").bytes == 160
    # int64 (2,): 2 * 8 = 16 bytes.
    assert out("side").bytes == 16
    # A scalar float loss: 4 bytes; a resource handle: 0 bytes.
    assert out("loss").bytes == 4
    assert out("w").bytes == 0
    # The variable itself: (3, 5) float32 = 60 bytes.
    assert og.variable_bytes == {"w": 60}
    # 2*8*5*3 = 240 flops for the matmul; 8*5 = 40 for the sum.
    assert og.op("dense/MatMul").flops == pytest.approx(240.0)
    assert og.op("loss").flops == pytest.approx(40.0)


def test_from_tf_graph_edges_and_kinds(v1_graph):
    og = from_tf_graph(v1_graph, arg_ops=["x"])
    mm = og.op("dense/MatMul")
    # MatMul reads x and the ReadVariableOp created in the dense scope.
    assert [og.ops[i].name for i in og.input_ops(mm.index)] == ["x", "dense/MatMul/ReadVariableOp"]
    # x is a step argument; "side" is a placeholder not listed: a capture.
    assert og.op("x").kind == "arg"
    assert og.op("side").kind == "capture"
    assert mm.kind == "op"
    # "after" has a control edge from z.
    assert og.op("after").control_inputs == [og.op_index["z"]]
    # Creation order is a topological order: every input precedes its consumer.
    for op in og.ops:
        assert all(j < op.index for j in og.input_ops(op.index))


def test_from_tf_graph_attaches_variables_to_handle_users(v1_graph):
    og = from_tf_graph(v1_graph, arg_ops=["x"])
    # Every op that takes w's handle touches w: the VarHandleOp, both
    # reads, the initializer's assign, and the read through an Identity of
    # the handle (the resource is followed through Identity).
    for name in ["w", "w/Assign", "dense/MatMul/ReadVariableOp", "handle_copy", "read_through_identity"]:
        assert og.op(name).variables == ("w",), name
    # The MatMul reads the *value* (a float tensor), not the handle.
    assert og.op("dense/MatMul").variables == ()
    assert og.op("x").variables == ()
    # Stateful: the variable ops are, the matmul is not.
    assert og.op("w").stateful and og.op("w/Assign").stateful
    assert not og.op("dense/MatMul").stateful


def test_from_tf_graph_links_gradients_to_their_forward_op(v1_graph):
    og = from_tf_graph(v1_graph, arg_ops=["x"])
    mm = og.op_index["dense/MatMul"]
    # tf.gradients names the matmul's gradients "gradients/dense/MatMul_grad/...".
    for name in ["gradients/dense/MatMul_grad/MatMul", "gradients/dense/MatMul_grad/MatMul_1"]:
        assert og.op(name).forward == mm, name
        assert og.op(name).is_gradient
    # The reduction's gradient "gradients/loss_grad/Tile" belongs to "loss".
    assert og.op("gradients/loss_grad/Tile").forward == og.op_index["loss"]
    # Forward ops are not gradients.
    for name in ["dense/MatMul", "loss", "x", "z"]:
        assert og.op(name).forward is None and not og.op(name).is_gradient
    # The gradient matmuls cost what the forward one does (2*8*3*5 = 240 each).
    assert og.op("gradients/dense/MatMul_grad/MatMul").flops == pytest.approx(240.0)


def test_custom_gradient_ops_belong_to_the_forward_op_they_differentiate():
    # A custom gradient (like TensorFlow's swish) builds its ops under no
    # scope; it recomputes sigmoid(h) from the forward h, and only its last
    # op reads the incoming gradient. All of them are gradient ops of the
    # layer before the activation, not forward ops after the whole forward
    # pass (which would put them on the last partition).
    @tf.custom_gradient
    def swish(h):
        def grad(dy):
            s = tf.sigmoid(h)
            return dy * (s * (1.0 + h * (1.0 - s)))

        return h * tf.sigmoid(h), grad

    w1 = tf.Variable(tf.ones([4, 4]))
    w2 = tf.Variable(tf.ones([4, 2]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("layer1"):
                h = tf.matmul(x, w1)
            a = swish(h)
            with tf.name_scope("layer2"):
                out = tf.matmul(a, w2)
            loss = tf.reduce_sum(out)
        return loss, tape.gradient(loss, [w1, w2])

    fg = step.get_concrete_function(tf.TensorSpec([3, 4])).graph
    og = from_tf_graph(fg, arg_ops=["x"], layer_of=lambda op: op.name.split("/")[0] if op.name.startswith("layer") else None)
    h_op = og.op_index["layer1/MatMul"]
    recomputed = [op for op in og.ops if op.type == "Sigmoid"][1:]
    assert len(recomputed) == 1
    chain = [op for op in og.ops if op.index >= recomputed[0].index and op.layer is None and op.inputs
             and not op.name.startswith(("gradient_tape", "Identity", "NoOp"))]
    assert {op.type for op in chain} >= {"Sigmoid", "Sub", "Mul", "AddV2"}
    for op in chain:
        assert op.is_gradient and op.forward == h_op, op.name
    # The forward pass stays forward, and so do the step's outputs.
    for op in og.ops:
        if op.type == "Sigmoid" and op is not recomputed[0]:
            assert not op.is_gradient
    assert not og.op("Sum").is_gradient


def test_from_tf_graph_parses_colocation(v1_graph):
    og = from_tf_graph(v1_graph, arg_ops=["x"])
    # colocate_with(y) writes _class = ["loc:@dense/MatMul"] on z.
    assert og.op("z").colocate_with == ("dense/MatMul",)
    # The initializer constant is colocated with its variable.
    assert og.op("w/Initializer/zeros").colocate_with == ("w",)
    # An op without _class has none, and never lists itself.
    assert og.op("dense/MatMul").colocate_with == ()
    assert og.op("w").colocate_with == ()


def test_from_tf_graph_captured_variables_and_callbacks():
    # The shape of a traced step: the variable arrives as a captured
    # resource placeholder, described by `captured_variables`.
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        handle = tf.compat.v1.placeholder(tf.resource, [], name="kernel_handle")
        with tf.compat.v1.name_scope("layer_a"):
            k = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
            k = tf.reshape(k, [4, 3])
            y = tf.matmul(x, k)
        with tf.compat.v1.name_scope("layer_b"):
            tf.nn.relu(y)
    og = from_tf_graph(
        g,
        arg_ops=["x"],
        captured_variables={"kernel_handle": ("model/kernel", 48, False)},
        layer_of=lambda op: op.name.split("/")[0] if "/" in op.name else None,
        manual_partition_of=lambda op: 1 if op.name.startswith("layer_b") else None,
    )
    h = og.op("kernel_handle")
    # The captured handle is a "capture" that touches the variable; its key,
    # bytes and trainability come from the mapping.
    assert h.kind == "capture" and h.variables == ("model/kernel",)
    assert og.variable_bytes == {"model/kernel": 48}
    assert og.trainable == {"model/kernel": False}
    # The read of the handle touches the variable.
    assert og.op("layer_a/ReadVariableOp").variables == ("model/kernel",)
    # Callbacks: layer from the first name component, manual partition 1
    # only inside layer_b.
    assert og.op("layer_a/MatMul").layer == "layer_a"
    assert og.op("layer_b/Relu").layer == "layer_b"
    assert og.op("x").layer is None
    assert og.op("layer_b/Relu").manual_partition == 1
    assert og.op("layer_a/MatMul").manual_partition is None


def test_from_tf_graph_captured_constants_are_captures():
    # tf.function captures a small eager tensor as a Const op that is also
    # an input of the function (the value is passed when it is called): it
    # is a capture, not a constant the graph optimiser may fold. A Const
    # the function creates itself stays an op.
    small = tf.constant([0.5, 1.5, 2.5])
    big = tf.constant([float(i) for i in range(200)])

    @tf.function
    def f(x):
        return (x - small) * 2.0 + tf.reduce_sum(big)

    fg = f.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph
    captured = {internal.op.name for _, internal in fg.captures}
    small_op = next(t.op for e, t in fg.captures if e is small)
    big_op = next(t.op for e, t in fg.captures if e is big)
    assert (small_op.type, big_op.type) == ("Const", "Placeholder")

    og = from_tf_graph(fg, arg_ops=["x"], captured_ops=captured)
    assert og.op(small_op.name).kind == "capture"
    assert og.op(big_op.name).kind == "capture"
    assert og.op("mul/y").kind == "op"
    # Without the capture list only placeholders are recognised.
    assert from_tf_graph(fg, arg_ops=["x"]).op(small_op.name).kind == "op"


def test_from_tf_graph_gradient_tape_names():
    # GradientTape in graph mode names gradient ops "gradient_tape/<scope>/...".
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        w = tf.Variable(tf.ones([3, 5]), name="w")
        with tf.GradientTape() as tape:
            with tf.name_scope("model/dense"):
                y = tf.nn.relu(tf.matmul(x, w))
            loss = tf.reduce_mean(y, name="loss")
        tape.gradient(loss, w)
    og = from_tf_graph(g, arg_ops=["x"])
    # The matmul's gradient "gradient_tape/model/dense/MatMul/MatMul" names its
    # forward op exactly.
    assert og.op("gradient_tape/model/dense/MatMul/MatMul").forward == og.op_index["model/dense/MatMul"]
    # "gradient_tape/model/dense/ReluGrad" only names the scope model/dense,
    # which holds three forward ops; the one it reads (Relu) wins.
    assert og.op("gradient_tape/model/dense/ReluGrad").forward == og.op_index["model/dense/Relu"]
    # The unknown batch dim counts as 1: the (None, 3) @ (3, 5) matmul costs
    # 2*1*5*3 = 30 and its output (None, 5) is counted as 5 floats = 20 bytes.
    mm = og.op("model/dense/MatMul")
    assert mm.flops == pytest.approx(30.0)
    assert og.tensors[mm.outputs[0]].bytes == 20


# --------------------------------------------------------------------------
# from_tf_graph: creation order, while-loop gradients, resource writes
# --------------------------------------------------------------------------


def _traced(fn, *specs):
    """The FuncGraph of `fn` and its captured variables, as smp.step reads it."""
    graph = tf.function(fn, autograph=False).get_concrete_function(*specs).graph
    captured = {}
    for external, internal in graph.captures:
        for v in graph.variables:
            if v.handle is external:
                captured[internal.op.name] = (v.name.split(":")[0], 4, v.trainable)
    return graph, captured


def test_while_loop_gradient_is_read_in_topological_order():
    # The gradient of a tf.while_loop that keeps intermediates adds inputs
    # (accumulators) to the forward While op, created after it: creation
    # order is not topological. The view must still index every producer
    # before its consumers, and tie the loop to its accumulators and to the
    # gradient loop that reads them.
    w = tf.Variable(tf.ones([3, 3]) * 0.5, name="w")

    def fn(x):
        with tf.GradientTape() as tape:
            def body(i, h):
                return i + 1, tf.tanh(tf.matmul(h, w))

            _, h = tf.while_loop(lambda i, h: i < 4, body, (0, x))
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, w)

    graph, captured = _traced(fn, tf.TensorSpec([2, 3]))
    created = [op.name for op in graph.get_operations()]
    fwd = next(op for op in graph.get_operations() if op.type in ("While", "StatelessWhile") and "grad" not in op.name)
    assert any(created.index(t.op.name) > created.index(fwd.name) for t in fwd.inputs)  # the premise

    g = from_tf_graph(graph, captured_variables=captured)
    for op in g.ops:
        for t in op.inputs:
            assert g.tensors[t].producer < op.index, op.name
    loop = g.op(fwd.name)
    tied = {g.ops[i].name for i in loop.tied}
    grad_loop = next(op.name for op in g.ops if op.type.endswith("While") and op.name != fwd.name)
    assert grad_loop in tied
    assert any("accumulator" in n for n in tied)


def test_while_loop_is_kept_with_its_gradient_on_one_partition():
    w = tf.Variable(tf.ones([3, 3]) * 0.5, name="w2")

    def fn(x):
        with tf.GradientTape() as tape:
            _, h = tf.while_loop(lambda i, h: i < 4, lambda i, h: (i + 1, tf.tanh(h @ w)), (0, x))
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, w)

    from smp_tf.partitioner.groups import colocation_groups

    graph, captured = _traced(fn, tf.TensorSpec([2, 3]))
    g = from_tf_graph(graph, captured_variables=captured)
    groups = colocation_groups(g)
    loops = [op.index for op in g.ops if op.type.endswith("While")]
    assert len(loops) == 2
    assert len({groups.group_of[i] for i in loops}) == 1


def test_resource_writes_are_read_from_ops_and_loop_bodies():
    # AssignAddVariableOp writes; ReadVariableOp only reads. A loop writes
    # what its body writes: the loop over `acc` writes it, the loop that
    # only reads `w` does not.
    w = tf.Variable(1.0, name="w_read")
    acc = tf.Variable(0.0, name="acc_written")

    def fn(x):
        y = x * w.read_value()
        acc.assign_add(1.0)
        _, r = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, a + w.read_value()), (0, x))

        def bump(i):
            acc.assign_add(1.0)
            return i + 1

        n = tf.while_loop(lambda i: i < 2, bump, [0])
        return y + r + tf.cast(n, tf.float32)

    graph, captured = _traced(fn, tf.TensorSpec([]))
    g = from_tf_graph(graph, captured_variables=captured)
    writes = {(op.type, v) for op in g.ops for v in op.writes}
    reads = {(op.type, v) for op in g.ops for v in op.variables if v not in op.writes and op.kind == "op"}
    assert ("AssignAddVariableOp", "acc_written") in writes
    assert ("ReadVariableOp", "w_read") in reads
    loop_writes = [op.writes for op in g.ops if op.type.endswith("While")]
    assert sorted(loop_writes) == [(), ("acc_written",)]


# --------------------------------------------------------------------------
# Shapes known when tracing are constants
# --------------------------------------------------------------------------


def test_static_shape_value_of_fully_known_shapes():
    # Shape of a (4, 8, 3) tensor is the vector [4, 8, 3]; ShapeN gives one
    # vector per input; Size is 4*8*3 = 96; Rank is 3; a scalar's shape is [].
    assert static_shape_value("Shape", [(4, 8, 3)], ["float32"]) == ((4, 8, 3),)
    assert static_shape_value("ShapeN", [(4, 8), (2,)], ["float32", "int32"]) == ((4, 8), (2,))
    assert static_shape_value("Size", [(4, 8, 3)], ["float32"]) == (96,)
    assert static_shape_value("Rank", [(4, 8, 3)], ["float32"]) == (3,)
    assert static_shape_value("Shape", [()], ["float32"]) == ((),)


def test_static_shape_value_needs_every_dimension_and_a_value_shape():
    # An unknown batch dimension, an unknown rank, a resource handle (whose
    # shape is the handle's, not the variable's) and ops that are not shape
    # ops are not constants.
    assert static_shape_value("Shape", [(None, 8)], ["float32"]) is None
    assert static_shape_value("Shape", [None], ["float32"]) is None
    assert static_shape_value("ShapeN", [(4, 8), (None,)], ["float32", "float32"]) is None
    assert static_shape_value("Shape", [()], ["resource"]) is None
    assert static_shape_value("Reshape", [(4, 8), (2,)], ["float32", "int32"]) is None


def test_from_tf_graph_static_shape_ops_read_no_tensor():
    # s = Shape(x) with x (2, 3) known is the constant [2, 3]: in the view it
    # has no data input (x has no consumer through it), so the partitioner
    # treats it like a constant. u = Shape(z) with z (None, 3) keeps its input.
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        z = tf.compat.v1.placeholder(tf.float32, [None, 3], name="z")
        tf.raw_ops.Shape(input=x, name="s")
        tf.raw_ops.ShapeN(input=[x, x], out_type=tf.int64, name="sn")
        tf.raw_ops.Shape(input=z, name="u")
    og = from_tf_graph(g, arg_ops=["x", "z"])
    s, sn, u = og.op("s"), og.op("sn"), og.op("u")
    assert s.inputs == [] and s.static_value == ((2, 3),)
    assert sn.inputs == [] and sn.static_value == ((2, 3), (2, 3))
    assert og.tensors[og.op("x").outputs[0]].consumers == []
    assert len(u.inputs) == 1 and u.static_value is None


def test_gradient_ops_of_a_scope_follow_the_ops_that_read_them():
    """Rows rebuilt by slicing and concatenating in a loop (Qwen3.5's gated
    delta net): the concatenation's gradient slices and offsets are named in
    the block's scope and read only the incoming gradient and constants.
    They are linked through the gradient ops that read them to the forward
    op of their own iteration, not to the block's last op; no gradient op is
    linked to a forward op created after it, and constants to none."""
    w = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("block"):
                a = tf.matmul(x, w)
                for i in range(1, 4):
                    row = a[:, i:i + 1] * 2.0
                    a = tf.concat([a[:, :i], row, a[:, i + 1:]], axis=1)
                out = tf.reshape(a, [-1])
            loss = tf.reduce_sum(out * out)
        return loss, tape.gradient(loss, [w])

    fg = step.get_concrete_function(tf.TensorSpec([3, 4])).graph
    og = from_tf_graph(fg, arg_ops=["x"], layer_of=lambda op: "block" if op.name.startswith("block/") else None)
    last = max(op.index for op in og.ops if op.name.startswith("block/") and not op.is_gradient)
    slices = [op for op in og.ops if op.is_gradient and op.type == "Slice" and op.name.startswith("gradient_tape/block/")]
    assert len(slices) == 3 * 3  # three concatenations of three parts
    for op in slices:
        assert op.forward is not None and op.forward != last, op.name
        # What reads the slice (a strided slice's gradient, a multiplication's)
        # differentiates the op it is linked to.
        readers = {c for t in op.outputs for c in og.tensors[t].consumers}
        assert op.forward in {og.ops[c].forward for c in readers}, op.name
    for op in og.ops:
        if op.is_gradient and op.forward is not None:
            assert op.forward < op.index, op.name
        if op.type == "Const" and forward_name_of_gradient(op.name) == "block":
            assert op.forward is None, op.name  # named in the block's scope alone


def _view_with_layers(step, x_shape, layers):
    """The op graph of `step` traced for an argument ``x`` of `x_shape`, each
    op in the layer its top-level name scope names when that is in `layers`."""
    fg = step.get_concrete_function(tf.TensorSpec(x_shape)).graph

    def layer_of(op):
        head = op.name.split("/")[0]
        return head if head in layers else None

    return from_tf_graph(fg, arg_ops=["x"], layer_of=layer_of)


def test_the_gradient_of_a_product_glued_in_a_scope_follows_the_product():
    """A gated feed-forward block (Llama's): ``z = act * up`` is made by
    ``tf.multiply`` in the block's own scope, so the tape names its gradients
    in that scope, not under the product. ``dz * act`` (the gradient for
    ``up``) reads ``act``, but differentiates the product: its incoming
    gradient comes from the layer that reads ``z``. Linked to the op that
    made ``act``, it went with the gate, and a split between the gate and
    ``up`` sent the backward back and forth (Llama 3 at two partitions: 5
    tasks instead of 3)."""
    wg, wu, wo = (tf.Variable(tf.ones([4, 4]) * k) for k in (1.0, 2.0, 3.0))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("gate"):
                gate = tf.matmul(x, wg)
            with tf.name_scope("up"):
                up = tf.matmul(x, wu)
            with tf.name_scope("block"):
                act = tf.multiply(gate, tf.sigmoid(gate))
                z = tf.multiply(act, up)
            with tf.name_scope("out"):
                out = tf.matmul(z, wo)
            loss = tf.reduce_sum(out)
        return loss, tape.gradient(loss, [wg, wu, wo])

    og = _view_with_layers(step, [3, 4], ("gate", "up", "block", "out"))
    producer = lambda t: og.ops[og.tensors[t].producer]  # noqa: E731
    z = next(op for op in og.ops if op.name.startswith("block/") and any(producer(t).name == "up/MatMul"
                                                                          for t in op.inputs))
    act = next(producer(t) for t in z.inputs if producer(t).name != "up/MatMul")
    d_up = [op for op in og.ops if op.is_gradient and op.name.startswith("gradient_tape/block/")
            and act.index in {og.tensors[t].producer for t in op.inputs}
            and any(producer(t).name.startswith("gradient_tape/out/") for t in op.inputs)]
    # Named in the block's scope, not under the product.
    assert len(d_up) == 1 and forward_name_of_gradient(d_up[0].name) == "block", [o.name for o in d_up]
    assert d_up[0].forward == z.index, og.ops[d_up[0].forward].name
    # The gradient for `act` (it reads `up`) is the product's as well.
    d_act = [op for op in og.ops if op.is_gradient and op.name.startswith("gradient_tape/block/")
             and og.op_index["up/MatMul"] in {og.tensors[t].producer for t in op.inputs}]
    assert [op.forward for op in d_act] == [z.index]


def test_a_gradient_reading_a_sum_of_contributions_follows_the_ops_that_read_its_tensor():
    """A mixture-of-experts block reshapes its input in its own scope, and
    both the router and the experts read the reshaped tokens; the block
    reshapes its output back in the same scope. The gradient of the first
    reshape is named in the block's scope only, and reads the tape's sum
    (``AddN``, outside every scope) of the router's and the experts'
    contributions. Those contributions differentiate ops that read the
    first reshape's output, so the gradient belongs to it, not to the
    scope's newest op (the output reshape, with the experts: GPT-OSS at two
    partitions split between router and experts sent the backward back and
    forth, 5 tasks instead of 3)."""
    w0, wr, we = (tf.Variable(tf.ones([4, 4]) * k) for k in (1.0, 2.0, 3.0))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("pre"):
                h = tf.matmul(x, w0)
            with tf.name_scope("block") as block:
                tokens = tf.reshape(h, [-1, 4])
            with tf.name_scope("router"):
                gates = tf.nn.softmax(tf.matmul(tokens, wr))
            with tf.name_scope("experts"):
                experts = tf.matmul(tokens, we)
            with tf.name_scope(block):
                out = tf.reshape(experts * gates, [2, 3, 4])
            loss = tf.reduce_sum(out)
        return loss, tape.gradient(loss, [w0, wr, we])

    og = _view_with_layers(step, [6, 4], ("pre", "block", "router", "experts"))
    tokens = og.op_index["block/Reshape"]
    total = [op for op in og.ops if op.type == "AddN"]
    assert len(total) == 1 and total[0].is_gradient
    d_tokens = [op for op in og.ops if op.type == "Reshape" and op.name.startswith("gradient_tape/block/")
                and total[0].index in {og.tensors[t].producer for t in op.inputs}]
    assert len(d_tokens) == 1 and forward_name_of_gradient(d_tokens[0].name) == "block"
    assert d_tokens[0].forward == tokens, og.ops[d_tokens[0].forward].name


def test_the_gradient_of_a_gated_residual_follows_the_product_not_the_blocks_last_op():
    """A diffusion transformer's block (MMDiT's) adds ``gate * attn`` to
    its residual stream in its own scope, where its MLP's residual sum is
    made too. The gradient for ``gate`` reads ``attn`` and the tape's sum of
    the stream's contributions, which gathers them from the block's norm and
    from the next block, so following the senders linked it to the block's
    last op (the MLP's residual sum). It differentiates the product, the one
    op of the scope that reads ``attn`` (MMDiT at two partitions, split
    between the norm and the MLP: 5 tasks instead of 3)."""
    wm, wa, wf, wn = (tf.Variable(tf.ones([4, 4]) * k) for k in (1.0, 2.0, 3.0, 4.0))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("mod"):
                gate = tf.matmul(x, wm)
            with tf.name_scope("attn"):
                attn = tf.matmul(x, wa)
            with tf.name_scope("block") as block:
                h = x + tf.multiply(gate, attn)
            with tf.name_scope("norm"):
                n = h - tf.reduce_mean(h, axis=-1, keepdims=True)
            with tf.name_scope("mlp"):
                f = tf.matmul(n, wf)
            with tf.name_scope(block):
                out = h + f
            with tf.name_scope("next"):
                y = tf.matmul(out, wn)
            loss = tf.reduce_sum(y * y)
        return loss, tape.gradient(loss, [wm, wa, wf, wn])

    og = _view_with_layers(step, [3, 4], ("mod", "attn", "block", "norm", "mlp", "next"))
    producer = lambda t: og.ops[og.tensors[t].producer]  # noqa: E731
    product = next(op for op in og.ops if op.name.startswith("block/") and op.type == "Mul")
    last = max(op.index for op in og.ops if op.name.startswith("block/") and not op.is_gradient)
    assert last != product.index
    d_gate = [op for op in og.ops if op.is_gradient and op.name.startswith("gradient_tape/block/")
              and any(producer(t).name == "attn/MatMul" for t in op.inputs)]
    d_attn = [op for op in og.ops if op.is_gradient and op.name.startswith("gradient_tape/block/")
              and any(producer(t).name == "mod/MatMul" for t in op.inputs)]
    assert len(d_gate) == 1 and len(d_attn) == 1, [op.name for op in d_gate + d_attn]
    assert forward_name_of_gradient(d_gate[0].name) == "block"
    assert d_gate[0].forward == product.index, og.ops[d_gate[0].forward].name
    assert d_attn[0].forward == product.index, og.ops[d_attn[0].forward].name


def test_a_gather_gradient_follows_its_incoming_gradient_not_the_permutation_it_reads():
    """A gather along a later axis (DeBERTa's relative-position lookups)
    is differentiated by transposes whose permutation the tape computes
    from constants, in the layer's scope like the rest. The permutation's
    own link is arbitrary: it was taken for what the transpose
    differentiates, which linked the gather's gradient to the op computing
    the gather's indices, placed with another of their readers (DeBERTa at
    three partitions: a backward task on the last partition between two of
    the middle one's, 7 tasks instead of 5). A value computed from constants
    carries no gradient; the incoming gradient decides."""
    w, v = tf.Variable(tf.ones([4, 8])), tf.Variable(tf.ones([4, 4]) * 2.0)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.name_scope("attn"):
                s = tf.reshape(tf.matmul(x, w), [2, 3, 8])
                idx = tf.range(4) * 2 + 1
                g = tf.gather(s, idx, axis=2)
                h = tf.matmul(tf.reshape(g, [6, 4]), v)
            loss = tf.reduce_sum(h * h)
        return loss, tape.gradient(loss, [w, v])

    og = _view_with_layers(step, [6, 4], ("attn",))
    free = free_op_flags(og.ops, og.tensors)
    indices = og.ops[og.op_index["attn/add"]]
    assert free[indices.index] and not indices.is_gradient
    producer = lambda t: og.ops[og.tensors[t].producer]  # noqa: E731
    # The gather's gradient: the transposes and the segment sum, each
    # reading a gradient and (the transposes) a permutation.
    carried = [op for op in og.ops if op.is_gradient and op.name.startswith("gradient_tape/attn/")
               and op.type in ("Transpose", "UnsortedSegmentSum")]
    assert len(carried) == 3, [op.name for op in carried]
    for op in carried:
        assert any(producer(t).is_gradient and not free[producer(t).index] for t in op.inputs)
        assert not free[op.forward], (op.name, og.ops[op.forward].name)


def test_strongly_connected_components_come_in_reverse_topological_order():
    # 0 -> 1 <-> 2 -> 3, and 4 alone.
    from smp_tf.graph_view import strongly_connected

    comp = strongly_connected([[1], [2], [1, 3], [], []])
    assert comp[1] == comp[2]
    assert len({comp[0], comp[1], comp[3], comp[4]}) == 4
    # A component's id is larger than the ids of the components it reaches.
    assert comp[0] > comp[1] > comp[3]
