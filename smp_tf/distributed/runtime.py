"""The data-parallel process group, on TensorFlow's collective runtime.

With several processes (one per pipeline replica), `smp.init` calls `start`:
every process runs TensorFlow's in-process gRPC server, joins TensorFlow's
collective runtime (the one behind ``MultiWorkerMirroredStrategy``, without
the strategy) and its coordination service, which watches every process
with heartbeats and offers barriers and a key-value store. Each process then
drives only its own devices; collectives (`smp_tf.distributed.collectives`)
connect the devices that run the same partition in every replica.

This must happen before TensorFlow initialises its runtime (before the first
op runs), right after the devices are configured; `smp.init` is therefore
the first thing a program calls.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from smp_tf.distributed.cluster import EXIT_PORT_IN_USE, ClusterInfo

logger = logging.getLogger("smp_tf")

__all__ = ["ProcessGroup", "start", "group", "EXIT_PORT_IN_USE", "JOB"]

#: TensorFlow job name of the replicas.
JOB = "worker"
#: The least time (seconds) a process waits for the others at start-up,
#: whatever ``dp_timeout`` is: processes of one job start seconds apart
#: (importing TensorFlow alone takes several).
JOIN_TIMEOUT_MIN_S = 120.0
_GROUP: Optional["ProcessGroup"] = None


def task_name(rank: int) -> str:
    """TensorFlow's name of the server task of `rank` (``/job:worker/replica:0/task:3``)."""
    return f"/job:{JOB}/replica:0/task:{rank}"


def has_register_barrier() -> bool:
    """Whether this TensorFlow's coordination service can make every task wait
    at start-up until all have registered (``cluster_register_with_barrier``,
    missing up to TensorFlow 2.18 at least)."""
    fields = _coordination_config_pb2().CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    return "cluster_register_with_barrier" in fields


def join_timeout(timeout: float) -> float:
    """Seconds a process waits for the others at start-up (``dp_timeout``, at least `JOIN_TIMEOUT_MIN_S`)."""
    return max(timeout, JOIN_TIMEOUT_MIN_S)


def server_addresses(info: ClusterInfo, timeout: float) -> Tuple[str, ...]:
    """Every rank's server address: from the environment, or exchanged
    through the coordinator after picking a free port for this rank."""
    if info.addresses is not None:
        return tuple(info.addresses)
    from smp_tf.distributed import cluster, rendezvous

    port = cluster.pick_free_ports(1)[0]
    return tuple(
        rendezvous.exchange_addresses(info, f"{rendezvous.my_host()}:{port}", timeout=join_timeout(timeout))
    )


def require_runtime_not_started(doing: str) -> None:
    """Raises unless TensorFlow's runtime is still to be started (a server
    must be set up before it)."""
    from tensorflow.python.eager import context

    if context.context()._context_handle is not None:  # noqa: SLF001 - no public "is initialised"
        raise RuntimeError(
            f"smp.init must {doing} before TensorFlow runs its first operation. "
            "Call smp.init at the very start of the program (importing TensorFlow and Keras first is fine)."
        )


@dataclass(frozen=True)
class ProcessGroup:
    """The processes (pipeline replicas) of a data-parallel run.

    Attributes:
        info: this process's place in the cluster (rank, size, local rank).
        addresses: the TensorFlow server address of every rank.
        timeout: seconds after which a dead or stalled replica stops the
            others (`Config.dp_timeout`).
    """

    info: ClusterInfo
    addresses: Tuple[str, ...]
    timeout: float

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.size

    def task(self, rank: int) -> str:
        """TensorFlow's name of the task of `rank`."""
        return task_name(rank)

    def device(self, local_device: str) -> str:
        """The full name of a local device (``/device:CPU:1`` -> ``/job:worker/.../device:CPU:1``)."""
        import tensorflow as tf

        spec = tf.DeviceSpec.from_string(local_device)
        return f"{self.task(self.rank)}/device:{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"

    # -- the coordination service ------------------------------------------------
    def barrier(self, name: str, timeout: Optional[float] = None) -> None:
        """Waits until every process reached the barrier `name` (unique per use)."""
        from tensorflow.python.eager import context

        seconds = self.timeout if timeout is None else timeout
        try:
            context.context().wait_at_barrier(f"smp_tf/{name}", int(seconds * 1000))
        except Exception as e:  # noqa: BLE001 - re-raised with the ranks that are missing
            raise_replica_error(e, self, f"barrier {name!r}")

    def put(self, key: str, value: str) -> None:
        """Publishes `value` under `key` in the coordination service's store."""
        from tensorflow.python.eager import context

        context.context().set_config_key_value(f"smp_tf/{key}", value)

    def get(self, key: str, timeout: Optional[float] = None) -> str:
        """The value published under `key`, waiting for it (bounded)."""
        from tensorflow.python.eager import context

        seconds = self.timeout if timeout is None else timeout
        try:
            return context.context().get_config_key_value(f"smp_tf/{key}", int(seconds * 1000))
        except Exception as e:  # noqa: BLE001
            raise_replica_error(e, self, f"waiting for {key!r}")
        raise AssertionError("unreachable")

    def allgather(self, name: str, value: str, timeout: Optional[float] = None) -> List[str]:
        """Every rank's `value`, in rank order (every rank calls it with the same `name`)."""
        self.put(f"{name}/{self.rank}", value)
        values = [self.get(f"{name}/{r}", timeout) for r in range(self.size)]
        # Everyone has read every value before any is deleted.
        self.barrier(f"{name}/read", timeout)
        self.delete(f"{name}/{self.rank}")
        return values

    def delete(self, key: str) -> None:
        from tensorflow.python.eager import context

        try:
            context.context().delete_config_key_value(f"smp_tf/{key}")
        except Exception:  # noqa: BLE001 - already gone
            pass

    def report_error(self, message: str) -> None:
        """Makes every other process's collectives fail now with `message`."""
        from tensorflow.python.eager import context

        try:
            context.context().report_error_to_cluster(10, message)  # ABORTED
        except Exception:  # noqa: BLE001 - the cluster may already be gone
            pass


