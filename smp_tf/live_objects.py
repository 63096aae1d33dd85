"""A registry of the objects a variable move must re-point.

When `smp_tf.placement` moves a variable to its partition's device, the
concrete functions and function graphs that captured its old handle are
re-pointed, and the optimizer slots of the variable move with it. This
module finds those objects: every concrete function, function graph and
Keras optimizer alive in the process.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from typing import Any, Dict, List, Tuple

__all__ = ["install_object_registry", "live_objects"]

# Concrete functions, function graphs and Keras optimizers created since
# `install_object_registry` (by kind). "complete" once they hold every live
# object of their kind that may have captured a variable handle.
_REGISTERED: Dict[str, "weakref.WeakSet[Any]"] = {
    "functions": weakref.WeakSet(), "graphs": weakref.WeakSet(), "optimizers": weakref.WeakSet(),
}
_REGISTRY = {"installed": False, "complete": False}
# Objects may be created on other threads while a move lists them.
_LOCK = threading.RLock()


def _registry_kinds() -> List[Tuple[str, type]]:
    from tensorflow.python.eager.polymorphic_function.concrete_function import ConcreteFunction
    from tensorflow.python.framework.func_graph import FuncGraph

    kinds: List[Tuple[str, type]] = [("functions", ConcreteFunction), ("graphs", FuncGraph)]
    try:
        import keras

        kinds.append(("optimizers", keras.optimizers.Optimizer))
    except ImportError:  # pragma: no cover - Keras is a dependency
        pass
    return kinds


def install_object_registry() -> None:
    """Registers every concrete function, function graph and Keras optimizer
    created from now on (once per process; `smp.init` calls it).

    A variable move re-points what captured the old handle (see the module
    doc). Finding those objects by a scan of the whole heap costs a tenth of
    a second in a process with TensorFlow and Keras loaded, on every first
    call; the registry costs a weak reference per object. Objects created
    before it was installed cannot hold a handle if TensorFlow had not yet
    started its runtime (no variable existed); otherwise the first lookup
    scans the heap once and registers them.
    """
    if _REGISTRY["installed"]:
        return
    from tensorflow.python.eager import context

    for kind, cls in _registry_kinds():
        if not getattr(cls.__init__, "_smp_tf", False):
            cls.__init__ = _registering_init(cls.__init__, _REGISTERED[kind])
    _REGISTRY["installed"] = True
    _REGISTRY["complete"] = not getattr(context.context(), "_initialized", True)


def _registering_init(original: Any, registered: "weakref.WeakSet[Any]") -> Any:
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with _LOCK:
            registered.add(self)

    __init__.__wrapped__ = original
    __init__._smp_tf = True
    return __init__


def live_objects() -> Dict[str, List[Any]]:
    """Concrete functions, function graphs and Keras optimizers alive, by
    kind ("functions", "graphs", "optimizers")."""
    install_object_registry()
    if _REGISTRY["complete"]:
        with _LOCK:
            return {kind: list(objects) for kind, objects in _REGISTERED.items()}
    found = _scan_live_objects()
    with _LOCK:
        for kind, objects in found.items():
            _REGISTERED[kind].update(objects)
        _REGISTRY["complete"] = True
    return found


def _scan_live_objects() -> Dict[str, List[Any]]:
    """`live_objects` by a scan of every object the garbage collector tracks."""
    kinds = _registry_kinds()
    found: Dict[str, List[Any]] = {k: [] for k, _ in kinds}
    # A process with TensorFlow and Keras loaded holds hundreds of thousands
    # of objects: the exact type of each is looked up in the set of the
    # classes and their subclasses, and the filtering runs in C (a Python
    # loop with isinstance took a quarter of a second).
    kind_of_type = {t: k for k, c in kinds for t in _subclasses(c)}
    objects = gc.get_objects()
    for o in itertools.compress(objects, map(kind_of_type.__contains__, map(type, objects))):
        found[kind_of_type[type(o)]].append(o)
    return found


def _subclasses(cls: type) -> List[type]:
    """`cls` and all its subclasses, defined so far."""
    out, todo = [cls], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out
