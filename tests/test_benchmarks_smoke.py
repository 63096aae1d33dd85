"""Smoke test of the benchmark scripts: they run and print their table.

The runs are marked ``benchmark`` (excluded from the default run by setup.cfg); run them with
``pytest -m benchmark tests/test_benchmarks_smoke.py``. No timing is
asserted: the figures of a ``--quick`` run mean nothing. How the pipeline
table counts its targets is tested on made-up results, in the default run.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE_BENCH = ROOT / "benchmarks" / "pipeline" / "bench.py"
PARTITIONER_BENCH = ROOT / "benchmarks" / "partitioner" / "bench.py"
DATA_PARALLEL_BENCH = ROOT / "benchmarks" / "data_parallel" / "bench.py"
KERAS_FIT_BENCH = ROOT / "benchmarks" / "keras_fit" / "bench.py"
PIPELINE_PROCESSES_BENCH = ROOT / "benchmarks" / "pipeline_processes" / "bench.py"
TIMELINE_BENCH = ROOT / "benchmarks" / "pipeline" / "timeline.py"
FIRST_CALL_BENCH = ROOT / "benchmarks" / "pipeline" / "first_call.py"
TENSOR_PARALLEL_BENCH = ROOT / "benchmarks" / "tensor_parallel" / "bench.py"
SHARDED_BENCH = ROOT / "benchmarks" / "sharded_data_parallel" / "bench.py"


def _run(script: Path, timeout: int, extra: tuple = ()) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", *extra],
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
    # NOISY: the ceiling of that run is not trustworthy (tiny --quick sizes
    # often are), so the efficiency rows get that verdict instead.
    assert out.count("PASS") + out.count("FAIL") + out.count("NOISY") >= 5
    assert "overall:" in out
    assert "FAILED:" not in out  # no part crashed


@pytest.mark.benchmark
@pytest.mark.skipif(not PARTITIONER_BENCH.exists(), reason="benchmarks/partitioner/bench.py is not there")
def test_partitioner_bench_quick_prints_a_table():
    out = _run(PARTITIONER_BENCH, timeout=1800)
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) >= 3, out


@pytest.mark.benchmark
def test_data_parallel_bench_quick_prints_the_table():
    out = _run(DATA_PARALLEL_BENCH, timeout=900)
    for case in ("all-reduce 1 MiB, 2 processes", "TCP copy 4 MiB", "1 replica: MLP",
                 "2 replicas, 1 core each, all-reduce", "after the pipeline"):
        assert case in out, case


@pytest.mark.benchmark
def test_sharded_data_parallel_bench_quick_prints_the_table():
    out = _run(SHARDED_BENCH, timeout=900)
    for row in ("optimizer state", "parameters + gradients + optimizer", "shard_optimizer_state",
                "all-to-all + all-gather"):
        assert row in out, row


@pytest.mark.benchmark
def test_sharded_data_parallel_fits_table_quick_prints_every_run():
    out = _run(SHARDED_BENCH, timeout=900, extra=("--fits",))
    assert "fits only when sharded" in out
    for row in ("plain, no limit", "sharded, no limit", "plain, memory_budget", "sharded, memory_budget",
                "plain, allocator limit", "sharded, allocator limit", "without the optimizer's update"):
        assert row in out, row
    assert "MemoryBudgetError" in out


@pytest.mark.benchmark
def test_keras_fit_bench_quick_prints_the_table():
    out = _run(KERAS_FIT_BENCH, timeout=900)
    assert "smp_tf Keras fit benchmark (quick)" in out
    header = next(line for line in out.splitlines() if line.startswith("case"))
    for column in ("samples/s", "time/keras", "vs P=1 same M", "bound", "sim bound", "eff", "target", "result"):
        assert column in header, column
    rows = [line for line in out.splitlines() if line.startswith("(")]
    assert any(r.startswith("(a) plain Keras fit") for r in rows), out
    assert any(r.startswith("(b) smp fit, one device") for r in rows), out
    pipelined = [r.split() for r in rows if r.startswith("(c) smp fit, pipeline")]
    assert {r[6] for r in pipelined} == {"simple", "interleaved"}, out
    assert "P=1 overhead target" in out and "NOT MEASURED" not in out


@pytest.mark.benchmark
def test_pipeline_processes_bench_quick_prints_the_table():
    out = _run(PIPELINE_PROCESSES_BENCH, timeout=900)
    assert "smp_tf pipeline across processes benchmark (--quick" in out
    for row in ("(a) step, P=2 in one process", "(a) step, P=2 across 2 processes", "sharing both CPUs",
                "(b) bytes sent on loopback",
                "(c) TensorFlow bandwidth", "(c) plain TCP bandwidth", "(c) call of a function",
                "(d) profiled step, one / two processes: call to first action", "(d) pipeline span",
                "(d) device 0 busy in the span", "(d) device 1 idle in the span", "(d) last action to result",
                "(e) CPU time per step, one process", "(e) CPU time per step, two processes",
                "(e) cores kept busy"):
        assert row in out, row
    assert "Where the difference goes" in out
    # Both processes' CPU time was read (the driver found its peer by pid).
    row = next(line for line in out.splitlines() if line.startswith("(e) CPU time per step, two processes"))
    assert float(row.split()[-1]) > 0, row


@pytest.mark.benchmark
def test_timeline_bench_quick_prints_the_table():
    out = _run(TIMELINE_BENCH, timeout=900)
    assert "smp_tf measured timeline (--quick" in out
    names = ("simple", "interleaved", "zero_bubble", "interleaved/v2", "zero_bubble/v2")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in names]
    assert {(r[0], r[1]) for r in rows} == {(s, m) for s in names for m in ("2", "4", "8")}


def _bench_module(path: Path = PIPELINE_BENCH):
    """A benchmark script loaded as a module (its ``main`` does not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"smp_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pipeline_result(bench, two_device_cpu: float) -> dict:
    """A pipeline part's raw result with made-up timings: one device 100 ms,
    two halves 100 ms on one device and 52 ms on two, every pipeline 60 ms."""
    case = lambda wall, cpu=None: {"wall": wall, "cpu": wall if cpu is None else cpu}
    cases = {"one_device": case(0.100), "halves_one_device": case(0.100),
             "halves_two_devices": case(0.052, two_device_cpu)}
    for M in bench.MICROBATCHES:
        cases[f"mbref_{M}"] = case(0.110)
        for sched, options in bench.VARIANTS:
            cases[bench._pipe_name(sched, options, M)] = dict(case(0.060, 0.110), sim_bubble=0.1, plan="plan")
    return {"pipeline": {"part": "pipeline", "sizes": {"layers": 8, "width": 1024, "batch": 256},
                         "pinning": "pinned", "threads": [1, 2], "cases": cases}}


class _Args:
    quick, repeats, warmup, firstcall_repeats = False, 7, 2, 3


def test_pipeline_bench_table_counts_efficiency_only_with_a_trustworthy_ceiling():
    bench = _bench_module()
    # Both cores busy during (b): eff = (100/60) / (100/52 * 16/9 / 2) = 0.975.
    quiet = bench.build_table(_pipeline_result(bench, two_device_cpu=0.100), _Args)
    assert "NOISY" not in quiet and "WARNING" not in quiet
    assert "met by simple" in quiet and "overall: PASS (1 of 1 targets met)" in quiet
    # 1.2 cores busy: another load shared the cores; the target is not counted.
    noisy = bench.build_table(_pipeline_result(bench, two_device_cpu=0.0624), _Args)
    assert "WARNING: (b) on two devices used 1.20 cores" in noisy
    assert noisy.count("NOISY") == len(bench.VARIANTS)  # the M=8 rows
    assert "overall: FAIL (0 of 1 targets met)" in noisy


MEMORY_BENCH = ROOT / "benchmarks" / "memory" / "bench.py"
MEMORY_GPU_LIMITED = ROOT / "benchmarks" / "memory" / "gpu_limited.py"


@pytest.mark.benchmark
def test_memory_bench_quick_prints_the_table_and_targets():
    out = _run(MEMORY_BENCH, timeout=1800)
    assert "smp_tf memory benchmark (quick)" in out
    header = next(line for line in out.splitlines() if line.startswith("config "))
    for column in ("loss", "peak part", "pred total", "pred act", "act vs never", "measured/part MiB", "max/mean",
                   "proc pred", "proc meas", "meas/pred", "ms/step", "vs never"):
        assert column in header, column
    for case in ("P=1 interleaved never", "P=2 simple selective", "P=4 interleaved full",
                 "P=4 interleaved never optimize=memory", "(ref) one device, plain tf.function"):
        assert case in out, case
    assert "FAILED" not in out  # no row crashed
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("targets ("))
    targets = [line for line in lines[start + 1:] if line.startswith("  ")]
    # full and selective at P=2 and P=4, optimize=memory, process peak
    assert len(targets) == 6, targets
    for line in targets:
        assert line.split()[0] in ("PASS", "FAIL"), line
    assert any(line.startswith("overall: ") for line in lines[start:])


