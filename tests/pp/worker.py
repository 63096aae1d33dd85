"""One process of the pipeline-across-processes tests (run in 2 processes by the tests).

Usage: worker.py SCENARIO OUT_DIR PARTITIONS SCHEDULES (SCENARIO ``tensor_parallel``: the
custom loop with each stage split over two devices of its process). SCHEDULES is
``PIPELINE[/VIRTUAL_STAGES]`` or, for ``custom_loop`` and ``fit``, several
of them separated by commas: the driver runs the scenario once per schedule
(a new `smp.init` and a new model each time; the servers serve them all),
and its results are under ``runs[schedule]``. The first process of each
pipeline drives it and writes what the test compares to
OUT_DIR/rank<rank>.json; the others serve their stages and never get past
`smp.init`. The ``dp`` scenario runs 2 replicas of the pipeline (4
processes) with data parallelism, each replica on its half of every batch:
the custom loop, then `fit`.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Deterministic kernels, except for the profile, whose clock op refuses to
# run under op determinism (in every process that holds a stage).
os.environ["TF_DETERMINISTIC_OPS"] = "0" if sys.argv[1] == "profile" else os.environ.get("TF_DETERMINISTIC_OPS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import smp_tf as smp  # noqa: E402

SCENARIO, OUT, PARTITIONS, SCHEDULES = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")


def init(schedule: str) -> None:
    pipeline, _, virtual_stages = schedule.partition("/")
    smp.init({"partitions": PARTITIONS, "microbatches": 4, "pipeline": pipeline, "pipeline_processes": 2,
              "virtual_stages": int(virtual_stages or 1),
              "dp_timeout": 8.0 if SCENARIO == "loop" else 20.0, "horovod": SCENARIO == "dp",
              "tensor_parallel_degree": 2 if SCENARIO == "tensor_parallel" else 1})


init(SCHEDULES[0])

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.dp import common  # noqa: E402

# Different initial weights per replica on purpose: replica 0's are broadcast.
model = common.build(seed=100 + smp.dp_rank())
result = {"rank": smp.rank(), "size": smp.size(), "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(),
          "pp_rank": smp.pp_rank(), "mp_size": smp.mp_size(), "local_partitions": list(smp.local_partitions())}
x, y = common.batches(3)


def weights_and_devices(model) -> dict:
    return {"weights": [v.numpy().tolist() for v in model.trainable_variables],
            "devices": [v.value.device for v in model.trainable_variables]}


if SCENARIO in ("custom_loop", "fit"):
    result["runs"] = {}
    for k, schedule in enumerate(SCHEDULES):
        if k:
            init(schedule)
            model = common.build(seed=100 + smp.dp_rank())
        run = {}
        if SCENARIO == "custom_loop":
            train = common.train_function(model, keras.optimizers.SGD(common.LR))
            run["losses"] = [float(train(x[s], y[s])) for s in range(3)]
        else:
            model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
            history = model.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=2,
                                shuffle=False, verbose=0)
            run["losses"] = history.history["loss"]
            run["predict"] = model.predict(x[0], batch_size=common.GLOBAL_BATCH, verbose=0).tolist()
        run.update(weights_and_devices(model))
        result["runs"][schedule] = run
elif SCENARIO == "profile":
    # The custom loop inside smp.profile.
    with smp.profile(os.path.join(OUT, "timeline")) as prof:
        train = common.train_function(model, keras.optimizers.SGD(common.LR))
        result["losses"] = [float(train(x[s], y[s])) for s in range(3)]
    tl = prof.timeline
    result["timeline"] = {
        "steps": tl.num_steps, "records": len(tl.records), "actions": sum(len(a) for a in tl.schedule.order.values()),
        "devices": tl.device_names, "per_device": {str(d): sum(r.device == d for r in tl.records) for d in range(2)},
        "ordered": all(a.end <= b.start for s in range(tl.num_steps) for d in range(2)
                       for a, b in zip(*(lambda recs: (recs, recs[1:]))(
                           [r for r in tl.step_records(s) if r.device == d]))),
        "files": [os.path.basename(f) for f in prof.files],
    }
elif SCENARIO == "tensor_parallel":
    # Each process's stage split over its two devices.
    from smp_tf.sharding import storage

    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    result["losses"] = [float(train(x[s], y[s])) for s in range(3)]
    result["pieces"] = {v.path: [p.device for p in storage.shards_of(v) or []] for v in model.trainable_variables}
    result["stage_devices"] = [list(smp.topology().stage_devices(p)) for p in range(PARTITIONS)]
elif SCENARIO == "loop":
    # Trains until the test kills or stops the other process.
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    train(x[0], y[0])
    open(os.path.join(OUT, "ready"), "w").close()
    while True:
        train(x[0], y[0])
elif SCENARIO == "dp":
    # The custom loop (smp.join on uneven data, saving), then `fit` on a new model.
    result["allgather"] = smp.allgather({"dp_rank": smp.dp_rank(), "rank": smp.rank()})
    smp.barrier()
    train = common.train_function(model, keras.optimizers.SGD(common.LR))
    result["losses"] = [float(train(*common.half(x[s], y[s], smp.dp_rank()))) for s in range(3)]
    # Uneven data: replica 0 has 2 more batches, replica 1 has 3.
    more_x, more_y = common.batches(6)
    with smp.join() as joined:
        for s in range(2 if smp.dp_rank() == 0 else 3):
            train(*common.half(more_x[3 + s], more_y[3 + s], smp.dp_rank()))
    result["joined_steps"] = joined.joined_steps
    if smp.rank() == 0:  # saved once, by one process
        model.save_weights(os.path.join(OUT, "w.weights.h5"))
        smp.CheckpointManager(tf.train.Checkpoint(model=model), os.path.join(OUT, "ckpt")).save()
        model.save_model(os.path.join(OUT, "export"))
        np.save(os.path.join(OUT, "predict.npy"), model.predict(x[0], verbose=0))
    result.update(weights_and_devices(model))
    model = common.build(seed=100 + smp.dp_rank())
    model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    history = model.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=2,
                        shuffle=False, verbose=0)
    result["fit"] = {"losses": history.history["loss"], **weights_and_devices(model)}
else:
    raise SystemExit(f"unknown scenario {SCENARIO!r}")

if SCENARIO != "dp":
    result.update(weights_and_devices(model))
with open(os.path.join(OUT, f"rank{smp.rank()}.json"), "w") as f:
    json.dump(result, f)
