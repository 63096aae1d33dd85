"""One pipeline across two processes against the same pipeline in one process.

Prints one table; every figure in it is measured by this invocation:

(a) the step time of the MLP of ``benchmarks/pipeline`` (8 x Dense(1024),
    batch 256, MSE, SGD) at P=2, M=8, interleaved: in one process with two
    logical devices, and across two processes (``pipeline_processes=2``) on
    the same two cores. Target: across processes <= 1.15x one process.
(b) the bytes the step moves between the processes, counted on the loopback
    interface (``/proc/net/dev``, bytes sent during the timed steps, less
    the same interface's traffic while idle), next to the tensor bytes the
    step sends across by construction (what the graph says must cross).
(c) the transport's bandwidth: the same bytes moved by TensorFlow between
    the two processes' devices (gRPC ``RecvTensor``), against a plain TCP
    copy of the same bytes between two processes; and the time of one small
    transfer (a boundary tensor of one micro-batch) both ways.
(d) where the difference goes: the same steps traced inside `smp.profile`
    on both sides, each split into the time from the call to the first
    action, the pipeline's span (each device's busy and idle time in it)
    and the time from the last action to the result.
(e) the CPU time of a step (every thread of the process, or of both
    processes, over the timed steps), and so how many cores each side keeps
    busy on average.

Run ``python benchmarks/pipeline_processes/bench.py`` (``--quick`` for small
sizes: checks the script, the figures mean nothing). Every process is
started on 127.0.0.1 by this script and ended by it; see README.md beside
this file.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.machine import choose_cpus, versions  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The profile's probes read TensorFlow's clock, which op determinism forbids.
os.environ.pop("TF_DETERMINISTIC_OPS", None)

_MARK = "@@SMP_BENCH_RESULT@@"
P = 2
M = 8
TARGET = 1.15
#: Ping-pong rounds of one small-transfer measurement.
PINGS = 16


def sizes(quick: bool) -> dict:
    if quick:
        return dict(layers=8, width=256, batch=64)
    return dict(layers=8, width=1024, batch=256)


def _emit(result: dict) -> None:
    print(_MARK + json.dumps(result), flush=True)


def _loopback_tx_bytes() -> Optional[int]:
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return int(rest.split()[8])  # transmit bytes
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------
# The training step (both sides)
# ---------------------------------------------------------------------------
def _model_and_step(args, smp, tf, keras):
    from benchmarks.pipeline.bench import build_mlp, smp_train_step

    keras.utils.set_random_seed(0)
    s = sizes(args.quick)
    model = build_mlp(keras, smp.DistributedModel, s["layers"], s["width"], "mlp")
    train, _ = smp_train_step(tf, keras, smp, model)
    # The batch starts on partition 0's device on both sides.
    with tf.device(smp.topology().devices[0]):
        x = tf.random.normal([s["batch"], s["width"]], seed=1)
        y = tf.random.normal([s["batch"], s["width"]], seed=2)
    return model, train, x, y


def _time_steps(train, x, y, warmup: int, repeats: int) -> List[float]:
    for _ in range(warmup):
        train(x, y).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train(x, y).numpy()
        times.append(time.perf_counter() - start)
    return times


def _process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system, every thread) of process `pid` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_with_cpu(train, x, y, repeats: int, peer: Optional[int] = None) -> dict:
    """`_time_steps` (no warm-up), with the CPU time per step that this
    process (and `peer`, the other stage's process) spent meanwhile."""
    cpu, peer_cpu = time.process_time(), _process_cpu_s(peer) if peer else None
    times = _time_steps(train, x, y, 0, repeats)
    out = {"step_s": times, "cpu_per_step_s": (time.process_time() - cpu) / len(times)}
    if peer_cpu is not None:
        after = _process_cpu_s(peer)
        if after is not None:
            out["peer_cpu_per_step_s"] = (after - peer_cpu) / len(times)
    return out


def _profiled_steps(smp, tf, keras, model, x, y, args) -> dict:
    """The step traced again inside `smp.profile`: per timed step, the wall
    time from the call to the first action (``lead_s``), the pipeline's
    span, each device's busy time in it, and the time from the last action
    to the result (``tail_s``).

    The actions' times come from `tf.timestamp` in the process that ran
    them; `time.time` brackets the call. Both read the host's real-time
    clock, so they compare across the processes of one host.
    """
    from benchmarks.pipeline.bench import smp_train_step

    calls = []
    with smp.profile(None) as prof:
        probed, _ = smp_train_step(tf, keras, smp, model)
        for _ in range(args.warmup + args.repeats):
            start = time.time()
            probed(x, y).numpy()
            calls.append((start, time.time()))
    tl = prof.timeline
    out: Dict[str, list] = {"lead_s": [], "span_s": [], "tail_s": [], "busy_s": []}
    for step in range(args.warmup, tl.num_steps):
        recs = tl.step_records(step)
        span = tl.step_time(step)
        first = min(r.start for r in recs)
        out["lead_s"].append(first - calls[step][0])
        out["span_s"].append(span)
        out["tail_s"].append(calls[step][1] - (first + span))
        idle = tl.step_bubbles(step)  # device -> idle fraction of the span
        out["busy_s"].append([span * (1.0 - idle[d]) for d in sorted(idle)])
    return out


def part_one(args) -> dict:
    """P=2 in one process, pinned to both CPUs."""
    cpus = [int(c) for c in args.cpus.split(",")]
    os.sched_setaffinity(0, set(cpus))
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": M, "pipeline": "interleaved"})
    import keras
    import tensorflow as tf

    model, train, x, y = _model_and_step(args, smp, tf, keras)
    _time_steps(train, x, y, args.warmup, 0)
    out = _timed_with_cpu(train, x, y, args.repeats)
    out["profile"] = _profiled_steps(smp, tf, keras, model, x, y, args)
    return out


def part_driver(args) -> dict:
    """P=2 across two processes: this is rank 0 (pinned to the first CPU);
    rank 1 serves partition 1 from the second CPU."""
    import smp_tf as smp

    smp.init({"partitions": P, "microbatches": M, "pipeline": "interleaved", "pipeline_processes": 2})
    import keras
    import tensorflow as tf

    model, train, x, y = _model_and_step(args, smp, tf, keras)
    devices = smp.topology().devices
    out: Dict[str, object] = {"devices": list(devices)}
    # Idle loopback traffic (the watchdog's probes, ...), measured before the
    # warm-up: an idle second between the warm-up and the timed steps would
    # let the transport cool down again.
    idle_start, t0 = _loopback_tx_bytes(), time.perf_counter()
    time.sleep(1.0)
    idle = None if idle_start is None else (_loopback_tx_bytes() - idle_start) / (time.perf_counter() - t0)
    for _ in range(args.warmup):
        train(x, y).numpy()
    before = _loopback_tx_bytes()
    peer = os.environ.get("SMP_BENCH_PEER_PID")
    out.update(_timed_with_cpu(train, x, y, args.repeats, int(peer) if peer else None))
    times = out["step_s"]
    after = _loopback_tx_bytes()
    if before is not None:
        out["lo_bytes_per_step"] = (after - before - idle * sum(times)) / len(times)
        out["lo_idle_bytes_per_s"] = idle

    # The transport alone: one tensor of `nbytes` from partition 1's device to
    # partition 0's, and a ping-pong of one micro-batch's boundary tensor.
    s = sizes(args.quick)
    nbytes = int(args.nbytes)
    with tf.device(devices[1]):
        big = tf.Variable(tf.zeros([nbytes // 4], tf.float32))
    small_rows = s["batch"] // M

    @tf.function
    def pull():
        with tf.device(devices[1]):
            t = big.read_value()
        with tf.device(devices[0]):
            return t[0]

    @tf.function
    def ping(t):
        # An op on each side (identities would be optimized away): each
        # hop waits for the previous one, as a boundary tensor does.
        for _ in range(PINGS):
            with tf.device(devices[1]):
                t = t + 1.0
            with tf.device(devices[0]):
                t = t - 1.0
        return t[0, 0]

    @tf.function
    def tick(t):
        # One scalar op in each process: what a call of a function that
        # spans both processes costs before any work.
        with tf.device(devices[1]):
            t = t + 1.0
        with tf.device(devices[0]):
            return t - 1.0

    with tf.device(devices[0]):
        boundary = tf.zeros([small_rows, s["width"]], tf.float32)
        scalar = tf.zeros([], tf.float32)
    pull_s, ping_s, tick_s = [], [], []
    for _ in range(args.warmup):
        pull().numpy()
        ping(boundary).numpy()
        tick(scalar).numpy()
    for _ in range(args.repeats):
        start = time.perf_counter()
        tick(scalar).numpy()
        tick_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        pull().numpy()
        pull_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ping(boundary).numpy()
        ping_s.append((time.perf_counter() - start) / (2 * PINGS))
    out.update(pull_s=pull_s, transfer_s=ping_s, call_s=tick_s, boundary_bytes=small_rows * s["width"] * 4)
    if args.profile:
        out["profile"] = _profiled_steps(smp, tf, keras, model, x, y, args)
    return out


# ---------------------------------------------------------------------------
# A plain TCP copy of the same bytes, between two processes
# ---------------------------------------------------------------------------
def part_tcp_receiver(args) -> dict:
    """Receives `nbytes` per round and answers one byte (the sender times it);
    then answers each small message of `small` bytes with the same message."""
    os.sched_setaffinity(0, {int(args.cpus.split(",")[1])})
    server = socket.create_server(("127.0.0.1", int(args.port)))
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        while True:
            header = _recv_exactly(conn, 16)
            if len(header) < 16:
                return {}  # the sender closed: done
            kind, n = int(header[:8]), int(header[8:])
            got = 0
            while got < n:
                k = conn.recv_into(view[: min(len(buf), n - got)])
                if k == 0:
                    return {}
                got += k
            if kind == 0:
                conn.sendall(b"k")
            else:  # echo n bytes
                conn.sendall(bytes(n))
    except ConnectionError:  # the sender closed: done
        return {}


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    """`n` bytes from `conn`, fewer only when the peer closed
    (``MSG_WAITALL`` alone may return early, on a signal)."""
    parts, got = [], 0
    while got < n:
        chunk = conn.recv(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def tcp_copy(args, nbytes: int, small: int, repeats: int) -> dict:
    cpus = args.cpus.split(",")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--part", "tcp_receiver", "--cpus", args.cpus, "--port", str(port)],
        cwd=ROOT,
    )
    try:
        os.sched_setaffinity(0, {int(cpus[0])})
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, reply = bytes(nbytes), bytes(small)
        big_s, small_s = [], []
        for i in range(repeats + 2):
            start = time.perf_counter()
            conn.sendall(b"%08d%08d" % (0, nbytes) + payload)
            _recv_exactly(conn, 1)
            if i >= 2:
                big_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(PINGS):
                conn.sendall(b"%08d%08d" % (1, small) + reply)
                _recv_exactly(conn, small)
            if i >= 2:
                small_s.append((time.perf_counter() - start) / (2 * PINGS))
        conn.close()
        return {"pull_s": big_s, "transfer_s": small_s}
    finally:
        os.sched_setaffinity(0, {int(c) for c in cpus})
        try:
            receiver.wait(timeout=30)
        except subprocess.TimeoutExpired:
            receiver.kill()


# ---------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------
def _result_of(output: str) -> dict:
    for line in output.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError("no result in the output:\n" + output[-3000:])


def _common(args) -> List[str]:
    out = ["--repeats", str(args.repeats), "--warmup", str(args.warmup), "--cpus", args.cpus,
           "--nbytes", str(args.nbytes)]
    return out + (["--quick"] if args.quick else [])


def _profile_medians(profiles: List[dict]) -> dict:
    """Medians over every profiled step of `profiles` (one dict per run)."""
    med = statistics.median
    out = {k: med([v for p in profiles for v in p[k]]) for k in ("lead_s", "span_s", "tail_s")}
    busy = [b for p in profiles for b in p["busy_s"]]
    out["busy_s"] = [med([b[d] for b in busy]) for d in range(len(busy[0]))]
    return out


def run_one(args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--part", "one", *_common(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return _result_of(proc.stdout)


def run_two(args, share: bool = False) -> dict:
    from smp_tf.distributed.cluster import pick_free_ports

    addresses = ",".join(f"127.0.0.1:{p}" for p in pick_free_ports(2, "127.0.0.1"))
    cpus = args.cpus.split(",")
    procs = []
    # Rank 1 first: the driver (rank 0) reads its CPU time by pid.
    for rank in (1, 0):
        env = dict(os.environ, SMP_TF_RANK=str(rank), SMP_TF_SIZE="2", SMP_TF_LOCAL_RANK=str(rank),
                   SMP_TF_LOCAL_SIZE="2", SMP_TF_ADDRESSES=addresses, PYTHONPATH=str(ROOT))
        if rank == 0:
            env["SMP_BENCH_PEER_PID"] = str(procs[0].pid)
        # One process per CPU, pinned before TensorFlow starts its threads;
        # or (share) both processes on both CPUs, the scheduler placing them.
        cmd = ["taskset", "-c", args.cpus if share else cpus[rank], sys.executable, __file__, "--part", "driver",
               *_common(args), *([] if share else ["--profile"])]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    procs.reverse()  # rank 0, rank 1
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if procs[0].returncode != 0 or procs[1].returncode != 0:
        raise RuntimeError(f"exit codes {[p.returncode for p in procs]}\n" + "\n".join(o[1][-2000:] for o in outs))
    return _result_of(outs[0][0])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def build_table(args, one: List[float], two: List[float], drivers: List[dict], tcp: dict, elapsed: float,
                shared: List[float], profiles: List[dict], one_cpu: List[float]) -> str:
    s = sizes(args.quick)
    med = statistics.median
    t1, t2, t3 = med(one), med(two), med(shared)
    ratio, ratio_shared = t2 / t1, t3 / t1
    lo = [d["lo_bytes_per_step"] for d in drivers if "lo_bytes_per_step" in d]
    rows_per_mb = s["batch"] // M
    boundary = rows_per_mb * s["width"] * 4
    # What must cross per step: each micro-batch's activation (forward) and
    # its gradient (backward) between the stages, and the labels y, which the
    # last stage's loss reads from partition 0's device.
    tensor_bytes = 2 * M * boundary + s["batch"] * s["width"] * 4
    pull = med([t for d in drivers for t in d["pull_s"]])
    transfer = med([t for d in drivers for t in d["transfer_s"]])
    call = med([t for d in drivers for t in d["call_s"]])
    tcp_pull, tcp_transfer = med(tcp["pull_s"]), med(tcp["transfer_s"])
    nbytes = int(args.nbytes)
    lines = [
        "smp_tf pipeline across processes benchmark%s: MLP %d x Dense(%d), batch %d, P=%d, M=%d, interleaved"
        % (" (--quick: figures mean nothing)" if args.quick else "", s["layers"], s["width"], s["batch"], P, M),
        "%s; CPUs %s; %d timed steps after %d warm-up per run, %d run(s) per side, medians; run took %.0f s"
        % (versions(), args.cpus, args.repeats, args.warmup, args.rounds, elapsed),
        "",
        "%-62s %14s" % ("figure", "value"),
        "%-62s %14s" % ("-" * 62, "-" * 14),
        "%-62s %14s" % ("(a) step, P=2 in one process (2 logical devices) [ms]", _ms(t1)),
        "%-62s %14s" % ("(a) step, P=2 across 2 processes, one device each [ms]", _ms(t2)),
        "%-62s %14s" % ("(a) across processes / one process (target <= %.2f)" % TARGET,
                        "%.3f %s" % (ratio, "PASS" if ratio <= TARGET else "FAIL")),
        "%-62s %14s" % ("(a) step, P=2 across 2 processes sharing both CPUs [ms]", _ms(t3)),
        "%-62s %14s" % ("(a) sharing both CPUs / one process (target <= %.2f)" % TARGET,
                        "%.3f %s" % (ratio_shared, "PASS" if ratio_shared <= TARGET else "FAIL")),
        "%-62s %14s" % ("(b) tensor bytes that must cross per step", _mib(tensor_bytes)),
        "%-62s %14s" % ("(b) bytes sent on loopback per step (measured)", _mib(med(lo)) if lo else "n/a"),
        "%-62s %14s" % ("(b) measured / tensor bytes", "%.3f" % (med(lo) / tensor_bytes) if lo else "n/a"),
        "%-62s %14s" % ("(c) TensorFlow: %s from stage 1 to stage 0 [ms]" % _mib(nbytes), _ms(pull)),
        "%-62s %14s" % ("(c) plain TCP copy of the same bytes [ms]", _ms(tcp_pull)),
        "%-62s %14s" % ("(c) TensorFlow bandwidth [MiB/s]", "%.0f" % (nbytes / pull / 2**20)),
        "%-62s %14s" % ("(c) plain TCP bandwidth [MiB/s]", "%.0f" % (nbytes / tcp_pull / 2**20)),
        "%-62s %14s" % ("(c) TensorFlow / TCP bandwidth", "%.3f" % (tcp_pull / pull)),
        "%-62s %14s" % ("(c) one boundary tensor (%s), TensorFlow [ms]" % _mib(boundary), _ms(transfer)),
        "%-62s %14s" % ("(c) one boundary tensor, plain TCP [ms]", _ms(tcp_transfer)),
        "%-62s %14s" % ("(c) call of a function with one op in each process [ms]", _ms(call)),
    ]
    p1, p2 = _profile_medians(profiles), _profile_medians([d["profile"] for d in drivers])

    def pair(a: float, b: float) -> str:
        return "%.2f / %.2f" % (a * 1e3, b * 1e3)

    lines += [
        "%-62s %14s" % ("(d) profiled step, one / two processes: call to first action [ms]",
                        pair(p1["lead_s"], p2["lead_s"])),
        "%-62s %14s" % ("(d) pipeline span, first action to last [ms]", pair(p1["span_s"], p2["span_s"])),
    ]
    for d, (b1, b2) in enumerate(zip(p1["busy_s"], p2["busy_s"])):
        lines += [
            "%-62s %14s" % ("(d) device %d busy in the span (its tasks' run time) [ms]" % d, pair(b1, b2)),
            "%-62s %14s" % ("(d) device %d idle in the span (waiting for its inputs) [ms]" % d,
                            pair(p1["span_s"] - b1, p2["span_s"] - b2)),
        ]
    lines += [
        "%-62s %14s" % ("(d) last action to result [ms]", pair(p1["tail_s"], p2["tail_s"])),
    ]
    cpu_one = med(one_cpu)
    cpu_two = [d["cpu_per_step_s"] + d["peer_cpu_per_step_s"] for d in drivers if "peer_cpu_per_step_s" in d]
    cpu_two = med(cpu_two) if cpu_two else None
    lines += [
        "%-62s %14s" % ("(e) CPU time per step, one process (both devices) [ms]", _ms(cpu_one)),
        "%-62s %14s" % ("(e) CPU time per step, two processes (rank 0 + rank 1) [ms]",
                        _ms(cpu_two) if cpu_two else "n/a"),
        "%-62s %14s" % ("(e) cores kept busy during a step, one / two processes",
                        "%.2f / %s" % (cpu_one / t1, "%.2f" % (cpu_two / t2) if cpu_two else "n/a")),
        "",
        "Where the difference goes: %.2f ms per step more across processes (a). In the profiled steps (d),"
        % ((t2 - t1) * 1e3),
        "from the call to the first action %+.2f ms, the span %+.2f ms, from the last action to the result"
        % ((p2["lead_s"] - p1["lead_s"]) * 1e3, (p2["span_s"] - p1["span_s"]) * 1e3),
        "%+.2f ms. Inside the span, the devices' tasks run %s ms longer (busy) and they wait"
        " %s ms"
        % ((p2["tail_s"] - p1["tail_s"]) * 1e3,
           " / ".join("%+.2f" % ((b2 - b1) * 1e3) for b1, b2 in zip(p1["busy_s"], p2["busy_s"])),
           " / ".join("%+.2f" % (((p2["span_s"] - b2) - (p1["span_s"] - b1)) * 1e3)
                      for b1, b2 in zip(p1["busy_s"], p2["busy_s"]))),
        "longer (idle; device 0 / device 1). Under 1F1B with P=2 every boundary tensor is on the critical"
        " path:",
        "%d hops at the measured cost of one (%.2f ms, an op on each side included) are %.2f ms, and a call"
        % (2 * M, transfer * 1e3, 2 * M * transfer * 1e3),
        "with one op in each process takes %.2f ms (c)." % (call * 1e3),
    ]
    if cpu_two:
        lines += [
            "CPU per step (e): %.0f ms in one process, %.0f ms in the two together (%.2fx); one process keeps"
            % (cpu_one * 1e3, cpu_two * 1e3, cpu_two / cpu_one),
            "%.2f cores busy on average, the two processes, each bound to its stage's core, %.2f."
            % (cpu_one / t1, cpu_two / t2),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (checks the script)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per run (default 15; 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before timing (default 10; 2 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per side, alternating (default 2; 1 --quick)")
    parser.add_argument("--json", help="write the raw results to this file")
    parser.add_argument("--part", default="all", choices=["all", "one", "driver", "tcp_receiver"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--cpus", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.warmup is None:
        # Across processes the first steps are slower than later ones: with
        # 2 warm-up steps, the next ten ran up to a third slower than the
        # rest of the run, while the transport warms up.
        args.warmup = 2 if args.quick else 10
    if args.part == "tcp_receiver":
        part_tcp_receiver(args)
        return 0
    if args.part in ("one", "driver"):
        _emit(part_one(args) if args.part == "one" else part_driver(args))
        return 0
    cpus = choose_cpus(2)
    if cpus is None:
        print("SKIPPED: this benchmark needs 2 CPUs (sched_getaffinity)", flush=True)
        return 0
    args.cpus = ",".join(str(c) for c in cpus)
    s = sizes(args.quick)
    args.nbytes = 2 * M * (s["batch"] // M) * s["width"] * 4 + s["batch"] * s["width"] * 4
    start = time.monotonic()
    one, two, shared, drivers, profiles, one_cpu = [], [], [], [], [], []
    for r in range(args.rounds):
        # Alternate the order so that a drift of the machine hits every side.
        for side in (("one", "two", "shared") if r % 2 == 0 else ("shared", "two", "one")):
            if side == "one":
                res = run_one(args)
                one += res["step_s"]
                one_cpu.append(res["cpu_per_step_s"])
                profiles.append(res["profile"])
            elif side == "two":
                d = run_two(args)
                drivers.append(d)
                two += d["step_s"]
            else:
                shared += run_two(args, share=True)["step_s"]
    small = (s["batch"] // M) * s["width"] * 4
    tcp = tcp_copy(args, int(args.nbytes), small, args.repeats)
    table = build_table(args, one, two, drivers, tcp, time.monotonic() - start, shared, profiles, one_cpu)
    print(table, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one": one, "two": two, "shared": shared, "drivers": drivers, "tcp": tcp,
                       "one_profiles": profiles, "one_cpu_per_step_s": one_cpu}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
