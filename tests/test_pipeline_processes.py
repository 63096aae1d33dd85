"""One pipeline across 2 processes (``pipeline_processes=2``) equals the same
layout in one process, bit for bit; 2 such pipelines with data parallelism
(4 processes) equal one process on the whole batch.

The tests start their processes on 127.0.0.1 (tests/pp/worker.py; a job
that several tests read runs once, `tests.jobs.once`): the first process of
each pipeline drives it, the other serves its stages. Every wait is
bounded, and only the processes a test started are ended. The references
run in this process, on its logical CPU devices.
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
import tensorflow as tf

import smp_tf as smp
from tests import jobs
from tests.dp import common

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("pipeline_processes")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "pp", "worker.py")


#: Exit code of a process killed by SIGSEGV.
SEGFAULT = -11
#: How many times a job whose process died of SIGSEGV runs again.
SEGFAULT_RERUNS = 2


def run_pipeline(args: List[str], out, timeout: float = 240.0, then=None, processes: int = 2):
    """Runs the processes of the job; returns (exit codes, outputs).

    `then(procs)`, if given, runs once the processes are started (it may
    signal them); the timeout covers it.

    TensorFlow's gRPC server rarely dies of a segmentation fault inside its
    collective runtime while the first collective of the job resolves its
    group (the drivers' first barrier, or the first step's broadcast; in about one full run of the suite in three, one of
    its 4-process jobs; never when the job runs alone; on a loaded 2-core
    machine once twice in a row); none of this library's code runs in that
    thread. Such a job is run again from the start, on new ports, saying
    so, up to `SEGFAULT_RERUNS` times; a crash in every run, or any other
    failure, fails the test."""
    codes, outputs = _run_once(args, out, timeout, then, processes)
    for attempt in range(SEGFAULT_RERUNS):
        if SEGFAULT not in codes or then is not None:
            break
        crashed = [r for r, c in enumerate(codes) if c == SEGFAULT]
        print(f"rank(s) {crashed} died of SIGSEGV inside TensorFlow; running the job again ({attempt + 1} of "
              f"{SEGFAULT_RERUNS}). Output of the run that crashed:\n"
              + "\n".join(f"--- rank {r}:\n{outputs[r][-4000:]}" for r in crashed), file=sys.stderr)
        for name in os.listdir(out):
            if name.startswith("rank") and name.endswith(".json"):
                os.remove(os.path.join(out, name))
        codes, outputs = _run_once(args, out, timeout, then, processes)
    return codes, outputs


def _run_once(args: List[str], out, timeout: float, then, processes: int):
    from smp_tf.distributed.cluster import pick_free_ports

    addresses = ",".join(f"127.0.0.1:{p}" for p in pick_free_ports(processes, "127.0.0.1"))
    procs = []
    for r in range(processes):
        env = dict(os.environ, SMP_TF_RANK=str(r), SMP_TF_SIZE=str(processes), SMP_TF_LOCAL_RANK=str(r),
                   SMP_TF_LOCAL_SIZE=str(processes), SMP_TF_ADDRESSES=addresses, PYTHONPATH=ROOT,
                   # A crash inside TensorFlow prints every thread's Python stack into the output.
                   PYTHONFAULTHANDLER="1")
        procs.append(subprocess.Popen([sys.executable, WORKER, *args[:1], str(out), *args[1:]], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    codes: List[Optional[int]] = [None] * processes
    try:
        if then is not None:
            then(procs, start)
        for r in range(processes):
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


def _task_of(device: str) -> str:
    """The task (process) of a device name, as a string."""
    return str(tf.DeviceSpec.from_string(device).task)


def _reference_custom_loop(partitions: int, pipeline: str, virtual_stages: int = 1):
    smp.init({"partitions": partitions, "microbatches": 4, "pipeline": pipeline, "virtual_stages": virtual_stages})
    model = common.build(seed=100)
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    x, y = common.batches(3)
    losses = [float(train(x[s], y[s])) for s in range(3)]
    return losses, [v.numpy() for v in model.trainable_variables]


#: The schedules of the custom-loop and `fit` tests, per partitions. One job
#: per (scenario, partitions) runs them all in turn (`smp.init` again between
#: them), which saves starting the processes again for each.
_SCHEDULES = {
    ("custom_loop", 2): ("interleaved/1", "interleaved/2", "zero_bubble/2"),
    ("custom_loop", 4): ("interleaved/1", "simple/1"),
    ("fit", 2): ("interleaved/1", "zero_bubble/2"),
}


def _job(scenario: str, partitions: int, tmp_path_factory) -> dict:
    """The driver's results of the job running every schedule of
    ``_SCHEDULES[scenario, partitions]``, started once per test run. The
    4-partition job is started with the launcher (`smp_tf.launch`), which
    also checks its start-up line."""
    def start():
        out = tmp_path_factory.mktemp(f"{scenario}{partitions}")
        schedules = ",".join(_SCHEDULES[scenario, partitions])
        if partitions == 4:
            launched = subprocess.run(
                [sys.executable, "-m", "smp_tf.launch", "-n", "2", "--partitions", "4", "--pipeline-processes", "2",
                 "--timeout", "200", WORKER, scenario, str(out), "4", schedules],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=240,
            )
            assert launched.returncode == 0, launched.stderr[-3000:]
            got = json.load(open(os.path.join(out, "rank0.json")))
            got["launcher_stderr"] = launched.stderr
        else:
            got = _driver_result([scenario, str(partitions), schedules], out)
        return got

    return jobs.once(f"pp/{scenario}/{partitions}", start)


@pytest.mark.parametrize("partitions, pipeline, virtual_stages", [
    (2, "interleaved", 1), (4, "interleaved", 1), (4, "simple", 1), (2, "interleaved", 2), (2, "zero_bubble", 2),
])
def test_custom_loop_across_processes_equals_one_process(tmp_path_factory, partitions, pipeline, virtual_stages):
    job = _job("custom_loop", partitions, tmp_path_factory)
    got = job["runs"][f"{pipeline}/{virtual_stages}"]
    losses, weights = _reference_custom_loop(partitions, pipeline, virtual_stages)
    assert got["losses"] == losses
    for a, b in zip(got["weights"], weights):
        np.testing.assert_array_equal(np.array(a, dtype=np.float32), b)
    # Ranks: one pipeline over both processes, driven by rank 0.
    assert (job["rank"], job["size"], job["dp_rank"], job["dp_size"], job["pp_rank"], job["mp_size"]) == (
        0, 2, 0, 1, 0, partitions)
    assert job["local_partitions"] == list(range(partitions // 2))
    # Every variable lives on the server of the process that holds its stage.
    tasks = {_task_of(d) for d in got["devices"]}
    assert tasks == {"0", "1"}
    assert got["devices"][0].startswith("/job:worker/replica:0/task:0/")
    assert got["devices"][-1].startswith("/job:worker/replica:0/task:1/")
    if virtual_stages > 1:
        # 4 chunks, one layer (kernel and bias) each: chunk c lives on
        # device c % 2, so the layers alternate between the processes.
        layer_tasks = [_task_of(d) for d in got["devices"][::2]]
        assert layer_tasks == ["0", "1", "0", "1"]


def test_tensor_parallel_stages_across_processes_equal_one_process(tmp_path):
    # P=2 x t=2 over 2 processes: each process's stage split over two of its
    # devices, the variables' pieces on them; the same as in one process.
    got = _driver_result(["tensor_parallel", "2", "interleaved"], tmp_path)
    smp.init({"partitions": 2, "microbatches": 4, "tensor_parallel_degree": 2})
    model = common.build(seed=100)
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    x, y = common.batches(3)
    assert got["losses"] == [float(train(x[s], y[s])) for s in range(3)]
    for a, b in zip(got["weights"], [v.numpy() for v in model.trainable_variables]):
        np.testing.assert_array_equal(np.array(a, dtype=np.float32), b)
    assert [[_task_of(d) for d in devices] for devices in got["stage_devices"]] == [["0", "0"], ["1", "1"]]
    assert [tf.DeviceSpec.from_string(d).device_index for g in got["stage_devices"] for d in g] == [0, 1, 0, 1]
    split = {path: pieces for path, pieces in got["pieces"].items() if pieces}
    assert split, got["pieces"]
    for path, pieces in split.items():
        assert len({_task_of(d) for d in pieces}) == 1 and len(set(pieces)) == 2, (path, pieces)


def test_profile_across_processes_records_every_action_of_both_processes(tmp_path):
    """smp.profile on a driver times the actions of the stages in both
    processes, and the numbers equal the same loop without probes."""
    got = _driver_result(["profile", "2", "interleaved"], tmp_path)
    tl = got["timeline"]
    assert tl["steps"] == 3 and tl["records"] == 3 * tl["actions"]
    assert tl["per_device"]["0"] > 0 and tl["per_device"]["1"] > 0
    assert tl["devices"]["0"].startswith("/job:worker/replica:0/task:0/")
    assert tl["devices"]["1"].startswith("/job:worker/replica:0/task:1/")
    assert tl["ordered"]
    assert "timeline.json" in tl["files"]
    trace = json.load(open(os.path.join(tmp_path, "timeline", "timeline.json")))
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == tl["records"]
    losses, _ = _reference_custom_loop(2, "interleaved")
    assert got["losses"] == losses


def _plain_model(seed: int) -> keras.Model:
    """`common.build`'s model as a plain `keras.Model`."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,))
    h = inp
    for i in range(3):
        h = keras.layers.Dense(32, activation="relu", name=f"d{i}")(h)
    return keras.Model(inp, keras.layers.Dense(4, name="head")(h))


