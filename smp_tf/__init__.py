"""smp_tf: pipeline model parallelism for TensorFlow 2 and Keras 3.

The programming model of the SageMaker model parallel library for
TensorFlow, without a cloud::

    import smp_tf as smp

    smp.init({"partitions": 2, "microbatches": 4})
    model = smp.DistributedModel(inputs, outputs)

    @smp.step
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    loss, grads = train_step(x, y)
    optimizer.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))

Public names are loaded on first use, so that the parts that need no
TensorFlow (the configuration, the partitioner, the schedules, the task
rewrite) import without it, e.g. in a launcher or a planning tool.
"""

from __future__ import annotations

import importlib
from typing import Any, List

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "Action": "smp_tf.schedules",
    "CommGroup": "smp_tf.distributed.comm",
    "RankType": "smp_tf.distributed.comm",
    "ReplicaError": "smp_tf.distributed.runtime",
    "allgather": "smp_tf.distributed.comm",
    "barrier": "smp_tf.distributed.comm",
    "broadcast": "smp_tf.distributed.comm",
    "dp_barrier": "smp_tf.distributed.comm",
    "join": "smp_tf.distributed.join",
    "mp_barrier": "smp_tf.distributed.comm",
    "recv_from": "smp_tf.distributed.comm",
    "send": "smp_tf.distributed.comm",
    "Config": "smp_tf.config",
    "ResourceGraph": "smp_tf.planner.resources",
    "cluster": "smp_tf.planner",
    "plan": "smp_tf.planner.plan",
    "Plan": "smp_tf.planner.plan",
    "LayoutMap": "smp_tf.sharding.layout_map",
    "ShardSpec": "smp_tf.sharding.spec",
    "shard_tensor": "smp_tf.sharding.api",
    "tp_rank": "smp_tf.state",
    "tp_size": "smp_tf.state",
    "CheckpointManager": "smp_tf.keras.checkpoint",
    "DistributedModel": "smp_tf.keras.model",
    "PartitionPlan": "smp_tf.partitioner.plan",
    "Schedule": "smp_tf.schedules",
    "ScheduleError": "smp_tf.schedules",
    "Simulation": "smp_tf.schedules",
    "StepFunction": "smp_tf.step_function",
    "StepOutput": "smp_tf.step_output",
    "TaskKind": "smp_tf.schedules",
    "TaskSpec": "smp_tf.schedules",
    "Timeline": "smp_tf.profiling.timeline",
    "Topology": "smp_tf.state",
    "current_config": "smp_tf.state",
    "dp_rank": "smp_tf.state",
    "dp_size": "smp_tf.state",
    "init": "smp_tf.state",
    "is_initialized": "smp_tf.state",
    "local_partitions": "smp_tf.state",
    "local_rank": "smp_tf.state",
    "local_size": "smp_tf.state",
    "mp_rank": "smp_tf.state",
    "mp_size": "smp_tf.state",
    "num_microbatches": "smp_tf.state",
    "partition": "smp_tf.trace",
    "pp_rank": "smp_tf.state",
    "profile": "smp_tf.profiling.timeline",
    "pp_size": "smp_tf.state",
    "rank": "smp_tf.state",
    "register_post_partition_hook": "smp_tf.step_function",
    "register_schedule": "smp_tf.schedules",
    "size": "smp_tf.state",
    "smp_input": "smp_tf.boundary",
    "smp_output": "smp_tf.boundary",
    "step": "smp_tf.step_function",
    "topology": "smp_tf.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'smp_tf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
