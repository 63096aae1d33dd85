"""The launcher, `python -m smp_tf.launch`, on tiny scripts (no TensorFlow).

Each test writes its scripts to `tmp_path` and runs the launcher as a
subprocess with a bounded wait. The launcher's PATH is an empty folder (or
one holding a fake ``nvidia-smi``), so the GPUs it sees are the ones the
test gives it.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from smp_tf import launch
from smp_tf.distributed.cluster import _ephemeral_range

pytestmark = pytest.mark.multiprocess

# Every wait on a launcher is bounded by this many seconds.
WAIT_S = 60


def _env(tmp_path, **extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SMP_TF_", "OMPI_", "PMI_", "SLURM_")) and k not in ("CUDA_VISIBLE_DEVICES", "TF_CONFIG")
    }
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    env["PATH"] = str(bin_dir)
    env.update(extra)
    return env


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _launch(tmp_path, args, env=None, timeout=WAIT_S):
    return subprocess.run(
        [sys.executable, "-m", "smp_tf.launch", *args],
        env=env if env is not None else _env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _lines(output, rank):
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def _wait_for(path, within=20.0):
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within} s"
        time.sleep(0.02)


PRINT_ENV = """
    import json, os, sys
    from smp_tf.distributed.cluster import from_environment
    keys = [k for k in os.environ if k.startswith("SMP_TF_")] + ["CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED"]
    info = from_environment()
    print(json.dumps({
        "env": {k: os.environ.get(k) for k in keys},
        "info": [info.rank, info.size, info.local_rank, info.local_size, info.source],
        "args": sys.argv[1:],
    }))
    print("to stderr", file=sys.stderr)
