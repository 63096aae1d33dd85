"""Start the processes of a data-parallel job on this machine.

::

    python -m smp_tf.launch -n 2 train.py --epochs 3
    smp-tf-launch -n 4 --devices-per-process 2 --placement-strategy spread train.py

Each of the ``N`` processes runs ``python script.py args...`` and drives one
pipeline replica. The launcher:

* picks ``N`` free ports (`pick_free_ports`) and gives every process
  ``SMP_TF_RANK``, ``SMP_TF_SIZE``, ``SMP_TF_LOCAL_RANK``,
  ``SMP_TF_LOCAL_SIZE``, ``SMP_TF_ADDRESSES`` (``host:port`` of every rank's
  TensorFlow server), ``SMP_TF_LAUNCHER=1`` and ``PYTHONUNBUFFERED=1``,
  which `smp.init` reads;
* gives each process its own GPUs through ``CUDA_VISIBLE_DEVICES`` when the
  machine has GPUs (the ``CUDA_VISIBLE_DEVICES`` list if set, else
  ``nvidia-smi -L``): ``K`` per process (``--devices-per-process``, default
  all GPUs divided evenly), rank ``r`` taking GPUs ``r*K .. r*K+K-1``
  (``cluster``) or ``r, r+N, r+2N, ...`` (``spread``) of the visible list.
  Without GPUs it leaves ``CUDA_VISIBLE_DEVICES`` alone and sets
  ``SMP_TF_CPU_DEVICES=K`` (default 1; `smp.init` creates its own logical
  CPU devices, so this only informs);
* prefixes every line a process prints with ``[rank r] `` (stdout to
  stdout, stderr to stderr);
* stops the job as a whole: when a process fails, the others get SIGTERM,
  then SIGKILL after a grace period, and the launcher exits with the first
  failure's code (``128 + signal`` for a process killed by a signal). A
  process that exits with 75 (`EXIT_PORT_IN_USE`: its server's port was
  taken) in its first 30 seconds restarts all processes with new ports, up
  to 3 times. SIGINT or SIGTERM to the launcher stops the processes and
  exits with 130 or 143; ``--timeout`` stops them and exits with 124.

Each process runs in its own session, and the launcher signals only the
process groups of the processes it started.

This module does not import TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Dict, List, Mapping, Optional, Sequence

from smp_tf.distributed.cluster import EXIT_PORT_IN_USE, parse_address, pick_free_ports
from smp_tf.distributed.layout import PipelineLayout

__all__ = ["EXIT_TIMEOUT", "assign_gpus", "main", "visible_gpus"]

#: Exit code when ``--timeout`` expires (as coreutils' ``timeout``).
EXIT_TIMEOUT = 124
#: Exit code for bad command-line arguments (as argparse).
EXIT_USAGE = 2

#: Seconds the processes get between SIGTERM and SIGKILL.
TERMINATE_GRACE_S = 10.0
#: A process exiting with `EXIT_PORT_IN_USE` within this many seconds of its
#: start restarts the job with new ports; later, it is an ordinary failure
#: (the server started long before, so a retry would not help).
PORT_RETRY_WINDOW_S = 30.0
#: How many times the job is restarted with new ports.
MAX_PORT_RETRIES = 3

_TAG = "[smp_tf.launch]"
_POLL_S = 0.05
_READER_JOIN_S = 2.0
_STRATEGIES = ("cluster", "spread")


# ---------------------------------------------------------------------------
# Devices.


def visible_gpus(env: Mapping[str, str] = os.environ) -> List[str]:
    """Lists the GPUs this machine gives to the launcher, without TensorFlow.

    Args:
        env: the environment; its ``CUDA_VISIBLE_DEVICES``, when set, is the
            list (an empty value hides every GPU).

    Returns:
        The GPU ids to hand out (as ``CUDA_VISIBLE_DEVICES`` entries): the
        entries of ``CUDA_VISIBLE_DEVICES`` up to the first invalid one (CUDA
        ignores the rest), else ``"0" .. "G-1"`` for the ``G`` GPUs that
        ``nvidia-smi -L`` lists, else an empty list.
    """
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        ids: List[str] = []
        for entry in raw.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            ids.append(entry)
        return ids
    if shutil.which("nvidia-smi", path=env.get("PATH")) is None:
        return []
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, env=dict(env)
        )
    except (OSError, subprocess.SubprocessError) as e:
        _say(f"'nvidia-smi -L' failed ({e}); starting the processes without GPUs.")
        return []
    if listing.returncode != 0:
        _say(
            f"'nvidia-smi -L' exited with code {listing.returncode} "
            f"({listing.stderr.strip()[:200]}); starting the processes without GPUs."
        )
        return []
    return [m.group(1) for m in re.finditer(r"^GPU (\d+):", listing.stdout, re.MULTILINE)]


def assign_gpus(gpus: Sequence[str], processes: int, per_process: int, strategy: str) -> List[List[str]]:
    """Splits GPUs among processes.

    Args:
        gpus: the GPU ids to hand out, in order.
        processes: number of processes ``N``.
        per_process: GPUs per process ``K``.
        strategy: ``"cluster"``: rank ``r`` gets ``gpus[r*K : r*K+K]``
            (a replica's partitions on neighbouring GPUs); ``"spread"``: rank
            ``r`` gets ``gpus[r], gpus[r+N], ...`` (replicas of one partition
            on neighbouring GPUs).

    Returns:
        The GPU ids of each rank.

    Raises:
        ValueError: ``N*K`` exceeds the number of GPUs, or `strategy` is
            unknown.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"The placement strategy must be one of {', '.join(map(repr, _STRATEGIES))}. "
            f"Received: strategy={strategy!r}"
        )
    if processes * per_process > len(gpus):
        raise ValueError(
            f"{processes} processes x {per_process} GPUs each need {processes * per_process} "
            f"GPUs, but {len(gpus)} are visible ({','.join(gpus) or 'none'}). Use fewer "
            "processes or --devices-per-process, or make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES)."
        )
    if strategy == "cluster":
        return [list(gpus[r * per_process : (r + 1) * per_process]) for r in range(processes)]
    return [[gpus[r + j * processes] for j in range(per_process)] for r in range(processes)]