MEMORY_CPU_LIMITED = ROOT / "benchmarks" / "memory" / "cpu_limited.py"


@pytest.mark.benchmark
def test_memory_cpu_limited_quick_one_device_runs_out_and_the_pipeline_trains():
    out = _run(MEMORY_CPU_LIMITED, timeout=1800)
    rows = {line[:30].strip(): line[30:].split()[0] for line in out.splitlines()
            if line.startswith(("one device", "P="))}
    assert rows["one device, plain tf.function"] == "OOM", out
    assert rows["P=4 M=8 interleaved never"] == "trains", out
    assert rows["P=4 M=8 interleaved full"] == "trains", out
    assert "FAILED" not in out


def test_memory_cpu_limited_reads_an_oom_out_of_tensorflows_log_and_prints_the_table():
    cpu_limited = _bench_module(MEMORY_CPU_LIMITED)
    log = ("W0000 local_rendezvous.cc:412] Local rendezvous is aborting with status: RESOURCE_EXHAUSTED: OOM when "
           "allocating tensor with shape[2,4,256,256] and type bool on /job:localhost/replica:0/task:0/device:CPU:2 "
           "by allocator bfc_cpu_allocator_for_gpu\nW0000 ... CANCELLED: RecvAsync is cancelled.")
    assert cpu_limited._oom_line(log) == ("OOM when allocating tensor with shape[2,4,256,256] and type bool on "
                                          "/job:localhost/replica:0/task:0/device:CPU:2")
    assert cpu_limited._oom_line("CANCELLED: RecvAsync is cancelled.") == ""
    args = cpu_limited.parse_args(["--quick"])
    table = cpu_limited.build_table([
        {"label": "one device, plain tf.function", "status": "OOM", "error": "OOM when allocating tensor"},
        {"label": "P=4 M=8 interleaved never", "status": "trains", "loss": 5.5, "seconds": 3.0, "peak": 24 * 2**20},
    ], args)
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB=40" in table
    assert any(line.split()[:4] == ["one", "device,", "plain", "tf.function"] and "OOM" in line
               for line in table.splitlines())
    assert any(line.startswith("P=4 M=8 interleaved never") and "trains" in line and "24.0" in line
               for line in table.splitlines())