@pytest.mark.parametrize("pipeline, virtual_stages", [("interleaved", 1), ("zero_bubble", 2)])
def test_fit_across_processes_equals_plain_keras(tmp_path_factory, pipeline, virtual_stages):
    got = _job("fit", 2, tmp_path_factory)["runs"][f"{pipeline}/{virtual_stages}"]
    plain = _assert_fit_equals_plain_keras(got)
    x, _ = common.batches(3)
    np.testing.assert_allclose(got["predict"], plain.predict(x[0], verbose=0), rtol=1e-5, atol=1e-6)


def _assert_fit_equals_plain_keras(got: dict) -> keras.Model:
    """The worker's 2-epoch `fit` against plain Keras on the same data; returns the plain model."""
    smp.init({"partitions": 1, "microbatches": 1})
    plain = _plain_model(seed=100)
    plain.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    x, y = common.batches(3)
    history = plain.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0)
    np.testing.assert_allclose(got["losses"], history.history["loss"], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["weights"], plain.trainable_variables):
        np.testing.assert_allclose(np.array(a, dtype=np.float32), b.numpy(), rtol=1e-5, atol=1e-5)
    return plain


# --------------------------------------------------------------------------
# 2 replicas of a pipeline over 2 processes each: data parallelism
# --------------------------------------------------------------------------
def _replicas_result(tmp_path_factory):
    """The drivers' results of the 4-process ``dp`` job (the custom loop,
    then `fit`) and its directory, started once per test run."""
    def start():
        out = tmp_path_factory.mktemp("dp")
        codes, outputs = run_pipeline(["dp", "2", "interleaved"], out, processes=4)
        assert codes == [0] * 4, f"exit codes {codes}\n" + "\n".join(
            f"--- rank {r}:\n{o[-2500:]}" for r, o in enumerate(outputs))
        # Ranks 0 and 2 drive pipelines 0 and 1; ranks 1 and 3 only serve.
        assert sorted(f for f in os.listdir(out) if f.endswith(".json")) == ["rank0.json", "rank2.json"]
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 2)], out

    return jobs.once("pp/dp", start)