# ---------------------------------------------------------------------------
# Output.

_OUTPUT_LOCKS: Dict[str, threading.Lock] = {"stdout": threading.Lock(), "stderr": threading.Lock()}


def _write(stream_name: str, text: str) -> None:
    # Looked up at each write so that a replaced sys.stdout (pytest's
    # capture, a notebook) is honoured; one lock per stream keeps the lines
    # of different processes whole.
    with _OUTPUT_LOCKS[stream_name]:
        stream = getattr(sys, stream_name)
        stream.write(text)
        stream.flush()


def _say(message: str) -> None:
    _write("stderr", f"{_TAG} {message}\n")


def _forward(pipe: IO[bytes], prefix: str, stream_name: str) -> None:
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            _write(stream_name, prefix + (line if line.endswith("\n") else line + "\n"))


# ---------------------------------------------------------------------------
# Processes.


@dataclass
class _Child:
    """One started process and the threads forwarding its output."""

    rank: int
    process: subprocess.Popen
    readers: List[threading.Thread] = field(default_factory=list)

    def exit_code(self) -> Optional[int]:
        """The exit code if the process has ended (negative: killed by that
        signal), without reaping it.

        An unreaped process keeps its pid, which is also its process group's
        id: until the launcher reaps it, no other process can take that id,
        so signalling the group cannot reach a stranger.
        """
        if self.process.returncode is not None:
            return self.process.returncode
        if not hasattr(os, "waitid"):
            return self.process.poll()
        try:
            status = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self.process.poll()
        if status is None:
            return None
        return status.si_status if status.si_code == os.CLD_EXITED else -status.si_status

    def signal_group(self, signum: int) -> None:
        if self.process.returncode is not None:
            return  # reaped: its id may belong to someone else now
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


