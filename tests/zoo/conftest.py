"""Prints the zoo's worst relative errors at the end of a test run.

Each zoo test records its worst error as a property of its report; reports
reach this hook in the main process also when the tests run in workers
(pytest-xdist).
"""

import re

_RESULTS = {}


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for key, value in report.user_properties:
        if key == "zoo_worst_error":
            m = re.search(r"\[(.+)-P(\d+)-(\w+)\]$", report.nodeid)
            if m:
                _RESULTS[(m.group(1), int(m.group(2)), m.group(3))] = value


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    configs = sorted({(p, s) for _, p, s in _RESULTS})
    names = list(dict.fromkeys(n for n, _, _ in _RESULTS))
    terminalreporter.section("zoo: worst relative error (loss, gradients, state) against the single-device loop")
    terminalreporter.write_line(f"{'model':<26}" + "".join(f"{f'P={p} {s}':>16}" for p, s in configs))
    for n in names:
        cells = "".join(
            f"{_RESULTS[(n, p, s)]:>16.2e}" if (n, p, s) in _RESULTS else f"{'-':>16}" for p, s in configs
        )
        terminalreporter.write_line(f"{n:<26}{cells}")
