"""Partitioning real Keras training steps: ResNet50, MobileNetV2, a tied Transformer.

Every test traces a full micro-batch training step (forward, loss and
`tf.GradientTape` gradients) with `StepFunction.get_plan` and checks the
plan against the partitioner's guarantees:

* every op of the traced graph is in exactly one partition;
* the ops that take one variable's handle share a partition (tied embeddings);
* a gradient op is on the partition of the forward op it differentiates;
* the ops of one Keras layer share a partition;
* ``contiguous=True`` gives each partition a contiguous range of units;
* ``auto_partition=False`` honours `smp.partition` blocks.

Documented exception to "gradient ops follow their forward op" and "a
layer's ops share a partition": *free* ops (`groups.free_ops`: constants and
shape arithmetic that read only constants and step arguments, e.g. the
``Shape`` constants of a broadcasting gradient or of a `MultiHeadAttention`)
belong to no colocation group. They cost nothing to duplicate and go to the
lowest partition among their consumers; a free op with no consumer (tracing
leaves dead shape constants behind) goes to ``default_partition``.
`check_free_ops` checks exactly that.

Models use small inputs so that the whole module runs in well under a minute.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import keras
import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf.partitioner.groups import _is_gradient_sum, colocation_groups, second_uses
from smp_tf.partitioner.plan import PartitionPlan, _group_positions, assign_partitions

P = 4  # tests/conftest.py creates 4 logical CPU devices

CONFIGS = [
    {"optimize": "speed", "contiguous": True},
    {"optimize": "memory", "contiguous": True},
    {"optimize": "speed", "contiguous": False},
    {"optimize": "memory", "contiguous": False},
]


# --------------------------------------------------------------------------- helpers


def training_body(model, loss_fn):
    def body(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    return body


def trace_plan(model, loss_fn, x, y, **config) -> PartitionPlan:
    smp.init({"partitions": P, "microbatches": 1, **config})
    return smp.step(training_body(model, loss_fn)).get_plan(x, y)


def replan(plan: PartitionPlan, **config) -> PartitionPlan:
    """The same traced graph partitioned under another config (no re-trace)."""
    assignment = assign_partitions(plan.op_graph, plan.num_partitions, **config)
    return PartitionPlan(plan.graph, plan.op_graph, assignment, plan.num_partitions)


def image_data(shape, classes: int, batch: int = 4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch,) + tuple(shape)).astype("float32")
    y = (np.arange(batch) % classes).astype("int32")
    return x, y


def check_every_op_once(plan: PartitionPlan) -> None:
    tf_ops = plan.graph.get_operations()
    assert set(plan.assignment) == {op.name for op in tf_ops}
    assert len(plan.assignment) == len(tf_ops) == len(plan.op_graph)
    assert all(0 <= p < plan.num_partitions for p in plan.assignment.values())
    assert sum(r["ops"] for r in plan.summary()) == len(tf_ops)


def check_variable_users(plan: PartitionPlan) -> int:
    """All consumers of a variable handle share its partition; returns #handles."""
    handles = 0
    for op in plan.graph.get_operations():
        if op.type not in ("Placeholder", "VarHandleOp") or op.outputs[0].dtype != tf.resource:
            continue
        handles += 1
        parts = {plan.assignment[op.name]} | {plan.assignment[c.name] for c in op.outputs[0].consumers()}
        assert len(parts) == 1, f"users of {op.name} on partitions {sorted(parts)}"
    # The same through the view (handles followed through Identity ops).
    by_var: Dict[str, set] = {}
    for op, p in zip(plan.op_graph.ops, plan.partition_of_op):
        for v in op.variables:
            by_var.setdefault(v, set()).add(p)
    split = {v: ps for v, ps in by_var.items() if len(ps) > 1}
    assert not split, f"variables split across partitions: {split}"
    return handles


def check_free_ops(plan: PartitionPlan, default_partition: int = 0) -> int:
    """Free ops follow their consumers (lowest partition); dead ones the default partition."""
    g = plan.op_graph
    free = colocation_groups(g).free
    part = plan.partition_of_op
    n = 0
    for op in g.ops:
        if not free[op.index]:
            continue
        n += 1
        consumers = g.consumer_ops(op.index)
        if consumers:
            assert part[op.index] == min(part[c] for c in consumers), op.name
        else:
            assert part[op.index] == default_partition, op.name
    return n


