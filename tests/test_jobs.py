"""The cache of jobs that several multi-process tests read (tests/jobs.py)."""

import pytest

from tests import jobs


def test_a_job_starts_once_and_its_failure_fails_every_reader():
    calls = []

    def start():
        calls.append(1)
        return len(calls)

    assert jobs.once("test_jobs/ok", start) == 1
    assert jobs.once("test_jobs/ok", start) == 1
    assert calls == [1]

    def fail():
        raise AssertionError("exit codes [1, 0]")

    with pytest.raises(AssertionError, match=r"exit codes \[1, 0\]"):
        jobs.once("test_jobs/failed", fail)
    with pytest.raises(AssertionError, match=r"failed in an earlier test: exit codes \[1, 0\]"):
        jobs.once("test_jobs/failed", start)
    assert calls == [1]
