"""Process-wide state: the active config and the device topology.

`smp.init(config)` validates the config, picks one device per partition and
stores both here. One process drives a whole pipeline (every partition), so
the model-parallel rank of the process is 0 and its model-parallel size is
the number of partitions; data parallelism adds processes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Optional

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
]


@dataclass(frozen=True)
class Topology:
    """Which device runs which partition.

    Attributes:
        devices: device name of partition ``p`` is ``devices[p]``.
        kind: ``"GPU"`` or ``"CPU"``.
        logical_cpu: True when the devices are logical CPU devices.
    """

    devices: tuple
    kind: str
    logical_cpu: bool

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


def _setup_devices(num_partitions: int) -> Topology:
    """Returns one device per partition, creating logical CPU devices if needed."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if len(gpus) < num_partitions:
            raise ValueError(
                f"partitions={num_partitions} needs {num_partitions} GPUs but "
                f"{len(gpus)} are visible. Lower `partitions` or make more GPUs "
                "visible (CUDA_VISIBLE_DEVICES)."
            )
        return Topology(
            tuple(f"/device:GPU:{i}" for i in range(num_partitions)), "GPU", False
        )

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


def init(config: Optional[Mapping[str, Any]] = None) -> Config:
    """Initialises smp_tf: validates `config` and sets up one device per partition.

    Calling it again re-initialises cleanly (caches of step functions traced
    under the previous config are discarded on their next call).

    Args:
        config: a dict with the keys documented in `docs/api.md` (for example
            ``{"partitions": 2, "microbatches": 4}``). The JSON in the
            environment variable ``SM_HP_MP_PARAMETERS``, if set, overrides it.

    Returns:
        The validated `Config`.

    Raises:
        ValueError: a key is unknown or a value has the wrong type or range.
        RuntimeError: TensorFlow initialised its devices before `smp.init`
            and there are fewer logical CPU devices than partitions.
    """
    cfg = parse_config(config)
    topo = _setup_devices(cfg.partitions)
    with _STATE.lock:
        _STATE.config = cfg
        _STATE.topology = topo
        _STATE.generation += 1
    logger.info("smp_tf initialised: %s on %s", cfg, topo.devices)
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
    """Global rank of this process (one process drives one whole pipeline)."""
    _require_init()
    return 0


def size() -> int:
    """Number of processes."""
    _require_init()
    return 1


def local_rank() -> int:
    """Rank of this process on its host."""
    _require_init()
    return 0


def local_size() -> int:
    """Number of processes on this host."""
    _require_init()
    return 1


def mp_rank() -> int:
    """Model-parallel rank: 0, since this process drives every partition."""
    _require_init()
    return 0


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
    """Data-parallel rank of this process's pipeline replica."""
    _require_init()
    return 0


def dp_size() -> int:
    """Number of data-parallel pipeline replicas."""
    _require_init()
    return 1


def num_microbatches() -> int:
    """Micro-batches per batch of the active config."""
    return _require_init().config.microbatches