class _Launcher:
    """Starts, watches and stops the processes of one job."""

    def __init__(
        self,
        args: argparse.Namespace,
        gpu_sets: Optional[List[List[str]]],
        per_process: int,
        layout: Optional[PipelineLayout] = None,
    ) -> None:
        self.args = args
        self.gpu_sets = gpu_sets
        self.per_process = per_process
        self.layout = layout
        self.signals: List[int] = []
        self.wake = threading.Event()
        self.deadline = None if args.timeout is None else time.monotonic() + args.timeout

    def devices_line(self) -> str:
        """What each process gets, for the start-up line."""
        if self.layout is not None:
            L = self.layout
            where = (
                f"{L.replicas} pipeline(s) of {L.partitions} partition(s), each over {L.pipeline_processes} "
                f"process(es) ({L.strategy}): {L.partitions_per_process} partition(s) per process"
            )
        else:
            where = None
        if self.gpu_sets is not None:
            devices = "; ".join(f"rank {r}: GPUs {','.join(g)}" for r, g in enumerate(self.gpu_sets))
        elif self.layout is not None:
            devices = f"{self.per_process} logical CPU device(s) each"
            if (self.args.tensor_parallel_degree or 1) > 1:
                devices += f" ({self.args.tensor_parallel_degree} per partition)"
        else:
            devices = (
                "each process creates one logical CPU device per partition it holds "
                "(give --partitions to have them counted here)"
            )
        return devices if where is None else f"{where}; {devices}"

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        self.wake.set()

    def run(self) -> int:
        """Runs the job, restarting it on a port conflict; returns the exit code."""
        n = self.args.nproc
        for attempt in range(MAX_PORT_RETRIES + 1):
            try:
                ports = pick_free_ports(n)
            except OSError as e:
                _say(f"cannot pick {n} free ports: {e}")
                return 1
            outcome = self.run_once(ports, may_retry=attempt < MAX_PORT_RETRIES)
            if outcome is not None:
                return outcome
            _say(
                f"restarting all {n} processes with new ports (retry {attempt + 1} of "
                f"{MAX_PORT_RETRIES})"
            )
        raise AssertionError("the last attempt never asks for a retry")

    def child_env(self, rank: int, addresses: str) -> Dict[str, str]:
        env = dict(os.environ)
        n = str(self.args.nproc)
        env.update(
            SMP_TF_RANK=str(rank),
            SMP_TF_SIZE=n,
            SMP_TF_LOCAL_RANK=str(rank),
            SMP_TF_LOCAL_SIZE=n,
            SMP_TF_ADDRESSES=addresses,
            SMP_TF_LAUNCHER="1",
            PYTHONUNBUFFERED="1",
        )
        if self.layout is not None:
            # As SageMaker passes its model-parallel parameters: they
            # override the keys of the config the script gives smp.init.
            try:
                params = json.loads(env.get("SM_HP_MP_PARAMETERS") or "{}")
            except ValueError:
                params = {}
            params.update(partitions=self.layout.partitions, pipeline_processes=self.layout.pipeline_processes,
                          placement_strategy=self.layout.strategy)
            if self.args.tensor_parallel_degree is not None:
                params.update(tensor_parallel_degree=self.args.tensor_parallel_degree)
            env["SM_HP_MP_PARAMETERS"] = json.dumps(params)
        if self.gpu_sets is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpu_sets[rank])
            env.pop("SMP_TF_CPU_DEVICES", None)
        else:
            env["SMP_TF_CPU_DEVICES"] = str(self.per_process)
        return env

    def start(self, ports: List[int]) -> List[_Child]:
        host = self.args.host
        addresses = ",".join(f"[{host}]:{p}" if ":" in host else f"{host}:{p}" for p in ports)
        _say(f"starting {self.args.nproc} processes, servers at {addresses}; {self.devices_line()}")
        children: List[_Child] = []
        try:
            for rank in range(self.args.nproc):
                process = subprocess.Popen(
                    [sys.executable, self.args.script, *self.args.script_args],
                    env=self.child_env(rank, addresses),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    # Own session: a Ctrl-C at the terminal reaches only the
                    # launcher, which stops the job in order, and the
                    # process's own children can be signalled as a group.
                    start_new_session=True,
                )
                child = _Child(rank, process)
                children.append(child)
                for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr")):
                    reader = threading.Thread(
                        target=_forward, args=(pipe, f"[rank {rank}] ", name), daemon=True
                    )
                    reader.start()
                    child.readers.append(reader)
        except BaseException:
            self.stop(children)
            self.reap(children)
            raise
        return children

    def run_once(self, ports: List[int], may_retry: bool) -> Optional[int]:
        """Runs the job once; returns its exit code, or None to retry with new ports."""
        started = time.monotonic()
        children = self.start(ports)
        try:
            while True:
                if self.signals:
                    signum = self.signals[0]
                    _say(f"received {signal.Signals(signum).name}; stopping all processes")
                    self.stop(children)
                    return 128 + signum
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    _say(f"the job ran longer than --timeout={self.args.timeout:g} s; stopping all processes")
                    self.stop(children)
                    return EXIT_TIMEOUT
                codes = [child.exit_code() for child in children]
                failed = [(r, c) for r, c in enumerate(codes) if c is not None and c != 0]
                if failed:
                    rank, code = failed[0]
                    port_in_use = code == EXIT_PORT_IN_USE and time.monotonic() - started < PORT_RETRY_WINDOW_S
                    if port_in_use and may_retry:
                        _say(
                            f"rank {rank} exited with code {EXIT_PORT_IN_USE}: its TensorFlow "
                            "server could not bind its port (another process took it); "
                            "stopping all processes"
                        )
                        self.stop(children)
                        return None
                    gave_up = f" (port in use again after {MAX_PORT_RETRIES} retries)" if port_in_use else ""
                    _say(f"rank {rank} {_describe(code)}{gave_up}; stopping the other processes")
                    self.stop(children)
                    return _shell_code(code)
                if all(c == 0 for c in codes):
                    return 0
                self.wake.wait(_POLL_S)
        finally:
            self.reap(children)

    def stop(self, children: List[_Child]) -> None:
        """SIGTERM to every process group, SIGKILL to all after the grace period."""
        for child in children:
            child.signal_group(signal.SIGTERM)
        signals_seen = len(self.signals)
        grace_end = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < grace_end:
            if all(child.exit_code() is not None for child in children):
                break
            if len(self.signals) > signals_seen:
                break  # asked again: do not wait for the grace period
            time.sleep(_POLL_S)
        else:
            running = [c.rank for c in children if c.exit_code() is None]
            _say(f"ranks {running} still running {TERMINATE_GRACE_S:g} s after SIGTERM; sending SIGKILL")
        # Also reaches what the processes started and left behind.
        for child in children:
            child.signal_group(signal.SIGKILL)

    def reap(self, children: List[_Child]) -> None:
        for child in children:
            try:
                child.process.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                child.signal_group(signal.SIGKILL)
                child.process.wait()
        for child in children:
            for reader in child.readers:
                # A grandchild may hold the pipe open; do not wait for it.
                reader.join(timeout=_READER_JOIN_S)


