"""The cluster from the environment, free ports, and the address rendezvous.

No TensorFlow: `smp_tf.distributed.cluster` and `.rendezvous` are plain
Python, used by the launcher before any process imports TensorFlow.
"""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from smp_tf.distributed import cluster
from smp_tf.distributed.cluster import (
    DEFAULT_COORDINATOR_PORT,
    ClusterInfo,
    expand_nodelist,
    expand_tasks_per_node,
    from_environment,
    parse_address,
    pick_free_ports,
)
from smp_tf.distributed.rendezvous import exchange_addresses, my_host

SINGLE = ClusterInfo(0, 1, 0, 1, None, None, "single")


def launcher_env(rank, size, addresses=None, **extra):
    env = {"SMP_TF_RANK": str(rank), "SMP_TF_SIZE": str(size)}
    if addresses is not None:
        env["SMP_TF_ADDRESSES"] = ",".join(addresses)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------
# Sources.


def test_no_launcher_is_a_single_process():
    assert from_environment({}) == SINGLE
    assert not SINGLE.is_distributed
    # Empty values are how shell scripts unset variables.
    assert from_environment({"SMP_TF_RANK": "", "TF_CONFIG": " ", "OMPI_COMM_WORLD_RANK": ""}) == SINGLE


def test_our_launcher():
    addresses = ["127.0.0.1:20000", "127.0.0.1:20001", "127.0.0.1:20002"]
    env = launcher_env(2, 3, addresses, SMP_TF_LOCAL_RANK="2", SMP_TF_LOCAL_SIZE="3", SMP_TF_LAUNCHER="1")
    info = from_environment(env)
    assert info == ClusterInfo(2, 3, 2, 3, tuple(addresses), None, "smp_tf.launch")
    assert info.is_distributed


def test_local_rank_is_counted_from_the_hosts_of_the_addresses():
    # Ranks 0 and 1 share host a; rank 2 is alone on b; rank 3 is a's third.
    addresses = ["a:1", "a:2", "b:1", "A:3"]
    got = [from_environment(launcher_env(r, 4, addresses)) for r in range(4)]
    assert [(i.local_rank, i.local_size) for i in got] == [(0, 3), (1, 3), (0, 1), (2, 3)]


def test_our_variables_with_a_coordinator_instead_of_addresses():
    env = launcher_env(1, 2, SMP_TF_LOCAL_RANK="0", SMP_TF_LOCAL_SIZE="1", SMP_TF_COORDINATOR="head:1234")
    assert from_environment(env) == ClusterInfo(1, 2, 0, 1, None, "head:1234", "smp_tf.launch")


def test_a_size_of_one_is_a_single_process_whatever_the_source():
    assert from_environment(launcher_env(0, 1, ["127.0.0.1:20000"])) == SINGLE
    assert from_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) == SINGLE
    assert from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == SINGLE
    tf_config = {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}
    assert from_environment({"TF_CONFIG": json.dumps(tf_config)}) == SINGLE


def test_tf_config_workers():
    tf_config = {"cluster": {"worker": ["h1:2222", "h1:2223", "h2:2222"]}, "task": {"type": "worker", "index": 1}}
    info = from_environment({"TF_CONFIG": json.dumps(tf_config)})
    assert info == ClusterInfo(1, 3, 1, 2, ("h1:2222", "h1:2223", "h2:2222"), None, "TF_CONFIG")


def test_tf_config_chief_is_rank_0_followed_by_the_workers():
    cluster_spec = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}
    chief = from_environment({"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": {"type": "chief", "index": 0}})})
    worker = from_environment({"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": {"type": "worker", "index": 1}})})
    assert chief.rank == 0 and worker.rank == 2
    assert chief.addresses == worker.addresses == ("c:1", "w0:1", "w1:1")