def _gpu_may_be_visible() -> bool:
    """Whether an NVIDIA GPU may be visible (then the GPU benchmark would run
    in full: this test is for machines without one)."""
    import shutil

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(_gpu_may_be_visible(), reason="a GPU may be visible: gpu_limited.py would run in full")
def test_memory_gpu_limited_skips_without_a_gpu():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.run(
        [sys.executable, str(MEMORY_GPU_LIMITED)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines() == [
        "SKIPPED: no GPU visible to TensorFlow (this benchmark needs one physical GPU, split into logical GPUs "
        "with memory limits)"
    ], proc.stdout


def test_schedules_table_rows():
    """The simulator's schedule table (pure Python, in the default run):
    every schedule at every P and M, virtual stages with less bubble and
    Megatron-LM's activation figure."""
    schedules_table = _bench_module(ROOT / "benchmarks" / "pipeline" / "schedules_table.py")
    rows = {(name, P, M): (bubble, peak, msgs) for name, P, M, bubble, peak, msgs in schedules_table.rows()}
    for P in (4, 8):
        for M in (8, 16, 32):
            one, virtual = rows[("interleaved", P, M)], rows[("interleaved v=2", P, M)]
            assert virtual[0] == pytest.approx((P - 1) / (2 * M + P - 1))
            assert virtual[0] < one[0] and rows[("zero_bubble v=2", P, M)][0] < virtual[0]
            assert virtual[2] == 2 * (2 * P - 1) * M
    assert rows[("interleaved v=2", 4, 8)][1] == pytest.approx(4 * (1 + 3 / 8))


@pytest.mark.benchmark
def test_first_call_bench_quick_prints_the_table():
    out = _run(FIRST_CALL_BENCH, timeout=300)
    assert "smp_tf first-call benchmark" in out
    header = next(line for line in out.splitlines() if line.startswith("model "))
    for column in ("plain s", "smp s", "ratio", "trace", "partition", "functions", "execute", "target", "result"):
        assert column in header, column
    rows = [line.split() for line in out.splitlines() if line.startswith(("lstm ", "noise_dropout "))]
    assert len(rows) == 2 and all(r[-1] in ("PASS", "FAIL") for r in rows), out
    assert "overall:" in out


def test_first_call_bench_table_gives_each_model_a_verdict():
    bench = _bench_module(FIRST_CALL_BENCH)
    smp = dict(total=3.0, trace=2.0, execute=1.0, step_trace=1.0, partition=0.2, tasks=0.1, functions=0.4,
               emit=0.3, ops=100, tasks_n=3)
    rows = {"fast": {"plain": [dict(total=2.0, trace=1.0, execute=1.0)], "smp": [smp]},
            "slow": {"plain": [dict(total=1.0, trace=0.5, execute=0.5)], "smp": [smp]},
            "broken": {"plain": [{"error": "exit code 1"}], "smp": [smp]}}
    table = bench.build_table(rows, type("Args", (), {"rounds": 1}))
    lines = {line.split()[0]: line.split() for line in table.splitlines() if line.split()[:1] in (["fast"], ["slow"])}
    assert lines["fast"][4] == "1.50" and lines["fast"][-1] == "PASS"
    assert lines["slow"][4] == "3.00" and lines["slow"][-1] == "FAIL"
    assert "broken FAILED:" in table
    assert "overall: FAIL (1 of 3 models within 2.0x)" in table
    assert "loop s" not in table


def test_first_call_bench_table_with_the_micro_batch_loop():
    """With --loop the table also shows the loop's first call and smp/loop;
    the verdict stays smp against plain."""
    bench = _bench_module(FIRST_CALL_BENCH)
    smp = dict(total=3.0, trace=2.0, execute=1.0, step_trace=1.0, partition=0.2, tasks=0.1, functions=0.4,
               emit=0.3, ops=100, tasks_n=3)
    rows = {"m": {"plain": [dict(total=1.0, trace=0.5, execute=0.5)],
                  "loop": [dict(total=2.5, trace=1.5, execute=1.0), dict(total=1.5, trace=1.0, execute=0.5),
                           dict(total=2.0, trace=1.2, execute=0.8)],
                  "smp": [smp]}}
    table = bench.build_table(rows, type("Args", (), {"rounds": 3, "microbatches": 4}))
    header = next(line for line in table.splitlines() if line.startswith("model "))
    assert header.split()[:9] == ["model", "ops", "plain", "s", "loop", "s", "smp", "s", "ratio"]
    row = next(line.split() for line in table.splitlines() if line.startswith("m "))
    # plain 1.00, loop median 2.00, smp 3.00, smp/plain 3.00, smp/loop 1.50
    assert row[2:7] == ["1.00", "2.00", "3.00", "3.00", "1.50"] and row[-1] == "FAIL"
    assert "same 4 micro-batches" in table


def test_first_call_runtime_breakdown_reads_tensorflows_log():
    """The --runtime split of a first execution, on a hand-written log: the
    first function prepared is the outer one; each line lasts until the
    thread's next one; lines outside the execution are left out."""
    bench = _bench_module(FIRST_CALL_BENCH)
    log = "\n".join([
        "I0000 00:00:99.000000  7 process_function_library_runtime.cc:518] Instantiating MultiDevice function \"warm\"",
        "I0000 00:00:100.000000  7 process_function_library_runtime.cc:518] Instantiating MultiDevice function \"outer\"",
        "I0000 00:00:100.100000  7 optimization_registry.cc:72] Running optimization pass: LowerFunctionalOpsPass",
        "I0000 00:00:100.400000  7 optimization_registry.cc:72] Running optimization pass: ParallelConcatRemovePass",
        "I0000 00:00:100.500000  7 meta_optimizer.cc:1059] Starting optimization for grappler item: outer",
        "I0000 00:00:100.600000  7 meta_optimizer.cc:973] function_optimizer: Graph size after: 9 nodes (0), "
        "9 edges (0), time = 250.0ms.",
        "I0000 00:00:100.800000  7 meta_optimizer.cc:973] tfg_optimizer{any(tfg-toposort)}: Graph size after: "
        "9 nodes (0), 9 edges (0), time = 100.0ms.",
        "Python prints in between are not log lines",
        "I0000 00:00:101.000000  7 meta_optimizer.cc:1311] Optimized 0 functions: ",
        "W0000 00:00:101.100000  7 dump_graph.cc:162] Failed to dump after_MetaOptimizer",
        "I0000 00:00:101.200000  7 optimization_registry.cc:72] Running optimization pass: EncapsulateSubgraphsPass",
        "I0000 00:00:101.700000  7 optimization_registry.cc:72] Running optimization pass: BuildXlaOpsPass",
        "I0000 00:00:101.800000  7 process_function_library_runtime.cc:912] Instantiated MultiDevice function "
        "\"outer\" with handle 3",
        "I0000 00:00:102.000000  8 process_function_library_runtime.cc:518] Instantiating MultiDevice function \"task\"",
        "I0000 00:00:102.100000  8 meta_optimizer.cc:1059] Starting optimization for grappler item: task",
        "I0000 00:00:102.400000  8 meta_optimizer.cc:1311] Optimized 0 functions: ",
        "I0000 00:00:102.500000  8 process_function_library_runtime.cc:912] Instantiated MultiDevice function "
        "\"task\" with handle 4",
        "I0000 00:00:109.000000  8 process_function_library_runtime.cc:518] Instantiating MultiDevice function \"late\"",
    ])
    events = bench.parse_tf_log(log, year=2026)
    assert len(events) == 17
    b = bench.runtime_breakdown(events, start=100.0, end=103.0)
    outer, nested = b["outer"], b["nested"]
    assert b["outer_name"] == "outer" and b["nested_count"] == 1
    assert outer["seconds"] == pytest.approx(1.8)
    assert outer["lowering"] == pytest.approx(0.3)
    assert outer["grappler"] == pytest.approx(0.6)  # 100.5 until the line after "Optimized 0 functions"
    assert outer["function_optimizer"] == pytest.approx(0.25) and outer["tfg"] == pytest.approx(0.1)
    assert outer["encapsulate"] == pytest.approx(0.5) and outer["xla"] == pytest.approx(0.6)
    assert outer["other"] == pytest.approx(1.8 - 0.3 - 0.6 - 0.6)
    assert nested["seconds"] == pytest.approx(0.5) and nested["grappler"] == pytest.approx(0.4)
    # The dated form of a log line (absl initialised) reads as local time.
    (t, thread, source, message), = bench.parse_tf_log(
        "I1127 03:12:01.250000    42 meta_optimizer.cc:1092] Optimized main graph.", year=2026)
    assert t == pytest.approx(time.mktime((2026, 11, 27, 3, 12, 0, 0, 0, -1)) + 1.25)
    assert (thread, source, message) == ("42", "meta_optimizer.cc", "Optimized main graph.")
    # The form of older releases (no thread id), local time as well.
    (t, thread, source, message), = bench.parse_tf_log(
        "2026-11-27 03:12:01.250000: I tensorflow/core/grappler/optimizers/meta_optimizer.cc:1092] "
        "Optimized main graph.", year=1999)
    assert t == pytest.approx(time.mktime((2026, 11, 27, 3, 12, 0, 0, 0, -1)) + 1.25)
    assert (thread, source, message) == ("?", "meta_optimizer.cc", "Optimized main graph.")


def test_first_call_runtime_breakdown_reads_a_real_log():
    """The same split on the log of a real first execution: a function that
    calls a `_noinline` function once is one outer window with grappler
    time and one nested window. Catches a change of TensorFlow's log lines."""
    bench = _bench_module(FIRST_CALL_BENCH)
    code = (
        "import time, tensorflow as tf\n"
        "def inner_fn(x):\n    return tf.tanh(x) * 2.0\n"
        "def outer_fn(x):\n    return inner(x) + 1.0\n"
        "inner = tf.function(inner_fn, autograph=False, experimental_attributes={'_noinline': True})\n"
        "outer = tf.function(outer_fn, autograph=False)\n"
        "x = tf.ones([4])\n"
        "outer.get_concrete_function(x)\n"
        "t0 = time.time(); outer(x).numpy(); t1 = time.time()\n"
        "print('WINDOW', t0, t1)\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=bench.RUNTIME_VMODULE)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t0, t1 = (float(v) for v in proc.stdout.split("WINDOW")[1].split())
    events = bench.parse_tf_log(proc.stderr, year=time.localtime(t0).tm_year)
    b = bench.runtime_breakdown(events, t0, t1)
    assert "outer_fn" in b["outer_name"], b
    assert b["nested_count"] == 1, b
    assert 0 < b["outer"]["seconds"] <= t1 - t0
    assert b["outer"]["grappler"] > 0 and b["nested"]["grappler"] > 0
    assert b["outer"]["function_optimizer"] > 0  # the outer graph has a function library


@pytest.mark.benchmark
def test_tensor_parallel_bench_quick_prints_the_table():
    out = _run(TENSOR_PARALLEL_BENCH, timeout=900)
    header = next(line for line in out.splitlines() if line.startswith("case"))
    for column in ("t=1 plain s", "t=2 smp s", "plain/t2", "target", "activations all-reduced", "Megatron"):
        assert column in header, column
    for case in ("MLP block", "GPT-2 block", "variables + Adam slots on the fullest device"):
        assert case in out, case
    assert "error" not in out


PLANNER_BENCH = ROOT / "benchmarks" / "planner" / "bench.py"
HETEROGENEOUS_BENCH = ROOT / "benchmarks" / "planner" / "heterogeneous.py"


@pytest.mark.benchmark
def test_planner_bench_quick_prints_its_tables():
    out = _run(PLANNER_BENCH, timeout=1500)
    assert "== planner against measurement: mlp" in out and "== planner against measurement: gpt2" in out
    assert "Spearman" in out and "measure(3)'s choice" in out and "after learning" in out
    assert "== search time" in out and out.count("<= 30 s") == 6
    assert "predicted to fit:" in out


@pytest.mark.benchmark
def test_heterogeneous_bench_quick_prints_its_table():
    out = _run(HETEROGENEOUS_BENCH, timeout=900)
    assert "speed-oblivious / speed-aware step" in out and "speed-oblivious / learned step" in out
    assert "bound: the best split of" in out


def test_heterogeneous_split_bound_tries_every_split():
    bench = _bench_module(HETEROGENEOUS_BENCH)
    assert bench.split_bound([1.0, 1.0, 1.0], 12) == pytest.approx(1.0)
    # Twice as fast: 6:3:3 takes 6 layers' time against 4 x 2 for 4:4:4.
    assert bench.split_bound([2.0, 1.0, 1.0], 12) == pytest.approx(8 / 6)
    # 1.8 times: 6:3:3 takes 6 against 7.2; no split of 12 does better.
    assert bench.split_bound([1.8, 1.0, 1.0], 12) == pytest.approx(7.2 / 6)
    # The order of the stages does not matter, nor does which is fast.
    assert bench.split_bound([1.0, 1.0, 1.8], 12) == pytest.approx(7.2 / 6)
    # 13 layers: the equal split is 5:4:4 (the fast stage first: its
    # slowest is a slow stage's 4 layers); 7:3:3 takes 3.5.
    assert bench.split_bound([1.0, 1.0, 1.0], 13) == pytest.approx(1.0)
    assert bench.split_bound([2.0, 1.0, 1.0], 13) == pytest.approx(4 / 3.5)


AT_SCALE_BENCH = ROOT / "benchmarks" / "planner" / "at_scale.py"


@pytest.mark.benchmark
def test_planner_at_scale_quick_prints_every_case():
    out = _run(AT_SCALE_BENCH, timeout=900)
    header = next(line for line in out.splitlines() if line.startswith("case"))
    for column in ("search s", "tracing s", "best row", "samples/s", "tokens/s", "MFU"):
        assert column in header, column
    for case in ("on 8 x 8 A100-like", "Llama 134M", "on 8 V100"):
        assert case in out, case
    assert "published Megatron-LM (DLPerf" in out
