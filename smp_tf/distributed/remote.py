"""One pipeline across several processes, on TensorFlow's distributed runtime.

With ``pipeline_processes = k > 1`` (`smp_tf.distributed.layout`):

* every process runs a TensorFlow gRPC server, task ``rank`` of the job
  ``worker``, serving the devices of the stages it holds;
* the first process of each pipeline (its driver) also connects to the
  cluster as a client (task ``replica`` of the job ``client``, a job that
  lists only itself, so that drivers never wait for each other): it sees the
  devices of every worker, traces and partitions the step and places
  partition p on the device of the process that holds stage p. TensorFlow's
  distributed function runtime then runs each process's share of the step
  on that process and moves the boundary tensors between processes (gRPC
  ``RecvTensor``), each transfer starting as soon as its tensor is ready,
  so a stage's compute overlaps its neighbours' transfers as on one host;
* the other processes serve until their driver's server goes away, then
  exit: the code after ``smp.init`` runs in the drivers only.

Why a driver rather than every process running its own stages: one process
holds the traced step, the schedule and every output, so everything that
works in one process (Keras ``fit``, ``StepOutput``, checkpoints of the whole
model) works unchanged, while each variable, activation and gradient still
lives on the device of its stage.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from smp_tf.distributed.cluster import ClusterInfo, parse_address, pick_free_ports
from smp_tf.distributed.layout import PipelineLayout
from smp_tf.distributed.runtime import (
    JOB,
    ReplicaError,
    join_timeout,
    missing_ranks,
    require_runtime_not_started,
    server_addresses,
    task_name,
)

logger = logging.getLogger("smp_tf")

__all__ = ["CLIENT", "PipelineGroup", "PipelineProcess", "intra_op_threads", "spin_idle_threads", "start"]

#: Job of the drivers' client contexts (every process's server is a task of
#: `runtime.JOB`, as with data parallelism).
CLIENT = "client"

_CURRENT: Optional["PipelineProcess"] = None
#: This process's server: kept for the life of the process.
_SERVER = None
#: Exit code of a driver whose pipeline lost a process.
EXIT_STAGE_LOST = 1
#: Inter-op threads of a process's server beyond one per device (see
#: `_session_config`).
TRANSFER_THREADS = 8
#: Seconds between two looks of the driver's watchdog at its servers.
WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class PipelineProcess:
    """This process's place in a job whose pipelines span processes.

    Attributes:
        info: the cluster (rank, size, addresses).
        layout: which rank holds which stage.
        devices: the full device name of each partition of the pipeline
            this process drives.
        timeout: `Config.dp_timeout`.
        tensor_devices: with tensor parallelism, the ``t`` devices of each
            partition (all of one process; the first is ``devices[p]``).
    """

    info: ClusterInfo
    layout: PipelineLayout
    devices: Tuple[str, ...]
    timeout: float
    tensor_devices: Tuple[Tuple[str, ...], ...] = ()

    @property
    def tensor_degree(self) -> int:
        """Devices per partition (1 without tensor parallelism)."""
        return len(self.tensor_devices[0]) if self.tensor_devices else 1


def io_device() -> Optional[str]:
    """The driver's own CPU (its client task) when this process drives a
    pipeline that spans processes, else None."""
    if _CURRENT is None:
        return None
    return f"/job:{CLIENT}/replica:0/task:{_CURRENT.layout.dp_rank(_CURRENT.info.rank)}/device:CPU:0"


def first_stage_device() -> Optional[str]:
    """The device of this driver's first stage when this process drives a
    pipeline that spans processes, else None.

    The step splits its batch into micro-batches there: an op without a
    device would run on the driver's client CPU, and every input would go
    there and back before the first stage reads it.
    """
    if _CURRENT is None:
        return None
    return _CURRENT.devices[0]


def worker_device(rank: int, kind: str, index: int) -> str:
    """The full name of device `index` of `kind` on the server of `rank`."""
    return f"{task_name(rank)}/device:{kind}:{index}"


#: Collective group of the drivers' control collectives (barriers, gathers):
#: the stage-0 devices of every replica, apart from the gradient groups.
CONTROL_GROUP = 999


class PipelineGroup:
    """The data-parallel group of a job whose pipelines span processes.

    Its members are the pipelines' drivers (rank = the replica,
    `PipelineLayout.dp_rank`); the stage processes never run the user's
    program. Gradients are all-reduced among the devices of each stage
    (`collectives`), as with one process per pipeline. The drivers are
    clients of the cluster, outside TensorFlow's coordination service, so
    their barriers and gathers are collectives too, on the stage-0 devices,
    bounded by the timeout; point-to-point messages (``smp.send``) are not
    available.

    Attributes:
        rank: this driver's replica.
        size: the number of replicas.
        timeout: `Config.dp_timeout`.
        device_0: this replica's stage-0 device (full name).
    """

    coordinated = False

    def __init__(self, replica: int, replicas: int, timeout: float, device_0: str) -> None:
        self.rank = replica
        self.size = replicas
        self.timeout = float(timeout)
        self.device_0 = device_0
        self._uses = 0
        self._functions: dict = {}

    def task(self, rank: int) -> str:
        return task_name(rank)

    def device(self, device: str) -> str:
        """Devices of a pipeline that spans processes are full names already."""
        return device

    def _collective_sum(self, values, name: str, timeout: Optional[float]):
        import tensorflow as tf
        from tensorflow.python.ops import collective_ops

        from smp_tf.distributed.collectives import instance_key

        self._uses += 1
        key = instance_key("control", name, self._uses)
        seconds = self.timeout if timeout is None else timeout
        reduce = self._functions.get(seconds)
        if reduce is None:
            # In a function: a driver waiting in an eager collective would
            # hold up the other drivers' function registrations on its servers.
            @tf.function(autograph=False, input_signature=[
                tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)])
            def reduce(x, key):
                with tf.device(self.device_0):
                    return collective_ops.all_reduce_v2(
                        x, group_size=self.size, group_key=CONTROL_GROUP, instance_key=key, merge_op="Add",
                        final_op="Id", timeout=seconds,
                    )

            self._functions[seconds] = reduce
        try:
            return reduce(tf.constant(values, tf.int32), tf.constant(key, tf.int32)).numpy()
        except tf.errors.OpError as e:
            raise ReplicaError(
                f"smp_tf: replica {self.rank} waited more than {seconds:g} s for the other replicas' drivers "
                f"in {name!r}: {str(e).strip().splitlines()[0]}. Every replica stops; restart all of them.",
                missing_ranks(str(e)),
            ) from e

    def barrier(self, name: str, timeout: Optional[float] = None) -> None:
        """Waits until every driver reached the barrier `name`."""
        self._collective_sum([1], f"barrier/{name}", timeout)

    def allgather(self, name: str, value: str, timeout: Optional[float] = None) -> List[str]:
        """Every driver's `value`, in replica order."""
        import numpy as np

        mine = np.frombuffer(value.encode("utf-8"), np.uint8).astype(np.int32)
        lengths = [0] * self.size
        lengths[self.rank] = len(mine)
        lengths = [int(n) for n in self._collective_sum(lengths, f"gather/{name}/lengths", timeout)]
        data = np.zeros(max(1, sum(lengths)), np.int32)
        start = sum(lengths[: self.rank])
        data[start:start + len(mine)] = mine
        summed = self._collective_sum(data, f"gather/{name}", timeout)
        out, position = [], 0
        for n in lengths:
            out.append(bytes(summed[position:position + n].astype(np.uint8)).decode("utf-8"))
            position += n
        return out

    def put(self, key: str, value: str) -> None:
        raise NotImplementedError(
            "smp.send / smp.recv_from / smp.broadcast are not available when pipelines span processes "
            "(pipeline_processes > 1): use smp.allgather or smp.barrier, which every driver calls."
        )

    get = put

    def delete(self, key: str) -> None:
        pass

    def report_error(self, message: str) -> None:
        """The others learn of a failing driver from its watchdog when it exits."""
        logger.error(message)


