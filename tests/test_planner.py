"""The resource graph (`smp.cluster()`): given as a dict, or calibrated."""

import json
import os

import pytest

import smp_tf as smp
from smp_tf.config import parse_config
from smp_tf.planner.resources import COST_CLASSES, ResourceGraph, cost_class


def _spec():
    """2 hosts x 2 GPUs of two generations, a slower link between the hosts,
    and one pair measured on its own."""
    def gpu(name, speed, memory):
        return {"name": name, "kind": "GPU", "memory": memory,
                "flops": {"matmul": speed, "conv": speed / 2, "elementwise": speed / 100}, "overhead": 5e-6}

    return {
        "hosts": {"a": {"devices": [gpu("GPU:0", 3e14, 80e9), gpu("GPU:1", 3e14, 80e9)]},
                  "b": {"devices": [gpu("GPU:0", 1e14, 40e9), gpu("GPU:1", 1e14, 40e9)]}},
        "links": {"host": {"bandwidth": 2e11, "latency": 5e-6},
                  "network": {"bandwidth": 2.5e10, "latency": 2e-5},
                  "pairs": [{"a": "a/GPU:1", "b": "b/GPU:0", "bandwidth": 5e10, "latency": 1e-5}]},
    }


def test_a_given_graph_has_hosts_devices_and_classed_links():
    g = ResourceGraph.from_dict(_spec())
    assert g.hosts == ["a", "b"] and [d.name for d in g.devices] == ["a/GPU:0", "a/GPU:1", "b/GPU:0", "b/GPU:1"]
    assert g.device("b/GPU:1").memory == 40 * 10**9
    assert g.link("a/GPU:0", "a/GPU:0").kind == "device" and g.link("a/GPU:0", "a/GPU:0").seconds(1e9) == 0
    assert g.link("a/GPU:0", "a/GPU:1").kind == "host"
    assert g.link("a/GPU:0", "b/GPU:1").bandwidth == 2.5e10  # the network class
    assert g.link("b/GPU:0", "a/GPU:1").bandwidth == 5e10  # the pair's own
    # Time on a device: each cost class at its own speed, plus the ops' overhead.
    work = {"matmul": 3e14, "conv": 0.0, "elementwise": 3e12}
    assert g.device("a/GPU:0").seconds(work, ops=10) == pytest.approx(1 + 1 + 5e-5)
    assert g.device("b/GPU:0").seconds(work) == pytest.approx(3 + 3)
    assert g.link("a/GPU:0", "b/GPU:0").seconds(2.5e10) == pytest.approx(1 + 2e-5)
    # Printable, and the dict comes back.
    text = str(g)
    assert "b/GPU:1" in text and "network" in text and "300000.00" in text
    assert ResourceGraph.from_dict(g.to_dict()).to_dict() == g.to_dict()


@pytest.mark.parametrize("change, message", [
    (lambda s: s["hosts"]["a"]["devices"][0]["flops"].pop("conv"), r"flops must give .*'conv'"),
    (lambda s: s["hosts"]["a"]["devices"][0].update(memory=-1), r"memory must be non-negative"),
    (lambda s: s["hosts"]["a"]["devices"][0]["flops"].update(matmul=0), r"flops\['matmul'\] must be positive"),
    (lambda s: s["links"].pop("network"), r"joined by \['network'\] links"),
    (lambda s: s["links"]["pairs"][0].update(b="c/GPU:0"), r"names device 'c/GPU:0', which is not in the graph"),
    (lambda s: s["hosts"]["b"].update(devices=[]), r"Host 'b' needs a non-empty 'devices' list"),
    (lambda s: s["links"].update(rack={"bandwidth": 1}), r"Unknown link classes \['rack'\]"),
    (lambda s: s["hosts"]["a"]["devices"].append(dict(s["hosts"]["a"]["devices"][0])), r"repeated: \['a/GPU:0'\]"),
    (lambda s: s["hosts"]["a"]["devices"][0].update(ops={"Softmax": 0}), r"ops\['Softmax'\] must be positive"),
    (lambda s: s["hosts"]["a"]["devices"][0].update(ops=[1e9]), r"ops must be a dict of op type"),
])
def test_a_malformed_graph_names_what_is_wrong(change, message):
    spec = _spec()
    change(spec)
    with pytest.raises(ValueError, match=message):
        ResourceGraph.from_dict(spec)


