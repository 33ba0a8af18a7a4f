"""pytest's hooks for the suite. No path setup: `tests` is a package and pytest puts the repository
root (the folder above it) on sys.path, so tests and workers import `tests.helpers`.

The `slow` marker (registered in pyproject.toml, with --strict-markers) keeps the inner loop,
`python -m pytest -m "not slow"`, short. After a run this names each test outside the marker that
took more than SLOW_S (its setup, which runs its module's fixtures, included), so that a test which
belongs under the marker shows the first time the inner loop runs it.

DTRAIN_TEST_CAPABILITY and DTRAIN_TEST_THREADS run everything on other CPU kernels and threads, and
after a run the worst margin (gap / allowance, tests/tolerance.py) of each file is printed
(tests/README.md, "Portability")."""

from __future__ import annotations

import os

import pytest

# The CPU kernels' instruction set (torch's dispatch: default, avx2, avx512 on x86), for this process
# and everything the tests start, which inherit the variables: each rounds differently, as another
# CPU does, so the parity tests' tolerances are checked under each (tests/README.md, "Portability").
# Read by torch at its first kernel, so set before any runs. MKL, torch's matmuls on x86, dispatches
# on its own and sums alike on AVX2 and AVX-512 here; `default` also takes its generic code path
# (MKL_CBWR=COMPATIBLE, which sums in another order), so that it stands for a CPU unlike this one.
CAPABILITY = os.environ.get("DTRAIN_TEST_CAPABILITY", "")
if CAPABILITY:
    os.environ["ATEN_CPU_CAPABILITY"] = CAPABILITY
if CAPABILITY == "default":
    os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402  (after ATEN_CPU_CAPABILITY)

from tests import tolerance  # noqa: E402

# One thread per process by default, here and in everything the tests start (they inherit the
# variable): the suite runs two pytest workers and launches of several ranks on a few cores, where a
# second OpenMP thread per process only spins waiting for a core (measured: a tiny model's 48 training
# steps took 7.0 s of CPU with 2 threads under load, 0.37 s with 1). DTRAIN_TEST_THREADS=2 runs two
# intra-op threads everywhere (the parity tests' other reduction splits).
THREADS = int(os.environ.get("DTRAIN_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)
SLOW_S = 5.0
_seconds: dict[str, float] = {}
_margins: dict[str, tuple[float, str]] = {}  # test file: its worst (margin, where)
_file_seconds: dict[str, float] = {}  # test file: its tests' seconds, set-up (its launches) included
# The files that take longest (a launch of many scenarios, a real run beside the planner's, the
# signal tests' waits), longest first as measured on 2 cores (seconds per file of a whole run, the
# summary below): each of ./scripts/test.sh's two workers takes the next file when it is done, so the
# suite ends on short files, neither worker left alone with a long one. pytest-xdist would otherwise
# reorder the files by their number of tests (test.sh passes --no-loadscope-reorder): then
# test_gpu_scripts, one test of 76 s, ran last, alone on one core.
LONGEST_FIRST = (
    "test_lifecycle.py",
    "test_estimate.py",
    "test_readme.py",
    "test_dpo.py",
    "test_moe.py",
    "test_parity.py",
    "test_launch.py",
    "test_perf.py",
    "test_lora.py",
    "test_grpo.py",
    "test_reliability.py",
    "test_checkpoint.py",
    "test_gpu_scripts.py",
    "test_distill.py",
    "test_hsdp.py",  # after test_parity's and test_moe's, whose cached references it reads
    "test_metrics.py",
    "test_qlora.py",
    "test_front_door.py",
    "test_data.py",
    "test_fused_loss.py",
)


def pytest_configure(config) -> None:
    running = torch.backends.cpu.get_cpu_capability()
    if CAPABILITY and running.lower() != CAPABILITY.lower():
        raise pytest.UsageError(f"DTRAIN_TEST_CAPABILITY={CAPABILITY}: torch runs {running} on this CPU")


def pytest_report_header() -> str:
    mkl = f", MKL_CBWR={os.environ['MKL_CBWR']}" if os.environ.get("MKL_CBWR") else ""
    return f"torch CPU kernels: {torch.backends.cpu.get_cpu_capability()}{mkl}, {THREADS} intra-op thread(s)"


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001, ANN201 (pytest's hook)
    """The test's worst margin (tests/tolerance.py), passed on with its report (from an xdist worker
    too: user_properties travel with it)."""
    outcome = yield
    margin = tolerance.MARGINS.pop(item.nodeid, None)
    if margin is not None:
        outcome.get_result().user_properties.append(("margin", margin))


def pytest_runtest_logreport(report) -> None:
    file = report.nodeid.split("::")[0]
    _file_seconds[file] = _file_seconds.get(file, 0.0) + report.duration
    if "slow" not in report.keywords:
        _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    for key, (margin, what) in report.user_properties:
        if key == "margin":
            file = report.nodeid.split("::")[0]
            if margin > _margins.get(file, (-1.0, ""))[0]:
                _margins[file] = (margin, f"{what} ({report.nodeid.split('::', 1)[1]})")


def pytest_terminal_summary(terminalreporter) -> None:
    if _margins:
        terminalreporter.section("worst margin per file: gap / allowance (tests/tolerance.py; fails above 1)")
        terminalreporter.write_line(pytest_report_header())
        for file, (margin, what) in sorted(_margins.items()):
            terminalreporter.write_line(f"{margin:6.3f}  {file}: {what}")
    if len(_file_seconds) > 1:  # where the suite's time goes (LONGEST_FIRST's order comes from it)
        terminalreporter.section("seconds per file (its tests' set-up, calls and teardown)")
        for file, seconds in sorted(_file_seconds.items(), key=lambda item: -item[1])[:15]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {file}")
    over = sorted(((s, nodeid) for nodeid, s in _seconds.items() if s > SLOW_S), reverse=True)
    if over:
        terminalreporter.section(f"not marked slow, over {SLOW_S:.0f} s")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
