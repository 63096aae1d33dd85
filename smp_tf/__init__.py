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
"""

def _exclude_from_autograph() -> None:
    """Keeps AutoGraph from rewriting smp_tf when a user's tf.function calls it.

    smp_tf's Python runs at trace time and has no tensor-dependent control
    flow; converting it would only slow tracing down and break on its
    closures. TensorFlow excludes Keras the same way.
    """
    try:
        from tensorflow.python.autograph.core import config as ag_config
    except ImportError:  # pragma: no cover - layout of a future TensorFlow
        return
    rule = ag_config.DoNotConvert("smp_tf")
    if not any(getattr(r, "_prefix", None) == "smp_tf" for r in ag_config.CONVERSION_RULES):
        ag_config.CONVERSION_RULES = (rule,) + tuple(ag_config.CONVERSION_RULES)


_exclude_from_autograph()

from smp_tf.boundary import smp_input, smp_output  # noqa: E402
from smp_tf.config import Config  # noqa: E402
from smp_tf.keras_model import DistributedModel  # noqa: E402
from smp_tf.partitioner.plan import PartitionPlan  # noqa: E402
from smp_tf.schedule import Action, Schedule, ScheduleError, Simulation, TaskSpec  # noqa: E402
from smp_tf.state import (  # noqa: E402
    current_config,
    Topology,
    dp_rank,
    dp_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    mp_rank,
    mp_size,
    num_microbatches,
    pp_rank,
    pp_size,
    rank,
    size,
    topology,
)
from smp_tf.step import StepFunction, register_post_partition_hook, step  # noqa: E402
from smp_tf.step_output import StepOutput  # noqa: E402
from smp_tf.trace import partition  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Config",
    "DistributedModel",
    "PartitionPlan",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "StepFunction",
    "StepOutput",
    "TaskSpec",
    "Topology",
    "current_config",
    "dp_rank",
    "dp_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mp_rank",
    "mp_size",
    "num_microbatches",
    "partition",
    "pp_rank",
    "pp_size",
    "rank",
    "register_post_partition_hook",
    "size",
    "smp_input",
    "smp_output",
    "step",
    "topology",
]
