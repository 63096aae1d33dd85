"""Keeps AutoGraph from rewriting smp_tf when a user's tf.function calls it.

smp_tf's Python runs at trace time and has no tensor-dependent control flow;
converting it would only slow tracing down and break on its closures.
TensorFlow excludes Keras the same way. Every module a user's code calls into
imports this one, so the rule is in place before any user function traces.
"""


def _exclude_from_autograph() -> None:
    try:
        from tensorflow.python.autograph.core import config as ag_config
    except ImportError:  # pragma: no cover - layout of a future TensorFlow
        return
    rule = ag_config.DoNotConvert("smp_tf")
    if not any(getattr(r, "_prefix", None) == "smp_tf" for r in ag_config.CONVERSION_RULES):
        ag_config.CONVERSION_RULES = (rule,) + tuple(ag_config.CONVERSION_RULES)


_exclude_from_autograph()
