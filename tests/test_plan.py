"""`smp.plan`: candidates, their predicted times and peaks, the ranking,
measuring the best, learning from the run, and the config key ``auto``."""

import dataclasses

import numpy as np
import pytest

import smp_tf as smp
from smp_tf.planner.resources import ResourceGraph
from smp_tf.planner.search import Candidate, candidates, interpolate_graph, simulate_shared


def _cluster(devices=4, memory=2**30, hosts=1, cores=None, speed=1e11):
    def cpu(name):
        return {"name": name, "kind": "CPU", "memory": memory, "overhead": 2e-6,
                "flops": {"matmul": speed, "conv": speed, "elementwise": speed / 20}}

    spec = {"hosts": {f"h{h}": {"devices": [cpu(f"CPU:{i}") for i in range(devices // hosts)]} for h in range(hosts)},
            "links": {"host": {"bandwidth": 1e10, "latency": 1e-5}, "network": {"bandwidth": 1e9, "latency": 5e-5}}}
    if cores is not None:
        for h in spec["hosts"].values():
            h["cores"] = cores
    return spec


def _mlp(width=64, layers=8, batch=16):
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((width,))
    h = inp
    for i in range(layers):
        h = keras.layers.Dense(width, activation="relu", name=f"d{i}")(h)
    model = smp.DistributedModel(inp, keras.layers.Dense(width, name="out")(h))

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    return model, step, x, y


def _tiny_gpt_lm():
    """The `smp.step` of a one-block keras_hub GPT-2 language model
    (vocabulary 64, width 16, sequence 8)."""
    import keras
    import keras_hub
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, dropout=0.0, max_sequence_length=8)
    inputs = {"token_ids": keras.Input((8,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((8,), dtype="int32", name="padding_mask")}
    gpt = smp.DistributedModel(inputs, backbone.token_embedding(backbone(inputs), reverse=True))

    @smp.step
    def lm(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, gpt(x), from_logits=True))
        return loss, tape.gradient(loss, gpt.trainable_variables)

    return lm


def _single_device(model, x, y):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return float(loss), [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


# -- candidates and the simulation (plain Python) ------------------------------------------

def test_candidates_cover_the_dimensions_within_the_devices():
    cands, skipped = candidates(4, 16)
    assert cands and all(c.devices <= 4 for c in cands)
    assert {c.partitions for c in cands} == {1, 2, 4} and {c.tensor_parallel_degree for c in cands} == {1, 2, 4}
    assert {c.replicas for c in cands} == {1, 2, 4}
    assert {c.pipeline for c in cands if c.partitions > 1} == {"interleaved", "simple", "zero_bubble"}
    assert {c.recompute for c in cands if c.partitions > 1} == {"never", "selective", "full"}
    for c in cands:
        assert (16 // c.replicas) % c.microbatches == 0
        assert c.partitions == 1 or c.microbatches >= c.partitions
        assert c.virtual_stages == 1 or c.microbatches % c.partitions == 0
        # One partition: one task per micro-batch, nothing to recompute or schedule.
        assert c.partitions > 1 or (c.recompute == "never" and c.microbatches == 1 and c.virtual_stages == 1)
    assert Candidate(2, 1, 1, 4, "interleaved", 2).config() == {
        "partitions": 2, "microbatches": 4, "pipeline": "interleaved", "recompute": "never", "virtual_stages": 2}
    # A batch that the replicas cannot share is listed with its reason.
    _, skipped = candidates(4, 6, replicas=[4])
    assert skipped and skipped[0].kind == "batch" and "not a multiple of R=4" in skipped[0].reason
    # On more than 8 devices every candidate uses them all.
    assert all(c.devices == 16 for c in candidates(16, 64)[0])
    with pytest.raises(ValueError, match="num_devices must be at least 1"):
        candidates(0, 8)


def test_devices_sharing_cores_slow_down_while_they_run_at_once():
    from smp_tf.schedules import Action

    order = {0: [Action(0, 0, 0)], 1: [Action(1, 0, 0)]}
    cost = lambda a: 1.0  # noqa: E731
    # Two devices, two cores: side by side in 1 s; on one core: 2 s.
    assert simulate_shared(order, {}, cost, {0: "h", 1: "h"}, {"h": 2}) == pytest.approx(1.0)
    elapsed = {}
    assert simulate_shared(order, {}, cost, {0: "h", 1: "h"}, {"h": 1}, elapsed) == pytest.approx(2.0)
    assert elapsed[Action(0, 0, 0)] == pytest.approx(2.0)
    # A dependency: the second waits for the first, which then runs alone at full speed.
    chained = {0: [Action(0, 0, 0)], 1: [Action(1, 0, 0)]}
    assert simulate_shared(chained, {(1, 0): [(0, 0)]}, cost, {0: "h", 1: "h"}, {"h": 1}) == pytest.approx(2.0)
    # An action whose ops can use two cores takes half its cost alone on two;
    # beside another, it takes the core the other leaves.
    assert simulate_shared({0: [Action(0, 0, 0)]}, {}, cost, {0: "h"}, {"h": 2}, cap=lambda a: 2.0) == pytest.approx(0.5)
    elapsed = {}
    assert simulate_shared(order, {}, cost, {0: "h", 1: "h"}, {"h": 3}, elapsed,
                           cap=lambda a: 2.0 if a.partition == 0 else 1.0) == pytest.approx(1.0)
    assert elapsed[Action(0, 0, 0)] == pytest.approx(0.5)
    elapsed = {}
    # Uneven: 1 s and 3 s on one core: both at half speed for 2 s, then the long one alone.
    costs = {0: 1.0, 1: 3.0}
    assert simulate_shared(order, {}, lambda a: costs[a.partition], {0: "h", 1: "h"}, {"h": 1}) == pytest.approx(4.0)


def test_a_graph_at_another_micro_batch_size_is_interpolated_exactly():
    """Every op's flops and every tensor's shape and bytes of the graph
    extrapolated from two traces equal a third trace's (an MLP and a GPT-2
    block, whose attention products are batched einsums)."""
    from smp_tf.planner.plan import _Tracer

    _, step, x, y = _mlp(batch=32)
    lm = _tiny_gpt_lm()
    tokens = {"token_ids": np.zeros((32, 8), "int32"), "padding_mask": np.ones((32, 8), "int32")}
    for fn, args in ((step, (x, y)), (lm, (tokens, np.zeros((32, 8), "int32")))):
        tracer = _Tracer(fn, args, {}, 32, None)
        mid, lo, hi = (tracer._traced_info(b, 1).graph for b in (4, 8, 32))
        got = interpolate_graph(lo, 8, hi, 32, 4)
        assert got is not None
        # Op by op (by name: at a small size TensorFlow may fold a constant
        # that a larger trace keeps, e.g. an attention mask's ones_like).
        traced = {op.name: op for op in mid.ops}
        common = [op for op in got.ops if op.name in traced and traced[op.name].type == op.type]
        assert len(common) >= len(mid.ops) - 4
        assert [op.flops for op in common] == pytest.approx([traced[op.name].flops for op in common], rel=1e-9)
        assert got.total_flops == pytest.approx(mid.total_flops, rel=1e-3)  # the folded ones_like
        for op in common:
            want = traced[op.name]
            assert [(got.tensors[t].shape, got.tensors[t].bytes) for t in op.outputs] == [
                (mid.tensors[t].shape, mid.tensors[t].bytes) for t in want.outputs], op.name
    # Graphs that differ in structure are not interpolated.
    assert interpolate_graph(lo, 8, mid.__class__(mid.ops[:-1], mid.tensors, {}), 4, 2) is None


@pytest.mark.parametrize("t, sequence_parallel", [(2, False), (4, False), (2, True)])
def test_a_sharded_graph_scaled_to_another_micro_batch_size_equals_sharding_it_there(t, sequence_parallel):
    """The planner shards a step once per degree, at the larger anchor
    size: the graph at another size, scaled as the unsharded graphs scale,
    has every op's flops and every tensor's shape and bytes of the step
    traced and sharded at that size (an MLP; a GPT-2 LM with its
    vocabulary-parallel cross-entropy and masked lookup, special lowerings
    whose nodes take their op's sizes)."""
    from smp_tf.planner.plan import _Tracer
    from smp_tf.planner.search import scale_sharded

    _, step, x, y = _mlp(batch=32)
    lm = _tiny_gpt_lm()
    tokens = {"token_ids": np.zeros((32, 8), "int32"), "padding_mask": np.ones((32, 8), "int32")}
    for fn, args in ((step, (x, y)), (lm, (tokens, np.zeros((32, 8), "int32")))):
        tracer = _Tracer(fn, args, {}, 32, None, sizes=[8, 32])
        real = tracer._traced_info(8, t, sequence_parallel).graph
        got = scale_sharded(tracer._traced_info(32, t, sequence_parallel).graph, tracer(32, 1).graph,
                            tracer(8, 1).graph)
        assert got is not None and [op.name for op in got.ops] == [op.name for op in real.ops]
        assert [op.flops for op in got.ops] == pytest.approx([op.flops for op in real.ops], rel=1e-12)
        assert [(x.shape, x.bytes) for x in got.tensors] == [(x.shape, x.bytes) for x in real.tensors]
        # The tracer itself scales rather than shards again.
        sharded, shard = [], tracer._traced_info
        tracer._traced_info = lambda b, t, *a: sharded.append((b, t)) or shard(b, t, *a)
        assert tracer(8, t, sequence_parallel).graph.total_flops == pytest.approx(real.total_flops, rel=1e-12)
        assert (8, t) not in sharded and (32, t) in sharded
    # Unsharded graphs that differ in structure are not scaled.
    plain = tracer(8, 1).graph
    assert scale_sharded(got, plain, plain.__class__(plain.ops[:-1], plain.tensors, {})) is None


def test_einsum_flops_come_from_its_equation():
    from smp_tf.graph_view import estimate_flops

    # Attention scores: (b, h, s, d) x (b, h, t, d) -> (b, h, s, t): 2 * b*h*s*t * d.
    shapes = [(4, 2, 8, 16), (4, 2, 8, 16)]
    assert estimate_flops("Einsum", shapes, [(4, 2, 8, 8)], "bhsd,bhtd->bhst") == 2 * 4 * 2 * 8 * 8 * 16
    # A projection: (b, s, m) x (m, h, d) -> (b, s, h, d): 2 * out * m.
    assert estimate_flops("Einsum", [(4, 8, 32), (32, 2, 16)], [(4, 8, 2, 16)], "bsm,mhd->bshd") == 2 * 4 * 8 * 32 * 32
    # Without an equation (or with an ellipsis) the estimate from the sizes alone.
    assert estimate_flops("Einsum", shapes, [(4, 2, 8, 8)], "...d,...d->...") == estimate_flops(
        "Einsum", shapes, [(4, 2, 8, 8)])


def test_the_resource_graph_keeps_cores_runtime_and_bandwidth():
    spec = _cluster(cores=2)
    spec["hosts"]["h0"]["devices"][0]["bandwidth"] = 2e10
    spec["runtime"] = {"step": 1e-4, "action": 2e-5}
    g = ResourceGraph.from_dict(spec)
    assert g.cores == {"h0": 2} and g.runtime == {"step": 1e-4, "action": 2e-5}
    assert g.device("h0/CPU:0").bandwidth == 2e10 and g.device("h0/CPU:1").bandwidth == 0
    assert ResourceGraph.from_dict(g.to_dict()).to_dict() == g.to_dict()
    assert "share 2 core(s)" in str(g) and "step 100.0 us" in str(g)
    bad = _cluster()
    bad["runtime"] = {"steps": 1.0}
    with pytest.raises(ValueError, match="runtime has unknown key 'steps'"):
        ResourceGraph.from_dict(bad)
    bad = _cluster(cores=0)
    with pytest.raises(ValueError, match=r"hosts\['h0'\].cores must be positive"):
        ResourceGraph.from_dict(bad)


def test_a_tensor_crosses_to_another_device_of_the_stage_once():
    from smp_tf.graph_view import OpGraph
    from smp_tf.planner.search import GraphInfo, _Timer
    from smp_tf.rewrite import Task

    # `a` on the stage's first device is read by two ops of its second.
    graph = OpGraph.from_spec([
        {"name": "a", "bytes": 10**6, "flops": 0},
        {"name": "b", "inputs": ["a"], "flops": 0},
        {"name": "c", "inputs": ["a"], "flops": 0},
        {"name": "d", "inputs": ["b", "c"], "bytes": 10**6, "flops": 0},
    ])
    cluster = ResourceGraph.from_dict(_cluster(devices=2))
    task = Task(0, 0, members=[0, 1, 2, 3])

    def exchange(shards):
        timer = _Timer(GraphInfo(graph, [3], shard_of_op=shards), cluster, [["h0/CPU:0", "h0/CPU:1"]])
        timer.task_seconds(task, [0, 0, 0, 0])
        return timer.parts[task.key][2]

    hop = cluster.link("h0/CPU:0", "h0/CPU:1").seconds(10**6)
    assert exchange([0, 0, 0, 0]) == 0.0
    assert exchange([0, 1, 1, 1]) == pytest.approx(hop)  # once, not once per reader
    # And `d`, back on the first device, reads `b` and `c`: two tensors.
    assert exchange([0, 1, 1, 0]) == pytest.approx(hop + 2 * cluster.link("h0/CPU:1", "h0/CPU:0").seconds(4))


def test_stages_on_other_devices_of_the_same_kinds_share_their_task_compute():
    from smp_tf.graph_view import OpGraph
    from smp_tf.planner.search import GraphInfo, _Timer
    from smp_tf.rewrite import Task

    graph = OpGraph.from_spec([{"name": "a", "bytes": 10**6, "flops": 1e6},
                               {"name": "b", "inputs": ["a"], "flops": 2e6}])
    cluster = ResourceGraph.from_dict(_cluster(devices=4))
    info = GraphInfo(graph, [1], shard_of_op=[0, 1])
    task = Task(0, 0, members=[0, 1])
    shared = {}
    first = _Timer(info, cluster, [["h0/CPU:0", "h0/CPU:1"]], shared=shared).task_seconds(task, [0, 0])
    computed = set(shared["task compute"])
    second = _Timer(info, cluster, [["h0/CPU:2", "h0/CPU:3"]], shared=shared).task_seconds(task, [0, 0])
    assert second == first and len(computed) == 1
    assert set(shared["task compute"]) == computed
    # A device of another kind is computed on its own.
    spec = _cluster(devices=4)
    spec["hosts"]["h0"]["devices"][3]["flops"] = {"matmul": 1e10, "conv": 1e10, "elementwise": 1e9}
    slow = ResourceGraph.from_dict(spec)
    third = _Timer(info, slow, [["h0/CPU:2", "h0/CPU:3"]], shared=shared).task_seconds(task, [0, 0])
    assert third > first


# -- the planner on declared clusters -----------------------------------------------------

def test_the_plan_ranks_by_predicted_time_and_never_puts_a_misfit_first():
    model, step, x, y = _mlp(width=128, layers=8, batch=16)
    smp.init({"partitions": 1})
    plan = smp.plan(step, x, y, cluster=_cluster(), pipelines=["interleaved"], virtual_stages=[1])
    rows = plan.rows
    assert rows and rows[0].fits and plan.best is rows[0]
    fitting = [r for r in rows if r.fits]
    assert [r.step_time for r in fitting] == sorted(r.step_time for r in fitting)
    for r in rows:
        assert r.peak and all(r.peak[n] <= r.capacity[n] for n in r.peak) == r.fits
        assert r.config["partitions"] == r.candidate.partitions and len(r.peak) == r.candidate.devices
    text = str(plan)
    assert "rank" in text and "step ms" in text and "fits" in text and "Plan: 4 device(s)" in text

    # Memory so small that one device cannot hold the model with Adam's state:
    # every fitting row splits it, and the rows predicted not to fit come last.
    need = next(r for r in rows if r.candidate.devices == 1).max_peak
    tight = smp.plan(step, x, y, cluster=_cluster(memory=int(need * 0.6)), pipelines=["interleaved"],
                     virtual_stages=[1], replicas=[1], microbatches=[1, 2, 4])
    assert tight.best.fits and tight.best.max_peak <= need * 0.6
    assert all(r.candidate.partitions * r.candidate.tensor_parallel_degree > 1 for r in tight.rows if r.fits)
    firsts = [r.fits for r in tight.rows]
    assert firsts == sorted(firsts, reverse=True)
    # Nothing fits: a clear error.
    none = smp.plan(step, x, y, cluster=_cluster(memory=1024), partitions=[1, 2], replicas=[1],
                    tensor_parallel_degrees=[1])
    with pytest.raises(ValueError, match="No candidate is predicted to fit"):
        none.best


def test_the_best_rows_config_runs_and_matches_one_device():
    model, step, x, y = _mlp(width=64, layers=6, batch=16)
    smp.init({"partitions": 1})
    want_loss, want_grads = _single_device(model, x, y)
    plan = smp.plan(step, x, y, cluster=_cluster(devices=4), replicas=[1], recompute=["never", "full"])
    ran = 0
    for row in [plan.best] + [r for r in plan.rows if r.candidate.partitions > 1][:1]:
        smp.init(row.config)
        loss, grads = step(x, y)
        assert float(loss.reduce_mean()) == pytest.approx(want_loss, rel=1e-5)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(g.accumulate().numpy(), w, rtol=1e-4, atol=1e-6)
        ran += 1
    assert ran == 2


def test_each_row_predicts_the_split_its_config_runs():
    """The runtime splits the graph of one micro-batch, and which ops join a
    variable's group can depend on the bytes they exchange: a tied output
    projection stays with its embedding at small micro-batches (moving the
    matrix would cost more than moving the activations) and not at large
    ones. Each row's prediction is for the split `smp.init(row.config)`
    makes, so rows of other micro-batch sizes come to other splits."""
    import tensorflow as tf

    from tests.models import TiedTransformer

    model = TiedTransformer(vocab=64, dim=32)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, size=(8, 6)).astype("int32")
    y = rng.integers(0, 64, size=(8, 6)).astype("int32")
    model(x[:2])

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        return loss, tape.gradient(loss, model.trainable_variables)

    smp.init({"partitions": 1})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2), partitions=[2], microbatches=[1, 8], replicas=[1],
                    tensor_parallel_degrees=[1], pipelines=["simple"], virtual_stages=[1], recompute=["never"])
    splits = {}
    for row in plan.rows:
        smp.init(row.config)
        assert list(step.get_plan(x, y).partition_of_op) == list(row.partition_of_op), row.candidate.label()
        splits[row.candidate.microbatches] = tuple(row.partition_of_op)
    assert sorted(splits) == [1, 8] and splits[1] != splits[8]


def test_a_faster_device_and_a_slow_network_shape_the_plan():
    """On two hosts joined by a slow network, with tensor parallelism
    allowed, a stage's devices share a host; and the predicted time falls
    when the devices are faster."""
    _, step, x, y = _mlp(width=128, layers=8, batch=16)
    smp.init({"partitions": 1})
    slow = smp.plan(step, x, y, cluster=_cluster(devices=4, hosts=2), replicas=[1], keep=8)
    for r in slow.rows:
        for names in r.devices.values():
            assert len({n.split("/")[0] for n in names}) == 1
    fast = smp.plan(step, x, y, cluster=_cluster(devices=4, hosts=2, speed=4e11), replicas=[1], keep=8)
    assert fast.best.step_time < slow.best.step_time


def test_skipped_candidates_are_listed_with_their_reasons():
    _, step, x, y = _mlp(batch=16)
    smp.init({"partitions": 1})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2), keep=2, replicas=[1], partitions=[1, 2, 4])
    kinds = {s.kind for s in plan.skipped}
    assert "slower" in kinds
    assert all(s.reason for s in plan.skipped)
    assert "skipped" in str(plan)


# -- this host: measure, learn, auto ---------------------------------------------------------

def test_measure_runs_the_best_rows_and_keeps_the_fastest():
    _, step, x, y = _mlp(width=64, layers=4, batch=8)
    smp.init({"partitions": 2})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2), replicas=[1], pipelines=["interleaved"],
                    virtual_stages=[1], recompute=["never"])
    chosen = plan.measure(k=2, steps=2, warmup=1)
    measured = [r for r in plan.rows if r.measured is not None]
    assert len(measured) == 2 and chosen is min(measured, key=lambda r: r.measured) and plan.best is chosen
    assert smp.current_config().partitions == chosen.config["partitions"]
    assert "<" in str(plan)
    with pytest.raises(ValueError, match="k >= 1"):
        plan.measure(k=0)
    with pytest.raises(ValueError, match="rounds >= 1"):
        plan.measure(rounds=0)


