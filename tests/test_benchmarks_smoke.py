"""Smoke test of the benchmark scripts: they run and print their table.

Marked ``benchmark`` (excluded from the default run by setup.cfg); run with
``pytest -m benchmark tests/test_benchmarks_smoke.py``. No timing is
asserted: the figures of a ``--quick`` run mean nothing.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_BENCH = ROOT / "benchmarks" / "pipeline" / "bench.py"
PARTITIONER_BENCH = ROOT / "benchmarks" / "partitioner" / "bench.py"


def _run(script: Path, timeout: int) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} --quick failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.benchmark
def test_pipeline_bench_quick_prints_the_table():
    out = _run(PIPELINE_BENCH, timeout=1800)
    assert "smp_tf pipeline benchmark (quick)" in out
    header = next(line for line in out.splitlines() if line.startswith("part "))
    for column in ("time", "cpu", "ratio", "bound", "ceiling", "eff", "sim bubble", "target", "result"):
        assert column in header
    for case in ("one device: plain tf.function", "two halves, CPU:0 + CPU:1 at once",
                 "pipeline P=2 simple M=2", "pipeline P=2 simple M=16",
                 "pipeline P=2 interleaved M=8", "smp.step P=1 M=1, same body",
                 "first call, smp.step P=2 M=4",
                 "smp.step P=1 M=8, fused wgrad + pretransposed", "(g)    product ("):
        assert case in out, case
    # Every target gets a verdict (the verdicts themselves are not checked).
    assert out.count("PASS") + out.count("FAIL") >= 5
    assert "overall:" in out
    assert "FAILED:" not in out  # no part crashed


@pytest.mark.benchmark
@pytest.mark.skipif(not PARTITIONER_BENCH.exists(), reason="benchmarks/partitioner/bench.py is not there")
def test_partitioner_bench_quick_prints_a_table():
    out = _run(PARTITIONER_BENCH, timeout=1800)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) >= 3, out
