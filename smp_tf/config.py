"""The smp_tf configuration: the dict given to `smp.init` and its validation.

The keys and their meaning follow the SageMaker model parallel library for
TensorFlow, so that a script written for it runs unchanged:

=====================  =============  =======================================
key                    default        meaning
=====================  =============  =======================================
partitions             1              pipeline stages (one device each);
                                      alias ``pipeline_parallel_degree``
microbatches           1              micro-batches each batch is split into
pipeline               "interleaved"  ``"interleaved"`` (1F1B), ``"simple"``
                                      (all forwards, then all backwards) or
                                      ``"zero_bubble"`` (1F1B with weight
                                      gradients moved into the bubbles); any
                                      name `smp_tf.schedules` registers
virtual_stages         1              (smp_tf only) model chunks per device:
                                      the model is cut into partitions x
                                      virtual_stages chunks, chunk c on
                                      device c % partitions (Megatron-LM's
                                      interleaved schedule)
optimize               "speed"        partitioner objective: ``"speed"`` or
                                      ``"memory"``
auto_partition         True           partition the model automatically
default_partition      0 / required   partition of ops outside any
                                      ``smp.partition`` scope; required when
                                      ``auto_partition`` is False
contiguous             True           each partition is one contiguous block
                                      of the model
placement_strategy     "cluster"      ``"cluster"`` or ``"spread"`` device
                                      order
horovod                False          data parallelism across processes
fuse_weight_gradients  False          (smp_tf only) compute dense weight and
                                      bias gradients once over all
                                      micro-batches, after the pipeline
pretranspose_weights   False          (smp_tf only) transpose dense kernels
                                      once per step for the products that
                                      read them transposed
dp_timeout             60.0           (smp_tf only) seconds after which a
                                      dead or stalled replica stops the
                                      others with an error
shard_inputs           True           (smp_tf only) Keras fit/evaluate with
                                      data parallelism: every replica takes
                                      its share of each (global) batch
uneven_inputs          "join"         (smp_tf only) a replica that runs out
                                      of data first: ``"join"`` (it keeps
                                      joining the collectives) or
                                      ``"raise"`` (every replica raises)
recompute              "never"        (smp_tf only) activation
                                      recomputation: ``"never"``,
                                      ``"selective"``, ``"full"`` or
                                      ``"auto"`` (only where needed to fit
                                      ``memory_budget``)
memory_budget          None           (smp_tf only) bytes each partition's
                                      device may use; None: the device's
                                      memory on GPUs, no limit on CPUs
pipeline_processes     1              (smp_tf only) processes one pipeline
                                      spans; with n processes there are
                                      n / pipeline_processes replicas
tensor_parallel_degree 1              devices each partition's ops are
                                      split over (tensor parallelism); a
                                      replica uses partitions x this many
layout_map             None           (smp_tf only) variable path regular
                                      expression -> shard spec (see
                                      ``smp.LayoutMap``); None with
                                      tensor_parallel_degree > 1: the
                                      built-in rules
cluster                None           (smp_tf only) the machines to plan
                                      for: a dict or the path of a JSON
                                      file (``smp.cluster()``); None: this
                                      host, calibrated
shard_optimizer_state  False          with data parallelism, each replica
                                      keeps and updates 1/R of every
                                      optimizer slot of its variables; the
                                      gradients are reduce-scattered, the
                                      parameters all-gathered after the
                                      update
sequence_parallel      False          with tensor_parallel_degree > 1,
                                      the ops between the tensor-parallel
                                      regions (norms, dropouts, residual
                                      additions) split along the sequence
auto                   False          (smp_tf only) plan the configuration
                                      (``smp.plan``) at a step's first call
                                      and re-initialise with the best one;
                                      sets up every GPU, or one logical CPU
                                      device per core
=====================  =============  =======================================

As on SageMaker, the JSON object in the environment variable
``SM_HP_MP_PARAMETERS`` (if set) overrides the keys of the dict given in code.

This module does not import TensorFlow, so configs can be validated cheaply
(for example by a launcher).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import numbers
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Config", "ENV_VAR", "parse_config"]

#: Environment variable whose JSON object overrides the keys of the config dict.
ENV_VAR = "SM_HP_MP_PARAMETERS"

#: Alias of ``partitions`` (the name used by newer SageMaker releases).
_PARTITIONS_ALIAS = "pipeline_parallel_degree"

#: Allowed values of the string-valued keys.
_CHOICES: Dict[str, Tuple[str, ...]] = {
    "optimize": ("speed", "memory"),
    "placement_strategy": ("cluster", "spread"),
    "uneven_inputs": ("join", "raise"),
    "recompute": ("never", "selective", "full", "auto"),
}
_INT_KEYS = (
    "partitions", "microbatches", "default_partition", "pipeline_processes", "virtual_stages", "tensor_parallel_degree",
)
_BOOL_KEYS = (
    "auto_partition", "contiguous", "horovod", "fuse_weight_gradients", "pretranspose_weights", "shard_inputs", "auto",
    "shard_optimizer_state", "sequence_parallel",
)


@dataclass(frozen=True)
class Config:
    """A validated smp_tf configuration (see the module doc for the keys).

    Build it with `parse_config` (or `smp.init`), which also accepts the alias
    ``pipeline_parallel_degree`` and the environment override. Constructing
    `Config` directly validates the values as well.

    Attributes:
        partitions: number of pipeline stages; each runs on its own device.
        microbatches: number of micro-batches each batch is split into.
        pipeline: the pipeline schedule: ``"interleaved"``, ``"simple"``,
            ``"zero_bubble"`` or another kind registered with
            `smp_tf.schedules.register_schedule`.
        optimize: ``"speed"`` or ``"memory"``: what the partitioner balances.
        auto_partition: whether the model is partitioned automatically.
        default_partition: partition of ops not placed explicitly. Resolved
            to 0 when `auto_partition` is True and it is not given.
        contiguous: whether each partition is a contiguous block of the model.
        placement_strategy: ``"cluster"`` or ``"spread"``.
        horovod: whether data parallelism across processes is enabled.
        fuse_weight_gradients: compute each eligible weight gradient once
            over all micro-batches instead of once per micro-batch (faster;
            keeps those layers' inputs and output gradients of every
            micro-batch alive until the end of the step).
        dp_timeout: with data parallelism, the seconds after which a replica
            that died, hung, or stopped joining the collectives makes the
            others stop with an error naming it (heartbeats detect a dead
            replica within min(10, dp_timeout) seconds).
        shard_inputs: with data parallelism, Keras ``fit`` and ``evaluate``
            give each replica its share of every batch (rows ``rank``,
            ``rank + size``, ...), so that ``batch_size`` is the global batch
            as with ``tf.distribute``; False: each replica trains on the data
            it is given (shard it yourself, e.g. with ``dataset.shard``).
        uneven_inputs: with data parallelism, what happens when a replica
            runs out of data before the others: ``"join"`` (it keeps joining
            the collectives, contributing nothing, until all are done; see
            `smp.join`) or ``"raise"`` (every replica raises at the first
            uneven step).
        pretranspose_weights: give the products that read a kernel
            transposed (a dense layer's input gradient ``dY @ W^T``) a copy of
            the kernel transposed once per step, instead of a transposed read
            in every micro-batch (faster where small transposed products are
            slow, e.g. on CPUs; holds one transposed copy of those kernels
            during the step).
        recompute: activation recomputation. ``"never"``: a partition keeps
            every activation its backward reads. ``"full"``: it keeps only
            what it received from other partitions (and the outputs of ops
            that may not run twice, such as the seed a dropout read); its
            backward recomputes the rest of its forward. ``"selective"``:
            it also keeps the outputs of expensive ops (products,
            convolutions) and dropout keep masks, and recomputes the cheap
            ops. ``"auto"``: each
            partition uses the cheapest of these that fits
            `memory_budget` (``"never"`` where there is no budget).
        memory_budget: bytes each partition's device may hold at its peak.
            The partitioner picks a layout whose predicted peak fits every
            device (``optimize="memory"``), recomputing where
            ``recompute="auto"`` says so, and a step that cannot fit raises
            before it runs. None: on GPUs the device's memory, on CPUs no
            limit.
        pipeline_processes: processes each pipeline spans (each holds
            ``partitions / pipeline_processes`` consecutive partitions, on
            its own devices; `smp_tf.distributed.layout`). The first process
            of a pipeline traces and drives the step; the others serve their
            devices to it. With n processes there are
            ``n / pipeline_processes`` data-parallel replicas.
        virtual_stages: model chunks per device (v). The model is cut into
            ``partitions * v`` chunks (`num_stages`), chunk ``c`` on device
            ``c % partitions``; ``smp.partition(i)`` and
            ``default_partition`` name chunks. Under ``interleaved`` a
            device runs its chunks depth first (Megatron-LM's interleaved
            1F1B), which divides the bubble by about v for more boundary
            traffic.
        tensor_parallel_degree: devices per partition (t). Each partition
            (model chunk) gets t devices of this process, and its sharded
            ops are split over them (`docs/tensor_parallelism.md`).
        layout_map: which variables are split over a partition's t
            devices: regular expression on the variable's path -> spec
            (one ``"tensor"`` or None per dimension), as a dict or a
            `smp.LayoutMap`; kept as a tuple of ``(key, spec)`` pairs.
            None: the built-in rules decide (with t > 1).
        cluster: the resource graph to plan for (`smp.cluster()`): a dict
            (kept as its JSON text) or the path of a JSON file; None: this
            host, calibrated.
        auto: plan the configuration at a step's first call (`smp.plan`)
            and re-initialise with the best plan's keys; the keys it
            chooses are ignored until then.
        shard_optimizer_state: with data parallelism over R replicas, each
            replica keeps and updates a 1/R piece of every optimizer slot of
            its variables (ZeRO stage 1): the gradients are reduce-scattered
            instead of all-reduced and the parameters all-gathered after the
            update (`docs/sharded_data_parallelism.md`). Needs
            ``horovod`` and several replicas.
        sequence_parallel: with ``tensor_parallel_degree`` t > 1, the ops
            that run whole between the tensor-parallel regions (norms,
            dropouts, residual additions, biases) run on 1/t of the
            sequence each (Megatron-LM's sequence parallelism): a
            row-parallel product's all-reduce becomes a reduce-scatter and
            the next column-parallel product's input is all-gathered
            (`docs/tensor_parallelism.md`).

    Raises:
        ValueError: a value has the wrong type or is out of range.
    """

    partitions: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    optimize: str = "speed"
    auto_partition: bool = True
    default_partition: Optional[int] = None
    contiguous: bool = True
    placement_strategy: str = "cluster"
    horovod: bool = False
    fuse_weight_gradients: bool = False
    pretranspose_weights: bool = False
    dp_timeout: float = 60.0
    shard_inputs: bool = True
    uneven_inputs: str = "join"
    recompute: str = "never"
    memory_budget: Optional[int] = None
    pipeline_processes: int = 1
    virtual_stages: int = 1
    tensor_parallel_degree: int = 1
    layout_map: Optional[Any] = None
    cluster: Optional[Any] = None
    auto: bool = False
    shard_optimizer_state: bool = False
    sequence_parallel: bool = False

    @property
    def raises_on_uneven_inputs(self) -> bool:
        """Whether a replica that runs out of data first makes every replica
        raise: ``uneven_inputs="raise"``, or ``shard_optimizer_state`` (each
        replica owns a piece of the optimizer state, which the others cannot
        update without)."""
        return self.uneven_inputs == "raise" or self.shard_optimizer_state

    @property
    def num_stages(self) -> int:
        """Model chunks the step is cut into: ``partitions * virtual_stages``."""
        return self.partitions * self.virtual_stages

    def _stages_phrase(self) -> str:
        """How errors name `num_stages`: the partitions, or the model chunks."""
        if self.virtual_stages == 1:
            return f"partitions ({self.partitions})"
        return f"model chunks, partitions x virtual_stages ({self.num_stages})"

    def __post_init__(self) -> None:
        for key in _INT_KEYS:
            value = getattr(self, key)
            if key == "default_partition" and value is None:
                continue
            # numpy integers are accepted, but stored as Python ints so that
            # the config stays hashable, comparable and JSON-serialisable.
            object.__setattr__(self, key, _check_int(key, value))
        for key in _BOOL_KEYS:
            _check_bool(key, getattr(self, key))
        for key, options in _CHOICES.items():
            _check_choice(key, getattr(self, key), options)
        # The schedules register themselves; importing them costs no TensorFlow.
        from smp_tf.schedules import schedule_kinds

        _check_choice("pipeline", self.pipeline, schedule_kinds())

        timeout = self.dp_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (0 < float(timeout) < float("inf")):
            raise ValueError(
                "Config parameter 'dp_timeout' must be a positive number of seconds. "
                f"Received: dp_timeout={timeout!r}"
            )
        object.__setattr__(self, "dp_timeout", float(timeout))
        budget = self.memory_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not (0 < float(budget) < float("inf")):
                raise ValueError(
                    "Config parameter 'memory_budget' must be a positive number of bytes per device "
                    f"(e.g. 8 * 2**30 for 8 GiB) or None. Received: memory_budget={budget!r}"
                )
            object.__setattr__(self, "memory_budget", int(budget))
        if self.layout_map is not None:
            object.__setattr__(self, "layout_map", _check_layout_map(self.layout_map))
        if self.cluster is not None:
            object.__setattr__(self, "cluster", _check_cluster(self.cluster))
        for key in ("partitions", "microbatches", "pipeline_processes", "virtual_stages", "tensor_parallel_degree"):
            if getattr(self, key) < 1:
                raise ValueError(
                    f"Config parameter '{key}' must be at least 1. "
                    f"Received: {key}={getattr(self, key)!r}"
                )

        if self.shard_optimizer_state:
            for key, value in (("tensor_parallel_degree", self.tensor_parallel_degree),
                               ("pipeline_processes", self.pipeline_processes)):
                if value > 1:
                    raise ValueError(
                        f"shard_optimizer_state=True does not compose with {key}={value} yet: shard the "
                        f"optimizer state of pipelines that run in one process each, with {key}=1."
                    )

        if self.sequence_parallel and self.tensor_parallel_degree < 2:
            raise ValueError(
                "sequence_parallel=True splits the activations between the tensor-parallel regions over a "
                "partition's tensor_parallel_degree devices, so it needs tensor_parallel_degree > 1. Received: "
                f"tensor_parallel_degree={self.tensor_parallel_degree}. Set tensor_parallel_degree to 2 or more, "
                "or leave sequence_parallel False."
            )

        if self.partitions % self.pipeline_processes:
            raise ValueError(
                f"partitions={self.partitions} cannot be shared evenly by pipeline_processes="
                f"{self.pipeline_processes}: each process of a pipeline holds the same number of "
                "partitions. Use a number of partitions that is a multiple of pipeline_processes."
            )

        if self.default_partition is None:
            if not self.auto_partition:
                raise ValueError(
                    "Config parameter 'default_partition' is required when "
                    "auto_partition is False: it is the partition of every op "
                    "that is not inside an `smp.partition` scope. "
                    "Received: auto_partition=False, default_partition=None"
                )
            object.__setattr__(self, "default_partition", 0)
        elif self.default_partition < 0:
            raise ValueError(
                "Config parameter 'default_partition' must be non-negative. "
                f"Received: default_partition={self.default_partition!r}"
            )
        elif self.default_partition >= self.num_stages:
            raise ValueError(
                f"default_partition={self.default_partition!r} must be less than "
                f"the number of {self._stages_phrase()}. Config parameter 'default_partition' is a partition index in "
                f"[0, {self.num_stages})."
            )

    def to_dict(self) -> Dict[str, Any]:
        """Returns the config as a plain dict (accepted back by `parse_config`).

        Returns:
            A dict mapping each config key to its value.
        """
        out = dataclasses.asdict(self)
        if self.layout_map is not None:
            out["layout_map"] = {key: tuple(spec) for key, spec in self.layout_map}
        if self.cluster is not None and self.cluster.lstrip().startswith("{"):
            out["cluster"] = json.loads(self.cluster)
        return out


def _check_cluster(value: Any) -> str:
    """A cluster as JSON text (a dict, checked) or a JSON file's path (read
    and checked): hashable, and the same value when it comes back."""
    from smp_tf.planner.resources import ResourceGraph

    if isinstance(value, Mapping):
        ResourceGraph.from_dict(value)
        return json.dumps(value, sort_keys=True)
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.lstrip().startswith("{"):
            ResourceGraph.from_dict(json.loads(text))
            return text
        ResourceGraph.from_json(text)
        return text
    raise ValueError(
        "Config parameter 'cluster' must be a dict describing hosts, devices and links, or the path of a "
        f"JSON file of one (docs/planner.md). Received: cluster={value!r:.200} (of type {type(value).__name__})"
    )


def _check_layout_map(value: Any) -> Tuple[Tuple[str, Tuple[Optional[str], ...]], ...]:
    """A layout map as a tuple of ``(regular expression, spec)`` pairs (hashable)."""
    from smp_tf.sharding.layout_map import LayoutMap

    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ValueError(
            "Config parameter 'layout_map' must be a dict (or smp.LayoutMap) from a regular expression "
            "on variable paths to a spec such as (None, 'tensor'). "
            f"Received: layout_map={value!r} (of type {type(value).__name__})"
        )
    checked = LayoutMap(dict(items))
    return tuple((k, checked[k].dims) for k in checked)


def _valid_keys() -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Config)) + (_PARTITIONS_ALIAS,)


def _check_int(key: str, value: Any) -> int:
    # bool is a subclass of int, but `partitions=True` is certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"Config parameter '{key}' must be an integer. "
            f"Received: {key}={value!r} (of type {type(value).__name__})"
        )
    return int(value)


def _check_bool(key: str, value: Any) -> None:
    # Strict: `contiguous=1` or `horovod="false"` are rejected rather than
    # guessed at ("false" would be truthy).
    if not isinstance(value, bool):
        raise ValueError(
            f"Config parameter '{key}' must be a boolean (True or False). "
            f"Received: {key}={value!r} (of type {type(value).__name__})"
        )


def _check_choice(key: str, value: Any, options: Tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in options:
        raise ValueError(
            f"Config parameter '{key}' must be one of "
            f"{', '.join(repr(o) for o in options)}. Received: {key}={value!r}"
        )


def _read_environment(environ: Mapping[str, str]) -> Dict[str, Any]:
    raw = environ.get(ENV_VAR)
    # An empty value is how a variable is commonly "unset" in shell scripts
    # (`export SM_HP_MP_PARAMETERS=`); treat it as no override.
    if raw is None or not str(raw).strip():
        return {}
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"The environment variable {ENV_VAR} must hold a JSON object such "
            f'as {{"partitions": 2, "microbatches": 4}}, but it is not valid '
            f"JSON ({e}). Received: {ENV_VAR}={raw!r}"
        ) from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"The environment variable {ENV_VAR} must hold a JSON object such "
            f'as {{"partitions": 2, "microbatches": 4}}, but it holds a JSON '
            f"{type(parsed).__name__}. Received: {ENV_VAR}={raw!r}"
        )
    return parsed


def _check_keys(values: Mapping[Any, Any], source: str) -> None:
    valid = _valid_keys()
    for key in values:
        if not isinstance(key, str):
            raise ValueError(
                f"Config parameter names must be strings. Received: {key!r} "
                f"(of type {type(key).__name__}) {source}"
            )
    unknown = [k for k in values if k not in valid]
    if not unknown:
        return
    key = unknown[0]
    hint = difflib.get_close_matches(key, valid, n=1)
    did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
    others = ""
    if len(unknown) > 1:
        others = f" Other unrecognized parameters: {', '.join(repr(k) for k in unknown[1:])}."
    raise ValueError(
        f"Unrecognized config parameter {key!r} {source}.{did_you_mean}{others} "
        f"Valid parameters: {', '.join(valid)}."
    )


def parse_config(
    config: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Config:
    """Validates a config dict and returns the resulting `Config`.

    Args:
        config: a mapping from config keys (see the module doc) to values, a
            `Config`, or None for the defaults.
        environ: the environment to read ``SM_HP_MP_PARAMETERS`` from;
            defaults to `os.environ`. If the variable is set, its JSON object
            overrides the keys of `config`. Setting either ``partitions`` or
            ``pipeline_parallel_degree`` there overrides both names in
            `config`.

    Returns:
        The validated `Config`.

    Raises:
        ValueError: `config` is not a mapping; the environment variable is not
            a JSON object; a key is unknown; ``partitions`` and
            ``pipeline_parallel_degree`` disagree; or a value has the wrong
            type or is out of range.
    """
    if config is None:
        values: Dict[Any, Any] = {}
    elif isinstance(config, Config):
        values = config.to_dict()
    elif isinstance(config, Mapping):
        values = dict(config)
    else:
        raise ValueError(
            "Expected `config` to be a dict of smp_tf config parameters (for "
            'example {"partitions": 2, "microbatches": 4}) or None. '
            f"Received: config={config!r} (of type {type(config).__name__})"
        )
    _check_keys(values, "in the config dict")

    env_values = _read_environment(os.environ if environ is None else environ)
    _check_keys(env_values, f"in the environment variable {ENV_VAR}")
    if "partitions" in env_values or _PARTITIONS_ALIAS in env_values:
        # The environment sets the number of partitions under one name: it
        # must win over the code's value under either name, not conflict.
        values.pop("partitions", None)
        values.pop(_PARTITIONS_ALIAS, None)
    values.update(env_values)

    if _PARTITIONS_ALIAS in values:
        # Validated under its own name so that errors name what the user wrote.
        alias_value = _check_int(_PARTITIONS_ALIAS, values.pop(_PARTITIONS_ALIAS))
        if alias_value < 1:
            raise ValueError(
                f"Config parameter '{_PARTITIONS_ALIAS}' must be at least 1. "
                f"Received: {_PARTITIONS_ALIAS}={alias_value!r}"
            )
        if "partitions" in values and values["partitions"] != alias_value:
            raise ValueError(
                f"Config parameters 'partitions' and '{_PARTITIONS_ALIAS}' are "
                "aliases and must agree; give only one of them. Received: "
                f"partitions={values['partitions']!r}, "
                f"{_PARTITIONS_ALIAS}={alias_value!r}"
            )
        values["partitions"] = alias_value
    # `default_partition: None` means "not given" (resolved by Config).
    return Config(**values)
