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
