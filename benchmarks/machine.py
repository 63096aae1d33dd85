"""What the benchmark scripts share: choosing and pinning CPUs, versions.

The scripts put the repository root on ``sys.path`` and import this module
as ``benchmarks.machine``.
"""

from __future__ import annotations

import os
from typing import Collection, Iterable, List, Optional, Sequence


def _physical_core(cpu: int):
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(base + "physical_package_id") as f:
            pkg = f.read().strip()
        with open(base + "core_id") as f:
            core = f.read().strip()
        return (pkg, core)
    except OSError:
        return ("?", str(cpu))


def choose_cpus(n: int) -> Optional[List[int]]:
    """`n` CPUs this process may use, on distinct physical cores when possible."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    chosen, cores = [], set()
    for cpu in allowed:  # one CPU per physical core first
        core = _physical_core(cpu)
        if core not in cores:
            cores.add(core)
            chosen.append(cpu)
    chosen += [cpu for cpu in allowed if cpu not in chosen]  # then SMT siblings
    return chosen[:n] if len(chosen) >= n else None


def pin_all_threads(cpus: Iterable[int]) -> None:
    """Restricts every thread of this process (not only the caller) to `cpus`."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


def threads_pinned(cpus: Iterable[int]) -> bool:
    """Whether every thread of this process is restricted to exactly `cpus`."""
    cpus, ok = set(cpus), True
    for tid in os.listdir("/proc/self/task"):
        try:
            ok &= os.sched_getaffinity(int(tid)) == cpus
        except OSError:
            pass
    return ok


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def versions() -> str:
    """'tensorflow X, keras Y' of the installed distributions."""
    try:
        from importlib.metadata import version

        tfv = next((version(p) for p in ("tensorflow-cpu", "tensorflow") if _installed(p)), "?")
        return f"tensorflow {tfv}, keras {version('keras')}"
    except Exception:  # pragma: no cover - metadata missing
        return ""


def aligned(cols: Sequence[str], rows: Sequence[Optional[Sequence[str]]], left: Collection[int]) -> List[str]:
    """A text table as lines: the header, a rule and the rows, columns two
    spaces apart, the columns in `left` (indices) left-aligned and the
    others right-aligned. A row that is None is an empty line."""
    present = [r for r in rows if r is not None]
    widths = [max([len(c)] + [len(r[i]) for r in present]) for i, c in enumerate(cols)]

    def fmt(r):
        if r is None:
            return ""
        return "  ".join(v.ljust(widths[i]) if i in left else v.rjust(widths[i]) for i, v in enumerate(r)).rstrip()

    return [fmt(cols), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def run_workers(script: str, role: str, processes: int, extra: Sequence[str], timeout: float = 600.0,
                replicas: bool = True) -> dict:
    """Runs ``script --role ROLE EXTRA`` in `processes` processes on
    127.0.0.1 and returns the first ``RESULT {json}`` line any of them
    prints. With `replicas`, the processes are the data-parallel ranks of
    one smp_tf job (the ``SMP_TF_*`` variables); each also gets
    ``BENCH_RANK`` and ``BENCH_PORT``, a free port for a side channel.
    Every wait is bounded by `timeout`, and the processes still running
    then are ended.

    Raises:
        SystemExit: a worker failed, or none printed a result.
    """
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from smp_tf.distributed.cluster import pick_free_ports

    ports = pick_free_ports(processes + 1, "127.0.0.1")
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports[:processes])
    procs = []
    for r in range(processes):
        env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="2", BENCH_RANK=str(r), BENCH_PORT=str(ports[-1]))
        if processes > 1 and replicas:
            env.update(SMP_TF_RANK=str(r), SMP_TF_SIZE=str(processes), SMP_TF_LOCAL_RANK=str(r),
                       SMP_TF_LOCAL_SIZE=str(processes), SMP_TF_ADDRESSES=addresses)
        procs.append(subprocess.Popen([sys.executable, script, "--role", role] + list(extra), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"{role} worker failed ({p.returncode}):\n{err[-3000:]}")
    for out, _ in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{role}: no result")
