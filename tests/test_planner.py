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
])
def test_a_malformed_graph_names_what_is_wrong(change, message):
    spec = _spec()
    change(spec)
    with pytest.raises(ValueError, match=message):
        ResourceGraph.from_dict(spec)


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


def test_calibration_measures_this_host_and_is_cached(tmp_path):
    from smp_tf.planner.calibrate import cache_path, local_cluster

    smp.init({"partitions": 2})
    devices = ["/device:CPU:0", "/device:CPU:1"]
    g = local_cluster(devices, budget_s=10.0, cache_dir=str(tmp_path))
    assert g.source == "calibrated" and 0 < g.seconds <= 15
    assert [d.name.split("/", 1)[1] for d in g.devices] == ["CPU:0", "CPU:1"]
    for d in g.devices:
        assert d.kind == "CPU" and d.memory > 0 and d.overhead > 0
        assert all(d.flops[c] > 1e6 for c in COST_CLASSES), d.flops
    link = g.link(g.devices[0].name, g.devices[1].name)
    assert link.kind == "host" and link.bandwidth > 0 and link.latency > 0
    # Later runs read the cache; refresh measures again.
    assert os.path.exists(cache_path(devices, str(tmp_path)))
    again = local_cluster(devices, cache_dir=str(tmp_path))
    assert again.source == "cached" and again.to_dict() == g.to_dict()
    assert local_cluster(devices, refresh=True, cache_dir=str(tmp_path)).source == "calibrated"


def _two_devices(fast, slow):
    def cpu(name, speed):
        return {"name": name, "kind": "CPU", "memory": 2**30, "overhead": 0.0,
                "flops": {"matmul": speed, "conv": speed, "elementwise": speed / 10}}

    return {"hosts": {"h": {"devices": [cpu("CPU:0", fast), cpu("CPU:1", slow)]}},
            "links": {"host": {"bandwidth": 1e10, "latency": 1e-5}}}


def test_effective_speed_weighs_each_class_by_the_work():
    from smp_tf.planner.resources import effective_speeds

    g = ResourceGraph.from_dict(_two_devices(2e11, 1e11))
    products = {"matmul": 1e9, "conv": 0.0, "elementwise": 0.0}
    assert effective_speeds(g.devices, products) == pytest.approx([2e11, 1e11])
    mixed = {"matmul": 1e9, "conv": 0.0, "elementwise": 1e9}  # the element-wise half dominates the time
    assert effective_speeds(g.devices, mixed) == pytest.approx([2e9 / (0.005 + 0.05), 2e9 / (0.01 + 0.1)])


@pytest.mark.parametrize("fast, ratio", [(2e11, 2.0), (1e11, 1.0)])
def test_a_device_twice_as_fast_gets_twice_the_work(fast, ratio):
    import keras
    import numpy as np
    import tensorflow as tf

    smp.init({"partitions": 2, "microbatches": 2, "cluster": _two_devices(fast, 1e11)})
    keras.utils.set_random_seed(0)
    inp = keras.Input((64,))
    h = inp
    for i in range(12):
        h = keras.layers.Dense(64, activation="relu", name=f"d{i}")(h)
    model = smp.DistributedModel(inp, h)

    @smp.step
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    plan = step.get_plan(tf.constant(np.ones((8, 64), "float32")))
    flops = [r["flops"] for r in plan.summary()]
    # By predicted time the stages are balanced: the fast device's stage
    # does about `ratio` times the work (whole layers: within one layer).
    assert flops[0] / flops[1] == pytest.approx(ratio, rel=0.25)
    seconds = plan.stage_seconds()
    assert max(seconds) / min(seconds) < 1.3
    report = plan.report()
    assert "declared devices (cluster)" in report and "h/CPU:1" in report