def check_gradients_follow_forward(plan: PartitionPlan) -> List[int]:
    """Gradient ops sit with their forward op; returns the (free-op) exceptions.

    Sums of gradient contributions (``AddN``) are the other exception: they
    sit where their terms are computed; when every term comes from one
    partition, on that partition.
    """
    g = plan.op_graph
    free = colocation_groups(g).free
    part = plan.partition_of_op
    exceptions = []
    n_linked = 0
    for op in g.ops:
        if op.forward is None:
            continue
        n_linked += 1
        if part[op.index] == part[op.forward]:
            continue
        if op.type == "AddN" and op.layer is None:
            term_parts = {part[g.tensors[t].producer] for t in op.inputs} - {-1}
            assert len(term_parts) > 1 or part[op.index] in term_parts, (
                f"gradient sum {op.name} on partition {part[op.index]}, its terms on {term_parts}"
            )
            continue
        assert free[op.index], (
            f"gradient op {op.name} ({op.type}) on partition {part[op.index]}, "
            f"its forward op {g.ops[op.forward].name} on {part[op.forward]}"
        )
        exceptions.append(op.index)
    assert n_linked > 0
    return exceptions


def check_layers_whole(plan: PartitionPlan) -> int:
    """The (non-free) ops of each Keras layer call share a partition; returns #calls.

    A read of a variable for its second use sits with the variable instead,
    and the glue of a composite layer (a `MultiHeadAttention`'s own einsums
    between its projections) goes with its neighbours.
    """
    free = colocation_groups(plan.op_graph).free
    second = second_uses(plan.op_graph)
    by_layer: Dict[str, set] = {}
    for op, p in zip(plan.op_graph.ops, plan.partition_of_op):
        if op.layer is not None and not free[op.index] and op.index not in second and not op.glue:
            by_layer.setdefault(op.call or op.layer, set()).add(p)
    split = {k: ps for k, ps in by_layer.items() if len(ps) > 1}
    assert not split, f"layers split across partitions: {split}"
    return len(by_layer)


def check_all(plan: PartitionPlan, default_partition: int = 0) -> None:
    check_every_op_once(plan)
    assert check_variable_users(plan) > 0
    check_free_ops(plan, default_partition)
    check_gradients_follow_forward(plan)
    assert check_layers_whole(plan) > 0


def check_every_partition_used(plan: PartitionPlan) -> None:
    used = {r["partition"] for r in plan.summary() if r["ops"] > 0}
    assert used == set(range(plan.num_partitions)), plan.report()


def unit_partitions(plan: PartitionPlan) -> List[int]:
    """Partition of each unit (colocation group with a forward op), in forward order."""
    g = plan.op_graph
    groups = colocation_groups(g)
    pos = _group_positions(g, groups)
    units = [grp for _, grp in sorted((p, grp) for grp, p in enumerate(pos) if p is not None)]
    out = []
    for grp in units:
        parts = {plan.partition_of_op[i] for i in groups.members[grp]}
        assert len(parts) == 1, f"group {grp} split over {parts}"
        out.append(parts.pop())
    return out


def layer_of_scope(name: str, layer_names: set) -> Optional[str]:
    """Keras layer owning an op, read from the op's name alone.

    Forward ops are ``<model>/<layer>_<k>/...``, tape gradients
    ``gradient_tape/<model>/<layer>_<k>/...`` (TensorFlow uniquifies scopes).
    """
    parts = name.split("/")
    if parts[0].startswith("gradient_tape"):
        parts = parts[1:]
    if len(parts) < 3:
        return None
    scope = parts[1]
    if scope in layer_names:
        return scope
    stripped = re.sub(r"_\d+$", "", scope)
    return stripped if stripped in layer_names else None


# --------------------------------------------------------------------------- ResNet50 / MobileNetV2


@pytest.fixture(scope="module")
def resnet50_plan():
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    x, y = image_data((32, 32, 3), 10)
    plan = trace_plan(model, keras.losses.SparseCategoricalCrossentropy(), x, y,
                      optimize="speed", contiguous=True)
    return model, plan