def test_tf_config_local_rank_can_be_given():
    tf_config = {"cluster": {"worker": ["h1:1", "h2:1"]}, "task": {"type": "worker", "index": 1}}
    env = {"TF_CONFIG": json.dumps(tf_config), "SMP_TF_LOCAL_RANK": "1", "SMP_TF_LOCAL_SIZE": "2"}
    info = from_environment(env)
    assert (info.local_rank, info.local_size) == (1, 2)


MPIRUN = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def test_mpirun_with_master_addr():
    info = from_environment({**MPIRUN, "MASTER_ADDR": "node7"})
    assert info == ClusterInfo(3, 4, 1, 2, None, f"node7:{DEFAULT_COORDINATOR_PORT}", "mpirun")
    assert from_environment({**MPIRUN, "MASTER_ADDR": "node7", "MASTER_PORT": "5555"}).coordinator == "node7:5555"
    assert from_environment({**MPIRUN, "MASTER_ADDR": "fe80::1"}).coordinator == f"[fe80::1]:{DEFAULT_COORDINATOR_PORT}"


def test_the_coordinator_variables_in_precedence_order():
    env = {**MPIRUN, "MASTER_ADDR": "m", "MASTER_PORT": "1111"}
    assert from_environment({**env, "SMP_TF_COORDINATOR_PORT": "2222"}).coordinator == "m:2222"
    assert from_environment({**env, "SMP_TF_COORDINATOR": "c:3333"}).coordinator == "c:3333"


def test_mpirun_with_the_addresses_needs_no_coordinator():
    addresses = ["h0:1", "h0:2", "h1:1", "h1:2"]
    info = from_environment({**MPIRUN, "SMP_TF_ADDRESSES": ",".join(addresses)})
    assert info == ClusterInfo(3, 4, 1, 2, tuple(addresses), None, "mpirun")


def test_mpich_and_intel_mpi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h"}
    assert from_environment(env) == ClusterInfo(1, 2, 1, 2, None, f"h:{DEFAULT_COORDINATOR_PORT}", "pmi")


def test_pmi_under_srun_takes_the_local_rank_from_slurm():
    env = {
        "PMI_RANK": "2", "PMI_SIZE": "4", "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]",
        "MASTER_ADDR": "n1",
    }
    info = from_environment(env)
    assert (info.source, info.rank, info.local_rank, info.local_size) == ("pmi", 2, 0, 2)


def test_slurm():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_JOB_NODELIST": "gpu[07-10]",
    }
    info = from_environment(env)
    assert info == ClusterInfo(5, 7, 1, 2, None, f"gpu07:{DEFAULT_COORDINATOR_PORT}", "slurm")
    # The last node runs one task.
    last = from_environment({**env, "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3"})
    assert (last.local_rank, last.local_size) == (0, 1)
    # A uniform count needs no node id; the port and host can be given.
    uniform = {k: v for k, v in env.items() if k not in ("SLURM_TASKS_PER_NODE", "SLURM_NODEID")}
    uniform.update(SLURM_NTASKS_PER_NODE="3", SMP_TF_COORDINATOR_PORT="4000")
    assert from_environment(uniform).local_size == 3
    assert from_environment(uniform).coordinator == "gpu07:4000"
    assert from_environment({**env, "MASTER_ADDR": "head"}).coordinator == f"head:{DEFAULT_COORDINATOR_PORT}"
    # The step's node list is where its task 0 runs.
    assert from_environment({**env, "SLURM_STEP_NODELIST": "gpu[09-10]"}).coordinator.startswith("gpu09:")


