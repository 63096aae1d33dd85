"""Data parallelism across processes: 2 replicas x (2 partitions, 4 micro-batches).

The tests start 2 processes on 127.0.0.1 (tests/dp/worker.py, one scenario
per job; a job that several tests read runs once, `tests.jobs.once`), bound
every wait, and end only the processes they started. The references are
single-process runs in this process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import keras
import numpy as np
import pytest

import smp_tf as smp
from smp_tf.distributed import runtime
from tests import jobs
from tests.dp import common

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("data_parallel")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dp", "worker.py")
RTOL = 1e-5
ATOL = 1e-5


def _free_ports(n: int) -> List[int]:
    from smp_tf.distributed.cluster import pick_free_ports

    return pick_free_ports(n, "127.0.0.1")


def run_replicas(scenario: str, out, timeout: float = 180.0, wait_for: Optional[List[int]] = None,
                 extra_env: Optional[Dict[str, str]] = None):
    """Runs the 2 replicas of `scenario`; returns (exit codes, outputs, seconds).

    Waits (bounded) for the ranks in `wait_for` (default: all), then ends
    every process it started that is still running.
    """
    addresses = ",".join(f"127.0.0.1:{p}" for p in _free_ports(2))
    procs = []
    for r in range(2):
        env = dict(os.environ, SMP_TF_RANK=str(r), SMP_TF_SIZE="2", SMP_TF_LOCAL_RANK=str(r),
                   SMP_TF_LOCAL_SIZE="2", SMP_TF_ADDRESSES=addresses, PYTHONPATH=ROOT,
                   PYTHONFAULTHANDLER="1", **(extra_env or {}))  # a crash prints every thread's stack
        procs.append(subprocess.Popen([sys.executable, WORKER, scenario, str(out)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    codes: List[Optional[int]] = [None, None]
    try:
        for r in (wait_for if wait_for is not None else [0, 1]):
            codes[r] = procs[r].wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    finally:
        seconds = time.monotonic() - start
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate(timeout=30)[0] for p in procs]
        codes = [p.returncode if c is None else c for p, c in zip(procs, codes)]
    return codes, outputs, seconds


def results(out) -> List[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def assert_same_weights(a, b, atol=0.0):
    for u, v in zip(a, b):
        np.testing.assert_allclose(np.array(u), np.array(v), rtol=0, atol=atol)


# --------------------------------------------------------------------------
# single-process references
# --------------------------------------------------------------------------
def reference(batches, epoch_loss_rows=None):
    """One process on 2 partitions from rank 0's initial weights: a step per
    batch (rows given), SGD. Returns (per-step losses, weights)."""
    smp.init({"partitions": 2, "microbatches": 4})
    model = common.build(seed=100)
    optimizer = keras.optimizers.SGD(common.LR)

    train = common.train_function(model, optimizer)
    losses = [float(train(x, y)) for x, y in batches]
    return losses, [v.numpy() for v in model.trainable_variables]


def _launched_custom_loops(tmp_path_factory):
    """``python -m smp_tf.launch -n 2`` running the custom loop, then the same
    loop with virtual_stages=2 (one job for three tests): (the launcher's
    completed process, the output directory)."""
    def start():
        out = tmp_path_factory.mktemp("custom_loops")
        proc = subprocess.run(
            [sys.executable, "-m", "smp_tf.launch", "-n", "2", "--timeout", "170", WORKER, "custom_loops", str(out)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=200,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc, out

    return jobs.once("dp/custom_loops", start)


def _assert_matches_whole_batch(a: dict, b: dict) -> None:
    """Two replicas' 5 steps on their halves against one process on the whole batches."""
    assert_same_weights(a["weights"], b["weights"])  # identical replicas
    x, y = common.batches(5)
    losses, weights = reference([(x[s], y[s]) for s in range(5)])
    # Each replica's loss is the mean over its half; their mean is the whole batch's.
    np.testing.assert_allclose(np.add(a["losses"], b["losses"]) / 2, losses, rtol=RTOL)
    for w, r in zip(a["weights"], weights):
        np.testing.assert_allclose(np.array(w), r, rtol=RTOL, atol=ATOL)


def test_custom_loop_matches_one_process_with_the_whole_batch(tmp_path_factory):
    _, out = _launched_custom_loops(tmp_path_factory)
    a, b = results(out)
    assert (a["rank"], a["size"], a["dp_rank"], a["dp_size"], a["mp_rank"], a["mp_size"]) == (0, 2, 0, 2, 0, 2)
    assert (b["rank"], b["dp_rank"], b["local_rank"]) == (1, 1, 1)
    # Each partition on its own device of its replica's process.
    assert a["devices"] == [f"/job:worker/replica:0/task:0/device:CPU:{p}" for p in (0, 1)]
    assert b["devices"] == [f"/job:worker/replica:0/task:1/device:CPU:{p}" for p in (0, 1)]
    _assert_matches_whole_batch(a, b)