@pytest.fixture(scope="module")
def mobilenet_plan():
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
    x, y = image_data((32, 32, 3), 10)
    plan = trace_plan(model, keras.losses.SparseCategoricalCrossentropy(), x, y,
                      optimize="memory", contiguous=False)
    return model, plan


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['optimize']}-{'contig' if c['contiguous'] else 'free'}")
def test_resnet50_invariants(resnet50_plan, config):
    model, traced = resnet50_plan
    assert len(traced.op_graph) > 5000  # forward, loss and backward of all 50 layers
    plan = traced if config == CONFIGS[0] else replan(traced, **config)
    check_all(plan)
    check_every_partition_used(plan)
    exceptions = check_gradients_follow_forward(plan)
    # The exceptions are a few hundred constant/shape ops, never compute.
    assert all(plan.op_graph.ops[i].flops <= 16 for i in exceptions)


def test_resnet50_layers_whole_by_name(resnet50_plan):
    """Independent of the recorded layer keys: group ops by their name scope."""
    model, plan = resnet50_plan
    layer_names = {l.name for l in model.layers if not isinstance(l, keras.layers.InputLayer)}
    free = colocation_groups(plan.op_graph).free
    parts: Dict[str, set] = {}
    for op, p in zip(plan.op_graph.ops, plan.partition_of_op):
        layer = layer_of_scope(op.name, layer_names)
        if layer is not None and not free[op.index]:
            parts.setdefault(layer, set()).add(p)
    # Every layer shows up except conv1_pad, whose Pad reads only the step
    # argument: a free op, fed to wherever it is used.
    assert layer_names - set(parts) == {"conv1_pad"}
    split = {k: v for k, v in parts.items() if len(v) > 1}
    assert not split, split
    # A conv layer's ops (forward and gradient) are where its kernel lives.
    conv = model.get_layer("conv3_block2_2_conv")
    assert plan.partition_of_variable()[conv.kernel.path] in parts["conv3_block2_2_conv"]


def test_resnet50_contiguous_units(resnet50_plan):
    _, plan = resnet50_plan
    seq = unit_partitions(plan)
    assert len(seq) > 150  # about one unit per Keras layer
    assert seq == sorted(seq), "partitions are not contiguous ranges of units"
    assert set(seq) == set(range(P))
    # Non-contiguous plans are allowed to interleave (and on this model do not
    # have to); they still keep every unit whole.
    unit_partitions(replan(plan, optimize="memory", contiguous=False))


@pytest.mark.parametrize("contiguous", [True, False])
def test_mobilenetv2_invariants(mobilenet_plan, contiguous):
    _, traced = mobilenet_plan
    plan = traced if not contiguous else replan(traced, optimize="memory", contiguous=True)
    check_all(plan)
    check_every_partition_used(plan)
    seq = unit_partitions(plan)
    if contiguous:
        assert seq == sorted(seq)


# --------------------------------------------------------------------------- tied Transformer


