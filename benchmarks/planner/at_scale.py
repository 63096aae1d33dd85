"""The planner on declared clusters larger than this machine: search time,
the chosen row's throughput and predicted MFU, next to published figures.

Every case plans a keras_hub GPT-2 or Llama (Adam) with ``smp.plan`` on a cluster
declared as a dict (no device of it exists here) and prints, per case, the
search time and its tracing share, the candidates predicted, and the best
row: its configuration, predicted step, samples and tokens per second and
model-flops utilisation (MFU: the model's forward and backward operations,
as the graph view counts them, over the step and the devices' product
speed). Where a published run of a comparable model on comparable
hardware exists, its figure is printed beside it.

The published figures (DLPerf's GPT report, Oneflow-Inc/DLPerf on GitHub,
Megatron-LM columns): 4 nodes of 8 V100-SXM2-16GB (125 TFLOP/s peak),
100 Gb/s InfiniBand, vocabulary 51200, sequence 2048, mixed precision:

* GPT 117M (width 768, 12 layers), 1 GPU, batch 8: 32.63 TFLOP/s per GPU,
  26% of peak, 13.09 sequences/s;
* GPT 498M (width 1536, 16 layers), 8 GPUs data-parallel, batch 16:
  41.74 TFLOP/s per GPU, 33% of peak, 33.27 sequences/s.

Megatron-LM's teraFLOP/s count the forward pass of activation
recomputation too (its formula's factor 4 instead of 3), so its figure is
up to 4/3 of the model's own operations per second.

Usage: python benchmarks/planner/at_scale.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def gpus(hosts: int, per_host: int, memory: float, matmul: float, elementwise: float, nvlink: float,
         network: float) -> Dict[str, Any]:
    """A declared cluster of `hosts` x `per_host` GPUs."""
    device = {"kind": "GPU", "memory": memory, "overhead": 5e-6,
              "flops": {"matmul": matmul, "conv": matmul * 0.7, "elementwise": elementwise}}
    return {"hosts": {f"node{h}": {"devices": [dict(device, name=f"GPU:{i}") for i in range(per_host)]}
                      for h in range(hosts)},
            "links": {"host": {"bandwidth": nvlink, "latency": 5e-6},
                      "network": {"bandwidth": network, "latency": 2e-5}}}


#: The issue's A100-like GPU: 80 GB, 2e14 FLOP/s for products, NVLink 300 GB/s, 25 GB/s between hosts.
A100 = dict(memory=80e9, matmul=2e14, elementwise=1.5e12, nvlink=3e11, network=2.5e10)
#: DLPerf's V100-SXM2-16GB: 125 TFLOP/s, NVLink (about 150 GB/s per direction), 100 Gb/s InfiniBand.
V100 = dict(memory=16e9, matmul=1.25e14, elementwise=7.5e11, nvlink=1.5e11, network=1.25e10)


def gpt2(smp: Any, layers: int, width: int, seq: int, vocab: int, batch: int, family: str = "gpt2"):
    """A keras_hub GPT-2 (or Llama, `family="llama"`) LM step, its Adam and
    one batch (`benchmarks.planner.bench.lm_step`)."""
    import keras
    import keras_hub

    from benchmarks.planner.bench import lm_step

    keras.utils.set_random_seed(0)
    if family == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocab, num_layers=layers, num_query_heads=max(width // 64, 1),
            num_key_value_heads=max(width // 64, 1), hidden_dim=width, intermediate_dim=int(width * 8 / 3) // 64 * 64)
    else:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, num_layers=layers, num_heads=max(width // 64, 1), hidden_dim=width,
            intermediate_dim=4 * width, dropout=0.0, max_sequence_length=seq)
    return lm_step(smp, backbone, seq, vocab, batch)


#: (label, model sizes, cluster, published figure or None)
CASES = [
    ("GPT-2 124M, seq 512, batch 64 on 2 x 8 A100-like",
     dict(layers=12, width=768, seq=512, vocab=50257, batch=64), dict(A100, hosts=2, per_host=8), None),
    ("GPT-2 124M, seq 512, batch 64 on 8 x 8 A100-like",
     dict(layers=12, width=768, seq=512, vocab=50257, batch=64), dict(A100, hosts=8, per_host=8), None),
    ("Llama 134M, seq 512, batch 64 on 4 x 8 A100-like",
     dict(layers=8, width=1024, seq=512, vocab=32000, batch=64, family="llama"), dict(A100, hosts=4, per_host=8),
     None),
    ("GPT 117M, seq 2048, batch 8 on 1 V100",
     dict(layers=12, width=768, seq=2048, vocab=51200, batch=8), dict(V100, hosts=1, per_host=1),
     "Megatron-LM (DLPerf MP_1x1x1_8_768x12): 26% of peak, 13.09 sequences/s"),
    ("GPT 498M, seq 2048, batch 16 on 8 V100",
     dict(layers=16, width=1536, seq=2048, vocab=51200, batch=16), dict(V100, hosts=1, per_host=8),
     "Megatron-LM (DLPerf DP_8x1x1_16_1536x16): 33% of peak, 33.27 sequences/s"),
]


def run_case(label: str, sizes: Dict[str, int], cluster: Dict[str, Any], published: Optional[str],
             quick: bool) -> Dict[str, Any]:
    import smp_tf as smp

    if quick:
        sizes = dict(sizes, layers=2, width=64, seq=32, vocab=256)
    smp.init({"partitions": 1})
    t0 = time.perf_counter()
    _, step, opt, batch = gpt2(smp, **sizes)
    build = time.perf_counter() - t0
    declared = gpus(**cluster)
    t0 = time.perf_counter()
    plan = smp.plan(step, *batch, optimizer=opt, cluster=declared)
    seconds = time.perf_counter() - t0
    best = plan.best
    return {"case": label, "build_seconds": build, "seconds": seconds, "trace": plan.trace_seconds,
            "candidates": plan.evaluated, "skipped": len(plan.skipped), "best": best.candidate.label(),
            "step_ms": best.step_time * 1e3, "samples": best.samples_per_second,
            "tokens": best.tokens_per_second, "mfu": best.mfu, "published": published,
            "devices": cluster["hosts"] * cluster["per_host"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models: checks the script, figures mean nothing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case is not None:
        print("RESULT " + json.dumps(run_case(*CASES[args.case], quick=args.quick)), flush=True)
        return
    import subprocess

    results: List[Dict[str, Any]] = []
    for k in range(len(CASES)):
        # Each case in a fresh process: smp.init first, and the memory of
        # the previous model's variables given back.
        cmd = [sys.executable, __file__, "--case", str(k)] + (["--quick"] if args.quick else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
        if done.returncode or not lines:
            results.append({"case": CASES[k][0], "error": (done.stderr or done.stdout)[-600:]})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    from benchmarks.machine import aligned

    rows = []
    for r in results:
        if "error" in r:
            rows.append((r["case"], "error", r["error"].splitlines()[-1][:80], "", "", "", "", "", ""))
            continue
        rows.append((r["case"], f"{r['seconds']:.1f}", f"{r['trace']:.1f}", str(r["candidates"]), r["best"],
                     f"{r['step_ms']:.1f}", f"{r['samples']:.1f}", f"{r['tokens'] / 1e3:.1f}k" if r["tokens"] else "-",
                     f"{100 * r['mfu']:.1f}%"))
    print("\n".join(aligned(("case", "search s", "tracing s", "predicted", "best row", "step ms", "samples/s",
                             "tokens/s", "MFU"), rows, left=[0, 4])))
    for r in results:
        if r.get("published"):
            print(f"{r['case']}: predicted MFU {100 * r['mfu']:.1f}%, {r['samples']:.2f} sequences/s; "
                  f"published {r['published']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