def test_measure_keeps_each_rows_fastest_round(monkeypatch):
    """A burst that slows one round of a row (here the first row's first
    round, as a process's first compile can) does not decide the choice:
    rounds alternate their order, and a row's figure is its fastest."""
    import smp_tf.planner.plan as plan_module

    _, step, x, y = _mlp(width=64, layers=4, batch=8)
    smp.init({"partitions": 2})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2), replicas=[1], pipelines=["interleaved"],
                    virtual_stages=[1], recompute=["never"])
    first, second = [r for r in plan.rows if r.fits][:2]
    seen = []
    times = {(0, first.candidate): 10.0, (0, second.candidate): 2.0,
             (1, second.candidate): 3.0, (1, first.candidate): 1.0}

    def fake_time_step(step, args, kwargs, steps, warmup):
        cfg = smp.current_config()
        current = next(r for r in (first, second) if all(getattr(cfg, k) == v for k, v in r.config.items())
                       and cfg.tensor_parallel_degree == r.candidate.tensor_parallel_degree)
        seen.append(current.candidate)
        return times[(len(seen) - 1) // 2, current.candidate]

    monkeypatch.setattr(plan_module, "time_step", fake_time_step)
    chosen = plan.measure(k=2, profile=False)
    assert seen == [first.candidate, second.candidate, second.candidate, first.candidate]
    assert (first.measured, second.measured) == (1.0, 2.0) and chosen is first


def test_the_cluster_learns_from_measured_runs():
    """Measured tasks that take twice their predicted operations' time plus
    5 us per op on one host, and what was predicted on the other, give
    back those figures; a second plan on the learned cluster predicts the
    slower host."""
    from smp_tf.planner.learn import Run, fit, refine

    assert fit([(1.0, 10, 2.0 + 10e-6), (3.0, 50, 6.0 + 50e-6)], 0.0) == pytest.approx((2.0, 1e-6))
    # Negative per-op figures fall back to the given overhead.
    assert fit([(1.0, 10, 1.0), (2.0, 1, 2.5)], 3e-6)[1] == 3e-6

    spec = _cluster(devices=2, hosts=2)
    for host in spec["hosts"].values():
        for d in host["devices"]:
            d["ops"] = {"Relu": 4e9}  # an op type timed on its own is learned with the rest
    g = ResourceGraph.from_dict(spec)
    _, step, x, y = _mlp(width=64, layers=4, batch=8)
    smp.init({"partitions": 1})
    dims = dict(partitions=[2], replicas=[1], tensor_parallel_degrees=[1], pipelines=["interleaved"],
                virtual_stages=[1], recompute=["never"], microbatches=[2])
    plan = smp.plan(step, x, y, cluster=g, **dims)
    row = plan.rows[0]
    host_of = {p: row.devices[(0, p)][0].split("/")[0] for p in range(2)}
    measured = {}
    for key, (work, ops, fixed) in row.task_parts.items():
        if host_of[key[0]] == "h0":
            measured[key] = 2.0 * work + 5e-6 * ops + fixed
        else:
            measured[key] = work + 2e-6 * ops + fixed
    run = Run(row, measured, gap=3e-5, span=0.01, step=None)
    learned = refine(g, [run])
    slow, same = (learned.device(row.devices[(0, p)][0]) for p in (0, 1))
    was = g.devices[0]
    assert slow.flops["matmul"] == pytest.approx(was.flops["matmul"] / 2, rel=1e-6)
    assert slow.ops["Relu"] == pytest.approx(was.ops["Relu"] / 2, rel=1e-6)
    assert slow.overhead == pytest.approx(5e-6, rel=1e-6)
    assert same.flops["matmul"] == pytest.approx(was.flops["matmul"], rel=1e-6)
    assert same.overhead == pytest.approx(2e-6, rel=1e-6)
    assert learned.runtime["action"] == 3e-5
    assert learned.source == "learned"
    again = smp.plan(step, x, y, cluster=learned, **dims)
    assert again.rows[0].step_time > row.step_time
    # A step measured by the clock 1.5 times slower than predicted sets the
    # level: a plan on the learned cluster predicts it (the profile's
    # probes slow the profiled steps, whose tasks give only the hosts' ratio).
    one = ResourceGraph.from_dict(_cluster(devices=2))
    first = smp.plan(step, x, y, cluster=one, **dims).rows[0]
    as_predicted = {k: v for k, v in first.task_elapsed.items()}
    timed = Run(first, as_predicted, gap=None, span=None, step=1.5 * first.step_time)
    level = smp.plan(step, x, y, cluster=refine(one, [timed]), **dims)
    assert level.rows[0].step_time == pytest.approx(1.5 * first.step_time, rel=0.05)
    # Profiled tasks 1.6 times slower (the probes) with a per-op cost four
    # times the calibrated one, and a step the clock measured 1.2 times the
    # prediction: the fitted per-op cost is scaled with the slowdown, so the
    # learned cluster predicts the measured step (with the per-op cost left
    # out of the level it predicted far more).
    per_op = 4 * one.devices[0].overhead
    probed = {k: 1.6 * (work + per_op * ops) * first.task_elapsed[k] / first.task_seconds[k] + fixed
              for k, (work, ops, fixed) in first.task_parts.items()}
    slow_ops = Run(first, probed, gap=None, span=None, step=1.2 * first.step_time)
    learned = refine(one, [slow_ops])
    # Against the operations, the ops cost four times what was calibrated.
    was, now = one.devices[0], learned.devices[0]
    assert now.overhead * now.flops["matmul"] == pytest.approx(4 * was.overhead * was.flops["matmul"], rel=0.05)
    again = smp.plan(step, x, y, cluster=learned, **dims)
    assert again.rows[0].step_time == pytest.approx(1.2 * first.step_time, rel=0.05)
    with pytest.raises(ValueError, match="at least one measured run"):
        refine(g, [])
    # A probed cluster's cost per op run is not the devices' speed: the level
    # leaves it out, and the learned cluster keeps it.
    spec = _cluster(devices=2)
    spec["runtime"] = {"dispatch": 5e-6, "parallel": 0.5}
    probed_cluster = ResourceGraph.from_dict(spec)
    first = smp.plan(step, x, y, cluster=probed_cluster, **dims).rows[0]
    dispatch = first.times["dispatch"]
    assert dispatch > 0.1 * first.step_time
    timed = Run(first, dict(first.task_elapsed), gap=None, span=None,
                step=1.5 * (first.step_time - dispatch) + dispatch)
    learned = refine(probed_cluster, [timed])
    assert learned.runtime["dispatch"] == 5e-6 and learned.runtime["parallel"] == 0.5
    again = smp.plan(step, x, y, cluster=learned, **dims).rows[0]
    assert again.step_time == pytest.approx(timed.step, rel=0.05)
    assert again.times["dispatch"] == pytest.approx(dispatch)


def test_auto_plans_at_the_first_call_and_keeps_the_numbers():
    model, step, x, y = _mlp(width=64, layers=6, batch=16)
    smp.init({"partitions": 1})
    want_loss, _ = _single_device(model, x, y)
    smp.init({"auto": True, "cluster": _cluster(devices=4)})
    loss, grads = step(x, y)
    assert float(loss.reduce_mean()) == pytest.approx(want_loss, rel=1e-5)
    assert step.auto_plan is not None
    cfg = smp.current_config()
    assert not cfg.auto and cfg.partitions == step.auto_plan.best.candidate.partitions
    assert cfg.microbatches == step.auto_plan.best.candidate.microbatches
    assert cfg.cluster is not None  # the keys the planner does not choose stay


def test_plan_takes_a_compiled_model():
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((32,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    model = smp.DistributedModel(inp, keras.layers.Dense(4)(h))
    smp.init({"partitions": 1})
    with pytest.raises(ValueError, match="needs a compiled model"):
        smp.plan(model, np.zeros((8, 32), "float32"), np.zeros((8, 4), "float32"))
    model.compile(optimizer="adam", loss="mse")
    plan = smp.plan(model, np.zeros((8, 32), "float32"), np.zeros((8, 4), "float32"), cluster=_cluster(devices=2),
                    replicas=[1])
    assert plan.best.fits and plan.rows
    smp.init(plan.best.config)
    model.fit(np.zeros((8, 32), "float32"), np.zeros((8, 4), "float32"), epochs=1, verbose=0)


def test_plan_rejects_what_it_cannot_plan():
    with pytest.raises(TypeError, match="needs an `smp.step` function"):
        smp.plan(lambda x: x, np.zeros((4, 2)))
    _, step, x, y = _mlp()
    with pytest.raises(TypeError, match="cluster must be a ResourceGraph"):
        smp.plan(step, x, y, cluster=42)


# -- the probe: the step's own cost per op run ---------------------------------------------

def test_a_dispatch_cost_adds_to_each_row_per_op_it_runs():
    _, step, x, y = _mlp(width=64, layers=4, batch=16)
    smp.init({"partitions": 1})
    dims = dict(replicas=[1], recompute=["never"], keep=1000)
    plain = smp.plan(step, x, y, cluster=_cluster(devices=4), **dims)
    spec = _cluster(devices=4)
    spec["runtime"] = {"dispatch": 3e-6}
    costly = smp.plan(step, x, y, cluster=spec, **dims)
    before = {r.candidate: r for r in plain.rows}
    assert len(before) > 4 and {r.candidate for r in costly.rows} == set(before)
    for row in costly.rows:
        was = before[row.candidate]
        ops = row.candidate.microbatches * sum(p[1] for p in row.task_parts.values())
        assert row.ops_run == was.ops_run == ops > 0
        assert row.times["dispatch"] == pytest.approx(3e-6 * ops) and was.times["dispatch"] == 0
        assert row.step_time == pytest.approx(was.step_time + 3e-6 * ops)
    # More micro-batches run the ops more often.
    by_m = {r.candidate.microbatches: r.ops_run for r in costly.rows if r.candidate.partitions == 2
            and r.candidate.tensor_parallel_degree == 1 and r.candidate.virtual_stages == 1}
    assert by_m[4] == 2 * by_m[2]
    g = ResourceGraph.from_dict(spec)
    assert g.with_runtime(step=1e-4).runtime == {"dispatch": 3e-6, "step": 1e-4} and g.runtime == {"dispatch": 3e-6}
    assert "dispatch 3.0 us" in str(g) and "parallel share 0.50" in str(g.with_runtime(parallel=0.5))
    with pytest.raises(ValueError, match="runtime\\['dispatch'\\]"):
        g.with_runtime(dispatch=-1e-6)
    with pytest.raises(ValueError, match="unknown key 'per_op'"):
        g.with_runtime(per_op=1e-6)
    with pytest.raises(ValueError, match="share of the ops' parallelism, 0 to 1"):
        g.with_runtime(parallel=1.5)


def test_the_probe_fit_recovers_the_cost_per_op_and_the_parallel_share():
    """Plain Python: predictions linear in both figures, each row moved by
    both; the fit finds the figures that make both rows what was measured."""
    from types import SimpleNamespace

    from smp_tf.planner.plan import fit_probe

    many = SimpleNamespace(name="many", ops_run=8000)
    one = SimpleNamespace(name="one", ops_run=1000)
    base = {"many": 0.080, "one": 0.100}
    gain = {"many": 0.002, "one": 0.030}   # what the whole parallelism saves

    def predict(row, dispatch, share):
        return base[row.name] - gain[row.name] * share + dispatch * row.ops_run

    d, share = 2.5e-6, 0.6
    dispatch, fitted = fit_probe(predict, many, predict(many, d, share), one, predict(one, d, share), rounds=12)
    assert dispatch == pytest.approx(d, rel=1e-3) and fitted == pytest.approx(share, abs=1e-3)
    # Faster than predicted at every figure: no cost, the whole parallelism.
    assert fit_probe(predict, many, 0.01, one, 0.01) == (0.0, 1.0)
    # Slower than with no parallelism at all: a share of 0.
    assert fit_probe(predict, many, 0.2, one, 0.5)[1] == 0.0
    # Without a one-device row the share stays 1.
    assert fit_probe(predict, many, 0.09, None, None) == (pytest.approx(0.012 / 8000), 1.0)


def test_a_probe_says_what_it_measured_in_one_line():
    from smp_tf.planner.plan import Probe

    probe = Probe("P2 t1 R1 M8 simple v1 never", {}, 0.094, 0.0688, 7992, 2.95e-6, 0.44,
                  "P1 t1 R1 M1 interleaved v1 never", 0.0934, 0.0701, 12.2)
    assert probe.summary() == (
        "P2 t1 R1 M8 simple v1 never measured 94.00 ms (predicted 68.80, 7992 ops run), "
        "P1 t1 R1 M1 interleaved v1 never 93.40 ms (predicted 70.10); "
        "fitted: dispatch 2.95 us per op run, parallel share 0.44")
    alone = dataclasses.replace(probe, one_device=None, one_device_measured=None, one_device_predicted=None)
    assert alone.summary() == ("P2 t1 R1 M8 simple v1 never measured 94.00 ms (predicted 68.80, 7992 ops run), "
                               "fitted: dispatch 2.95 us per op run, parallel share 0.44")


def test_a_probe_measures_two_rows_and_predicts_every_row_again(monkeypatch):
    """The probe runs the row that runs the most ops and the one device
    alone, fits the cost per op and the parallel share to their measured
    steps, and plans again with them; `smp.init` gets its config back."""
    import smp_tf.planner.plan as plan_module
    from smp_tf.planner.plan import one_device_row, probe_row

    _, step, x, y = _mlp(width=64, layers=4, batch=16)
    smp.init({"partitions": 2, "microbatches": 2})
    dims = dict(cluster=_cluster(devices=2, cores=2), replicas=[1], recompute=["never"], keep=1000)
    first = smp.plan(step, x, y, **dims)
    many, one = probe_row(first.rows), one_device_row(first.rows)
    assert many.ops_run == max(r.ops_run for r in first.rows if r.fits) and one.candidate.devices == 1
    # Where every row runs as many ops (the micro-batches fixed), the probe
    # still takes a row of several devices: the one device is the other probe
    # row; of those, the fewest actions, then the fastest.
    from types import SimpleNamespace

    def row(devices, tasks, step_time, fits=True):
        cand = SimpleNamespace(devices=devices, microbatches=4)
        return SimpleNamespace(candidate=cand, fits=fits, replicas=1, ops_run=400, step_time=step_time,
                               task_seconds=dict.fromkeys(range(tasks)))

    alone, two, two_fast = row(1, 1, 0.1), row(2, 3, 0.1), row(2, 3, 0.09)
    four, big = row(4, 7, 0.05), row(2, 1, 0.01, fits=False)
    assert probe_row([alone, two, two_fast, four, big]) is two_fast and one_device_row([alone, two, four]) is alone
    assert probe_row([alone]) is alone
    want = {many.candidate: many.step_time * 1.03, one.candidate: one.step_time * 1.15}
    ran = []

    def fake_time_step(step, args, kwargs, steps, warmup):
        cfg = smp.current_config()
        row = next(r for r in (many, one) if all(getattr(cfg, k) == v for k, v in r.config.items()))
        ran.append(row.candidate)
        return want[row.candidate]

    monkeypatch.setattr(plan_module, "time_step", fake_time_step)
    plan = smp.plan(step, x, y, probe=True, **dims)
    assert ran == [many.candidate, one.candidate, one.candidate, many.candidate, many.candidate, one.candidate]
    p = plan.probe
    assert p.label == many.candidate.label() and p.one_device == one.candidate.label()
    assert p.measured == pytest.approx(want[many.candidate]) and p.predicted == pytest.approx(many.step_time)
    assert p.dispatch > 0 and 0 <= p.parallel < 1
    assert plan.cluster.runtime["dispatch"] == p.dispatch and plan.cluster.runtime["parallel"] == p.parallel
    # Predicted again, both probed rows take what they measured.
    again = {r.candidate: r for r in plan.rows}
    assert again[many.candidate].step_time == pytest.approx(want[many.candidate], rel=2e-3)
    assert again[one.candidate].step_time == pytest.approx(want[one.candidate], rel=2e-3)
    assert again[many.candidate].times["dispatch"] == pytest.approx(p.dispatch * many.ops_run)
    # The second search shares the first's cache: it predicts what a fresh search on the fitted cluster does.
    fresh = {r.candidate: r.step_time for r in smp.plan(step, x, y, **{**dims, "cluster": plan.cluster}).rows}
    assert fresh == pytest.approx({c: r.step_time for c, r in again.items()}, rel=1e-12)
    assert smp.current_config().partitions == 2 and smp.current_config().microbatches == 2
    # Steps faster than predicted: no cost per op, the whole parallelism.
    monkeypatch.setattr(plan_module, "time_step", lambda *a: 1e-6)
    quick = smp.plan(step, x, y, probe=True, **dims).probe
    assert (quick.dispatch, quick.parallel) == (0.0, 1.0)


def test_a_probe_runs_the_step_for_real():
    _, step, x, y = _mlp(width=64, layers=4, batch=16)
    smp.init({"partitions": 2})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2), replicas=[1], recompute=["never"], probe=True)
    p = plan.probe
    assert p.measured > 0 and p.dispatch >= 0 and p.seconds > 0 and p.label in {r.candidate.label() for r in plan.rows}
    assert smp.current_config().partitions == 2
    no_room = _cluster(devices=2, memory=1024)
    with pytest.raises(ValueError, match="No fitting single-replica candidate to probe"):
        smp.plan(step, x, y, cluster=no_room, replicas=[1], recompute=["never"], probe=True)


def test_a_row_that_fits_only_with_its_optimizer_state_sharded_is_chosen_with_it():
    """Two replicas of one device each: plain data parallelism keeps Adam's
    two slots whole on every replica, shard_optimizer_state half of them.
    Under a budget between the two predicted peaks the sharded row is the
    one that fits; with room for both, the plain row is preferred."""
    model, step, x, y = _mlp(width=128, layers=8, batch=16)
    smp.init({"partitions": 1})
    dims = dict(partitions=[1], tensor_parallel_degrees=[1], replicas=[2], microbatches=[1], headroom=0.0)
    roomy = smp.plan(step, x, y, cluster=_cluster(devices=2), **dims)
    assert not roomy.best.candidate.shard_optimizer_state and roomy.best.replicas == 2
    peak = roomy.best.max_peak
    slot_bytes = 2 * sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)  # Adam: m and v
    tight = smp.plan(step, x, y, cluster=_cluster(devices=2, memory=int(peak - slot_bytes / 4)), **dims)
    best = tight.best
    assert best.candidate.shard_optimizer_state and best.config["shard_optimizer_state"] is True
    # Each replica keeps half of each slot: the peak falls by half of the slots' bytes.
    assert best.max_peak == pytest.approx(peak - slot_bytes / 2, rel=1e-3)
    assert not next(r for r in tight.rows if not r.candidate.shard_optimizer_state).fits
    assert "opt" in str(tight) and "shard" in str(tight)


