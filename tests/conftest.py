"""pytest's hooks for the suite. No path setup: `tests` is a package and pytest puts the repository
root (the folder above it) on sys.path, so tests and workers import `tests.helpers`.

The `slow` marker (registered in pyproject.toml, with --strict-markers) keeps the inner loop,
`python -m pytest -m "not slow"`, short. After a run this names each test outside the marker that
took more than SLOW_S (its setup, which runs its module's fixtures, included), so that a test which
belongs under the marker shows the first time the inner loop runs it."""

from __future__ import annotations

SLOW_S = 5.0
_seconds: dict[str, float] = {}
# The files whose module fixtures run longest (a torchrun of many scenarios, a real run beside the
# planner's): first, so that neither of ./scripts/test.sh's two workers is left alone with one at the end.
LONGEST_FIRST = ("test_parity.py", "test_estimate.py", "test_hsdp.py")


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


def pytest_runtest_logreport(report) -> None:
    if "slow" not in report.keywords:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    over = sorted(((s, nodeid) for nodeid, s in _seconds.items() if s > SLOW_S), reverse=True)
    if over:
        terminalreporter.section(f"not marked slow, over {SLOW_S:.0f} s")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