class TiedEncoder(smp.DistributedModel):
    """A small Transformer encoder whose output projection reuses the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(vocab, dim, name="embed")
        self.blocks = [
            (
                keras.layers.MultiHeadAttention(heads, dim // heads, name=f"attn{i}"),
                keras.layers.LayerNormalization(name=f"ln{i}a"),
                keras.layers.Dense(2 * dim, activation="relu", name=f"ff{i}a"),
                keras.layers.Dense(dim, name=f"ff{i}b"),
                keras.layers.LayerNormalization(name=f"ln{i}b"),
            )
            for i in range(layers)
        ]

    def call(self, tokens, training=False):
        h = self.embed(tokens)
        for attn, ln_a, ff_a, ff_b, ln_b in self.blocks:
            h = ln_a(h + attn(h, h, training=training))
            h = ln_b(h + ff_b(ff_a(h)))
        return tf.matmul(h, self.embed.embeddings, transpose_b=True, name="tied_logits")


def _handle_of(op: tf.Operation) -> tf.Operation:
    """The variable handle an op reads, through ReadVariableOp / Identity."""
    while op.type not in ("Placeholder", "VarHandleOp"):
        resource = [t for t in op.inputs if t.dtype == tf.resource]
        op = resource[0].op if resource else op.inputs[0].op
    return op


def _tied_plan(config) -> PartitionPlan:
    keras.utils.set_random_seed(0)
    model = TiedEncoder()
    model(np.zeros((1, 8), "int32"))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, size=(4, 8)).astype("int32")
    y = rng.integers(0, 64, size=(4, 8)).astype("int32")
    return trace_plan(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y, **config)


def _tied_ops(plan: PartitionPlan):
    """(embedding handle, embedding lookup, tied projection) in the traced graph."""
    ops = plan.graph.get_operations()
    logits = [op for op in ops if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
              and "tied_logits" in op.name and not op.name.startswith("gradient_tape")]
    gathers = [op for op in ops if op.type in ("GatherV2", "ResourceGather") and "embed" in op.name
               and not op.name.startswith("gradient_tape")]
    assert len(logits) == 1 and len(gathers) == 1
    handle = _handle_of(gathers[0])
    # The projection really reads the embedding matrix (same handle).
    assert _handle_of(logits[0]) is handle
    return handle, gathers[0], logits[0]


def _projection_gradients(plan: PartitionPlan, logits: tf.Operation) -> List[int]:
    """Gradient ops of the tied projection, less the sums of gradient contributions."""
    g = plan.op_graph
    free = colocation_groups(g).free
    return [op.index for op in g.ops
            if op.forward == g.op_index[logits.name] and not free[op.index] and not _is_gradient_sum(op)]


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]], ids=["speed-contig", "memory-free"])
def test_tied_embedding_handle_users_stay_together(config):
    plan = _tied_plan(config)
    check_all(plan)
    check_every_partition_used(plan)
    handle, gather, logits = _tied_ops(plan)
    # Both reads of the matrix (the lookup's and the projection's) take the
    # handle, so they and the lookup sit with it.
    p = plan.assignment[handle.name]
    reads = [c for c in handle.outputs[0].consumers()]
    assert len(reads) >= 2
    assert all(plan.assignment[r.name] == p for r in reads)
    assert plan.assignment[gather.name] == p
    # The projection and its gradients are on one partition.
    q = plan.assignment[logits.name]
    grads = _projection_gradients(plan, logits)
    assert grads and all(plan.partition_of_op[i] == q for i in grads)


def test_custom_gradient_activations_run_their_backward_with_their_layer():
    """Swish's gradient is a `tf.custom_gradient` that recomputes
    ``sigmoid(x)`` under no name scope and reads the incoming gradient only
    at its end. Those ops differentiate the layer's activation: they sit on
    its partition, so each stage's backward is one task instead of crossing
    to the last partition and back for every activation."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16,))
    h = inp
    for _ in range(2 * P):
        h = keras.layers.Dense(16, activation="swish")(h)
    model = smp.DistributedModel(inp, keras.layers.Dense(4)(h))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    plan = trace_plan(model, keras.losses.MeanSquaredError(), x, y, optimize="speed", contiguous=True)
    check_all(plan)
    check_every_partition_used(plan)
    g = plan.op_graph
    recomputed = [op for op in g.ops if op.type == "Sigmoid" and op.is_gradient]
    assert len(recomputed) == 2 * P, [op.name for op in recomputed]
    for op in recomputed:
        assert op.layer is None and plan.partition_of_op[op.index] == plan.partition_of_op[op.forward], op.name
    # The compiled step: a forward and a backward task per stage, the last
    # stage's fused (2P - 1 tasks); before, every activation of the first
    # stages added two more.
    smp.init({"partitions": P, "microbatches": 2})
    step = smp.step(training_body(model, keras.losses.MeanSquaredError()))
    step(x, y)
    assert len(step.last_compiled.tasks) == 2 * P - 1, [t.key for t in step.last_compiled.tasks]


def test_tied_output_projection_runs_on_the_last_stage_next_to_its_loss():
    # The 64 x 16 embedding (4 KiB) is smaller than the hidden state and the
    # logits around the projection, so the projection is a group of its own:
    # it runs on the last partition with the loss, and the matrix (and its
    # gradient) crosses partitions instead of the activations going back to
    # the first partition and forward again.
    plan = _tied_plan(CONFIGS[0])
    handle, gather, logits = _tied_ops(plan)
    p = plan.assignment[handle.name]
    last = plan.num_partitions - 1
    assert p == 0 and plan.assignment[logits.name] == last
    grads = _projection_gradients(plan, logits)
    assert grads and all(plan.partition_of_op[i] == last for i in grads)
    # The loss follows the projection: nothing it feeds goes back to partition 0.
    g = plan.op_graph
    free = colocation_groups(g).free
    after, stack = set(), [g.op_index[logits.name]]
    while stack:
        for c in g.consumer_ops(stack.pop()):
            if c not in after and not g.ops[c].is_gradient:
                after.add(c)
                stack.append(c)
    loss_ops = [i for i in after if not free[i] and g.ops[i].type not in ("Identity", "IdentityN")]
    assert loss_ops and all(plan.partition_of_op[i] == last for i in loss_ops)


