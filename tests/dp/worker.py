"""One replica of the data-parallel tests (run in 2 processes by the tests).

Usage: worker.py SCENARIO OUT_DIR. ``custom_loops`` is ``custom_loop``
followed by the same loop with ``virtual_stages=2`` (`smp.init` again, a new
model); ``uneven_both`` runs the custom loop under `smp.join` on uneven
data, then `fit` on the same data; ``comm_fit`` the communication helpers,
then `fit`. Every scenario trains the same small
model on 2 partitions with 4 micro-batches, starting from weights that
differ per rank (the initial broadcast must equalise them), and writes what
the test compares to OUT_DIR/rank{r}.json.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

import smp_tf as smp  # noqa: E402

SCENARIO, OUT = sys.argv[1], sys.argv[2]
CONFIG = {"partitions": 2, "microbatches": 4, "horovod": True, "dp_timeout": 8.0}
if SCENARIO == "uneven_raise":
    CONFIG["uneven_inputs"] = "raise"
smp.init(CONFIG)

import keras  # noqa: E402

from tests.dp import common  # noqa: E402

RANK = smp.rank()
model = common.build(seed=100 + RANK)  # different per rank on purpose
result = {"rank": RANK, "size": smp.size(), "dp_rank": smp.dp_rank(), "dp_size": smp.dp_size(),
          "local_rank": smp.local_rank(), "mp_size": smp.mp_size(), "mp_rank": smp.mp_rank()}


def train_function(optimizer):
    return common.train_function(model, optimizer)


def state_of(model) -> dict:
    """What the tests compare of a trained model, and the schedule it ran."""
    return {"weights": [v.numpy().tolist() for v in model.trainable_variables],
            "devices": sorted({v.value.device for v in model.variables}),
            "virtual_stages": smp.current_config().virtual_stages, "pipeline": smp.current_config().pipeline}


def finish():
    result.update(state_of(model))
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f)


if SCENARIO in ("custom_loop", "custom_loops"):
    train = train_function(keras.optimizers.SGD(common.LR))
    x, y = common.batches(5)
    result["losses"] = [float(train(*common.half(x[s], y[s], RANK))) for s in range(5)]
    # Where the gradients' all-reduces run (each device of a tensor-parallel
    # stage reduces its pieces).
    graph = train.get_concrete_function(*common.half(x[0], y[0], RANK)).graph
    result["reduce_devices"] = sorted({op.device.rsplit("device:", 1)[-1] for op in graph.get_operations()
                                       if op.type == "CollectiveReduceV2"})
    if SCENARIO == "custom_loops":
        # Then again with 2 chunks per device (smp.init again, a new model).
        smp.init(dict(CONFIG, virtual_stages=2))
        chunked = common.build(seed=100 + RANK)
        train = common.train_function(chunked, keras.optimizers.SGD(common.LR))
        result["virtual_stages_run"] = {"losses": [float(train(*common.half(x[s], y[s], RANK))) for s in range(5)],
                                        **state_of(chunked)}
    finish()

elif SCENARIO == "uneven_raise":
    train = train_function(keras.optimizers.SGD(common.LR))
    x, y = common.batches(7)
    steps = 5 if RANK == 0 else 7
    with smp.join():
        for s in range(steps):
            train(*common.half(x[s], y[s], RANK))
    finish()

elif SCENARIO == "uneven_both":
    # The custom loop under smp.join, then `fit` on the same uneven data
    # (smp.init again with shard_inputs=False, a new model).
    train = train_function(keras.optimizers.SGD(common.LR))
    x, y = common.batches(7)
    steps = 5 if RANK == 0 else 7
    with smp.join() as joined:
        for s in range(steps):
            train(*common.half(x[s], y[s], RANK))
    result["uneven"] = {"joined_steps": joined.joined_steps, **state_of(model)}
    smp.init(dict(CONFIG, shard_inputs=False))
    model = common.build(seed=100 + RANK)
    model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    mine = [common.half(x[s], y[s], RANK) for s in range(steps)]
    xs = np.concatenate([a for a, _ in mine]); ys = np.concatenate([b for _, b in mine])
    history = model.fit(xs, ys, batch_size=common.GLOBAL_BATCH // 2, epochs=1, shuffle=False, verbose=0)
    result["uneven_fit"] = {"losses": history.history["loss"], **state_of(model)}
    finish()

elif SCENARIO in ("killed", "stalled"):
    train = train_function(keras.optimizers.SGD(common.LR))
    x, y = common.batches(20)
    start = time.monotonic()
    try:
        for s in range(20):
            if s == 3 and RANK == 1:
                if SCENARIO == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(600)  # alive, but never joins step 4
            train(*common.half(x[s], y[s], RANK))
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["seconds_after_stop"] = time.monotonic() - start
        finish()
        raise

elif SCENARIO == "comm_fit":
    # The communication helpers, then `fit` on global batches.
    smp.barrier()
    smp.dp_barrier()
    smp.mp_barrier()
    result["allgather"] = smp.allgather({"rank": RANK, "square": RANK * RANK})
    if RANK == 0:
        smp.broadcast({"from": 0, "payload": list(range(5))})
        smp.send("to one", 1, smp.RankType.WORLD_RANK)
        result["received"] = smp.recv_from(1, smp.RankType.DP_RANK)
    else:
        result["broadcast"] = smp.recv_from(0, smp.RankType.WORLD_RANK)
        result["received"] = smp.recv_from(0)
        smp.send(("back", RANK), 0, smp.RankType.DP_RANK)
    smp.send("to myself", 0, smp.RankType.MP_RANK)
    result["self"] = smp.recv_from(0, smp.RankType.MP_RANK)
    smp.barrier(smp.CommGroup.WORLD)
    model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss)
    x, y = common.batches(5)
    history = model.fit(x.reshape(-1, 16), y.reshape(-1, 4), batch_size=common.GLOBAL_BATCH, epochs=1,
                        shuffle=False, verbose=0)
    result["losses"] = history.history["loss"]
    finish()

else:
    raise SystemExit(f"unknown scenario {SCENARIO!r}")
print(f"rank {RANK}: {SCENARIO} done", flush=True)
