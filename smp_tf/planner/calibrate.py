"""Measuring this host's resource graph: a short calibration, cached.

For every device `smp.init` set up (or, before it, every logical device
TensorFlow has), a few small `tf.function`s run on that device alone:

* ``matmul``: a chain of products of 256 x 256 matrices (512 on GPUs);
* ``conv``: a chain of 3 x 3 convolutions of 32 channels on 32 x 32 images;
* ``elementwise``: a chain of additions and multiplications of 2^18 floats;
* the per-op overhead: a chain of 200 additions of scalars;
* ``ops``: a chain of each of `MEASURED_OPS`, op types whose work per
  element the element-wise class misses.

Each figure is the least of nine timed calls after one untimed one, in
the flop units of `smp_tf.graph_view.estimate_flops`; logical CPU devices
of one process (the same cores) each get the median of their figures.
A chain of products of 1/16 as many rows by distinct large weights and
the square chain together give the product speed and the bandwidth
products stream their operands at (the prediction charges a product
both); calling a one-op `tf.function` the runtime's cost of a step, and a
function kept a call (as the pipeline's tasks are) the cost of an action. Then, for every pair
of devices, a tensor of 4 bytes and one of 4 MiB go back and forth between
them, each hop after the one before (a chain, as the ops of a step that
exchange tensors wait for them), against the same chain on one device: the
small one's extra time per hop is the latency, the large one's the
bandwidth. Logical CPU devices of one process copy a tensor from one to
the other too (about 20 to 40 GB/s, and 3 to 6 us a hop, on a 2-core
EPYC; about 100 GB/s and 1.6 to 4 us on one with AVX-512); each pair of
them gets the median of their links, as they share one memory.

It takes a few seconds (at most ``budget_s``, 10 by default: the sizes
shrink when a device is slow). The result is cached per host, TensorFlow
version and device set (``$SMP_TF_CACHE`` or ``~/.cache/smp_tf``), so later
runs read it back; ``refresh=True`` measures again.

Logical CPU devices that share cores are measured one at a time, each with
the whole process's threads: what one device can do alone, not what it
does while the others run. The graph records the cores they share
(``ResourceGraph.cores``), so a prediction slows devices that run at once
on fewer cores than there are devices.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from smp_tf.planner.resources import COST_CLASSES, Device, Link, ResourceGraph

__all__ = ["calibrate", "local_cluster", "cache_path", "MEASURED_OPS"]

_SIZES = {"matmul": 256, "conv": 32, "elementwise": 1 << 18}
_CHAIN = 8
#: The fastest link recorded (bytes per second): a transfer that takes no
#: measurable time is given this.
_FASTEST = 1e12


def _short(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``; a
    device of another process keeps its job and task
    (``worker.1/CPU:0``)."""
    short = device.rsplit("device:", 1)[-1]
    parts = dict(p.split(":", 1) for p in device.strip("/").split("/") if p.startswith(("job:", "task:")))
    if parts.get("job", "localhost") != "localhost":
        return f"{parts['job']}.{parts.get('task', '0')}/{short}"
    return short


def _timed(fn, *args, repeats: int = 9) -> float:
    """The least seconds of `repeats` calls after one untimed call.

    The least, not the median: a call of a millisecond is only ever slowed
    (by another process, by the first calls' allocations). Within sets of
    six calibrations in a row on a 2-core EPYC, the median of three such
    calls moved by 9 to 14% for the product speed, 9 to 22% for the
    element-wise one and 22 to 55% for the bandwidth; the least of nine by
    2 to 6%, 7 to 14% and 5 to 17%.
    """
    fn(*args)  # traces and warms up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        _ = out.numpy() if hasattr(out, "numpy") else out
        times.append(time.perf_counter() - t0)
    return min(times)


