"""Process-wide state: the active config, the device topology and the ranks.

`smp.init(config)` validates the config, reads the cluster from the
environment, picks one device per partition and, with several processes,
joins the data-parallel group; it stores all of it here.

Ranks. One process drives a whole pipeline replica (every partition of it),
where the SageMaker library ran one process per device. A process therefore
plays the part of all the ranks of one replica:

==================  =====================================================
``rank()``          this process's index among all processes (0 first)
``size()``          the number of processes (pipeline replicas)
``dp_rank()``       = ``rank()``: the index of this pipeline replica
``dp_size()``       = ``size()``
``mp_rank()``       0 (``pp_rank``): the process drives partition 0 and
                    all the others of its replica
``mp_size()``       the number of partitions (``pp_size``)
``local_rank()``    this process's index among the processes of its host
``local_size()``    the number of processes on its host
``tp_rank()``       0: the process drives every device of each stage
``tp_size()``       ``tensor_parallel_degree``: the devices of one stage
==================  =====================================================

So ``if smp.rank() == 0:`` runs on exactly one process, and
``dataset.shard(smp.dp_size(), smp.dp_rank())`` gives each replica its own
part of the data, as with the original's numbering.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from smp_tf.config import Config, parse_config

logger = logging.getLogger("smp_tf")

__all__ = [
    "Topology",
    "init",
    "is_initialized",
    "config",
    "current_config",
    "topology",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "pp_rank",
    "pp_size",
    "dp_rank",
    "dp_size",
    "num_microbatches",
    "data_parallel",
    "process_group",
    "local_partitions",
    "tp_rank",
    "tp_size",
]


@dataclass(frozen=True)
class Topology:
    """Which device runs which partition.

    Attributes:
        devices: device name of partition ``p`` is ``devices[p]``.
        kind: ``"GPU"`` or ``"CPU"``.
        logical_cpu: True when the devices are logical CPU devices.
        tensor_devices: with tensor parallelism, the ``t`` devices of
            partition ``p`` are ``tensor_devices[p]`` (the first is
            ``devices[p]``); empty without.
    """

    devices: tuple
    kind: str
    logical_cpu: bool
    tensor_devices: tuple = ()

    def stage_groups(self) -> tuple:
        """Each partition's devices (`stage_devices` of every partition)."""
        return self.tensor_devices or tuple((d,) for d in self.devices)

    def all_devices(self) -> list:
        """Every device of this process's stages, once, in stage order
        (each stage's tensor-parallel devices together)."""
        out: list = []
        for group in self.stage_groups():
            out.extend(d for d in group if d not in out)
        return out

    def stage_devices(self, partition: int) -> tuple:
        """The devices partition `partition`'s ops are split over."""
        if self.tensor_devices:
            return self.tensor_devices[partition]
        return (self.device(partition),)

    def device(self, partition: int) -> str:
        """Returns the device name of `partition`."""
        if not 0 <= partition < len(self.devices):
            raise ValueError(
                f"Partition {partition} does not exist; there are "
                f"{len(self.devices)} partitions."
            )
        return self.devices[partition]


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.config: Optional[Config] = None
        self.topology: Optional[Topology] = None
        self.cluster: Any = None  # smp_tf.distributed.cluster.ClusterInfo
        self.group: Any = None  # smp_tf.distributed.runtime.ProcessGroup
        self.layout: Any = None  # smp_tf.distributed.layout.PipelineLayout
        self.post_partition_hooks: list = []
        self.generation = 0
        # The generation in which the post-partition hooks last ran.
        self.hooks_generation = -1


_STATE = _State()


def _require_init() -> _State:
    if _STATE.config is None:
        raise RuntimeError(
            "smp_tf is not initialised. Call `smp.init(config)` at the start of "
            "your program, before building models or calling a @smp.step function."
        )
    return _STATE