def intra_op_threads(num_devices: int, local_size: int, cpus: int, cpus_on_host: int) -> Optional[int]:
    """Intra-op threads of a process whose devices are CPU devices, or None
    for TensorFlow's default (every core it may use).

    Several logical devices in one process get one core each, as with one
    process per pipeline. One device per process, with several processes on
    the host, shares the host's cores among them; a process restricted to
    fewer cores than the host has (``taskset``, a batch system's binding)
    keeps those.

    Args:
        num_devices: the process's devices.
        local_size: processes of the job on this host.
        cpus: cores this process may run on.
        cpus_on_host: cores of the host.
    """
    if num_devices > 1:
        return 1
    if local_size > 1 and cpus >= cpus_on_host:
        return _core_share(local_size, cpus, cpus_on_host)
    return None


def _core_share(local_size: int, cpus: int, cpus_on_host: int) -> int:
    """The cores a process counts as its own: those it is bound to, when
    fewer than the host's; otherwise the host's, divided among the job's
    processes there."""
    if cpus < cpus_on_host:
        return cpus
    return max(1, cpus_on_host // max(1, local_size))


def spin_idle_threads(threads: int, local_size: int, cpus: int, cpus_on_host: int) -> bool:
    """Whether the idle threads of a process's pools should spin before
    they sleep (TensorFlow's default), given its inter-op threads.

    A thread of TensorFlow's pools that runs out of work keeps polling for
    new work for a while before it sleeps, so that the next op starts
    without a wake-up. That pays while every thread has a core to itself. A
    stage process has more inter-op threads than one per device (see
    `_session_config`), and the stage processes of a host share its cores:
    once the threads outnumber the process's share of the cores, a spinning
    thread takes turns with the threads that compute (on
    ``benchmarks/pipeline_processes``, two processes on two cores, the step
    across processes was 2 to 3% shorter without spinning, at the median of
    five alternating runs each).

    Args:
        threads: the process's inter-op threads.
        local_size: processes of the job on this host.
        cpus: cores this process may run on.
        cpus_on_host: cores of the host.
    """
    return threads <= _core_share(local_size, cpus, cpus_on_host)


def _session_config(kind: str, num_devices: int, logical_cpu: bool, local_size: int = 1):
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={kind: num_devices})
    config.experimental.collective_group_leader = task_name(0)
    cpus_on_host = os.cpu_count() or 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus_on_host
    if logical_cpu:
        threads = intra_op_threads(num_devices, local_size, cpus, cpus_on_host)
        if threads is not None:
            # Otherwise every process of the host runs each op on all its
            # cores at once, and their compute threads take turns.
            config.intra_op_parallelism_threads = threads
    # The transfers to other processes run as small ops (`_Send`, and the
    # completions of `RecvTensor` calls) on the inter-op pool, which runs
    # the newest work first: with one thread per device they wait behind
    # that device's compute, and the neighbour stage waits with them. Spare
    # threads run them as soon as their tensor is ready. A backward task's
    # independent branches take several threads at once, so a few spares are
    # not enough: on the benchmark's MLP with one core per process, a
    # profile shows boundary tensors arriving 2 to 4 ms after they were
    # produced with 3 spares, 0.1 to 0.5 ms with 8 (16 are no better).
    config.inter_op_parallelism_threads = max(
        num_devices + TRANSFER_THREADS, tf.config.threading.get_inter_op_parallelism_threads()
    )
    # Threads beyond the process's share of the cores would spin on cores
    # that other threads compute on: see `spin_idle_threads`.
    if not spin_idle_threads(config.inter_op_parallelism_threads, local_size, cpus, cpus_on_host):
        config.experimental.disable_thread_spinning = True
    return config


