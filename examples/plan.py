"""Let the planner choose the configuration, then train with it.

A Keras MLP (8 x Dense(1024), Adam, batch 256) compiled as an
`smp.DistributedModel`; `smp.plan` predicts every configuration of this
host's devices (partitions, tensor parallelism, micro-batches, schedule,
virtual stages, recomputation) on the calibrated resource graph, after
probing the step (two candidates for a few steps each: the runtime's cost
per op run and the share of the ops' parallelism a device realizes are
fitted to them), discards
those predicted not to fit, ranks the rest by predicted step time;
`plan.measure(3)` runs the best three for a few steps and keeps the
fastest measured, and `fit` trains with it. The loss of the first epoch
is checked against the same model trained on one device.

Run from the repository root::

    python examples/plan.py [--devices 4] [--width 1024] [--measure 3] [--no-probe]

It takes about a minute on two CPU cores (the calibration is cached
afterwards, in ``$SMP_TF_CACHE`` or ``~/.cache/smp_tf``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402


def build(smp, width: int, layers: int, seed: int):
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((width,))
    h = inp
    for i in range(layers):
        h = keras.layers.Dense(width, activation="relu", name=f"dense{i}")(h)
    out = keras.layers.Dense(width, name="out")(h)
    model = smp.DistributedModel(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4, help="logical CPU devices to plan for (default 4)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--measure", type=int, default=3, help="run the best k rows and keep the fastest (0: skip)")
    ap.add_argument("--no-probe", dest="probe", action="store_false", help="plan without probing the step")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import smp_tf as smp

    # The devices the plan may use: on CPUs, smp.init sets up that many
    # logical devices (they share the host's cores, which the plan knows).
    smp.init({"partitions": args.devices})
    print(smp.cluster())
    print()

    rng = np.random.default_rng(args.seed)
    x = rng.normal(size=(8 * args.batch_size, args.width)).astype("float32")
    y = rng.normal(size=(8 * args.batch_size, args.width)).astype("float32")
    model = build(smp, args.width, args.layers, args.seed)

    plan = smp.plan(model, x[: args.batch_size], y[: args.batch_size], probe=args.probe)
    if plan.probe is not None:
        print(f"probe: {plan.probe.summary()} ({plan.probe.seconds:.1f} s)\n")
    if args.measure:
        plan.measure(args.measure)
    print(plan)
    best = plan.chosen if args.measure else plan.best
    print(f"\nchosen: {best.candidate.label()} -> smp.init({best.config})\n")
    smp.init(best.config)

    history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0)
    losses = history.history["loss"]
    print("loss per epoch:", " ".join(f"{v:.6f}" for v in losses))

    # The same model and data on one device: the planned configuration
    # computes the same numbers.
    smp.init({"partitions": 1})
    reference = build(smp, args.width, args.layers, args.seed)
    ref = reference.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    diff = abs(losses[0] - ref) / abs(ref)
    print(f"one device, first epoch: {ref:.6f} (relative difference {diff:.1e})")
    if diff > 1e-4:
        raise SystemExit(f"the planned configuration's loss differs from one device's by {diff:.1e}")


if __name__ == "__main__":
    main()
