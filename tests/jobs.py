"""Jobs of processes that several tests read (one start instead of one per test)."""

from typing import Any, Callable, Dict, Hashable

_RESULTS: Dict[Hashable, Any] = {}


def once(key: Hashable, start: Callable[[], Any]) -> Any:
    """The result of ``start()``, called the first time `key` is asked for
    in this test process. With pytest-xdist the tests that share a job share
    an ``xdist_group``, so they run in one worker. A job that failed fails
    every later test that reads it, naming the first error."""
    if key not in _RESULTS:
        try:
            _RESULTS[key] = start()
        except BaseException as e:
            _RESULTS[key] = e
            raise
    value = _RESULTS[key]
    if isinstance(value, BaseException):
        raise AssertionError(f"the job {key!r} failed in an earlier test: {str(value)[-2000:]}")
    return value