def test_a_device_may_give_its_own_speed_for_an_op_type():
    """An op type with its own figure runs at it; every other op at its
    class's speed. The figures print and come back from the dict."""
    from smp_tf.graph_view import OpGraph, OpNode, TensorInfo
    from smp_tf.planner.search import _op_seconds

    spec = _spec()
    spec["hosts"]["a"]["devices"][0]["ops"] = {"SparseSoftmaxCrossEntropyWithLogits": 1e9}
    g = ResourceGraph.from_dict(spec)
    fast, plain = g.device("a/GPU:0"), g.device("a/GPU:1")
    assert fast.op_speed("SparseSoftmaxCrossEntropyWithLogits") == 1e9
    assert plain.op_speed("SparseSoftmaxCrossEntropyWithLogits") == 3e12  # its class: element-wise
    assert fast.op_speed("MatMul") == 3e14
    ops = [OpNode(0, "loss", "SparseSoftmaxCrossEntropyWithLogits", [], [0], flops=1e9),
           OpNode(1, "relu", "Relu", [0], [1], flops=1e9)]
    tensors = [TensorInfo(0, 0, 0, 4, shape=(1,), consumers=[1]), TensorInfo(1, 1, 0, 4, shape=(1,))]
    graph = OpGraph(ops, tensors, {})
    assert _op_seconds(graph, fast)(0) == pytest.approx(1.0 + 5e-6)
    assert _op_seconds(graph, plain)(0) == pytest.approx(1e9 / 3e12 + 5e-6)
    assert _op_seconds(graph, fast)(1) == _op_seconds(graph, plain)(1)
    assert "SparseSoftmaxCrossEntropyWithLogits 1.00" in str(g)
    assert ResourceGraph.from_dict(g.to_dict()).device("a/GPU:0").ops == fast.ops


def test_the_product_figures_reproduce_both_calibration_chains():
    """Speed and bandwidth come from two chains under the model that
    predicts with them (operations at the speed plus bytes at the
    bandwidth): recovered exactly from times that model makes."""
    from smp_tf.planner.calibrate import _solve2

    speed, bandwidth = 2.5e11, 2e10
    square, skinny = (3.4e7, 7.9e5), (8.4e6, 1.1e6)
    times = [(f, b, f / speed + b / bandwidth) for f, b in (square, skinny)]
    per_flop, per_byte = _solve2(*times)
    assert 1 / per_flop == pytest.approx(speed) and 1 / per_byte == pytest.approx(bandwidth)
    assert _solve2((1.0, 2.0, 3.0), (2.0, 4.0, 6.0)) == (0.0, 0.0)  # not determined


def test_the_streaming_figures_come_from_the_chains_or_not_at_all():
    from smp_tf.planner.calibrate import _streaming_figures

    speed, conv_speed, bandwidth, fixed = 2.5e11, 3e11, 2e10, 1e-5

    def chain(flops, nbytes, s):
        return (flops, nbytes, flops / s + nbytes / bandwidth + fixed, fixed)

    got = _streaming_figures(chain(3.4e7, 7.9e5, speed), chain(8.4e6, 1.1e6, speed), chain(1.5e8, 2.1e6, conv_speed))
    assert got == pytest.approx((speed, conv_speed, bandwidth))
    # Bytes that do not show in the skinny chain's time: streaming is not modelled.
    assert _streaming_figures((3.4e7, 7.9e5, 1.36e-4, 0.0), (8.4e6, 1.1e6, 3.36e-5, 0.0), (1.5e8, 2.1e6, 5e-4, 0.0)) \
        is None


def test_cost_classes_of_the_flop_model():
    assert cost_class("MatMul") == cost_class("BatchMatMulV2") == cost_class("Einsum") == "matmul"
    assert cost_class("Conv2D") == cost_class("Conv2DBackpropFilter") == cost_class("DepthwiseConv2dNative") == "conv"
    assert cost_class("AddV2") == cost_class("Relu") == "elementwise"
    assert set(COST_CLASSES) == {"matmul", "conv", "elementwise"}


def test_the_config_takes_a_dict_or_a_json_file(tmp_path):
    cfg = parse_config({"cluster": _spec()})
    hash(cfg)  # kept as JSON text: the config stays hashable
    assert cfg.to_dict()["cluster"] == json.loads(json.dumps(_spec()))
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(_spec()))
    assert parse_config({"cluster": str(path)}).cluster == str(path)
    with pytest.raises(ValueError, match="does not exist"):
        parse_config({"cluster": str(tmp_path / "missing.json")})
    with pytest.raises(ValueError, match="must be a dict describing hosts"):
        parse_config({"cluster": 3})
    bad = _spec()
    bad["links"].pop("host")
    with pytest.raises(ValueError, match=r"joined by \['host'\] links"):
        parse_config({"cluster": bad})
    # smp.cluster() returns the graph the config gives (not this machine's).
    smp.init({"partitions": 2, "cluster": str(path)})
    assert [d.name for d in smp.cluster().devices] == ["a/GPU:0", "a/GPU:1", "b/GPU:0", "b/GPU:1"]