def test_virtual_stages_under_data_parallelism_match_one_process(tmp_path_factory):
    """Each replica's 2 devices hold 2 chunks each; gradients are averaged
    per partition."""
    _, out = _launched_custom_loops(tmp_path_factory)
    a, b = (r["virtual_stages_run"] for r in results(out))
    assert (a["virtual_stages"], a["pipeline"]) == (b["virtual_stages"], b["pipeline"]) == (2, "interleaved")
    assert a["devices"] == [f"/job:worker/replica:0/task:0/device:CPU:{p}" for p in (0, 1)]
    _assert_matches_whole_batch(a, b)


def test_zero_bubble_set_through_the_environment_under_data_parallelism_matches_one_process(tmp_path):
    """The zero_bubble schedule, chosen by the environment override
    (SM_HP_MP_PARAMETERS) on every replica."""
    codes, outputs, _ = run_replicas("custom_loop", tmp_path,
                                     extra_env={"SM_HP_MP_PARAMETERS": json.dumps({"pipeline": "zero_bubble"})})
    assert codes == [0, 0], outputs
    a, b = results(tmp_path)
    assert (a["virtual_stages"], a["pipeline"]) == (b["virtual_stages"], b["pipeline"]) == (1, "zero_bubble")
    assert a["devices"] == [f"/job:worker/replica:0/task:0/device:CPU:{p}" for p in (0, 1)]
    _assert_matches_whole_batch(a, b)


def test_tensor_parallelism_under_data_parallelism_matches_one_process(tmp_path):
    """Each replica's 2 partitions split over 2 devices each (4 per
    process): its Dense pairs run column- and row-parallel, and the
    replicas' averaged steps match one process within float32 rounding."""
    codes, outputs, _ = run_replicas("custom_loop", tmp_path,
                                     extra_env={"SM_HP_MP_PARAMETERS": json.dumps({"tensor_parallel_degree": 2})})
    assert codes == [0, 0], outputs
    a, b = results(tmp_path)
    # Partition p on devices 2p and 2p + 1 of its replica's process.
    assert a["devices"] == [f"/job:worker/replica:0/task:0/device:CPU:{p}" for p in (0, 2)]
    assert b["devices"] == [f"/job:worker/replica:0/task:1/device:CPU:{p}" for p in (0, 2)]
    # A split variable's gradient is all-reduced in its pieces, each on its
    # own device of the stage: no device gathers it whole.
    assert a["reduce_devices"] == b["reduce_devices"] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    _assert_matches_whole_batch(a, b)


def _replicas_once(scenario: str, tmp_path_factory) -> List[dict]:
    """Both replicas' results of `scenario`, run once for the tests that read it."""
    def start():
        out = tmp_path_factory.mktemp(scenario)
        codes, outputs, _ = run_replicas(scenario, out)
        assert codes == [0, 0], outputs
        return results(out)

    return jobs.once(f"dp/{scenario}", start)


def test_fit_with_sharded_global_batches_matches_one_process(tmp_path_factory):
    a, b = _replicas_once("comm_fit", tmp_path_factory)  # the helpers, then fit
    assert_same_weights(a["weights"], b["weights"])
    assert a["losses"] == b["losses"]  # the epoch's logs describe the global data
    smp.init({"partitions": 2, "microbatches": 4})
    model = common.build(seed=100)
    model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    x, y = common.batches(5)
    history = model.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=1,
                        shuffle=False, verbose=0)
    np.testing.assert_allclose(a["losses"], history.history["loss"], rtol=RTOL)
    for w, v in zip(a["weights"], model.trainable_variables):
        np.testing.assert_allclose(np.array(w), v.numpy(), rtol=RTOL, atol=ATOL)


def _uneven_reference():
    """Replica 0 has 5 batches, replica 1 has 7: 5 steps average both, the
    last 2 are replica 1's alone."""
    x, y = common.batches(7)
    batches = [(x[s], y[s]) for s in range(5)] + [common.half(x[s], y[s], 1) for s in (5, 6)]
    return reference(batches)


@pytest.mark.parametrize("scenario", ["uneven", "uneven_fit"], ids=["custom_loop", "fit"])
def test_uneven_inputs_join(scenario, tmp_path_factory):
    # One job runs both: the custom loop, then fit.
    a, b = (r[scenario] for r in _replicas_once("uneven_both", tmp_path_factory))
    if scenario == "uneven":  # smp.join reports what it did
        assert (a["joined_steps"], b["joined_steps"]) == (2, 0)
    else:  # the epoch's logs describe the global data
        assert a["losses"] == b["losses"]
    assert_same_weights(a["weights"], b["weights"])
    _, weights = _uneven_reference()
    for w, r in zip(a["weights"], weights):
        np.testing.assert_allclose(np.array(w), r, rtol=RTOL, atol=ATOL)


def test_uneven_inputs_raise_on_every_replica(tmp_path):
    codes, outputs, seconds = run_replicas("uneven_raise", tmp_path, timeout=120)
    assert codes[0] != 0 and codes[1] != 0, outputs
    # Rank 0 counts the replicas still running, unless rank 1's check
    # stopped the collectives first: then it cannot count them.
    assert re.search(r"rank 0 ran out of data while (1|other) replica\(s\) still had data", outputs[0]), outputs[0]
    assert "ran out of data" in outputs[1]
    assert seconds < 120