# --------------------------------------------------------------------------- manual placement


class ManualModel(smp.DistributedModel):
    """Explicit placement: d0 + relu on 1, d1 on 2, d2 outside any block, head on 0."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d0 = keras.layers.Dense(16, name="d0")
        self.d1 = keras.layers.Dense(16, name="d1")
        self.d2 = keras.layers.Dense(16, name="d2")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        with smp.partition(1):
            h = self.d0(x)
            h = tf.nn.relu(h, name="manual_relu")
        with smp.partition(2):
            h = self.d1(h)
        h = self.d2(h)
        with smp.partition(0):
            return self.head(h)


def test_manual_placement_is_honoured():
    keras.utils.set_random_seed(0)
    model = ManualModel()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(4, 4)).astype("float32")
    model(x)
    default = 3
    plan = trace_plan(model, keras.losses.MeanSquaredError(), x, y,
                      auto_partition=False, default_partition=default)
    check_all(plan, default_partition=default)

    g = plan.op_graph
    free = colocation_groups(g).free
    part = plan.partition_of_op
    expected_layer = {"d0": 1, "d1": 2, "d2": default, "head": 0}
    seen = set()
    for op in g.ops:
        if free[op.index]:
            continue
        fwd = g.ops[op.forward] if op.forward is not None else op
        if op.is_gradient and op.forward is not None:
            assert part[op.index] == part[op.forward], op.name
        # By name, independently of the recorded blocks.
        m = re.search(r"(?:^|/)(d0|d1|d2|head)(?:_\d+)?/", fwd.name)
        if m:
            assert part[op.index] == expected_layer[m.group(1)], op.name
            seen.add(m.group(1))
        elif "manual_relu" in fwd.name:
            assert part[op.index] == 1, op.name
            seen.add("relu")
        elif fwd.name.startswith("mean_squared_error/sub"):
            # The loss's difference reads only the head's bias addition: an
            # arithmetic chain (groups rule 6), which joins the head's block.
            assert fwd.manual_partition is None, op.name
            assert part[op.index] == 0, op.name
            seen.add("loss difference")
        elif not op.is_gradient or op.forward is not None:
            # Outside every block (the rest of the loss, the step outputs):
            # default partition.
            assert fwd.manual_partition is None, op.name
            assert part[op.index] == default, op.name
        # Ops recorded in a block are on that block's partition.
        if fwd.manual_partition is not None:
            assert part[op.index] == fwd.manual_partition, op.name
    assert seen == {"d0", "d1", "d2", "head", "relu", "loss difference"}
    by_var = plan.partition_of_variable()
    assert by_var[model.d0.kernel.path] == 1
    assert by_var[model.d1.kernel.path] == 2
    assert by_var[model.d2.kernel.path] == default
    assert by_var[model.head.kernel.path] == 0


class SharedLayerModel(smp.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.shared = keras.layers.Dense(8, name="shared")

    def call(self, x):
        with smp.partition(0):
            h = self.shared(x)
        with smp.partition(1):
            return self.shared(h)


def test_a_shared_layer_called_in_two_blocks_runs_each_call_in_its_block():
    # The second call reads the kernel and bias again: the reads stay with
    # the variables (partition 0), the call's ops run where the user put them.
    keras.utils.set_random_seed(0)
    model = SharedLayerModel()
    x = np.ones((4, 8), "float32")
    model(x)
    plan = trace_plan(model, keras.losses.MeanSquaredError(), x, x,
                      auto_partition=False, default_partition=0)
    check_all(plan, default_partition=0)
    g = plan.op_graph
    part = plan.partition_of_op
    matmuls = [op for op in g.ops if op.type == "MatMul" and not op.is_gradient]
    assert len(matmuls) == 2
    assert [part[op.index] for op in matmuls] == [0, 1]
    by_var = plan.partition_of_variable()
    assert by_var[model.shared.kernel.path] == 0 and by_var[model.shared.bias.path] == 0


# --------------------------------------------------------------------------- objectives


def conv_then_dense() -> keras.Model:
    """Flops live in the convolutions, bytes in one wide dense layer."""
    inp = keras.Input((16, 16, 8))
    h = inp
    for i in range(4):
        h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name=f"conv{i}")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    h = keras.layers.Dense(1024, activation="relu", name="wide_in")(h)
    h = keras.layers.Dense(1024, activation="relu", name="wide")(h)  # 4 MiB of weights
    out = keras.layers.Dense(10, name="head")(h)
    return smp.DistributedModel(inp, out)


@pytest.mark.parametrize("contiguous", [True, False])
def test_memory_and_speed_balance_different_things(contiguous):
    keras.utils.set_random_seed(0)
    model = conv_then_dense()
    x, y = image_data((16, 16, 8), 10)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    speed = trace_plan(model, loss, x, y, optimize="speed", contiguous=contiguous)
    memory = replan(speed, optimize="memory", contiguous=contiguous)
    # replan reproduces what smp.step does for the same config.
    assert replan(speed, optimize="speed", contiguous=contiguous).partition_of_op == speed.partition_of_op
    for plan in (speed, memory):
        check_all(plan)

    def peak(plan, key):
        rows = plan.summary()
        return max(r[key] for r in rows) / sum(r[key] for r in rows)

    assert speed.partition_of_op != memory.partition_of_op
    # speed: flops spread over the partitions, the wide layer's bytes land together.
    assert peak(speed, "flops") < peak(memory, "flops")
    assert peak(memory, "variable_bytes") <= peak(speed, "variable_bytes")
    # memory: the wide layer is (about) alone on its partition.
    wide = memory.partition_of_variable()[model.get_layer("wide").kernel.path]
    conv_parts = {memory.partition_of_variable()[model.get_layer(f"conv{i}").kernel.path] for i in range(4)}
    assert wide not in conv_parts
    assert peak(speed, "flops") < 0.5


def test_memory_contiguous_leaves_no_partition_empty():
    keras.utils.set_random_seed(0)
    model = conv_then_dense()
    x, y = image_data((16, 16, 8), 10)
    plan = trace_plan(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y,
                      optimize="memory", contiguous=True)
    check_all(plan)
    check_every_partition_used(plan)


@pytest.mark.benchmark
def test_benchmark_quick_runs():
    """`benchmarks/partitioner/bench.py --quick` prints its table (run with -m benchmark)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "partitioner", "bench.py"), "--quick"],
        capture_output=True, text=True, timeout=600, cwd=root,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| model")
    rows = [l for l in lines if l.startswith("| ") and not l.startswith("| model")]
    assert len(rows) >= 12
    assert any("eq-layers" in r for r in rows) and any("eq-ops" in r for r in rows)
    assert "target checks PASS" in out.stdout


