"""Prints the zoo's worst relative errors at the end of a test run."""


def pytest_terminal_summary(terminalreporter):
    from tests.zoo.results import RESULTS

    if not RESULTS:
        return
    configs = sorted({(p, s) for _, p, s in RESULTS})
    names = list(dict.fromkeys(n for n, _, _ in RESULTS))
    header = f"{'model':<26}" + "".join(f"{f'P={p} {s}':>16}" for p, s in configs)
    terminalreporter.section("zoo: worst relative error (loss, gradients, state) against the single-device loop")
    terminalreporter.write_line(header)
    for n in names:
        cells = "".join(
            f"{RESULTS[(n, p, s)]:>16.2e}" if (n, p, s) in RESULTS else f"{'-':>16}" for p, s in configs
        )
        terminalreporter.write_line(f"{n:<26}{cells}")