class ReplicaError(RuntimeError):
    """A data-parallel replica died, stalled or failed; the run cannot go on.

    Attributes:
        ranks: the ranks the error is about (empty if unknown).
    """

    def __init__(self, message: str, ranks: Tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


def missing_ranks(message: str) -> Tuple[int, ...]:
    """The ranks a TensorFlow error message names (``/job:worker/replica:0/task:3`` -> 3)."""
    return tuple(sorted({int(m) for m in re.findall(r"/job:%s(?:/replica:\d+)?/task:(\d+)" % JOB, message)}))


def raise_replica_error(error: BaseException, group: "ProcessGroup", during: str) -> None:
    """Re-raises a runtime error of the collectives as a `ReplicaError` naming ranks."""
    text = str(error)
    ranks = tuple(r for r in missing_ranks(text) if r != group.rank)
    if "Heartbeat" in text and not ranks and group.rank != 0:
        ranks = (0,)  # the coordination leader stopped answering
    if "smp_tf:" in text:  # a message another rank reported: keep it
        reason = text[text.index("smp_tf:"):].split("\n")[0]
    elif ranks:
        reason = f"rank(s) {list(ranks)} stopped responding (died, hung, or left the collectives)"
    else:
        reason = text.strip().split("\n")[0]
    raise ReplicaError(
        f"smp_tf: data-parallel replica failure on rank {group.rank} while {during}: {reason}. "
        "Every replica stops; restart all of them (for example from the last checkpoint).",
        ranks,
    ) from error


def group() -> Optional[ProcessGroup]:
    """The process group of this process, or None with a single process."""
    return _GROUP


def use_group(group: Any, config_json: str) -> Any:
    """Makes `group` (a `remote.PipelineGroup`: the drivers of pipelines
    that span processes) the data-parallel group, after checking that every
    member runs the same configuration."""
    global _GROUP
    if _GROUP is not group:
        group.barrier("init", timeout=join_timeout(group.timeout))
        _GROUP = group
    _check_same_config(group, config_json)
    return group


def _coordination_config_pb2() -> Any:
    """The coordination service's config protos, wherever this TensorFlow keeps them.

    TensorFlow moved the module between releases: ``tensorflow.tsl.protobuf``
    up to 2.18 at least, ``tensorflow.compiler.xla.tsl.protobuf`` in 2.21.
    """
    import importlib

    for name in (
        "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2",
        "tensorflow.tsl.protobuf.coordination_config_pb2",
        "tsl.protobuf.coordination_config_pb2",
    ):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    import tensorflow as tf

    raise RuntimeError(
        f"smp_tf could not find the coordination service's protos (coordination_config_pb2) in "
        f"TensorFlow {tf.__version__}; multi-process jobs need TensorFlow 2.17 or later."
    )


def start(info: ClusterInfo, timeout: float, config_json: str) -> ProcessGroup:
    """Joins the collective runtime and the coordination service of the cluster.

    Called by `smp.init` after the local devices are configured and before
    anything initialises TensorFlow's runtime. A second call with the same
    cluster returns the same group (`smp.init` again); another cluster needs
    a new process.

    Args:
        info: the cluster, from the environment.
        timeout: `Config.dp_timeout`: the bound of every wait (seconds).
        config_json: the configuration, compared across ranks.

    Raises:
        RuntimeError: TensorFlow's runtime was initialised before `smp.init`,
            or the cluster changed since the last `smp.init`.
        OSError: this process's server port is in use (the launcher then
            restarts every process on new ports).
        ReplicaError: not every rank joined within the timeout.
        ValueError: the ranks were started with different configurations.
    """
    global _GROUP
    if _GROUP is not None:
        if _GROUP.info == info:
            _check_same_config(_GROUP, config_json)
            return _GROUP
        raise RuntimeError(
            f"smp.init was called again with another cluster ({info}) than the running one "
            f"({_GROUP.info}); a process joins one cluster for its lifetime. Start new processes."
        )
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    coordination_config_pb2 = _coordination_config_pb2()

    addresses = server_addresses(info, timeout)
    require_runtime_not_started("form the data-parallel group")
    ctx = context.context()
    leader = task_name(0)
    heartbeat_ms = int(min(10.0, timeout) * 1000)
    ctx.configure_collective_ops(
        collective_leader=leader,
        scoped_allocator_enabled_ops=("CollectiveReduce",),
        device_filters=(f"/job:{JOB}/task:{info.rank}",),
    )
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=leader,
        enable_health_check=True,
        heartbeat_timeout_in_ms=heartbeat_ms,
        cluster_register_timeout_in_ms=int(join_timeout(timeout) * 1000),
        shutdown_barrier_timeout_in_ms=int(max(timeout, 300.0) * 1000),
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=JOB, num_tasks=info.size)],
    )
    # Every task, rank 0 too, waits at start-up until all have registered and
    # fails after the register timeout naming the missing ones; without it
    # rank 0 would wait forever for a rank that never starts. (TensorFlow
    # 2.16 to 2.18 have no such option; see
    # `_wait_for_every_rank_to_join_the_cluster`.)
    register_barrier = has_register_barrier()
    if register_barrier:
        ctx._coordination_service_config.cluster_register_with_barrier = True  # noqa: SLF001
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=tf.train.ClusterSpec({JOB: list(addresses)}).as_cluster_def(),
        default_session_config=ctx.config,
        job_name=JOB,
        task_index=info.rank,
        protocol="grpc",
        port=int(addresses[info.rank].rsplit(":", 1)[1]),
    )
    ctx.enable_collective_ops(server_def)
    try:
        if register_barrier:
            ctx.ensure_initialized()
        else:
            _wait_for_every_rank_to_join_the_cluster(ctx, join_timeout(timeout) + 10.0, info, addresses)
    except tf.errors.UnknownError as e:
        if "Could not start gRPC server" in str(e):
            message = (
                f"smp_tf: rank {info.rank} cannot listen on {addresses[info.rank]}: the port is in use. "
                "Choose other ports (smp_tf.launch picks free ones and retries by itself)."
            )
            if os.environ.get("SMP_TF_LAUNCHER") == "1":
                logger.error(message)
                os._exit(EXIT_PORT_IN_USE)
            raise OSError(message) from e
        raise
    except tf.errors.DeadlineExceededError as e:
        ranks = [r for r in missing_ranks(str(e)) if r != info.rank]
        raise ReplicaError(
            f"smp_tf: rank {info.rank} waited {join_timeout(timeout):.0f} s for every rank to join "
            f"the cluster {list(addresses)}; missing: {ranks or 'unknown'}. Check that every "
            "process was started with the same cluster environment.",
            tuple(ranks),
        ) from e
    _GROUP = ProcessGroup(info, tuple(addresses), float(timeout))
    _GROUP.barrier("init", timeout=join_timeout(timeout))
    _check_same_config(_GROUP, config_json)
    logger.info("smp_tf: rank %d of %d joined %s", info.rank, info.size, list(addresses))
    return _GROUP