@pytest.mark.parametrize(
    "sources, expected",
    [
        (("smp_tf", "tf_config", "mpirun", "pmi", "slurm"), "smp_tf.launch"),
        (("tf_config", "mpirun", "pmi", "slurm"), "TF_CONFIG"),
        (("mpirun", "pmi", "slurm"), "mpirun"),
        (("pmi", "slurm"), "pmi"),
        (("slurm",), "slurm"),
    ],
)
def test_precedence_of_the_sources(sources, expected):
    # Each source describes a different rank so that the winner shows.
    by_source = {
        "smp_tf": launcher_env(1, 2, ["127.0.0.1:20000", "127.0.0.1:20001"]),
        "tf_config": _tf({"worker": ["a:1", "b:1", "c:1"]}, {"type": "worker", "index": 2}),
        "mpirun": {**MPIRUN, "MASTER_ADDR": "m"},
        "pmi": {"PMI_RANK": "4", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "m"},
        "slurm": _srun(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="8"),
    }
    env = {}
    for name in sources:
        env.update(by_source[name])
    assert from_environment(env).source == expected


def test_processes_of_our_launcher_inside_a_slurm_allocation_ignore_slurm():
    # The allocation's variables describe the one batch task, not the
    # processes the launcher started.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    env.update(launcher_env(1, 2, ["127.0.0.1:20000", "127.0.0.1:20001"]))
    assert from_environment(env).rank == 1


# ---------------------------------------------------------------------------
# SLURM lists.


def test_expand_nodelist():
    assert expand_nodelist("node[01-03,07],gpu-a1,rack[1-2]-n[3,5]") == [
        "node01", "node02", "node03", "node07", "gpu-a1",
        "rack1-n3", "rack1-n5", "rack2-n3", "rack2-n5",
    ]
    assert expand_nodelist("single") == ["single"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("n[08-10]") == ["n08", "n09", "n10"]
    assert expand_nodelist("a1 b[2-3]") == ["a1", "b2", "b3"]
    assert expand_nodelist("c[5]") == ["c5"]


@pytest.mark.parametrize(
    "nodelist, reason",
    [
        ("", "names no host"),
        ("n[1-3", "'\\[' without '\\]'"),
        ("n1-3]", "'\\]' without '\\['"),
        ("n[1-[2]]", "nested"),
        ("n[3-1]", "backwards"),
        ("n[a-c]", "not a list of numbers"),
        ("n[1-]", "not a list of numbers"),
    ],
)
def test_expand_nodelist_errors(nodelist, reason):
    with pytest.raises(ValueError, match=f"Cannot expand the SLURM node list {re.escape(repr(nodelist))}: .*{reason}"):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match=r"SLURM_TASKS_PER_NODE must be a list like '2\(x3\),1'.*'2\(3\)'"):
        expand_tasks_per_node("2(3)")


# ---------------------------------------------------------------------------
# Validation: every error names the variable and its value.

_TF_WORKERS = {"worker": ["a:1", "b:1"]}


def _tf(cluster_spec=None, task=None, raw=None):
    if raw is not None:
        return {"TF_CONFIG": raw}
    config = {"cluster": cluster_spec or _TF_WORKERS, "task": task or {"type": "worker", "index": 0}}
    return {"TF_CONFIG": json.dumps(config)}


def _mpi(**changes):
    return {**MPIRUN, "MASTER_ADDR": "m", **changes}


