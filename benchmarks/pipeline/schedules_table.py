"""The simulator's table of schedules: bubble, activation memory, communication.

For a chain of P stages with forward, input-gradient (B) and weight-gradient
(W) work of equal cost per stage (the setting of the zero-bubble paper's
table, Qi et al., ICLR 2024), prints for each schedule, P in {4, 8} and
M in {8, 16, 32}:

- bubble: the idle fraction of the devices over the simulated step;
- peak activations: the most micro-batches any device holds at once (its
  activations kept for the backward), in units of one micro-batch's
  activations of one stage;
- messages: boundary tensors sent per step (2 (P-1) M for every schedule:
  the schedules reorder work, they do not add transfers).

``simple`` and ``interleaved`` run B and W as one backward task (what
smp_tf runs for them); ``zero_bubble`` runs them as separate tasks except
on the last stage, whose fused task smp_tf leaves whole; ``zb, all split``
splits the last stage too, for comparison. No
TensorFlow needed: ``python benchmarks/pipeline/schedules_table.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from smp_tf.schedule import chain_tasks, make_schedule, split_chain_tasks  # noqa: E402

STAGES = (4, 8)
MICROBATCHES = (8, 16, 32)


def rows():
    out = []
    for P in STAGES:
        for M in MICROBATCHES:
            for name, kind, tasks in (
                ("simple", "simple", chain_tasks(P, 1.0, 2.0)),
                ("interleaved", "interleaved", chain_tasks(P, 1.0, 2.0)),
                # What smp_tf runs: the last stage's fused task stays whole.
                ("zero_bubble", "zero_bubble", split_chain_tasks(P, split_last=False)),
                ("zb, all split", "zero_bubble", split_chain_tasks(P)),
            ):
                sim = make_schedule(tasks, M, kind).simulate()
                out.append((name, P, M, sim.bubble, max(sim.peak_live.values()), 2 * (P - 1) * M))
    return out


def main() -> int:
    print("schedule        P   M  bubble  peak activations  messages")
    for kind, P, M, bubble, peak, msgs in rows():
        print(f"{kind:<14} {P:>2} {M:>3}  {bubble:6.1%}  {peak:>16}  {msgs:>8}")
    print("\nbubble: idle fraction of the simulated step (F = B = W = 1); peak activations: most micro-batches")
    print("a device holds at once; messages: boundary tensors sent per step.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