def _device_speeds(device: str, scale: float) -> Tuple[Dict[str, float], float, float]:
    """Operations per second per cost class, seconds per op, and the bytes
    per second a product streams its operands at (0: not measurable), on
    `device`."""
    import tensorflow as tf

    from smp_tf.graph_view import estimate_flops

    gpu = "GPU" in device.upper()
    n = int((512 if gpu else _SIZES["matmul"]) * scale) or 16
    c = _SIZES["conv"]
    e = max(int(_SIZES["elementwise"] * scale), 1024)
    with tf.device(device):
        a = tf.random.stateless_normal((n, n), seed=(1, 2)) / n ** 0.5
        img = tf.random.stateless_normal((8, c, c, 32), seed=(3, 4))
        kernel = tf.random.stateless_normal((3, 3, 32, 32), seed=(5, 6)) / 17.0
        vec = tf.random.stateless_normal((e,), seed=(7, 8))
        one = tf.constant(1.0)

    def on_device(body):
        @tf.function
        def run(*xs):
            with tf.device(device):
                return body(*xs)
        return run

    def products(x):
        for _ in range(_CHAIN):
            x = tf.matmul(x, a)
        return tf.reduce_sum(x[:1, :1])

    def convolutions(x):
        for _ in range(_CHAIN):
            x = tf.nn.conv2d(x, kernel, 1, "SAME")
        return tf.reduce_sum(x[:1, :1, :1, :1])

    def elementwise(x):
        for _ in range(_CHAIN):
            x = x * 0.999 + 0.001
        return tf.reduce_sum(x[:1])

    def tiny(x):
        for _ in range(200):
            x = x + 1.0
        return x

    flops = {
        "matmul": _CHAIN * estimate_flops("MatMul", [(n, n), (n, n)], [(n, n)]),
        "conv": _CHAIN * estimate_flops("Conv2D", [(8, c, c, 32), (3, 3, 32, 32)], [(8, c, c, 32)]),
        "elementwise": _CHAIN * 2 * estimate_flops("Mul", [(e,), ()], [(e,)]),
    }
    overhead = _timed(on_device(tiny), one) / 200
    seconds = {
        "matmul": _timed(on_device(products), a),
        "conv": _timed(on_device(convolutions), img),
        "elementwise": _timed(on_device(elementwise), vec),
    }
    # Each chain also pays its ops' fixed cost; the speed is what is left.
    ops = {"matmul": _CHAIN, "conv": _CHAIN, "elementwise": 2 * _CHAIN}
    speeds = {c: flops[c] / max(seconds[c] - ops[c] * overhead, 1e-9) for c in COST_CLASSES}
    fitted = _streaming_figures(
        (flops["matmul"], _CHAIN * 4 * 3 * n * n, seconds["matmul"], ops["matmul"] * overhead),
        _streamed_chain(device, n, on_device) + (_CHAIN * overhead,),
        (flops["conv"], _CHAIN * 4 * (2 * 8 * c * c * 32 + 3 * 3 * 32 * 32), seconds["conv"], ops["conv"] * overhead),
    )
    bandwidth = 0.0
    if fitted is not None:
        speeds["matmul"], conv_speed, bandwidth = fitted
        if conv_speed is not None:
            speeds["conv"] = conv_speed
    return speeds, overhead, bandwidth