def _srun(**changes):
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n[1-2]"}
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize(
    "env, message",
    [
        # Integers and ranges.
        (launcher_env("x", 2), r"SMP_TF_RANK must be an integer. Received: SMP_TF_RANK='x'"),
        (launcher_env(0, "2.0"), r"SMP_TF_SIZE must be an integer. Received: SMP_TF_SIZE='2.0'"),
        ({"SMP_TF_RANK": "0"}, r"SMP_TF_SIZE is not set, but SMP_TF_RANK is set"),
        ({"SMP_TF_SIZE": "2"}, r"SMP_TF_RANK is not set, but SMP_TF_SIZE is set"),
        (
            launcher_env(2, 2, ["h:1", "h:2"]),
            r"SMP_TF_RANK=2 is not a rank of a job of SMP_TF_SIZE=2 processes: it must be in \[0, 2\)",
        ),
        (launcher_env(-1, 2, ["h:1", "h:2"]), r"SMP_TF_RANK=-1 .* must be in \[0, 2\)"),
        (launcher_env(0, 0), r"must be at least 1. Received: SMP_TF_SIZE=0"),
        (_mpi(OMPI_COMM_WORLD_RANK="4"), r"OMPI_COMM_WORLD_RANK=4 is not a rank of a job of OMPI_COMM_WORLD_SIZE=4"),
        (_mpi(OMPI_COMM_WORLD_LOCAL_RANK="2"), r"OMPI_COMM_WORLD_LOCAL_RANK=2 must be in \[0, 2\)"),
        (_mpi(OMPI_COMM_WORLD_LOCAL_SIZE="5"), r"OMPI_COMM_WORLD_LOCAL_SIZE=5 must be in \[1, 4\]"),
        (
            _mpi(OMPI_COMM_WORLD_LOCAL_RANK="one"),
            r"OMPI_COMM_WORLD_LOCAL_RANK must be an integer. Received: OMPI_COMM_WORLD_LOCAL_RANK='one'",
        ),
        (
            launcher_env(0, 2, ["h:1", "h:2"], SMP_TF_LOCAL_RANK="1", SMP_TF_LOCAL_SIZE="1"),
            r"SMP_TF_LOCAL_RANK=1 must be in \[0, 1\)",
        ),
        (
            launcher_env(0, 2, ["h:1", "h:2"], SMP_TF_LOCAL_RANK="0"),
            r"SMP_TF_LOCAL_RANK is set but SMP_TF_LOCAL_SIZE is not",
        ),
        (
            launcher_env(0, 2, SMP_TF_COORDINATOR="h:1"),
            r"local rank of this process is unknown .*set SMP_TF_LOCAL_RANK and SMP_TF_LOCAL_SIZE",
        ),
        # Addresses.
        (
            launcher_env(0, 2, ["h:1", "h:2", "h:3"]),
            r"SMP_TF_ADDRESSES must list one address per process: SMP_TF_SIZE is 2 but it has 3 entries",
        ),
        (launcher_env(0, 1, ["h:1", "h:2"]), r"SMP_TF_SIZE is 1 but it has 2 entries"),
        (
            launcher_env(0, 2, ["h:1", "h"]),
            r"SMP_TF_ADDRESSES\[1\] must be 'host:port'.*Received: SMP_TF_ADDRESSES\[1\]='h'",
        ),
        (launcher_env(0, 2, ["h:1", "h:0"]), r"the port '0' is not an integer in \[1, 65535\]"),
        (launcher_env(0, 2, ["h:1", "h:99999"]), r"the port '99999' is not an integer"),
        (launcher_env(0, 2, ["h:1", "h:http"]), r"the port 'http' is not an integer"),
        (launcher_env(0, 2, ["h:1", "a b:1"]), r"'a b' is not a host name"),
        (launcher_env(0, 2, ["h:1", "::1:5"]), r"an IPv6 host needs brackets"),
        (launcher_env(0, 2, ["h:1", "h:1"]), r"SMP_TF_ADDRESSES lists the address 'h:1' twice \(entries 0 and 1\)"),
        (
            {"SMP_TF_ADDRESSES": "h:1,h:2"},
            r"SMP_TF_ADDRESSES is set but no launcher variable says which .*set SMP_TF_RANK and SMP_TF_SIZE",
        ),
        # TF_CONFIG.
        (_tf(raw="{cluster"), r"TF_CONFIG is not valid JSON .*Received: TF_CONFIG='\{cluster'"),
        (_tf(raw="[1, 2]"), r"TF_CONFIG holds a JSON list, not an object"),
        (_tf(raw='{"task": {"type": "worker", "index": 0}}'), r"TF_CONFIG has no 'cluster' object"),
        (_tf(raw='{"cluster": {"worker": ["a:1"]}}'), r"TF_CONFIG has no 'task' object"),
        (
            _tf(task={"type": "ps", "index": 0}),
            r"'ps' task: smp_tf runs synchronous data parallelism.*'ps' tasks are not supported",
        ),
        (_tf(task={"type": "evaluator", "index": 0}), r"'evaluator' tasks are not supported"),
        (_tf(cluster_spec={"worker": ["a:1"], "ps": ["p:1"]}), r"has a 'ps' job: .*'ps' tasks are not supported"),
        (_tf(cluster_spec={"worker": ["a:1"], "master": ["m:1"]}), r"unknown job 'master'"),
        (_tf(cluster_spec={"worker": "a:1,b:1"}), r"'worker' job that is not a non-empty list"),
        (_tf(cluster_spec={"chief": ["c:1", "d:1"], "worker": ["a:1"]}), r"has 2 'chief' tasks; at most one"),
        (_tf(task={"type": "driver", "index": 0}), r"task.type='driver'; it must be 'worker' or 'chief'"),
        (_tf(task={"type": "worker", "index": "1"}), r"task.index='1'; it must be an integer"),
        (_tf(task={"type": "worker", "index": 2}), r"task.index=2, but the 'worker' job has 2 tasks"),
        (_tf(cluster_spec={"worker": ["a:1", "a:1"]}), r"lists the address 'a:1' twice"),
        (_tf(cluster_spec={"worker": ["a:1", "b"]}), r"TF_CONFIG's cluster addresses\[1\] must be 'host:port'"),
        # Sources that disagree.
        ({**_tf(), "SMP_TF_ADDRESSES": "a:1,c:1"}, r"SMP_TF_ADDRESSES and TF_CONFIG's cluster addresses disagree"),
        # Coordinators.
        (dict(MPIRUN), r"no coordinator is known: set MASTER_ADDR .*mpirun -x MASTER_ADDR=<host of rank 0>"),
        (
            {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
            r"mpiexec -genv MASTER_ADDR <host of rank 0>",
        ),
        (_mpi(MASTER_PORT="x"), r"MASTER_PORT must be an integer. Received: MASTER_PORT='x'"),
        (_mpi(MASTER_PORT="70000"), r"MASTER_PORT must be a port in \[1, 65535\]. Received: MASTER_PORT='70000'"),
        (_mpi(MASTER_ADDR="m:29400"), r"MASTER_ADDR must be the host .* without a port .*Received: MASTER_ADDR='m:29400'"),
        (_mpi(SMP_TF_COORDINATOR="m"), r"SMP_TF_COORDINATOR must be 'host:port'.*Received: SMP_TF_COORDINATOR='m'"),
        # SLURM.
        (_srun(), r"neither SLURM_NTASKS_PER_NODE nor SLURM_TASKS_PER_NODE is set"),
        (
            _srun(SLURM_TASKS_PER_NODE="2,1"),
            r"SLURM_NODEID is not set, but SLURM_TASKS_PER_NODE='2,1' differs between nodes",
        ),
        (
            _srun(SLURM_TASKS_PER_NODE="2,1", SLURM_NODEID="2"),
            r"SLURM_NODEID=2 is not a node of SLURM_TASKS_PER_NODE='2,1'",
        ),
        (_srun(SLURM_NTASKS_PER_NODE="3", SLURM_NODELIST="n[1-"), r"Cannot expand the SLURM node list 'n\[1-'"),
        (_srun(SLURM_NTASKS=None), r"SLURM_NTASKS is not set"),
    ],
)
def test_validation_errors(env, message):
    with pytest.raises(ValueError, match=message):
        from_environment(env)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=2, size=2), r"ClusterInfo.rank must be in \[0, size=2\). Received: rank=2"),
        (dict(size=0), r"ClusterInfo.size must be at least 1"),
        (dict(rank=True), r"ClusterInfo.rank must be an integer"),
        (dict(local_rank=1, local_size=1), r"ClusterInfo.local_rank must be in \[0, local_size=1\)"),
        (dict(local_size=3), r"ClusterInfo.local_size must be in \[1, size=2\]"),
        (dict(source="k8s"), r"ClusterInfo.source must be one of .*Received: source='k8s'"),
        (dict(addresses=("h:1",)), r"ClusterInfo.addresses must list one address per process"),
        (dict(coordinator="h:1", addresses=("h:1", "h:2")), r"needs exactly one of `addresses`"),
        (dict(coordinator=None), r"needs exactly one of `addresses`"),
        (dict(coordinator="nope"), r"ClusterInfo.coordinator must be 'host:port'"),
    ],
)
def test_cluster_info_validates_its_fields(kwargs, message):
    fields = dict(rank=0, size=2, local_rank=0, local_size=1, addresses=None, coordinator="h:1", source="mpirun")
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ClusterInfo(**fields)