def test_a_row_that_fits_only_with_sequence_parallelism_is_chosen_with_it():
    """A GPT-2 at P=2 x t=2: sequence parallelism divides the norms' and
    residuals' activations, so its predicted peak is lower. Under a budget
    between the two peaks its row is the one that fits; with room for both
    the plain row is chosen and the variant not predicted."""
    lm = _tiny_gpt_lm()
    tokens = {"token_ids": np.zeros((8, 8), "int32"), "padding_mask": np.ones((8, 8), "int32")}
    y = np.zeros((8, 8), "int32")
    dims = dict(partitions=[2], tensor_parallel_degrees=[2], replicas=[1], microbatches=[2],
                pipelines=["interleaved"], virtual_stages=[1], recompute=["never"], headroom=0.0)
    smp.init({"partitions": 1})
    roomy = smp.plan(lm, tokens, y, cluster=_cluster(devices=4), **dims)
    assert not roomy.best.candidate.sequence_parallel
    assert any(s.candidate.sequence_parallel and s.kind == "recompute" for s in roomy.skipped)
    peak = roomy.best.max_peak
    tight = smp.plan(lm, tokens, y, cluster=_cluster(devices=4, memory=int(peak) - 1), **dims)
    assert tight.best.candidate.sequence_parallel and tight.best.config["sequence_parallel"] is True
    assert tight.best.fits and tight.best.max_peak < peak
    assert not next(r for r in tight.rows if not r.candidate.sequence_parallel).fits
    assert " seq " in str(tight)