def test_a_killed_replica_stops_the_other_with_an_error_naming_it(tmp_path):
    codes, outputs, seconds = run_replicas("killed", tmp_path, timeout=120, wait_for=[0])
    assert codes[1] == -9 and codes[0] != 0, outputs
    error = results_of_rank(tmp_path, 0)["error"]
    assert "task:1" in error, error  # TensorFlow's name of rank 1
    assert seconds < 90


def test_a_stalled_replica_stops_the_other_within_the_timeout(tmp_path):
    # Rank 1 stays alive but never starts step 4 (heartbeats keep coming):
    # the watchdog of rank 0 stops it after dp_timeout (8 s).
    codes, outputs, seconds = run_replicas("stalled", tmp_path, timeout=120, wait_for=[0])
    assert codes[0] != 0, outputs
    result = results_of_rank(tmp_path, 0)
    assert "rank(s) [1] have not started it" in result["error"], result["error"][-2000:]
    assert result["seconds_after_stop"] < 8.0 + 30.0
    assert seconds < 90


def results_of_rank(out, rank: int) -> dict:
    return json.load(open(os.path.join(out, f"rank{rank}.json")))


def test_comm_helpers(tmp_path_factory):
    a, b = _replicas_once("comm_fit", tmp_path_factory)  # the helpers, then fit
    assert a["allgather"] == b["allgather"] == [{"rank": 0, "square": 0}, {"rank": 1, "square": 1}]
    assert b["broadcast"] == {"from": 0, "payload": [0, 1, 2, 3, 4]}
    assert b["received"] == "to one" and a["received"] == ["back", 1]
    assert a["self"] == b["self"] == "to myself"


def test_launcher_runs_the_replicas(tmp_path_factory):
    proc, out = _launched_custom_loops(tmp_path_factory)
    assert "[rank 0] rank 0: custom_loops done" in proc.stdout
    assert "[rank 1] rank 1: custom_loops done" in proc.stdout
    a, b = results(out)
    assert_same_weights(a["weights"], b["weights"])


def _init_in_subprocess(env: Dict[str, str], before: str = "") -> subprocess.CompletedProcess:
    code = before + "import smp_tf as smp; smp.init({'partitions': 2, 'horovod': True, 'dp_timeout': 10})"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, **env),
                          capture_output=True, text=True, timeout=120)


def test_bad_cluster_environment_is_a_clear_error_before_training():
    proc = _init_in_subprocess({"SMP_TF_RANK": "0", "SMP_TF_SIZE": "3", "SMP_TF_LOCAL_RANK": "0",
                                "SMP_TF_LOCAL_SIZE": "3", "SMP_TF_ADDRESSES": "127.0.0.1:20001,127.0.0.1:20002"})
    assert proc.returncode != 0
    assert "SMP_TF_ADDRESSES" in proc.stderr and "3" in proc.stderr


def test_port_in_use_is_a_clear_error():
    port, other = _free_ports(2)
    with socket.socket() as s:
        s.bind(("", port))
        s.listen()
        proc = _init_in_subprocess({"SMP_TF_RANK": "0", "SMP_TF_SIZE": "2", "SMP_TF_LOCAL_RANK": "0",
                                    "SMP_TF_LOCAL_SIZE": "2",
                                    "SMP_TF_ADDRESSES": f"127.0.0.1:{port},127.0.0.1:{other}"})
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in proc.stderr, proc.stderr[-2000:]


def test_a_rank_that_never_starts_is_an_error_at_start_up():
    """Rank 0 of two, started alone, stops with an error naming the cluster
    once the join timeout is over (shortened here), on TensorFlow releases
    with the coordination service's register barrier and on those without."""
    port, other = _free_ports(2)
    t0 = time.monotonic()
    proc = _init_in_subprocess(
        {"SMP_TF_RANK": "0", "SMP_TF_SIZE": "2", "SMP_TF_LOCAL_RANK": "0", "SMP_TF_LOCAL_SIZE": "2",
         "SMP_TF_ADDRESSES": f"127.0.0.1:{port},127.0.0.1:{other}"},
        before="import smp_tf.distributed.runtime as r; r.JOIN_TIMEOUT_MIN_S = 5.0; ",
    )
    seconds = time.monotonic() - t0
    assert proc.returncode != 0
    if runtime.has_register_barrier():
        assert "rank 0 waited 10 s for every rank to join the cluster" in proc.stderr, proc.stderr[-2000:]
        assert f"127.0.0.1:{other}" in proc.stderr and "missing: [1]" in proc.stderr
    else:  # TensorFlow 2.17 and 2.18: the interpreter is held, faulthandler's timer ends the process
        assert "Timeout" in proc.stderr and "_wait_for_every_rank_to_join_the_cluster" in proc.stderr, \
            proc.stderr[-2000:]
        assert "cannot name a rank that never joins; rank 0 waits up to 20 s for every rank of" in proc.stderr
        assert f"127.0.0.1:{other}" in proc.stderr
    assert seconds < 90, seconds
