"""Inject the faults dtrain must survive, through the real CLI on 2 CPU processes, and print what
happened: faults injected, survived, bad inputs tried, data lost. About two minutes on 2 cores.

    python bench/fault_report.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["-m", "dtrain.sft", "parallel.tp=1", "train.max_steps=6", "train.log_every=1",
        "train.global_batch_size=8", "train.micro_batch_size=4", "checkpoint.every=2"]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def launch(run_dir: Path, *extra: str, env: dict | None = None, launcher: list | None = None):
    command = [*(launcher or TORCHRUN), *ARGS, *extra, f"hydra.run.dir={run_dir}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def finish(proc: subprocess.Popen) -> int:
    proc.communicate(timeout=300)
    return proc.returncode


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="dtrain-faults-"))
    assert finish(launch(root / "reference")) == 0, "the uninterrupted run failed"
    reference = losses(root / "reference")
    rows = []

    def survived(name: str, run_dir: Path) -> None:
        got = losses(run_dir)
        same = sorted(got) == sorted(reference) and all(abs(got[s] - reference[s]) <= 1e-6 * abs(reference[s])
                                                        for s in reference)  # fmt: skip
        rows.append((name, same, 0 if same else len(reference)))

    kill = root / "kill"
    env = {"DTRAIN_TEST_KILL_AT_STEP": "4"}
    finish(launch(kill, env=env, launcher=[*TORCHRUN, "--max-restarts=1"]))
    survived("rank SIGKILLed, torchrun --max-restarts=1", kill)

    term = root / "sigterm"
    proc = launch(term, "checkpoint.every=0", env={"DTRAIN_TEST_STEP_SLEEP_S": "1"})
    while not ((term / "metrics.jsonl").exists() and (term / "metrics.jsonl").read_text().strip()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    finish(proc)
    finish(launch(term))  # the requeued job: resume=auto
    survived("SIGTERM (preemption), then requeue", term)

    crash = root / "crash_in_save"
    finish(launch(crash, env={"DTRAIN_TEST_CRASH_IN_SAVE": "4"}))
    finish(launch(crash))
    survived("SIGKILL during a checkpoint save, then restart", crash)

    full = root / "disk_full"
    failed = finish(launch(full, env={"DTRAIN_TEST_FAIL_SAVE": "4"}))
    finish(launch(full))
    if failed:
        survived("no space left during a save, then restart", full)
    else:
        rows.append(("no space left during a save: the run did not stop", False, 0))

    nan = root / "nan"
    finish(launch(nan, env={"DTRAIN_TEST_NAN_AT_STEP": "3"}))
    skipped = json.loads((nan / "metrics.jsonl").read_text().splitlines()[-1])["skipped_steps"]
    rows.append(("NaN gradients at step 3 (skipped)", skipped == 1, 0))

    pytest = [sys.executable, "-m", "pytest", "-q", "tests/test_fuzz.py", "--hypothesis-show-statistics"]
    fuzz = subprocess.run(pytest, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    tried = sum(int(n) for n in re.findall(r"(\d+) passing", fuzz.stdout))

    print(f"\n{'fault injected':52} {'survived':>9} {'steps lost':>11}")
    for name, ok, lost in rows:
        print(f"{name:52} {'yes' if ok else 'NO':>9} {lost:>11}")
    print(f"\nfaults injected {len(rows)}, survived {sum(ok for _, ok, _ in rows)}, "
          f"data lost {sum(lost for *_, lost in rows)} steps")  # fmt: skip
    print(f"bad inputs (hypothesis): tests/test_fuzz.py {'passed' if fuzz.returncode == 0 else 'FAILED'}, "
          f"{tried} generated records and files, each a clear error or a counted row")  # fmt: skip
    print(f"run folders under {root}")


if __name__ == "__main__":
    main()