def test_a_cluster_declared_by_the_config_key_is_searched_with_replicas_as_the_argument_is():
    # The same declared cluster, given to smp.init or to smp.plan, gives the
    # same rows, data-parallel ones included; this process's own devices
    # keep one replica.
    _, step, x, y = _mlp(width=64, layers=4, batch=16)
    cluster = _cluster(devices=4, hosts=2)
    dims = dict(pipelines=["interleaved"], virtual_stages=[1], recompute=["never"])
    smp.init({"partitions": 1})
    by_argument = smp.plan(step, x, y, cluster=cluster, **dims)
    smp.init({"partitions": 1, "cluster": cluster})
    by_key = smp.plan(step, x, y, **dims)
    labels = [r.candidate.label() for r in by_key.rows]
    assert labels == [r.candidate.label() for r in by_argument.rows]
    assert [r.step_time for r in by_key.rows] == pytest.approx([r.step_time for r in by_argument.rows])
    assert any(r.replicas > 1 for r in by_key.rows)
    smp.init({"partitions": 1})
    own = smp.plan(step, x, y, partitions=[1, 2], **dims)
    assert {r.replicas for r in own.rows} == {1}


def test_each_row_shows_throughput_and_model_flops_utilisation():
    # samples/s is the batch over the predicted step; tokens/s multiplies
    # it by the sequence of token-id inputs; MFU is the model's operations
    # (every op of the step's graph, each micro-batch of each replica) over
    # the step's time and the product speed of the devices the row uses.
    _, step, x, y = _mlp(width=64, layers=4, batch=16)
    smp.init({"partitions": 1})
    plan = smp.plan(step, x, y, cluster=_cluster(devices=2, speed=1e11), pipelines=["interleaved"],
                    virtual_stages=[1], recompute=["never"], tensor_parallel_degrees=[1])
    assert plan.sequence_length is None
    one = next(r for r in plan.rows if r.candidate.devices == 1 and r.candidate.microbatches == 1)
    for row in plan.rows:
        assert row.samples_per_second == pytest.approx(16 / row.step_time)
        assert row.tokens_per_second is None
        used = {n for names in row.devices.values() for n in names}
        assert row.mfu == pytest.approx(row.model_flops / (row.step_time * 1e11 * len(used)))
        assert 0 < row.mfu < 1
        # The same model's work whatever the split: per step, for the batch.
        assert row.model_flops == pytest.approx(one.model_flops, rel=0.02)
    text = str(plan)
    assert "samples/s" in text and "MFU" in text and "tokens/s" not in text

    lm = _tiny_gpt_lm()
    tokens = {"token_ids": np.zeros((8, 8), "int32"), "padding_mask": np.ones((8, 8), "int32")}
    plan = smp.plan(lm, tokens, np.zeros((8, 8), "int32"), cluster=_cluster(devices=2), partitions=[1, 2],
                    pipelines=["interleaved"], virtual_stages=[1], recompute=["never"], tensor_parallel_degrees=[1],
                    microbatches=[1, 2])
    assert plan.sequence_length == 8
    for row in plan.rows:
        assert row.tokens_per_second == pytest.approx(8 * row.samples_per_second)
    assert "tokens/s" in str(plan)