def _reference(batches):
    """One process, one pipeline, the whole batch, from replica 0's initial weights."""
    smp.init({"partitions": 2, "microbatches": 4})
    model = common.build(seed=100)
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    losses = [float(train(x, y)) for x, y in batches]
    return model, losses


def test_two_replicas_of_a_pipeline_over_four_processes_equal_one_process_on_the_whole_batch(tmp_path_factory):
    (a, b), tmp_path = _replicas_result(tmp_path_factory)
    assert [(r["rank"], r["dp_rank"], r["dp_size"], r["pp_rank"], r["local_partitions"]) for r in (a, b)] == [
        (0, 0, 2, 0, [0]), (2, 1, 2, 0, [0])]
    assert a["allgather"] == b["allgather"] == [{"dp_rank": 0, "rank": 0}, {"dp_rank": 1, "rank": 2}]
    # Each replica's variables live on its own two processes.
    assert {_task_of(d) for d in a["devices"]} == {"0", "1"}
    assert {_task_of(d) for d in b["devices"]} == {"2", "3"}
    for u, v in zip(a["weights"], b["weights"]):  # the replicas stay identical
        np.testing.assert_array_equal(np.array(u), np.array(v))
    # The sequential description: 3 steps on whole batches, then (smp.join)
    # 2 steps on whole batches and one on replica 1's half alone.
    assert (a["joined_steps"], b["joined_steps"]) == (1, 0)
    x, y = common.batches(3)
    more_x, more_y = common.batches(6)
    batches = [(x[s], y[s]) for s in range(3)] + [(more_x[s], more_y[s]) for s in (3, 4)]
    model, losses = _reference(batches + [common.half(more_x[5], more_y[5], 1)])
    np.testing.assert_allclose(np.add(a["losses"], b["losses"]) / 2, losses[:3], rtol=1e-5)
    for w, r in zip(a["weights"], model.trainable_variables):
        np.testing.assert_allclose(np.array(w), r.numpy(), rtol=1e-5, atol=1e-5)

    # Saved once by rank 0: the checkpoint restores in one process on another
    # layout, the weights file in plain Keras, the export serves.
    saved = [np.array(w, dtype=np.float32) for w in a["weights"]]
    smp.init({"partitions": 3, "microbatches": 2})
    restored = common.build(seed=7)
    smp.CheckpointManager(tf.train.Checkpoint(model=restored), tmp_path / "ckpt").restore()
    for u, v in zip(restored.trainable_variables, saved):
        np.testing.assert_array_equal(u.numpy(), v)
    plain = _plain_model(seed=7)
    plain.load_weights(str(tmp_path / "w.weights.h5"))
    for u, v in zip(plain.trainable_variables, saved):
        np.testing.assert_array_equal(u.numpy(), v)
    predicted = np.load(tmp_path / "predict.npy")
    np.testing.assert_allclose(plain.predict(x[0], verbose=0), predicted, rtol=1e-5, atol=1e-6)
    served = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(served.serve(tf.constant(x[0])), predicted, rtol=1e-5, atol=1e-6)