def _streamed_chain(device: str, n: int, on_device: Any) -> Tuple[float, float, float]:
    """``(flops, bytes moved, seconds)`` of a chain of products of `n` / 16
    rows by distinct weights of ``2 n x 2 n``: each reads its weight from
    memory (distinct weights, so that none stays in a cache)."""
    import tensorflow as tf

    from smp_tf.graph_view import estimate_flops

    k, rows = (2 * n, max(n // 16, 1))
    with tf.device(device):
        weights = [tf.random.stateless_normal((k, k), seed=(11, i)) / k ** 0.5 for i in range(_CHAIN)]
        skinny = tf.random.stateless_normal((rows, k), seed=(12, 13))

    def streamed(x, *ws):
        for w in ws:
            x = tf.matmul(x, w)
        return tf.reduce_sum(x[:1, :1])

    return (_CHAIN * estimate_flops("MatMul", [(rows, k), (k, k)], [(rows, k)]),
            _CHAIN * 4 * (k * k + 2 * rows * k), _timed(on_device(streamed), skinny, *weights))


_Chain = Tuple[float, float, float, float]


def _streaming_figures(square: _Chain, skinny: _Chain, conv: _Chain) -> Optional[Tuple[float, Optional[float], float]]:
    """(product speed, convolution speed, bandwidth) from timed chains,
    each ``(flops, bytes moved, seconds, seconds of its ops' fixed cost)``.

    The prediction charges a product (and a convolution) its operations at
    the class's speed plus its operands' and result's bytes at the
    bandwidth (`smp_tf.planner.search`), so both figures come from the two
    product chains under that same model: the square chain (mostly
    operations) and the skinny one (mostly the weights' bytes), two
    equations in 1 / speed and 1 / bandwidth. Then each chain is predicted
    as measured. None when the skinny chain's bytes do not show (under 5%
    of its time): streaming is then not modelled. The convolution speed is
    what its chain leaves after its bytes; None when that is under 5%.
    """
    per_flop, per_byte = _solve2(square[:2] + (square[2] - square[3],), skinny[:2] + (skinny[2] - skinny[3],))
    if not (per_flop > 0 and per_byte > 0 and skinny[1] * per_byte > 0.05 * skinny[2]):
        return None
    conv_left = conv[2] - conv[3] - conv[1] * per_byte
    conv_speed = conv[0] / conv_left if conv_left > 0.05 * conv[2] else None
    return 1.0 / per_flop, conv_speed, 1.0 / per_byte


#: Op types whose work per element the element-wise class (additions and
#: multiplications) misses, each timed on its own by the calibration: the
#: softmax cross-entropies (a softmax, a logarithm and the gradient per
#: logit: on a 2-core EPYC about 12 multiplications' time per logit, and
#: the largest op of a language model's loss), the softmax itself, and the
#: transcendental activations.
MEASURED_OPS = (
    "SparseSoftmaxCrossEntropyWithLogits",
    "SoftmaxCrossEntropyWithLogits",
    "Softmax",
    "Tanh",
    "Erf",
    "Exp",
)


def _op_speeds(device: str, scale: float, overhead: float, elementwise: float) -> Dict[str, float]:
    """The speed of each of `MEASURED_OPS` on `device`, in the flop model's
    units (`estimate_flops` of the op) per second: a chain of 8 of the op
    on rows of 1024 (2^18 elements at scale 1), less the ops' fixed cost
    and the element-wise work around them (at `elementwise`, the class's
    speed)."""
    import tensorflow as tf

    from smp_tf.graph_view import estimate_flops

    cols = 1024
    rows = max(int((1 << 18) * scale) // cols, 8)
    with tf.device(device):
        logits = tf.random.stateless_normal((rows, cols), seed=(14, 15))
        labels = tf.zeros((rows,), tf.int32)
        dense = tf.nn.softmax(tf.random.stateless_normal((rows, cols), seed=(16, 17)))

    def run_of(body):
        @tf.function
        def run(x):
            with tf.device(device):
                return body(x)
        return run

    def chain(op):
        def body(x):
            for _ in range(_CHAIN):
                x = op(x)
            return tf.reduce_sum(x[:1, :1])
        return body

    def losses(op):
        # Not chainable (a loss and a gradient per call): independent calls
        # on shifted logits, each kept alive by the sum.
        def body(x):
            total = tf.constant(0.0)
            for k in range(_CHAIN):
                loss, grad = op(x + float(k))
                total += loss[0] + grad[0, 0]
            return total
        return body

    shape = (rows, cols)
    bodies = {
        "SparseSoftmaxCrossEntropyWithLogits": (
            losses(lambda x: tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=labels)),
            estimate_flops("SparseSoftmaxCrossEntropyWithLogits", [shape, (rows,)], [(rows,), shape]), 2),
        "SoftmaxCrossEntropyWithLogits": (
            losses(lambda x: tf.raw_ops.SoftmaxCrossEntropyWithLogits(features=x, labels=dense)),
            estimate_flops("SoftmaxCrossEntropyWithLogits", [shape, shape], [(rows,), shape]), 2),
        "Softmax": (chain(tf.nn.softmax), estimate_flops("Softmax", [shape], [shape]), 1),
        "Tanh": (chain(tf.tanh), estimate_flops("Tanh", [shape], [shape]), 1),
        "Erf": (chain(tf.math.erf), estimate_flops("Erf", [shape], [shape]), 1),
        # Scaled down first (one multiplication, at the class's cost) so the
        # chain stays finite.
        "Exp": (chain(lambda x: tf.exp(x * 1e-3)), estimate_flops("Exp", [shape], [shape]), 2),
    }
    out: Dict[str, float] = {}
    for op_type in MEASURED_OPS:
        body, units, per_call = bodies[op_type]
        # Each call's other op (the scaling, or the shift) at the class's speed.
        around = (per_call - 1) * (rows * cols / elementwise + overhead)
        seconds = _timed(run_of(body), logits) / _CHAIN - overhead - around
        out[op_type] = units / max(seconds, 1e-9)
    return out


def _solve2(first: Tuple[float, float, float], second: Tuple[float, float, float]) -> Tuple[float, float]:
    """``(x, y)`` with ``a x + b y = r`` for both ``(a, b, r)``; ``(0, 0)``
    when the two equations do not determine them."""
    (a1, b1, r1), (a2, b2, r2) = first, second
    det = a1 * b2 - a2 * b1
    if abs(det) <= 1e-12 * abs(a1 * b2):
        return 0.0, 0.0
    return (r1 * b2 - r2 * b1) / det, (a1 * r2 - a2 * r1) / det


#: Hops of a tensor between two devices in one timed chain (`_link`).
_HOPS = 16


def _link(a: str, b: str, scale: float) -> Tuple[float, float]:
    """(bandwidth in bytes per second, latency in seconds) from `a` to `b`.

    A tensor crosses between the two devices `_HOPS` times in a chain
    (each hop adds one to it on the other device, so it waits for the one
    before), against the same chain on `a` alone. Timing one transfer by
    itself instead measured a call's noise: between 1 us and 0.5 ms of
    latency for logical CPU devices whose hops take 3 to 6 us, and up to
    1000 GB/s for copies that run at 20 to 40 GB/s."""
    import tensorflow as tf

    big_n = max(int((1 << 20) * scale), 1024)  # 4 MiB of float32 at scale 1
    with tf.device(a):
        big = tf.random.stateless_normal((big_n,), seed=(9, 10))
        small = tf.constant([1.0])

    def chain(devices):
        @tf.function
        def run(x):
            for i in range(_HOPS):
                with tf.device(devices[i % len(devices)]):
                    x = x + 1.0
            with tf.device(a):
                return tf.reduce_sum(x[:1])
        return run

    across, stay = chain((b, a)), chain((a,))
    latency = max((_timed(across, small) - _timed(stay, small)) / _HOPS, 1e-7)
    extra = (_timed(across, big) - _timed(stay, big)) / _HOPS - latency
    return min(big_n * 4 / max(extra, 1e-9), _FASTEST), latency


def calibrate(devices: Sequence[str], budget_s: float = 10.0, host: Optional[str] = None) -> ResourceGraph:
    """Measures `devices` (TensorFlow device names of this process) and the
    links between them (module doc).

    Args:
        devices: the devices to measure.
        budget_s: how long the calibration may take, roughly.
        host: the host's name (default: this machine's).

    Returns:
        The `ResourceGraph` (``source="calibrated"``).
    """
    host = host or socket.gethostname()
    start = time.perf_counter()
    scale = 1.0
    measured: List[Device] = []
    for k, d in enumerate(devices):
        t0 = time.perf_counter()
        speeds, overhead, bandwidth = _device_speeds(d, scale)
        ops = _op_speeds(d, scale, overhead, speeds["elementwise"])
        spent = time.perf_counter() - t0
        # Leave half the budget for the links and the other devices.
        left = max(len(devices) - k - 1, 0)
        if left and spent * left > budget_s / 2 - (time.perf_counter() - start):
            scale = max(scale / 2, 0.125)
        cpus = sum(_kind(x) == "CPU" for x in devices)
        measured.append(Device(f"{host}/{_short(d)}", host, _kind(d), _memory_of(d, cpus), speeds, overhead,
                               bandwidth, ops))
    measured = _same_cores(measured)
    pairs: Dict[Tuple[str, str], Link] = {}
    for i, a in enumerate(devices):
        for b in devices[i + 1:]:
            if time.perf_counter() - start > budget_s:
                break
            bandwidth, latency = _link(a, b, scale)
            pairs[tuple(sorted((f"{host}/{_short(a)}", f"{host}/{_short(b)}")))] = Link("host", bandwidth, latency)
    pairs = _same_memory(pairs, {d.name for d in measured if d.kind == "CPU"})
    links = {}
    if pairs:
        links["host"] = Link("host", statistics.median(l.bandwidth for l in pairs.values()),
                             statistics.median(l.latency for l in pairs.values()))
    elif len(devices) > 1:
        links["host"] = Link("host", 1e10, 1e-5)
    # Logical CPU devices of one process share the cores the process may run on.
    cpus = sum(d.kind == "CPU" for d in measured)
    cores = {host: float(_cores())} if cpus > 1 else {}
    runtime = _runtime(devices[0])
    return ResourceGraph(measured, links, pairs, source="calibrated", seconds=time.perf_counter() - start,
                         cores=cores, runtime=runtime)


def _same_cores(measured: List[Device]) -> List[Device]:
    """Logical CPU devices of one process run on the same cores: each gets
    the median of their figures, which a moment's load on the machine
    moves less than any one of them."""
    cpus = [d for d in measured if d.kind == "CPU"]
    if len(cpus) < 2:
        return measured
    flops = {c: statistics.median(d.flops[c] for d in cpus) for c in COST_CLASSES}
    overhead = statistics.median(d.overhead for d in cpus)
    bandwidth = statistics.median(d.bandwidth for d in cpus)
    types = set.intersection(*(set(d.ops) for d in cpus))
    ops = {t: statistics.median(d.ops[t] for d in cpus) for t in sorted(types)}
    return [Device(d.name, d.host, d.kind, d.memory, dict(flops), overhead, bandwidth, dict(ops)) if d.kind == "CPU" else d
            for d in measured]


def _same_memory(pairs: Dict[Tuple[str, str], Link], cpus: set) -> Dict[Tuple[str, str], Link]:
    """Logical CPU devices of one process copy tensors within one memory:
    every pair of them gets the median of their links, which a moment's
    load on the machine moves less than any one of them (a plan that used
    the slowest measured pairs for its tensor-parallel groups was once
    predicted 4 to 6% too long)."""
    same = [k for k in pairs if k[0] in cpus and k[1] in cpus]
    if len(same) < 2:
        return pairs
    link = Link("host", statistics.median(pairs[k].bandwidth for k in same),
                statistics.median(pairs[k].latency for k in same))
    return {k: (link if k in same else v) for k, v in pairs.items()}


def _runtime(device: str) -> Dict[str, float]:
    """What the runtime costs besides the ops: ``step``, the seconds of
    calling a compiled step (a `tf.function` of one op); ``action``, the
    seconds each action of a pipeline adds (a function call inside the
    step, over the same op inline)."""
    import tensorflow as tf

    calls = 20
    with tf.device(device):
        one = tf.constant(1.0)

    # Kept a call, as the pipeline's task functions are (`smp_tf.lowering`):
    # an inlined call costs nothing, and measured so the action's cost was 0.
    @tf.function(experimental_attributes={"_noinline": True})
    def inner(x):
        return x + 1.0

    @tf.function
    def nested(x):
        with tf.device(device):
            for _ in range(calls):
                x = inner(x)
            return x

    @tf.function
    def inline(x):
        with tf.device(device):
            for _ in range(calls):
                x = x + 1.0
            return x

    @tf.function
    def trivial(x):
        return x + 1.0

    step = _timed(trivial, one)
    action = max(_timed(nested, one) - _timed(inline, one), 0.0) / calls
    return {"step": step, "action": action}


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _kind(device: str) -> str:
    return "GPU" if "GPU" in _short(device).upper() else "CPU"


def _memory_of(device: str, cpu_devices: int) -> int:
    """A GPU's memory limit or total memory; a logical CPU device's share of
    the host's memory (the CPU devices of a process share it)."""
    import tensorflow as tf

    if _kind(device) == "GPU":
        try:
            info = tf.config.experimental.get_memory_info(device)
            limit = info.get("limit") if isinstance(info, dict) else None
            if limit:
                return int(limit)
        except (ValueError, RuntimeError, tf.errors.OpError):
            pass
        return 0
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
    return int(total // max(cpu_devices, 1))


def cache_path(devices: Sequence[str], cache_dir: Optional[str] = None) -> str:
    """Where the calibration of `devices` on this host is cached."""
    import tensorflow as tf

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # The calibration's version: a cache written by an older one is measured again.
    key = json.dumps([socket.gethostname(), tf.__version__, list(devices), cores, 5])
    folder = cache_dir or os.environ.get("SMP_TF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "smp_tf")
    return os.path.join(folder, f"cluster-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def local_cluster(devices: Optional[Sequence[str]] = None, refresh: bool = False, budget_s: float = 10.0,
                  cache_dir: Optional[str] = None) -> ResourceGraph:
    """This host's resource graph: read from the cache, or calibrated and
    cached.

    Args:
        devices: the devices (default: those `smp.init` set up, or every
            logical device TensorFlow has).
        refresh: measure again even when a cached graph exists.
        budget_s: the calibration's time budget.
        cache_dir: the cache folder (default ``$SMP_TF_CACHE`` or
            ``~/.cache/smp_tf``).
    """
    if devices is None:
        devices = _local_devices()
    path = cache_path(devices, cache_dir)
    if not refresh and os.path.exists(path):
        try:
            with open(path) as f:
                return ResourceGraph.from_dict(json.load(f), source="cached")
        except (ValueError, OSError):
            pass  # a damaged cache is measured again
    graph = calibrate(devices, budget_s=budget_s)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(graph.to_dict(), f, indent=1)
    os.replace(tmp, path)
    return graph


def _local_devices() -> List[str]:
    from smp_tf import state

    if state.is_initialized():
        return state.topology().all_devices()
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