"""


def _envs(result, n):
    return [json.loads(_lines(result.stdout, r)[0]) for r in range(n)]


# ---------------------------------------------------------------------------
# Success, output, environment.


def test_every_process_gets_its_rank_and_the_addresses(tmp_path):
    script = _script(tmp_path, "env.py", PRINT_ENV)
    result = _launch(tmp_path, ["-n", "3", script, "--flag", "value"])
    assert result.returncode == 0, result.stderr
    outputs = _envs(result, 3)
    addresses = outputs[0]["env"]["SMP_TF_ADDRESSES"].split(",")
    ports = [int(a.split(":")[1]) for a in addresses]
    assert [a.split(":")[0] for a in addresses] == ["127.0.0.1"] * 3
    assert ports == list(range(ports[0], ports[0] + 3)) and ports[-1] < _ephemeral_range()[0]
    for rank, out in enumerate(outputs):
        assert out["env"] == {
            "SMP_TF_RANK": str(rank),
            "SMP_TF_SIZE": "3",
            "SMP_TF_LOCAL_RANK": str(rank),
            "SMP_TF_LOCAL_SIZE": "3",
            "SMP_TF_ADDRESSES": ",".join(addresses),
            "SMP_TF_LAUNCHER": "1",
            # No GPUs: CUDA_VISIBLE_DEVICES stays unset.
            "SMP_TF_CPU_DEVICES": "1",
            "CUDA_VISIBLE_DEVICES": None,
            "PYTHONUNBUFFERED": "1",
        }
        # What smp.init will read.
        assert out["info"] == [rank, 3, rank, 3, "smp_tf.launch"]
        assert out["args"] == ["--flag", "value"]
        assert _lines(result.stderr, rank) == ["to stderr"]


def test_output_keeps_the_line_order_of_each_process(tmp_path):
    script = _script(tmp_path, "count.py", """
        import sys
        for i in range(300):
            print(i)
            if i % 50 == 0:
                print(f"err {i}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
    """)
    result = _launch(tmp_path, ["-n", "2", script])
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert _lines(result.stdout, rank) == [str(i) for i in range(300)] + ["no newline at the end"]
        assert _lines(result.stderr, rank) == [f"err {i}" for i in range(0, 300, 50)]
    # Every line is whole: nothing but prefixed lines on stdout.
    assert all(re.match(r"\[rank [01]\] ", line) for line in result.stdout.splitlines())


def test_devices_per_process_is_passed_on_without_gpus(tmp_path):
    script = _script(tmp_path, "env.py", PRINT_ENV)
    result = _launch(tmp_path, ["-n", "2", "--devices-per-process", "3", script])
    assert result.returncode == 0, result.stderr
    for out in _envs(result, 2):
        assert out["env"]["SMP_TF_CPU_DEVICES"] == "3" and out["env"]["CUDA_VISIBLE_DEVICES"] is None


def test_tensor_parallel_degree_sets_the_config_and_the_devices(tmp_path):
    script = _script(tmp_path, "env.py", PRINT_ENV + "    print(os.environ['SM_HP_MP_PARAMETERS'])\n")
    result = _launch(tmp_path, ["-n", "2", "--partitions", "2", "--tensor-parallel-degree", "2", script])
    assert result.returncode == 0, result.stderr
    for r, out in enumerate(_envs(result, 2)):
        # 2 partitions x 2 devices each, per process.
        assert out["env"]["SMP_TF_CPU_DEVICES"] == "4"
        params = json.loads(_lines(result.stdout, r)[1])
        assert params["tensor_parallel_degree"] == 2 and params["partitions"] == 2
    assert "4 logical CPU device(s) each (2 per partition)" in result.stderr + result.stdout
    # A pipeline over both processes: each holds one stage of 2 devices.
    result = _launch(tmp_path, ["-n", "2", "--partitions", "2", "--pipeline-processes", "2",
                                "--tensor-parallel-degree", "2", script])
    assert result.returncode == 0, result.stderr
    for out in _envs(result, 2):
        assert out["env"]["SMP_TF_CPU_DEVICES"] == "2"


@pytest.mark.parametrize(
    "strategy, expected",
    [("cluster", ["0,1", "2,3"]), ("spread", ["0,2", "1,3"])],
)
def test_gpus_by_placement_strategy(tmp_path, strategy, expected):
    script = _script(tmp_path, "env.py", PRINT_ENV)
    env = _env(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2,3")
    args = ["-n", "2", "--devices-per-process", "2", "--placement-strategy", strategy, script]
    result = _launch(tmp_path, args, env=env)
    assert result.returncode == 0, result.stderr
    outputs = _envs(result, 2)
    assert [o["env"]["CUDA_VISIBLE_DEVICES"] for o in outputs] == expected
    assert all("SMP_TF_CPU_DEVICES" not in o["env"] for o in outputs)


def test_gpus_from_nvidia_smi_are_divided_evenly_by_default(tmp_path):
    script = _script(tmp_path, "env.py", PRINT_ENV)
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: Fake GPU (UUID: GPU-{i})"\n' for i in range(6)))
    fake.chmod(0o755)
    result = _launch(tmp_path, ["-n", "3", script])
    assert result.returncode == 0, result.stderr
    assert [o["env"]["CUDA_VISIBLE_DEVICES"] for o in _envs(result, 3)] == ["0,1", "2,3", "4,5"]


def test_too_few_gpus_is_an_error(tmp_path):
    script = _script(tmp_path, "env.py", PRINT_ENV)
    env = _env(tmp_path, CUDA_VISIBLE_DEVICES="0,1,2")
    result = _launch(tmp_path, ["-n", "2", "--devices-per-process", "2", script], env=env)
    assert result.returncode == 2
    assert "2 processes x 2 GPUs each need 4 GPUs, but 3 are visible (0,1,2)" in result.stderr
    assert result.stdout == ""


def test_assign_gpus():
    gpus = ["a", "b", "c", "d", "e", "f"]
    assert launch.assign_gpus(gpus, 3, 2, "cluster") == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert launch.assign_gpus(gpus, 3, 2, "spread") == [["a", "d"], ["b", "e"], ["c", "f"]]
    assert launch.assign_gpus(gpus, 2, 2, "spread") == [["a", "c"], ["b", "d"]]
    with pytest.raises(ValueError, match="need 8 GPUs, but 6 are visible"):
        launch.assign_gpus(gpus, 4, 2, "cluster")
    with pytest.raises(ValueError, match="Received: strategy='round'"):
        launch.assign_gpus(gpus, 1, 1, "round")


def test_visible_gpus(tmp_path):
    empty_path = str(tmp_path)
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,3", "PATH": empty_path}) == ["0", "1", "3"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb", "PATH": empty_path}) == ["GPU-aa", "GPU-bb"]
    # CUDA ignores the entries after an invalid one; "" hides every GPU.
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,3", "PATH": empty_path}) == ["2"]
    assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "", "PATH": empty_path}) == []
    assert launch.visible_gpus({"PATH": empty_path}) == []


# ---------------------------------------------------------------------------
# Failures and stopping.

# Rank 1 sleeps and records SIGTERM; rank 0 does what the test says once
# rank 1 is ready to record it.
SLEEPER_AND_FAILER = """
    import os, pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    rank = int(os.environ["SMP_TF_RANK"])
    if rank == 1:
        def on_term(signum, frame):
            (out / "rank1-terminated").write_text("SIGTERM")
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        (out / "rank1-ready").write_text("")
        time.sleep(120)
        sys.exit(9)
    deadline = time.time() + 20
    while not (out / "rank1-ready").exists() and time.time() < deadline:
        time.sleep(0.01)
    print("rank 0 fails")
    {action}
"""


def test_a_failure_stops_the_others_and_gives_its_exit_code(tmp_path):
    script = _script(tmp_path, "fail.py", SLEEPER_AND_FAILER.replace("{action}", "sys.exit(3)"))
    start = time.monotonic()
    result = _launch(tmp_path, ["-n", "2", script, str(tmp_path)])
    assert result.returncode == 3, result.stderr
    assert (tmp_path / "rank1-terminated").read_text() == "SIGTERM"
    assert "rank 0 exited with code 3; stopping the other processes" in result.stderr
    assert _lines(result.stdout, 0) == ["rank 0 fails"]
    assert time.monotonic() - start < launch.TERMINATE_GRACE_S


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    action = "os.kill(os.getpid(), signal.SIGKILL)"
    script = _script(tmp_path, "kill.py", SLEEPER_AND_FAILER.replace("{action}", action))
    result = _launch(tmp_path, ["-n", "2", script, str(tmp_path)])
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by SIGKILL" in result.stderr
    assert (tmp_path / "rank1-terminated").exists()


def _dead(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # Reparented orphans may stay zombies where nothing reaps them.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_only_the_launched_processes_and_their_children_are_stopped(tmp_path):
    # Rank 1 starts a child of its own that ignores SIGTERM; a process the
    # launcher did not start sleeps alongside.
    script = _script(tmp_path, "tree.py", SLEEPER_AND_FAILER.replace("{action}", "sys.exit(5)").replace(
        "    if rank == 1:\n",
        "    if rank == 1:\n"
        "        import subprocess\n"
        "        child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        "        (out / 'grandchild').write_text(str(child.pid))\n",
    ))
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        result = _launch(tmp_path, ["-n", "2", script, str(tmp_path)])
        assert result.returncode == 5, result.stderr
        grandchild = int((tmp_path / "grandchild").read_text())
        deadline = time.monotonic() + 10
        while not _dead(grandchild):
            assert time.monotonic() < deadline, "the launched process's own child survived"
            time.sleep(0.05)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait(timeout=WAIT_S)


def test_timeout_stops_the_job_with_124(tmp_path):
    script = _script(tmp_path, "slow.py", SLEEPER_AND_FAILER.replace("{action}", "time.sleep(120)"))
    start = time.monotonic()
    result = _launch(tmp_path, ["-n", "2", "--timeout", "1", script, str(tmp_path)])
    assert result.returncode == launch.EXIT_TIMEOUT
    assert "the job ran longer than --timeout=1 s; stopping all processes" in result.stderr
    assert (tmp_path / "rank1-terminated").exists()
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_launcher_stops_the_job(tmp_path, signum, code):
    script = _script(tmp_path, "slow.py", SLEEPER_AND_FAILER.replace("{action}", "time.sleep(120)"))
    process = subprocess.Popen(
        [sys.executable, "-m", "smp_tf.launch", "-n", "2", script, str(tmp_path)],
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(tmp_path / "rank1-ready")
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)
    assert process.returncode == code, stderr
    assert f"received {signal.Signals(signum).name}; stopping all processes" in stderr
    assert (tmp_path / "rank1-terminated").exists()


# ---------------------------------------------------------------------------
# Ports in use.


def test_exit_code_75_restarts_every_process_with_new_ports(tmp_path):
    script = _script(tmp_path, "port.py", """
        import os, pathlib, sys
        marker = pathlib.Path(sys.argv[1]) / "failed-once"
        print(os.environ["SMP_TF_ADDRESSES"])
        if os.environ["SMP_TF_RANK"] == "1" and not marker.exists():
            marker.write_text("")
            sys.exit(75)
    """)
    result = _launch(tmp_path, ["-n", "2", script, str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert "rank 1 exited with code 75: its TensorFlow server could not bind its port" in result.stderr
    assert "restarting all 2 processes with new ports (retry 1 of 3)" in result.stderr
    first, second = _lines(result.stdout, 1)
    assert first != second


def test_exit_code_75_every_time_gives_up_after_three_retries(tmp_path):
    script = _script(tmp_path, "port.py", """
        import os, sys
        sys.exit(75 if os.environ["SMP_TF_RANK"] == "0" else 0)
    """)
    result = _launch(tmp_path, ["-n", "2", script])
    assert result.returncode == 75
    assert result.stderr.count("starting 2 processes") == 4
    assert "retry 3 of 3" in result.stderr
    assert "rank 0 exited with code 75 (port in use again after 3 retries)" in result.stderr


# ---------------------------------------------------------------------------
# Arguments.


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "the following arguments are required: -n/--nproc, script"),
        (["-n", "0", "{script}"], "-n must be at least 1. Received: -n 0"),
        (["-n", "two", "{script}"], "argument -n/--nproc: invalid int value: 'two'"),
        (["-n", "2", "{missing}"], "the script '{missing}' does not exist"),
        (["-n", "2", "--devices-per-process", "0", "{script}"], "--devices-per-process must be at least 1"),
        (["-n", "2", "--timeout", "0", "{script}"], "--timeout must be positive. Received: --timeout 0"),
        (["-n", "2", "--placement-strategy", "round", "{script}"], "invalid choice: 'round'"),
        (["-n", "2", "--host", "a b", "{script}"], "--host must be a host name or IP address"),
        (["-n", "2", "--tensor-parallel-degree", "2", "{script}"], "--tensor-parallel-degree needs --partitions"),
        (["-n", "2", "--partitions", "2", "--tensor-parallel-degree", "0", "{script}"],
         "--tensor-parallel-degree must be at least 1"),
    ],
)
def test_bad_arguments(tmp_path, capsys, args, message):
    script = _script(tmp_path, "ok.py", "print('never run')\n")
    missing = str(tmp_path / "missing.py")
    argv = [a.replace("{script}", script).replace("{missing}", missing) for a in args]
    assert launch.main(argv) == launch.EXIT_USAGE
    captured = capsys.readouterr()
    assert message.replace("{missing}", missing) in captured.err
    assert "never run" not in captured.out