def test_fit_with_two_replicas_of_a_pipeline_over_four_processes_equals_plain_keras(tmp_path_factory):
    a, b = (r["fit"] for r in _replicas_result(tmp_path_factory)[0])
    assert a["losses"] == b["losses"]  # the epoch's logs describe the global data
    for u, v in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(np.array(u), np.array(v))
    _assert_fit_equals_plain_keras(a)


def test_the_launcher_starts_a_pipeline_over_two_processes_and_counts_their_devices(tmp_path_factory):
    job = _job("custom_loop", 4, tmp_path_factory)
    assert ("1 pipeline(s) of 4 partition(s), each over 2 process(es) (cluster): 2 partition(s) per process; "
            "2 logical CPU device(s) each") in job["launcher_stderr"]
    assert job["local_partitions"] == [0, 1] and set(job["runs"]) == {"interleaved/1", "simple/1"}
    assert all(len(run["losses"]) == 3 for run in job["runs"].values())


def test_the_launcher_needs_partitions_for_pipeline_processes(tmp_path):
    from smp_tf import launch

    script = tmp_path / "noop.py"
    script.write_text("")
    assert launch.main(["-n", "2", "--pipeline-processes", "2", str(script)]) == launch.EXIT_USAGE
    assert launch.main(["-n", "3", "--partitions", "2", "--pipeline-processes", "2", str(script)]) == launch.EXIT_USAGE


def test_a_driver_whose_watchdog_cannot_run_still_exits():
    """The main thread blocks in a native call that holds the interpreter
    (ctypes.PyDLL keeps it), so the watchdog thread cannot run: the native
    timer it armed prints every thread's stack and exits with code 1."""
    script = r"""
import ctypes, sys, threading, time
sys.path.insert(0, sys.argv[1])
from smp_tf.distributed import remote
remote.last_resort_s = lambda timeout: 3.0
threading.Thread(target=remote._watch, args=(0, None, ("127.0.0.1:1",), [], 1.0), daemon=True).start()
time.sleep(0.5)
print("blocking", flush=True)
ctypes.PyDLL(None).sleep(120)
print("not reached", flush=True)
"""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script, ROOT], capture_output=True, text=True, timeout=100)
    took = time.monotonic() - start
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-3000:])
    assert "blocking" in out.stdout and "not reached" not in out.stdout
    assert "Timeout (0:00:03)!" in out.stderr and "<module>" in out.stderr, out.stderr[-3000:]
    assert took < 60, took


def test_a_server_that_closes_late_is_seen_as_gone():
    """A killed process resets its connections before the kernel closes its
    listening socket: the first look may still connect. `_gone` keeps
    looking for a while; a server that stays open is not gone."""
    import socket
    import threading

    from smp_tf.distributed import remote

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(128)  # every look is a connection nobody accepts
    address = "127.0.0.1:%d" % server.getsockname()[1]
    assert not remote._gone(address, window=0.3)  # open all along
    closer = threading.Timer(0.5, server.close)
    closer.start()
    start = time.monotonic()
    try:
        assert remote._alive(address)
        assert remote._gone(address, window=5.0)
    finally:
        closer.cancel()
        server.close()
    assert time.monotonic() - start < 4.0


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
