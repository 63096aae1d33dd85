"""`LayoutMap`: which variables are sharded, by regular expressions on their paths.

As in ``keras.distribution.LayoutMap``, each key is a regular expression
matched with `re.fullmatch` against a variable's ``path``
(``"dense_1/kernel"``) and each value a spec, one entry per dimension:
``"tensor"`` (split over the stage's ``tensor_parallel_degree`` devices) or
None (whole)::

    layout_map = smp.LayoutMap()
    layout_map["mlp/up/kernel"] = (None, "tensor")     # column-parallel
    layout_map["mlp/up/bias"] = ("tensor",)
    layout_map["mlp/down/kernel"] = ("tensor", None)   # row-parallel

Unlike Keras, a key must match: a key that matches no variable raises (a
renamed layer must not silently leave a model whole and out of memory), and
so does a variable that two keys match. This module is plain Python.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import MutableMapping
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from smp_tf.sharding.spec import ShardSpec, check_divisible, parse_spec

__all__ = ["LayoutMap", "resolve_layout"]


class LayoutMap(MutableMapping):
    """Regular expression on a variable's path -> its shard spec.

    A plain dict with the same keys and values is accepted wherever a
    `LayoutMap` is; this class checks each entry when it is set.
    """

    def __init__(self, entries: Optional[Mapping[str, Any]] = None) -> None:
        self._entries: Dict[str, ShardSpec] = {}
        for key, value in (entries or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise ValueError(f"LayoutMap keys are regular expressions (str). Received: {key!r}")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"LayoutMap key {key!r} is not a valid regular expression: {e}") from None
        self._entries[key] = parse_spec(value, what=f"layout of {key!r}")

    def __getitem__(self, key: str) -> ShardSpec:
        return self._entries[key]

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: {v.dims!r}" for k, v in self._entries.items())
        return f"LayoutMap({{{body}}})"


def resolve_layout(
    layout_map: Mapping[str, Any],
    shapes: Mapping[str, Sequence[Optional[int]]],
    t: int,
) -> Dict[str, ShardSpec]:
    """The spec of every variable a layout map names.

    Args:
        layout_map: regular expression -> spec (a `LayoutMap` or a dict).
        shapes: variable path -> shape, for every variable of the model.
        t: the tensor-parallel degree.

    Returns:
        path -> `ShardSpec`, for the variables some key matches.

    Raises:
        ValueError: a key that matches no variable (with the closest paths),
            a variable that two keys match, a spec of another rank than its
            variable, or a split dimension that `t` does not divide.
    """
    entries = layout_map if isinstance(layout_map, LayoutMap) else LayoutMap(layout_map)
    paths = list(shapes)
    out: Dict[str, ShardSpec] = {}
    matched_by: Dict[str, str] = {}
    for key, spec in entries.items():
        pattern = re.compile(key)
        hits = [p for p in paths if pattern.fullmatch(p)]
        if not hits:
            close = difflib.get_close_matches(key, paths, n=5, cutoff=0.3) or paths[:5]
            raise ValueError(
                f"layout_map key {key!r} matches no variable of the model (keys are matched "
                f"with re.fullmatch against variable paths). Closest paths: {close}."
            )
        for path in hits:
            if path in matched_by:
                raise ValueError(
                    f"Variable {path!r} is matched by two layout_map keys, {matched_by[path]!r} and "
                    f"{key!r}; make the expressions disjoint."
                )
            matched_by[path] = key
            shape = tuple(shapes[path])
            spec = parse_spec(spec, rank=len(shape), what=f"layout of variable {path!r} (key {key!r})")
            check_divisible(spec, shape, t, f"Variable {path!r}")
            out[path] = spec
    return out


def paths_and_shapes(variables: Sequence[Any]) -> Dict[str, Tuple[Optional[int], ...]]:
    """path -> shape of Keras variables (their ``path``, else their name)."""
    out: Dict[str, Tuple[Optional[int], ...]] = {}
    for v in variables:
        path = getattr(v, "path", None) or getattr(v, "name", str(v)).split(":")[0]
        out[path] = tuple(None if d is None else int(d) for d in v.shape)
    return out