class GatedBlock(keras.layers.Layer):
    """A composite layer: its own ops (the gated product, the residual
    addition) lie between the calls of its sublayers."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(width, activation="relu", name="up")
        self.gate = keras.layers.Dense(width, name="gate")
        self.down = keras.layers.Dense(width, name="down")

    def call(self, x):
        return x + self.down(self.up(x) * self.gate(x))


def test_the_own_ops_of_a_composite_layer_are_its_glue():
    inp = keras.Input((8,))
    h = GatedBlock(8, name="block")(keras.layers.Dense(8, name="embed")(inp))
    model = smp.DistributedModel(inp, keras.layers.Dense(2, name="head")(h))
    x, y = np.ones((4, 8), "float32"), np.ones((4, 2), "float32")
    plan = trace_plan(model, keras.losses.MeanSquaredError(), x, y)
    forward = [op for op in plan.op_graph.ops if not op.is_gradient and op.kind == "op"]
    glue = {op.type for op in forward if op.glue}
    # The block's product and residual addition; nothing of its sublayers
    # (Dense ops, their variable reads) nor of the leaf layers around it.
    assert glue == {"Mul", "AddV2"}
    for op in forward:
        if op.layer is not None and not op.layer.startswith("block"):
            assert not op.glue, op.name
    # Each sublayer's ops are still one group.
    groups = colocation_groups(plan.op_graph)
    for name in ("up", "gate", "down", "embed", "head"):
        ids = {groups.group_of[op.index] for op in forward
               if op.layer is not None and op.layer.startswith(name + "#") and groups.group_of[op.index] >= 0}
        assert len(ids) == 1, (name, ids)
