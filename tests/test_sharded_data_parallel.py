"""Optimizer state divided over data-parallel replicas (``shard_optimizer_state``).

The piece arithmetic and the registry are plain Python; the replicas run
in 2 processes on 127.0.0.1 (tests/dp/sharded_worker.py), each training the
same model from the same weights with plain data parallelism and then with
the optimizer state divided, so that the two runs are compared step for
step. The waits are bounded and the tests end only the processes they
started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

import numpy as np
import pytest
import tensorflow as tf

import smp_tf as smp
from smp_tf.sharding import pieces
from tests import jobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "dp", "sharded_worker.py")

#: Optimizers whose update involves no norm: the pieces' update is the
#: whole update of those elements, and a reduce-scatter over 2 replicas adds
#: the same two numbers an all-reduce adds.
BIT_EXACT = ("adamw", "rmsprop", "adagrad", "adamax", "nadam", "lion", "adadelta", "ftrl")


# -- pieces (plain Python) -----------------------------------------------------
def test_pieces_divide_every_size_and_pad_the_last():
    # 10 elements over 4 replicas: runs of 3, the last holds 1 and 2 padding.
    assert pieces.piece_length(10, 4) == 3
    assert [pieces.piece_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    # Fewer elements than replicas: the later pieces are all padding.
    assert [pieces.piece_bounds(1, 2, r) for r in range(2)] == [(0, 1), (1, 1)]
    assert pieces.Piece((4, 5), 3, 2).length == 7 and pieces.Piece((4, 5), 3, 2).size == 20
    with pytest.raises(ValueError, match="rank must be in"):
        pieces.piece_bounds(10, 2, 2)


def test_registered_pieces_are_found_by_identity_and_forgotten():
    a, b = object(), object()
    piece = pieces.Piece((3,), 2, 0)
    assert pieces.register(a, piece) is a
    assert pieces.piece_of(a) == piece and pieces.piece_of(b) is None
    pieces.forget_all()
    assert pieces.piece_of(a) is None


# -- bad input -----------------------------------------------------------------
def test_sharding_without_replicas_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"shard_optimizer_state=True .* 1 replica\(s\)"):
        smp.init({"partitions": 2, "shard_optimizer_state": True, "horovod": True})


def test_sharding_does_not_compose_with_tensor_parallelism_yet():
    with pytest.raises(ValueError, match="tensor_parallel_degree=2"):
        smp.Config(partitions=1, tensor_parallel_degree=2, shard_optimizer_state=True)
    with pytest.raises(ValueError, match="pipeline_processes=2"):
        smp.Config(partitions=2, pipeline_processes=2, shard_optimizer_state=True)
    with pytest.raises(ValueError, match="shard_optimizer_state"):
        smp.Config(shard_optimizer_state="yes")
    cfg = smp.Config(partitions=2, horovod=True, shard_optimizer_state=True)
    assert smp.Config(**cfg.to_dict()) == cfg


# -- two replicas ----------------------------------------------------------------
def _run(scenario: str, tmp_path_factory, *extra: str, timeout: float = 400) -> List[dict]:
    def start():
        out = tmp_path_factory.mktemp(scenario)
        proc = subprocess.run(
            [sys.executable, "-m", "smp_tf.launch", "-n", "2", "--timeout", str(timeout), WORKER, scenario, str(out),
             *extra],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=timeout + 30,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return out, [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]

    return jobs.once(("sharded", scenario) + extra, start)


def _max_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.array(x) - np.array(y)))) if np.size(x) else 0.0 for x, y in zip(a, b))


def _check_run(name: str, a: dict, b: dict, tolerance: float) -> None:
    for rank, result in enumerate((a, b)):
        plain, sharded = result[name]["plain"], result[name]["sharded"]
        # Each replica's losses and weights are those of plain data parallelism.
        np.testing.assert_allclose(sharded["losses"], plain["losses"], rtol=tolerance, atol=0)
        assert _max_difference(sharded["weights"], plain["weights"]) <= tolerance, (name, rank)
        # Every slot, read whole (gathered from the replicas), too.
        assert len(sharded["slots"]) == len(plain["slots"]) > 0
        assert _max_difference(sharded["slots"], plain["slots"]) <= tolerance, (name, rank)
        # Each replica stores half of the slots (the pieces of 2 replicas);
        # Adafactor's factored moments (a vector per row and per column)
        # are whole on each.
        if name == "adafactor":
            assert plain["slot_elements"] / 2 < sharded["slot_elements"] < 0.6 * plain["slot_elements"]
        else:
            assert sharded["slot_elements"] * 2 - plain["slot_elements"] in range(0, 2 * len(plain["slots"]) + 1)
    # Every replica ends every step with bit-identical parameters.
    assert a[name]["sharded"]["weights"] == b[name]["sharded"]["weights"]
    # The partition report says how: the slots in pieces over the replicas.
    for result in (a, b):
        if result[name]["sharded"].get("storage") is None:
            continue  # fit and the zoo entries report no plan
        assert [tuple(x) for x in result[name]["sharded"]["storage"]] == [("whole", "whole", "data", 2)]
        assert [tuple(x) for x in result[name]["plain"]["storage"]] == [("whole", "whole", "whole", 1)]
        assert "whole / whole / pieces over data (2)" in result[name]["sharded"]["report"]


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
@pytest.mark.parametrize("name", BIT_EXACT)
def test_element_wise_optimizers_update_their_pieces_bit_for_bit(name, tmp_path_factory):
    _, (a, b) = _run("optimizers", tmp_path_factory)
    _check_run(name, a, b, tolerance=0.0)


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
@pytest.mark.parametrize("name", ["adam_global_clipnorm", "sgd_momentum_clipnorm", "lamb", "adafactor"])
def test_clipping_and_trust_ratio_norms_are_summed_over_every_replicas_piece(name, tmp_path_factory):
    # A norm over a piece alone would clip (or scale, Lamb's trust ratio,
    # Adafactor's factored moments and its update's root-mean-square) each
    # replica's piece differently, and wrongly; summed over the pieces it
    # is the whole gradient's (or variable's), within the rounding of a sum
    # in another order.
    _, (a, b) = _run("optimizers", tmp_path_factory)
    _check_run(name, a, b, tolerance=1e-6)


#: A CNN with BatchNorm and a transformer (GPT-2, a tied embedding) in the
#: default run; ``-m sharded_zoo`` runs the other entries too.
ZOO_DEFAULT = ("hard_swish_cnn", "gpt2_lm")
#: (keras_hub's BERT classifier is left out: plain data parallelism cannot
#: all-reduce its embedding gradient, whose dense shape its graph computes.)
ZOO_MORE = ("unet", "tied_transformer", "lstm_dropout", "noise_stochastic_depth", "mixed_bfloat16_cnn",
            "mobilenet_v2")


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
@pytest.mark.parametrize("name", ZOO_DEFAULT)
def test_zoo_entries_with_sharded_optimizer_state_match_plain_data_parallelism(name, tmp_path_factory):
    _, (a, b) = _run("zoo", tmp_path_factory, ",".join(ZOO_DEFAULT))
    _check_run(name, a, b, tolerance=1e-6)


@pytest.mark.sharded_zoo
@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
@pytest.mark.parametrize("name", ZOO_MORE)
def test_more_zoo_entries_with_sharded_optimizer_state(name, tmp_path_factory):
    _, (a, b) = _run("zoo", tmp_path_factory, ",".join(ZOO_MORE), timeout=1500)
    _check_run(name, a, b, tolerance=1e-6)


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
def test_keras_fit_with_sharded_optimizer_state_matches_plain_data_parallelism(tmp_path_factory):
    _, (a, b) = _run("fit", tmp_path_factory)
    _check_run("adam_global_clipnorm", a, b, tolerance=1e-6)


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
def test_a_checkpoint_saved_sharded_restores_in_one_process(tmp_path_factory):
    import keras

    from tests.dp import common

    out, (a, _) = _run("optimizers", tmp_path_factory)
    plain = a["adam_global_clipnorm"]["plain"]
    smp.init({"partitions": 2, "microbatches": 2})
    model = common.build(seed=7)  # other weights: the restore must replace them
    optimizer = keras.optimizers.Adam(0.01, global_clipnorm=0.5)
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(os.path.join(out, "ckpt_rank0", "ckpt")).assert_consumed()
    assert _max_difference([v.numpy() for v in model.trainable_variables], plain["weights"]) <= 1e-6
    slots = [v.numpy() for v in optimizer.variables if tuple(v.shape)]
    assert _max_difference(slots, plain["slots"]) <= 1e-6


@pytest.mark.multiprocess
@pytest.mark.xdist_group("sharded_data_parallel")
def test_an_optimizer_that_cannot_work_on_pieces_is_refused_naming_it(tmp_path_factory):
    _, (a, b) = _run("refused", tmp_path_factory)
    for result in (a, b):
        assert "cannot divide the state of optimizer RenamedSGD" in result["error"]
        assert "only built-in optimizers can be sharded" in result["error"]
