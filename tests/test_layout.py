"""Which process holds which stage of which replica (`smp_tf.distributed.layout`, pure)."""

from __future__ import annotations

import pytest

from smp_tf.distributed.layout import PipelineLayout


def test_one_pipeline_over_two_processes():
    layout = PipelineLayout(size=2, partitions=4, pipeline_processes=2)
    assert layout.replicas == 1 and layout.partitions_per_process == 2
    assert [layout.stages(r) for r in range(2)] == [(0, 1), (2, 3)]
    assert layout.placement(0) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.driver(0) == 0 and layout.is_driver(0) and not layout.is_driver(1)
    assert [layout.pp_rank(r) for r in range(2)] == [0, 1]
    assert [layout.dp_rank(r) for r in range(2)] == [0, 0]


def test_cluster_keeps_a_replica_on_neighbouring_ranks():
    # 2 replicas x 2 processes: ranks 0, 1 are replica 0; ranks 2, 3 replica 1.
    layout = PipelineLayout(size=4, partitions=2, pipeline_processes=2, strategy="cluster")
    assert layout.pipeline(0) == (0, 1) and layout.pipeline(1) == (2, 3)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.pp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.driver(r) for r in range(2)] == [0, 2]
    # The replicas of each stage, whose gradients are all-reduced together.
    assert layout.stage_ranks(0) == (0, 2) and layout.stage_ranks(1) == (1, 3)


def test_spread_keeps_the_replicas_of_a_stage_on_neighbouring_ranks():
    layout = PipelineLayout(size=4, partitions=2, pipeline_processes=2, strategy="spread")
    assert layout.pipeline(0) == (0, 2) and layout.pipeline(1) == (1, 3)
    assert [layout.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.stage_ranks(0) == (0, 1) and layout.stage_ranks(1) == (2, 3)
    assert layout.placement(1) == [(1, 0), (3, 0)]


@pytest.mark.parametrize("strategy", ["cluster", "spread"])
def test_every_stage_of_every_replica_has_exactly_one_place(strategy):
    layout = PipelineLayout(size=6, partitions=6, pipeline_processes=3, strategy=strategy)
    places = {(r, i) for replica in range(layout.replicas) for r, i in layout.placement(replica)}
    assert len(places) == layout.replicas * layout.partitions == 12
    for rank in range(6):
        replica, j = layout.dp_rank(rank), layout.pp_rank(rank)
        assert layout.rank(replica, j) == rank
        assert [p for p, (r, _) in enumerate(layout.placement(replica)) if r == rank] == list(layout.stages(rank))


def test_a_single_process_pipeline_is_data_parallelism_as_before():
    layout = PipelineLayout(size=3, partitions=2)
    assert layout.replicas == 3 and [layout.dp_rank(r) for r in range(3)] == [0, 1, 2]
    assert all(layout.is_driver(r) and layout.stages(r) == (0, 1) for r in range(3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(size=3, partitions=2, pipeline_processes=2), "does not divide the 3 processes"),
        (dict(size=2, partitions=3, pipeline_processes=2), "partitions=3 cannot be shared evenly"),
        (dict(size=0, partitions=2), "size must be a positive integer"),
        (dict(size=2, partitions=2, pipeline_processes=True), "pipeline_processes must be a positive integer"),
        (dict(size=2, partitions=2, strategy="ring"), "placement_strategy must be one of"),
    ],
)
def test_bad_layouts_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineLayout(**kwargs)


def test_out_of_range_queries_name_the_value():
    layout = PipelineLayout(size=2, partitions=2, pipeline_processes=2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\). Received: rank=2"):
        layout.stages(2)
    with pytest.raises(ValueError, match="replica must be in"):
        layout.driver(1)
    with pytest.raises(ValueError, match="partition must be in"):
        layout.stage_ranks(5)


def test_intra_op_threads_share_the_host_among_its_stage_processes():
    from smp_tf.distributed.remote import intra_op_threads

    # Several logical devices in one process: one core each.
    assert intra_op_threads(num_devices=2, local_size=2, cpus=16, cpus_on_host=16) == 1
    # One device per process: the host's cores shared among its processes.
    assert intra_op_threads(num_devices=1, local_size=2, cpus=16, cpus_on_host=16) == 8
    assert intra_op_threads(num_devices=1, local_size=4, cpus=2, cpus_on_host=2) == 1
    # A process bound to fewer cores keeps them; alone on its host, all of them.
    assert intra_op_threads(num_devices=1, local_size=2, cpus=1, cpus_on_host=2) is None
    assert intra_op_threads(num_devices=1, local_size=1, cpus=16, cpus_on_host=16) is None


def test_idle_threads_spin_only_while_each_has_a_core():
    from smp_tf.distributed.remote import spin_idle_threads

    # Alone on a host of 16 cores, 16 threads: one core each.
    assert spin_idle_threads(threads=16, local_size=1, cpus=16, cpus_on_host=16)
    # Two processes on that host: 8 cores each, fewer than their threads.
    assert not spin_idle_threads(threads=16, local_size=2, cpus=16, cpus_on_host=16)
    assert spin_idle_threads(threads=8, local_size=2, cpus=16, cpus_on_host=16)
    # Bound to one core (taskset, a batch system), whatever the host has.
    assert not spin_idle_threads(threads=9, local_size=1, cpus=1, cpus_on_host=16)
    # Two stage processes on two cores, each with one device and 8 spares.
    assert not spin_idle_threads(threads=9, local_size=2, cpus=2, cpus_on_host=2)


def test_stage_processes_sharing_cores_do_not_spin(monkeypatch):
    import os

    from smp_tf.distributed import remote

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    config = remote._session_config("CPU", 1, logical_cpu=True, local_size=2)
    assert config.experimental.disable_thread_spinning
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    config = remote._session_config("CPU", 1, logical_cpu=True, local_size=1)
    assert config.inter_op_parallelism_threads <= 64
    assert not config.experimental.disable_thread_spinning