def gpu_indices(num_gpus: int, num_partitions: int, local_rank: int, local_size: int, strategy: str) -> Tuple[int, ...]:
    """The visible GPUs this process's partitions use (``placement_strategy``).

    When each process sees only its own GPUs (`smp_tf.launch` sets
    ``CUDA_VISIBLE_DEVICES``), they are GPUs 0..P-1. When the processes of a
    host see all of them, replica r of R uses ``r*P + p`` (``"cluster"``:
    a replica's partitions are neighbours) or ``r + p*R`` (``"spread"``: the
    replicas of one partition are neighbours).
    """
    if num_gpus < num_partitions * local_size or local_size == 1:
        return tuple(range(num_partitions))
    if strategy == "spread":
        return tuple(local_rank + p * local_size for p in range(num_partitions))
    return tuple(local_rank * num_partitions + p for p in range(num_partitions))


def _setup_devices(
    num_partitions: int, local_rank: int = 0, local_size: int = 1, strategy: str = "cluster", tensor_degree: int = 1
) -> Topology:
    """Returns one device per partition (``tensor_degree`` with tensor
    parallelism: partition p gets devices ``p*t .. p*t+t-1``), creating
    logical CPU devices if needed."""
    if tensor_degree > 1:
        try:
            flat = _setup_devices(num_partitions * tensor_degree, local_rank, local_size, strategy)
        except (RuntimeError, ValueError) as e:
            raise type(e)(
                f"partitions={num_partitions} x tensor_parallel_degree={tensor_degree} needs "
                f"{num_partitions * tensor_degree} devices in this process (lower either to need fewer): {e}"
            ) from e
        groups = tuple(flat.devices[p * tensor_degree:(p + 1) * tensor_degree] for p in range(num_partitions))
        return Topology(tuple(g[0] for g in groups), flat.kind, flat.logical_cpu, groups)
    import tensorflow as tf

    physical = tf.config.list_physical_devices("GPU")
    # One physical GPU split into logical GPUs (with memory limits) counts
    # as that many devices, as TensorFlow numbers them.
    gpus = [None] * sum(len(tf.config.get_logical_device_configuration(g) or [None]) for g in physical)
    if gpus:
        if len(gpus) < num_partitions:
            raise ValueError(
                f"partitions={num_partitions} needs {num_partitions} GPUs but "
                f"{len(gpus)} are visible. Lower `partitions` or make more GPUs "
                "visible (CUDA_VISIBLE_DEVICES)."
            )
        indices = gpu_indices(len(gpus), num_partitions, local_rank, local_size, strategy)
        return Topology(tuple(f"/device:GPU:{i}" for i in indices), "GPU", False)

    cpus = tf.config.list_physical_devices("CPU")
    configured = tf.config.get_logical_device_configuration(cpus[0])
    have = len(configured) if configured else 1
    if have < num_partitions:
        try:
            tf.config.set_logical_device_configuration(
                cpus[0],
                [tf.config.LogicalDeviceConfiguration()] * num_partitions,
            )
        except RuntimeError as e:
            raise RuntimeError(
                f"smp.init(partitions={num_partitions}) needs {num_partitions} "
                f"logical CPU devices but TensorFlow has already initialised its "
                f"devices with {have}. Call `smp.init` at the start of the program, "
                "before any TensorFlow operation runs."
            ) from e
    if num_partitions > 1:
        # One intra-op thread keeps each op on one core and enough inter-op
        # threads let all partitions run at once. The inter-op pool is shared
        # by all logical devices, so a device with several independent ops
        # ready can still use more than one core at a time.
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            inter = tf.config.threading.get_inter_op_parallelism_threads()
            if inter != 0 and inter < num_partitions:
                tf.config.threading.set_inter_op_parallelism_threads(num_partitions)
        except RuntimeError:
            logger.warning(
                "TensorFlow's thread pools were already created; logical CPU "
                "devices may use more than one core each. Call smp.init first "
                "for a faithful one-core-per-device setup."
            )
    return Topology(
        tuple(f"/device:CPU:{i}" for i in range(num_partitions)), "CPU", True
    )


