"""Tests of `smp_tf.config`: defaults, validation, aliases and the env override."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from smp_tf.config import ENV_VAR, Config, parse_config  # noqa: E402

NO_ENV: dict = {}


def parse(config=None, env=None):
    """parse_config with an explicit (by default empty) environment."""
    environ = NO_ENV if env is None else {ENV_VAR: env if isinstance(env, str) else json.dumps(env)}
    return parse_config(config, environ=environ)


def test_does_not_import_tensorflow():
    # The module alone must stay cheap to import (launchers validate configs
    # with it). Load the file directly: the package __init__ may import more.
    import subprocess

    import smp_tf.config

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cfg', {smp_tf.config.__file__!r})\n"
        "module = sys.modules['cfg'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_defaults():
    cfg = parse()
    assert cfg == Config()
    assert cfg.to_dict() == {
        "partitions": 1,
        "microbatches": 1,
        "pipeline": "interleaved",
        "optimize": "speed",
        "auto_partition": True,
        "default_partition": 0,
        "contiguous": True,
        "placement_strategy": "cluster",
        "horovod": False,
        "fuse_weight_gradients": False,
        "pretranspose_weights": False,
        "dp_timeout": 60.0,
        "shard_inputs": True,
        "uneven_inputs": "join",
        "recompute": "never",
        "memory_budget": None,
        "pipeline_processes": 1,
        "virtual_stages": 1,
        "tensor_parallel_degree": 1,
        "layout_map": None,
        "cluster": None,
        "auto": False,
        "shard_optimizer_state": False,
        "sequence_parallel": False,
    }
    assert parse({}) == cfg


def test_all_keys_set():
    given = {
        "partitions": 4,
        "microbatches": 8,
        "pipeline": "simple",
        "optimize": "memory",
        "auto_partition": False,
        "default_partition": 3,
        "contiguous": False,
        "placement_strategy": "spread",
        "horovod": True,
        "fuse_weight_gradients": True,
        "pretranspose_weights": True,
        "dp_timeout": 12.5,
        "shard_inputs": False,
        "uneven_inputs": "raise",
        "recompute": "selective",
        "memory_budget": 2**30,
        "pipeline_processes": 2,
        "virtual_stages": 1,
        "tensor_parallel_degree": 1,
        "layout_map": {"dense/kernel": (None, "tensor")},
        "cluster": {"hosts": {"h": {"devices": [
            {"name": "CPU:0", "kind": "CPU", "memory": 2**30, "overhead": 1e-6,
             "flops": {"matmul": 1e11, "conv": 5e10, "elementwise": 1e9}}]}}, "links": {}},
        "auto": True,
        # True needs pipeline_processes=1 (test_sharded_data_parallel.py).
        "shard_optimizer_state": False,
        # True needs tensor_parallel_degree > 1 (test_sequence_parallel_needs_tensor_parallelism).
        "sequence_parallel": False,
    }
    cfg = parse(given)
    assert cfg.to_dict() == given
    # to_dict round-trips, and a Config is accepted as the config.
    assert parse(cfg.to_dict()) == cfg
    assert parse(cfg) == cfg


def test_sequence_parallel_needs_tensor_parallelism():
    assert parse({"tensor_parallel_degree": 2, "sequence_parallel": True}).sequence_parallel
    with pytest.raises(ValueError, match=r"sequence_parallel=True .* needs tensor_parallel_degree > 1\. "
                                         r"Received: tensor_parallel_degree=1"):
        parse({"sequence_parallel": True})
    with pytest.raises(ValueError, match="sequence_parallel"):
        parse({"tensor_parallel_degree": 2, "sequence_parallel": "yes"})


def test_virtual_stages():
    cfg = parse({"partitions": 2, "virtual_stages": 3, "default_partition": 5})
    assert cfg.num_stages == 6 and cfg.default_partition == 5
    with pytest.raises(ValueError, match=r"partitions x virtual_stages \(6\)"):
        parse({"partitions": 2, "virtual_stages": 3, "default_partition": 6})
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="virtual_stages"):
            parse({"partitions": 2, "virtual_stages": bad})
    # Across processes too: each process holds its devices' chunks.
    cfg = parse({"partitions": 2, "virtual_stages": 2, "pipeline_processes": 2})
    assert cfg.num_stages == 4 and cfg.pipeline_processes == 2
    # The memory options work on each device's chunks.
    cfg = parse({"partitions": 2, "virtual_stages": 2, "memory_budget": 2**30, "optimize": "memory"})
    assert cfg.memory_budget == 2**30 and cfg.optimize == "memory"


def test_pipeline_names_come_from_the_schedule_registry():
    from smp_tf.schedules import schedule_kinds

    for kind in schedule_kinds():
        assert parse({"pipeline": kind}).pipeline == kind
    with pytest.raises(ValueError, match="zero_bubble"):
        parse({"pipeline": "zb"})


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_pipeline_processes_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="pipeline_processes"):
        parse({"partitions": 2, "pipeline_processes": value})


def test_pipeline_processes_must_share_the_partitions_evenly():
    with pytest.raises(ValueError, match=r"partitions=3 cannot be shared evenly by pipeline_processes=2"):
        parse({"partitions": 3, "pipeline_processes": 2})
    assert parse({"partitions": 4, "pipeline_processes": 2}).pipeline_processes == 2


def test_config_is_frozen_and_hashable():
    cfg = parse({"partitions": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.partitions = 3
    assert hash(cfg) == hash(parse({"partitions": 2}))


def test_numpy_integers_are_accepted_as_python_ints():
    cfg = parse({"partitions": np.int64(2), "microbatches": np.int32(4)})
    assert cfg.partitions == 2 and type(cfg.partitions) is int
    assert type(cfg.microbatches) is int


@pytest.mark.parametrize("config", [[("partitions", 2)], "partitions=2", 3])
def test_config_must_be_a_mapping(config):
    with pytest.raises(ValueError, match=re.escape(type(config).__name__)):
        parse(config)


@pytest.mark.parametrize(
    "key,value",
    [
        ("partitions", 2.0),
        ("partitions", "2"),
        ("partitions", True),  # bool is not an int here
        ("microbatches", False),
        ("microbatches", 4.5),
        ("microbatches", None),
        ("default_partition", "0"),
        ("default_partition", True),
        ("pipeline_parallel_degree", 2.0),
        ("pipeline_parallel_degree", True),
    ],
)
def test_int_keys_reject_other_types(key, value):
    with pytest.raises(ValueError, match=rf"'{key}' must be an integer.*{re.escape(repr(value))}"):
        parse({key: value})


@pytest.mark.parametrize(
    "key,value",
    [
        ("auto_partition", 1),  # int is not a bool here
        ("auto_partition", "False"),
        ("contiguous", 0),
        ("contiguous", None),
        ("horovod", "true"),
        ("horovod", 1),
        ("fuse_weight_gradients", "yes"),
        ("pretranspose_weights", 0),
    ],
)
def test_bool_keys_reject_other_types(key, value):
    with pytest.raises(ValueError, match=rf"'{key}' must be a boolean.*{re.escape(repr(value))}"):
        parse({key: value})


@pytest.mark.parametrize(
    "key,value,options",
    [
        ("pipeline", "1f1b", "'interleaved', 'simple'"),
        ("pipeline", "Simple", "'interleaved', 'simple'"),
        ("pipeline", 1, "'interleaved', 'simple'"),
        ("optimize", "time", "'speed', 'memory'"),
        ("optimize", None, "'speed', 'memory'"),
        ("placement_strategy", "PDT", "'cluster', 'spread'"),
    ],
)
def test_string_keys_reject_unknown_options(key, value, options):
    with pytest.raises(ValueError) as info:
        parse({key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg and repr(value) in msg and options in msg


@pytest.mark.parametrize("key", ["partitions", "microbatches", "pipeline_parallel_degree"])
@pytest.mark.parametrize("value", [0, -1])
def test_counts_must_be_positive(key, value):
    with pytest.raises(ValueError, match=rf"'{key}' must be at least 1.*{key}={value}"):
        parse({key: value})


def test_unknown_key():
    with pytest.raises(ValueError) as info:
        parse({"partitions": 2, "foo": 1})
    msg = str(info.value)
    assert "Unrecognized config parameter 'foo'" in msg
    assert "Valid parameters: partitions, microbatches," in msg
    assert "pipeline_parallel_degree" in msg


def test_unknown_key_suggests_close_match_and_lists_others():
    with pytest.raises(ValueError) as info:
        parse({"microbatch": 2, "zzz": 1})
    msg = str(info.value)
    assert "'microbatch'" in msg and "Did you mean 'microbatches'?" in msg
    assert "'zzz'" in msg


def test_non_string_key():
    with pytest.raises(ValueError, match=r"names must be strings.*\b1\b"):
        parse({1: 2})


def test_alias_alone_sets_partitions():
    assert parse({"pipeline_parallel_degree": 3}).partitions == 3


def test_alias_and_partitions_agreeing():
    assert parse({"partitions": 2, "pipeline_parallel_degree": 2}).partitions == 2


def test_alias_conflict():
    with pytest.raises(ValueError) as info:
        parse({"partitions": 2, "pipeline_parallel_degree": 4})
    msg = str(info.value)
    assert "partitions=2" in msg and "pipeline_parallel_degree=4" in msg


def test_default_partition_resolves_to_zero_with_auto_partition():
    assert parse({"partitions": 4}).default_partition == 0
    assert parse({"partitions": 4, "default_partition": None}).default_partition == 0
    assert parse({"partitions": 4, "default_partition": 2}).default_partition == 2


def test_default_partition_required_without_auto_partition():
    with pytest.raises(ValueError, match=r"'default_partition' is required when auto_partition is False"):
        parse({"partitions": 2, "auto_partition": False})
    cfg = parse({"partitions": 2, "auto_partition": False, "default_partition": 1})
    assert cfg.default_partition == 1


def test_default_partition_range():
    with pytest.raises(ValueError, match=re.escape("default_partition=3 must be less than the number of partitions (2)")):
        parse({"partitions": 2, "default_partition": 3})
    with pytest.raises(ValueError, match=re.escape("default_partition=2 must be less than the number of partitions (2)")):
        parse({"pipeline_parallel_degree": 2, "default_partition": 2})
    with pytest.raises(ValueError, match=r"'default_partition' must be non-negative.*default_partition=-1"):
        parse({"partitions": 2, "default_partition": -1})


def test_config_constructor_validates():
    with pytest.raises(ValueError, match=r"'microbatches' must be at least 1"):
        Config(microbatches=0)
    assert Config(partitions=2).default_partition == 0


# -- the environment override -------------------------------------------------
def test_env_overrides_dict():
    cfg = parse({"partitions": 2, "microbatches": 2, "pipeline": "simple"}, env={"microbatches": 8})
    assert (cfg.partitions, cfg.microbatches, cfg.pipeline) == (2, 8, "simple")


def test_env_alone():
    assert parse(None, env={"partitions": 4, "horovod": True}).to_dict()["horovod"] is True


@pytest.mark.parametrize(
    "code,env",
    [
        ({"partitions": 2}, {"pipeline_parallel_degree": 4}),
        ({"pipeline_parallel_degree": 2}, {"partitions": 4}),
        ({"partitions": 2, "pipeline_parallel_degree": 2}, {"partitions": 4}),
    ],
)
def test_env_partitions_override_either_alias_in_code(code, env):
    assert parse(code, env=env).partitions == 4


def test_env_values_are_validated():
    with pytest.raises(ValueError, match=r"'microbatches' must be an integer.*'4'"):
        parse({}, env={"microbatches": "4"})


def test_env_unknown_key_names_the_variable():
    with pytest.raises(ValueError, match=rf"Unrecognized config parameter 'ddp' in the environment variable {ENV_VAR}"):
        parse({}, env={"ddp": True})


@pytest.mark.parametrize("raw", ["{partitions: 2}", "not json", '{"partitions": 2'])
def test_env_invalid_json(raw):
    with pytest.raises(ValueError, match=rf"{ENV_VAR}.*not valid JSON") as info:
        parse({}, env=raw)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize("raw", ["[1, 2]", "2", '"partitions"', "null"])
def test_env_json_must_be_an_object(raw):
    with pytest.raises(ValueError, match=rf"{ENV_VAR} must hold a JSON object") as info:
        parse({}, env=raw)
    assert repr(raw) in str(info.value)


def test_empty_env_value_is_ignored():
    assert parse({"partitions": 2}, env="  ").partitions == 2


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"microbatches": 4}))
    assert parse_config({"microbatches": 2}).microbatches == 4
    monkeypatch.delenv(ENV_VAR)
    assert parse_config({"microbatches": 2}).microbatches == 2


@pytest.mark.parametrize("value", [0, -1, float("inf"), "10", True, None])
def test_dp_timeout_must_be_a_positive_number(value):
    with pytest.raises(ValueError, match=r"'dp_timeout' must be a positive number of seconds. Received: dp_timeout="):
        parse({"dp_timeout": value})


def test_uneven_inputs_choices():
    assert parse({"uneven_inputs": "raise"}).uneven_inputs == "raise"
    with pytest.raises(ValueError, match=r"'uneven_inputs' must be one of 'join', 'raise'"):
        parse({"uneven_inputs": "pad"})


def test_tensor_parallel_keys():
    cfg = parse({"partitions": 2, "tensor_parallel_degree": 2, "layout_map": {"up/kernel": [None, "tensor"]}})
    assert cfg.tensor_parallel_degree == 2
    assert cfg.to_dict()["layout_map"] == {"up/kernel": (None, "tensor")}
    hash(cfg)  # the layout map is kept hashable
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        parse({"tensor_parallel_degree": 0})
    # Stages across processes, each split over devices of its own process.
    assert parse({"partitions": 2, "tensor_parallel_degree": 2, "pipeline_processes": 2}).pipeline_processes == 2
    with pytest.raises(ValueError, match="axis 'pipeline'"):
        parse({"tensor_parallel_degree": 2, "layout_map": {"up/kernel": ("pipeline", None)}})