# ---------------------------------------------------------------------------
# Command line.


def _layout(args: argparse.Namespace) -> Optional[PipelineLayout]:
    """The job's layout when ``--partitions`` is given (None otherwise)."""
    if args.partitions is None:
        return None
    if args.partitions < 1:
        raise ValueError(f"--partitions must be at least 1. Received: --partitions {args.partitions}")
    k = 1 if args.pipeline_processes is None else args.pipeline_processes
    if k < 1:
        raise ValueError(f"--pipeline-processes must be at least 1. Received: --pipeline-processes {k}")
    return PipelineLayout(args.nproc, args.partitions, k, args.placement_strategy)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m smp_tf.launch",
        description=(
            "Start N processes of a data-parallel smp_tf job on this machine; each "
            "process drives one pipeline replica."
        ),
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, metavar="N", help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help=(
            "GPUs per process (default: the visible GPUs divided evenly); without GPUs, "
            "passed as SMP_TF_CPU_DEVICES (default 1)"
        ),
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=None,
        metavar="P",
        help=(
            "partitions of each pipeline: sets the 'partitions' key of every process's config "
            "(through SM_HP_MP_PARAMETERS) and gives each process one device per partition it holds"
        ),
    )
    parser.add_argument(
        "--pipeline-processes",
        type=int,
        default=None,
        metavar="K",
        help="processes each pipeline spans (the 'pipeline_processes' key; needs --partitions; default 1)",
    )
    parser.add_argument(
        "--tensor-parallel-degree",
        type=int,
        default=None,
        metavar="T",
        help=(
            "devices each partition is split over: sets the 'tensor_parallel_degree' key of every "
            "process's config and gives each process T devices per partition it holds (needs --partitions)"
        ),
    )
    parser.add_argument(
        "--placement-strategy",
        choices=_STRATEGIES,
        default="cluster",
        help="cluster: each process takes neighbouring GPUs; spread: GPUs dealt out in turn",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="host name written in the server addresses (default 127.0.0.1)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"stop the job after this long (exit {EXIT_TIMEOUT})",
    )
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="args", help="arguments of the script")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher.

    Args:
        argv: the command-line arguments (without the program name);
            defaults to ``sys.argv[1:]``.

    Returns:
        0 if every process exited with 0; the first failing process's exit
        code (``128 + signal`` if a signal killed it); 124 when ``--timeout``
        expired; 130 or 143 when the launcher got SIGINT or SIGTERM; 2 for bad
        arguments.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.nproc < 1:
            parser.error(f"-n must be at least 1. Received: -n {args.nproc}")
        if args.devices_per_process is not None and args.devices_per_process < 1:
            parser.error(
                f"--devices-per-process must be at least 1. Received: --devices-per-process "
                f"{args.devices_per_process}"
            )
        if args.timeout is not None and not args.timeout > 0:
            parser.error(f"--timeout must be positive. Received: --timeout {args.timeout:g}")
        if not os.path.isfile(args.script):
            parser.error(f"the script {args.script!r} does not exist (or is not a file)")
        try:
            parse_address(f"{args.host}:1" if ":" not in args.host else f"[{args.host}]:1")
        except ValueError:
            parser.error(f"--host must be a host name or IP address. Received: --host {args.host!r}")
        if args.pipeline_processes is not None and args.partitions is None:
            parser.error("--pipeline-processes needs --partitions (the partitions the processes share)")
        if args.tensor_parallel_degree is not None:
            if args.tensor_parallel_degree < 1:
                parser.error(f"--tensor-parallel-degree must be at least 1. Received: --tensor-parallel-degree "
                             f"{args.tensor_parallel_degree}")
            if args.partitions is None:
                parser.error("--tensor-parallel-degree needs --partitions (the devices of a process are "
                             "partitions x tensor-parallel degree)")
        try:
            layout = _layout(args)
        except ValueError as e:
            parser.error(str(e))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE

    gpus = visible_gpus(os.environ)
    gpu_sets: Optional[List[List[str]]] = None
    if layout is not None and args.devices_per_process is None:
        args.devices_per_process = layout.partitions_per_process * (args.tensor_parallel_degree or 1)
    if gpus:
        per_process = args.devices_per_process or len(gpus) // args.nproc
        if per_process < 1:
            per_process = 1  # too few GPUs: let assign_gpus say so
        try:
            gpu_sets = assign_gpus(gpus, args.nproc, per_process, args.placement_strategy)
        except ValueError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
    else:
        per_process = args.devices_per_process or 1

    launcher = _Launcher(args, gpu_sets, per_process, layout)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main_thread:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, launcher.on_signal)
    try:
        return launcher.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