def _alive(address: str, timeout: float = 2.0) -> bool:
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


#: How long an error naming another process waits for that process's server
#: to refuse connections before calling the process alive. A killed process
#: resets its connections before the kernel closes its listening socket, so
#: the first look may still find the port open.
GONE_WINDOW_S = 3.0


def _gone(address: str, window: float = GONE_WINDOW_S) -> bool:
    """Whether the server at `address` refuses connections within `window` seconds."""
    deadline = time.monotonic() + window
    while True:
        if not _alive(address, timeout=min(2.0, window)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _serve(info: ClusterInfo, layout: PipelineLayout, addresses: Tuple[str, ...], timeout: float) -> None:
    """Serves this process's devices until its driver's server is gone, then exits."""
    driver = layout.driver(layout.dp_rank(info.rank))
    logger.info(
        "smp_tf: rank %d serves stages %s of pipeline %d to its driver, rank %d (%s)",
        info.rank, list(layout.stages(info.rank)), layout.dp_rank(info.rank), driver, addresses[driver],
    )
    deadline = time.monotonic() + join_timeout(timeout)
    seen = False
    while True:
        up = _alive(addresses[driver])
        if up:
            seen = True
        elif seen:
            break  # the driver finished (or died: it reports that itself)
        elif time.monotonic() > deadline:
            logger.error("smp_tf: rank %d: the driver of its pipeline, rank %d, never started its server", info.rank, driver)
            os._exit(1)
        time.sleep(1.0)
    logger.info("smp_tf: rank %d: its driver, rank %d, is done; exiting", info.rank, driver)
    # Nothing of the user's program runs here, and TensorFlow's server does
    # not shut down cleanly: leave at once.
    logging.shutdown()
    os._exit(0)


def _lost_message(rank: int, layout: PipelineLayout, addresses: Tuple[str, ...], other: int, why: str) -> str:
    return (
        f"smp_tf: rank {other} on {addresses[other]}, which holds stages {list(layout.stages(other))} of pipeline "
        f"{layout.dp_rank(other)}, {why}. The pipeline cannot go on: rank {rank} stops "
        "(restart every process of the job, for example from the last checkpoint)."
    )


_GONE = "is gone (its server refuses connections: the process died)"


#: Set when the driver's program ends with an uncaught error.
_FAILED = threading.Event()


def _install_excepthook(rank: int, layout: PipelineLayout, addresses: Tuple[str, ...]) -> None:
    """An error that ends the driver's program and names a task of its
    pipeline (TensorFlow's "/job:worker/replica:0/task:N") first says which
    rank and host that is, and whether its process is gone."""
    import sys

    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        _FAILED.set()
        for other in (t for t in missing_ranks(str(value)) if t != rank and t < len(addresses)):
            why = _GONE if _gone(addresses[other]) else "failed while running its stages"
            print(_lost_message(rank, layout, addresses, other, why), file=sys.stderr, flush=True)
        previous(kind, value, traceback)

    sys.excepthook = hook


def _stage_lost(rank: int, layout: PipelineLayout, addresses: Tuple[str, ...], other: int, why: str) -> None:
    message = _lost_message(rank, layout, addresses, other, why)
    logger.error(message)
    import sys

    print(message, file=sys.stderr, flush=True)
    logging.shutdown()
    # The main thread may be inside a step that waits for the lost process.
    os._exit(EXIT_STAGE_LOST)


#: What an HTTP/2 client sends first: the connection preface and an empty
#: SETTINGS frame. A gRPC server answers with its own SETTINGS frame.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _answers(address: str, timeout: float) -> bool:
    """Whether the gRPC server at `address` answers an HTTP/2 greeting within
    `timeout` seconds. A stopped or hung process still has its port open (the
    kernel accepts the connection) but never answers; its server's threads
    are what answer, whatever its main thread does."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(_HTTP2_HELLO)
            return len(sock.recv(9)) > 0
    except OSError:
        return False


#: Set when the driver's program ends: the other processes may then go.
_FINISHING = threading.Event()


def last_resort_s(timeout: float) -> float:
    """Seconds after which a driver whose watchdog could not run exits (see `_watch`)."""
    return 2.0 * timeout + 30.0


def _watch(rank: int, layout: PipelineLayout, addresses: Tuple[str, ...], others, timeout: float) -> None:
    """The driver's watchdog: stops the driver when a process of the job
    died (its server refuses connections) or stalled (its server does not
    answer within `timeout` seconds).

    This thread needs the interpreter: should the main thread block inside
    a native call that holds it, the thread could not run and the driver
    would hang. As a last resort each round arms faulthandler's native
    timer (which needs no interpreter): when no round re-arms it for
    `last_resort_s` seconds, it prints every thread's stack and exits with
    code 1.
    """
    import faulthandler
    import sys

    try:
        while not _FINISHING.is_set():
            faulthandler.dump_traceback_later(last_resort_s(timeout), exit=True, file=sys.stderr)
            _watch_round(rank, layout, addresses, others, timeout)
            time.sleep(WATCH_INTERVAL_S)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _watch_round(rank: int, layout: PipelineLayout, addresses: Tuple[str, ...], others, timeout: float) -> None:
    """One look at every other process; stops the driver if one is lost."""
    for r in others:
        if _FINISHING.is_set():
            return
        if not _answers(addresses[r], timeout):
            # A dead process refuses the connection; a hung one accepts it.
            why = _GONE if _gone(addresses[r], window=min(GONE_WINDOW_S, timeout)) else (
                f"stopped responding (no answer for {timeout:g} s: it hangs)")
            _stage_lost(rank, layout, addresses, r, why)


def start(info: ClusterInfo, layout: PipelineLayout, kind: str, logical_cpu: bool, timeout: float,
          tensor_degree: int = 1) -> PipelineProcess:
    """Starts this process's server; on a driver, connects to the cluster.

    Called by `smp.init` after the local devices are configured and before
    TensorFlow's runtime starts. On a process that is not a driver this
    never returns (`_serve`).

    Args:
        info: the cluster.
        layout: the job's layout.
        kind: ``"CPU"`` or ``"GPU"``, the kind of every stage's device.
        logical_cpu: whether the devices are logical CPU devices.
        timeout: `Config.dp_timeout`.
        tensor_degree: devices per partition (``tensor_parallel_degree``):
            each process serves ``partitions_per_process * tensor_degree``
            devices, a stage's all in one process.

    Returns:
        On a driver, its `PipelineProcess`.
    """
    global _CURRENT, _SERVER
    if _CURRENT is not None:
        if _CURRENT.info == info and _CURRENT.layout == layout:
            if _CURRENT.tensor_degree != tensor_degree:
                raise RuntimeError(
                    f"smp.init was called again with tensor_parallel_degree={tensor_degree}, but this job's "
                    f"processes serve {_CURRENT.tensor_degree} device(s) per partition, fixed when they started. "
                    "Start new processes for another tensor-parallel degree."
                )
            return _CURRENT
        raise RuntimeError(
            f"smp.init was called again with another cluster or layout ({info}, {layout}) than the running "
            f"one ({_CURRENT.info}, {_CURRENT.layout}); a process joins one cluster for its lifetime. "
            "Start new processes."
        )
    import tensorflow as tf
    from tensorflow.python.eager import context

    addresses = server_addresses(info, timeout)
    require_runtime_not_started("start this process's server")
    cluster_spec = tf.train.ClusterSpec({JOB: list(addresses)})
    config = _session_config(kind, layout.partitions_per_process * tensor_degree, logical_cpu, info.local_size)
    # The same pool sizes for this process's own context (a driver's client
    # runs its share of each step there).
    tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_parallelism_threads)
    if config.intra_op_parallelism_threads:
        tf.config.threading.set_intra_op_parallelism_threads(config.intra_op_parallelism_threads)
    try:
        _SERVER = tf.distribute.Server(cluster_spec, job_name=JOB, task_index=info.rank, start=True, config=config)
    except tf.errors.UnknownError as e:
        raise OSError(
            f"smp_tf: rank {info.rank} cannot start its server on {addresses[info.rank]}: {str(e).splitlines()[0]}. "
            "Choose other ports (smp_tf.launch picks free ones)."
        ) from e
    if not layout.is_driver(info.rank):
        _serve(info, layout, addresses, timeout)
        raise AssertionError("unreachable")  # _serve exits the process

    # The driver: wait for every server of the job, then connect (its
    # cluster lists them all; connecting while one is still starting can
    # leave this process's own server unreachable).
    replica = layout.dp_rank(info.rank)
    deadline = time.monotonic() + join_timeout(timeout)
    for r in range(info.size):
        while not _alive(addresses[r]):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"smp_tf: rank {info.rank} waited {join_timeout(timeout):.0f} s for the server of rank {r} "
                    f"({addresses[r]}), which holds stages {list(layout.stages(r))} of pipeline {layout.dp_rank(r)}. "
                    "Check that every process was started with the same cluster environment."
                )
            time.sleep(0.2)
    host = parse_address(addresses[info.rank])[0]
    client = f"{host}:{pick_free_ports(1)[0]}"
    # The client job lists only this driver: connecting asks every listed
    # task for its devices, and another driver would not answer before it
    # has connected itself.
    client_spec = tf.train.ClusterSpec({JOB: list(addresses), CLIENT: {replica: client}})
    context.context().configure_collective_ops(collective_leader=task_name(0))
    tf.config.experimental_connect_to_cluster(
        client_spec, job_name=CLIENT, task_index=replica, protocol="grpc", make_master_device_default=True
    )
    groups = tuple(tuple(worker_device(r, kind, i * tensor_degree + k) for k in range(tensor_degree))
                   for r, i in layout.placement(replica))
    devices = tuple(g[0] for g in groups)
    _CURRENT = PipelineProcess(info, layout, devices, float(timeout), groups if tensor_degree > 1 else ())
    # With several replicas a lost process of another pipeline stalls this
    # one's gradient all-reduce: watch every process of the job.
    others = [r for r in range(info.size) if r != info.rank]
    _install_excepthook(info.rank, layout, addresses)
    threading.Thread(
        target=_watch, args=(info.rank, layout, addresses, others, float(timeout)), name="smp_tf-stage-watchdog",
        daemon=True,
    ).start()
    logger.info(
        "smp_tf: rank %d drives pipeline %d: %s", info.rank, replica,
        ", ".join(f"stage {p} on rank {r} {kind}:{i}" for p, (r, i) in enumerate(layout.placement(replica))),
    )
    return _CURRENT


def data_parallel_group(process: PipelineProcess, config_json: str) -> PipelineGroup:
    """The drivers' data-parallel group (several replicas of a pipeline that
    spans processes), checked to run one configuration; at exit every driver
    waits for the others, so that no replica's processes go while another
    still all-reduces with them."""
    from smp_tf.distributed import runtime

    group = runtime.group()
    if not isinstance(group, PipelineGroup):  # not smp.init again
        layout = process.layout
        group = PipelineGroup(layout.dp_rank(process.info.rank), layout.replicas, process.timeout, process.devices[0])
        import atexit

        atexit.register(_leave_together, group)
    return runtime.use_group(group, config_json)


def _leave_together(group: PipelineGroup) -> None:
    if _FAILED.is_set():
        return  # the others' watchdogs see this process go
    try:
        group.barrier("exit", timeout=join_timeout(group.timeout))
    except Exception as e:  # noqa: BLE001 - exiting anyway
        logger.error("smp_tf: replica %d left without the others: %s", group.rank, e)
    _FINISHING.set()
