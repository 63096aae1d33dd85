"""One pipeline across 2 processes (``pipeline_processes=2``) equals the same
layout in one process, bit for bit.

Each test starts 2 processes on 127.0.0.1 (tests/pp/worker.py): rank 0
drives the pipeline, rank 1 serves its stages. Every wait is bounded, and
only the processes a test started are ended. The references run in this
process, on its logical CPU devices.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import List, Optional

import keras
import numpy as np
import pytest

import smp_tf as smp
from tests.dp import common

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("pipeline_processes")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "pp", "worker.py")


def run_pipeline(args: List[str], out, timeout: float = 240.0, then=None):
    """Runs the 2 processes of one pipeline; returns (exit codes, outputs).

    `then(procs)`, if given, runs once the processes are started (it may
    signal them); the timeout covers it."""
    from smp_tf.distributed.cluster import pick_free_ports

    addresses = ",".join(f"127.0.0.1:{p}" for p in pick_free_ports(2, "127.0.0.1"))
    procs = []
    for r in range(2):
        env = dict(os.environ, SMP_TF_RANK=str(r), SMP_TF_SIZE="2", SMP_TF_LOCAL_RANK=str(r),
                   SMP_TF_LOCAL_SIZE="2", SMP_TF_ADDRESSES=addresses, PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, WORKER, *args[:1], str(out), *args[1:]], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    codes: List[Optional[int]] = [None, None]
    try:
        if then is not None:
            then(procs, start)
        for r in range(2):
            codes[r] = procs[r].wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate(timeout=30)[0] for p in procs]
        codes = [p.returncode if c is None else c for p, c in zip(procs, codes)]
    return codes, outputs


def _driver_result(args, tmp_path) -> dict:
    codes, outputs = run_pipeline(args, tmp_path)
    assert codes == [0, 0], f"exit codes {codes}\n--- rank 0:\n{outputs[0][-3000:]}\n--- rank 1:\n{outputs[1][-3000:]}"
    assert not os.path.exists(os.path.join(tmp_path, "rank1.json")), "rank 1 ran the program past smp.init"
    return json.load(open(os.path.join(tmp_path, "rank0.json")))


def _reference_custom_loop(partitions: int, pipeline: str):
    smp.init({"partitions": partitions, "microbatches": 4, "pipeline": pipeline})
    model = common.build(seed=100)
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    x, y = common.batches(3)
    losses = [float(train(x[s], y[s])) for s in range(3)]
    return losses, [v.numpy() for v in model.trainable_variables]


@pytest.mark.parametrize("partitions, pipeline", [(2, "interleaved"), (4, "interleaved"), (4, "simple")])
def test_custom_loop_across_processes_equals_one_process(tmp_path, partitions, pipeline):
    got = _driver_result(["custom_loop", str(partitions), pipeline], tmp_path)
    losses, weights = _reference_custom_loop(partitions, pipeline)
    assert got["losses"] == losses
    for a, b in zip(got["weights"], weights):
        np.testing.assert_array_equal(np.array(a, dtype=np.float32), b)
    # Ranks: one pipeline over both processes, driven by rank 0.
    assert (got["rank"], got["size"], got["dp_rank"], got["dp_size"], got["pp_rank"], got["mp_size"]) == (
        0, 2, 0, 1, 0, partitions)
    assert got["local_partitions"] == list(range(partitions // 2))
    # Every variable lives on the server of the process that holds its stage.
    tasks = {d.split("/task:")[1].split("/")[0] for d in got["devices"]}
    assert tasks == {"0", "1"}
    assert got["devices"][0].startswith("/job:worker/replica:0/task:0/")
    assert got["devices"][-1].startswith("/job:worker/replica:0/task:1/")


def test_fit_across_processes_equals_plain_keras(tmp_path):
    got = _driver_result(["fit", "2", "interleaved"], tmp_path)
    smp.init({"partitions": 1, "microbatches": 1})
    keras.utils.set_random_seed(100)
    inp = keras.Input((16,))
    h = inp
    for i in range(3):
        h = keras.layers.Dense(32, activation="relu", name=f"d{i}")(h)
    plain = keras.Model(inp, keras.layers.Dense(4, name="head")(h))
    plain.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    x, y = common.batches(3)
    history = plain.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0)
    np.testing.assert_allclose(got["losses"], history.history["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["weights"], plain.trainable_variables):
        np.testing.assert_allclose(np.array(a, dtype=np.float32), b.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["predict"], plain.predict(x[0], verbose=0), rtol=1e-5, atol=1e-6)


def test_the_launcher_starts_a_pipeline_over_two_processes_and_counts_their_devices(tmp_path):
    import subprocess as sp

    result = sp.run(
        [sys.executable, "-m", "smp_tf.launch", "-n", "2", "--partitions", "4", "--pipeline-processes", "2",
         "--timeout", "200", WORKER, "custom_loop", str(tmp_path), "4", "interleaved"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("1 pipeline(s) of 4 partition(s), each over 2 process(es) (cluster): 2 partition(s) per process; "
            "2 logical CPU device(s) each") in result.stderr
    got = json.load(open(os.path.join(tmp_path, "rank0.json")))
    assert got["local_partitions"] == [0, 1] and len(got["losses"]) == 3


def test_the_launcher_needs_partitions_for_pipeline_processes(tmp_path):
    from smp_tf import launch

    script = tmp_path / "noop.py"
    script.write_text("")
    assert launch.main(["-n", "2", "--pipeline-processes", "2", str(script)]) == launch.EXIT_USAGE
    assert launch.main(["-n", "3", "--partitions", "2", "--pipeline-processes", "2", str(script)]) == launch.EXIT_USAGE


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_lost_stage_process_stops_the_driver_within_the_timeout(tmp_path, how):
    import signal

    lost = {}

    def lose_rank_1(procs, start):
        ready = os.path.join(tmp_path, "ready")
        while not os.path.exists(ready):
            if time.monotonic() - start > 180 or procs[0].poll() is not None:
                return
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        lost["at"] = time.monotonic()
        procs[0].wait(timeout=60)
        lost["after"] = time.monotonic() - lost["at"]
        procs[1].kill()  # a stopped process waits for nothing else

    codes, outputs = run_pipeline(["loop", "2", "interleaved"], tmp_path, then=lose_rank_1)
    assert "after" in lost, f"the driver did not stop\n{outputs[0][-3000:]}"
    assert codes[0] == 1, outputs[0][-3000:]
    # dp_timeout is 8 s in the worker; a dead process is seen within a second or two.
    assert lost["after"] < (5.0 if how == "killed" else 8.0 + 10.0), lost
    what = "is gone" if how == "killed" else "stopped responding"
    assert re.search(r"smp_tf: rank 1 on 127\.0\.0\.1:\d+, which holds stages \[1\] of pipeline 0, " + what,
                     outputs[0]), outputs[0][-3000:]
