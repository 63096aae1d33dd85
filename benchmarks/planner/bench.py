"""The planner against measurement, its search time, and plans under a memory limit.

Prints one table per part; every figure is measured by this invocation:

(a) **the planner against measurement** (``--part accuracy``), for the MLP
    of ``benchmarks/pipeline`` (8 x Dense(1024), batch 256, MSE, SGD) and a
    GPT-2 (keras_hub, 4 layers, width 256, sequence 64, vocabulary 2048,
    batch 16, Adam), each in its own process with 4 logical CPU devices on
    this machine's cores. `smp.plan` on the calibrated cluster (cores
    shared, as they are) with ``probe=True`` predicts every candidate of up
    to 4 devices (after probing two candidates, the one that runs the most
    ops and the one device alone: the runtime's cost per op run and the
    share of the ops' parallelism a device realizes, fitted to their
    measured steps, are what every row is predicted again with); at least
    12 fitting
    candidates spread over the ranking are then run for
    real (`smp.init` with the row's config, 2 untimed and 7 timed steps,
    median), in 5 passes over them in alternating order (``--passes``; a
    candidate's figure is the median of its passes). Reported: mean
    |predicted - measured| / measured, Spearman's rank correlation, the
    planner's first choice against the best measured
    candidate, and `plan.measure(3)`'s choice likewise, and the first
    search's predictions (before the probe). Then the cost model
    learns from the three runs `measure` profiled (`plan.learned()`) and a
    second plan on the learned cluster predicts the same candidates again.
    Targets: error <= 15%, Spearman >= 0.8, choice within 10% of the best
    (within 5% with measure(3)).
(b) **search time** (``--part search``): `smp.plan` on declared clusters of
    4, 16 and 64 GPUs (8 per host) for the MLP and a GPT-2 of GPT-2-small
    size (12 layers, width 768, vocabulary 50257, sequence 256, batch 64,
    Adam), tracing included. Target: <= 30 s.
(c) **no plan that does not fit** (``--part oom``): an MLP of 8 x
    Dense(2048) with Adam under ``TF_CPU_BFC_MEM_LIMIT_IN_MB=1536`` (one shared
    allocator for the process's 4 logical devices; the planner gives each
    device a quarter of it). Every candidate predicted to fit, and up to 4
    predicted not to, runs one step in its own process under the limit.
    Target: no candidate predicted to fit runs out of memory; the table
    says how many of those predicted not to fit did.

Run ``python benchmarks/planner/bench.py`` (``--quick`` for small sizes:
checks the script, the figures mean nothing; ``--part`` for one part).
The heterogeneous 3-process pipeline is ``heterogeneous.py`` beside this
file; the memory model's ratios per recompute mode are
``benchmarks/memory/ratios.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.pop("TF_DETERMINISTIC_OPS", None)  # the profile's clock needs it off

_MARK = "@@SMP_PLANNER_RESULT@@"


def _emit(obj: Any) -> None:
    print(_MARK + json.dumps(obj), flush=True)


def _spearman(a: List[float], b: List[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 0.0


# ---------------------------------------------------------------------------
# Models


def _mlp(smp, width: int, layers: int, batch: int, optimizer: str):
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    inp = keras.Input((width,))
    h = inp
    for i in range(layers):
        h = keras.layers.Dense(width, activation="relu", name=f"d{i}")(h)
    model = smp.DistributedModel(inp, h)
    opt = keras.optimizers.SGD(1e-3) if optimizer == "sgd" else keras.optimizers.Adam(1e-4)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, width)).astype("float32")
    y = rng.normal(size=(batch, width)).astype("float32")
    return model, step, opt, (x, y)


def _gpt2(smp, layers: int, width: int, seq: int, vocab: int, batch: int):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab, num_layers=layers, num_heads=max(width // 64, 1), hidden_dim=width,
        intermediate_dim=4 * width, dropout=0.0, max_sequence_length=seq)
    return lm_step(smp, backbone, seq, vocab, batch)


def lm_step(smp, backbone: Any, seq: int, vocab: int, batch: int):
    """A language model of a keras_hub backbone (its embedding read
    reversed for the logits) as a `DistributedModel`, its `smp.step`
    (sparse cross-entropy), Adam and one batch of random tokens:
    (model, step, optimizer, (x, y))."""
    import keras
    import numpy as np
    import tensorflow as tf

    inputs = {"token_ids": keras.Input((seq,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((seq,), dtype="int32", name="padding_mask")}
    model = smp.DistributedModel(inputs, backbone.token_embedding(backbone(inputs), reverse=True))
    opt = keras.optimizers.Adam(1e-4)

    @smp.step
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch, seq), "int32")}
    return model, step, opt, (x, tokens[:, 1:])


def _build(smp, name: str, quick: bool):
    if name == "mlp":
        return _mlp(smp, 256 if quick else 1024, 8, 64 if quick else 256, "sgd")
    if name == "gpt2":
        return _gpt2(smp, 2 if quick else 4, 64 if quick else 256, 16 if quick else 64, 256 if quick else 2048,
                     8 if quick else 16)
    if name == "gpt2_small":
        if quick:
            return _gpt2(smp, 2, 128, 32, 1024, 16)
        return _gpt2(smp, 12, 768, 256, 50257, 64)
    if name == "mlp_big":
        return _mlp(smp, 512 if quick else 2048, 8, 64 if quick else 256, "adam")
    raise ValueError(name)


# ---------------------------------------------------------------------------
# (a) accuracy


def _spread(rows: List[Any], n: int) -> List[Any]:
    """`n` rows spread evenly over the ranking (the first and last included)."""
    if len(rows) <= n:
        return list(rows)
    picks = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in picks]


def part_accuracy(args) -> None:
    import smp_tf as smp
    from smp_tf.planner.plan import time_step

    smp.init({"partitions": 4})
    model, step, opt, batch = _build(smp, args.model, args.quick)
    graph = smp.cluster(refresh=True)
    t0 = time.perf_counter()
    plan = smp.plan(step, *batch, optimizer=opt, replicas=[1], keep=40, tensor_parallel_degrees=[1, 2],
                    recompute=["never"], probe=True)
    search_s = time.perf_counter() - t0 - plan.probe.seconds
    # The first search's predictions, before the probe (the same cluster).
    unprobed = {r.candidate.label(): r.step_time for r in smp.plan(
        step, *batch, optimizer=opt, cluster=graph, replicas=[1], keep=200, tensor_parallel_degrees=[1, 2],
        recompute=["never"]).rows}
    fitting = [r for r in plan.rows if r.fits]
    chosen_rows = _spread(fitting, 6 if args.quick else 14)
    steps = 3 if args.quick else 7
    # measure(3) first: it profiles its runs, which the learned cluster needs.
    picked = plan.measure(3, steps=steps, warmup=2)
    measure_three = {r.candidate.label(): r.measured for r in fitting[:3]}
    measured: Dict[str, float] = dict(measure_three)
    for row in chosen_rows:
        if row.candidate.label() in measured:
            row.measured = measured[row.candidate.label()]
            continue
        smp.init(row.config)
        row.measured = time_step(step, batch, {}, steps, 2)
        measured[row.candidate.label()] = row.measured
    runs = [r for r in fitting if r.candidate.label() in measured]
    # More passes, alternating the order: a candidate's figure is the median
    # of its passes (another process's burst slows one pass, not all), and
    # the passes against each other show how much the machine itself moves
    # between measurements of the same candidate minutes apart.
    passes: Dict[str, List[float]] = {label: [m] for label, m in measured.items()}
    for n in range(1, args.passes):
        for row in (reversed(runs) if n % 2 else runs):
            smp.init(row.config)
            passes[row.candidate.label()].append(time_step(step, batch, {}, steps, 2))
    learned = plan.learned()
    again = smp.plan(step, *batch, optimizer=opt, cluster=learned, replicas=[1], keep=60,
                     tensor_parallel_degrees=[1, 2], recompute=["never"])
    second = {r.candidate.label(): r.step_time for r in again.rows}
    out = {
        "model": args.model, "cluster": graph.table(), "learned": learned.table(), "search_s": search_s,
        "candidates": plan.evaluated, "fitting": len(fitting),
        "probe": dataclasses.asdict(plan.probe), "probe_line": plan.probe.summary(),
        "rows": [{"label": r.candidate.label(), "predicted": r.step_time,
                  "unprobed": unprobed.get(r.candidate.label()),
                  "measured": statistics.median(passes[r.candidate.label()]),
                  "passes": passes[r.candidate.label()],
                  "learned": second.get(r.candidate.label()), "rank": fitting.index(r) + 1} for r in runs],
        "first_choice": fitting[0].candidate.label(), "measure3": picked.candidate.label(),
        "learned_choice": again.best.candidate.label(),
    }
    _emit(out)


def _accuracy_table(res: Dict[str, Any]) -> List[str]:
    rows = res["rows"]
    probe = res["probe"]
    lines = [f"== planner against measurement: {res['model']} ({res['candidates']} candidates predicted twice in "
             f"{res['search_s']:.1f} s, {res['fitting']} fit; {len(rows)} run) ==",
             f"probe ({probe['seconds']:.1f} s): {res['probe_line']}; every row below predicted with them",
             f"{'rank':>4}  {'candidate':<34} {'predicted ms':>12} {'measured ms':>12} {'error':>7} "
             f"{'learned ms':>11} {'error':>7}  passes ms"]
    for r in sorted(rows, key=lambda r: r["rank"]):
        err = (r["predicted"] - r["measured"]) / r["measured"]
        le = "" if r["learned"] is None else f"{r['learned'] * 1e3:11.2f} {(r['learned'] - r['measured']) / r['measured']:+7.1%}"
        passes = " / ".join(f"{x * 1e3:.1f}" for x in r.get("passes", ()))
        lines.append(f"{r['rank']:>4}  {r['label']:<34} {r['predicted'] * 1e3:12.2f} {r['measured'] * 1e3:12.2f} "
                     f"{err:+7.1%} {le}  {passes}")
    meas = [r["measured"] for r in rows]
    best = min(meas)
    by_label = {r["label"]: r["measured"] for r in rows}
    mean_err = statistics.mean(abs(r["predicted"] - r["measured"]) / r["measured"] for r in rows)
    rho = _spearman([r["predicted"] for r in rows], meas)
    learned = [r for r in rows if r["learned"] is not None]
    mean_learned = statistics.mean(abs(r["learned"] - r["measured"]) / r["measured"] for r in learned) if learned else None
    rho_learned = _spearman([r["learned"] for r in learned], [r["measured"] for r in learned]) if learned else None
    first = by_label.get(res["first_choice"])
    m3 = by_label.get(res["measure3"])

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    lines.append(f"mean |predicted - measured| / measured: {mean_err:.1%} (target <= 15%: {verdict(mean_err <= 0.15)}); "
                 f"Spearman {rho:.2f} (target >= 0.8: {verdict(rho >= 0.8)})")
    if all(r.get("unprobed") is not None for r in rows):
        unprobed = [r["unprobed"] for r in rows]
        lines.append(f"  before the probe: mean error "
                     f"{statistics.mean(abs(u - m) / m for u, m in zip(unprobed, meas)):.1%}, "
                     f"Spearman {_spearman(unprobed, meas):.2f}")
    if mean_learned is not None:
        lines.append(f"after learning from measure(3)'s profiled runs: mean error {mean_learned:.1%} "
                     f"({verdict(mean_learned <= 0.15)}), Spearman {rho_learned:.2f} ({verdict(rho_learned >= 0.8)})")
    if first is not None:
        lines.append(f"planner's choice {res['first_choice']}: {first * 1e3:.2f} ms, {first / best:.3f} x the best "
                     f"measured (target <= 1.10: {verdict(first <= 1.10 * best)})")
    if m3 is not None:
        lines.append(f"measure(3)'s choice {res['measure3']}: {m3 * 1e3:.2f} ms, {m3 / best:.3f} x the best measured "
                     f"(target <= 1.05: {verdict(m3 <= 1.05 * best)})")
    lines.append(f"second plan's choice (learned cluster): {res['learned_choice']}")
    return lines + _self_agreement(rows)


def _self_agreement(rows: List[Dict[str, Any]]) -> List[str]:
    """The measurement against itself, what no prediction can beat: each
    pair of passes, and (with three or more) one pass against the median of
    the others. No lines with fewer than two passes."""
    n = min((len(r.get("passes", ())) for r in rows), default=0)
    if n < 2:
        return []
    passes = [r["passes"] for r in rows]
    pairs = list(itertools.combinations(range(n), 2))
    rho_pairs = [_spearman([p[i] for p in passes], [p[j] for p in passes]) for i, j in pairs]
    drift = statistics.mean(abs(p[i] - p[j]) / ((p[i] + p[j]) / 2) for p in passes for i, j in pairs)
    lines = [f"the measurement against itself ({n} passes, minutes apart): Spearman between two passes "
             f"{' / '.join(f'{x:.2f}' for x in rho_pairs)}, mean |difference| / mean {drift:.1%}"]
    if n >= 3:
        rho_rest = [_spearman([p[i] for p in passes], [statistics.median(p[:i] + p[i + 1:]) for p in passes])
                    for i in range(n)]
        lines.append(f"  one pass against the median of the others: Spearman "
                     f"{' / '.join(f'{x:.2f}' for x in rho_rest)}")
    return lines


# ---------------------------------------------------------------------------
# (b) search time


def _gpus(n: int) -> Dict[str, Any]:
    hosts = {}
    for h in range(max(n // 8, 1)):
        hosts[f"node{h}"] = {"devices": [
            {"name": f"GPU:{i}", "kind": "GPU", "memory": 16e9, "overhead": 5e-6,
             "flops": {"matmul": 1e14, "conv": 7e13, "elementwise": 1e12}} for i in range(min(n, 8))]}
    return {"hosts": hosts, "links": {"host": {"bandwidth": 1e11, "latency": 5e-6},
                                      "network": {"bandwidth": 1.25e10, "latency": 2e-5}}}


def part_search(args) -> None:
    import smp_tf as smp

    smp.init({"partitions": 1})
    model, step, opt, batch = _build(smp, args.model, args.quick)
    for n in (4, 16, 64):
        t0 = time.perf_counter()
        plan = smp.plan(step, *batch, optimizer=opt, cluster=_gpus(n))
        seconds = time.perf_counter() - t0
        best = plan.best
        _emit({"model": args.model, "devices": n, "seconds": seconds, "trace": plan.trace_seconds,
               "candidates": plan.evaluated, "skipped": len(plan.skipped), "best": best.candidate.label(),
               "step_ms": best.step_time * 1e3})


# ---------------------------------------------------------------------------
# (c) no plan that does not fit


def part_oom_plan(args) -> None:
    import smp_tf as smp

    smp.init({"partitions": 4})
    model, step, opt, batch = _build(smp, "mlp_big", args.quick)
    per_device = args.limit_mb * 2**20 // 4
    plan = smp.plan(step, *batch, optimizer=opt, replicas=[1], memory_budget=per_device, keep=12,
                    tensor_parallel_degrees=[1, 2], pipelines=["interleaved"], virtual_stages=[1])
    rows = [r for r in plan.rows if r.fits] + [r for r in plan.rows if not r.fits][:4]
    _emit({"rows": [{"config": r.config, "label": r.candidate.label(), "fits": r.fits,
                     "peak": sum(r.peak.values()), "max_peak": r.max_peak} for r in rows],
           "per_device": per_device})


def part_oom_run(args) -> None:
    import tensorflow as tf

    import smp_tf as smp

    config = json.loads(args.config)
    smp.init({**config, "partitions": config["partitions"]})
    model, step, opt, batch = _build(smp, "mlp_big", args.quick)
    try:
        for _ in range(2):
            loss, grads = step(*batch)
            opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
            float(loss.reduce_mean())
        _emit({"ok": True})
    except (tf.errors.ResourceExhaustedError, tf.errors.InternalError) as e:
        _emit({"ok": False, "error": type(e).__name__})


# ---------------------------------------------------------------------------
# Driver


def _run(part: str, extra: List[str], env: Dict[str, str], timeout: float) -> List[Dict[str, Any]]:
    cmd = [sys.executable, __file__, "--part", part] + extra
    try:
        p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:.0f} s"}]
    out = [json.loads(line[len(_MARK):]) for line in p.stdout.splitlines() if line.startswith(_MARK)]
    if not out:
        tail = (p.stderr or "").strip().splitlines()[-3:]
        return [{"error": f"exit {p.returncode}: {' | '.join(tail)}"}]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["accuracy", "search", "oom", "oom-plan", "oom-run", "all"], default="all")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--config", default=None)
    ap.add_argument("--limit-mb", type=int, default=0)
    ap.add_argument("--passes", type=int, default=5,
                    help="accuracy: timed passes over the candidates (a candidate's figure is their median)")
    args = ap.parse_args()
    if args.part == "accuracy" and args.model:
        return part_accuracy(args)
    if args.part == "search" and args.model:
        return part_search(args)
    if args.part == "oom-plan":
        return part_oom_plan(args)
    if args.part == "oom-run":
        return part_oom_run(args)
    quick = ["--quick"] if args.quick else []
    from benchmarks.machine import versions

    print(f"machine: {os.cpu_count()} cores; {versions()}")
    started = time.perf_counter()
    if args.part in ("all", "accuracy"):
        for model in ("mlp", "gpt2"):
            res = _run("accuracy", ["--model", model, "--passes", str(args.passes)] + quick, {}, 2400)[0]
            if "error" in res:
                print(f"== planner against measurement: {model}: {res['error']}")
                continue
            print(res["cluster"])
            print("\n".join(_accuracy_table(res)))
            print("learned cluster:\n" + res["learned"])
            print()
    if args.part in ("all", "search"):
        print("== search time (declared GPU clusters, 8 per host; tracing included) ==")
        print(f"{'model':<11} {'devices':>7} {'seconds':>8} {'tracing':>8} {'predicted':>9} {'skipped':>8}  "
              f"{'best':<34} {'step ms':>8}  target")
        for model in ("mlp", "gpt2_small"):
            for res in _run("search", ["--model", model] + quick, {}, 900):
                if "error" in res:
                    print(f"{model:<11} {res['error']}")
                    continue
                ok = "PASS" if res["seconds"] <= 30 else "FAIL"
                print(f"{model:<11} {res['devices']:>7} {res['seconds']:>8.1f} {res['trace']:>8.1f} "
                      f"{res['candidates']:>9} {res['skipped']:>8}  {res['best']:<34} {res['step_ms']:>8.2f}  "
                      f"<= 30 s {ok}")
        print()
    if args.part in ("all", "oom"):
        limit = 256 if args.quick else 1536
        env = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(limit)}
        plan = _run("oom-plan", ["--limit-mb", str(limit)] + quick, env, 900)[0]
        print(f"== plans under a {limit} MiB CPU allocator limit (a quarter per logical device) ==")
        if "error" in plan:
            print(plan["error"])
        else:
            print(f"{'candidate':<34} {'predicted':>9} {'fullest MiB':>11} {'all MiB':>8}  run")
            fit_ooms = misfit_ooms = misfits = 0
            for r in plan["rows"]:
                res = _run("oom-run", ["--config", json.dumps(r["config"])] + quick, env, 600)[0]
                ok = res.get("ok")
                outcome = "trains" if ok else ("OOM" if "error" in res and ok is False else res.get("error", "?"))
                if r["fits"] and not ok:
                    fit_ooms += 1
                if not r["fits"]:
                    misfits += 1
                    misfit_ooms += int(not ok)
                print(f"{r['label']:<34} {'fits' if r['fits'] else 'no fit':>9} {r['max_peak'] / 2**20:>11.1f} "
                      f"{r['peak'] / 2**20:>8.1f}  {outcome}")
            n_fit = sum(r["fits"] for r in plan["rows"])
            print(f"predicted to fit: {n_fit}, of which ran out of memory: {fit_ooms} (target 0: "
                  f"{'PASS' if fit_ooms == 0 else 'FAIL'}); predicted not to fit: {misfits}, of which ran out of "
                  f"memory: {misfit_ooms}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