def test_parse_address():
    assert parse_address("node-1.example.com:20000") == ("node-1.example.com", 20000)
    assert parse_address("[::1]:8") == ("::1", 8)
    with pytest.raises(ValueError, match=r"Received: address=':80'"):
        parse_address(":80")


# ---------------------------------------------------------------------------
# Free ports.


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def test_pick_free_ports_gives_bindable_consecutive_ports_below_the_ephemeral_range():
    ephemeral_low, _ = cluster._ephemeral_range()
    for n in (1, 4):
        ports = pick_free_ports(n)
        assert ports == list(range(ports[0], ports[0] + n))
        assert 20000 <= ports[0] and ports[-1] < ephemeral_low
        assert all(_bindable(p) for p in ports)


def test_pick_free_ports_skips_a_port_in_use(monkeypatch):
    # Confine the choice to three ports and hold the first: the only free
    # block of two is the other two.
    base = pick_free_ports(3)[0]
    with socket.socket() as held:
        held.bind(("", base))
        held.listen()
        monkeypatch.setattr(cluster, "_port_windows", lambda n: [(base, base + 3)])
        for _ in range(5):
            assert pick_free_ports(2) == [base + 1, base + 2]
        with pytest.raises(OSError, match=r"No block of 3 consecutive free ports found .* after 10 random tries"):
            pick_free_ports(3, attempts=10)