def _wait_for_every_rank_to_join_the_cluster(ctx: Any, seconds: float, info: ClusterInfo,
                                            addresses: Sequence[str]) -> None:
    """Starts TensorFlow's runtime where the coordination service has no
    register barrier (TensorFlow 2.16 to 2.18): the leader would then wait for a rank
    that never starts with no deadline, holding the interpreter (no Python
    timer can run) and catching SIGTERM. `faulthandler`'s timer runs outside
    the interpreter: after `seconds` it prints the stack, this function's name
    on top, and ends the process with exit code 1."""
    import faulthandler
    import sys

    import tensorflow as tf

    # A warning, so that it shows without any logging set up: it is what
    # explains the timeout that may follow.
    logger.warning(
        "smp_tf: TensorFlow %s cannot name a rank that never joins; rank %d waits up to %.0f s for every rank "
        "of %s, then ends with a timeout in %s",
        tf.__version__, info.rank, seconds, list(addresses), _wait_for_every_rank_to_join_the_cluster.__name__,
    )
    # sys.stderr may be replaced by an object without a file descriptor
    # (a notebook, pytest's capture); the process's own stderr always has one.
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        ctx.ensure_initialized()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _check_same_config(group: ProcessGroup, config_json: str) -> None:
    """Every rank must run the same configuration (same partitions, schedule, ...)."""
    generation = getattr(_check_same_config, "calls", 0)
    _check_same_config.calls = generation + 1
    mine = json.loads(config_json)
    for r, text in enumerate(group.allgather(f"config/{generation}", config_json)):
        other = json.loads(text)
        if other != mine:
            diff = {k: (mine.get(k), other.get(k)) for k in sorted(set(mine) | set(other)) if mine.get(k) != other.get(k)}
            raise ValueError(
                f"smp_tf: rank {r} was initialised with another configuration than rank {group.rank}: "
                f"{ {k: {'rank ' + str(group.rank): a, 'rank ' + str(r): b} for k, (a, b) in diff.items()} }. "
                "Every replica must call smp.init with the same config."
            )

