"""The simulator's table of schedules: bubble, activation memory, communication.

For a chain of P stages with forward, input-gradient (B) and weight-gradient
(W) work of equal cost per stage (the setting of the zero-bubble paper's
table, Qi et al., ICLR 2024), prints for each schedule, P in {4, 8} and
M in {8, 16, 32}:

- bubble: the idle fraction of the devices over the simulated step;
- peak activations: the most activations any device holds at once (kept
  for the backward), in units of one micro-batch's activations of one
  device's share of the model (with v chunks per device, each chunk's
  micro-batch counts 1/v);
- messages: boundary tensors sent per step (2 (P v - 1) M: the schedules
  reorder work and add no transfers, but v chunks per device make v times
  as many boundaries).

``simple`` and ``interleaved`` run B and W as one backward task (what
smp_tf runs for them); ``zero_bubble`` runs them as separate tasks, the
last stage's fused FB task included. ``... v=2`` rows cut the chain
into 2P chunks, chunk c on device c % P (``virtual_stages: 2``), each chunk
costing half a stage; ``interleaved v=2`` is Megatron-LM's interleaved 1F1B.
No
TensorFlow needed: ``python benchmarks/pipeline/schedules_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dataclasses  # noqa: E402

from smp_tf.schedules import chain_tasks, make_schedule, split_chain_tasks, virtual_chain_tasks  # noqa: E402


def _virtual_split(P, v):
    """split_chain_tasks of P v chunks, chunk c on device c % P, costs / v."""
    tasks = split_chain_tasks(P * v, 1.0 / v, 1.0 / v, 1.0 / v)
    return [dataclasses.replace(t, device=t.partition % P) for t in tasks]

STAGES = (4, 8)
MICROBATCHES = (8, 16, 32)


def rows():
    out = []
    for P in STAGES:
        for M in MICROBATCHES:
            for name, kind, tasks in (
                ("simple", "simple", chain_tasks(P, 1.0, 2.0)),
                ("interleaved", "interleaved", chain_tasks(P, 1.0, 2.0)),
                ("zero_bubble", "zero_bubble", split_chain_tasks(P)),
                ("interleaved v=2", "interleaved", virtual_chain_tasks(P, 2, 1.0, 2.0)),
                ("zero_bubble v=2", "zero_bubble", _virtual_split(P, 2)),
            ):
                sim = make_schedule(tasks, M, kind).simulate()
                chunks = len({t.partition for t in tasks})
                out.append((name, P, M, sim.bubble, max(sim.peak_activations.values()), 2 * (chunks - 1) * M))
    return out


def main() -> int:
    print("schedule          P   M  bubble  peak activations  messages")
    for kind, P, M, bubble, peak, msgs in rows():
        print(f"{kind:<16} {P:>2} {M:>3}  {bubble:6.1%}  {peak:>16.3g}  {msgs:>8}")
    print("\nbubble: idle fraction of the simulated step (F = B = W = 1); peak activations: most micro-batches")
    print("of a device's share of the model it holds at once; messages: boundary tensors sent per step.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