def test_a_calibration_figure_is_the_least_of_its_timed_calls(monkeypatch):
    """A call is only ever slowed (by other work, by the first calls'
    allocations): each figure takes the fastest of nine timed calls after
    an untimed one, not their median."""
    from smp_tf.planner import calibrate

    durations = iter([50.0, 9.0, 2.0, 7.0, 3.0, 8.0, 6.0, 4.0, 5.0, 30.0])  # the first call is untimed
    clock = {"now": 0.0, "calls": 0}

    def perf_counter():
        return clock["now"]

    def fn():
        clock["calls"] += 1
        clock["now"] += next(durations)

    monkeypatch.setattr(calibrate.time, "perf_counter", perf_counter)
    assert calibrate._timed(fn) == 2.0
    assert clock["calls"] == 10


def test_calibration_measures_this_host_and_is_cached(tmp_path):
    from smp_tf.planner.calibrate import MEASURED_OPS, cache_path, local_cluster

    smp.init({"partitions": 2})
    devices = ["/device:CPU:0", "/device:CPU:1"]
    g = local_cluster(devices, budget_s=10.0, cache_dir=str(tmp_path))
    assert g.source == "calibrated" and 0 < g.seconds <= 15
    assert [d.name.split("/", 1)[1] for d in g.devices] == ["CPU:0", "CPU:1"]
    for d in g.devices:
        assert d.kind == "CPU" and d.memory > 0 and d.overhead > 0
        assert all(d.flops[c] > 1e6 for c in COST_CLASSES), d.flops
        assert set(d.ops) == set(MEASURED_OPS) and all(v > 1e6 for v in d.ops.values()), d.ops
    link = g.link(g.devices[0].name, g.devices[1].name)
    assert link.kind == "host" and link.bandwidth > 0 and link.latency > 0
    # Later runs read the cache; refresh measures again.
    assert os.path.exists(cache_path(devices, str(tmp_path)))
    again = local_cluster(devices, cache_dir=str(tmp_path))
    assert again.source == "cached" and again.to_dict() == g.to_dict()
    assert local_cluster(devices, refresh=True, cache_dir=str(tmp_path)).source == "calibrated"


def test_logical_cpu_devices_of_one_process_share_one_link_figure():
    """Pairs of logical CPU devices (one memory) each get the median of
    their measured links; a pair with a GPU keeps its own."""
    from smp_tf.planner.calibrate import _same_memory
    from smp_tf.planner.resources import Link

    pairs = {("h/CPU:0", "h/CPU:1"): Link("host", 9e9, 6e-5), ("h/CPU:0", "h/CPU:2"): Link("host", 1e12, 4.7e-4),
             ("h/CPU:1", "h/CPU:2"): Link("host", 5e10, 1e-7), ("h/CPU:0", "h/GPU:0"): Link("host", 2e10, 1e-5)}
    out = _same_memory(pairs, {"h/CPU:0", "h/CPU:1", "h/CPU:2"})
    median = Link("host", 5e10, 6e-5)
    assert [out[k] for k in list(pairs)[:3]] == [median] * 3
    assert out[("h/CPU:0", "h/GPU:0")] == pairs[("h/CPU:0", "h/GPU:0")]
    one = {("h/CPU:0", "h/GPU:0"): Link("host", 2e10, 1e-5)}
    assert _same_memory(one, {"h/CPU:0"}) == one


def _two_devices(fast, slow):
    def cpu(name, speed):
        return {"name": name, "kind": "CPU", "memory": 2**30, "overhead": 0.0,
                "flops": {"matmul": speed, "conv": speed, "elementwise": speed / 10}}

    return {"hosts": {"h": {"devices": [cpu("CPU:0", fast), cpu("CPU:1", slow)]}},
            "links": {"host": {"bandwidth": 1e10, "latency": 1e-5}}}


