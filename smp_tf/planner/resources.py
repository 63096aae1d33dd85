"""The resource graph of a cluster: hosts, devices and the links between them.

A `ResourceGraph` says what the machines a job runs on can do, in the units
of smp_tf's cost model (`smp_tf.graph_view.estimate_flops`):

* a **device** has a kind (``"CPU"``, ``"GPU"``), a host, a memory capacity,
  a speed per cost class of the flop model (floating-point operations per
  second for ``"matmul"``: products, ``"conv"``: convolutions,
  ``"elementwise"``: everything else), optionally the speed of particular
  op types the element-wise class misses (``"ops"``), and a fixed
  overhead per op;
* a **link** between two devices has a bandwidth (bytes per second) and a
  latency (seconds), and a class: ``"device"`` (the same device),
  ``"host"`` (two devices of one host), ``"network"`` (two hosts).

It is built from a plain dict (or a JSON file of one), so a user can plan
for machines they do not have, or measured on this host by a short
calibration (`smp_tf.planner.calibrate`). Plain Python: it imports no
TensorFlow.

The dict::

    {"hosts": {"a": {"devices": [
         {"name": "GPU:0", "kind": "GPU", "memory": 80e9,
          "flops": {"matmul": 3e14, "conv": 2e14, "elementwise": 1e12},
          "overhead": 5e-6, "ops": {"SparseSoftmaxCrossEntropyWithLogits": 2e11}},
         ...]},
       "b": {...}},
     "links": {"host": {"bandwidth": 2e11, "latency": 5e-6},
               "network": {"bandwidth": 2.5e10, "latency": 2e-5},
               "pairs": [{"a": "a/GPU:0", "b": "b/GPU:0", "bandwidth": 5e10, "latency": 1e-5}]}}

Devices are named ``host/name``. A link between two devices is the pair's
own entry when ``pairs`` has one, else its class's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

__all__ = ["COST_CLASSES", "cost_class", "Device", "Link", "ResourceGraph", "stage_devices", "effective_speeds"]

#: The cost classes of the flop model, each with its own measured speed.
COST_CLASSES = ("matmul", "conv", "elementwise")
#: Link classes, from the fastest.
LINK_CLASSES = ("device", "host", "network")

_MATMUL = frozenset(["MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"])
_CONV_PREFIXES = ("Conv", "DepthwiseConv")


def cost_class(op_type: str) -> str:
    """The cost class of an op type: ``"matmul"``, ``"conv"`` or ``"elementwise"``."""
    if op_type in _MATMUL:
        return "matmul"
    if op_type.startswith(_CONV_PREFIXES):
        return "conv"
    return "elementwise"


def _positive(value: Any, what: str, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{what} must be a number. Received: {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{what} must be {'non-negative' if allow_zero else 'positive'}. Received: {value!r}")
    return float(value)


@dataclass(frozen=True)
class Device:
    """One device of the cluster.

    Attributes:
        name: ``host/name`` (``"worker-1/GPU:0"``).
        host: the host it belongs to.
        kind: ``"CPU"`` or ``"GPU"`` (or another accelerator's name).
        memory: bytes it can hold (0: unknown).
        flops: operations per second per cost class (`COST_CLASSES`).
        overhead: seconds each op costs besides its operations.
        bandwidth: bytes per second a product or convolution streams its
            operands at (weights that do not stay in a cache); 0: not
            modelled. A product of few rows by a large weight costs its
            bytes at this rate besides its operations.
        ops: op type -> its own speed (flop-model units per second), used
            instead of its class's: op types whose work per element the
            element-wise class misses (the calibration measures
            `smp_tf.planner.calibrate.MEASURED_OPS`: a softmax
            cross-entropy costs about ten multiplications per logit).
    """

    name: str
    host: str
    kind: str
    memory: int
    flops: Mapping[str, float]
    overhead: float = 0.0
    bandwidth: float = 0.0
    ops: Mapping[str, float] = field(default_factory=dict)

    def op_speed(self, op_type: str) -> float:
        """The speed an op of `op_type` runs at here (flop-model units per second)."""
        own = self.ops.get(op_type)
        return own if own is not None else self.flops[cost_class(op_type)]

    def seconds(self, flops_by_class: Mapping[str, float], ops: int = 0) -> float:
        """Predicted time of `ops` ops doing `flops_by_class` operations here."""
        return sum(f / self.flops[c] for c, f in flops_by_class.items() if f) + ops * self.overhead

    def speed(self) -> float:
        """One figure for the device's speed: its element-wise, product and
        convolution speeds' geometric mean (for reports)."""
        values = [self.flops[c] for c in COST_CLASSES]
        return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass(frozen=True)
class Link:
    """What moving bytes between two devices costs.

    Attributes:
        kind: ``"device"``, ``"host"`` or ``"network"``.
        bandwidth: bytes per second.
        latency: seconds per transfer.
    """

    kind: str
    bandwidth: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        """Time to move `nbytes` over the link (0 on the same device)."""
        if self.kind == "device" or nbytes <= 0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


#: The runtime figures a resource graph may hold (`ResourceGraph.runtime`).
RUNTIME_KEYS = ("step", "action", "dispatch", "parallel")


@dataclass
class ResourceGraph:
    """Hosts, devices and links (module doc).

    Attributes:
        devices: every device, in the order given (host by host).
        links: the link of each link class (``"host"``, ``"network"``).
        pairs: links measured or given for a pair of devices, keyed by the
            sorted pair of names.
        source: where it came from (``"given"``, ``"calibrated"``, ``"cached"``).
        seconds: how long the calibration took (0 when given or cached).
        runtime: what the runtime costs besides the ops, in seconds:
            ``"step"`` per step (calling the compiled step), ``"action"``
            per action of the pipeline (dispatching a task's function),
            ``"dispatch"`` per op each micro-batch runs, added to the
            step's wall time (what the step's own ops cost beyond their
            work as the step runs them), and ``"parallel"``, the share of
            a task's ops' side-by-side parallelism the runtime realizes
            (0 to 1; missing: 1): both measured by a probe of the step
            (``smp.plan(..., probe=True)``). Other missing keys count 0.
        cores: host -> the CPU cores its CPU devices share (logical CPU
            devices of one process, or processes pinned to the same
            cores): when more of them run at once than there are cores,
            each runs slower in proportion. A host not listed: its devices
            do not share (GPUs, or one core per device).
    """

    devices: List[Device]
    links: Dict[str, Link]
    pairs: Dict[Tuple[str, str], Link] = field(default_factory=dict)
    source: str = "given"
    seconds: float = 0.0
    cores: Dict[str, float] = field(default_factory=dict)
    runtime: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name = {d.name: d for d in self.devices}
        names = [d.name for d in self.devices]
        if not names:
            raise ValueError("A resource graph needs at least one device.")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Device names must be unique; repeated: {dup}.")
        known = set(names)
        for a, b in self.pairs:
            for n in (a, b):
                if n not in known:
                    raise ValueError(f"A link names device {n!r}, which is not in the graph. Devices: {names}.")
        hosts = {d.host for d in self.devices}
        for key, value in self.runtime.items():
            if key not in RUNTIME_KEYS:
                raise ValueError(f"runtime has unknown key {key!r}: use 'step', 'action', 'dispatch' (seconds) "
                                 "or 'parallel' (a share, 0 to 1).")
            _positive(value, f"runtime[{key!r}]", allow_zero=True)
            if key == "parallel" and value > 1:
                raise ValueError(f"runtime['parallel'] is a share of the ops' parallelism, 0 to 1. Received: {value}")
        for host, n in self.cores.items():
            if host not in hosts:
                raise ValueError(f"cores names host {host!r}, which has no device. Hosts: {sorted(hosts)}.")
            _positive(n, f"hosts[{host!r}].cores")
        needed = {"host"} if any(sum(d.host == h for d in self.devices) > 1 for h in hosts) else set()
        if len(hosts) > 1:
            needed.add("network")
        missing = sorted(k for k in needed - set(self.links)
                         if not self._pairs_cover(k))
        if missing:
            raise ValueError(
                f"The graph has devices joined by {missing} links but no bandwidth and latency for them: "
                f"give links[{missing[0]!r}] = {{'bandwidth': ..., 'latency': ...}}."
            )

    def _pairs_cover(self, kind: str) -> bool:
        return all((tuple(sorted((a.name, b.name))) in self.pairs)
                   for a in self.devices for b in self.devices
                   if a.name < b.name and self._kind(a, b) == kind)

    # -- lookups -------------------------------------------------------------
    @property
    def hosts(self) -> List[str]:
        """The hosts, in the order of their first device."""
        out: List[str] = []
        for d in self.devices:
            if d.host not in out:
                out.append(d.host)
        return out

    def device(self, name: str) -> Device:
        """The device named `name` (``host/name``, or ``name`` on one host)."""
        found = self._by_name.get(name)
        if found is not None:
            return found
        for d in self.devices:
            if d.name == name or (len(self.hosts) == 1 and d.name.split("/", 1)[1] == name):
                return d
        raise KeyError(f"No device {name!r} in the resource graph. Devices: {[d.name for d in self.devices]}.")

    @staticmethod
    def _kind(a: Device, b: Device) -> str:
        if a.name == b.name:
            return "device"
        return "host" if a.host == b.host else "network"

    def link(self, a: str, b: str) -> Link:
        """The link between devices `a` and `b`."""
        # Planning asks for the same pairs very often: remember them.
        memo = self.__dict__.setdefault("_link_memo", {})
        found = memo.get((a, b))
        if found is None:
            found = memo[(a, b)] = self._link(a, b)
        return found

    def _link(self, a: str, b: str) -> Link:
        da, db = self.device(a), self.device(b)
        kind = self._kind(da, db)
        if kind == "device":
            return Link("device", float("inf"), 0.0)
        own = self.pairs.get(tuple(sorted((da.name, db.name))))
        return own if own is not None else self.links[kind]

    # -- conversions -----------------------------------------------------------
    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], source: str = "given") -> "ResourceGraph":
        """Builds a graph from the dict of the module doc, checking every value.

        Raises:
            ValueError: a missing or malformed entry (named in the message).
        """
        if not isinstance(spec, Mapping) or not isinstance(spec.get("hosts"), Mapping) or not spec["hosts"]:
            raise ValueError("A cluster is a dict with 'hosts': {host name: {'devices': [...]}, ...} "
                             f"(see docs/planner.md). Received: {spec!r:.200}")
        devices = []
        cores: Dict[str, float] = {}
        for host, entry in spec["hosts"].items():
            items = entry.get("devices") if isinstance(entry, Mapping) else None
            if not isinstance(items, Sequence) or not items:
                raise ValueError(f"Host {host!r} needs a non-empty 'devices' list. Received: {entry!r:.200}")
            if entry.get("cores") is not None:
                cores[str(host)] = _positive(entry["cores"], f"hosts[{host!r}].cores")
            for k, d in enumerate(items):
                where = f"hosts[{host!r}].devices[{k}]"
                if not isinstance(d, Mapping) or "name" not in d:
                    raise ValueError(f"{where} must be a dict with a 'name'. Received: {d!r:.200}")
                flops = d.get("flops")
                if not isinstance(flops, Mapping) or set(flops) != set(COST_CLASSES):
                    raise ValueError(f"{where}.flops must give operations per second for each of {list(COST_CLASSES)}. "
                                     f"Received: {flops!r}")
                devices.append(Device(
                    name=f"{host}/{d['name']}", host=str(host), kind=str(d.get("kind", "CPU")),
                    memory=int(_positive(d.get("memory", 0), f"{where}.memory", allow_zero=True)),
                    flops={c: _positive(flops[c], f"{where}.flops[{c!r}]") for c in COST_CLASSES},
                    overhead=_positive(d.get("overhead", 0.0), f"{where}.overhead", allow_zero=True),
                    bandwidth=_positive(d.get("bandwidth", 0.0), f"{where}.bandwidth", allow_zero=True),
                    ops=_parse_ops(d.get("ops"), where),
                ))
        links_spec = spec.get("links", {}) or {}
        if not isinstance(links_spec, Mapping):
            raise ValueError(f"'links' must be a dict. Received: {links_spec!r:.200}")
        unknown = sorted(set(links_spec) - {"host", "network", "pairs"})
        if unknown:
            raise ValueError(f"Unknown link classes {unknown}: use 'host', 'network' and 'pairs'.")

        def link(kind: str, d: Any, where: str) -> Link:
            if not isinstance(d, Mapping):
                raise ValueError(f"{where} must be a dict with 'bandwidth' and 'latency'. Received: {d!r:.200}")
            return Link(kind, _positive(d.get("bandwidth"), f"{where}.bandwidth"),
                        _positive(d.get("latency", 0.0), f"{where}.latency", allow_zero=True))

        links = {k: link(k, links_spec[k], f"links[{k!r}]") for k in ("host", "network") if k in links_spec}
        pairs: Dict[Tuple[str, str], Link] = {}
        hosts_of = {d.name: d.host for d in devices}
        for k, p in enumerate(links_spec.get("pairs", []) or []):
            if not isinstance(p, Mapping) or "a" not in p or "b" not in p:
                raise ValueError(f"links.pairs[{k}] needs 'a' and 'b' (device names host/name). Received: {p!r:.200}")
            a, b = str(p["a"]), str(p["b"])
            for n in (a, b):
                if n not in hosts_of:
                    raise ValueError(f"links.pairs[{k}] names device {n!r}, which is not in the graph. "
                                     f"Devices: {sorted(hosts_of)}.")
            kind = "host" if hosts_of[a] == hosts_of[b] else "network"
            pairs[tuple(sorted((a, b)))] = link(kind, p, f"links.pairs[{k}]")
        runtime = spec.get("runtime", {}) or {}
        if not isinstance(runtime, Mapping):
            raise ValueError("'runtime' must be a dict {'step': seconds, 'action': seconds, 'dispatch': seconds, "
                             "'parallel': share}. "
                             f"Received: {runtime!r:.200}")
        return cls(devices, links, pairs, source=source, cores=cores, runtime=dict(runtime))

    def to_dict(self) -> Dict[str, Any]:
        """The dict `from_dict` reads back."""
        hosts: Dict[str, Any] = {}
        for d in self.devices:
            hosts.setdefault(d.host, {"devices": []})["devices"].append({
                "name": d.name.split("/", 1)[1], "kind": d.kind, "memory": d.memory,
                "flops": dict(d.flops), "overhead": d.overhead, "bandwidth": d.bandwidth,
                **({"ops": dict(d.ops)} if d.ops else {})})
        for host, n in self.cores.items():
            hosts[host]["cores"] = n
        links: Dict[str, Any] = {k: {"bandwidth": l.bandwidth, "latency": l.latency} for k, l in self.links.items()}
        if self.pairs:
            links["pairs"] = [{"a": a, "b": b, "bandwidth": l.bandwidth, "latency": l.latency}
                              for (a, b), l in sorted(self.pairs.items())]
        out: Dict[str, Any] = {"hosts": hosts, "links": links}
        if self.runtime:
            out["runtime"] = dict(self.runtime)
        return out

    def with_runtime(self, **figures: float) -> "ResourceGraph":
        """A copy with these `runtime` figures set (seconds; ``parallel``
        a share), the rest kept.

        Raises:
            ValueError: an unknown figure, a negative one, or a share above 1.
        """
        return dataclasses.replace(self, runtime={**self.runtime, **figures})

    @classmethod
    def from_json(cls, path: str) -> "ResourceGraph":
        """Reads the dict from a JSON file."""
        if not os.path.exists(path):
            raise ValueError(f"Cluster file {path!r} does not exist.")
        with open(path) as f:
            try:
                spec = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"Cluster file {path!r} is not JSON: {e}") from e
        return cls.from_dict(spec)

    # -- report ------------------------------------------------------------------
    def table(self) -> str:
        """A readable table: the devices, then the links."""
        w = max(len(d.name) for d in self.devices)
        lines = [f"ResourceGraph ({self.source}{f', {self.seconds:.1f} s' if self.seconds else ''}): "
                 f"{len(self.hosts)} host(s), {len(self.devices)} device(s)",
                 f"{'device':<{w}}  {'kind':<4}  {'memory':>9}  {'matmul':>9}  {'conv':>9}  {'elementwise':>11}  "
                 f"{'overhead':>9}  {'stream':>7}",
                 f"{'':<{w}}  {'':<4}  {'GiB':>9}  {'GFLOP/s':>9}  {'GFLOP/s':>9}  {'GFLOP/s':>11}  {'us/op':>9}  "
                 f"{'GB/s':>7}"]
        for d in self.devices:
            lines.append(f"{d.name:<{w}}  {d.kind:<4}  {d.memory / 2**30:>9.2f}  {d.flops['matmul'] / 1e9:>9.2f}  "
                         f"{d.flops['conv'] / 1e9:>9.2f}  {d.flops['elementwise'] / 1e9:>11.2f}  "
                         f"{d.overhead * 1e6:>9.1f}  {d.bandwidth / 1e9:>7.1f}")
        # Measured op types: one line per set of devices with the same figures.
        by_ops: Dict[Tuple[Tuple[str, float], ...], List[str]] = {}
        for d in self.devices:
            if d.ops:
                by_ops.setdefault(tuple(sorted(d.ops.items())), []).append(d.name)
        for ops, names in by_ops.items():
            lines.append(f"op types (GFLOP/s) on {', '.join(names)}: "
                         + ", ".join(f"{t} {v / 1e9:.2f}" for t, v in ops))
        for host, n in self.cores.items():
            shared = sum(d.host == host and d.kind == "CPU" for d in self.devices)
            lines.append(f"host {host}: its {shared} CPU device(s) share {n:g} core(s)")
        if self.runtime:
            lines.append("runtime: " + ", ".join(f"{k} share {v:.2f}" if k == "parallel" else f"{k} {v * 1e6:.1f} us"
                                                 for k, v in sorted(self.runtime.items())))
        lines.append("links:")
        for kind, l in sorted(self.links.items()):
            lines.append(f"  {kind:<8} {l.bandwidth / 1e9:>9.2f} GB/s  {l.latency * 1e6:>8.1f} us")
        for (a, b), l in sorted(self.pairs.items()):
            lines.append(f"  {a} <-> {b} ({l.kind}): {l.bandwidth / 1e9:.2f} GB/s, {l.latency * 1e6:.1f} us")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _parse_ops(spec: Any, where: str) -> Dict[str, float]:
    """A device's ``ops`` entry: op type -> positive speed."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}.ops must be a dict of op type -> operations per second. Received: {spec!r:.200}")
    return {str(t): _positive(v, f"{where}.ops[{t!r}]") for t, v in spec.items()}


def graph_flops_by_class(op_types: Iterable[str], flops: Iterable[float]) -> Dict[str, float]:
    """Sums ops' flops per cost class (`cost_class`)."""
    out = {c: 0.0 for c in COST_CLASSES}
    for t, f in zip(op_types, flops):
        out[cost_class(t)] += float(f)
    return out


def stage_devices(graph: ResourceGraph, num_stages: int, partitions: int) -> List[Device]:
    """The device of each pipeline stage (model chunk): stage ``c`` on the
    graph's device ``c % partitions``, the devices in the graph's order.

    Raises:
        ValueError: the graph has fewer devices than `partitions`.
    """
    if len(graph.devices) < partitions:
        raise ValueError(
            f"The cluster has {len(graph.devices)} device(s) for partitions={partitions}: describe at least one "
            "device per partition (their order is the stages' order)."
        )
    return [graph.devices[c % partitions] for c in range(num_stages)]


def effective_speeds(devices: Sequence[Device], flops_by_class: Mapping[str, float], ops: int = 0) -> List[float]:
    """Each device's speed on a workload of this mix (operations per second):
    its total operations over the time the device takes for all of them, so
    that a device fast at products and slow at element-wise ops counts as
    fast for a graph of products."""
    total = sum(flops_by_class.values())
    if total <= 0:
        return [1.0 for _ in devices]
    return [total / max(d.seconds(flops_by_class, ops), 1e-30) for d in devices]
