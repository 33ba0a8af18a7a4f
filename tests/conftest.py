"""pytest's hooks for the suite. No path setup: `tests` is a package and pytest puts the repository
root (the folder above it) on sys.path, so tests and workers import `tests.helpers`.

The `slow` marker (registered in pyproject.toml, with --strict-markers) keeps the inner loop,
`python -m pytest -m "not slow"`, short. After a run this names each test outside the marker that
took more than SLOW_S (its setup, which runs its module's fixtures, included), so that a test which
belongs under the marker shows the first time the inner loop runs it."""

from __future__ import annotations

import os

import torch

# One thread per process, here and in everything the tests start (they inherit the variable): the
# suite runs two pytest workers and launches of several ranks on a few cores, where a second OpenMP
# thread per process only spins waiting for a core (measured: a tiny model's 48 training steps took
# 7.0 s of CPU with 2 threads under load, 0.37 s with 1).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
SLOW_S = 5.0
_seconds: dict[str, float] = {}
# The files that take longest (a launch of many scenarios, a real run beside the planner's, the
# signal tests' waits), longest first as measured on 2 cores: each of ./scripts/test.sh's two workers
# takes the next file when it is done, so the suite ends on short files, neither worker left alone
# with a long one.
LONGEST_FIRST = (
    "test_lora.py",
    "test_parity.py",
    "test_estimate.py",
    "test_lifecycle.py",
    "test_readme.py",
    "test_checkpoint.py",
    "test_perf.py",
    "test_reliability.py",
    "test_hsdp.py",
    "test_moe.py",
    "test_launch.py",
    "test_metrics.py",
    "test_gpu_scripts.py",
    "test_fused_loss.py",
)


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