def _host_devices() -> int:
    """The devices smp_tf plans for on this host: its GPUs (logical GPUs
    counted), or one logical CPU device per core this process may use."""
    import os

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return sum(len(tf.config.get_logical_device_configuration(g) or [None]) for g in gpus)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: The oldest releases smp_tf runs on (its test suite passes there, and CI
#: runs the exactness tests on them). TensorFlow 2.16 is below the floor:
#: with oneDNN (the default on x86 CPUs) its graph optimiser fuses
#: ``x * sigmoid(x)`` into one kernel in some places of a pipeline's task
#: where it does not in the single-device step, and EfficientNetB0's
#: gradients came out up to 2.0 apart (docs/notes/exactness.md).
MIN_TENSORFLOW = (2, 17)
MIN_KERAS = (3, 7)


def _release(version: str) -> Tuple[int, ...]:
    """The leading numbers of a version string (``"2.21.0rc1"`` -> (2, 21, 0))."""
    numbers = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def unsupported_versions(tensorflow_version: str, keras_version: str) -> Optional[str]:
    """A message naming what to upgrade when TensorFlow or Keras is older than
    smp_tf supports, else None."""
    old = [
        f"{name} {version} (smp_tf needs {'.'.join(map(str, least))} or later)"
        for name, version, least in (("TensorFlow", tensorflow_version, MIN_TENSORFLOW),
                                     ("Keras", keras_version, MIN_KERAS))
        if _release(version) < least
    ]
    if not old:
        return None
    return (f"smp_tf: this environment has {' and '.join(old)}. Upgrade, e.g. "
            f"pip install 'tensorflow>={'.'.join(map(str, MIN_TENSORFLOW))}' 'keras>={'.'.join(map(str, MIN_KERAS))}'.")


def init(config: Optional[Mapping[str, Any]] = None) -> Config:
    """Initialises smp_tf: validates `config` and sets up one device per partition.

    Calling it again re-initialises cleanly (caches of step functions traced
    under the previous config are discarded on their next call).

    Args:
        config: a dict with the keys documented in `docs/config.md` (for example
            ``{"partitions": 2, "microbatches": 4}``). The JSON in the
            environment variable ``SM_HP_MP_PARAMETERS``, if set, overrides it.

    Returns:
        The validated `Config`.

    Raises:
        ValueError: a key is unknown or a value has the wrong type or range.
        RuntimeError: TensorFlow initialised its devices before `smp.init`
            and there are fewer logical CPU devices than partitions; or
            TensorFlow or Keras is older than smp_tf supports
            (`MIN_TENSORFLOW`, `MIN_KERAS`).
    """
    cfg = parse_config(config)
    import keras
    import tensorflow as tf

    problem = unsupported_versions(tf.__version__, keras.__version__)
    if problem:
        raise RuntimeError(problem)
    from smp_tf import live_objects

    # Before the devices are set up: while TensorFlow's runtime has not
    # started, nothing created so far can hold a variable handle.
    live_objects.install_object_registry()
    from smp_tf.distributed.cluster import from_environment

    info = from_environment()
    group = None
    from smp_tf.distributed.layout import PipelineLayout

    layout = PipelineLayout(info.size, cfg.partitions, cfg.pipeline_processes, cfg.placement_strategy)
    if cfg.shard_optimizer_state and (layout.replicas < 2 or not cfg.horovod):
        raise ValueError(
            "shard_optimizer_state=True divides the optimizer state over data-parallel replicas, but this job has "
            f"{layout.replicas} replica(s) with horovod={cfg.horovod}. Launch several processes "
            "(python -m smp_tf.launch -n 2 ...) with {'horovod': True}, or leave shard_optimizer_state off."
        )
    if cfg.pipeline_processes > 1:
        from smp_tf.distributed import remote

        local = _setup_devices(layout.partitions_per_process, info.local_rank, info.local_size, cfg.placement_strategy,
                               cfg.tensor_parallel_degree)
        # Returns on the driver of a pipeline only; the other processes serve.
        process = remote.start(info, layout, local.kind, local.logical_cpu, cfg.dp_timeout,
                               cfg.tensor_parallel_degree)
        topo = Topology(process.devices, local.kind, local.logical_cpu, process.tensor_devices)
        if layout.replicas > 1:
            import json

            group = remote.data_parallel_group(process, json.dumps(cfg.to_dict(), sort_keys=True))
    else:
        if cfg.auto:
            # The planner plans for every device this host has: set them up
            # now, while TensorFlow's devices can still be configured.
            _setup_devices(max(_host_devices(), cfg.partitions * cfg.tensor_parallel_degree), info.local_rank,
                           info.local_size, cfg.placement_strategy)
        topo = _setup_devices(
            cfg.partitions, info.local_rank, info.local_size, cfg.placement_strategy, cfg.tensor_parallel_degree
        )
    if info.is_distributed and cfg.pipeline_processes == 1:
        import json

        from smp_tf.distributed import runtime

        group = runtime.start(info, cfg.dp_timeout, json.dumps(cfg.to_dict(), sort_keys=True))
    if group is not None and not cfg.horovod:
        logger.warning(
            "smp_tf: %d pipeline replicas but horovod=False: the replicas will not average their "
            "gradients and will drift apart. Set {'horovod': True} for data parallelism.",
            layout.replicas,
        )
    with _STATE.lock:
        _STATE.config = cfg
        _STATE.topology = topo
        _STATE.cluster = info
        _STATE.group = group
        _STATE.layout = layout
        _STATE.generation += 1
    if topo.tensor_devices:
        logger.info("smp_tf initialised: %s; each partition's ops split over tensor_parallel_degree=%d devices: %s "
                    "(rank %d of %d)", cfg, cfg.tensor_parallel_degree, topo.tensor_devices, info.rank, info.size)
    else:
        logger.info("smp_tf initialised: %s on %s (rank %d of %d)", cfg, topo.devices, info.rank, info.size)
    return cfg


def generation() -> int:
    """A counter bumped by every `init`; caches keyed on it are invalidated."""
    return _STATE.generation


def is_initialized() -> bool:
    """Returns True once `smp.init` has been called."""
    return _STATE.config is not None


def config() -> Config:
    """Returns the active `Config` (raises if `smp.init` was not called)."""
    return _require_init().config


def current_config() -> Config:
    """Returns the active `Config` (raises if `smp.init` was not called)."""
    return config()


def topology() -> Topology:
    """Returns the active `Topology` (raises if `smp.init` was not called)."""
    return _require_init().topology


def rank() -> int:
    """Global rank of this process (one process drives one pipeline replica)."""
    return _require_init().cluster.rank


def size() -> int:
    """Number of processes (pipeline replicas)."""
    return _require_init().cluster.size


def local_rank() -> int:
    """Rank of this process among the processes of its host."""
    return _require_init().cluster.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return _require_init().cluster.local_size


def mp_rank() -> int:
    """Model-parallel rank: this process's position in its pipeline (0 for the
    process that drives it; with ``pipeline_processes`` k, the j-th process
    holds partitions ``j * partitions / k ...``)."""
    st = _require_init()
    return st.layout.pp_rank(st.cluster.rank)


def mp_size() -> int:
    """Model-parallel size: the number of partitions."""
    return _require_init().config.partitions


def pp_rank() -> int:
    """Alias of `mp_rank`."""
    return mp_rank()


def pp_size() -> int:
    """Alias of `mp_size`."""
    return mp_size()


def dp_rank() -> int:
    """Data-parallel rank: the index of this process's pipeline replica
    (`rank` when each pipeline is one process)."""
    st = _require_init()
    return st.layout.dp_rank(st.cluster.rank)


def dp_size() -> int:
    """Number of data-parallel pipeline replicas (processes / ``pipeline_processes``)."""
    return _require_init().layout.replicas


def local_partitions() -> Tuple[int, ...]:
    """The partitions whose devices this process holds (all of them unless
    ``pipeline_processes`` > 1)."""
    st = _require_init()
    return st.layout.stages(st.cluster.rank)


def tp_rank() -> int:
    """Tensor-parallel rank: 0, since the process drives every device of
    each stage (as `mp_rank` is 0 for the process that drives a pipeline)."""
    _require_init()
    return 0


def tp_size() -> int:
    """Tensor-parallel size: the devices each partition is split over
    (``tensor_parallel_degree``)."""
    return _require_init().config.tensor_parallel_degree


def data_parallel() -> bool:
    """True when gradients are averaged across several replicas (``horovod``
    is on and there is more than one process)."""
    st = _require_init()
    return bool(st.config.horovod and st.group is not None and st.cluster.size > 1)


def process_group() -> Any:
    """The data-parallel process group, or None with one process."""
    return _require_init().group


def num_microbatches() -> int:
    """Micro-batches per batch of the active config."""
    return _require_init().config.microbatches
