"""Which process am I, and where are the others: the cluster from the environment.

With data parallelism each process drives one whole pipeline replica, and the
replicas all-reduce their gradients through TensorFlow's collective runtime.
That runtime starts a gRPC server in every process and must be told, before
it starts, the ``host:port`` of every process's server. `from_environment`
reads what the process launcher put in the environment; the first source
found wins:

===============  =============================================  =============
source           variables                                      addresses
===============  =============================================  =============
smp_tf.launch    ``SMP_TF_RANK``, ``SMP_TF_SIZE``,              ``SMP_TF_ADDRESSES``
                 ``SMP_TF_LOCAL_RANK``, ``SMP_TF_LOCAL_SIZE``
TF_CONFIG        ``TF_CONFIG`` (``chief`` and ``worker`` jobs)  in TF_CONFIG
mpirun           ``OMPI_COMM_WORLD_RANK``, ``..._SIZE``,         rendezvous
                 ``..._LOCAL_RANK``, ``..._LOCAL_SIZE``
pmi              ``PMI_RANK``, ``PMI_SIZE``,                    rendezvous
                 ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
slurm            ``SLURM_PROCID``, ``SLURM_NTASKS``,            rendezvous
                 ``SLURM_LOCALID``, ``SLURM_NTASKS_PER_NODE`` /
                 ``SLURM_TASKS_PER_NODE`` and ``SLURM_NODEID``
single           none of the above, or one process              none needed
===============  =============================================  =============

Later sources are ignored once one is found, because launchers nest: the
processes that ``smp_tf.launch`` starts inside a SLURM allocation inherit the
allocation's ``SLURM_*`` variables, which describe the allocation, not them.

Other variables:

* ``SMP_TF_LOCAL_RANK`` / ``SMP_TF_LOCAL_SIZE`` (both or neither) override
  the local rank and size of any source. Without them, TF_CONFIG and
  ``SMP_TF_ADDRESSES`` give them by counting the addresses on the same host
  (host names are compared as written).
* ``SMP_TF_ADDRESSES`` (``host:port`` per rank, comma-separated) gives the
  addresses to any rank source, so no rendezvous is needed.
* When the addresses are not given, the processes exchange them through a
  rendezvous at the coordinator (`smp_tf.distributed.rendezvous`): rank 0
  listens on it. It is ``SMP_TF_COORDINATOR`` (``host:port``), else
  ``MASTER_ADDR`` with the port ``SMP_TF_COORDINATOR_PORT``, ``MASTER_PORT``
  or 29400 (the first set), else under SLURM the first host of the step's or
  job's node list with that port. The first node of the list runs task 0
  under SLURM's default (block) distribution.

This module does not import TensorFlow: launchers use it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import socket
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "ClusterInfo",
    "DEFAULT_COORDINATOR_PORT",
    "EXIT_PORT_IN_USE",
    "SOURCES",
    "expand_nodelist",
    "expand_tasks_per_node",
    "from_environment",
    "parse_address",
    "pick_free_ports",
]

#: Port of the rendezvous when only its host is known.
DEFAULT_COORDINATOR_PORT = 29400

#: Exit code of a process whose TensorFlow server could not bind its port;
#: the launcher then restarts every rank with new ports.
EXIT_PORT_IN_USE = 75

#: The values of `ClusterInfo.source`.
SOURCES = ("single", "smp_tf.launch", "TF_CONFIG", "mpirun", "pmi", "slurm")

#: Lowest port `pick_free_ports` uses; well above the ports of common services.
_PORT_RANGE_START = 20000

# Linux's default, used where /proc cannot be read (it is also below macOS's
# 49152-65535, so the block picked stays outside the ephemeral range there).
_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)

# Job types of TF_CONFIG that play no part in synchronous data parallelism.
_UNSUPPORTED_TF_JOBS = ("ps", "evaluator")

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?$")


@dataclass(frozen=True)
class ClusterInfo:
    """This process's place among the processes of a data-parallel job.

    Attributes:
        rank: index of this process, in ``[0, size)``.
        size: number of processes (pipeline replicas).
        local_rank: index of this process among those on its host.
        local_size: number of processes on this host.
        addresses: ``host:port`` of every rank's TensorFlow server, in rank
            order, when the environment gives them; None when they must be
            exchanged through the coordinator (or the job is one process).
        coordinator: ``host:port`` of the rendezvous (rank 0 listens there)
            when the addresses must be exchanged; None otherwise.
        source: where the information came from, one of `SOURCES`.

    Raises:
        ValueError: a field has the wrong type or is out of range; a job of
            several processes has neither addresses nor a coordinator.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    addresses: Optional[Tuple[str, ...]]
    coordinator: Optional[str]
    source: str

    def __post_init__(self) -> None:
        for name in ("rank", "size", "local_rank", "local_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"ClusterInfo.{name} must be an integer. Received: {name}={value!r}"
                )
        if self.size < 1:
            raise ValueError(f"ClusterInfo.size must be at least 1. Received: size={self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(
                f"ClusterInfo.rank must be in [0, size={self.size}). Received: rank={self.rank}"
            )
        if not 1 <= self.local_size <= self.size:
            raise ValueError(
                f"ClusterInfo.local_size must be in [1, size={self.size}]. "
                f"Received: local_size={self.local_size}"
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ValueError(
                f"ClusterInfo.local_rank must be in [0, local_size={self.local_size}). "
                f"Received: local_rank={self.local_rank}"
            )
        if self.source not in SOURCES:
            raise ValueError(
                f"ClusterInfo.source must be one of {', '.join(map(repr, SOURCES))}. "
                f"Received: source={self.source!r}"
            )
        if self.addresses is not None:
            object.__setattr__(self, "addresses", tuple(self.addresses))
            _check_addresses(self.addresses, self.size, "ClusterInfo.addresses", "ClusterInfo.size")
        if self.coordinator is not None:
            _parse_address(self.coordinator, "ClusterInfo.coordinator")
        if self.size > 1 and (self.addresses is None) == (self.coordinator is None):
            raise ValueError(
                "A ClusterInfo of several processes needs exactly one of `addresses` "
                "(every rank's server) and `coordinator` (where to exchange them). "
                f"Received: size={self.size}, addresses={self.addresses!r}, "
                f"coordinator={self.coordinator!r}"
            )

    @property
    def is_distributed(self) -> bool:
        """Whether the job has more than one process."""
        return self.size > 1


def _single() -> ClusterInfo:
    return ClusterInfo(0, 1, 0, 1, None, None, "single")


# ---------------------------------------------------------------------------
# Addresses.


def parse_address(address: str) -> Tuple[str, int]:
    """Splits a ``host:port`` address.

    Args:
        address: ``host:port``; an IPv6 host is written in brackets
            (``[::1]:20000``).

    Returns:
        ``(host, port)``, the host without brackets.

    Raises:
        ValueError: `address` is not ``host:port`` with a port in [1, 65535].
    """
    return _parse_address(address, "address")


def _parse_address(address: Any, what: str) -> Tuple[str, int]:
    def bad(reason: str) -> ValueError:
        return ValueError(
            f"{what} must be 'host:port' (for example 'node1:20000' or '[::1]:20000'); "
            f"{reason}. Received: {what}={address!r}"
        )

    if not isinstance(address, str):
        raise bad(f"it is a {type(address).__name__}, not a string")
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host:
        raise bad("the host or the ':' is missing")
    if host.startswith("["):
        if not host.endswith("]") or not _IPV6_RE.match(host[1:-1]):
            raise bad(f"{host!r} is not a bracketed IPv6 address")
        host = host[1:-1]
    elif not _HOST_RE.match(host):
        raise bad(f"{host!r} is not a host name or IPv4 address (an IPv6 host needs brackets)")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise bad(f"the port {port_text!r} is not an integer in [1, 65535]")
    return host, int(port_text)


def _check_addresses(addresses: Sequence[str], size: int, what: str, size_what: str) -> None:
    for i, address in enumerate(addresses):
        _parse_address(address, f"{what}[{i}]")
    if len(addresses) != size:
        raise ValueError(
            f"{what} must list one address per process: {size_what} is {size} but it has "
            f"{len(addresses)} entries. Received: {what}={list(addresses)!r}"
        )
    seen: Dict[str, int] = {}
    for i, address in enumerate(addresses):
        key = address.strip().lower()
        if key in seen:
            raise ValueError(
                f"{what} lists the address {address!r} twice (entries {seen[key]} and {i}); "
                f"every process needs its own port. Received: {what}={list(addresses)!r}"
            )
        seen[key] = i


def _local_from_addresses(addresses: Sequence[str], rank: int) -> Tuple[int, int]:
    hosts = [_parse_address(a, "address")[0].lower() for a in addresses]
    mine = hosts[rank]
    return hosts[:rank].count(mine), hosts.count(mine)


# ---------------------------------------------------------------------------
# Reading variables.


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    # An empty value is how a variable is commonly "unset" in shell scripts.
    value = env.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = _get(env, name)
    if raw is None:
        return None
    try:
        return int(raw, 10)
    except ValueError:
        raise ValueError(
            f"The environment variable {name} must be an integer. Received: {name}={env[name]!r}"
        ) from None


def _require_int(env: Mapping[str, str], name: str, because: str) -> int:
    value = _int(env, name)
    if value is None:
        raise ValueError(f"The environment variable {name} is not set, but {because}. Set {name}.")
    return value


def _check_rank_size(rank: int, size: int, rank_name: str, size_name: str) -> None:
    if size < 1:
        raise ValueError(
            f"The number of processes must be at least 1. Received: {size_name}={size}"
        )
    if not 0 <= rank < size:
        raise ValueError(
            f"{rank_name}={rank} is not a rank of a job of {size_name}={size} processes: it "
            f"must be in [0, {size}). Check that both come from the same launcher."
        )


def _check_local(
    local_rank: int, local_size: int, size: int, rank_name: str, size_name: str
) -> None:
    if not 1 <= local_size <= size:
        raise ValueError(
            f"{size_name}={local_size} must be in [1, {size}] (at least this process and at "
            f"most all {size} processes run on this host)."
        )
    if not 0 <= local_rank < local_size:
        raise ValueError(
            f"{rank_name}={local_rank} must be in [0, {local_size}) since {size_name}="
            f"{local_size} processes run on this host."
        )


# ---------------------------------------------------------------------------
# SLURM's compressed lists.


def expand_nodelist(nodelist: str) -> List[str]:
    """Expands SLURM's compressed host list.

    ``"node[01-03,07],gpu-a1,rack[1-2]-n[3,5]"`` becomes ``node01, node02,
    node03, node07, gpu-a1, rack1-n3, rack1-n5, rack2-n3, rack2-n5``. A range
    keeps the zero padding of its first number (``[08-10]`` is ``08, 09,
    10``). Entries may also be separated by spaces.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST`` or a similar variable.

    Returns:
        The host names, in order.

    Raises:
        ValueError: the list is empty, a bracket is unbalanced or nested, or a
            range is not ``a-b`` with integers ``a <= b``.
    """

    def bad(reason: str) -> ValueError:
        return ValueError(f"Cannot expand the SLURM node list {nodelist!r}: {reason}.")

    items: List[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise bad("nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise bad("a ']' without '['")
        elif ch in ", " and depth == 0:
            if nodelist[start:i]:
                items.append(nodelist[start:i])
            start = i + 1
    if depth != 0:
        raise bad("a '[' without ']'")
    if not items:
        raise bad("it names no host")

    def values(body: str) -> List[str]:
        out: List[str] = []
        for part in body.split(","):
            first, dash, last = part.strip().partition("-")
            if not first.isdigit() or (dash and not last.isdigit()):
                raise bad(f"[{body}] is not a list of numbers and ranges a-b")
            if not dash:
                out.append(first)
                continue
            if int(first) > int(last):
                raise bad(f"the range {part} goes backwards")
            out.extend(str(v).zfill(len(first)) for v in range(int(first), int(last) + 1))
        return out

    def expand(item: str) -> List[str]:
        open_at = item.find("[")
        if open_at < 0:
            return [item]
        close_at = item.index("]", open_at)
        prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
        tails = expand(rest)
        return [prefix + v + t for v in values(body) for t in tails]

    return [host for item in items for host in expand(item)]


def expand_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> List[int]:
    """Expands SLURM's tasks-per-node list: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Args:
        value: the variable's value.
        name: the variable's name, for error messages.

    Returns:
        The number of tasks on each node, in node order.

    Raises:
        ValueError: an entry is not ``count`` or ``count(xrepeat)`` with
            positive integers.
    """
    counts: List[int] = []
    for entry in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", entry)
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(
                f"The environment variable {name} must be a list like '2(x3),1' (tasks per "
                f"node, with repeats). Received: {name}={value!r}"
            )
        counts.extend([int(m.group(1))] * (int(m.group(2)) if m.group(2) else 1))
    return counts


def _slurm_local_size(env: Mapping[str, str]) -> Tuple[int, str]:
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = _get(env, name)
        if raw is None:
            continue
        counts = expand_tasks_per_node(raw, name)
        if len(set(counts)) == 1:
            return counts[0], name
        node = _require_int(env, "SLURM_NODEID", f"{name}={raw!r} differs between nodes")
        if not 0 <= node < len(counts):
            raise ValueError(
                f"SLURM_NODEID={node} is not a node of {name}={raw!r} ({len(counts)} nodes)."
            )
        return counts[node], name
    raise ValueError(
        "Running under SLURM (SLURM_PROCID is set) but neither SLURM_NTASKS_PER_NODE nor "
        "SLURM_TASKS_PER_NODE is set, so the number of processes on this node is unknown. "
        "Start the processes with srun, or set SMP_TF_LOCAL_RANK and SMP_TF_LOCAL_SIZE."
    )


# ---------------------------------------------------------------------------
# Sources.


@dataclass
class _Found:
    """What a source gave, with the variable names to put in error messages."""

    source: str
    rank: int
    size: int
    rank_name: str
    size_name: str
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    local_rank_name: str = "SMP_TF_LOCAL_RANK"
    local_size_name: str = "SMP_TF_LOCAL_SIZE"
    addresses: Optional[Tuple[str, ...]] = None
    addresses_name: str = "SMP_TF_ADDRESSES"


def from_environment(env: Mapping[str, str] = os.environ) -> ClusterInfo:
    """Reads this process's rank and the cluster from the environment.

    See the module doc for the sources and their precedence.

    Args:
        env: the environment; defaults to `os.environ`.

    Returns:
        The `ClusterInfo`. A job of one process (or no launcher at all) gives
        ``ClusterInfo(0, 1, 0, 1, None, None, "single")``.

    Raises:
        ValueError: a variable is not an integer, a rank is out of range, the
            addresses are malformed, duplicated or not one per process,
            ``TF_CONFIG`` is not valid or asks for an unsupported job type,
            two variables of one source disagree, or several processes must
            exchange their addresses but no coordinator is known. The message
            names the variable, its value, and what to set.
    """
    if _get(env, "SMP_TF_RANK") is not None or _get(env, "SMP_TF_SIZE") is not None:
        found = _from_smp_tf(env)
    elif _get(env, "TF_CONFIG") is not None:
        found = _from_tf_config(env)
    elif _get(env, "OMPI_COMM_WORLD_RANK") is not None or _get(env, "OMPI_COMM_WORLD_SIZE") is not None:
        found = _from_mpi(
            env, "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
    elif _get(env, "PMI_RANK") is not None or _get(env, "PMI_SIZE") is not None:
        found = _from_mpi(env, "pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    elif _get(env, "SLURM_PROCID") is not None:
        found = _from_slurm(env)
    else:
        if _get(env, "SMP_TF_ADDRESSES") is not None:
            raise ValueError(
                "SMP_TF_ADDRESSES is set but no launcher variable says which of its entries is "
                "this process: set SMP_TF_RANK and SMP_TF_SIZE (or start the processes with "
                f"python -m smp_tf.launch). Received: SMP_TF_ADDRESSES={env['SMP_TF_ADDRESSES']!r}"
            )
        return _single()
    return _assemble(env, found)


def _from_smp_tf(env: Mapping[str, str]) -> _Found:
    rank = _require_int(env, "SMP_TF_RANK", "SMP_TF_SIZE is set")
    size = _require_int(env, "SMP_TF_SIZE", "SMP_TF_RANK is set")
    return _Found("smp_tf.launch", rank, size, "SMP_TF_RANK", "SMP_TF_SIZE")


def _from_mpi(
    env: Mapping[str, str],
    source: str,
    rank_name: str,
    size_name: str,
    local_rank_name: str,
    local_size_name: str,
) -> _Found:
    rank = _require_int(env, rank_name, f"{size_name} is set")
    size = _require_int(env, size_name, f"{rank_name} is set")
    found = _Found(source, rank, size, rank_name, size_name)
    local_rank, local_size = _int(env, local_rank_name), _int(env, local_size_name)
    if local_rank is not None and local_size is not None:
        found.local_rank, found.local_size = local_rank, local_size
        found.local_rank_name, found.local_size_name = local_rank_name, local_size_name
    elif (
        source == "pmi"
        and _int(env, "SLURM_PROCID") == rank
        and _get(env, "SLURM_LOCALID") is not None
    ):
        # srun with a PMI plugin sets PMI_* but not MPICH's local variables;
        # SLURM's describe the same processes.
        slurm = _from_slurm(env)
        found.local_rank, found.local_size = slurm.local_rank, slurm.local_size
        found.local_rank_name, found.local_size_name = slurm.local_rank_name, slurm.local_size_name
    return found


def _from_slurm(env: Mapping[str, str]) -> _Found:
    rank = _require_int(env, "SLURM_PROCID", "SLURM_PROCID is set")
    size = _require_int(env, "SLURM_NTASKS", "SLURM_PROCID is set (start the processes with srun)")
    found = _Found("slurm", rank, size, "SLURM_PROCID", "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID")
    if local_rank is not None and size > 1:
        found.local_rank = local_rank
        found.local_size, found.local_size_name = _slurm_local_size(env)
        found.local_rank_name = "SLURM_LOCALID"
    return found


def _from_tf_config(env: Mapping[str, str]) -> _Found:
    raw = env["TF_CONFIG"]
    example = (
        '{"cluster": {"worker": ["host1:20000", "host2:20000"]}, '
        '"task": {"type": "worker", "index": 0}}'
    )

    def bad(reason: str) -> ValueError:
        return ValueError(
            f"The environment variable TF_CONFIG {reason}. It must be a JSON object like "
            f"{example}. Received: TF_CONFIG={raw!r}"
        )

    try:
        config = json.loads(raw)
    except ValueError as e:
        raise bad(f"is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise bad(f"holds a JSON {type(config).__name__}, not an object")
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise bad("has no 'cluster' object")
    if not isinstance(task, dict):
        raise bad("has no 'task' object")
    for job in cluster:
        if job in _UNSUPPORTED_TF_JOBS:
            raise bad(
                f"has a {job!r} job: smp_tf runs synchronous data parallelism, where every "
                f"process is a 'worker' (optionally one 'chief'); '{job}' tasks are not supported"
            )
        if job not in ("chief", "worker"):
            raise bad(f"has an unknown job {job!r} (only 'chief' and 'worker' are supported)")
        if not isinstance(cluster[job], list) or not cluster[job]:
            raise bad(f"has a {job!r} job that is not a non-empty list of 'host:port'")
    chief, workers = cluster.get("chief", []), cluster.get("worker", [])
    if len(chief) > 1:
        raise bad(f"has {len(chief)} 'chief' tasks; at most one is allowed")

    task_type, index = task.get("type"), task.get("index", 0)
    if task_type in _UNSUPPORTED_TF_JOBS:
        raise bad(
            f"says this process is a {task_type!r} task: smp_tf runs synchronous data "
            f"parallelism, where every process is a 'worker' (or the 'chief'); '{task_type}' "
            "tasks are not supported"
        )
    if task_type not in ("chief", "worker"):
        raise bad(f"has task.type={task_type!r}; it must be 'worker' or 'chief'")
    if isinstance(index, bool) or not isinstance(index, int):
        raise bad(f"has task.index={index!r}; it must be an integer")
    job_size = len(chief) if task_type == "chief" else len(workers)
    if not 0 <= index < job_size:
        raise bad(
            f"has task.index={index}, but the {task_type!r} job has {job_size} tasks "
            f"(the index must be in [0, {job_size}))"
        )
    # The chief is rank 0 and the workers follow it, in order.
    addresses = tuple(chief) + tuple(workers)
    rank = index if task_type == "chief" else len(chief) + index
    _check_addresses(addresses, len(addresses), "TF_CONFIG's cluster addresses", "the cluster size")
    return _Found(
        "TF_CONFIG", rank, len(addresses), "the rank from TF_CONFIG",
        "TF_CONFIG's cluster size", addresses=addresses, addresses_name="TF_CONFIG's cluster addresses",
    )


# ---------------------------------------------------------------------------
# Putting a source together with the shared variables.


def _assemble(env: Mapping[str, str], found: _Found) -> ClusterInfo:
    _check_rank_size(found.rank, found.size, found.rank_name, found.size_name)

    raw_addresses = _get(env, "SMP_TF_ADDRESSES")
    if raw_addresses is not None:
        addresses = tuple(a.strip() for a in raw_addresses.split(","))
        _check_addresses(addresses, found.size, "SMP_TF_ADDRESSES", found.size_name)
        if found.addresses is not None and addresses != found.addresses:
            raise ValueError(
                f"SMP_TF_ADDRESSES and {found.addresses_name} disagree; give the addresses "
                f"once. Received: SMP_TF_ADDRESSES={raw_addresses!r}, "
                f"{found.addresses_name}={list(found.addresses)!r}"
            )
        found.addresses = addresses
    if found.size == 1:
        return _single()

    local_rank, local_size = _int(env, "SMP_TF_LOCAL_RANK"), _int(env, "SMP_TF_LOCAL_SIZE")
    if (local_rank is None) != (local_size is None):
        given, missing = (
            ("SMP_TF_LOCAL_RANK", "SMP_TF_LOCAL_SIZE")
            if local_rank is not None
            else ("SMP_TF_LOCAL_SIZE", "SMP_TF_LOCAL_RANK")
        )
        raise ValueError(f"{given} is set but {missing} is not: set both or neither.")
    if local_rank is not None and local_size is not None:
        found.local_rank, found.local_size = local_rank, local_size
        found.local_rank_name, found.local_size_name = "SMP_TF_LOCAL_RANK", "SMP_TF_LOCAL_SIZE"
    elif found.local_rank is None and found.addresses is not None:
        found.local_rank, found.local_size = _local_from_addresses(found.addresses, found.rank)
    if found.local_rank is None or found.local_size is None:
        raise ValueError(
            f"The local rank of this process is unknown ({found.rank_name}={found.rank}, "
            f"{found.size_name}={found.size}): set SMP_TF_LOCAL_RANK and SMP_TF_LOCAL_SIZE "
            "(this process's index among those on its host, and their number)."
        )
    _check_local(
        found.local_rank, found.local_size, found.size, found.local_rank_name, found.local_size_name
    )

    coordinator = None if found.addresses is not None else _coordinator(env, found)
    return ClusterInfo(
        rank=found.rank,
        size=found.size,
        local_rank=found.local_rank,
        local_size=found.local_size,
        addresses=found.addresses,
        coordinator=coordinator,
        source=found.source,
    )


def _coordinator_port(env: Mapping[str, str]) -> int:
    for name in ("SMP_TF_COORDINATOR_PORT", "MASTER_PORT"):
        port = _int(env, name)
        if port is not None:
            if not 1 <= port <= 65535:
                raise ValueError(
                    f"The environment variable {name} must be a port in [1, 65535]. "
                    f"Received: {name}={env[name]!r}"
                )
            return port
    return DEFAULT_COORDINATOR_PORT


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _coordinator(env: Mapping[str, str], found: _Found) -> str:
    explicit = _get(env, "SMP_TF_COORDINATOR")
    if explicit is not None:
        _parse_address(explicit, "SMP_TF_COORDINATOR")
        return explicit
    host = _get(env, "MASTER_ADDR")
    if host is not None:
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not (_HOST_RE.match(host) or (":" in host and _IPV6_RE.match(host))):
            raise ValueError(
                "The environment variable MASTER_ADDR must be the host name or IP address of "
                "rank 0, without a port (the port is MASTER_PORT). "
                f"Received: MASTER_ADDR={env['MASTER_ADDR']!r}"
            )
        return _join(host, _coordinator_port(env))
    if found.source == "slurm":
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            nodes = _get(env, name)
            if nodes is not None:
                return _join(expand_nodelist(nodes)[0], _coordinator_port(env))
    how = {
        "mpirun": "mpirun -x MASTER_ADDR=<host of rank 0> [-x MASTER_PORT=29400] ...",
        "pmi": "mpiexec -genv MASTER_ADDR <host of rank 0> [-genv MASTER_PORT 29400] ...",
        "slurm": "export MASTER_ADDR=<host of rank 0> before srun",
        "smp_tf.launch": "export MASTER_ADDR=<host of rank 0> in every process",
    }[found.source]
    raise ValueError(
        f"{found.size_name}={found.size} processes must exchange the addresses of their "
        "TensorFlow servers, but no coordinator is known: set MASTER_ADDR to the host of "
        f"rank 0 in every process ({how}), or SMP_TF_COORDINATOR=<host>:<port>, or list "
        "every process's address in SMP_TF_ADDRESSES."
    )


# ---------------------------------------------------------------------------
# Ports.


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_RANGE


def _port_windows(n: int) -> List[Tuple[int, int]]:
    """Ranges ``[lo, hi)`` able to hold `n` consecutive ports, best first."""
    eph_lo, eph_hi = _ephemeral_range()
    windows = [(_PORT_RANGE_START, eph_lo), (1024, eph_lo), (eph_hi + 1, 65536)]
    return [(lo, hi) for lo, hi in windows if hi - lo >= n]


def pick_free_ports(n: int, host: str = "", attempts: int = 100) -> List[int]:
    """Picks `n` consecutive free TCP ports, for the TensorFlow servers of a job.

    The block starts at a random port below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, from port 20000 up), so no
    outgoing connection or ``bind(0)`` of another process can be handed one
    of these ports; only a process that binds that very port can race the
    caller. Each port is bound once on `host` without ``SO_REUSEADDR`` (so a
    port held by a connection in TIME_WAIT counts as busy) and released at
    once. Callers still handle a port taken in between: a rank that cannot
    start its server exits with `EXIT_PORT_IN_USE`.

    Args:
        n: how many ports.
        host: interface to probe; "" (all interfaces) matches TensorFlow's
            server, which listens on every interface.
        attempts: random blocks tried before giving up.

    Returns:
        ``n`` consecutive port numbers, ascending.

    Raises:
        ValueError: `n` is not a positive integer, or larger than the port
            range.
        OSError: no free block was found in `attempts` tries.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"pick_free_ports needs a positive number of ports. Received: n={n!r}")
    windows = _port_windows(n)
    if not windows:
        raise ValueError(
            f"Cannot pick {n} consecutive ports outside the ephemeral port range "
            f"{_ephemeral_range()}. Received: n={n}"
        )
    lo, hi = windows[0]
    # Not the `random` module's shared generator: user code (and Keras's
    # set_random_seed) seeds it, and processes seeded alike would then race
    # for the same blocks.
    rng = random.SystemRandom()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        base = rng.randrange(lo, hi - n + 1)
        if _all_bindable(family, host, range(base, base + n)):
            return list(range(base, base + n))
    raise OSError(
        errno.EADDRINUSE,
        f"No block of {n} consecutive free ports found in [{lo}, {hi}) after {attempts} "
        f"random tries on host {host!r}; free some ports or use fewer processes.",
    )


def _all_bindable(family: int, host: str, ports: range) -> bool:
    socks = []
    try:
        for port in ports:
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