def test_candidates_too_slow_by_a_lower_bound_are_not_predicted_and_the_rows_do_not_change(monkeypatch):
    # The search predicts a candidate only once the ranking reaches a lower
    # bound of its time (its ops' seconds on the fastest devices shared by
    # its P x t devices, its update and all-reduce at their least): the
    # rows are those of predicting every candidate.
    from smp_tf.planner import search as search_module

    _, step, x, y = _mlp(width=256, layers=8, batch=64)
    smp.init({"partitions": 1})
    dims = dict(pipelines=["interleaved", "simple"], virtual_stages=[1], recompute=["never"], keep=4)
    pruned = smp.plan(step, x, y, cluster=_cluster(devices=8, hosts=2), **dims)
    bound = [s for s in pruned.skipped if s.kind == "bound"]
    assert bound and "a lower bound of its time" in bound[0].reason
    assert "slower than the ranked rows by a lower bound of their time" in str(pruned)
    monkeypatch.setattr(search_module._BoundCache, "__call__", lambda self, *a: 0.0)
    every = smp.plan(step, x, y, cluster=_cluster(devices=8, hosts=2), **dims)
    assert every.evaluated == pruned.evaluated + len(bound)
    assert [r.candidate for r in pruned.rows] == [r.candidate for r in every.rows]
    assert [r.step_time for r in pruned.rows] == [r.step_time for r in every.rows]
    assert [r.peak for r in pruned.rows] == [r.peak for r in every.rows]
    # The bound is below every candidate's predicted time.
    from smp_tf.planner.plan import _Tracer

    everything = smp.plan(step, x, y, cluster=_cluster(devices=8, hosts=2), **dict(dims, keep=10**4))
    monkeypatch.undo()
    bounds = search_module._BoundCache(smp.ResourceGraph.from_dict(_cluster(devices=8, hosts=2)))
    tracer, infos = _Tracer(step, (x, y), {}, 64, None), {}
    assert len(everything.rows) == everything.evaluated > len(every.rows)
    for r in everything.rows:
        assert 0 < bounds(r.candidate, infos, tracer, 64) <= r.step_time, r.candidate.label()