def test_pick_free_ports_is_not_tied_to_the_seeded_random_module():
    import random

    # Processes seeded alike (Keras's set_random_seed seeds `random`) must not
    # pick the same blocks; 5 picks agreeing by chance has odds ~1e-20.
    random.seed(0)
    first = [pick_free_ports(1)[0] for _ in range(5)]
    random.seed(0)
    assert [pick_free_ports(1)[0] for _ in range(5)] != first


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_pick_free_ports_needs_a_positive_count(n):
    with pytest.raises(ValueError, match="pick_free_ports needs a positive number of ports"):
        pick_free_ports(n)


# ---------------------------------------------------------------------------
# Rendezvous.


def _coordinator():
    return f"127.0.0.1:{pick_free_ports(1)[0]}"


def _info(rank, size, coordinator, source="mpirun"):
    return ClusterInfo(rank, size, rank, size, None, coordinator, source)


class _Rank(threading.Thread):
    """Runs `exchange_addresses` for one rank; keeps its result or error."""

    def __init__(self, info, address, timeout):
        super().__init__(daemon=True)
        self.args = (info, address, timeout)
        self.result = self.error = None

    def run(self):
        try:
            self.result = exchange_addresses(*self.args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def finish(self, within=30.0):
        self.join(within)
        assert not self.is_alive(), "exchange_addresses did not return in time"
        return self


def _assert_error(error, kind, pattern):
    assert isinstance(error, kind), f"expected {kind.__name__}, got {error!r}"
    assert re.search(pattern, str(error)), f"{pattern!r} not in {str(error)!r}"


def _run_ranks(specs, start_delay=None):
    """Starts one thread per (info, address, timeout); rank 0 last, after `start_delay`."""
    ranks = [_Rank(*spec) for spec in specs]
    for r in ranks[1:]:
        r.start()
    if start_delay:
        time.sleep(start_delay)
    ranks[0].start()
    return [r.finish() for r in ranks]


def test_rendezvous_of_three_ranks():
    coordinator = _coordinator()
    addresses = ("127.0.0.1:21000", "127.0.0.1:21001", "127.0.0.1:21002")
    # The other ranks start first and retry until rank 0 listens.
    ranks = _run_ranks([(_info(r, 3, coordinator), addresses[r], 10.0) for r in range(3)], start_delay=0.3)
    assert [r.error for r in ranks] == [None, None, None]
    assert [r.result for r in ranks] == [addresses] * 3


def test_rendezvous_in_three_processes_from_the_environment(tmp_path):
    # mpirun-like variables, as each process would see them.
    port = pick_free_ports(1)[0]
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import json, os
        from smp_tf.distributed.cluster import from_environment
        from smp_tf.distributed.rendezvous import exchange_addresses, my_host
        info = from_environment()
        me = f"{my_host()}:{22000 + info.rank}"
        print(json.dumps([info.rank, info.coordinator, exchange_addresses(info, me, timeout=20)]))
    """))
    procs = []
    for rank in range(3):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SMP_TF_", "OMPI_", "PMI_", "SLURM_"))}
        env.update(
            OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="3", OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SMP_TF_HOST="127.0.0.1",
        )
        env.pop("TF_CONFIG", None)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    expected = [f"127.0.0.1:{22000 + r}" for r in range(3)]
    assert outputs == [[r, f"127.0.0.1:{port}", expected] for r in range(3)]


def test_rendezvous_timeout_names_the_missing_rank():
    coordinator = _coordinator()
    ranks = _run_ranks([(_info(r, 3, coordinator), f"127.0.0.1:{21000 + r}", 1.0) for r in range(2)])
    message = (
        rf"^rank 0 waited 1 s for ranks \[2\] at {coordinator}; check that every process "
        "started and that the coordinator address is reachable"
    )
    _assert_error(ranks[0].error, TimeoutError, message)
    # Rank 1 learns from rank 0 which rank is missing.
    _assert_error(ranks[1].error, TimeoutError, message)


def test_rendezvous_timeout_hint_under_slurm():
    coordinator = _coordinator()
    with pytest.raises(TimeoutError, match=r"for ranks \[1\] .*start every process with srun"):
        exchange_addresses(_info(0, 2, coordinator, source="slurm"), "127.0.0.1:21000", 0.5)


def test_rendezvous_without_rank_0_times_out_naming_the_coordinator():
    coordinator = _coordinator()
    start = time.monotonic()
    message = rf"rank 1 could not reach the coordinator \(rank 0\) at {coordinator} within 0.5 s"
    with pytest.raises(TimeoutError, match=message):
        exchange_addresses(_info(1, 2, coordinator), "127.0.0.1:21001", 0.5)
    assert time.monotonic() - start < 5


def test_rendezvous_coordinator_port_in_use():
    coordinator = _coordinator()
    port = parse_address(coordinator)[1]
    with socket.socket() as held:
        held.bind(("", port))
        held.listen()
        message = rf"Rank 0 cannot listen on port {port} of the coordinator {coordinator}"
        with pytest.raises(OSError, match=message) as caught:
            exchange_addresses(_info(0, 2, coordinator), "127.0.0.1:21000", 5.0)
    assert caught.value.errno == errno.EADDRINUSE


@pytest.mark.parametrize(
    "rank1, rank2, message",
    [
        # (rank, size, address) of the two other processes.
        (
            (1, 4, "127.0.0.1:21001"),
            None,
            r"The processes disagree on their number: rank 1 .* for 4 processes but rank 0 for 3",
        ),
        ((1, 3, "127.0.0.1:21001"), (1, 3, "127.0.0.1:21009"), r"Two processes say they are rank 1"),
        ((1, 3, "127.0.0.1:21000"), None, r"Ranks 0 and 1 both give the address '127.0.0.1:21000'"),
    ],
)
def test_rendezvous_rejects_inconsistent_ranks(rank1, rank2, message):
    coordinator = _coordinator()
    specs = [(_info(0, 3, coordinator), "127.0.0.1:21000", 10.0)]
    for rank, size, address in filter(None, (rank1, rank2)):
        specs.append((_info(rank, size, coordinator), address, 10.0))
    ranks = _run_ranks(specs, start_delay=0.2)
    # Every rank fails with rank 0's message (one of the two duplicates may
    # have come second and be the one rank 0 names).
    for r in ranks:
        _assert_error(r.error, ValueError, message)


def test_rendezvous_is_not_needed_with_addresses_or_one_process():
    info = ClusterInfo(1, 2, 1, 2, ("a:1", "b:1"), None, "smp_tf.launch")
    assert exchange_addresses(info, "b:1", 1.0) == ("a:1", "b:1")
    assert exchange_addresses(SINGLE, "h:5", 1.0) == ("h:5",)
    with pytest.raises(ValueError, match="must be 'host:port'"):
        exchange_addresses(_info(1, 2, "h:1"), "no-port", 1.0)


def test_my_host():
    assert my_host({"SMP_TF_HOST": "127.0.0.1"}) == "127.0.0.1"
    host = my_host({})
    assert host and parse_address(f"{host}:1")


def _raw_registration(coordinator, rank, size, address):
    """A connection that registers like a rank but never reads the answer."""
    host, port = parse_address(coordinator)
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0 did not listen"
            time.sleep(0.02)
    conn.sendall(json.dumps({"rank": rank, "size": size, "address": address}).encode() + b"\n")
    return conn


def test_rendezvous_forgets_a_rank_that_left_and_takes_its_new_connection():
    coordinator = _coordinator()
    rank0 = _Rank(_info(0, 3, coordinator), "127.0.0.1:21000", 10.0)
    rank0.start()
    # Rank 1 registers and goes away: rank 0 must not count it.
    _raw_registration(coordinator, 1, 3, "127.0.0.1:21001").close()
    # Rank 2 registers, then registers again on a new connection (as after
    # a connection loss); the new one gets the answer.
    stale = _raw_registration(coordinator, 2, 3, "127.0.0.1:21002")
    time.sleep(0.2)
    rank2 = _Rank(_info(2, 3, coordinator), "127.0.0.1:21002", 10.0)
    rank2.start()
    time.sleep(0.2)
    assert rank0.is_alive(), "rank 0 finished without rank 1"
    rank1 = _Rank(_info(1, 3, coordinator), "127.0.0.1:21001", 10.0)
    rank1.start()
    expected = ("127.0.0.1:21000", "127.0.0.1:21001", "127.0.0.1:21002")
    assert [r.finish().result for r in (rank0, rank1, rank2)] == [expected] * 3
    stale.settimeout(5)
    assert stale.recv(100) == b""  # closed by rank 0 without an answer
    stale.close()


def test_stray_connections_do_not_disturb_the_rendezvous():
    coordinator = _coordinator()
    rank0 = _Rank(_info(0, 2, coordinator), "127.0.0.1:21000", 10.0)
    rank0.start()
    stray = _raw_registration(coordinator, 1, 2, "x")  # not an address
    stray.settimeout(5)
    assert b"not an smp_tf rendezvous registration" in stray.recv(1000)
    stray.close()
    result = exchange_addresses(_info(1, 2, coordinator), "127.0.0.1:21001", 10.0)
    assert result == rank0.finish().result == ("127.0.0.1:21000", "127.0.0.1:21001")


def test_cluster_rendezvous_and_launcher_import_without_tensorflow():
    code = (
        "import sys\n"
        "import smp_tf.launch, smp_tf.distributed.cluster, smp_tf.distributed.rendezvous\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