def _mlp_step(width):
    """`smp.step` of a 12-layer MLP of `width` (its loss: the outputs' mean square)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((width,))
    h = inp
    for i in range(12):
        h = keras.layers.Dense(width, activation="relu", name=f"d{i}")(h)
    model = smp.DistributedModel(inp, h)

    @smp.step
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    return step


def test_effective_speed_weighs_each_class_by_the_work():
    from smp_tf.planner.resources import effective_speeds

    g = ResourceGraph.from_dict(_two_devices(2e11, 1e11))
    products = {"matmul": 1e9, "conv": 0.0, "elementwise": 0.0}
    assert effective_speeds(g.devices, products) == pytest.approx([2e11, 1e11])
    mixed = {"matmul": 1e9, "conv": 0.0, "elementwise": 1e9}  # the element-wise half dominates the time
    assert effective_speeds(g.devices, mixed) == pytest.approx([2e9 / (0.005 + 0.05), 2e9 / (0.01 + 0.1)])


@pytest.mark.parametrize("fast, ratio", [(2e11, 2.0), (1e11, 1.0)])
def test_a_device_twice_as_fast_gets_twice_the_work(fast, ratio):
    import numpy as np
    import tensorflow as tf

    smp.init({"partitions": 2, "microbatches": 2, "cluster": _two_devices(fast, 1e11)})
    step = _mlp_step(64)
    plan = step.get_plan(tf.constant(np.ones((8, 64), "float32")))
    flops = [r["flops"] for r in plan.summary()]
    # By predicted time the stages are balanced: the fast device's stage
    # does about `ratio` times the work (whole layers: within one layer).
    assert flops[0] / flops[1] == pytest.approx(ratio, rel=0.25)
    seconds = plan.stage_seconds()
    assert max(seconds) / min(seconds) < 1.3
    report = plan.report()
    assert "declared devices (cluster)" in report and "h/CPU:1" in report
    # Each stage sends its boundary tensors over the declared link (10 GB/s,
    # 10 us each): stage 0 its activations forward, stage 1 the gradients back.
    sends = plan.stage_send_seconds()
    assert all(s >= 1e-5 for s in sends) and all(s < 1e-3 for s in sends)


# -- rank mapping ------------------------------------------------------------------

def _two_hosts_of_four(slow_network=1e9):
    def cpu(name, speed=1e11):
        return {"name": name, "kind": "GPU", "memory": 2**34, "overhead": 0.0,
                "flops": {"matmul": speed, "conv": speed, "elementwise": speed}}

    return ResourceGraph.from_dict({
        "hosts": {"a": {"devices": [cpu(f"GPU:{i}") for i in range(4)]},
                  "b": {"devices": [cpu(f"GPU:{i}") for i in range(4)]}},
        "links": {"host": {"bandwidth": 1e11, "latency": 1e-6},
                  "network": {"bandwidth": slow_network, "latency": 1e-4}}})


def _problem(replicas, stages, t, boundary, gradient, flops=1e9, m=4):
    from smp_tf.planner.mapping import MappingProblem

    work = {"matmul": flops, "conv": 0.0, "elementwise": 0.0}
    return MappingProblem(replicas, stages, t, [work] * stages, boundary, gradient, m)


@pytest.mark.parametrize("replicas, stages, t, boundary, gradient", [
    (2, 4, 1, [1e8, 1e6, 1e8], [1e6] * 4),   # heavy pipeline traffic: each pipeline on one host
    (2, 2, 2, [1e7], [1e9, 1e9]),            # heavy gradients, tensor-parallel pairs
    (4, 2, 1, [1e8], [1e7, 1e7]),
    (1, 4, 2, [1e6, 1e9, 1e6], [0] * 4),     # one pipeline over both hosts: cut at the light boundary
])
def test_the_heuristic_matches_brute_force_on_two_hosts_with_a_slow_link(replicas, stages, t, boundary, gradient):
    from smp_tf.planner.mapping import _blocks, _heuristic, brute_force

    graph = _two_hosts_of_four()
    problem = _problem(replicas, stages, t, boundary, gradient)
    exact = brute_force(problem, graph)
    heuristic = _heuristic(problem, graph, _blocks(graph, t))
    assert heuristic.step_seconds <= exact.step_seconds * 1.001, (heuristic.table(), exact.table())
    # Tensor-parallel groups never span hosts.
    for names in heuristic.devices.values():
        assert len({n.split("/")[0] for n in names}) == 1


def test_the_mapping_follows_the_traffic():
    from smp_tf.planner.mapping import map_ranks

    graph = _two_hosts_of_four()
    # Heavy boundaries, light gradients: each replica's pipeline on one host.
    m = map_ranks(_problem(2, 4, 1, [1e8] * 3, [1e3] * 4), graph)
    assert m.method == "brute force"
    for r in range(2):
        assert len({m.devices[(r, p)][0].split("/")[0] for p in range(4)}) == 1
    # One pipeline over both hosts crosses once, at its lightest boundary.
    m = map_ranks(_problem(1, 4, 2, [1e9, 1e6, 1e9], [0] * 4), graph)
    hosts = [m.devices[(0, p)][0].split("/")[0] for p in range(4)]
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[1] != hosts[2]
    with pytest.raises(ValueError, match="need 5 groups of 2 device"):
        map_ranks(_problem(1, 5, 2, [1.0] * 4, [0] * 5), graph)



def test_the_heuristic_on_a_large_cluster_is_quick_and_no_worse_than_in_order():
    import time

    from smp_tf.planner.mapping import Mapping, map_ranks

    def cpu(name, speed):
        return {"name": name, "kind": "GPU", "memory": 2**34, "overhead": 0.0,
                "flops": {"matmul": speed, "conv": speed, "elementwise": speed}}

    # 8 hosts x 8 devices, two generations of devices.
    graph = ResourceGraph.from_dict({
        "hosts": {f"h{i}": {"devices": [cpu(f"GPU:{k}", 2e11 if i % 2 else 1e11) for k in range(8)]}
                  for i in range(8)},
        "links": {"host": {"bandwidth": 1e11, "latency": 1e-6}, "network": {"bandwidth": 1e9, "latency": 1e-4}}})
    problem = _problem(4, 8, 2, [1e8] * 7, [1e8] * 8)
    t0 = time.perf_counter()
    m = map_ranks(problem, graph)
    assert m.method == "heuristic" and time.perf_counter() - t0 < 30
    names = [d.name for d in graph.devices]
    in_order = Mapping({g: tuple(names[2 * i:2 * i + 2]) for i, g in enumerate(problem.groups)})
    assert m.step_seconds <= problem.step_seconds(graph, in_order)


def test_each_declared_device_is_bounded_by_its_own_memory():
    import keras
    import numpy as np
    import tensorflow as tf

    import smp_tf.memory as memory

    def build():
        keras.utils.set_random_seed(0)
        inp = keras.Input((64,))
        h = inp
        for i in range(4):
            h = keras.layers.Dense(256, activation="relu", name=f"d{i}")(h)
        return smp.DistributedModel(inp, keras.layers.Dense(4)(h))

    def body_of(model):
        def body(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            return loss, tape.gradient(loss, model.trainable_variables)
        return body

    x = np.ones((8, 64), "float32")
    spec = _two_devices(1e11, 1e11)
    for d in spec["hosts"]["h"]["devices"]:
        d["memory"] = 2**30
    smp.init({"partitions": 2, "microbatches": 2, "cluster": spec})
    step = smp.step(body_of(build()))
    step(tf.constant(x))
    report = step.memory_report(keras.optimizers.Adam())
    assert report.budget == {"/device:CPU:0": 2**30, "/device:CPU:1": 2**30}
    peaks = report.device_totals()
    # The second device holds less than its first stage's peak: that layout
    # does not fit it, and the error names it; the first still fits.
    spec["hosts"]["h"]["devices"][1]["memory"] = peaks["/device:CPU:1"] - 1
    smp.init({"partitions": 2, "microbatches": 2, "cluster": spec})
    with pytest.raises(memory.MemoryBudgetError, match=r"/device:CPU:1 .* OVER") as raised:
        smp.step(body_of(build()))(tf.constant(x))
    assert "/device:CPU:0" in str(raised.value) and "the devices' memory" in str(raised.value)
    # memory_budget lowers a declared device's memory, never raises it.
    smp.init({"partitions": 2, "microbatches": 2, "cluster": spec, "memory_budget": 2**40})
    with pytest.raises(memory.MemoryBudgetError):
        smp.step(body_of(build()))(tf.constant(x))


def test_optimize_memory_fills_each_declared_device_by_its_share_of_memory():
    import keras
    import numpy as np
    import tensorflow as tf

    def peaks(memory):
        spec = _two_devices(1e11, 1e11)
        for d, m in zip(spec["hosts"]["h"]["devices"], memory):
            d["memory"] = m
        smp.init({"partitions": 2, "microbatches": 2, "optimize": "memory", "cluster": spec})
        step = _mlp_step(128)
        step(tf.constant(np.ones((8, 128), "float32")))
        totals = step.memory_report(keras.optimizers.Adam()).device_totals()
        return totals["/device:CPU:0"], totals["/device:CPU:1"]

    even = peaks([2**30, 2**30])
    uneven = peaks([2**30, 3 * 2**30])
    # Equal memory: about equal peaks. Three times the memory on the second
    # device: it takes more of the model, the first less.
    assert 0.7 < even[0] / even[1] < 1.4, even
    assert uneven[1] / uneven[0] > 1.5 * even[1] / even[0], (even, uneven)
